"""Arithmetic word problems in GSM8K's format: a question, a worked answer, and a last line `#### N`.

Two- and three-step problems over small integers (products of one-digit numbers, sums and differences below
a few hundred), with one worked step per line. Sums and differences are worked in columns, units first, the way they
are written on paper (carry `+ 1`, borrow `1x - y` then `- 1` in the next column), then assembled after `so`: a
2M-parameter model does not learn two-digit addition in a single token, but it does learn one-digit facts and where
their digits sit. Products and quotients are one-digit table facts. E.g.

    Question: Mia has 23 apples. She buys 4 bags with 6 apples in each. Then she gives 15 apples to Leo.
    How many apples does Mia have now?
    Answer: 4 * 6 = 24
    23 + 24: 3 + 4 = 7, 2 + 2 = 4, so 47
    47 - 15: 7 - 5 = 2, 4 - 1 = 3, so 32
    #### 32

The problem's template and numbers form its key; train and test keys never overlap (`mla_quant.tasks.split`).
The prompt is lm-eval's gsm8k `doc_to_text` ("Question: {question}\nAnswer:") and the answer follows a space.

    problems = test_set(n=100, seed=1234)          # [{"question": ..., "answer": "...\n#### 32"}]
    prompt, answer = train_example(random.Random(0))
"""

from __future__ import annotations

import random
from collections.abc import Callable

from mla_quant.tasks.split import HELD_OUT, check_split, in_split

NAMES = "Mia Leo Ava Sam Zoe Max Ivy Ben Amy Tom Eva Dan Lily Noah Emma Jack Ruby Owen".split()
SHE = {"Mia", "Ava", "Zoe", "Ivy", "Amy", "Eva", "Lily", "Emma", "Ruby"}
ITEMS = "apples pens stickers cookies marbles books shells cards coins stamps".split()
CONTAINERS = "bags boxes packs jars".split()


def add_step(x: int, y: int) -> str:
    """`x + y` worked in columns, units first: "46 + 35: 6 + 5 = 11, 4 + 3 + 1 = 8, so 81"."""
    xs, ys = str(x)[::-1], str(y)[::-1]
    columns, digits, carry = [], [], 0
    n = max(len(xs), len(ys))
    for i in range(n):
        dx, dy = int(xs[i]) if i < len(xs) else 0, int(ys[i]) if i < len(ys) else 0
        s = dx + dy + carry
        columns.append(f"{dx} + {dy}" + (" + 1" if carry else "") + f" = {s}")
        digits.append(str(s) if i == n - 1 else str(s % 10))
        carry = s // 10
    assert int("".join(reversed(digits))) == x + y
    return f"{x} + {y}: " + ", ".join(columns) + f", so {x + y}"


def sub_step(x: int, y: int) -> str:
    """`x - y` (x >= y) worked in columns, units first: "72 - 36: 12 - 6 = 6, 7 - 3 - 1 = 3, so 36"."""
    if y > x:
        raise ValueError(f"sub_step({x}, {y}): the result would be negative")
    xs, ys = str(x)[::-1], str(y)[::-1]
    columns, borrow = [], 0
    for i in range(len(xs)):
        dx, dy = int(xs[i]), int(ys[i]) if i < len(ys) else 0
        top = dx + (10 if dx - borrow < dy else 0)
        columns.append(f"{top} - {dy}" + (" - 1" if borrow else "") + f" = {top - dy - borrow}")
        borrow = int(top > dx)
    return f"{x} - {y}: " + ", ".join(columns) + f", so {x - y}"


def _pronoun(name: str) -> str:
    return "She" if name in SHE else "He"


