"""experiment=quality: perplexity and next-token KL of a cache format against the unquantized cache."""

import pytest
from conftest import compose

from mla_quant import runner
from mla_quant.record import load_records


def _quality(tmp_path, monkeypatch, name, overrides):
    run_dir = tmp_path / name
    monkeypatch.setattr(runner, "run_dir_of", lambda cfg: run_dir)
    runner.main(compose(["experiment=quality", "logger=none", "task.data.samples=2", "task.data.seq_len=160",
                           "task.batch_size=2", *overrides]))
    (rec,) = load_records(run_dir)
    return rec["metrics"]


def test_quality_orders_formats_and_is_exact_unquantized(tmp_path, monkeypatch):
    bf16 = _quality(tmp_path, monkeypatch, "bf16", ["quant=bf16"])
    assert bf16["quality/kl"] == 0 and bf16["quality/top1_agree"] == 1 and bf16["quality/ppl_ratio"] == 1
    assert bf16["quality/source"] == "toy" and bf16["quality/tokens"] > 50  # the answers of held-out documents
    low = ["quant.protected.n_sink=0", "quant.protected.recent=0"]
    int4 = _quality(tmp_path, monkeypatch, "int4", ["quant=int4_joint", *low])
    int2 = _quality(tmp_path, monkeypatch, "int2", ["quant=int2_joint", *low])
    assert 0 < int4["quality/kl"] < int2["quality/kl"]
    assert 0 < int4["quality/kl_stderr"] < int4["quality/kl"] and bf16["quality/kl_stderr"] == 0
    assert int4["quality/ppl"] < int2["quality/ppl"] and int2["quality/ppl_ratio"] > 1
    assert int4["quality/ppl_unquantized"] == pytest.approx(bf16["quality/ppl"], rel=1e-6)
    # bytes held over the scored sequences: with no protected region, every token at its quantized bytes
    assert int4["cache/bf16_B_per_token_per_layer"] == pytest.approx(int4["cache/bytes_per_token_per_layer"])
    assert int4["cache/bf16/full_precision"] == 0 and bf16["cache/bf16_B_per_token_per_layer"] == (96 + 16) * 2
    assert int4["cache/token_layers"] == 2 * 160 * 4  # 2 sequences of 160 tokens, 4 cache layers


def test_serving_mode_sees_quantization_only_across_chunks(tmp_path, monkeypatch):
    """Serving mode: a forward attends to its own tokens unquantized, so one whole-sequence forward equals the
    reference, while chunked prefill reads earlier chunks from the quantized cache."""
    base = ["model=tiny_deepseek_v2", "quant=int2_joint", "quant.mode=serving", "quant.protected.recent=0"]
    whole = _quality(tmp_path, monkeypatch, "whole", base)
    chunked = _quality(tmp_path, monkeypatch, "chunked", [*base, "task.chunk=32"])
    assert whole["quality/source"] == "random"
    assert whole["quality/kl"] == pytest.approx(0, abs=1e-9) and chunked["quality/kl"] > 1e-4


def test_bad_quality_settings_are_refused(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="task.chunk=0"):
        _quality(tmp_path, monkeypatch, "c", ["task.chunk=0"])
    with pytest.raises(ValueError, match="task.data.seq_len: 2048 exceeds .*1024"):
        _quality(tmp_path, monkeypatch, "l", ["task.data.seq_len=2048"])


def test_kl_standard_error_clusters_tokens_by_sequence():
    import math

    from mla_quant.stats import clustered_stderr

    # tokens 1, 2, 3 | 4, 6 | 5 in three sequences: sums (6, 10, 5), counts (3, 2, 1), mean 21/6 = 3.5
    resid = [6 - 3.5 * 3, 10 - 3.5 * 2, 5 - 3.5 * 1]
    assert clustered_stderr([6, 10, 5], [3, 2, 1]) == pytest.approx(math.sqrt(3 / 2 * sum(r * r for r in resid)) / 6)
    assert clustered_stderr([6, 4, 2], [3, 2, 1]) == 0  # every sequence at the mean (all tokens 2)
    assert math.isnan(clustered_stderr([21], [6]))  # one sequence: no estimate


