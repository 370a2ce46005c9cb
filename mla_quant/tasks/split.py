"""Held-out separation for the synthetic tasks: a hashed split of the item that identifies an example.

Every generator draws candidates from a seeded `random.Random` and keeps only those whose key (a needle key or
value, a problem's numbers, a function's template and constant) hashes into the requested split. Train and test
therefore never share a key, whatever the seeds, and the test set is a fixed function of its seed.

Three splits by bucket of the key's hash: "test" (bucket 0, held out from training and calibration), "dev" (bucket
1: where sweeps choose a quantizer, a grouping, a budget or a "best" configuration, so the test split only reports
the chosen ones) and "train" (every bucket but 0). Dev and test never share a key. Dev is carved out of the training
buckets so that the shipped toy's training data and every calibration batch stay as they were: a dev key may have
occurred in training text, as any non-test key may; what a dev choice must not see is the test split.

    split_of("quick-otter")          # "train" or "test" (about 1 in 8 keys is "test")
    in_split("quick-otter", "dev")   # about 1 in 8 keys is "dev" (and also "train")
    draw(rng, sample_fn, key_fn, "test")
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from typing import TypeVar

SPLITS = ("train", "dev", "test")
TEST_BUCKETS = 8  # one key in TEST_BUCKETS is held out for test, another for dev
BUCKET = {"test": 0, "dev": 1}  # the bucket of each held-out split

T = TypeVar("T")


def bucket(key: str) -> int:
    """The key's bucket, from the first 8 bytes of its SHA-256 (stable across runs and machines)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % TEST_BUCKETS


def split_of(key: str) -> str:
    """"test" or "train": what the training data and the calibration text draw from (dev keys are "train" here)."""
    return "test" if bucket(key) == BUCKET["test"] else "train"


def in_split(key: str, split: str) -> bool:
    """Whether `key` belongs to `split` (one of SPLITS): test and dev are disjoint buckets; train is every bucket
    but test's."""
    check_split(split)
    if split == "train":
        return bucket(key) != BUCKET["test"]
    return bucket(key) == BUCKET[split]


HELD_OUT = ("dev", "test")  # the splits an evaluation set may be drawn from


def check_split(split: str, allowed: tuple[str, ...] = SPLITS) -> None:
    if split not in allowed:
        raise ValueError(f"split={split!r}; allowed: {allowed}")


def draw(rng: random.Random, sample: Callable[[random.Random], T], key: Callable[[T], str], split: str,
         max_tries: int = 10_000) -> T:
    """Sample until the key of the sample falls in `split`."""
    check_split(split)
    for _ in range(max_tries):
        item = sample(rng)
        if in_split(key(item), split):
            return item
    raise RuntimeError(f"no {split} sample after {max_tries} tries; is the key space too small?")
