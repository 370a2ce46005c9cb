"""format=turboquant: one path as vLLM's TurboQuant-MLA cache stores it (`turboquant_4bit_nc`, `turboquant_3bit_nc`,
`turboquant_k3v4_nc`; vLLM PR #41803, `triton_mla_tq.py` and `quantization/turboquant/`). Per token, of a d-dim
vector (d a power of two):

    n = ||x||_2 (float32), u = x / max(n, 1e-8)
    y = u H                      H = the Sylvester Hadamard matrix / sqrt(d) (orthonormal, symmetric; no random
                                 signs)
    code_i = the index of y_i among the Lloyd-Max levels of N(0, 1/d) (`engine_levels`): the number of midpoints
             between consecutive levels below y_i (a value on a midpoint takes the lower level), `bits` bits each,
             packed as an LSB-first bit stream (mla_quant/quant/packing.py: vLLM's order)
    s = n / max(||c||_2, 1e-8)   c = the levels of the codes in bfloat16 ("norm correction", the `_nc` presets)
    stored: the packed codes, then s as float16: ceil(d * bits / 8) + 2 bytes

Read back x_hat = (c * s) H, in float32: the engine attends in the rotated space with H folded into its up-projection
weights, which is the same product. At d_c 512, d_r 64 with a 4-bit RoPE key: 258 + 34 = 292 B (4-bit content), 194
+ 34 = 228 B (3-bit). No calibration, no protected region."""

from __future__ import annotations

import functools
import math

import torch

from mla_quant.quant import packing
from mla_quant.quant.codecs.base import Codec, register

MIN_NORM = 1e-8  # the engine's floor on a token's norm and on its codes' norm


@functools.cache
def engine_levels(d: int, bits: int, iters: int = 200, tol: float = 1e-10) -> tuple[float, ...]:
    """The 2^bits Lloyd-Max levels of N(0, 1/d) as the engine computes them (`centroids.py`): levels started evenly
    over +-3.5 sigma (cell centres); each round, every cell's conditional mean by the trapezoidal rule with 200 steps
    between the midpoints of neighbouring levels (the outer cells out to +-10.5 sigma), float64; stopped after
    `iters` rounds or before the first round that moves no level by `tol` or more (that round's levels are not
    taken)."""
    n = 2 ** bits
    var = 1.0 / d
    sigma = math.sqrt(var)
    norm = 1.0 / math.sqrt(2 * math.pi * var)

    def density(x):
        return norm * math.exp(-x * x / (2 * var))

    def trapezoid(f, a, b, steps=200):
        h = (b - a) / steps
        total = 0.5 * (f(a) + f(b))
        for i in range(1, steps):
            total += f(a + i * h)
        return total * h

    lo, hi = -3.5 * sigma, 3.5 * sigma
    levels = [lo + (hi - lo) * (i + 0.5) / n for i in range(n)]
    for _ in range(iters):
        cuts = [lo * 3] + [(levels[i] + levels[i + 1]) / 2.0 for i in range(n - 1)] + [hi * 3]
        moved = []
        for i in range(n):
            mass = trapezoid(density, cuts[i], cuts[i + 1])
            mean = trapezoid(lambda x: x * density(x), cuts[i], cuts[i + 1])
            moved.append(mean / mass if mass > 1e-15 else levels[i])
        if max(abs(a - b) for a, b in zip(moved, levels)) < tol:
            break
        levels = moved
    return tuple(levels)


