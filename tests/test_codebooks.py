"""quantizer=lloyd through the preparation step: a codebook per cache layer and path fitted on the (transformed) toy's
own cache latents over the calibration batch, stored with its provenance, reused, counted in the cache's bytes; the
calibration objectives see the same quantizer; settings it cannot take are refused before any weight is read."""

import json
from pathlib import Path

import pytest
import torch

from conftest import compose
from mla_quant.calibration.codebooks import capture_latents
from mla_quant.calibration.objectives import ste_quantizer
from mla_quant.models.absorbed import absorbed_view, cache_kwargs
from mla_quant.prepare import model_dims, prepare_model, validate
from mla_quant.quant.formats import CacheSpec, PathFormat, cache_bytes_per_token
from mla_quant.quant.quantizers import fake_quantize, fit_levels

LLOYD = ["quant=int2_joint", "quant.content.quantizer=lloyd", "quant.rope.quantizer=lloyd", "calib.samples=8",
         "calib.seq_len=192"]


def test_codebooks_are_fitted_per_layer_stored_and_reused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the codebooks are stored under outputs/calibration of the working directory
    prep = prepare_model(compose(LLOYD))
    m, fmt = prep.metrics(), prep.fmt
    assert isinstance(fmt, CacheSpec) and len(fmt) == 4 and m["cache/codebooks_reused"] == 0
    books = [(f.content.levels, f.rope.levels) for f in fmt.layers]
    assert all(c is not None and r is not None for c, r in books) and len(set(books)) == 4  # each layer its own
    for i in range(4):
        for p in ("content", "rope"):
            assert m[f"cache/layer{i}/{p}/nmse_lloyd"] < 0.8 * m[f"cache/layer{i}/{p}/nmse_rtn"]
            assert m[f"cache/layer{i}/{p}/nmse_lloyd"] <= m[f"cache/layer{i}/{p}/nmse_clip"] * (1 + 1e-6)
    stored = json.loads(Path(m["cache/codebooks"]).read_text())
    assert Path(m["cache/codebooks"]).parent == Path("outputs/calibration")
    assert stored["identity"]["weights"] and stored["identity"]["calib"]["samples"] == 8
    assert stored["provenance"]["config_sha256"] == stored["config_sha256"]  # the artifact store's provenance
    # layer 2's content levels are fit_levels on that layer's latents over the calibration batch
    from mla_quant.calibration.data import calibration_ids, resolve_source

    cfg = compose(LLOYD)
    ids = calibration_ids(cfg.calib, resolve_source(cfg.calib, cfg.model._target_), prep.tokenizer,
                          prep.model.config.vocab_size)
    with absorbed_view(prep.model) as view:
        x = capture_latents(view, ids, [(2, "content")], {"content": 96, "rope": 16})[2, "content"]
    assert torch.equal(torch.tensor(books[2][0]), fit_levels(x, 2, 32))
    # the cache it builds reads those codebooks and counts their bytes (once per layer)
    cache = prep.new_cache()
    with torch.no_grad():
        logits = prep.model(ids[:2], use_cache=True, **cache_kwargs(cache)).logits
    assert bool(torch.isfinite(logits).all())
    per_layer = [cache_bytes_per_token(f, 96, 16, 192, batch=2, act_bytes=4) * 2 * 192 for f in fmt.layers]
    assert cache.nbytes() == sum(per_layer) and m["cache/codebook_bytes_per_layer"] == 2 * 4 * 4
    # reused as stored; another calibration batch fits anew
    again = prepare_model(compose(LLOYD))
    assert again.metrics()["cache/codebooks_reused"] == 1 and again.fmt == fmt
    other = prepare_model(compose([*LLOYD, "calib.samples=4"]))
    assert other.metrics()["cache/codebooks_reused"] == 0 and other.fmt != fmt


def test_calibration_objectives_see_the_lloyd_quantizer():
    """The objectives' quantizer of a lloyd path is the cache's (levels fitted on the first latents it quantizes:
    one layer's), with straight-through gradients."""
    fmt = PathFormat.from_cfg({"format": "int", "bits": 2, "group_size": 16, "quantizer": "lloyd"})
    quantize = ste_quantizer(fmt, 64)
    x = (torch.randn(40, 64) ** 3).requires_grad_(True)
    out = quantize(x)
    # (the straight-through sum a + (exact - a) rounds in float32)
    torch.testing.assert_close(out.detach(), fake_quantize(x.detach(), 2, 16, quantizer="lloyd"), rtol=0, atol=1e-5)
    out.pow(2).sum().backward()
    assert x.grad is not None and float(x.grad.abs().sum()) > 0
    levels = fit_levels(x.detach(), 2, 16)  # later calls keep the first call's levels
    y = torch.randn(40, 64)
    with torch.no_grad():
        torch.testing.assert_close(quantize(y), fake_quantize(y, 2, 16, quantizer="lloyd", levels=levels), rtol=0,
                                   atol=0)


def test_lloyd_needs_calibration_data_and_an_asymmetric_int_path():
    dims = model_dims(compose([]).model)
    cfg = compose(LLOYD)
    cfg.calib = None
    with pytest.raises(ValueError, match="quantizer=lloyd path: its codebooks are fitted on calibration latents: "
                                         "add calib=<option>"):
        validate(cfg, dims)
    with pytest.raises(ValueError, match="quant.content.quantizer=lloyd places levels inside each group's range: it "
                                         "needs symmetric=false"):
        validate(compose([*LLOYD, "quant.content.symmetric=true"]), dims)
    with pytest.raises(ValueError, match=r"quant.content.quantizer=lloyd fits non-uniform levels at bits \[2, 3, 4\]"):
        validate(compose([*LLOYD, "quant.content.bits=8"]), dims)


def test_export_carries_each_layers_codebooks(tmp_path, monkeypatch):
    """experiment=export: the checkpoint's cache description holds every layer's levels, the stored codebooks'."""
    from mla_quant.stages import export

    monkeypatch.chdir(tmp_path)
    metrics = export.run(compose(["experiment=export", *LLOYD[:3], "calib.samples=4", "calib.seq_len=128"]),
                         tmp_path).metrics
    desc = json.loads((tmp_path / "checkpoint" / "mla_quant_cache.json").read_text())["cache"]
    stored = json.loads(Path(metrics["cache/codebooks"]).read_text())
    assert desc["allocation"] == metrics["cache/codebooks"] and len(desc["codebooks"]) == 4
    assert [[i, p, desc["codebooks"][i][p]] for i in range(4) for p in ("content", "rope")] == stored["levels"]
