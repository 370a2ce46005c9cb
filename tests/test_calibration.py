"""Calibration: captured activations, objectives, fitting, storage with provenance, the stages that use it."""

import json

import pytest
import torch
from conftest import compose, run_cli

from mla_quant.calibration import calibrated_transforms
from mla_quant.calibration.capture import capture_layer
from mla_quant.calibration.data import toy_ids
from mla_quant.calibration.fit import FitOptions, fit_content, fit_rope
from mla_quant.calibration.objectives import content_objective, ste_quantizer
from mla_quant.calibration.store import load_transforms, save_transforms
from mla_quant.prepare import build_model, load_tokenizer
from mla_quant.quant.formats import cache_format, fake_quantizer
from mla_quant.quant.quantizers import fit_levels
from mla_quant.transforms import LayerTransform, TransformSet


@pytest.fixture(scope="module")
def toy():
    cfg = compose(["model=toy_mla"])
    model = build_model(cfg.model, absorbed=False)
    tok = load_tokenizer(cfg.model)
    ids = toy_ids(tok, 8, 128, seed=0)
    return cfg, model, {layer: capture_layer(model, ids, layer) for layer in (0, 3)}


def _formats(cfg, name):
    return cache_format(compose(["model=toy_mla", f"quant={name}"]).quant, 96, 16)


@pytest.mark.parametrize("quant", ["int4_joint", "int2_content_int4_rope"])
def test_objective_ordering_on_a_fixed_seed(toy, quant):
    """Per layer and path: QuantMLA's fitted transform < the best of QuaRot / SmoothQuant, and that best < RTN."""
    cfg, _, caps = toy
    fmt = _formats(cfg, quant)
    opts = FitOptions(steps=40, lr=0.01, eval_every=10, batch=4)
    for layer, cap in caps.items():
        q = ste_quantizer(fmt.content, 96)
        err = {kind: fit_content(cap, kind, "attention_output", q, opts, torch.Generator().manual_seed(layer))[2]["fitted"]
               for kind in ("none", "hadamard", "smooth", "rotation_scaling")}
        assert err["rotation_scaling"] < min(err["hadamard"], err["smooth"]) < err["none"], (layer, err)
        q = ste_quantizer(fmt.rope, 16)
        err = {kind: fit_rope(cap, kind, "positional_qk", q, opts)[2]["fitted"]
               for kind in ("none", "pair_scale", "pairwise")}
        # QuaRot leaves the RoPE key alone (kind none), SmoothQuant balances pairs (pair_scale)
        assert err["pairwise"] < min(err["none"], err["pair_scale"]), (layer, err)


def test_capture_matches_the_model(toy):
    """The captured pieces reproduce the block's own cached latent and RoPE key."""
    _, model, caps = toy
    cap = caps[0]
    attn = model.model.layers[0].self_attn
    assert cap.x_hat.shape[-1] == attn.kv_lora_rank and cap.k_rope.shape[-1] == attn.qk_rope_head_dim
    # rms(x_hat) == 1 up to the norm's epsilon, and gamma * x_hat is what kv_a_layernorm returns
    torch.testing.assert_close(cap.x_hat.pow(2).mean(-1), torch.ones_like(cap.x_hat[..., 0]), atol=1e-3, rtol=0)
    assert cap.q_latent.shape[:3] == (8, attn.num_heads, 128)


def test_ste_quantizer_is_exact_forward_and_has_gradients():
    fmt = cache_format(compose(["model=toy_mla", "quant=int2_content_int4_rope"]).quant, 96, 16)
    x = torch.randn(3, 40, 96, requires_grad=True)
    q = ste_quantizer(fmt.content, 96)
    y = q(x)
    assert torch.equal(y.detach(), fake_quantizer(fmt.content, 96)(x.detach()))
    with torch.no_grad():  # an evaluation reads the cache's own values
        assert torch.equal(q(x), fake_quantizer(fmt.content, 96)(x))
    y.pow(2).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


