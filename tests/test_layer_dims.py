"""A model whose MLA layers have different latent dims (Mistral Large 4, model_type mistral_large4: its NoPE layers
cache the content latent alone, d_r 0 there and 8 elsewhere in the tiny model). Each cache layer is validated and
stored at its own dims (one option, a RoPE part skipped by name in the NoPE layers), bytes are exact per layer, the
transforms are fitted per layer, padding in a batch changes no row, the learned factors the tiny model starts at
their neutral values (the log-position query factor, LeRoPE's frequency scale) are followed once set, and what
reads one (d_c, d_r) for the whole model is refused by name. The family's equivalence, sensitivity, transforms,
calibration capture and from_pretrained run in the suites that take every tiny model."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import alone_and_padded, prefill_logits, prompt_ids
from test_quant_cache import TINY, compose, quant_cfg

from mla_quant.calibration.options import fit_format
from mla_quant.calibration.sweep import fit_all
from mla_quant.models import families
from mla_quant.models.absorbed import absorb, cache_kwargs, latent_dims, new_cache, quantized_cache
from mla_quant.prepare import build_model, model_dims, validate
from mla_quant.quant.formats import CacheSpec
from mla_quant.stages.equivalence import compare, make_batch

OPTION = "model=tiny_mistral_large4"
NOPE = 1  # the tiny model's NoPE layer (conf/model/tiny_mistral_large4.yaml: no_rope_layers [1, 0, 1, 1])


@pytest.fixture(scope="module")
def model():
    return build_model(compose(OPTION).model)


def test_the_dims_are_read_per_layer_from_the_config_and_the_modules(model):
    want = [(32, 8), (32, 0), (32, 8), (32, 8)]
    assert latent_dims(model)["layer_dims"] == want
    dims = model_dims(compose(OPTION).model)
    assert dims["layer_dims"] == want and (dims["d_c"], dims["d_r"], dims["layers"]) == (32, 8, 4)


def test_each_layer_is_stored_at_its_own_dims(model):
    ids = prompt_ids()
    with pytest.warns(UserWarning, match=r"quant=int4_joint: MLA layers \[1\] have no RoPE key .*skipped in them"):
        cache = quantized_cache(model, quant_cfg("int4_joint", *TINY))
    exact = new_cache(model)
    quantized, reference = prefill_logits(model, cache, ids), prefill_logits(model, exact, ids)
    assert (quantized - reference).abs().max() > 1e-3  # it does quantize
    for i, layer in enumerate(cache.latent_layers):
        d_r = 0 if i == NOPE else 8
        assert (layer.fmt.d_c, layer.fmt.d_r) == (32, d_r) and layer.fmt.rope.quantized == (i != NOPE)
        assert (layer.store.layouts["rope"].token_bytes == 0) == (i == NOPE)
        # codes + scales + zeros of the quantized tokens at the layer's own dims, the protected tokens in float32
        stored = int(layer.store.lengths.sum())
        window = int(layer.n_sinks.sum() + layer.n_recent.sum() + layer.n_pending.sum())
        per_token = layer.fmt.content.bytes_per_token(32, 4) + layer.fmt.rope.bytes_per_token(d_r, 4)
        assert stored > 0 and layer.nbytes() == stored * per_token + window * (32 + d_r) * 4


def test_a_format_per_layer_takes_each_layers_dims(model):
    """quant.layers on this model: INT2 content in the NoPE layer, INT2 RoPE in layer 2, each validated at its dims."""
    cfg = quant_cfg("int4_joint", *TINY, "quant.layers=[null,{content: {bits: 2}},{rope: {bits: 2}},null]")
    with pytest.warns(UserWarning, match="no RoPE key"):
        cache = quantized_cache(model, cfg)
    prefill_logits(model, cache, prompt_ids())
    bits = [(layer.fmt.content.bits, layer.fmt.rope.bits if layer.fmt.d_r else None) for layer in cache.latent_layers]
    assert bits == [(4, 4), (2, None), (4, 2), (4, 4)]
    fmt = validate(compose(OPTION, "quant=int4_joint", *TINY), model_dims(compose(OPTION).model))
    assert isinstance(fmt, CacheSpec) and fmt.one_format
    assert fmt.describe()[NOPE]["rope"] == "none (no RoPE key)"
    # int4 content in groups of 16: 16 B codes + 2 x (fp16 scale + zero); int4 RoPE per token: 4 B codes + 4 B
    assert fmt.bytes_per_token(4) == [32, 24, 32, 32]


def test_transforms_are_fitted_per_layer_at_its_dims(model):
    cfg = compose(OPTION, "quant=int2_content_int4_rope", *TINY, "transform=quantmla", "transform.fit.steps=3")
    layer_dims = latent_dims(model)["layer_dims"]
    with pytest.warns(UserWarning, match="no RoPE key"):
        fmt = validate(cfg, model_dims(cfg.model))
    fit = fit_format(cfg.transform, fmt, layer_dims, None)
    tset, report = fit_all(copy.deepcopy(model), prompt_ids(24), cfg.transform, cfg.objective, fit, seed=0,
                           batch_size=2)
    rope = {row["layer"]: row for row in report if row["path"] == "rope"}
    assert rope[NOPE]["kind"] == "none" and all(rope[i]["kind"] == "pairwise" for i in (0, 2, 3))
    assert tset.layers[NOPE].angle is None or tset.layers[NOPE].angle.numel() == 0
    assert all(tset.layers[i].angle.numel() == 4 for i in (0, 2, 3))  # d_r / 2 pair angles


@pytest.fixture(scope="module")
def dense_model():
    """index_topk above the context: the indexer selects every key, so a row's result is its own (as GLM-5's)."""
    return build_model(compose(OPTION, "model.config.text_config.index_topk=64").model)


def test_padding_in_a_batch_changes_no_row(dense_model):
    model = dense_model
    with pytest.warns(UserWarning, match="no RoPE key"):
        cfg = quant_cfg("int4_joint", *TINY)
        quantized_cache(model, cfg)
    runs = alone_and_padded(model, lambda: quantized_cache(model, cfg))
    assert torch.equal(runs[0][0], runs[1][0])
    assert float((runs[0][1] - runs[1][1]).abs().max()) <= 1e-3


def _set_learned_factors(model, seed: int = 0) -> None:
    """The log-position query factor (per head) and LeRoPE's frequency scale away from their neutral initial values
    (scale 0, bias 1, alpha 0), as a trained checkpoint has them."""
    g = torch.Generator().manual_seed(seed)
    text = model.model.language_model
    with torch.no_grad():
        for layer in text.layers:
            s = layer.self_attn.softmax_scaling
            s.scale.copy_(0.3 * torch.rand(s.scale.shape, generator=g))
            s.bias.copy_(0.5 + torch.rand(s.bias.shape, generator=g))
        text.rotary_emb.alpha.copy_(0.5 * torch.randn(text.rotary_emb.alpha.shape, generator=g))


def test_the_learned_query_factor_and_rope_scale_are_followed(monkeypatch):
    reference = build_model(compose(OPTION).model, absorbed=False, attn_implementation="eager", dtype="float32")
    _set_learned_factors(reference)
    absorbed = absorb(copy.deepcopy(reference))
    ids, mask = make_batch(512, 2, 40, 9, seed=0)
    m = compare(reference, absorbed, ids, mask, decode_steps=8)
    assert m["prefill_max_abs_logit_diff"] <= 1e-4 and m["decode_max_abs_logit_diff"] <= 1e-4
    assert m["greedy_tokens_match"] == 1.0
    monkeypatch.setattr(families.MistralLarge4Family, "query_scale", lambda self, attn, position_ids: None)
    with torch.no_grad():
        diff = (reference(ids, attention_mask=mask).logits - absorbed(ids, attention_mask=mask).logits)
    assert diff[mask.bool()].abs().max() > 1e-2  # the factor is seen: dropping it leaves transformers' logits


def test_what_reads_one_dims_for_every_layer_is_refused_by_name(model):
    with pytest.raises(ValueError, match=r"quant=hf_hqq_int4: transformers' quantized cache takes one \(d_c, d_r\) "
                                         r".*\[\(32, 0\), \(32, 8\)\]"):
        quantized_cache(model, quant_cfg("hf_hqq_int4", "peer.group_size=8"))
    cfg = compose(OPTION, "quant=mixed", "calib=toy", *TINY)
    with pytest.raises(ValueError, match=r"quant='mixed' allocates widths from one \(d_c, d_r\) .*quant.layers"):
        validate(cfg, model_dims(cfg.model))
    shared = compose(OPTION, "+model.config.text_config.kv_source_layers=[0,1,1,3]").model
    with pytest.raises(ValueError, match=r"mistral_large4: config.kv_source_layers shares latents between layers "
                                         r"\(layer 2 attends to layer 1's cache.*kv_source_layers\[i\] = i"):
        build_model(shared)


# dots.3 Note: indexed layers (d_c 32, d_r 8, 4 heads) and sliding-window layers (d_c 48, d_r 4, 2 heads, a window of
# 8 tokens) of their own dims, the RoPE key RMS-normed before RoPE, a per-head output gate.
DOTS = "model=tiny_dots3_note"


@pytest.fixture(scope="module")
def dots():
    """index_topk above the context: an indexer's top-k can flip between near-equal keys under any cache error, which
    the comparison below is not about."""
    return build_model(compose(DOTS, "model.config.text_config.index_topk=64").model)


def test_dots_layers_are_stored_at_their_own_dims_and_slide(dots):
    """Each layer at its (d_c, d_r); a sliding-window layer keeps every token and masks beyond its window: greedy
    decoding past the window with an INT8 cache stays within INT8 rounding of the unquantized cache, which equals
    transformers' own (test_equivalence)."""
    assert latent_dims(dots)["layer_dims"] == [(32, 8), (32, 8), (48, 4), (48, 4)]
    cfg = quant_cfg("int8_joint", *TINY)
    cache = quantized_cache(dots, cfg)
    ids = prompt_ids(24)
    with torch.no_grad():
        out = dots.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0, output_scores=True,
                            return_dict_in_generate=True, **cache_kwargs(cache))
        ref = dots.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0, output_scores=True,
                            return_dict_in_generate=True, **cache_kwargs(new_cache(dots)))
    assert torch.equal(out.sequences, ref.sequences)
    assert max(float((a - b).abs().max()) for a, b in zip(out.scores, ref.scores)) < 5e-2
    for i, layer in enumerate(cache.latent_layers):
        d_c, d_r = (32, 8) if i < 2 else (48, 4)
        assert (layer.fmt.d_c, layer.fmt.d_r) == (d_c, d_r)
        stored = int(layer.store.lengths.sum())
        window = int(layer.n_sinks.sum() + layer.n_recent.sum() + layer.n_pending.sum())
        per_token = layer.fmt.content.bytes_per_token(d_c, 4) + layer.fmt.rope.bytes_per_token(d_r, 4)
        assert stored + window == 2 * (24 + 11)  # every token, the sliding layers' too
        assert layer.nbytes() == stored * per_token + window * (d_c + d_r) * 4


