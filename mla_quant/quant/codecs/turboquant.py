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
+ 34 = 228 B (3-bit). No calibration, no protected region.

At 8 bits (`turboquant_k8v4`) a path is e4m3 with no rotation and no norm, any dimension:
- granularity=unscaled: the values cast as they are (the content latent under the layer's static scale, which the
  engine leaves at 1.0 uncalibrated), saturating at +-448: d bytes;
- granularity=group (one scale per token, the RoPE key): s = max(amax, 1e-8) / 448 in float32, codes =
  e4m3(clamp(x * (1 / s), +-448)) (x times the reciprocal of the float32 scale, not divided by the stored one),
  s stored as float16 (round to nearest): d + 2 bytes. Read back code * float(s16).
The k8v4 record is [content e4m3 | RoPE e4m3 | its float16 scale]: 512 + 64 + 2 = 578 B at d_c 512, d_r 64 (the
engine's default since its RoPE key went to FP8; `quant.rope.format=bf16` gives its earlier 640 B form). In MLA the
latent is both key and value, so the 4 value bits have no path of their own."""

from __future__ import annotations

import functools
import math

import torch

from mla_quant.quant import packing
from mla_quant.quant.codecs.base import Codec, register
from mla_quant.quant.quantizers import FP8_DTYPE, FP8_MAX

MIN_NORM = 1e-8  # the engine's floor on a token's norm and on its codes' norm
MIN_AMAX = 1e-8  # 8 bits: the engine's floor on a token's amax (its per-token e4m3 scale is amax / 448)
FP8_BITS = 8  # the width at which a path is e4m3 (k8v4) instead of rotated Lloyd-Max codes


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


def fp8_encode(x: torch.Tensor, per_token: bool) -> dict[str, torch.Tensor]:
    """The 8-bit rule (module docstring): x (..., d) -> {"codes": (..., d) uint8 e4m3 bits[, "scales": (..., 1)
    float16]}."""
    xf = x.float()
    if not per_token:
        return {"codes": xf.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(torch.uint8)}
    s = xf.abs().amax(-1, keepdim=True).clamp(min=MIN_AMAX) / FP8_MAX
    codes = (xf * (1.0 / s)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(torch.uint8)
    return {"codes": codes, "scales": s.half()}


def fp8_decode(parts, dtype: torch.dtype) -> torch.Tensor:
    """The stored e4m3 codes (and float16 scale per token, if any) -> x_hat in `dtype`, multiplied in float32."""
    x = parts["codes"].view(FP8_DTYPE).float()
    if "scales" in parts:
        x = x * parts["scales"].float()
    return x.to(dtype)


@register
class TurboQuantCodec(Codec):
    """vLLM's TurboQuant-MLA path: a Hadamard rotation, Lloyd-Max codes of N(0, 1/d), a float16 scale per token; at
    8 bits, e4m3 (unscaled, or with a float16 scale per token)."""

    name = "turboquant"
    widths = (3, 4, FP8_BITS)
    granularities = ("group", "unscaled")

    def check(self, fmt, where):
        super().check(fmt, where)
        if fmt.granularity == "unscaled" and fmt.bits != FP8_BITS:
            raise ValueError(f"{where}.granularity='unscaled': format=turboquant at {fmt.bits} bits keeps a float16 "
                             f"scale per token (only its {FP8_BITS}-bit e4m3 path can be unscaled); allowed: group")
        if not fmt.symmetric:
            raise ValueError(f"{where}.symmetric=false: format=turboquant codes are signed levels with no zero point; "
                             "allowed: true")
        if fmt.group_size is not None:
            raise ValueError(f"{where}.group_size={fmt.group_size!r}: format=turboquant keeps one scale per token; "
                             "allowed: null")
        if fmt.scale_dtype != "fp16":
            raise ValueError(f"{where}.scale_dtype={fmt.scale_dtype!r}: format=turboquant stores its scale as "
                             "float16; allowed: fp16")

    def check_dim(self, fmt, d: int, where: str) -> None:
        if fmt.bits != FP8_BITS and d & (d - 1):
            raise ValueError(f"{where}: format=turboquant rotates with a Sylvester Hadamard matrix, which needs a "
                             f"power-of-two dimension; the path has {d} dims")

    def n_groups(self, fmt, d):
        return 0 if fmt.granularity == "unscaled" else 1

    def bytes_per_token(self, fmt, d, act_bytes):
        return packing.packed_dim(d, fmt.bits) + 2 * self.n_groups(fmt, d)  # codes, the float16 scale

    def encode(self, fmt, x, tensor_scale):
        if fmt.bits == FP8_BITS:
            return fp8_encode(x, per_token=fmt.granularity == "group")
        return tq_encode(x, fmt.bits)

    def decode(self, fmt, parts, d, dtype, tensor_scale):
        if fmt.bits == FP8_BITS:
            return fp8_decode(parts, dtype)
        return tq_decode(parts, d, fmt.bits, dtype)

    def kernel_unsupported(self, fmt, d):
        return None

    def kernel_spec(self, fmt, d):
        if fmt.bits == FP8_BITS:
            return self.byte_codes_spec("e4m3", d)
        # the codes index levels of the rotated vector y = x H: a stream read in the rotated basis (x = y H)
        return self.byte_codes_spec("stream", d, bits=fmt.bits)

    def kernel_tensors(self, fmt, d, device):
        if fmt.bits == FP8_BITS:
            return {}
        _, levels_bf16, h = _tables(d, fmt.bits, str(torch.device(device)))
        return {"levels": levels_bf16, "rotation": h}

    def describe(self, fmt):
        if fmt.bits == FP8_BITS:
            return "turboquant fp8 e4m3" + (", unscaled" if fmt.granularity == "unscaled" else ", fp16 scale per token")
        return f"turboquant{fmt.bits} (Hadamard, Lloyd-Max N(0,1/d), fp16 scale)"

    def label(self, fmt):
        return f"tq{fmt.bits}" + ("u" if fmt.granularity == "unscaled" else "")


def to_record(content: dict[str, torch.Tensor], rope: dict[str, torch.Tensor]) -> torch.Tensor:
    """One token record per row (N, bytes) uint8 in vLLM's TurboQuant-MLA order: the content's packed codes, its
    float16 scale (little-endian; none for k8v4's unscaled e4m3 content), the RoPE key's packed codes, its float16
    scale."""
    def parts_bytes(parts):
        scale = [parts["scales"].reshape(-1, 1).contiguous().view(torch.uint8)] if "scales" in parts else []
        return [parts["codes"], *scale]

    return torch.cat([*parts_bytes(content), *parts_bytes(rope)], dim=-1)


def from_record(record: torch.Tensor, d_c: int, content_bits: int, d_r: int, rope_bits: int = 4
                ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """`to_record` read back: (the content's parts, the RoPE key's parts). 8-bit content is k8v4's unscaled e4m3."""
    c, r = packing.packed_dim(d_c, content_bits), packing.packed_dim(d_r, rope_bits)
    c_scale = 0 if content_bits == FP8_BITS else 2

    def scale(at):
        return record[:, at:at + 2].contiguous().view(torch.float16)

    content = {"codes": record[:, :c], **({"scales": scale(c)} if c_scale else {})}
    return content, {"codes": record[:, c + c_scale:c + c_scale + r], "scales": scale(c + c_scale + r)}
