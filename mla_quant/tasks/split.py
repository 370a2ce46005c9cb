"""Held-out separation for the synthetic tasks: a hashed split of the item that identifies an example.

Every generator draws candidates from a seeded `random.Random` and keeps only those whose key (a needle key or
value, a problem's numbers, a function's template and constant) hashes into the requested split. Train and test
therefore never share a key, whatever the seeds, and the test set is a fixed function of its seed.

    split_of("quick-otter")          # "train" or "test" (about 1 in 8 keys is "test")
    draw(rng, sample_fn, key_fn, "test")
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from typing import TypeVar

SPLITS = ("train", "test")
TEST_BUCKETS = 8  # one key in TEST_BUCKETS is held out

T = TypeVar("T")


def split_of(key: str) -> str:
    """The split a key belongs to, from the first 8 bytes of its SHA-256 (stable across runs and machines)."""
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    return "test" if h % TEST_BUCKETS == 0 else "train"


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split={split!r}; allowed: {SPLITS}")


def draw(rng: random.Random, sample: Callable[[random.Random], T], key: Callable[[T], str], split: str,
         max_tries: int = 10_000) -> T:
    """Sample until the key of the sample falls in `split`."""
    check_split(split)
    for _ in range(max_tries):
        item = sample(rng)
        if split_of(key(item)) == split:
            return item
    raise RuntimeError(f"no {split} sample after {max_tries} tries; is the key space too small?")
