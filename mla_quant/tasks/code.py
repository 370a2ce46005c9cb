"""Tiny code problems in HumanEval's format: one-line Python functions over lists and integers.

Each problem is a dict with HumanEval's fields: task_id, prompt (signature + docstring with one example),
canonical_solution (the body, one line), test (`def check(candidate): assert ...`) and entry_point, e.g.

    def add_to_each(xs: list) -> list:
        \"\"\"Return a list with 3 added to every element of xs.
        >>> add_to_each([1, 5, 2])
        [4, 8, 5]
        \"\"\"
        return [x + 3 for x in xs]

The key of a problem is (template, constant, function name); train and test keys never overlap.

    problems = test_set(n=50, seed=1234)
    prompt, completion = train_example(random.Random(0))
"""

from __future__ import annotations

import random

from mla_quant.tasks.split import HELD_OUT, check_split, in_split

# (names, docstring with {k}, body with {k}, argument kind, constant range)
TEMPLATES = [
    (["add_to_each", "shift_all", "increase_all"], "Return a list with {k} added to every element of xs.",
     "return [x + {k} for x in xs]", "list", (1, 9)),
    (["scale_all", "multiply_each", "times_all"], "Return a list with every element of xs multiplied by {k}.",
     "return [x * {k} for x in xs]", "list", (2, 9)),
    (["keep_greater", "filter_above", "select_big"], "Return the elements of xs that are greater than {k}.",
     "return [x for x in xs if x > {k}]", "list", (1, 9)),
    (["keep_smaller", "filter_below", "select_small"], "Return the elements of xs that are less than {k}.",
     "return [x for x in xs if x < {k}]", "list", (1, 9)),
    (["sum_plus", "total_plus", "add_to_sum"], "Return the sum of xs plus {k}.",
     "return sum(xs) + {k}", "list", (1, 9)),
    (["count_value", "count_equal", "how_many"], "Return the number of elements of xs equal to {k}.",
     "return xs.count({k})", "list", (1, 9)),
    (["max_times", "scaled_max", "largest_times"], "Return the largest element of xs multiplied by {k}.",
     "return max(xs) * {k}", "list", (2, 9)),
    (["min_minus", "smallest_minus", "lower_min"], "Return the smallest element of xs minus {k}.",
     "return min(xs) - {k}", "list", (1, 9)),
    (["first_items", "take_front", "head_of"], "Return the first {k} elements of xs.",
     "return xs[:{k}]", "list", (1, 4)),
    (["drop_front", "skip_items", "tail_after"], "Return xs without its first {k} elements.",
     "return xs[{k}:]", "list", (1, 4)),
    (["times_k", "multiply_by", "scale_number"], "Return n multiplied by {k}.",
     "return n * {k}", "int", (2, 9)),
    (["remainder_of", "mod_by", "leftover"], "Return the remainder of n divided by {k}.",
     "return n % {k}", "int", (2, 9)),
    (["is_multiple", "divisible_by", "check_divides"], "Return True if n is divisible by {k}, else False.",
     "return n % {k} == 0", "int", (2, 9)),
    (["plus_k", "add_number", "increment_by"], "Return n plus {k}.",
     "return n + {k}", "int", (1, 9)),
]


def _call(body: str, arg_name: str, arg):
    scope: dict = {}
    exec(f"def f({arg_name}):\n    {body}\n", scope)  # our own template text only, never model output
    return scope["f"](arg)


def _random_arg(rng: random.Random, kind: str):
    if kind == "list":
        return [rng.randint(0, 9) for _ in range(rng.randint(3, 6))]
    return rng.randint(1, 60)


def make_problem(rng: random.Random, split: str = "train", index: int = 0) -> dict:
    """One HumanEval-format problem of `split` (plus `key`, and `completion` = canonical_solution)."""
    check_split(split)
    for _ in range(10_000):
        t = rng.randrange(len(TEMPLATES))
        names, doc, body, kind, (lo, hi) = TEMPLATES[t]
        k, name = rng.randint(lo, hi), rng.choice(names)
        key = f"code:{t}:{k}:{name}"
        if in_split(key, split):
            break
    else:  # pragma: no cover
        raise RuntimeError(f"no {split} code problem found")
    arg_name, arg_type = ("xs", "list") if kind == "list" else ("n", "int")
    body = body.format(k=k)
    example = _random_arg(rng, kind)
    ret_type = type(_call(body, arg_name, example)).__name__
    prompt = (f"def {name}({arg_name}: {arg_type}) -> {ret_type}:\n"
              f'    """{doc.format(k=k)}\n'
              f"    >>> {name}({example!r})\n"
              f"    {_call(body, arg_name, example)!r}\n"
              f'    """\n')
    cases = [_random_arg(rng, kind) for _ in range(4)]
    test = "def check(candidate):\n" + "".join(
        f"    assert candidate({c!r}) == {_call(body, arg_name, c)!r}\n" for c in cases)
    solution = f"    {body}\n"
    return {"task_id": f"ToyEval/{index}", "prompt": prompt, "canonical_solution": solution, "test": test,
            "entry_point": name, "key": key, "completion": solution}


def test_set(n: int, seed: int, split: str = "test") -> list[dict]:
    """`n` held-out problems of `split` (test or dev), deterministic in (n, seed, split); keys may repeat (the key
    space is small)."""
    check_split(split, HELD_OUT)
    rng = random.Random(f"code-{split}:{seed}")
    return [make_problem(rng, split, i) for i in range(n)]


def train_example(rng: random.Random) -> tuple[str, str]:
    p = make_problem(rng, "train")
    return p["prompt"], p["completion"]
