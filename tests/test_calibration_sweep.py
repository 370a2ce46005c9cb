"""Calibration in one sweep: every decoder layer runs once over the calibration sequences, each block's capture equals
the capture of a forward stopped at that block (every family, the toy), the fitted transforms equal those of the
per-block captures, and a resumed calibration (some layers already on disk) keeps the sweep aligned."""

import pytest
import torch
from conftest import compose, options

from mla_quant import calibration
from mla_quant.calibration import fit_all
from mla_quant.calibration.capture import capture_layer, capture_layers
from mla_quant.models.absorbed import decoder_layers
from mla_quant.models.families import text_config
from mla_quant.calibration.data import toy_ids
from mla_quant.models.absorbed import attention_modules
from mla_quant.prepare import build_model, load_tokenizer
from mla_quant.quant.formats import cache_format

TINY = [o for o in options("model") if o.startswith("tiny_") and "dims" not in o]
FIELDS = ("x_hat", "q_latent", "q_rope", "k_rope", "gamma", "w_uv")


def random_ids(model, n=5, t=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, text_config(model.config).vocab_size, (n, t), generator=g)


def count_layer_forwards(model):
    counts = [0]
    handles = [layer.register_forward_hook(lambda *a: counts.__setitem__(0, counts[0] + 1))
               for layer in decoder_layers(model)]
    return counts, handles


@pytest.mark.parametrize("option", TINY + ["toy_mla"])
def test_sweep_captures_equal_stopped_forwards(option):
    model = build_model(compose([f"model={option}"]).model, absorbed=False, dtype="float32")
    ids = random_ids(model)
    n_blocks = len(attention_modules(model))
    swept = list(capture_layers(model, ids, batch_size=2))
    assert [c.layer for c in swept] == list(range(n_blocks))
    for cap in swept:
        want = capture_layer(model, ids, cap.layer, batch_size=2)
        for name in FIELDS:
            got, ref = getattr(cap, name), getattr(want, name)
            if ref.numel() == 0:  # a path of no dims (no RoPE key)
                assert got.shape == ref.shape
                continue
            err = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
            assert err <= 1e-6, f"{option} block {cap.layer}: {name} differs from the stopped forward by {err:.3g}"
        assert cap.scale == want.scale and cap.latent_scale == want.latent_scale


