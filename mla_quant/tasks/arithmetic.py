"""Arithmetic word problems in GSM8K's format: a question, a worked answer, and a last line `#### N`.

Two- and three-step problems over small integers (products of one-digit numbers, sums and differences below
a few hundred), with one worked step per line, e.g.

    Question: Mia has 23 apples. She buys 4 bags with 6 apples in each bag. Then she gives 15 apples to Leo.
    How many apples does Mia have now?
    Answer: 4 * 6 = 24
    23 + 24 = 47
    47 - 15 = 32
    #### 32

The problem's template and numbers form its key; train and test keys never overlap (`mla_quant.tasks.split`).
The prompt is lm-eval's gsm8k `doc_to_text` ("Question: {question}\nAnswer:") and the answer follows a space.

    problems = test_set(n=100, seed=1234)          # [{"question": ..., "answer": "...\n#### 32"}]
    prompt, answer = train_example(random.Random(0))
"""

from __future__ import annotations

import random
from collections.abc import Callable

from mla_quant.tasks.split import check_split, split_of

NAMES = "Mia Leo Ava Sam Zoe Max Ivy Ben Amy Tom Eva Dan Lily Noah Emma Jack Ruby Owen".split()
SHE = {"Mia", "Ava", "Zoe", "Ivy", "Amy", "Eva", "Lily", "Emma", "Ruby"}
ITEMS = "apples pens stickers cookies marbles books shells cards coins stamps".split()
CONTAINERS = "bags boxes packs jars".split()


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
    steps = [f"{b} * {c} = {b * c}", f"{a} + {b * c} = {a + b * c}", f"{a + b * c} - {d} = {a + b * c - d}"]
    return q, steps, a + b * c - d, f"bbg:{a}:{b}:{c}:{d}"


def get_then_give(rng: random.Random) -> tuple[str, list[str], int, str]:
    """a + b - c (two steps)."""
    name, friend = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    a, b = rng.randint(5, 99), rng.randint(5, 99)
    c = rng.randint(1, a + b - 1)
    q = (f"{name} has {a} {item}. {friend} gives {'her' if name in SHE else 'him'} "
         f"{b} more {item}. Then {name} loses {c} {item}. How many {item} does {name} have left?")
    steps = [f"{a} + {b} = {a + b}", f"{a + b} - {c} = {a + b - c}"]
    return q, steps, a + b - c, f"gtg:{a}:{b}:{c}"


def daily_plus(rng: random.Random) -> tuple[str, list[str], int, str]:
    """a*b + c (two steps)."""
    name = rng.choice(NAMES)
    item = rng.choice(ITEMS)
    a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 99)
    q = (f"{name} collects {a} {item} every day for {b} days. {_pronoun(name)} already had {c} {item}. "
         f"How many {item} does {name} have in total?")
    steps = [f"{a} * {b} = {a * b}", f"{a * b} + {c} = {a * b + c}"]
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
    steps = [f"{b} * {c} = {total}", f"{total} - {d} = {total - d}", f"{total - d} / {e} = {(total - d) // e}"]
    return q, steps, (total - d) // e, f"se:{b}:{c}:{d}:{e}"


TEMPLATES: list[Callable[[random.Random], tuple[str, list[str], int, str]]] = [
    buy_bags_give, get_then_give, daily_plus, share_equally,
]


def make_problem(rng: random.Random, split: str = "train") -> dict:
    """One GSM8K-format problem of `split`: {"question", "answer", "prompt", "completion", "key"}."""
    check_split(split)
    for _ in range(10_000):
        question, steps, result, key = rng.choice(TEMPLATES)(rng)
        if split_of("arith:" + key) == split:
            answer = "\n".join(steps) + f"\n#### {result}"
            return {"question": question, "answer": answer, "key": key,
                    "prompt": f"Question: {question}\nAnswer:", "completion": " " + answer}
    raise RuntimeError(f"no {split} arithmetic problem found")


def test_set(n: int, seed: int) -> list[dict]:
    """`n` held-out problems with distinct keys, deterministic in (n, seed)."""
    rng, seen, out = random.Random(f"arith-test:{seed}"), set(), []
    while len(out) < n:
        p = make_problem(rng, "test")
        if p["key"] not in seen:
            seen.add(p["key"])
            out.append(p)
    return out


def train_example(rng: random.Random) -> tuple[str, str]:
    p = make_problem(rng, "train")
    return p["prompt"], p["completion"]
