"""Task generators: formats, determinism from the seed, and train/test separation."""

from __future__ import annotations

import random
import re

import pytest

from mla_quant.tasks import arithmetic, code, niah
from mla_quant.tasks.split import split_of


@pytest.mark.parametrize("variant", sorted(niah.VARIANTS))
def test_niah_format_and_length(variant):
    for length in (800, 1024):  # lengths counted in characters here (the default count_tokens)
        doc = niah.make_doc(random.Random(0), variant, length, "test")
        value = doc["outputs"][0]
        assert doc["length"] <= length - 48, f"{variant}: prompt of {doc['length']} chars exceeds {length} - reserve"
        assert doc["prompt"] == f"{doc['input']} {doc['gen_prefix']}"
        assert f"for {doc['key']} is: {value}." in doc["input"]
        assert doc["answer"] == " " + value
        assert doc["input"].count("One of the special magic") == niah.VARIANTS[variant][2]
        if niah.VARIANTS[variant][1] == "uuid":
            assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", value)
        else:
            assert re.fullmatch(r"\d{7}", value)


def test_niah_multikey_distractors_have_other_keys():
    doc = niah.make_doc(random.Random(3), "multikey_1", 1024, "train")
    keys = re.findall(r"magic numbers for (\S+) is:", doc["input"])
    assert len(keys) == 4 and len(set(keys)) == 4 and doc["key"] in keys


def test_niah_too_short_names_the_length():
    with pytest.raises(ValueError, match="max_length=100"):
        niah.make_doc(random.Random(0), "single_1", 100)


def test_arithmetic_format():
    for p in arithmetic.test_set(30, seed=0):
        lines = p["answer"].split("\n")
        assert 2 <= len(lines) - 1 <= 3, p["answer"]  # two or three worked steps, then #### N
        final = re.fullmatch(r"#### (\d+)", lines[-1])
        assert final, p["answer"]
        for step in lines[:-1]:  # every worked step is correct arithmetic
            a, op, b, _, c = step.split()
            assert eval(f"{a} {op.replace('/', '//')} {b}") == int(c), step
        assert lines[-2].split()[-1] == final.group(1)
        assert p["prompt"] == f"Question: {p['question']}\nAnswer:"


def test_code_format_and_canonical_solution_passes():
    for p in code.test_set(20, seed=0):
        assert p["prompt"].startswith(f"def {p['entry_point']}(") and p["prompt"].endswith('    """\n')
        assert p["test"].startswith("def check(candidate):")
        scope: dict = {}
        exec(p["prompt"] + p["canonical_solution"] + p["test"], scope)
        scope["check"](scope[p["entry_point"]])  # the hidden tests pass on the reference


def test_code_wrong_solution_fails():
    p = code.test_set(1, seed=0)[0]
    scope: dict = {}
    exec(p["prompt"] + "    return None\n" + p["test"], scope)
    with pytest.raises(AssertionError):
        scope["check"](scope[p["entry_point"]])


@pytest.mark.parametrize("make", [
    lambda s: niah.test_set("single_2", [512], 5, s),
    lambda s: arithmetic.test_set(10, s),
    lambda s: code.test_set(10, s),
])
def test_deterministic_from_seed(make):
    assert make(7) == make(7)
    assert make(7) != make(8)


def test_heldout_separation():
    """No test key (needle key or value, arithmetic numbers, code template+constant+name) is ever generated for
    training, and every test example's key hashes into the test split."""
    rng = random.Random(0)
    train_niah = [niah.make_doc(rng, v, 1024, "train") for v in niah.VARIANTS for _ in range(50)]
    test_niah = [d for v in niah.VARIANTS for d in niah.test_set(v, [800, 1024], 10, seed=1)]
    train_keys = {d["key"] for d in train_niah}
    train_values = {d["outputs"][0] for d in train_niah}
    for d in test_niah:
        assert split_of("niah-key:" + d["key"]) == "test" and d["key"] not in train_keys
        assert split_of("niah-value:" + d["outputs"][0]) == "test" and d["outputs"][0] not in train_values
    for d in train_niah:  # the distractor needles of training docs are training needles too
        for key in re.findall(r"for (\S+) is: ", d["input"]):
            assert split_of("niah-key:" + key) == "train"

    train_arith = {arithmetic.make_problem(rng, "train")["key"] for _ in range(2000)}
    test_arith = arithmetic.test_set(100, seed=1)
    assert not train_arith & {p["key"] for p in test_arith}
    assert not {arithmetic.make_problem(rng, "train")["question"] for _ in range(2000)} & {
        p["question"] for p in test_arith}

    train_code = {code.make_problem(rng, "train")["key"] for _ in range(2000)}
    test_code = {p["key"] for p in code.test_set(50, seed=1)}
    assert test_code and not train_code & test_code


def test_bad_split_is_named():
    with pytest.raises(ValueError, match="split='dev'"):
        arithmetic.make_problem(random.Random(0), "dev")
