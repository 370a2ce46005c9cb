"""vLLM's TurboQuant-MLA presets (quant=turboquant_4bit_nc / turboquant_3bit_nc / turboquant_k3v4_nc /
turboquant_k8v4): each rule of the format checked against an independent construction (the Hadamard matrix of
mla_quant.transforms, a Lloyd-Max solution on a fine grid, nearest-level coding by brute force, the bit stream read
bit by bit; k8v4's e4m3 codes against torch's own cast, its scale per token against the float32 amax), the engine's
token record, the bytes of a cache at DeepSeek's dims, and the refusals."""

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
from mla_quant.quant.formats import cache_format, fake_quantizer
from mla_quant.quant.quantizers import FP8_DTYPE
from mla_quant.transforms.hadamard import sylvester_hadamard

PRESETS = {"turboquant_4bit_nc": (4, 4, 292), "turboquant_3bit_nc": (3, 4, 228), "turboquant_k3v4_nc": (3, 4, 228),
           "turboquant_k8v4": (8, 8, 578)}  # content bits, RoPE bits, bytes per token at 512 + 64


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
    """The engine's record: [content codes | float16 scale | RoPE codes | float16 scale], 292 or 228 bytes (k8v4: no
    content scale, 578 bytes); a cache at d_c 512, d_r 64 holds exactly that per token."""
    bits, rope_bits, total = PRESETS[preset]
    fmt = cache_format(load_quant_option(preset), 512, 64)
    assert (fmt.content.bits, fmt.rope.bits) == (bits, rope_bits)
    g = torch.Generator().manual_seed(0)
    c, r = torch.randn(8, 512, generator=g), torch.randn(8, 64, generator=g)
    content, rope = fmt.content.encode(c), fmt.rope.encode(r)
    record = to_record(content, rope)
    assert record.shape == (8, total) and record.dtype == torch.uint8
    at = 512 * bits // 8
    if bits == 8:  # k8v4: the content's e4m3 bytes, then the RoPE key's, then its scale
        assert "scales" not in content and torch.equal(record[:, :512], content["codes"])
        assert torch.equal(record[:, 576:], rope["scales"].view(torch.uint8).reshape(8, 2))
    else:
        assert torch.equal(record[:, at:at + 2], content["scales"].view(torch.uint8).reshape(8, 2))  # little-endian
    back_c, back_r = from_record(record, 512, bits, 64, rope_bits)
    for a, b in ((back_c, content), (back_r, rope)):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    from mla_quant.cache import cache_layer_factory

    layer = cache_layer_factory(load_quant_option(preset), 512, 64)()
    layer.append(torch.randn(2, 24, 512, generator=g), torch.randn(2, 24, 64, generator=g))
    assert layer.nbytes() == 2 * 24 * total


@pytest.mark.parametrize(("preset", "nbytes"), [("turboquant_4bit_nc", 24.0), ("turboquant_k8v4", 32 + 8 + 2.0)])
def test_a_tiny_model_decodes_through_the_format(preset, nbytes):
    """tiny DeepSeek-V3 (d_c 32, d_r 8: 18 + 6 bytes per token at 4 bits): prefill and decode read back what was
    stored."""
    model = build_model(compose("model=tiny_deepseek_v3").model)
    cache = quantized_cache(model, quant_cfg(preset))
    ids = torch.randint(5, 500, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids[:, :29], **cache_kwargs(cache))
        model(ids[:, 29:], **cache_kwargs(cache))
    assert cache.bytes_per_token_per_layer() == nbytes
    layer = cache.latent_layers[0]
    content, rope = layer.read()
    fmt = cache_format(quant_cfg(preset), 32, 8)
    torch.testing.assert_close(content, fmt.content.decode(layer.stored_parts("content"), 32, content.dtype))
    torch.testing.assert_close(rope, fmt.rope.decode(layer.stored_parts("rope"), 8, rope.dtype))


def test_k8v4_codes_the_content_as_cast_and_the_rope_key_under_its_float32_scale():
    """k8v4 (the engine's PyTorch writer): the content latent is torch's e4m3 cast of the values clamped to +-448 (the
    layer's static scale 1.0); the RoPE key's scale is its amax / 448 in float32 (amax floored at 1e-8), its codes the
    cast of x times that scale's reciprocal (not x over the float16 scale it stores), the scale stored as float16;
    read back code times the stored scale. Any dimension: the toy's 96 + 16 take 96 + 16 + 2 bytes."""
    fmt = cache_format(quant_cfg("turboquant_k8v4"), 96, 16)
    assert fmt.bytes_per_token() == 96 + 16 + 2
    g = torch.Generator().manual_seed(3)
    c = torch.randn(64, 96, generator=g) * torch.exp2(torch.randint(-12, 10, (64, 1), generator=g).float())
    c[0, 0], c[0, 1] = 1000.0, -3000.0  # beyond e4m3: saturate at +-448
    content = fmt.content.encode(c)
    assert content.keys() == {"codes"}
    assert torch.equal(content["codes"].view(FP8_DTYPE).float(), c.clamp(-448, 448).to(FP8_DTYPE).float())
    assert content["codes"].view(FP8_DTYPE)[0, :2].float().tolist() == [448.0, -448.0]
    assert torch.equal(fake_quantizer(fmt.content, 96)(c), c.clamp(-448, 448).to(FP8_DTYPE).float())

    r = torch.randn(512, 16, generator=g) * torch.exp2(torch.randint(-8, 8, (512, 1), generator=g).float())
    r[0] = 0.0
    rope = fmt.rope.encode(r)
    s32 = r.double().abs().amax(-1, keepdim=True).clamp(min=1e-8).float() / 448
    assert torch.equal(rope["scales"], s32.half())
    assert torch.equal(rope["codes"].view(FP8_DTYPE), (r * (1.0 / s32)).clamp(-448, 448).to(FP8_DTYPE))
    by_stored = (r / rope["scales"].float()).clamp(-448, 448).to(FP8_DTYPE)
    assert (rope["codes"].view(FP8_DTYPE).float() != by_stored.float()).any()  # the engine's rule is not that one
    back = fmt.rope.decode(rope, 16, torch.float64)
    assert torch.equal(back, rope["codes"].view(FP8_DTYPE).double() * rope["scales"].double())
    assert (back - r.double()).abs().max() <= (r.double().abs().amax(-1, keepdim=True) / 14).max()


@pytest.mark.parametrize(("override", "match"), [
    ("content.group_size=32", "group_size=32: format=turboquant keeps one scale per token"),
    ("content.scale_dtype=fp32", "scale_dtype='fp32': format=turboquant stores its scale as float16"),
    ("content.bits=2", "bits=2 is not a width of format=turboquant"),
    ("content.symmetric=false", "symmetric=false: format=turboquant codes are signed levels"),
    ("content.granularity=unscaled", "granularity='unscaled': format=turboquant at 4 bits keeps a float16 scale"),
])
def test_settings_the_format_cannot_take_are_refused_by_name(override, match):
    with pytest.raises(ValueError, match=match):
        cache_format(quant_cfg("turboquant_4bit_nc", f"quant.{override}"), 512, 64)


def test_a_dimension_that_is_not_a_power_of_two_is_refused():
    """The default toy (d_c 96) cannot take the engine's rotation: refused by name before any model work."""
    with pytest.raises(ValueError, match="power-of-two dimension; the path has 96 dims"):
        cache_format(quant_cfg("turboquant_4bit_nc"), 96, 16)