@pytest.mark.parametrize("option", TINY + ["toy_mla"])
def test_blocks_computed_from_their_pieces_equal_the_models_own_attention(option):
    """In a capture each block's output is computed from its recorded pieces (the attention runs once, for the next
    layer and for the objectives' reference): every block's per-head output, kept as the capture's ref_out, equals
    the model's own attention output (the o_proj input of a plain forward), and the objectives' reference from the
    pieces equals it. A family whose mask is its own (the DSA indexer of V3.2, GLM-5, GLM-5.3, A.X K2, Hunyuan V4,
    Mistral Large 4, dots.3 Note), that gates
    the output (A.X K2, Hunyuan V4, Ling 3) or has attention sinks (Hunyuan V4), and a model given a dense mask (transformers' eager attention outside the absorbed view), run
    their own forward and keep no ref_out."""
    from mla_quant.calibration.objectives import reference_output
    from mla_quant.models.absorbed import absorbed_view

    model = build_model(compose([f"model={option}"]).model, absorbed=False, dtype="float32")
    ids = random_ids(model)
    modules = attention_modules(model)
    own = {}
    handles = [m.o_proj.register_forward_pre_hook(lambda mod, args, i=i: own.__setitem__(i, args[0]))
               for i, m in enumerate(modules)]
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    assert all(cap.ref_out is None for cap in capture_layers(model, ids, batch_size=2))  # a dense mask
    with absorbed_view(model):  # as fit_all captures: no mask tensor for unpadded sequences
        caps = list(capture_layers(model, ids, batch_size=2))
    for cap in caps:
        m = modules[cap.layer]
        want = own[cap.layer].view(ids.shape[0], ids.shape[1], m.num_heads, -1).transpose(1, 2)
        if option in ("tiny_deepseek_v32", "tiny_glm_moe_dsa", "tiny_axk2", "tiny_hy_v4", "tiny_hy_v4_vl",
                      "tiny_bailing_hybrid", "tiny_glm5_next", "tiny_mistral_large4",
                      "tiny_dots3_note"):  # indexers, output gates
            assert cap.ref_out is None
        else:
            torch.testing.assert_close(cap.ref_out, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
            kept, cap.ref_out = cap.ref_out, None
            torch.testing.assert_close(reference_output(cap), kept, rtol=1e-6, atol=1e-6 * float(kept.abs().max()))
        assert not any("forward" in vars(m) for m in modules)  # the class's forward again between layers


def test_capture_keeps_an_instance_forward_and_bounds_sampled_queries():
    """A forward set on the module instance (as accelerate's offloading hooks do) runs in the capture and is put back
    after it; with calib.query_tokens no block forms the full query tensor, so none keeps a reference output."""
    from mla_quant.models.absorbed import absorbed_view

    model = build_model(compose(["model=toy_mla"]).model, absorbed=False, dtype="float32")
    ids = random_ids(model)
    with absorbed_view(model):
        modules = attention_modules(model)
        calls = [0]
        hooked = modules[1]
        own = hooked.forward

        def wrapper(*args, **kwargs):
            calls[0] += 1
            return own(*args, **kwargs)

        hooked.forward, hooked._hf_hook = wrapper, object()
        try:
            caps = list(capture_layers(model, ids, batch_size=2))
            assert calls[0] == 3 and hooked.forward is wrapper  # 3 batches through the instance's forward
            assert caps[1].ref_out is None and caps[0].ref_out is not None
            sampled = list(capture_layers(model, ids, batch_size=2, query_tokens=8))
        finally:
            del hooked.forward, hooked._hf_hook
    assert all(cap.ref_out is None and cap.q_latent.shape[2] == 8 for cap in sampled)
    for a, b in zip(sampled, caps):  # the same inputs reach every block
        torch.testing.assert_close(a.x_hat, b.x_hat, rtol=1e-5, atol=1e-5)


def test_sweep_runs_each_decoder_layer_once_per_batch():
    cfg = compose(["model=tiny_deepseek_v3", "model.config.num_hidden_layers=16"])
    model = build_model(cfg.model, absorbed=False, dtype="float32")
    ids, batches = random_ids(model, n=6), 3  # batch_size 2
    counts, handles = count_layer_forwards(model)
    try:
        caps = sum(1 for _ in capture_layers(model, ids, batch_size=2))
        swept = counts[0]
        counts[0] = 0
        for i in range(16):
            capture_layer(model, ids, i, batch_size=2)
        stopped = counts[0]
    finally:
        for h in handles:
            h.remove()
    assert caps == 16
    assert swept == 16 * batches, f"sweep ran {swept} decoder-layer forwards, expected {16 * batches}"
    assert stopped == sum(range(16)) * batches  # the stopped forwards: 0 + 1 + ... + 15 full layers per batch


@pytest.fixture(scope="module")
def toy_setup():
    cfg = compose(["model=toy_mla", "transform=quantmla", "quant=int4_joint", "transform.fit.steps=6",
                   "transform.fit.eval_every=3"])
    model = build_model(cfg.model, absorbed=False)
    ids = toy_ids(load_tokenizer(cfg.model), 6, 96, seed=0)
    fmt = cache_format(cfg.quant, 96, 16)
    return cfg, model, ids, fmt


def test_fits_from_the_sweep_equal_fits_from_stopped_forwards(toy_setup):
    cfg, model, ids, fmt = toy_setup
    swept, rows = fit_all(model, ids, cfg.transform, cfg.objective, fmt, seed=0, batch_size=4)
    stopped, rows_ref = fit_all(model, ids, cfg.transform, cfg.objective, fmt, seed=0, batch_size=4,
                                capture="stopped")
    for i, (a, b) in enumerate(zip(swept.layers, stopped.layers)):
        for name in ("rotation", "scale", "angle", "pair_scale"):
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None) == (y is None), (i, name)
            if x is not None:
                err = float((x - y).abs().max())
                assert err <= 1e-5, f"layer {i} {name}: sweep vs stopped forwards differ by {err:.3g}"
    for r, s in zip(rows, rows_ref):
        assert abs(r["error"] - s["error"]) <= 1e-5 * max(1.0, abs(s["error"])), (r, s)


def test_resumed_calibration_keeps_the_sweep_aligned(toy_setup, tmp_path):
    """Layers 0 and 2 already fitted on disk: the sweep still hands layers 1 and 3 their own captures."""
    cfg, model, ids, fmt = toy_setup
    full, _ = fit_all(model, ids, cfg.transform, cfg.objective, fmt, seed=0, batch_size=4)
    checkpoints = calibration.LayerCheckpoints(tmp_path / "partial", "sha")
    for i in (0, 2):
        checkpoints.load(i)
        checkpoints.save(i, full.layers[i], [])
    resumed, _ = fit_all(model, ids, cfg.transform, cfg.objective, fmt, seed=0, batch_size=4,
                         checkpoints=checkpoints)
    for i in range(4):
        err = float((resumed.layers[i].rotation - full.layers[i].rotation).abs().max())
        assert err <= 1e-6, f"layer {i}: resumed fit differs by {err:.3g}"


