"""format=fp4_e2m1: SGLang's `fp4_e2m1` MLA cache (`MLATokenToKVPoolFP4`, `kvfp4_tensor.py`): the content latent and
the RoPE key each in e2m1 codes (4 bits: a sign and one of 0, 0.5, 1, 1.5, 2, 3, 4, 6), two per byte with the even
element in the low nibble, and one power-of-two scale per block of 16 values, stored as its biased exponent byte
(E8M0-like, bias 127; MXFP4's scale on half its block). Per block, in the latent's own dtype as the engine computes
it:

    e = ceil(log2(max(amax / 6, 1e-10)))        (an all-zero block: e = -33, byte 94)
    y = x / 2^e                                 (|y| <= 6)
    code = sign(y) << 3 | #{b in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5) : |y| >= b}

so a value on a midpoint takes the larger magnitude (not ties to even, as NVFP4's cast) and a small negative value
keeps its sign bit (code 8). Read back code value * 2^e in float32. No per-tensor scale, no protected region.
SGLang quantizes the 512 content and 64 RoPE values separately into one 576-value row; 16 divides both, so the blocks
are the same as the row's: (512 + 64) / 2 + (512 + 64) / 16 = 288 + 36 = 324 B per token and layer."""

from __future__ import annotations

import torch

from mla_quant.quant.codecs.base import Codec, register
from mla_quant.quant.codecs.mxfp8 import E8M0_BIAS
from mla_quant.quant.codecs.nvfp4 import BLOCK, E2M1_MAX, e2m1_pack, e2m1_scaled

AMAX_FLOOR = 1e-10  # the floor on amax / 6 before the log
BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # a magnitude at or above the k-th takes level k + 1


def fp4_e2m1_encode(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """x (..., d), d a multiple of 16 -> {"codes": (..., d/2) uint8, "scales": (..., d/16) uint8 biased exponents}."""
    lead, d = x.shape[:-1], x.shape[-1]
    blocks = x.reshape(*lead, d // BLOCK, BLOCK)
    e = torch.ceil(torch.log2(torch.clamp(blocks.abs().amax(-1, keepdim=True) / E2M1_MAX, min=AMAX_FLOOR)))
    y = blocks / torch.exp2(e)
    bounds = torch.tensor(BOUNDS, dtype=torch.float32, device=x.device)
    magnitude = (y.abs().unsqueeze(-1) >= bounds).sum(-1)
    codes = (((y < 0).long() << 3) + magnitude).to(torch.uint8).reshape(*lead, d)
    return {"codes": e2m1_pack(codes), "scales": (e + E8M0_BIAS).squeeze(-1).to(torch.uint8)}


def fp4_e2m1_decode(parts, d: int, dtype: torch.dtype) -> torch.Tensor:
    """The stored codes (..., d/2) and scales (..., d/16) -> x_hat (..., d) in `dtype`."""
    return e2m1_scaled(parts["codes"], torch.exp2(parts["scales"].float() - E8M0_BIAS), d, dtype)


@register
class Fp4E2m1Codec(Codec):
    """SGLang's fp4_e2m1 MLA layout: e2m1 codes, a power-of-two scale byte per 16 values."""

    name = "fp4_e2m1"
    widths = (4,)

    def check(self, fmt, where):
        super().check(fmt, where)
        self.check_block_format(fmt, where, BLOCK, "e8m0", "E8M0 (power-of-two) scales")

    def check_dim(self, fmt, d: int, where: str) -> None:
        if d % BLOCK:
            raise ValueError(f"{where}: format=fp4_e2m1 scales whole blocks of {BLOCK} values; the path has {d} dims, "
                             f"allowed: a multiple of {BLOCK}")

    def n_groups(self, fmt, d):
        return d // BLOCK

    def bytes_per_token(self, fmt, d, act_bytes):
        return d // 2 + d // BLOCK  # codes, one exponent byte per block

    def encode(self, fmt, x, tensor_scale):
        return fp4_e2m1_encode(x)

    def decode(self, fmt, parts, d, dtype, tensor_scale):
        return fp4_e2m1_decode(parts, d, dtype)

    def kernel_unsupported(self, fmt, d):
        return None

    def kernel_spec(self, fmt, d):
        return self.byte_codes_spec("e2m1", BLOCK, "e8m0")

    def describe(self, fmt):
        return "fp4 e2m1 g=16 e8m0 scales"


def to_record(content: dict[str, torch.Tensor], rope: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's two buffers per layer, one row per token: (the packed codes (N, (d_c + d_r)/2): content then RoPE
    key; the scale bytes (N, (d_c + d_r)/16): content then RoPE key)."""
    return (torch.cat([content["codes"], rope["codes"]], dim=-1),
            torch.cat([content["scales"], rope["scales"]], dim=-1))


def from_record(codes: torch.Tensor, scales: torch.Tensor, d_c: int = 512
                ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """`to_record` read back: (the content's parts, the RoPE key's parts)."""
    c, g = d_c // 2, d_c // BLOCK
    return ({"codes": codes[:, :c], "scales": scales[:, :g]}, {"codes": codes[:, c:], "scales": scales[:, g:]})