@pytest.mark.parametrize("quantizer", ["clip", "lloyd"])
def test_searched_quantizers_pass_gradients_inside_the_grid_they_chose(quantizer):
    """clip / lloyd: the forward pass is the cache's values; the gradient is straight through exactly where a
    value lies inside the grid its group's search chose (first to last level), zero where that grid clips it (so
    the fit sees the quantizer it is fitted for, not RTN's min/max grid)."""
    from mla_quant.quant.quantizers import group_dequantize, group_quantize

    fmt = cache_format(compose(["model=toy_mla", "quant=int2_joint", f"quant.content.quantizer={quantizer}"]).quant,
                       96, 16).content
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 40, 96, generator=g) ** 3).requires_grad_(True)  # heavy tails: clipped groups
    q = ste_quantizer(fmt, 96)
    y = q(x)
    assert torch.equal(y.detach(), fake_quantizer(fmt, 96)(x.detach()))
    y.sum().backward()
    levels = fit_levels(x.detach(), 2, fmt.group_size, fmt.scale_dtype) if quantizer == "lloyd" else None
    codes, scales, zeros = group_quantize(x.detach(), 2, fmt.group_size, False, fmt.scale_dtype, quantizer, levels)
    lowest = group_dequantize(torch.zeros_like(codes), scales, zeros, 2, torch.float32, levels)
    highest = group_dequantize(torch.full_like(codes, 3), scales, zeros, 2, torch.float32, levels)
    inside = ((x.detach() >= lowest) & (x.detach() <= highest)).float()
    assert int((x.grad != inside).sum()) <= 2, "gradient differs from the grid's inside beyond boundary rounding"
    assert 0 < int(inside.sum()) < inside.numel()  # some values inside, some clipped


def test_fitted_rotation_stays_orthogonal_and_scale_positive(toy):
    cfg, _, caps = toy
    fmt = _formats(cfg, "int2_content_int4_rope")
    r, s, info = fit_content(caps[3], "rotation_scaling", "attention_output", ste_quantizer(fmt.content, 96),
                             FitOptions(steps=20, eval_every=5, batch=4), torch.Generator().manual_seed(0))
    torch.testing.assert_close(r.double() @ r.double().T, torch.eye(96, dtype=torch.float64), atol=1e-4, rtol=0)
    assert bool((s > 0).all()) and info["fitted"] <= info["none"]
    r2, s2, info2 = fit_content(caps[3], "rotation", "attention_output", ste_quantizer(fmt.content, 96),
                                FitOptions(steps=10, eval_every=5, batch=4), torch.Generator().manual_seed(0))
    assert s2 is None and info2["fitted"] <= info2["none"]  # the ablation fits the rotation alone
    with pytest.raises(ValueError, match="objective.content.kind='kl'"):
        content_objective("kl", caps[3], r, s, ste_quantizer(fmt.content, 96))


def test_a_new_kind_is_one_registered_class(toy):
    """transform.<path>.kind comes from the kinds registry: one class adds a kind that the option checks accept, the
    fit starts from (and keeps the best of) its candidates and the invariance sampler draws from; unknown kinds are
    refused with the registered names."""
    from mla_quant.calibration import check_transform, fitted_paths, needs_data
    from mla_quant.transforms import KINDS, TransformKind, register, sample_layer_transform

    cfg, _, caps = toy
    fmt = _formats(cfg, "int2_joint")

    class HalfHadamard(TransformKind):  # a made-up baseline: the Hadamard start, or the Hadamard with a balanced scale
        path, name, data_free = "content", "test_half_hadamard", False

        def starts(self, ctx):
            return [(ctx.hadamard, None), (ctx.hadamard, ctx.balanced(ctx.hadamard))]

        def sample(self, d, generator, log_normal):
            return None, log_normal(d)

    register(HalfHadamard)
    try:
        spec = {"name": "t", "content": {"kind": "test_half_hadamard"}, "rope": {"kind": "none"}, "fit": {"format": "auto"}}
        check_transform(spec)
        assert needs_data(spec) and fitted_paths(spec) == []  # read from the registry, the new kind included
        q = ste_quantizer(fmt.content, 96)
        opts = FitOptions(steps=1)
        r, s, err = fit_content(caps[3], "test_half_hadamard", "attention_output", q, opts, torch.Generator().manual_seed(0))
        _, _, had = fit_content(caps[3], "hadamard", "attention_output", q, opts, torch.Generator().manual_seed(0))
        assert r is not None and err["fitted"] <= had["fitted"] + 1e-7, (err, had)  # the Hadamard start is a candidate
        lt = sample_layer_transform("test_half_hadamard", "none", 96, 16, torch.Generator().manual_seed(0))
        assert lt.rotation is None and lt.scale.shape == (96,) and bool((lt.scale > 0).all())
    finally:
        del KINDS["content"]["test_half_hadamard"]
    with pytest.raises(ValueError, match=r"transform.content.kind='test_half_hadamard'; allowed: \['none', 'hadamard'"):
        check_transform({"name": "t", "content": {"kind": "test_half_hadamard"}, "rope": {"kind": "none"}})


