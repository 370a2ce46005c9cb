"""Fixed-NMSE injection is exact, splits by mechanism and RoPE pair correctly, and the study runs on every family."""

import json

import pytest
import torch
from conftest import compose, options

from mla_quant.prepare import build_model, model_dims
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_quant.models.absorbed import new_cache
from mla_quant.quant.rope import rope_pair
from mla_quant.sensitivity.injection import InjectionSpec, fixed_nmse_noise, injection_factory, nmse
from mla_quant.sensitivity.study import RecordingLatentLayer, capture, output_errors, predicted_score_error
from mla_quant.stages import sensitivity

TINY = [name for name in options("model") if name.startswith("tiny_") and "dims" not in name]


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 40), dim=st.integers(1, 70), target=st.floats(1e-6, 0.99), seed=st.integers(0, 10**6))
def test_fixed_nmse_noise_hits_the_target_exactly(rows, dim, target, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, dim, generator=g, dtype=torch.float64) + 0.1
    eps = fixed_nmse_noise(x, target, torch.randn(rows, dim, generator=g, dtype=torch.float64))
    assert nmse(x + eps, x) == pytest.approx(target, rel=1e-9)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(8, 40), dim=st.integers(8, 70), target=st.floats(1e-4, 0.5), seed=st.integers(0, 10**6),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_fixed_nmse_noise_corrects_for_storage_rounding(rows, dim, target, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, dim, generator=g) + 0.1).to(dtype)
    eps = fixed_nmse_noise(x, target, torch.randn(rows, dim, generator=g))
    # what the dtype's rounding of x + eps allows: float32 is fine-grained; in bfloat16 (8 significant bits) the
    # achievable NMSE moves in steps as large as one element's rounding step, ((2^-7 |x|max)^2 / ||x||^2) / target,
    # a few percent on a small tensor at a small target
    x64 = x.double()
    step = float((2.0 ** -7 * x64.abs().max()) ** 2 / x64.pow(2).sum() / target)
    rel = 1e-5 if dtype == torch.float32 else max(2e-2, step)
    assert nmse(x + eps, x) == pytest.approx(target, rel=rel)


@pytest.mark.parametrize("bad", [0.0, 1.0, -0.1, 1.5])
def test_nmse_target_outside_unit_interval_is_refused(bad):
    with pytest.raises(ValueError, match=r"outside \(0, 1\)"):
        InjectionSpec(path="content", nmse=bad)


def test_bad_target_fails_before_any_model_work(monkeypatch, tmp_path):
    cfg = compose(["model=tiny_deepseek_v3", "experiment=sensitivity", "task.nmse=1.5"])
    monkeypatch.setattr(sensitivity, "prepare_model", lambda *a, **k: pytest.fail("model built before validation"))
    with pytest.raises(ValueError, match="1.5"):
        sensitivity.run(cfg, tmp_path)


def _model(name="tiny_deepseek_v3"):
    return build_model(compose([f"model={name}"]).model)


