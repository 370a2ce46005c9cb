"""format=nvfp4: NVFP4 as vLLM's `nvfp4_ds_mla` cache stores the content latent. Each value an e2m1 code (4 bits: a
sign and one of 0, 0.5, 1, 1.5, 2, 3, 4, 6), two per byte with the even element in the low nibble; one e4m3 scale per
16 values, sf = e4m3(max(amax / 6, 2^-9)) rounded up to the next e4m3 value where rounding went below (at most 448);
codes = e2m1(x * (1 / sf)), round to nearest even, saturating at +-6; no per-tensor scale. Read back x = code * sf
(exact in float32). `to_record` / `from_record` give the engine's 352-byte token record at d_c 512 with an unscaled
e4m3 RoPE key (docs/cache.md, "Engine formats")."""

from __future__ import annotations

import torch

from mla_quant.kernels.layout import E2M1_VALUES  # noqa: F401 (code & 7 -> magnitude; part of this module's API)
from mla_quant.quant import quantizers
from mla_quant.quant.codecs.base import Codec, register

E2M1_MAX = 6.0
BLOCK = 16  # values per e4m3 scale
MIN_SCALE = 2.0 ** -9  # the scale's floor (an all-zero block still gets a positive scale)
E4M3_MAX_BITS = 0x7E  # 448: the largest finite e4m3fn value, the scale's ceiling


def e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """float32 values -> 4-bit e2m1 codes (uint8, 0..15): nearest of E2M1_VALUES in magnitude, ties to the even
    code (the even mantissa), saturating at 6; the sign in bit 3 (negative zero kept as 8)."""
    levels = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=y.device)
    mids = (levels[1:] + levels[:-1]) / 2  # 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5
    a = y.abs().clamp(max=E2M1_MAX)
    idx = torch.bucketize(a, mids)  # a == mids[k] -> k
    tie = a == mids[idx.clamp(max=len(mids) - 1)]
    idx = torch.where(tie & (idx % 2 == 1), idx + 1, idx)
    return (idx + 8 * torch.signbit(y).long()).to(torch.uint8)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """4-bit e2m1 codes -> their float32 values."""
    levels = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    v = levels[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -v, v)


def e4m3_scales(amax: torch.Tensor) -> torch.Tensor:
    """Per block, the e4m3 scale (as its uint8 bits): max(amax / 6, 2^-9) cast to e4m3 (round to nearest even),
    one e4m3 step up where the cast fell below the value, at most 448."""
    want = torch.clamp(amax.float() / E2M1_MAX, min=MIN_SCALE)
    bits = want.clamp(max=quantizers.FP8_MAX).to(quantizers.FP8_DTYPE).view(torch.uint8)
    low = (bits.view(quantizers.FP8_DTYPE).float() < want) & (bits < E4M3_MAX_BITS)
    return torch.where(low, bits + 1, bits)


def nvfp4_encode(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """x (..., d), d a multiple of 32 -> {"codes": (..., d/2) uint8, "scales": (..., d/16) uint8 e4m3 bits}."""
    lead, d = x.shape[:-1], x.shape[-1]
    blocks = x.float().reshape(*lead, d // BLOCK, BLOCK)
    scales = e4m3_scales(blocks.abs().amax(-1))
    inv = 1.0 / scales.view(quantizers.FP8_DTYPE).float()
    codes = e2m1_codes(blocks * inv[..., None]).reshape(*lead, d)
    return {"codes": e2m1_pack(codes), "scales": scales}


def e2m1_pack(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (..., d) uint8 -> two per byte (..., d/2), the even element in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def e2m1_scaled(packed: torch.Tensor, scales: torch.Tensor, d: int, dtype: torch.dtype) -> torch.Tensor:
    """Packed e2m1 codes (..., d/2) (`e2m1_pack`), and each block of 16's float32 scale (..., d/16) -> the values
    (..., d) in `dtype`."""
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(*packed.shape[:-1], d)
    values = e2m1_values(codes).reshape(*packed.shape[:-1], d // BLOCK, BLOCK)
    return (values * scales[..., None]).reshape(*packed.shape[:-1], d).to(dtype)


def nvfp4_decode(parts, d: int, dtype: torch.dtype) -> torch.Tensor:
    """The stored codes (..., d/2) and scales (..., d/16) -> x_hat (..., d) in `dtype`."""
    return e2m1_scaled(parts["codes"], parts["scales"].view(quantizers.FP8_DTYPE).float(), d, dtype)


@register
class Nvfp4Codec(Codec):
    """NVFP4 (e2m1 codes, an e4m3 scale per 16 values), vLLM's `nvfp4_ds_mla` content layout."""

    name = "nvfp4"
    widths = (4,)

    def check(self, fmt, where):
        super().check(fmt, where)
        self.check_block_format(fmt, where, BLOCK, "e4m3", "e4m3 scales")

    def check_dim(self, fmt, d: int, where: str) -> None:
        if d % (2 * BLOCK):
            raise ValueError(f"{where}: format=nvfp4 packs two codes per byte in blocks of {BLOCK}; the path has {d} "
                             f"dims, allowed: a multiple of {2 * BLOCK}")

    def n_groups(self, fmt, d):
        return d // BLOCK

    def bytes_per_token(self, fmt, d, act_bytes):
        return d // 2 + d // BLOCK  # codes, one e4m3 scale per block

    def encode(self, fmt, x, tensor_scale):
        return nvfp4_encode(x)

    def decode(self, fmt, parts, d, dtype, tensor_scale):
        return nvfp4_decode(parts, d, dtype)

    def kernel_unsupported(self, fmt, d):
        return None

    def kernel_spec(self, fmt, d):
        return self.byte_codes_spec("e2m1", BLOCK, "e4m3")

    def describe(self, fmt):
        return "nvfp4 e2m1 g=16 e4m3 scales"


def scale_slot(block: int) -> int:
    """The byte (within the record's 32 scale bytes) of 16-value block `block`'s scale: vLLM's permuted order,
    8 * (block % 4) + block // 4."""
    return 8 * (block % 4) + block // 4


def to_record(content: dict[str, torch.Tensor], rope_codes: torch.Tensor) -> torch.Tensor:
    """One token record per row (N, 352) uint8 in vLLM's `nvfp4_ds_mla` order: 256 B of packed e2m1 content codes,
    64 B of the unscaled e4m3 RoPE key, 32 B of the content's e4m3 scales in their permuted order. content: the
    nvfp4 parts of d_c = 512 values; rope_codes (N, 64) uint8 e4m3 bits."""
    scales = content["scales"]
    order = torch.tensor([scale_slot(b) for b in range(scales.shape[-1])], device=scales.device)
    permuted = torch.empty_like(scales)
    permuted[:, order] = scales
    return torch.cat([content["codes"], rope_codes, permuted], dim=-1)


def from_record(record: torch.Tensor, d_c: int = 512, d_r: int = 64) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """`to_record` read back: (the content's nvfp4 parts, the RoPE key's e4m3 bits)."""
    codes, rope = record[:, : d_c // 2], record[:, d_c // 2: d_c // 2 + d_r]
    permuted = record[:, d_c // 2 + d_r:]
    order = torch.tensor([scale_slot(b) for b in range(d_c // BLOCK)], device=record.device)
    return {"codes": codes, "scales": permuted[:, order]}, rope