def test_nan_in_captured_activations_names_the_layer():
    model = build_model(compose(["model=tiny_deepseek_v3"]).model, absorbed=False)
    with torch.no_grad():
        model.model.layers[1].self_attn.kv_a_proj_with_mqa.weight[0, 0] = float("nan")
    ids = torch.randint(3, 100, (2, 16))
    capture_layer(model, ids, 0)  # layer 0 is fine
    with pytest.raises(ValueError, match=r"layer 1: x_hat holds \d+ NaN/inf"):
        capture_layer(model, ids, 1)


def test_store_roundtrip_reuse_and_integrity(tmp_path):
    tset = TransformSet([LayerTransform(rotation=torch.eye(4, dtype=torch.float64)), LayerTransform()])
    path = tmp_path / "k.safetensors"
    save_transforms(path, tset, {"config_sha256": "abc", "seed": 0})
    back = load_transforms(path, 2, "abc")
    assert torch.equal(back.layers[0].rotation, tset.layers[0].rotation) and back.layers[1].identity
    assert back.meta["seed"] == "0" and len(back.meta["tensors_sha256"]) == 64
    assert load_transforms(path, 2, "other config") is None
    path.write_bytes(path.read_bytes()[:-3])  # a truncated file is recalibrated, not trusted
    assert load_transforms(path, 2, "abc") is None


def test_prepare_reuses_a_stored_calibration(tmp_path):
    over = ["model=tiny_minicpm3", "quant=int4_joint", "transform=quantmla", "calib.samples=4", "calib.seq_len=32",
            "transform.fit.steps=3", f"transform.fit.cache_dir={tmp_path}"]
    cfg = compose(over)
    model = build_model(cfg.model, absorbed=False)
    tset, metrics, report = calibrated_transforms(model, cfg, None, None)
    assert metrics["calib/reused"] == 0 and metrics["calib/format"] == "int4_joint" and len(report) == 2 * 2
    meta = json.loads(json.dumps(tset.meta))
    assert meta["data_source"] == "random" and len(meta["data_sha256"]) == 64
    assert {"config_sha256", "created", "host", "torch", "transformers"} <= set(meta)  # the artifact store's provenance
    again, metrics2, _ = calibrated_transforms(build_model(cfg.model, absorbed=False), cfg, None, None)
    assert metrics2["calib/reused"] == 1
    _, metrics_report, rows = calibrated_transforms(build_model(cfg.model, absorbed=False), cfg, None, None,
                                                    report=True)  # experiment=calibrate finds the same fit
    assert metrics_report["calib/reused"] == 1 and len(rows) == len(report)
    for a, b in zip(tset.layers, again.layers):
        assert torch.equal(a.rotation, b.rotation) and torch.equal(a.angle, b.angle)
    cfg2 = compose(over + ["calib.seed=1"])  # other calibration data: a new fit
    _, metrics3, _ = calibrated_transforms(build_model(cfg2.model, absorbed=False), cfg2, None, None)
    assert metrics3["calib/reused"] == 0 and metrics3["calib/file"] != metrics["calib/file"]


def _run(*args):
    return run_cli(*args, "logger=none")