@functools.lru_cache(maxsize=64)
def _tables(d: int, bits: int, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the float32 levels' midpoints, the levels in bfloat16 as float32, H float32) on `device`."""
    levels = torch.tensor(engine_levels(d, bits), dtype=torch.float32, device="cpu")
    mids = (levels[:-1] + levels[1:]) / 2
    h = torch.ones(1, 1, dtype=torch.float32, device="cpu")  # built and scaled in float32, as the engine's
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    h = h / math.sqrt(d)
    return tuple(t.to(device) for t in (mids, levels.to(torch.bfloat16).float(), h))


def tq_encode(x: torch.Tensor, bits: int) -> dict[str, torch.Tensor]:
    """x (..., d) -> {"codes": (..., ceil(d bits / 8)) uint8, "scales": (..., 1) float16} (module docstring)."""
    d = x.shape[-1]
    mids, levels_bf16, h = _tables(d, bits, str(x.device))
    xf = x.float()
    n = xf.norm(dim=-1, keepdim=True)
    y = (xf / n.clamp(min=MIN_NORM)) @ h
    codes = torch.bucketize(y.contiguous(), mids).clamp(max=2 ** bits - 1)
    c_norm = levels_bf16[codes].norm(dim=-1, keepdim=True).clamp(min=MIN_NORM)
    return {"codes": packing.pack(codes.to(torch.uint8), bits, check=False), "scales": (n / c_norm).half()}


def tq_decode(parts, d: int, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """The stored codes and scale -> x_hat (..., d) in `dtype`: the codes' levels times the scale, rotated back."""
    _, levels_bf16, h = _tables(d, bits, str(parts["codes"].device))
    codes = packing.unpack(parts["codes"], bits, d).long()
    return ((levels_bf16[codes] * parts["scales"].float()) @ h).to(dtype)


@register
class TurboQuantCodec(Codec):
    """vLLM's TurboQuant-MLA path: a Hadamard rotation, Lloyd-Max codes of N(0, 1/d), a float16 scale per token."""

    name = "turboquant"
    widths = (3, 4)

    def check(self, fmt, where):
        super().check(fmt, where)
        if fmt.group_size is not None:
            raise ValueError(f"{where}.group_size={fmt.group_size!r}: format=turboquant keeps one scale per token; "
                             "allowed: null")
        if fmt.scale_dtype != "fp16":
            raise ValueError(f"{where}.scale_dtype={fmt.scale_dtype!r}: format=turboquant stores its scale as "
                             "float16; allowed: fp16")

    def check_dim(self, fmt, d: int, where: str) -> None:
        if d & (d - 1):
            raise ValueError(f"{where}: format=turboquant rotates with a Sylvester Hadamard matrix, which needs a "
                             f"power-of-two dimension; the path has {d} dims")

    def bytes_per_token(self, fmt, d, act_bytes):
        return packing.packed_dim(d, fmt.bits) + 2  # codes, the float16 scale

    def encode(self, fmt, x, tensor_scale):
        return tq_encode(x, fmt.bits)

    def decode(self, fmt, parts, d, dtype, tensor_scale):
        return tq_decode(parts, d, fmt.bits, dtype)

    def describe(self, fmt):
        return f"turboquant{fmt.bits} (Hadamard, Lloyd-Max N(0,1/d), fp16 scale)"

    def label(self, fmt):
        return f"tq{fmt.bits}"


def to_record(content: dict[str, torch.Tensor], rope: dict[str, torch.Tensor]) -> torch.Tensor:
    """One token record per row (N, bytes) uint8 in vLLM's TurboQuant-MLA order: the content's packed codes, its
    float16 scale (little-endian), the RoPE key's packed codes, its float16 scale."""
    def scale_bytes(parts):
        return parts["scales"].reshape(-1, 1).contiguous().view(torch.uint8)

    return torch.cat([content["codes"], scale_bytes(content), rope["codes"], scale_bytes(rope)], dim=-1)


def from_record(record: torch.Tensor, d_c: int, content_bits: int, d_r: int, rope_bits: int = 4
                ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """`to_record` read back: (the content's parts, the RoPE key's parts)."""
    c, r = packing.packed_dim(d_c, content_bits), packing.packed_dim(d_r, rope_bits)

    def scale(at):
        return record[:, at:at + 2].contiguous().view(torch.float16)

    return ({"codes": record[:, :c], "scales": scale(c)},
            {"codes": record[:, c + 2:c + 2 + r], "scales": scale(c + 2 + r)})
