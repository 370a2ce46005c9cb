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


def _check_fact(text: str) -> int:
    """`a op b [op c] = r` is correct arithmetic (integer division); returns r."""
    lhs, rhs = text.split(" = ")
    assert re.fullmatch(r"\d+( [-+*/] \d+)+", lhs), text
    assert eval(lhs.replace("/", "//")) == int(rhs), text
    return int(rhs)


def test_arithmetic_format():
    for p in arithmetic.test_set(60, seed=0):
        lines = p["answer"].split("\n")
        assert 2 <= len(lines) - 1 <= 3, p["answer"]  # two or three worked steps, then #### N
        final = re.fullmatch(r"#### (\d+)", lines[-1])
        assert final, p["answer"]
        results = []
        for step in lines[:-1]:  # every worked step is correct arithmetic, its columns too
            column = re.fullmatch(r"(\d+ [-+] \d+): (.+), so (\d+)", step)
            if column:
                whole, facts, result = column.groups()
                assert _check_fact(f"{whole} = {result}") == int(result)
                for fact in facts.split(", "):
                    _check_fact(fact)
                results.append(int(result))
            else:
                results.append(_check_fact(step))
        assert results[-1] == int(final.group(1))
        assert p["prompt"] == f"Question: {p['question']}\nAnswer:"


@pytest.mark.parametrize("x, y", [(46, 35), (7, 27), (99, 99), (5, 5), (0, 0)])
def test_column_addition(x, y):
    line = arithmetic.add_step(x, y)
    assert line.startswith(f"{x} + {y}: ") and line.endswith(f", so {x + y}")
    facts = line.split(": ", 1)[1].rsplit(", so", 1)[0].split(", ")
    assert len(facts) == max(len(str(x)), len(str(y)))  # one per column
    assert [_check_fact(f) for f in facts]


@pytest.mark.parametrize("x, y", [(72, 36), (104, 97), (119, 15), (100, 1), (198, 197), (5, 5)])
def test_column_subtraction(x, y):
    line = arithmetic.sub_step(x, y)
    assert line.startswith(f"{x} - {y}: ") and line.endswith(f", so {x - y}")
    facts = line.split(": ", 1)[1].rsplit(", so", 1)[0].split(", ")
    assert len(facts) == len(str(x))
    digits = [_check_fact(f) for f in facts]
    assert all(0 <= d <= 9 for d in digits)  # borrowing keeps every column digit in 0..9
    assert int("".join(map(str, reversed(digits)))) == x - y
    with pytest.raises(ValueError, match="negative"):
        arithmetic.sub_step(y, x + 1)


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
    with pytest.raises(ValueError, match="split='validation'"):
        arithmetic.make_problem(random.Random(0), "validation")
