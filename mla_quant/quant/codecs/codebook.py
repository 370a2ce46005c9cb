"""format=codebook: a norm per token and a Lloyd-Max Gaussian level per coordinate (TurboQuant's MSE quantizer)."""

from __future__ import annotations

import functools

import torch

from mla_quant.quant import packing
from mla_quant.quant.codecs.base import SCALE_BYTES, Codec, register
from mla_quant.quant.quantizers import INT_BITS, check_bits, check_scale_dtype, load_scale, store_scale


@register
class CodebookCodec(Codec):
    """TurboQuant's MSE quantizer: one norm per token (in `scale_dtype`) and per coordinate a `bits`-bit index into
    the Lloyd-Max levels of a unit Gaussian (the coordinates of a randomly rotated unit vector, times sqrt(d))."""

    name = "codebook"
    recodes_content = True
    widths = INT_BITS

    def check(self, fmt, where):
        super().check(fmt, where)
        check_scale_dtype(fmt.scale_dtype)
        if fmt.group_size is not None:
            raise ValueError(f"{where}.group_size={fmt.group_size!r}: format=codebook keeps one norm per token; "
                             f"allowed: null")

    def bytes_per_token(self, fmt, d, act_bytes):
        return packing.packed_dim(d, fmt.bits) + SCALE_BYTES[fmt.scale_dtype]

    def encode(self, fmt, x, tensor_scale):
        codes, norms = codebook_quantize(x, fmt.bits, fmt.scale_dtype)
        return {"codes": packing.pack(codes, fmt.bits, check=False), "scales": norms}

    def decode(self, fmt, parts, d, dtype, tensor_scale):
        codes = packing.unpack(parts["codes"], fmt.bits, d)
        return codebook_dequantize(codes, parts["scales"], fmt.bits, dtype)

    def describe(self, fmt):
        return f"codebook{fmt.bits} (Lloyd-Max) per-token norm {fmt.scale_dtype}"


@functools.cache
def gaussian_codebook(bits: int, iters: int = 200) -> torch.Tensor:
    """The 2^bits Lloyd-Max (MSE-optimal) scalar quantizer levels of a standard normal, ascending (float64).

    Lloyd's iteration on a fine grid of the density: levels -> midpoints -> conditional means."""
    check_bits(bits)
    grid = torch.linspace(-8.0, 8.0, 160_001, dtype=torch.float64)
    pdf = torch.exp(-0.5 * grid**2)
    n = 2**bits
    levels = torch.linspace(-2.5, 2.5, n, dtype=torch.float64) * (1.0 if n > 2 else 0.3)
    for _ in range(iters):
        edges = (levels[1:] + levels[:-1]) / 2
        cell = torch.bucketize(grid, edges)
        mass = torch.zeros(n, dtype=torch.float64).index_add_(0, cell, pdf)
        moment = torch.zeros(n, dtype=torch.float64).index_add_(0, cell, pdf * grid)
        levels = moment / mass
    return levels


def codebook_quantize(x: torch.Tensor, bits: int, scale_dtype: str = "fp16") -> tuple[torch.Tensor, torch.Tensor]:
    """TurboQuant's MSE quantizer: x (..., d) -> codes (..., d) uint8 (nearest Lloyd-Max level of the coordinates
    of sqrt(d) x / ||x||, a unit-variance Gaussian after a random rotation), norms (..., 1) in `scale_dtype`."""
    d = x.shape[-1]
    norm = x.float().norm(dim=-1, keepdim=True)
    norm = torch.where(norm > 0, norm, torch.ones_like(norm))
    stored = store_scale(norm, scale_dtype)
    u = x.float() / load_scale(stored) * d**0.5
    levels = gaussian_codebook(bits).to(u.device, torch.float32)
    codes = torch.bucketize(u, (levels[1:] + levels[:-1]) / 2).to(torch.uint8)
    return codes, stored


def codebook_dequantize(codes: torch.Tensor, norms: torch.Tensor, bits: int,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    levels = gaussian_codebook(bits).to(codes.device, torch.float32)
    d = codes.shape[-1]
    return (levels[codes.long()] / d**0.5 * load_scale(norms)).to(dtype)
