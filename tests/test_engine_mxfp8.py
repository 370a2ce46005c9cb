"""Engine formats: MXFP8 (vLLM's DeepSeek-V4 cache rule on both paths: e4m3 values, an E8M0 scale per 32 values,
594 B at 512 + 64). Its rules, each checked against an independent construction: the scale's exponent is the smallest
e with amax / 2^e <= 448 (so nothing saturates; amax floored at 1e-4); the codes are torch's own e4m3 cast of
x / 2^e, bit for bit; the scale byte is e + 127; reading back is code * 2^e exactly; a dimension that is not a
multiple of 32 ends in one shorter block with its own scale; a cache in the format stores exactly 594 B per token
at DeepSeek's dims and reads back its own grid."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from test_quant_cache import compose

from mla_quant.cache.bytes import load_quant_option
from mla_quant.models.absorbed import cache_kwargs, quantized_cache
from mla_quant.prepare import build_model
from mla_quant.quant.codecs import mxfp8
from mla_quant.quant.formats import cache_format, fake_quantizer


def _wide(n: int, d: int, seed: int = 0) -> torch.Tensor:
    """Values over many decades, blocks of very different scales, some exact zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * torch.exp2(torch.randint(-30, 30, (n, d), generator=g).float())
    x[0, :40] = 0.0
    return x


def test_the_scale_is_the_smallest_power_of_two_that_keeps_every_code_finite():
    x = _wide(64, 512)
    parts = mxfp8.mxfp8_encode(x)
    e = parts["scales"].long() - mxfp8.E8M0_BIAS  # (64, 16)
    amax = x.reshape(64, 16, 32).abs().amax(-1).clamp(min=mxfp8.AMAX_FLOOR).double()
    assert bool((amax / torch.exp2(e.double()) <= 448).all())
    assert bool((amax / torch.exp2(e.double() - 1) > 448).all())  # one step smaller would saturate
    for exact in (448.0, 448.0 * 2**-5, 448.0 * 2**7):  # amax exactly 448 * 2^k: e = k, no rounding up
        block = torch.zeros(1, 32)
        block[0, 3] = -exact
        assert int(mxfp8.mxfp8_encode(block)["scales"][0, 0]) - 127 == round(torch.log2(torch.tensor(exact / 448)).item())


def test_codes_are_the_e4m3_cast_of_the_scaled_values_and_read_back_exactly():
    x = _wide(32, 96, seed=1)
    parts = mxfp8.mxfp8_encode(x)
    step = torch.exp2(parts["scales"].float() - 127).repeat_interleave(32, dim=-1)  # (32, 96)
    expect = (x / step).to(torch.float8_e4m3fn).view(torch.uint8)  # torch's cast: round to nearest even
    assert torch.equal(parts["codes"], expect)
    back = mxfp8.mxfp8_decode(parts, 96, torch.float32)
    assert torch.equal(back, parts["codes"].view(torch.float8_e4m3fn).float() * step)
    again = mxfp8.mxfp8_decode(mxfp8.mxfp8_encode(back), 96, torch.float32)
    assert torch.equal(again, back)  # the grid is a fixed point (a block may take a smaller exponent, same values)


def test_a_dimension_off_the_block_ends_in_one_shorter_block():
    x = _wide(8, 16, seed=2) * 0 + torch.linspace(-3, 5, 16)
    parts = mxfp8.mxfp8_encode(x)
    assert parts["codes"].shape == (8, 16) and parts["scales"].shape == (8, 1)
    assert int(parts["scales"][0, 0]) - 127 == -6  # 5 / 2^-6 = 320 <= 448 < 640
    fmt = cache_format(load_quant_option("mxfp8"), 96, 16)  # the toy's dims
    assert fmt.rope.bytes_per_token(16, 2) == 16 + 1 and fmt.content.bytes_per_token(96, 2) == 96 + 3


def test_a_cache_in_the_format_stores_594_bytes_per_token_and_reads_them_back():
    model = build_model(compose("model=tiny_deepseek_v2_lite_dims").model)
    cache = quantized_cache(model, load_quant_option("mxfp8"))
    ids = torch.randint(5, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids, **cache_kwargs(cache))
    fmt = cache_format(load_quant_option("mxfp8"), 512, 64)
    assert fmt.content.bytes_per_token(512, 2) + fmt.rope.bytes_per_token(64, 2) == 594
    for layer in cache.latent_layers:
        assert layer.nbytes() == 2 * 24 * 594  # no protected region: every token in the format
        content, rope = layer.read()
        assert torch.equal(content, fake_quantizer(fmt.content, 512)(content))
        assert torch.equal(rope, fake_quantizer(fmt.rope, 64)(rope))


@pytest.mark.parametrize("override, match", [
    ("content.group_size=16", r"quant.content.group_size=16: format=mxfp8 scales every 32 values; allowed: 32"),
    ("rope.scale_dtype=fp16", r"quant.rope.scale_dtype='fp16': format=mxfp8 stores E8M0 \(power-of-two\) scales"),
    ("content.symmetric=false", r"quant.content.symmetric=false: format=mxfp8 codes are signed values"),
    ("rope.bits=4", r"quant.rope.bits=4 is not a width of format=mxfp8"),
])
def test_settings_the_format_cannot_take_are_refused_by_name(override, match):
    cfg = OmegaConf.merge(load_quant_option("mxfp8"), OmegaConf.from_dotlist([override]))
    with pytest.raises(ValueError, match=match):
        cache_format(cfg, 512, 64)