@pytest.mark.parametrize("model, transform", [("tiny_minicpm3", "quantmla"), ("toy_mla", "smoothquant")])
def test_export_round_trip(tmp_path, model, transform):
    res = _run("experiment=export", f"model={model}", f"transform={transform}", "quant=int4_joint",
               "calib.samples=4", "calib.seq_len=32", f"hydra.run.dir={tmp_path}/run",
               f"transform.fit.cache_dir={tmp_path}/calib",
               *(["transform.fit.steps=3"] if transform == "quantmla" else []))
    assert res.returncode == 0, res.stderr[-3000:]
    record = json.loads((tmp_path / "run" / "record.json").read_text())
    assert record["metrics"]["export/logits_rel_err"] <= 1e-5
    desc = json.loads((tmp_path / "run" / "checkpoint" / "mla_quant_cache.json").read_text())
    assert desc["cache"]["format"] == "int4_joint" and desc["transform"]["name"] == transform
    assert (tmp_path / "run" / "checkpoint" / "config.json").is_file()


def test_idle_objective_and_calib_settings_are_refused():
    from mla_quant.runner import refuse_idle_calibration

    res = _run("experiment=evaluate", "transform=quarot", "objective=cache_mse", "eval.limit=1")  # as a user meets it
    assert res.returncode != 0 and "fits nothing, so objective settings would do nothing" in res.stderr
    for overrides, message in (
            (["transform=none", "calib.samples=3"], "reads no calibration data"),
            (["transform=quarot", "transform.fit.format=int2_joint"],
             r"\['transform.fit.format=int2_joint'\]: transform=quarot does not read these transform.fit settings")):
        overrides = ["experiment=evaluate", *overrides, "eval.limit=1"]
        with pytest.raises(ValueError, match=message):
            refuse_idle_calibration(compose(overrides), overrides)


def test_next_token_kl_objective_is_end_to_end():
    """Zero when the path is read back exactly, positive at INT2, and differentiable in the transform."""
    from mla_quant.calibration.objectives import content_objective, rope_objective

    cfg = compose(["model=tiny_deepseek_v3", "quant=int2_joint", "quant.content.group_size=16"])
    model = build_model(cfg.model, absorbed=False).requires_grad_(False)
    ids = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    cap = capture_layer(model, ids, 1)
    d_c, d_r = cap.x_hat.shape[-1], cap.k_rope.shape[-1]
    fmt = cache_format(cfg.quant, d_c, d_r)
    r = torch.eye(d_c, requires_grad=True)
    exact = content_objective("next_token_kl", cap, r, torch.ones(d_c), lambda x: x)
    assert abs(exact.detach().item()) < 1e-6
    lossy = content_objective("next_token_kl", cap, r, torch.ones(d_c), ste_quantizer(fmt.content, d_c))
    lossy.backward()
    assert lossy.detach().item() > 1e-5 and r.grad.abs().sum() > 0
    rope = rope_objective("next_token_kl", cap, torch.zeros(d_r // 2), torch.ones(d_r // 2),
                          ste_quantizer(fmt.rope, d_r))
    assert float(rope) > 1e-6


def test_sensitivity_sees_the_calibrated_model(tmp_path):
    res = _run("experiment=sensitivity", "model=tiny_deepseek_v3", "transform=quantmla", "calib.samples=4",
               "calib.seq_len=32", "transform.fit.steps=2", f"transform.fit.cache_dir={tmp_path}/calib",
               "task.seeds=1", "task.per_layer=false", "task.mechanism=false", "task.rope_pairs=false",
               "task.sweep_nmse=[0.01]", "task.probe.seq_len=32", f"hydra.run.dir={tmp_path}/run")
    assert res.returncode == 0, res.stderr[-3000:]
    metrics = json.loads((tmp_path / "run" / "record.json").read_text())["metrics"]
    # Gaussian injection reads no quant option: the transforms are fitted for int4_joint (transform.fit.format=auto)
    assert metrics["calib/transform"] == "quantmla" and metrics["calib/format"] == "int4_joint"
    assert any(k.startswith("sensitivity/") for k in metrics)
