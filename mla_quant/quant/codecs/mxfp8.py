"""format=mxfp8: MXFP8 as vLLM's DeepSeek-V4 cache stores its attention vector, RoPE part included (vLLM PR #56893):
e4m3 values with one E8M0 scale (a power of two, stored as its biased exponent byte) per block of 32 consecutive
values. Per block, e = ceil(log2(max(amax, 1e-4) / 448)) (clamped to the E8M0 range), so amax / 2^e <= 448 and
nothing saturates; codes = e4m3(x / 2^e) (round to nearest even); scale byte = e + 127. Read back x = code * 2^e
(exact in float32). d + ceil(d / 32) bytes per token: 528 at V4's 512 values, 594 at DeepSeek-V3's 512 + 64. vLLM's
dims are whole blocks; a path whose dimension is not a multiple of 32 (the toy's 16-dim RoPE key) ends in one
shorter block with its own scale (docs/cache.md, "Engine formats")."""

from __future__ import annotations

import math

import torch

from mla_quant.quant.codecs.base import Codec, register
from mla_quant.quant.quantizers import FP8_DTYPE, FP8_MAX

BLOCK = 32  # values per E8M0 scale
AMAX_FLOOR = 1e-4  # the amax below which a block takes the scale of this amax (an all-zero block gets 2^-22)
E8M0_BIAS = 127
E8M0_MIN, E8M0_MAX = -127, 127  # exponents an E8M0 byte holds (255 is NaN)


def n_blocks(d: int) -> int:
    return math.ceil(d / BLOCK)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """x (..., d) float32 -> (..., n_blocks, 32), the last block padded with zeros."""
    d = x.shape[-1]
    pad = n_blocks(d) * BLOCK - d
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], -1, BLOCK)


def e8m0_exponents(amax: torch.Tensor) -> torch.Tensor:
    """Per block, the scale's exponent e (int32): ceil(log2(max(amax, 1e-4) / 448)), within the E8M0 range."""
    e = torch.ceil(torch.log2(torch.clamp(amax.float(), min=AMAX_FLOOR) / FP8_MAX))
    return e.clamp(E8M0_MIN, E8M0_MAX).to(torch.int32)


def mxfp8_encode(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """x (..., d) -> {"codes": (..., d) uint8 e4m3 bits, "scales": (..., ceil(d/32)) uint8 biased exponents}."""
    d = x.shape[-1]
    blocks = _blocks(x.float())
    e = e8m0_exponents(blocks.abs().amax(-1))
    scaled = blocks * torch.exp2(-e.float())[..., None]
    codes = scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(torch.uint8)
    return {"codes": codes.reshape(*x.shape[:-1], -1)[..., :d], "scales": (e + E8M0_BIAS).to(torch.uint8)}


def mxfp8_decode(parts, d: int, dtype: torch.dtype) -> torch.Tensor:
    """The stored codes (..., d) and scales (..., ceil(d/32)) -> x_hat (..., d) in `dtype`."""
    values = _blocks(parts["codes"].view(FP8_DTYPE).float())
    scale = torch.exp2(parts["scales"].float() - E8M0_BIAS)
    out = (values * scale[..., None]).reshape(*values.shape[:-2], -1)
    return out[..., :d].to(dtype)


@register
class Mxfp8Codec(Codec):
    """MXFP8 (e4m3 values, an E8M0 power-of-two scale per 32 values), vLLM's DeepSeek-V4 cache layout."""

    name = "mxfp8"
    widths = (8,)
    partial_groups = True  # the toy's 16-dim RoPE key: one block of 16 values with its scale

    def check(self, fmt, where):
        super().check(fmt, where)
        self.check_block_format(fmt, where, BLOCK, "e8m0", "E8M0 (power-of-two) scales")

    def n_groups(self, fmt, d):
        return n_blocks(d)

    def bytes_per_token(self, fmt, d, act_bytes):
        return d + n_blocks(d)  # one e4m3 byte per value, one E8M0 byte per block

    def encode(self, fmt, x, tensor_scale):
        return mxfp8_encode(x)

    def decode(self, fmt, parts, d, dtype, tensor_scale):
        return mxfp8_decode(parts, d, dtype)

    def kernel_unsupported(self, fmt, d):
        return None

    def kernel_spec(self, fmt, d):
        return self.byte_codes_spec("e4m3", BLOCK, "e8m0")

    def describe(self, fmt):
        return "mxfp8 e4m3 g=32 e8m0 scales"
