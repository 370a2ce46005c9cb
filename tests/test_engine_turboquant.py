"""vLLM's TurboQuant-MLA presets (quant=turboquant_4bit_nc / turboquant_3bit_nc / turboquant_k3v4_nc): each rule of
the format checked against an independent construction (the Hadamard matrix of mla_quant.transforms, a Lloyd-Max
solution on a fine grid, nearest-level coding by brute force, the bit stream read bit by bit), the engine's token
record, the bytes of a cache at DeepSeek's dims, and the refusals."""

from __future__ import annotations

import math

import pytest
import torch
from test_quant_cache import compose, quant_cfg

from mla_quant.cache.bytes import load_quant_option
from mla_quant.models.absorbed import cache_kwargs, quantized_cache
from mla_quant.prepare import build_model
from mla_quant.quant.codecs.codebook import gaussian_codebook
from mla_quant.quant.codecs.turboquant import engine_levels, from_record, tq_decode, tq_encode, to_record
from mla_quant.quant.formats import cache_format
from mla_quant.transforms.hadamard import sylvester_hadamard

PRESETS = {"turboquant_4bit_nc": (4, 292), "turboquant_3bit_nc": (3, 228), "turboquant_k3v4_nc": (3, 228)}


@pytest.mark.parametrize(("d", "bits"), [(512, 4), (512, 3), (64, 4)])
def test_levels_are_the_lloyd_max_levels_of_n01d(d, bits):
    """The engine's trapezoidal solution equals a Lloyd-Max solution of the unit normal on a fine grid, scaled by
    1/sqrt(d), to 2e-3 of the outermost level; ascending and symmetric."""
    levels = torch.tensor(engine_levels(d, bits), dtype=torch.float64)
    ref = gaussian_codebook(bits) / math.sqrt(d)
    assert (levels[1:] > levels[:-1]).all()
    torch.testing.assert_close(levels, -levels.flip(0), rtol=0, atol=1e-12)
    assert (levels - ref).abs().max() <= 2e-3 * ref.abs().max()


@pytest.mark.parametrize(("d", "bits"), [(512, 4), (512, 3), (64, 4)])
def test_codes_and_scale_follow_the_rules(d, bits):
    """Codes: the nearest level of each coordinate of x / ||x|| rotated by H (brute force, away from the midpoints,
    where float32 and float64 may round apart); scale: ||x|| over the norm of the codes' bfloat16 levels, float16;
    the stream LSB first; read back: the levels times the scale, rotated back."""
    x = torch.randn(64, d, generator=torch.Generator().manual_seed(bits)) * 3
    parts = tq_encode(x, bits)
    packed = parts["codes"]
    assert packed.shape == (64, math.ceil(d * bits / 8)) and parts["scales"].dtype == torch.float16
    stream = ((packed.long()[..., None] >> torch.arange(8)) & 1).reshape(64, -1)  # bit k of byte j at 8 j + k
    codes = (stream[:, : d * bits].reshape(64, d, bits) << torch.arange(bits)).sum(-1)
    levels = torch.tensor(engine_levels(d, bits), dtype=torch.float64)
    y = (x.double() / x.double().norm(dim=-1, keepdim=True)) @ sylvester_hadamard(d)
    nearest = (y[..., None] - levels).abs().argmin(-1)
    mids = (levels[1:] + levels[:-1]) / 2
    clear = ((y[..., None] - mids).abs() > 1e-6).all(-1)
    assert clear.float().mean() > 0.99 and torch.equal(codes[clear], nearest[clear])
    c = torch.tensor(engine_levels(d, bits), dtype=torch.float32).bfloat16().float()[codes]
    want = (x.norm(dim=-1) / c.norm(dim=-1)).half()
    assert torch.equal(parts["scales"][:, 0], want)
    back = tq_decode(parts, d, bits, torch.float64)
    torch.testing.assert_close(back, (c.double() * want.double()[:, None]) @ sylvester_hadamard(d), rtol=1e-5,
                               atol=1e-5)
    err = (back - x.double()).norm() / x.double().norm()
    assert err < {4: 0.11, 3: 0.2}[bits]  # Lloyd-Max MSE of the unit normal: 0.0095 (4 bits), 0.0345 (3 bits)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_token_record_and_cache_bytes_at_deepseek_dims(preset):
    """The engine's record: [content codes | float16 scale | RoPE codes | float16 scale], 292 or 228 bytes; a cache at
    d_c 512, d_r 64 holds exactly that per token."""
    bits, total = PRESETS[preset]
    fmt = cache_format(load_quant_option(preset), 512, 64)
    assert (fmt.content.bits, fmt.rope.bits) == (bits, 4)
    g = torch.Generator().manual_seed(0)
    c, r = torch.randn(8, 512, generator=g), torch.randn(8, 64, generator=g)
    content, rope = fmt.content.encode(c), fmt.rope.encode(r)
    record = to_record(content, rope)
    assert record.shape == (8, total) and record.dtype == torch.uint8
    at = 512 * bits // 8
    assert torch.equal(record[:, at:at + 2], content["scales"].view(torch.uint8).reshape(8, 2))  # little-endian
    back_c, back_r = from_record(record, 512, bits, 64)
    for a, b in ((back_c, content), (back_r, rope)):
        assert torch.equal(a["codes"], b["codes"]) and torch.equal(a["scales"], b["scales"])
    from mla_quant.cache import cache_layer_factory

    layer = cache_layer_factory(load_quant_option(preset), 512, 64)()
    layer.append(torch.randn(2, 24, 512, generator=g), torch.randn(2, 24, 64, generator=g))
    assert layer.nbytes() == 2 * 24 * total


def test_a_tiny_model_decodes_through_the_format():
    """tiny DeepSeek-V3 (d_c 32, d_r 8: 18 + 6 bytes per token): prefill and decode read back what was stored."""
    model = build_model(compose("model=tiny_deepseek_v3").model)
    cache = quantized_cache(model, quant_cfg("turboquant_4bit_nc"))
    ids = torch.randint(5, 500, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids[:, :29], **cache_kwargs(cache))
        model(ids[:, 29:], **cache_kwargs(cache))
    assert cache.bytes_per_token_per_layer() == 24.0
    layer = cache.latent_layers[0]
    content, rope = layer.read()
    parts = layer.stored_parts("content")
    torch.testing.assert_close(content, tq_decode(parts, 32, 4, content.dtype))


@pytest.mark.parametrize(("override", "match"), [
    ("content.group_size=32", "group_size=32: format=turboquant keeps one scale per token"),
    ("content.scale_dtype=fp32", "scale_dtype='fp32': format=turboquant stores its scale as float16"),
    ("content.bits=2", "bits=2 is not a width of format=turboquant"),
])
def test_settings_the_format_cannot_take_are_refused_by_name(override, match):
    with pytest.raises(ValueError, match=match):
        cache_format(quant_cfg("turboquant_4bit_nc", f"quant.{override}"), 512, 64)


def test_a_dimension_that_is_not_a_power_of_two_is_refused():
    """The default toy (d_c 96) cannot take the engine's rotation: refused by name before any model work."""
    with pytest.raises(ValueError, match="power-of-two dimension; the path has 96 dims"):
        cache_format(quant_cfg("turboquant_4bit_nc"), 96, 16)