@pytest.mark.parametrize("dropped", ["gated", "key_norm"])
def test_dots_gate_and_rope_key_norm_are_applied(monkeypatch, dropped):
    """Negative controls: without the per-head output gate, or without the RoPE key's norm, the absorbed path leaves
    transformers' logits."""
    reference = build_model(compose(DOTS).model, absorbed=False, attn_implementation="eager", dtype="float32")
    with torch.no_grad():  # the norm's weight away from its initial ones, as a trained checkpoint has it
        for layer in reference.model.language_model.layers:
            layer.self_attn.k_rope_only_layernorm.weight.uniform_(0.5, 1.5)
    absorbed = absorb(copy.deepcopy(reference))
    ids, mask = make_batch(512, 2, 32, 5, seed=0)
    m = compare(reference, absorbed, ids, mask, decode_steps=12)
    assert m["prefill_max_abs_logit_diff"] <= 1e-4 and m["decode_max_abs_logit_diff"] <= 1e-4, m
    monkeypatch.setattr(families.Dots3NoteFamily, dropped, lambda self, attn, *args: args[-1] if dropped ==
                        "key_norm" else args[0])
    with torch.no_grad():
        diff = reference(ids, attention_mask=mask).logits - absorbed(ids, attention_mask=mask).logits
    assert diff[mask.bool()].abs().max() > 1e-2, dropped