def test_paired_kl_pairs_runs_sequence_by_sequence(tmp_path, monkeypatch):
    import pandas as pd

    from analysis import tables
    from analysis.records import load_frame

    low = ["quant=int4_joint", "quant.protected.n_sink=0", "quant.protected.recent=0"]
    rtn = _quality(tmp_path, monkeypatch, "rtn", low)
    quarot = _quality(tmp_path, monkeypatch, "quarot", [*low, "transform=quarot"])
    sums = pd.read_csv(tmp_path / "rtn" / "per_sequence.csv")
    assert len(sums) == 2 and sums["tokens"].sum() == rtn["quality/tokens"]
    assert sums["kl_sum"].sum() / sums["tokens"].sum() == pytest.approx(rtn["quality/kl"])
    t = tables.paired_kl(load_frame([tmp_path]))
    (row,) = t.long.to_dict("records")
    assert row["method"] == "quarot" and row["sequences"] == 2
    assert row["delta"] == pytest.approx(quarot["quality/kl"] - rtn["quality/kl"])
    assert row["paired SE"] > 0 and row["sequences lower"] + row["sequences higher"] <= 2
    assert row["B held"] == pytest.approx(quarot["cache/bf16_B_per_token_per_layer"])  # bytes held beside the KL
    assert row["RTN B held"] == pytest.approx(rtn["cache/bf16_B_per_token_per_layer"]) == row["RTN B quantized"]
    assert set(t.sources) == {str(tmp_path / n / "record.json") for n in ("rtn", "quarot")}


def test_mixed_runs_pair_with_the_uniform_option_at_their_bytes(tmp_path, monkeypatch):
    """analysis's `mixed` table: a quant=mixed run against the uniform option its budget names, same sequences."""
    from analysis import tables
    from analysis.records import load_frame

    low = ["quant.protected.n_sink=0", "quant.protected.recent=0"]
    uniform = _quality(tmp_path, monkeypatch, "uniform", ["quant=int2_joint", *low])
    mixed = _quality(tmp_path, monkeypatch, "mixed", ["quant=mixed", "quant.budget=int2_joint", *low,
                                                      f"quant.allocation.cache_dir={tmp_path / 'alloc'}",
                                                      "quant.allocation.sequences=2", "quant.allocation.seeds=1",
                                                      "calib.samples=4", "calib.seq_len=128"])
    assert mixed["alloc/budget"] == uniform["cache/bytes_per_token_per_layer"] == 44
    assert mixed["cache/bytes_per_token_per_layer"] <= 44 and mixed["alloc/reused"] == 0
    grouped = _quality(tmp_path, monkeypatch, "grouped", ["quant=int2_joint", "quant.rope.group_size=4", *low])
    assert grouped["cache/bytes_per_token_per_layer"] == 56  # the budget's option with other settings: not its bytes
    t = tables.mixed(load_frame([tmp_path]))
    (row,) = t.long.to_dict("records")
    assert row["cache"] == "mixed sensitivity @int2_joint" and row["uniform"] == "int2_joint"
    assert row["KL"] == pytest.approx(mixed["quality/kl"]) and row["KL uniform"] == pytest.approx(uniform["quality/kl"])
    assert row["delta"] == pytest.approx(mixed["quality/kl"] - uniform["quality/kl"]) and row["sequences"] == 2
    assert row["B held"] == pytest.approx(mixed["cache/bf16_B_per_token_per_layer"])
    assert row["uniform B held"] == pytest.approx(uniform["cache/bf16_B_per_token_per_layer"])
    assert set(t.sources) == {str(tmp_path / n / "record.json") for n in ("uniform", "mixed")}
