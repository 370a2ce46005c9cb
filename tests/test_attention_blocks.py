"""The blocked absorbed attention equals the unblocked reference: odd shapes, every mask form transformers hands an
attention module and the compact causal mask, left/right padding, block sizes down to one token, the absorbed query
and value projections per block; on the toy through the cache for every format in both modes; the mask an absorbed
model receives holds (B, S) key validity, not a (B, 1, T, S) tensor; bad block sizes are refused by name. The
expanded form (per-head K/V and scaled_dot_product_attention, attention=expanded) equals the same reference."""

import copy

import pytest
import torch
from omegaconf import OmegaConf

from conftest import CPU_DECODE, compose
from mla_quant.cache.bytes import load_quant_option
from mla_quant.calibration.codebooks import fitted_on
from mla_quant.kernels import attention as attn_mod
from mla_quant.kernels import torch_decode
from mla_quant.kernels.attention import (UNBLOCKED, AttentionBlocks, CausalMask, latent_attention,
                                         reference_attention)
from mla_quant.models.absorbed import absorb, attention_blocks, cache_kwargs, quantized_cache
from mla_quant.toy.model import load_toy_model

BLOCKS = [AttentionBlocks(1, 1), AttentionBlocks(7, 11), AttentionBlocks(16, 5), AttentionBlocks(64, 2048)]
# (B, H, queries, keys, d_c, d_r); 70 queries: past one 64-query block
SHAPES = [(2, 3, 37, 37, 24, 8), (2, 3, 5, 41, 24, 8), (1, 4, 70, 70, 16, 8), (3, 2, 1, 300, 16, 8)]


def rel_err(got, want, rows):
    """Max relative error over the rows (B, T) that hold real queries; o (B, H, T, d)."""
    got, want = got.transpose(1, 2)[rows], want.transpose(1, 2)[rows]
    return float((got - want).abs().max() / want.abs().max())


def padded_keys(b, s, t, side):
    keys = torch.ones(b, s, dtype=torch.bool)
    if side == "left":
        keys[0, :3] = False
    elif side == "right" and t == s:
        keys[-1, -4:] = False
    return keys


def mask_forms(b, s, t, side):
    """The compact mask, the rows holding real queries, and every mask form an attention module may be handed."""
    keys = padded_keys(b, s, t, side)
    compact = CausalMask(keys)
    forms = {"compact": compact, "bool": compact.dense(t), "additive": compact.dense(t, torch.float32)}
    if side == "none":
        forms["none"] = None
    return compact, keys[:, s - t:], forms


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("side", ["none", "left", "right"])
def test_blocked_equals_reference_for_every_mask_form(shape, side):
    b, h, t, s, d_c, d_r = shape
    g = torch.Generator().manual_seed(sum(shape))
    ql, qr = torch.randn(b, h, t, d_c, generator=g), torch.randn(b, h, t, d_r, generator=g)
    c, r = torch.randn(b, s, d_c, generator=g), torch.randn(b, s, d_r, generator=g)
    compact, rows, forms = mask_forms(b, s, t, side)
    want = reference_attention(ql, qr, c, r, 0.3, compact.dense(t, torch.float32))
    for blocks in BLOCKS:
        for name, mask in forms.items():
            got = latent_attention(ql, qr, c, r, 0.3, mask, blocks=blocks)
            err = rel_err(got, want, rows)
            assert err <= 1e-5, f"{blocks} mask={name} padding={side}: max relative error {err:.3g}"