def _ids(model, t=48):
    return torch.randint(3, model.config.vocab_size, (2, t), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("path", ["content", "rope"])
def test_each_injected_layer_gets_the_exact_cache_nmse(path):
    model = _model()
    spec = InjectionSpec(path=path, nmse=0.01, seed=3)
    capture(model, _ids(model), new_cache(model, injection_factory(spec)))
    assert sorted(spec.achieved) == [0, 1]
    for layer, achieved in spec.achieved.items():
        assert achieved == pytest.approx(0.01, rel=1e-6), f"layer {layer}: {achieved}"


def test_one_layer_injection_leaves_earlier_layers_untouched():
    model = _model()
    ids = _ids(model)
    clean = capture(model, ids, new_cache(model))
    noisy = capture(model, ids, new_cache(model, injection_factory(InjectionSpec(path="rope", nmse=0.01, layers={1}))))
    errors = output_errors(noisy, clean)
    assert errors["attn_output"][0] == 0.0
    assert errors["attn_output"][1] > 1e-6 and errors["logits"] > 1e-8


def test_content_sides_split_the_error():
    """Score-only and value-only errors are each smaller than both together; the remainder (coupling) is small."""
    model = _model()
    ids = _ids(model)
    clean = capture(model, ids, new_cache(model))
    out = {}
    for side in ("score", "value", "both"):
        spec = InjectionSpec(path="content", nmse=0.01, side=side, seed=1)
        out[side] = output_errors(capture(model, ids, new_cache(model, injection_factory(spec))), clean)["attn_output"][0]
    assert 0 < out["score"] < out["both"] and 0 < out["value"] < out["both"], out
    coupling = out["both"] - out["score"] - out["value"]
    assert abs(coupling) < 0.2 * out["both"], out


@pytest.mark.parametrize("name", ["tiny_deepseek_v2", "tiny_deepseek_v3", "tiny_minicpm3"])
def test_cached_rope_pairs_are_frequency_pairs(name):
    """RoPE rotates each pair: cached pair norms are the pre-RoPE ones times one constant (the rope attention factor)."""
    model = _model(name)
    family, attn = model.mla_family, model.mla_family.attention_modules(model)[0]
    h = torch.randn(1, 12, model.config.hidden_size)
    _, k_pre = family.latent(attn, h)
    pos = torch.arange(12)[None]
    pe = model.model.rotary_emb(h, pos)
    q = torch.zeros(1, attn.num_heads, 12, attn.qk_rope_head_dim)
    _, k_post = family.rotate(attn, q, k_pre, pe)
    d_r = k_pre.shape[-1]
    ratios = []
    for i in range(d_r // 2):
        a, b = rope_pair(family.rope_layout(model.config), d_r, i)
        c, d = rope_pair(family.cached_rope_layout(model.config), d_r, i)
        pre = k_pre[..., a] ** 2 + k_pre[..., b] ** 2
        post = k_post[..., c] ** 2 + k_post[..., d] ** 2
        ratios.append(post / pre)
    ratios = torch.stack(ratios)
    torch.testing.assert_close(ratios, torch.full_like(ratios, ratios.mean().item()), rtol=1e-4, atol=0)


def test_pair_injection_touches_only_that_pair():
    model = _model()
    spec = InjectionSpec(path="rope", nmse=0.01, pair=2, rope_layout="half")
    capture(model, _ids(model), new_cache(model, injection_factory(spec)))
    energy = spec.error_energy[0]
    d_r = energy.numel()
    hit = torch.zeros(d_r, dtype=torch.bool)
    hit[list(rope_pair("half", d_r, 2))] = True
    assert (energy[~hit] == 0).all() and (energy[hit] > 0).all()


def test_pair_group_injection_touches_only_those_pairs():
    model = _model()
    spec = InjectionSpec(path="rope", nmse=0.01, pair=(0, 3), rope_layout="interleaved")
    capture(model, _ids(model), new_cache(model, injection_factory(spec)))
    energy = spec.error_energy[0]
    hit = torch.zeros(energy.numel(), dtype=torch.bool)
    for i in (0, 3):
        hit[list(rope_pair("interleaved", energy.numel(), i))] = True
    assert (energy[~hit] == 0).all() and (energy[hit] > 0).all()
    assert spec.achieved[0] == pytest.approx(0.01, rel=1e-6)  # the target NMSE of the whole key


def test_predictor_matches_monte_carlo():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(64, 16, generator=g, dtype=torch.float64) * torch.linspace(0.1, 3, 16, dtype=torch.float64)
    sigma = torch.linspace(2, 0.2, 16, dtype=torch.float64)
    delta = torch.randn(4000, 16, generator=g, dtype=torch.float64) * sigma
    measured = ((q @ delta.T) ** 2).mean().item()
    predicted = predicted_score_error(q.pow(2).mean(0), sigma.pow(2))
    assert measured == pytest.approx(predicted, rel=0.06)


def test_recording_layer_sees_scaled_queries():
    model = _model()
    cache = new_cache(model, RecordingLatentLayer)
    capture(model, _ids(model), cache)
    layer = cache.layers[0]
    assert layer.q_latent_energy.shape == (32,) and layer.q_rope_energy.shape == (8,)
    assert (layer.q_latent_energy > 0).all()


@pytest.mark.every_family("name")
@pytest.mark.parametrize("name", TINY)
def test_study_runs_on_every_family(name, tmp_path):
    seeds = 2 if name == "tiny_deepseek_v2" else 1  # the spread over seeds needs two; the rest checks the plumbing
    cfg = compose([f"model={name}", "experiment=sensitivity", f"task.seeds={seeds}", "task.sweep_nmse=[0.005]",
                   "task.probe.num_sequences=2", "task.probe.seq_len=48"])
    result = sensitivity.run(cfg, tmp_path)
    m = result.metrics
    if model_dims(cfg.model)["d_r"] == 0:  # no RoPE key: the content path alone, and the table says why
        assert m["sensitivity/achieved_nmse_max_rel_error/content"] < 1e-6
        assert m["sensitivity/output_nmse/content/logits"] > 0 and m["sensitivity/layer1/output_nmse/content/logits"] > 0
        assert "sensitivity/mechanism/coupling/logits" in m and not any("rope" in k or "amplif" in k for k in m)
        assert "has no RoPE key" in (tmp_path / "sensitivity.md").read_text()
        assert not (tmp_path / "rope_pair_sensitivity.png").exists()
        return
    for path in ("content", "rope"):
        assert m[f"sensitivity/achieved_nmse_max_rel_error/{path}"] < 1e-6
    assert m["sensitivity/amplification/logits"] > 0 and m["sensitivity/amplification/logits_std"] >= 0
    assert m["sensitivity/layer0/predicted_amplification"] > 0
    assert "sensitivity/mechanism/coupling/logits" in m and "sensitivity/rope_pair/0/logits" in m
    for f in ("sensitivity.md", "sensitivity_rows.csv", "amplification_per_layer.png", "output_vs_injected_nmse.png",
              "rope_pair_sensitivity.png"):
        assert (tmp_path / f).stat().st_size > 0, f
    json.dumps(m)  # record-ready


def test_quantizer_noise_uses_the_real_quantization_error(tmp_path):
    cfg = compose(["model=tiny_deepseek_v3", "experiment=sensitivity", "task.noise=quantizer", "quant=int4_joint",
                   "quant.content.group_size=16",
                   "task.seeds=1", "task.sweep_nmse=[]", "task.per_layer=false", "task.rope_pairs=false",
                   "task.mechanism=false", "task.probe.num_sequences=2", "task.probe.seq_len=32"])
    m = sensitivity.run(cfg, tmp_path).metrics
    assert m["sensitivity/achieved_nmse_max_rel_error/content"] < 1e-6
    assert m["sensitivity/output_nmse/content/logits"] > 0


@pytest.mark.parametrize("overrides,match", [
    (["quant=bf16"], "keeps the content path in bf16"),
    (["quant=int4_joint", "quant.content.group_size=128"], "group_size=128 does not divide the path dimension 32"),
])
def test_quantizer_noise_bad_formats_fail_before_model_work(overrides, match, monkeypatch, tmp_path):
    cfg = compose(["model=tiny_deepseek_v3", "experiment=sensitivity", "task.noise=quantizer", *overrides])
    monkeypatch.setattr(sensitivity, "prepare_model", lambda *a, **k: pytest.fail("model built before validation"))
    with pytest.raises(ValueError, match=match):
        sensitivity.run(cfg, tmp_path)


def test_trained_toy_model_amplifies_rope_errors(tmp_path):
    """On the shipped trained toy (probed with held-out needle prompts), a RoPE-key cache error costs clearly more
    output error than a content error of the same NMSE: the effect the study exists to measure."""
    cfg = compose(["model=toy_mla", "experiment=sensitivity", "task.seeds=2", "task.sweep_nmse=[]",
                   "task.per_layer=false", "task.mechanism=false", "task.rope_pairs=false",
                   "task.probe.num_sequences=2", "task.probe.seq_len=256"])
    m = sensitivity.run(cfg, tmp_path).metrics
    assert m["sensitivity/amplification/logits"] > 2.0, m["sensitivity/amplification/logits"]
