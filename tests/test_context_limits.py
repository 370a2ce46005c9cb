"""A sequence length beyond the model's positions is refused by name from the config alone, before any weight is
read (calibration, the sensitivity probes, the quality stage's sequences, the evaluation lengths), and the per-layer
profile of a run (profile_layers=true) counts every decoder layer's calls with their seconds and memory."""

import pytest
import torch
from conftest import compose

from mla_quant.eval.harness import ContextTooLong
from mla_quant.prepare import model_dims, validate


def test_calibration_longer_than_the_model_is_refused():
    cfg = compose(["experiment=calibrate", "transform=quantmla", "calib.seq_len=1025"])
    with pytest.raises(ContextTooLong, match=r"calib.seq_len: 1025 exceeds the model's limit of 1024 positions"):
        validate(cfg, model_dims(cfg.model))
    cfg = compose(["experiment=calibrate", "transform=quarot", "calib.seq_len=1025"])
    validate(cfg, model_dims(cfg.model))  # a data-free transform reads no calibration data ...
    with pytest.raises(ContextTooLong, match="calib.seq_len"):  # ... unless the calibrate stage reports on it
        validate(cfg, model_dims(cfg.model), calib_report=True)
    validate(compose(["experiment=calibrate", "transform=quantmla", "calib.seq_len=1024"]), model_dims(cfg.model))


def test_sensitivity_probes_longer_than_the_model_are_refused():
    from mla_quant.stages.sensitivity import validate as validate_study

    with pytest.raises(ContextTooLong, match=r"task.probe.seq_len: 4096 exceeds .* 1024"):
        validate_study(compose(["experiment=sensitivity", "task.probe.seq_len=4096"]))


def test_quality_sequences_longer_than_the_model_are_refused(tmp_path, monkeypatch):
    import mla_quant.stages.quality as quality

    monkeypatch.setattr(quality, "prepare_model", lambda *a, **k: pytest.fail("weights were read"))
    with pytest.raises(ContextTooLong, match=r"task.data.seq_len: 2048 exceeds"):
        quality.run(compose(["experiment=quality", "logger=none", "task.data.seq_len=2048"]), tmp_path)


def test_layer_profile_counts_every_decoder_layer():
    from mla_quant.memory import LayerProfile, PeakMemory
    from mla_quant.prepare import build_model

    model = build_model(compose(["model=tiny_deepseek_v3"]).model)
    ids = torch.randint(0, model.config.vocab_size, (2, 24))
    with PeakMemory("cpu") as mem, LayerProfile(mem) as prof:
        with torch.no_grad():
            model(ids)
            model(ids[:, :8])
    rows = prof.summary()
    assert [r["layer"] for r in rows] == list(range(model.config.num_hidden_layers))
    assert all(r["calls"] == 2 and r["seconds"] > 0 and r["peak_added_gb"] >= 0 for r in rows), rows
    with PeakMemory("cpu") as mem, LayerProfile(mem, enabled=False) as off:
        model(ids)
    assert off.summary() == []
    with PeakMemory("cpu") as mem, LayerProfile(mem) as after:  # the hooks of a finished profile are gone
        pass
    model(ids)
    assert after.summary() == [] and len(prof.summary()) == len(rows) and prof.rows[0]["calls"] == 2


def test_peak_memory_counts_the_bytes_allocated_exactly():
    """On glibc the CPU peak of the bytes allocated sees a short-lived tensor to within a few MB, freed memory the
    allocator keeps included or not (the resident set's noise): the figure the prefill benchmark's growth uses. Another
    thread of the process (a test before this one) may free a little in the window: 1 MiB of slack below."""
    import gc
    import time

    from mla_quant.memory import PeakMemory, allocated_bytes

    if allocated_bytes() is None:
        pytest.skip("the C library has no mallinfo2 (not glibc >= 2.33)")
    size = 200 * 2**20
    gc.collect()
    for _ in range(2):  # the second time the heap may keep freed memory: the count must not change
        with PeakMemory("cpu", interval=1e-4) as mem:
            x = torch.ones(size, dtype=torch.uint8)
            time.sleep(0.05)
            del x
        assert size - 2**20 <= mem.added_allocated_bytes < size + 8 * 2**20, mem.added_allocated_bytes
        assert mem.summary()["peak_added_allocated_gb"] == mem.added_allocated_bytes / 1e9
    start = allocated_bytes()
    y = torch.empty(size, dtype=torch.uint8)
    assert allocated_bytes() - start >= size
    del y
    assert abs(allocated_bytes() - start) < 2**20
