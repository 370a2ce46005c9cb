"""Engine formats: vLLM's nvfp4_ds_mla cache (NVFP4 content latent, unscaled e4m3 RoPE key, 352 B at 512 + 64).
Its rules, each checked against an independent construction: the e2m1 codes are the nearest representable value
with ties to the even code, saturating at 6 (brute force over the 8 levels); the e4m3 scale is the smallest e4m3
value at or above max(amax / 6, 2^-9), at most 448 (vLLM's round-then-bump, over the whole e4m3 table); the token
record is vLLM's byte order (csrc/libtorch_stable/nvfp4_ds_mla_cache_kernels.cu: codes [0, 256) with the even element
in the low nibble, RoPE [256, 320), block b's scale at 320 + 8 (b % 4) + b // 4), read back here as vLLM's own test
reads it (an e2m1 table and that scale offset); a cache in the format stores and reads back those values, at exactly
352 B per token."""

from __future__ import annotations

import pytest
import torch
from test_quant_cache import compose

from mla_quant.cache.bytes import load_quant_option
from mla_quant.models.absorbed import quantized_cache
from mla_quant.prepare import build_model
from mla_quant.quant.codecs import nvfp4
from mla_quant.quant.formats import cache_format, fake_quantizer

LEVELS = torch.tensor(nvfp4.E2M1_VALUES)


def _e4m3_table() -> torch.Tensor:
    """Every positive finite e4m3fn value, ascending."""
    values = torch.arange(1, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return values.sort().values


def test_e2m1_codes_are_nearest_with_ties_to_even():
    y = torch.cat([torch.linspace(-7, 7, 4001), (LEVELS[1:] + LEVELS[:-1]) / 2, -(LEVELS[1:] + LEVELS[:-1]) / 2])
    codes = nvfp4.e2m1_codes(y)
    dist = (y.abs().clamp(max=6)[:, None] - LEVELS[None]).abs()
    best = dist.min(-1, keepdim=True).values
    candidates = dist == best  # every nearest level; ties go to the even index
    idx = torch.where(candidates[:, 0::2].any(-1), (candidates * (torch.arange(8) % 2 == 0)).float().argmax(-1),
                      candidates.float().argmax(-1))
    assert torch.equal((codes & 7).long(), idx)
    assert torch.equal(codes >= 8, torch.signbit(y))
    assert torch.equal(nvfp4.e2m1_values(codes), torch.where(torch.signbit(y), -1.0, 1.0) * LEVELS[idx])


def test_e4m3_scale_is_the_smallest_at_or_above_its_target():
    table = _e4m3_table()
    amax = torch.cat([torch.tensor([0.0, 1e-9, 6 * 2.0 ** -9, 6 * 448.0, 1e6]), torch.rand(5000) * 3000,
                      table * 6])  # exact e4m3 targets too
    got = nvfp4.e4m3_scales(amax).view(torch.float8_e4m3fn).float()
    want = torch.clamp(amax / 6, min=2.0 ** -9)
    idx = torch.searchsorted(table, want).clamp(max=len(table) - 1)  # first table value >= want, 448 at most
    assert torch.equal(got, table[idx])


def _vllm_dequantize(record: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A 352-byte record read as vLLM's test reads it: the e2m1 table on each nibble (even element low), block b's
    scale at byte 320 + 8 (b % 4) + b // 4, the RoPE key's e4m3 bytes at [256, 320)."""
    packed = record[:, :256]
    codes = torch.stack([packed & 15, packed >> 4], -1).reshape(-1, 512)
    table = torch.tensor([*nvfp4.E2M1_VALUES, *(-v for v in nvfp4.E2M1_VALUES)])
    scales = torch.stack([record[:, 320 + 8 * (b % 4) + b // 4] for b in range(32)], -1)
    scales = scales.view(torch.float8_e4m3fn).float().repeat_interleave(16, -1)
    return table[codes.long()] * scales, record[:, 256:320].view(torch.float8_e4m3fn).float()


def test_the_token_record_is_vllms_byte_order():
    g = torch.Generator().manual_seed(0)
    content = torch.randn(6, 512, generator=g) * torch.logspace(-3, 2, 512)  # blocks of very different ranges
    rope = torch.randn(6, 64, generator=g) * 100
    fmt = cache_format(load_quant_option("nvfp4_ds_mla"), 512, 64)
    assert fmt.content.bytes_per_token(512, 2) + fmt.rope.bytes_per_token(64, 2) == 352
    parts = fmt.content.codec.encode(fmt.content, content, None)
    rope_codes = fmt.rope.codec.encode(fmt.rope, rope, None)["codes"]
    record = nvfp4.to_record(parts, rope_codes)
    assert record.shape == (6, 352) and record.dtype == torch.uint8
    c, r = _vllm_dequantize(record)
    assert torch.equal(c, fake_quantizer(fmt.content, 512)(content))  # bit for bit the framework's read-back
    assert torch.equal(r, fake_quantizer(fmt.rope, 64)(rope))
    assert torch.equal(r, rope.clamp(-448, 448).to(torch.float8_e4m3fn).float())  # unscaled, saturating
    back, back_rope = nvfp4.from_record(record)
    assert torch.equal(back["codes"], parts["codes"]) and torch.equal(back["scales"], parts["scales"])
    assert torch.equal(back_rope, rope_codes)


def test_a_cache_in_the_format_stores_352_bytes_per_token_and_reads_them_back():
    model = build_model(compose("model=tiny_deepseek_v2_lite_dims").model)
    cache = quantized_cache(model, load_quant_option("nvfp4_ds_mla"))
    ids = torch.randint(5, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    from mla_quant.models.absorbed import cache_kwargs

    with torch.no_grad():
        model(ids, **cache_kwargs(cache))
    fmt = cache_format(load_quant_option("nvfp4_ds_mla"), 512, 64)
    for layer in cache.latent_layers:
        assert layer.nbytes() == 2 * 24 * 352  # no protected region: every token in the format
        content, rope = layer.read()
        assert torch.equal(content, fake_quantizer(fmt.content, 512)(content))  # already on the grid: a fixed point
        assert torch.equal(rope, fake_quantizer(fmt.rope, 64)(rope))


@pytest.mark.parametrize("override, match", [
    ("content.group_size=32", r"quant.content.group_size=32: format=nvfp4 scales every 16 values; allowed: 16"),
    ("content.scale_dtype=fp16", r"quant.content.scale_dtype='fp16': format=nvfp4 stores e4m3 scales"),
    ("content.bits=2", r"quant.content.bits=2 is not a width of format=nvfp4"),
    ("rope.group_size=16", r"quant.rope.group_size=16: granularity=unscaled stores no scale"),
])
def test_settings_the_format_cannot_take_are_refused_by_name(override, match):
    from omegaconf import OmegaConf

    cfg = OmegaConf.merge(load_quant_option("nvfp4_ds_mla"), OmegaConf.from_dotlist([override]))
    with pytest.raises(ValueError, match=match):
        cache_format(cfg, 512, 64)
    with pytest.raises(ValueError, match=r"format=nvfp4 packs two codes per byte in blocks of 16; the path has 48"):
        cache_format(load_quant_option("nvfp4_ds_mla"), 48, 64)
