"""Per-sequence semantics of the cache: a prompt gives the same logits alone and inside a left- or right-padded
batch, for every quant option (the protected region is each sequence's own first and last real tokens), prefill
and decode; overflowing scales are refused, naming the layer and path."""

import pytest
import torch
from omegaconf import OmegaConf
from conftest import greedy_alone_and_in_batch

from mla_quant.cache import LatentCacheLayer, cache_layer_factory
from mla_quant.cache.bytes import load_quant_option
from mla_quant.models.absorbed import cache_kwargs, quantized_cache
from mla_quant.toy.model import load_toy_model

OPTIONS = ["bf16", "fp8_flat", "fp8_ds_mla", "int8_joint", "int4_content", "int4_joint", "int2_content_int4_rope"]
TOY_GROUPS = {"wide": 32, "narrow": 32}
PROMPT, OTHER, PAD = 150, 190, 23  # the prompt is shorter than its batch mate: it gets padded


@pytest.fixture(scope="module")
def toy():
    return load_toy_model()


def quant(option: str, **extra):
    # a window short enough that both prompts have quantized tokens: 4 sinks + 32 recent
    return OmegaConf.merge(load_quant_option(option, groups=TOY_GROUPS), {"protected": {"recent": 32}}, extra)


def logits_of(model, ids, mask, cfg):
    positions = (mask.long().cumsum(1) - 1).clamp(min=0)  # as generate() numbers left-padded rows
    with torch.no_grad():
        return model(ids, attention_mask=mask, position_ids=positions,
                     **cache_kwargs(quantized_cache(model, cfg))).logits


def batches():
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 1024, (PROMPT,), generator=g)
    other = torch.randint(3, 1024, (OTHER,), generator=g)
    pad = OTHER - PROMPT
    left = torch.zeros(2, OTHER, dtype=torch.long)
    left[0, pad:], left[1] = prompt, other
    left_mask = torch.ones_like(left)
    left_mask[0, :pad] = 0
    right = torch.zeros(2, OTHER, dtype=torch.long)
    right[0, :PROMPT], right[1] = prompt, other
    right_mask = torch.ones_like(right)
    right_mask[0, PROMPT:] = 0
    return prompt[None], (left, left_mask, slice(pad, None)), (right, right_mask, slice(0, PROMPT))


@pytest.mark.parametrize("option", OPTIONS)
def test_prompt_alone_equals_prompt_in_padded_batches(toy, option):
    cfg = quant(option)
    prompt, *padded = batches()
    alone = logits_of(toy, prompt, torch.ones_like(prompt), cfg)[0]
    for name, (ids, mask, rows) in zip(("left", "right"), padded):
        got = logits_of(toy, ids, mask, cfg)[0, rows]
        diff = float((got - alone).abs().max())
        assert diff <= 1e-5, f"{option}: {name}-padded batch differs from the prompt alone by {diff:.3g}"
    if option != "bf16":  # the check is sharp: the quantized cache does change the logits
        exact = logits_of(toy, prompt, torch.ones_like(prompt), quant("bf16"))[0]
        assert float((exact - alone).abs().max()) > 1e-4


@pytest.mark.parametrize("option, extra, steps", [
    ("int4_joint", {}, 40), ("int2_content_int4_rope", {}, 40), ("fp8_flat", {}, 40),
    ("int4_joint", {"mode": "serving"}, 40),
])  # through the Triton and C++ kernels: test_kernel and test_cpu_kernel decode a left-padded batch as torch does
def test_greedy_decode_alone_equals_left_padded_batch(toy, option, extra, steps):
    cfg = quant(option, **extra)
    prompt, (ids, mask, _), _ = batches()
    runs = greedy_alone_and_in_batch(toy, prompt, ids, mask, lambda: quantized_cache(toy, cfg), steps)
    assert torch.equal(runs[0][0], runs[1][0]), f"{option}: greedy tokens depend on the padding"
    diff = float((runs[0][1] - runs[1][1]).abs().max())
    assert diff <= 1e-4, f"{option} {extra}: decode logits differ by {diff:.3g} (tokens leave the window)"


def test_regions_are_per_sequence():
    """Sinks are each sequence's first real tokens, whatever its padding; padding is never stored."""
    fmt = OmegaConf.merge(load_quant_option("int4_joint", groups=TOY_GROUPS), {"protected": {"n_sink": 2, "recent": 3}})
    layer = cache_layer_factory(fmt, 96, 16)()
    c, r = torch.randn(2, 10, 96), torch.randn(2, 10, 16)
    valid = torch.ones(2, 10, dtype=torch.bool)
    valid[0, :4] = False  # 4 left pads
    layer.append(c, r, valid)
    assert torch.equal(layer.sinks["content"][0, :2], c[0, 4:6]) and torch.equal(layer.sinks["content"][1], c[1, :2])
    assert layer.n_sinks.tolist() == [2, 2] and layer.n_recent.tolist() == [3, 3]
    assert layer.store.lengths.tolist() == [1, 5]  # 6 - 2 - 3 and 10 - 2 - 3 quantized
    assert torch.equal(layer.recent["content"][0, :3], c[0, 7:])
    assert layer.real_tokens() == 16 and layer.length == 10


def test_overflowing_scales_are_refused_naming_layer_and_path():
    cfg = load_quant_option("int4_joint", groups=TOY_GROUPS)
    layer = cache_layer_factory(OmegaConf.merge(cfg, {"protected": {"n_sink": 0, "recent": 0}}), 96, 16)()
    layer.layer_idx = 3
    c = torch.randn(1, 4, 96)
    c[0, 1, :32] = -1e6  # a group whose minimum (the fp16 zero) is beyond the fp16 range
    with pytest.raises(ValueError, match=r"cache layer 3, quant.content .*zeros \(float16\) overflow.*scale_dtype=fp32"):
        layer.append(c, torch.randn(1, 4, 16))
    wide = cache_layer_factory(OmegaConf.merge(cfg, {"protected": {"n_sink": 0, "recent": 0},
                                                     "content": {"scale_dtype": "fp32"}}), 96, 16)()
    wide.append(c, torch.randn(1, 4, 16))
    assert torch.isfinite(wide.read()[0]).all()


def test_unquantized_layer_stores_only_real_tokens():
    layer = LatentCacheLayer()
    c, r = torch.randn(2, 5, 8), torch.randn(2, 5, 4)
    valid = torch.tensor([[False, False, True, True, True], [True] * 5])
    layer.append(c, r, valid)
    got_c, got_r = layer.read()
    assert torch.equal(got_c[valid], c[valid]) and torch.equal(got_r[valid], r[valid])
    assert layer.nbytes() == 8 * (8 + 4) * 4 and layer.real_tokens() == 8