def test_query_tokens_sample_the_per_head_queries_and_the_objectives_follow(toy_setup):
    """calib.query_tokens keeps the per-head query tensors at evenly spaced positions ending at the last token; the
    attention-output and positional objectives over them equal the full capture's restricted to those queries."""
    from mla_quant.calibration.capture import query_positions
    from mla_quant.calibration.capture import head_outputs
    from mla_quant.calibration.objectives import (attention_output_error, positional_qk_error, rope_output_bound,
                                                  ste_quantizer)
    from mla_quant.kernels.attention import latent_attention

    cfg, model, ids, fmt = toy_setup
    pos = query_positions(96, 10)
    assert len(pos) == 10 and int(pos[-1]) == 95 and int(pos[0]) == 0 and bool((pos.diff() > 0).all())
    full = next(capture_layers(model, ids, batch_size=3))
    part = next(capture_layers(model, ids, batch_size=3, query_tokens=10))
    assert part.q_latent.shape[2] == 10 and part.x_hat.shape[1] == 96
    torch.testing.assert_close(part.q_latent, full.q_latent[:, :, pos], rtol=1e-6, atol=1e-6)
    quant = ste_quantizer(fmt.content, 96)
    c_hat = quant(full.content)
    ref = head_outputs(latent_attention(full.q_latent, full.q_rope, full.content, full.k_rope, full.scale), full.w_uv)
    out = head_outputs(latent_attention(full.q_latent, full.q_rope, c_hat, full.k_rope, full.scale), full.w_uv)
    want = (out - ref)[:, :, pos].pow(2).sum() / ref[:, :, pos].pow(2).sum()
    got = attention_output_error(part, c_hat)
    assert abs(float(got) - float(want)) <= 1e-5 * float(want), (float(got), float(want))
    k_hat = ste_quantizer(fmt.rope, 16)(full.k_rope)
    scores = full.q_rope @ (k_hat - full.k_rope).unsqueeze(1).transpose(-1, -2)
    base = full.q_rope @ full.k_rope.unsqueeze(1).transpose(-1, -2)
    keep = torch.arange(96)[None, :] <= pos[:, None]
    want = scores[:, :, pos].masked_fill(~keep, 0).pow(2).sum() / base[:, :, pos].masked_fill(~keep, 0).pow(2).sum()
    assert abs(float(positional_qk_error(part, k_hat)) - float(want)) <= 1e-5 * float(want)
    keep = torch.arange(96)[None, :] <= torch.arange(96)[:, None]  # every query: the whole causal triangle
    want = scores.masked_fill(~keep, 0).pow(2).sum() / base.masked_fill(~keep, 0).pow(2).sum()
    assert abs(float(positional_qk_error(full, k_hat)) - float(want)) <= 1e-5 * float(want)
    bound = rope_output_bound(part, torch.zeros(8), torch.ones(8), ste_quantizer(fmt.rope, 16))
    assert bound["measured"] <= bound["bound"]


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_bad_query_tokens_are_refused(bad):
    from mla_quant.calibration.data import check_calib

    cfg = compose(["model=toy_mla", "transform=quantmla", f"calib.query_tokens={bad}"])
    with pytest.raises(ValueError, match="calib.query_tokens"):
        check_calib(cfg.calib, "toy")


def test_query_tokens_with_an_end_to_end_objective_is_refused_before_loading():
    from mla_quant.prepare import model_dims, validate

    cfg = compose(["model=toy_mla", "transform=quantmla", "objective=next_token_kl", "calib.query_tokens=16"])
    with pytest.raises(ValueError, match="next_token_kl .* needs every query"):
        validate(cfg, model_dims(cfg.model))


@pytest.mark.parametrize("option", ["toy_mla", "tiny_longcat_flash", "tiny_deepseek_v32"])
def test_capture_through_the_absorbed_view_equals_the_model_and_leaves_it_as_it_was(option):
    """fit_all captures through the blocked absorbed attention (linear memory at long contexts): the same pieces as
    transformers' own attention gives, and the model is handed back unabsorbed, with its attention implementation."""
    from mla_quant.models.absorbed import absorbed_view, is_absorbed

    model = build_model(compose([f"model={option}"]).model, absorbed=False, dtype="float32")
    ids = random_ids(model)
    before = [type(m) for m in attention_modules(model)], model.config._attn_implementation
    plain = list(capture_layers(model, ids, batch_size=2))
    with torch.no_grad():
        logits = model(ids).logits
    with absorbed_view(model):
        assert is_absorbed(model)
        viewed = list(capture_layers(model, ids, batch_size=2))
    for a, b in zip(viewed, plain):
        for name in FIELDS:
            err = float((getattr(a, name) - getattr(b, name)).abs().max() / getattr(b, name).abs().max())
            assert err <= 1e-5, f"{option} block {a.layer}: {name} through the absorbed view differs by {err:.3g}"
    assert ([type(m) for m in attention_modules(model)], model.config._attn_implementation) == before
    assert not is_absorbed(model) and not hasattr(model, "mla_family")
    assert not any(hasattr(m, "mla_blocks") or "mla_kv_b" in m._buffers for m in attention_modules(model))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits)
