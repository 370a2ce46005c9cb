"""Engine formats: SGLang's fp4_e2m1 MLA cache (quant=fp4_e2m1: e2m1 codes on both paths, a power-of-two scale byte
per 16 values, 324 B at 512 + 64). Its rules, each checked against an independent construction: the scale's exponent
is the smallest e with amax / 2^e <= 6 (an all-zero block: the engine's floor, byte 94); each code is the nearest e2m1
magnitude with a value on a midpoint taking the larger one (unlike NVFP4's ties to even), the sign in bit 3 (a small
negative value keeps it), the even element in the low nibble; reading back is value * 2^e exactly; quantizing the
content and RoPE key apart gives the engine's one 576-value row; a cache in the format stores exactly 324 B per token
at DeepSeek's dims and reads back its own grid."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf
from test_quant_cache import compose

from mla_quant.cache.bytes import load_quant_option
from mla_quant.models.absorbed import cache_kwargs, quantized_cache
from mla_quant.prepare import build_model
from mla_quant.quant.codecs import fp4_e2m1
from mla_quant.quant.codecs.nvfp4 import e2m1_codes
from mla_quant.quant.formats import cache_format, fake_quantizer

LEVELS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _wide(n: int, d: int, seed: int = 0) -> torch.Tensor:
    """Blocks of very different scales, one all-zero block, some values on the scaled midpoints."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * torch.exp2(torch.randint(-20, 20, (n, d // 16, 1), generator=g).float()
                                                    ).repeat_interleave(16, -1).reshape(n, d)
    x[0, :16] = 0.0
    x[1, 16:32] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0,
                                -0.25, -5.0, -0.1, 0.1, -0.0, 4.9, 5.1, 1.0])
    return x


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 15, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)


def test_the_scale_is_the_smallest_power_of_two_that_fits_the_block_in_six():
    x = _wide(6, 96)
    scales = fp4_e2m1.fp4_e2m1_encode(x)["scales"]
    assert scales.shape == (6, 6) and scales.dtype == torch.uint8
    amax = x.reshape(6, 6, 16).abs().amax(-1).double()
    for i in range(6):
        for b in range(6):
            if amax[i, b] == 0:
                assert scales[i, b] == 127 + math.ceil(math.log2(1e-10))  # the engine's floor: byte 94
                continue
            e = int(scales[i, b]) - 127
            assert amax[i, b] / 2.0 ** e <= 6 < amax[i, b] / 2.0 ** (e - 1), (i, b)


def test_codes_are_the_nearest_magnitude_with_midpoints_rounding_up():
    x = _wide(6, 96)
    parts = fp4_e2m1.fp4_e2m1_encode(x)
    codes = _unpack(parts["codes"]).long()
    assert torch.equal(parts["codes"] & 15, codes[:, 0::2].to(torch.uint8))  # even element in the low nibble
    e = parts["scales"].double() - 127
    y = (x.double().reshape(6, 6, 16) / torch.exp2(e)[..., None]).reshape(6, 96)
    levels = torch.tensor(LEVELS, dtype=torch.float64)
    dist = (y.abs()[..., None] - levels).abs()
    # the nearest level; of two equally near, the larger (the last index reaching the minimum)
    nearest = 7 - dist.flip(-1).argmin(-1)
    assert torch.equal(codes & 7, nearest)
    assert torch.equal(codes >> 3, (y < 0).long())  # sign: set for every negative value, also one coded as 0
    assert codes[1, 16:32].tolist() == [7, 1, 2, 3, 4, 5, 6, 7, 9, 15, 8, 0, 0, 6, 7, 2]
    # NVFP4's cast takes the even code on a midpoint instead (0.25 -> 0, 2.5 -> 2.0, 5 -> 4.0): the two differ there
    assert e2m1_codes(torch.tensor([0.25, 0.75, 1.75, 2.5, 5.0])).tolist() == [0, 2, 4, 4, 6]
    back = fp4_e2m1.fp4_e2m1_decode(parts, 96, torch.float64)
    want = levels[codes & 7] * torch.where(codes >= 8, -1.0, 1.0) * torch.exp2(e).repeat_interleave(16, -1)
    assert torch.equal(back, want)


def test_the_engine_row_of_576_values_is_the_two_paths_quantized_apart():
    """SGLang quantizes the 512 content and 64 RoPE values of a token separately into one row; a block never spans
    both, so the row equals quantizing the 576 values at once (its other writer): 288 code bytes, 36 scale bytes."""
    g = torch.Generator().manual_seed(1)
    c, r = torch.randn(8, 512, generator=g) * 3, torch.randn(8, 64, generator=g) * 20
    fmt = cache_format(load_quant_option("fp4_e2m1"), 512, 64)
    codes, scales = fp4_e2m1.to_record(fmt.content.encode(c), fmt.rope.encode(r))
    whole = fp4_e2m1.fp4_e2m1_encode(torch.cat([c, r], dim=-1))
    assert codes.shape == (8, 288) and scales.shape == (8, 36)
    assert torch.equal(codes, whole["codes"]) and torch.equal(scales, whole["scales"])
    back_c, back_r = fp4_e2m1.from_record(codes, scales)
    assert torch.equal(fmt.content.decode(back_c, 512, torch.float32), fake_quantizer(fmt.content, 512)(c))
    assert torch.equal(fmt.rope.decode(back_r, 64, torch.float32), fake_quantizer(fmt.rope, 64)(r))


def test_a_cache_in_the_format_stores_324_bytes_per_token_and_reads_them_back():
    model = build_model(compose("model=tiny_deepseek_v2_lite_dims").model)
    cache = quantized_cache(model, load_quant_option("fp4_e2m1"))
    ids = torch.randint(5, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids[:, :23], **cache_kwargs(cache))
        model(ids[:, 23:], **cache_kwargs(cache))
    fmt = cache_format(load_quant_option("fp4_e2m1"), 512, 64)
    assert fmt.content.bytes_per_token(512, 2) + fmt.rope.bytes_per_token(64, 2) == 324
    assert cache_format(load_quant_option("fp4_e2m1"), 96, 16).bytes_per_token() == 48 + 6 + 8 + 1  # the toy's dims
    for layer in cache.latent_layers:
        assert layer.nbytes() == 2 * 24 * 324  # no protected region: every token in the format
        content, rope = layer.read()
        assert torch.equal(content, fake_quantizer(fmt.content, 512)(content))
        assert torch.equal(rope, fake_quantizer(fmt.rope, 64)(rope))


@pytest.mark.parametrize("override, match", [
    ("content.group_size=32", r"quant.content.group_size=32: format=fp4_e2m1 scales every 16 values; allowed: 16"),
    ("rope.scale_dtype=e4m3", r"quant.rope.scale_dtype='e4m3': format=fp4_e2m1 stores E8M0 \(power-of-two\) scales"),
    ("content.symmetric=false", r"quant.content.symmetric=false: format=fp4_e2m1 codes are signed values"),
    ("rope.bits=8", r"quant.rope.bits=8 is not a width of format=fp4_e2m1"),
])
def test_settings_the_format_cannot_take_are_refused_by_name(override, match):
    cfg = OmegaConf.merge(load_quant_option("fp4_e2m1"), OmegaConf.from_dotlist([override]))
    with pytest.raises(ValueError, match=match):
        cache_format(cfg, 512, 64)


def test_a_dimension_off_the_block_is_refused():
    with pytest.raises(ValueError, match="format=fp4_e2m1 scales whole blocks of 16 values; the path has 8 dims"):
        cache_format(load_quant_option("fp4_e2m1"), 32, 8)