def test_dots_rope_transforms_fold_into_the_norm_or_are_refused(dots):
    """A scale per RoPE pair folds into the RoPE key norm's weight (function unchanged: test_transforms); QuantMLA's
    rotation within pairs cannot pass the norm and is refused by name before any weight is read."""
    cfg = compose(DOTS, "quant=int4_joint", *TINY, "transform=quantmla")
    with pytest.raises(ValueError, match=r"transform=quantmla \(transform.rope.kind=pairwise\) on dots3_note: the "
                                         r"RoPE key is RMS-normed before RoPE .*pair_scale or none"):
        validate(cfg, model_dims(cfg.model))
    ok = compose(DOTS, "quant=int4_joint", *TINY, "transform=quantmla", "transform.rope.kind=pair_scale")
    validate(ok, model_dims(ok.model))


def test_verify_reports_a_refused_kind_and_passes(tmp_path):
    """experiment=verify on dots.3 Note: every kind it folds leaves the function unchanged, QuantMLA's pair rotation
    is listed as refused with its reason, and the stage passes."""
    from mla_quant.stages import verify

    result = verify.run(compose(DOTS, "experiment=verify"), tmp_path)
    assert result.ok and result.metrics["verify/dots3_note/quantmla/refused"] == 1.0
    assert result.metrics["verify/dots3_note/smoothquant/logits_rel_err"] <= 1e-5
    assert "dots3_note x quantmla refused: " in (tmp_path / "verify.md").read_text()
