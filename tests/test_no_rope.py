"""A model without a RoPE key (qk_rope_head_dim 0: GLM-5.3, model_type glm5_next): the cache holds the content latent
alone. A format's RoPE part is skipped by name and stores nothing (bytes exactly those of the content path), the
sparse indexer's keys are counted apart, padding in a batch changes no row, and what cannot act on a missing path is
refused by name. The family's equivalence, sensitivity, transforms and calibration capture run in the suites that
take every tiny model."""

from __future__ import annotations

import pytest
import torch
from conftest import alone_and_padded, prefill_logits, prompt_ids
from test_quant_cache import TINY, compose, quant_cfg

from mla_quant.cache.bytes import HeldBytes
from mla_quant.models.absorbed import new_cache, quantized_cache
from mla_quant.prepare import build_model
from mla_quant.stages import sensitivity


@pytest.fixture(scope="module")
def model():
    return build_model(compose("model=tiny_glm5_next").model)


def test_a_rope_part_is_skipped_by_name_and_stores_nothing(model):
    ids = prompt_ids()
    with pytest.warns(UserWarning, match=r"quant=int4_joint: the model has no RoPE key .*quant.rope \(int4 .*skipped"):
        joint = quantized_cache(model, quant_cfg("int4_joint", *TINY))
    content_only = quantized_cache(model, quant_cfg("int4_content", *TINY))
    exact = new_cache(model)
    a, b, c = (prefill_logits(model, cache, ids) for cache in (joint, content_only, exact))
    assert torch.equal(a, b)  # int4_joint on this model is int4_content
    assert (a - c).abs().max() > 1e-3  # and it does quantize
    assert joint.nbytes() == content_only.nbytes() > 0
    for layer in joint.latent_layers:
        assert layer.fmt.d_r == 0 and not layer.fmt.rope.quantized
        assert layer.store.layouts["rope"].token_bytes == 0  # the RoPE path's page holds nothing
    # the content path alone: codes + scales + zeros of the quantized tokens, the protected tokens in float32
    fmt = joint.latent_layers[0].fmt
    for layer in joint.latent_layers:
        stored = int(layer.store.lengths.sum())
        window = int(layer.n_sinks.sum() + layer.n_recent.sum() + layer.n_pending.sum())
        assert layer.nbytes() == stored * fmt.content.bytes_per_token(32, 4) + window * 32 * 4


def test_the_indexer_keys_are_counted_apart(model):
    ids = prompt_ids()
    cache = new_cache(model)
    prefill_logits(model, cache, ids)
    keys = [layer.indexer_keys for layer in cache.latent_layers]
    assert keys[0] is not None and keys[1] is None  # layer 1 is "shared": it reuses layer 0's top-k
    assert cache.indexer_bytes() == 2 * 40 * keys[0].shape[-1] * 4
    held = HeldBytes()
    held.add(cache)
    figures = held.metrics("cache")
    assert figures["cache/indexer_B_per_token_per_layer"] == cache.indexer_bytes() / (2 * 2 * 40)
    assert figures["cache/held_B_per_token_per_layer"] == 32 * 4  # the latent: d_c values, no RoPE key


@pytest.fixture(scope="module")
def dense_model():
    """The tiny GLM-5.3 with index_topk above the context: transformers' own pooled indexer is batch-dependent at a
    sequence's incomplete last pool when it selects (a row's result then depends on the longest row beside it, in
    transformers' forward as in ours); selecting everything, a row's result is its own."""
    return build_model(compose("model=tiny_glm5_next", "model.config.text_config.index_topk=64").model)


@pytest.mark.parametrize("option", ["int4_joint", "hf_hqq_int4"])
def test_padding_in_a_batch_changes_no_row(dense_model, option):
    """Greedy decoding of a prompt alone and left-padded in a batch beside a longer one: the same tokens, and scores
    within rounding."""
    model = dense_model
    cfg = quant_cfg(option, *TINY) if option.startswith("int") else quant_cfg(option, "peer.group_size=8",
                                                                             "peer.residual_length=16")
    runs = alone_and_padded(model, lambda: quantized_cache(model, cfg))
    assert torch.equal(runs[0][0], runs[1][0])
    assert float((runs[0][1] - runs[1][1]).abs().max()) <= 1e-3  # as tests/test_peers.py: float order, 4-bit steps


def test_what_cannot_act_on_a_missing_rope_key_is_refused_by_name(model, tmp_path):
    with pytest.raises(ValueError, match=r"hf_quanto_int4: the model has no RoPE key .*quanto.*allowed on this model"):
        quantized_cache(model, quant_cfg("hf_quanto_int4", "peer.group_size=8"))
    cfg = compose("model=tiny_glm5_next", "experiment=sensitivity", "task.rope_groups=2")
    with pytest.raises(ValueError, match=r"task.rope_groups=2: the model has no RoPE key .*task.rope_groups=null"):
        sensitivity.validate(cfg)