def buy_bags_give(rng: random.Random) -> tuple[str, list[str], int, str]:
    """a + b*c - d (three steps)."""
    name, friend = rng.sample(NAMES, 2)
    item, box = rng.choice(ITEMS), rng.choice(CONTAINERS)
    a, b, c = rng.randint(2, 60), rng.randint(2, 9), rng.randint(2, 9)
    d = rng.randint(1, a + b * c - 1)
    q = (f"{name} has {a} {item}. {_pronoun(name)} buys {b} {box} with {c} {item} in each. "
         f"Then {_pronoun(name).lower()} gives {d} {item} to {friend}. How many {item} does {name} have now?")
    steps = [f"{b} * {c} = {b * c}", add_step(a, b * c), sub_step(a + b * c, d)]
    return q, steps, a + b * c - d, f"bbg:{a}:{b}:{c}:{d}"


def get_then_give(rng: random.Random) -> tuple[str, list[str], int, str]:
    """a + b - c (two steps)."""
    name, friend = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    a, b = rng.randint(5, 99), rng.randint(5, 99)
    c = rng.randint(1, a + b - 1)
    q = (f"{name} has {a} {item}. {friend} gives {'her' if name in SHE else 'him'} "
         f"{b} more {item}. Then {name} loses {c} {item}. How many {item} does {name} have left?")
    steps = [add_step(a, b), sub_step(a + b, c)]
    return q, steps, a + b - c, f"gtg:{a}:{b}:{c}"


def daily_plus(rng: random.Random) -> tuple[str, list[str], int, str]:
    """a*b + c (two steps)."""
    name = rng.choice(NAMES)
    item = rng.choice(ITEMS)
    a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 99)
    q = (f"{name} collects {a} {item} every day for {b} days. {_pronoun(name)} already had {c} {item}. "
         f"How many {item} does {name} have in total?")
    steps = [f"{a} * {b} = {a * b}", add_step(a * b, c)]
    return q, steps, a * b + c, f"dp:{a}:{b}:{c}"


def share_equally(rng: random.Random) -> tuple[str, list[str], int, str]:
    """(b*c - d) / e with an exact division (three steps)."""
    name = rng.choice(NAMES)
    item, box = rng.choice(ITEMS), rng.choice(CONTAINERS)
    e, share = rng.randint(2, 5), rng.randint(2, 12)
    b, c = rng.randint(2, 9), rng.randint(2, 9)
    total = b * c
    d = total - e * share
    if d < 0:
        b, c, d = e, share, 0  # fall back to a two-step-free layout: total exactly e*share
        total = b * c
    q = (f"{name} has {b} {box} with {c} {item} in each. {_pronoun(name)} keeps {d} {item} and shares the rest "
         f"equally among {e} friends. How many {item} does each friend get?")
    steps = [f"{b} * {c} = {total}", sub_step(total, d), f"{total - d} / {e} = {(total - d) // e}"]
    return q, steps, (total - d) // e, f"se:{b}:{c}:{d}:{e}"


TEMPLATES: list[Callable[[random.Random], tuple[str, list[str], int, str]]] = [
    buy_bags_give, get_then_give, daily_plus, share_equally,
]


def make_problem(rng: random.Random, split: str = "train") -> dict:
    """One GSM8K-format problem of `split`: {"question", "answer", "prompt", "completion", "key"}."""
    check_split(split)
    for _ in range(10_000):
        question, steps, result, key = rng.choice(TEMPLATES)(rng)
        if in_split("arith:" + key, split):
            answer = "\n".join(steps) + f"\n#### {result}"
            return {"question": question, "answer": answer, "key": key,
                    "prompt": f"Question: {question}\nAnswer:", "completion": " " + answer}
    raise RuntimeError(f"no {split} arithmetic problem found")


def test_set(n: int, seed: int, split: str = "test") -> list[dict]:
    """`n` held-out problems of `split` (test or dev) with distinct keys, deterministic in (n, seed, split)."""
    check_split(split, HELD_OUT)
    rng, seen, out = random.Random(f"arith-{split}:{seed}"), set(), []
    while len(out) < n:
        p = make_problem(rng, split)
        if p["key"] not in seen:
            seen.add(p["key"])
            out.append(p)
    return out


def train_example(rng: random.Random) -> tuple[str, str]:
    p = make_problem(rng, "train")
    return p["prompt"], p["completion"]