EXPANDED = [AttentionBlocks(1, 1, expand_from=1), AttentionBlocks(7, 11, expand_from=2),
            AttentionBlocks(256, 2048, expand_from=1)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("side", ["none", "left", "right"])
@pytest.mark.parametrize("head_group", [16, 2])
def test_expanded_equals_reference_for_every_mask_form(shape, side, head_group, monkeypatch):
    """Per-head keys and values up-projected from the latent, scaled_dot_product_attention per query block (or one
    is_causal call), per group of heads: the absorbed reference's head outputs, for every mask form, with values and
    sampled queries."""
    monkeypatch.setattr(attn_mod, "EXPANDED_HEAD_GROUP", head_group)  # 2: several groups, the last one partial
    b, h, t, s, d_c, d_r = shape
    d_nope, d_v = 12, 10
    g = torch.Generator().manual_seed(sum(shape) + 1)
    q_nope, qr = torch.randn(b, h, t, d_nope, generator=g), torch.randn(b, h, t, d_r, generator=g)
    w_uk, w_uv = torch.randn(h, d_nope, d_c, generator=g) / 3, torch.randn(h, d_v, d_c, generator=g) / 3
    c, r, v = torch.randn(b, s, d_c, generator=g), torch.randn(b, s, d_r, generator=g), torch.randn(b, s, d_c, generator=g)
    compact, rows, forms = mask_forms(b, s, t, side)
    for values in (None, v):
        want = reference_attention(q_nope @ w_uk, qr, c, r, 0.3, compact.dense(t, torch.float32), values=values)
        want = want @ w_uv.transpose(-1, -2)
        for blocks in EXPANDED:
            for name, mask in forms.items():
                got = latent_attention(q_nope, qr, c, r, 0.3, mask, values=values, blocks=blocks, w_uk=w_uk, w_uv=w_uv)
                assert got.shape == (b, h, t, d_v) and torch.isfinite(got).all()
                err = rel_err(got, want, rows)
                assert err <= 1e-5, f"{blocks} mask={name} padding={side} values={values is not None}: {err:.3g}"
    if t > 4:  # sampled query positions (calibration): the expanded form masks at those slots too
        pos = torch.tensor(sorted({0, t // 3, t // 2, t - 1})) + (s - t)
        for mask in ([compact] + ([None] if side == "none" else [])):
            want = latent_attention(q_nope[:, :, pos - (s - t)], qr[:, :, pos - (s - t)], c, r, 0.3, mask,
                                    blocks=UNBLOCKED, w_uk=w_uk, w_uv=w_uv, q_positions=pos)
            got = latent_attention(q_nope[:, :, pos - (s - t)], qr[:, :, pos - (s - t)], c, r, 0.3, mask,
                                   blocks=EXPANDED[1], w_uk=w_uk, w_uv=w_uv, q_positions=pos)
            assert rel_err(got, want, rows[:, pos - (s - t)]) <= 1e-5


@pytest.mark.parametrize("d_v", [10, 20, 31])
def test_expanded_pads_the_smaller_head_dim(d_v):
    """Values narrower or wider than the keys (d_nope + d_r = 20): zero padding to one head dim changes nothing."""
    g = torch.Generator().manual_seed(d_v)
    b, h, t, d_c, d_r, d_nope = 2, 3, 30, 16, 8, 12
    q_nope, qr = torch.randn(b, h, t, d_nope, generator=g), torch.randn(b, h, t, d_r, generator=g)
    w_uk, w_uv = torch.randn(h, d_nope, d_c, generator=g) / 4, torch.randn(h, d_v, d_c, generator=g) / 4
    c, r = torch.randn(b, t, d_c, generator=g), torch.randn(b, t, d_r, generator=g)
    want = reference_attention(q_nope @ w_uk, qr, c, r, 0.3) @ w_uv.transpose(-1, -2)
    for mask in (None, CausalMask(padded_keys(b, t, t, "left"))):
        got = latent_attention(q_nope, qr, c, r, 0.3, mask, blocks=AttentionBlocks(8, 8, expand_from=1), w_uk=w_uk,
                               w_uv=w_uv)
        rows = torch.ones(b, t, dtype=torch.bool) if mask is None else mask.keys
        if mask is not None:
            want = reference_attention(q_nope @ w_uk, qr, c, r, 0.3, mask.dense(t, torch.float32)) @ w_uv.transpose(-1, -2)
        assert got.shape == (b, h, t, d_v) and rel_err(got, want, rows) <= 1e-5


def test_expanded_form_only_from_its_query_count():
    """attention.expand_from: forwards with fewer queries (decode steps) stay in the latent form."""
    import torch.nn.functional as F

    calls = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        calls.append(q.shape[2])
        return real(q, k, v, **kw)

    g = torch.Generator().manual_seed(0)
    h, d_c, d_r, d_nope, d_v = 2, 16, 4, 8, 8
    w_uk, w_uv = torch.randn(h, d_nope, d_c, generator=g), torch.randn(h, d_v, d_c, generator=g)
    F.scaled_dot_product_attention = spy
    try:
        for t in (1, 7, 8, 20):
            latent_attention(torch.randn(1, h, t, d_nope), torch.randn(1, h, t, d_r), torch.randn(1, 20, d_c),
                             torch.randn(1, 20, d_r), 0.5, None, blocks=AttentionBlocks(64, 64, expand_from=8),
                             w_uk=w_uk, w_uv=w_uv)
    finally:
        F.scaled_dot_product_attention = real
    assert calls == [8, 20], calls  # t=8 over 20 keys: one masked block; t=20=S unpadded: one is_causal call


def test_values_and_absorbed_projections_per_block():
    g = torch.Generator().manual_seed(1)
    b, h, t, d_c, d_r, d_nope, d_v = 2, 3, 45, 20, 8, 12, 10
    q_nope, qr = torch.randn(b, h, t, d_nope, generator=g), torch.randn(b, h, t, d_r, generator=g)
    w_uk, w_uv = torch.randn(h, d_nope, d_c, generator=g), torch.randn(h, d_v, d_c, generator=g)
    c, r, v = (torch.randn(b, t, d, generator=g) for d in (d_c, d_r, d_c))
    want = reference_attention(q_nope @ w_uk, qr, c, r, 0.2, values=v) @ w_uv.transpose(-1, -2)
    got = latent_attention(q_nope, qr, c, r, 0.2, values=v, blocks=AttentionBlocks(8, 6), w_uk=w_uk, w_uv=w_uv)
    assert got.shape == (b, h, t, d_v)
    err = rel_err(got, want, torch.ones(b, t, dtype=torch.bool))
    assert err <= 1e-5, f"absorbed projections per block: max relative error {err:.3g}"


def _score_blocks(*args, blocks):
    """latent_attention(*args, blocks=blocks) and the (query tokens, keys) of every block of scores it formed."""
    seen = []
    real = attn_mod._masked_scores

    def spy(ql, qr, content, rope, scale, mask):
        seen.append((ql.shape[2], content.shape[1]))
        return real(ql, qr, content, rope, scale, mask)

    attn_mod._masked_scores = spy
    try:
        return latent_attention(*args, blocks=blocks), seen
    finally:
        attn_mod._masked_scores = real


def _causal_args(b=1, h=2, t=40, d=8):
    return torch.randn(b, h, t, d), torch.randn(b, h, t, 4), torch.randn(b, t, d), torch.randn(b, t, 4), 0.5, None


def test_causal_blocks_skip_keys_after_the_last_query():
    """Under a causal mask a query block reads only the keys up to its last query: no score beyond them is formed."""
    _, seen = _score_blocks(*_causal_args(), blocks=AttentionBlocks(10, 10))
    widest = max(k for _, k in seen)
    assert widest <= 10 and sum(q * k for q, k in seen) <= 10 * 10 * 10, seen  # 10 blocks of 10 x 10, causal half


def test_a_step_over_few_keys_takes_more_queries_per_block():
    """Over fewer keys than `key`, a query block holds proportionally more queries: the same workspace bound
    (query x key per head), fewer blocks."""
    args = _causal_args()
    got, seen = _score_blocks(*args, blocks=AttentionBlocks(10, 100))
    assert [q for q, _ in seen] == [25, 15] and all(q * k <= 10 * 100 for q, k in seen), seen
    assert AttentionBlocks(10, 100).queries_per_block(400) == 10  # at or beyond `key` keys: `query`
    torch.testing.assert_close(got, latent_attention(*args, blocks=UNBLOCKED), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("t,s,sampled", [(37, 37, False), (5, 41, False), (9, 50, True)])
def test_fused_causal_attention_equals_the_latent_form_with_gradients(t, s, sampled):
    """The fused (SDPA) form of causal latent attention, for every query of a sequence, its last T queries, or
    queries sampled at positions: the blocked form's output and gradients, to float32 rounding."""
    g = torch.Generator().manual_seed(t + s)
    b, h, d_c, d_r = 2, 3, 24, 8
    pos = torch.tensor(sorted(torch.randperm(s, generator=g)[:t].tolist())) if sampled else None
    tensors = [torch.randn(b, h, t, d_c, generator=g), torch.randn(b, h, t, d_r, generator=g),
               torch.randn(b, s, d_c, generator=g), torch.randn(b, s, d_r, generator=g)]
    outs, grads = [], []
    for form in (attn_mod.fused_causal_attention, None):
        leaves = [x.clone().requires_grad_(True) for x in tensors]
        if form is None:
            out = latent_attention(*leaves, 0.3, None, blocks=AttentionBlocks(4, 8), q_positions=pos)
        else:
            out = form(*leaves, 0.3, q_positions=pos)
        out.pow(2).sum().backward()
        outs.append(out.detach())
        grads.append([x.grad for x in leaves])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def toy():
    return load_toy_model()


OPTIONS = ["bf16", "fp8_flat", "fp8_ds_mla", "int8_joint", "int4_content", "int4_joint", "int2_content_int4_rope",
           "int2_joint", "kivi_int2"]


@pytest.mark.parametrize("mode", ["simulated", "serving"])
@pytest.mark.parametrize("option", OPTIONS)
def test_cache_attention_blocked_equals_unblocked_for_every_format(option, mode):
    """Two cache layers fed the same latents (so the same codes): prefill with left padding, then decode steps."""
    from mla_quant.cache import cache_layer_factory

    cfg = OmegaConf.merge(load_quant_option(option, groups={"wide": 32, "narrow": 32}),
                          {"protected": {"recent": 16}, "mode": mode})
    g = torch.Generator().manual_seed(3)
    b, h, d_c, d_r, d_nope, d_v = 2, 4, 96, 16, 32, 32
    w_uk, w_uv = torch.randn(h, d_nope, d_c, generator=g) / 6, torch.randn(h, d_v, d_c, generator=g) / 10
    forms = {"blocked": AttentionBlocks(16, 24), "expanded": AttentionBlocks(16, 24, expand_from=4),
             "unblocked": UNBLOCKED}
    layers = {name: cache_layer_factory(cfg, d_c, d_r)() for name in forms}
    keys = torch.ones(b, 0, dtype=torch.bool)
    for t in (83, 1, 1, 5):
        new = torch.ones(b, t, dtype=torch.bool)
        if keys.shape[1] == 0:
            new[0, :9] = False  # left padding
        keys = torch.cat([keys, new], 1)
        q, qr = torch.randn(b, h, t, d_nope, generator=g), torch.randn(b, h, t, d_r, generator=g)
        c, r = torch.randn(b, t, d_c, generator=g), torch.randn(b, t, d_r, generator=g)
        out = {name: layer.attend(q, qr, c, r, 0.1, CausalMask(keys), new, w_uk=w_uk, w_uv=w_uv, blocks=forms[name])
               for name, layer in layers.items()}
        for name in ("blocked", "expanded"):
            err = rel_err(out[name], out["unblocked"], keys[:, -t:])
            assert err <= 1e-5, f"{option} {mode}, step of {t}: {name} vs unblocked, max relative error {err:.3g}"


@pytest.mark.parametrize("option", ["bf16", "fp8_ds_mla"])
def test_toy_logits_blocked_equal_unblocked(toy, option):
    """The whole toy with a left-padded batch, prefill then decode. (With integer formats the stored codes of later
    layers may differ at rounding boundaries, as they do between any two summation orders: the cache test above
    holds those formats to the same bound with equal codes.)"""
    cfg = OmegaConf.merge(load_quant_option(option, groups={"wide": 32, "narrow": 32}), {"protected": {"recent": 16}})
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 1024, (2, 97), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :9] = 0
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    out = {}
    for name, blocks in (("blocked", AttentionBlocks(16, 24)), ("expanded", AttentionBlocks(16, 24, expand_from=2)),
                         ("unblocked", UNBLOCKED)):
        model = absorb(copy.deepcopy(toy), blocks)
        with torch.no_grad():
            cache = quantized_cache(model, cfg)
            prefill = model(ids[:, :90], attention_mask=mask[:, :90], position_ids=positions[:, :90],
                            **cache_kwargs(cache)).logits
            step = model(ids[:, 90:], attention_mask=mask, position_ids=positions[:, 90:],
                         **cache_kwargs(cache)).logits
        out[name] = torch.cat([prefill, step], 1)
    valid = mask.bool()
    for name in ("blocked", "expanded"):
        err = float((out[name] - out["unblocked"])[valid].abs().max() / out["unblocked"][valid].abs().max())
        assert err <= 1e-5, f"{option}: {name} vs unblocked logits, max relative error {err:.3g}"


def test_absorbed_model_receives_the_compact_mask(toy):
    model = copy.deepcopy(toy)
    masks = []
    attention = model.mla_family.attention_modules(model)[0]
    attention.register_forward_pre_hook(lambda m, args, kw: masks.append(kw.get("attention_mask")), with_kwargs=True)
    ids = torch.randint(3, 1024, (2, 20))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    with torch.no_grad():
        model(ids, attention_mask=mask)
        model(ids)
    assert isinstance(masks[0], CausalMask) and masks[0].keys.shape == (2, 20), type(masks[0])
    assert torch.equal(masks[0].keys, mask.bool())
    assert masks[1] is None  # no padding: causal, nothing built


@pytest.mark.parametrize("bad", [{"query_block": 0, "key_block": 64}, {"query_block": 64, "key_block": -1},
                                 {"query_block": 64, "key_block": None}, {"query_block": 2.5, "key_block": 64},
                                 {"query_block": 64, "key_block": 64, "size": 3},
                                 {"query_block": 64, "key_block": 64, "expand_from": 0},
                                 {"query_block": 64, "key_block": 64, "expand_from": "yes"}])
def test_bad_block_sizes_are_refused_by_name(bad):
    cfg = OmegaConf.create({"name": "blocked", **bad})
    with pytest.raises(ValueError) as err:
        attention_blocks(cfg)
    msg = str(err.value)
    assert any(str(v) in msg for v in bad.values()) or "size" in msg, msg


def test_attention_option_reaches_the_model():
    from mla_quant.prepare import prepare_model

    cfg = compose(["experiment=quality", "model=tiny_deepseek_v2", "attention=blocked",
                   "attention.query_block=5", "attention.key_block=9"])
    prep = prepare_model(cfg, tokenizer=False)
    blocks = {m.mla_blocks for m in prep.model.mla_family.attention_modules(prep.model)}
    assert blocks == {AttentionBlocks(5, 9)}
    cfg = compose(["experiment=quality", "model=tiny_deepseek_v2", "attention=expanded"])
    prep = prepare_model(cfg, tokenizer=False)
    assert {m.mla_blocks for m in prep.model.mla_family.attention_modules(prep.model)} == {
        AttentionBlocks(256, 2048, expand_from=256)}
    cfg = compose(["experiment=quality", "model=tiny_deepseek_v2", "attention=unblocked"])
    prep = prepare_model(cfg, tokenizer=False)
    assert {m.mla_blocks for m in prep.model.mla_family.attention_modules(prep.model)} == {UNBLOCKED}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("t,s,pad", [(2048, 2048, 0), (2048, 2048, 5), (300, 4096, 0)])
def test_expanded_on_cuda_matches_the_reference(t, s, pad):
    """On CUDA the expanded form runs flash / memory-efficient attention (one is_causal call when unpadded): within
    bfloat16 rounding of the float32 unblocked reference at DeepSeek-V2-Lite's dims."""
    g = torch.Generator(device="cuda").manual_seed(0)
    b, h, d_c, d_r, d_nope, d_v = 2, 16, 512, 64, 128, 128

    def rnd(*shape, std=1.0):
        return torch.randn(*shape, generator=g, device="cuda") * std

    q_nope, qr, c, r = rnd(b, h, t, d_nope), rnd(b, h, t, d_r), rnd(b, s, d_c), rnd(b, s, d_r)
    w_uk, w_uv = rnd(h, d_nope, d_c, std=d_c ** -0.5), rnd(h, d_v, d_c, std=d_c ** -0.5)
    keys = torch.ones(b, s, dtype=torch.bool, device="cuda")
    keys[0, :pad] = False
    mask = CausalMask(keys) if pad else None
    scale = (d_nope + d_r) ** -0.5
    want = latent_attention(q_nope, qr, c, r, scale, mask, blocks=UNBLOCKED, w_uk=w_uk, w_uv=w_uv)
    args = [x.bfloat16() for x in (q_nope, qr, c, r)]
    got = latent_attention(*args, scale, mask, blocks=AttentionBlocks(256, 2048, expand_from=256),
                           w_uk=w_uk.bfloat16(), w_uv=w_uv.bfloat16())
    rows = keys[:, s - t:]
    assert rel_err(got.float(), want, rows) < 2e-2


# ------------------------------------------------------------------------------- decode steps over stored segments
SEGMENT_FORMATS = {
    "bf16": {"option": "bf16"},
    "int4_joint g32": {"content": {"group_size": 32}},
    "int2 g32 + int4 rope": {"option": "int2_content_int4_rope", "content": {"group_size": 32}},
    "int8 g96 sym + bf16 rope": {"option": "int4_content", "content": {"bits": 8, "group_size": 96, "symmetric": True}},
    "int4 pow2 sym + int8 rope": {"content": {"group_size": 32, "symmetric": True, "scale_dtype": "pow2"},
                                  "rope": {"bits": 8}},
    "int4 g128 at d_c 512": {"content": {"group_size": 128}, "d_c": 512},
    "int4 no recent, serving": {"content": {"group_size": 48}, "protected": {"n_sink": 2, "recent": 0}},
    "int4 g32 + pairs rope [8, 3, 2, 16]": {"content": {"group_size": 32}, "rope": {"bits": [8, 3, 2, 16]}},
    "int2 g32 lloyd + int4 rope lloyd": {"option": "int2_content_int4_rope",
                                         "content": {"group_size": 32, "quantizer": "lloyd"},
                                         "rope": {"quantizer": "lloyd"}},
}


def segment_layer(spec: dict, b: int = 3, pads=(0, 9, 77), tokens: int = 190):
    """A cache layer after a left-padded prefill and single-token appends (sequences hold different numbers of sinks,
    stored and recent tokens), and its latents' dims."""
    from mla_quant.cache import layer_factory
    from mla_quant.quant.formats import cache_format

    spec = dict(spec)
    d_c, d_r = spec.pop("d_c", 96), 16
    cfg = OmegaConf.merge(load_quant_option(spec.pop("option", "int4_joint")), spec)
    g = torch.Generator().manual_seed(0)
    c, r = torch.randn(b, tokens, d_c, generator=g), 3 * torch.randn(b, tokens, d_r, generator=g)
    layer = layer_factory(fitted_on(cache_format(cfg, d_c, d_r), c, r))()
    valid = torch.ones(b, tokens, dtype=torch.bool)
    for i, pad in enumerate(pads):
        valid[i, :pad] = False
    first = tokens * 2 // 3
    layer.append(c[:, :first], r[:, :first], valid[:, :first])
    for i in range(first, tokens):
        layer.append(c[:, i : i + 1], r[:, i : i + 1], valid[:, i : i + 1])
    return layer, d_c, d_r


@pytest.mark.parametrize("keys", [None, 64, 40, 1])
@pytest.mark.parametrize("name", list(SEGMENT_FORMATS))
def test_segment_attention_equals_the_kernels_reference(name, keys, monkeypatch):
    """segment_attention over a layer's stored segments (codes read in place, `keys` tokens per chunk) equals the
    kernel's specification (every token dequantized, float32); no decoded chunk exceeds the workspace."""
    from mla_quant.kernels.torch_decode import latent_decode_reference

    layer, d_c, d_r = segment_layer(SEGMENT_FORMATS[name])
    segments = layer.segments()
    if name != "bf16":
        assert layer.n_quantized > 0 and len(segments) >= 2
    held, kept = [], []  # tokens decoded per chunk; content tokens held under one softmax when a chunk is decoded
    real, group = torch_decode._Chunk.__init__, torch_decode._softmax_group

    def chunk(self, p, read, d):
        real(self, p, read, d)
        held.append(self.x.shape[1])
        if any(p is s.content for s in segments):
            kept.append(self.x.shape[1])

    def softmax_group(chunks):
        kept.append(None)  # a group closed: its chunks are let go
        return group(chunks)

    monkeypatch.setattr(torch_decode, "_softmax_group", softmax_group)

    monkeypatch.setattr(torch_decode._Chunk, "__init__", chunk)
    g = torch.Generator().manual_seed(1)
    for heads in (1, 5):
        q, qr = torch.randn(3, heads, d_c, generator=g), torch.randn(3, heads, d_r, generator=g)
        got = torch_decode.segment_attention(q, qr, 0.12, segments, keys)
        torch.testing.assert_close(got, latent_decode_reference(q, qr, 0.12, segments), rtol=1e-5, atol=1e-5)
    bound = max(keys or 0, layer.block_size) if keys else max(s.longest() for s in segments)
    assert max(held) <= bound, (held, bound)
    if keys:  # the content tokens decoded and not yet let go never exceed the workspace
        live = 0
        for n in kept:
            live = 0 if n is None else live + n
            assert live <= bound, (kept, bound)


def test_segment_attention_of_empty_sequences_is_zero():
    from mla_quant.kernels.layout import Segment

    c, r = torch.randn(2, 4, 8), torch.randn(2, 4, 4)
    out = torch_decode.segment_attention(torch.randn(2, 3, 8), torch.randn(2, 3, 4), 0.5,
                                     [Segment.dense(c, r, torch.tensor([0, 2]))])
    assert torch.equal(out[0], torch.zeros(3, 8)) and out[1].abs().sum() > 0


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("mode", ["simulated", "serving"])
@pytest.mark.parametrize("name", list(SEGMENT_FORMATS))
def test_decode_steps_over_segments_equal_the_stored_keys_path(name, mode, backend):
    """A layer's decode step (one query, padding-only mask) reads the stored segments (backend=torch:
    `segment_attention`; auto: the C++ CPU kernel where it reads the format); it equals attention over the layer's
    slot-aligned stored keys (`StoredKeys`, what prefill and every other step read), with the absorbed projections,
    left padding included. A 4-D mask that also hides a real token takes the StoredKeys path; a padding mask
    (`CausalMask`) that differs from the cache's record is refused."""
    from mla_quant.cache.reads import StoredKeys

    spec = {**SEGMENT_FORMATS[name], "mode": mode, "backend": backend}
    layer, d_c, d_r = segment_layer(spec)
    chosen = layer.fmt.step_backends("cpu")["decode"]
    assert chosen == (CPU_DECODE if backend == "auto" and "pairs" not in name else "torch")
    g = torch.Generator().manual_seed(2)
    h, d_nope, d_v = 4, 32, 24
    w_uk, w_uv = torch.randn(h, d_nope, d_c, generator=g) / 6, torch.randn(h, d_v, d_c, generator=g) / 10
    keys = torch.cat([layer.slot_valid, torch.ones(3, 1, dtype=torch.bool)], 1)
    fresh = mode == "serving" and layer.quantized and layer.fmt.recent == 0
    for step in range(3):
        q, qr = torch.randn(3, h, 1, d_nope, generator=g), torch.randn(3, h, 1, d_r, generator=g)
        c, r = torch.randn(3, 1, d_c, generator=g), torch.randn(3, 1, d_r, generator=g)
        assert layer._reads_segments(q, CausalMask(keys), None) != fresh
        before = dict(layer.backend_steps)
        got = layer.attend(q, qr, c, r, 0.1, CausalMask(keys), None, w_uk=w_uk, w_uv=w_uv)
        ran = "torch" if fresh else chosen  # a step that must see its own fresh latent reads the stored keys
        assert layer.backend_steps[("decode", ran)] == before.get(("decode", ran), 0) + 1
        want = latent_attention(q, qr, StoredKeys(layer, (c, r) if mode == "serving" else None), None, 0.1,
                                CausalMask(keys), w_uk=w_uk, w_uv=w_uv)
        tol = dict(rtol=1e-5, atol=1e-6) if chosen == "torch" else dict(rtol=1e-4, atol=1e-5)  # the kernels' order
        torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{name} {mode} step {step}: {m}")
        keys = torch.cat([keys, torch.ones(3, 1, dtype=torch.bool)], 1)
    hidden = keys.clone()
    hidden[1, 100] = False  # a real token masked out: not what the segments hold
    q = torch.randn(3, h, 1, d_nope, generator=g)
    assert not layer._reads_segments(q, CausalMask(hidden).dense(1), None)  # a 4-D mask: compared on the host
    c, r = torch.randn(3, 1, d_c, generator=g), torch.randn(3, 1, d_r, generator=g)
    if fresh:  # the StoredKeys path honours any mask
        return
    with pytest.raises(RuntimeError, match="differs from the cache's record"):  # a 2-D mask: checked on the device
        layer.attend(q, torch.randn(3, h, 1, d_r, generator=g), c, r, 0.1, CausalMask(hidden), None, w_uk=w_uk,
                     w_uv=w_uv)


def test_sinks_in_every_form_equal_transformers_softmax_with_a_sink_column():
    """Attention sinks (Hunyuan V4, as gpt-oss): the reference equals transformers' form (a sink logit per head
    concatenated to the scores, softmaxed, then dropped), and the blocked, online-merged and segment forms equal the
    reference; without sinks the result differs (they take effect)."""
    from mla_quant.kernels.layout import Segment

    b, h, t, s, d_c, d_r = 2, 3, 9, 40, 16, 8
    g = torch.Generator().manual_seed(5)
    ql, qr = torch.randn(b, h, t, d_c, generator=g), torch.randn(b, h, t, d_r, generator=g)
    c, r = torch.randn(b, s, d_c, generator=g), torch.randn(b, s, d_r, generator=g)
    sinks = torch.tensor([0.5, 2.0, -1.0])
    compact, rows, forms = mask_forms(b, s, t, "left")
    dense = compact.dense(t, torch.float32)
    scores = (torch.einsum("bhtc,bsc->bhts", ql, c) + torch.einsum("bhtr,bsr->bhts", qr, r)) * 0.3 + dense
    combined = torch.cat([scores, sinks.view(1, h, 1, 1).expand(b, h, t, 1)], -1)
    hf = torch.softmax(combined, -1)[..., :-1] @ c[:, None]
    want = reference_attention(ql, qr, c, r, 0.3, dense, sinks=sinks)
    assert rel_err(want, hf, rows) <= 1e-5
    assert rel_err(reference_attention(ql, qr, c, r, 0.3, dense), want, rows) > 1e-2
    for blocks in BLOCKS:
        for name, mask in forms.items():
            err = rel_err(latent_attention(ql, qr, c, r, 0.3, mask, blocks=blocks, sinks=sinks), want, rows)
            assert err <= 1e-5, f"{blocks} mask={name}: max relative error {err:.3g}"
    # one query per sequence over segments, merged by log-sum-exp (split over 3 chunks of keys)
    lengths = torch.tensor([s, s - 7])
    got = torch_decode.segment_attention(ql[:, :, -1], qr[:, :, -1], 0.3, [Segment.dense(c, r, lengths)], 16, sinks)
    keys = torch.arange(s)[None] < lengths[:, None]
    one = reference_attention(ql[:, :, -1:], qr[:, :, -1:], c, r, 0.3, CausalMask(keys).dense(1, torch.float32),
                              sinks=sinks)[:, :, 0]
    torch.testing.assert_close(got, one, rtol=1e-5, atol=1e-6)
