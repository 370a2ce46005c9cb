"""Triton store path: quantize new tokens and write their codes, scales and zeros into a paged pool, in one launch.

    quantize_append(x, rows, pos, block_table, block_size, codes, scales, zeros, bits=4, group=128,
                    symmetric=False, scale_dtype="fp16")

x (N, d) float: the new tokens of one path; token i is position pos[i] of sequence rows[i], so it goes to slot
pos[i] % block_size of block block_table[rows[i], pos[i] // block_size]. The pools are (num_blocks, block_size, *)
tensors contiguous within a block, each with its own block stride (views of one page pool per path, `PageLayout`
in kernels/layout.py, or whole contiguous pools): `codes` int32 words (WordLayout(bits, d).words), `scales` (d /
group) in the scale dtype (int8 exponents for pow2), `zeros` (d / group) for asymmetric groups. A token's words go
to block * codes.stride(0) + slot * W, its scales and zeros likewise. One program per token.

The arithmetic is the PyTorch encoder's (mla_quant/quant/quantizers.py `group_quantize`), operation for operation,
so the stored bytes are identical (tested under the interpreter): per group min/max (or amax), the step
(max - min) / (2^b - 1) (amax / (2^(b-1) - 1)), 1 for a constant group, rounded UP to the scale dtype (round to
nearest, then one ulp up if below; pow2: 2^ceil(log2 s) from the float's exponent bits), the zero rounded to
nearest in its dtype, codes round-half-even((x - z) / s) with an IEEE division, clamped, packed into words.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_quant.kernels.latent_decode import _layout, require_triton, rows_contiguous
from mla_quant.kernels.layout import DTYPE_CODES, SCALE_DTYPES, WORD_BITS, ZERO_DTYPES, WordLayout

SCALE_KINDS = {name: DTYPE_CODES[dtype] for name, dtype in SCALE_DTYPES.items()}  # the kernel's KIND per scale dtype
MAX_GROUPS = 64  # groups per token one program unrolls
_RNE = tl.constexpr(12582912.0)  # 1.5 * 2^23: (v + _RNE) - _RNE rounds |v| < 2^22 to the nearest integer, ties to even


@triton.jit
def _bf16_rne(v):
    """float32 -> bfloat16 bits (int16), round to nearest even (spelled out: the CPU interpreter truncates)."""
    bits = v.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16)


@triton.jit
def _stored_scale(s, KIND: tl.constexpr):
    """A positive float32 step -> (its stored form, the float32 value decoding reads), never below s."""
    if KIND == 0:
        r = s.to(tl.float16)
        r = tl.where(r.to(tl.float32) < s, (r.to(tl.int16, bitcast=True) + 1).to(tl.float16, bitcast=True), r)
        val = r.to(tl.float32)
    elif KIND == 1:
        bits = _bf16_rne(s)
        bits = tl.where((bits.to(tl.int32) << 16).to(tl.float32, bitcast=True) < s, bits + 1, bits)
        r = bits
        val = (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    elif KIND == 2:
        r = s
        val = s
    else:
        bits = s.to(tl.int32, bitcast=True)
        e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)  # ceil(log2 s), exactly
        e = tl.minimum(tl.maximum(e, -126), 127)
        r = e.to(tl.int8)
        val = ((e + 127) << 23).to(tl.float32, bitcast=True)
    return r, val


@triton.jit
def _rounded_zero(lo, KIND: tl.constexpr):
    """The asymmetric zero (the group minimum) in its dtype, round to nearest: (stored form, float32 value)."""
    if KIND == 1:
        bits = _bf16_rne(lo)
        r = bits
        val = (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    elif KIND == 2:
        r = lo
        val = lo
    else:  # fp16 (also the zeros of pow2 scales)
        r = lo.to(tl.float16)
        val = r.to(tl.float32)
    return r, val


@triton.jit
def _quantize_append_kernel(X, stride_x, ROWS, POS, TABLE, TABLE_W, BS, CODES, SCALES, ZEROS, stride_c, stride_s,
                            stride_z, D: tl.constexpr, BLOCK_D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                            SYM: tl.constexpr, KIND: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    b = tl.load(ROWS + i).to(tl.int64)
    pos = tl.load(POS + i).to(tl.int64)
    blk = tl.load(TABLE + b * TABLE_W + pos // BS).to(tl.int64)
    slot = pos % BS
    PW: tl.constexpr = 32 // BITS
    W: tl.constexpr = (D + PW - 1) // PW
    BLOCK_W: tl.constexpr = BLOCK_D // PW
    NG: tl.constexpr = D // GROUP
    s_dest = SCALES + blk * stride_s + slot * NG  # the token's first scale (zero): its block's page, its slot
    z_dest = ZEROS + blk * stride_z + slot * NG
    ch, ok = _layout(D, BITS, BLOCK_D, 0)  # the token in its storage order (int32 words)
    x = tl.load(X + i * stride_x + ch, mask=ok, other=0.0).to(tl.float32)
    gid = ch // GROUP
    s_of = tl.zeros_like(x)
    z_of = tl.zeros_like(x)
    for g in tl.static_range(NG):
        in_g = ok & (gid == g)
        if SYM:
            step = tl.max(tl.where(in_g, tl.abs(x), 0.0), 0) / ((1 << (BITS - 1)) - 1)
        else:
            lo = tl.min(tl.where(in_g, x, float("inf")), 0)
            step = (tl.max(tl.where(in_g, x, float("-inf")), 0) - lo) / ((1 << BITS) - 1)
        step = tl.where(step > 0, step, 1.0)
        stored, s_val = _stored_scale(step, KIND)
        tl.store(s_dest + g, stored)
        s_of = tl.where(in_g, s_val, s_of)
        if not SYM:
            z_stored, z_val = _rounded_zero(lo, KIND)
            tl.store(z_dest + g, z_stored)
            z_of = tl.where(in_g, z_val, z_of)
    if SYM:
        v = tl.math.div_rn(x, tl.where(ok, s_of, 1.0))
        q = (v + _RNE) - _RNE + (1 << (BITS - 1))
    else:
        v = tl.math.div_rn(x - z_of, tl.where(ok, s_of, 1.0))
        q = (v + _RNE) - _RNE
    q = tl.minimum(tl.maximum(q, 0.0), (1 << BITS) - 1).to(tl.int32)
    q = tl.where(ok, q, 0)
    fields = tl.reshape(q, [PW, BLOCK_W]) << (tl.arange(0, PW) * BITS)[:, None]
    words = tl.sum(fields, 0)  # disjoint bit fields: the sum is their OR (two's complement wraps the top one)
    j = tl.arange(0, BLOCK_W)
    tl.store(CODES + blk * stride_c + slot * W + j, words, mask=j < W)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """bfloat16 pools are written as their int16 bits (the kernel rounds to bfloat16 itself)."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def kernel_store_unsupported(bits: int, d: int, group: int | None) -> str | None:
    """Why `quantize_append` cannot encode this int format (then the PyTorch encoder stores it), or None."""
    if bits not in WORD_BITS:
        return f"bits={bits} (the store kernel packs {list(WORD_BITS)})"
    groups = d // (group or d)
    if groups > MAX_GROUPS:
        return f"{groups} groups per token (the store kernel unrolls at most {MAX_GROUPS})"
    return None


def quantize_append(x: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, block_table: torch.Tensor,
                    block_size: int, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, *,
                    bits: int, group: int | None, symmetric: bool, scale_dtype: str) -> None:
    """Quantize x (N, d) and write it into the pools at the block-table positions (see the module docstring)."""
    require_triton("quantize_append")
    n, d = x.shape
    group = group or d
    why = kernel_store_unsupported(bits, d, group)
    if why is not None:
        raise ValueError(f"quantize_append: {why}")
    if scale_dtype not in SCALE_KINDS:
        raise ValueError(f"quantize_append: scale_dtype={scale_dtype!r}; allowed: {list(SCALE_KINDS)}")
    if d % group:
        raise ValueError(f"quantize_append: group={group} does not divide d={d}")
    layout = WordLayout(bits, d)
    expect = {"codes": (codes, torch.int32, layout.words), "scales": (scales, SCALE_DTYPES[scale_dtype], d // group)}
    if not symmetric:
        expect["zeros"] = (zeros, ZERO_DTYPES[scale_dtype], d // group)
    for name, (t, dtype, width) in expect.items():
        if (t is None or t.dtype != dtype or t.dim() != 3 or t.shape[1:] != (block_size, width)
                or t.shape[0] != codes.shape[0] or not rows_contiguous(t)):
            got = None if t is None else (t.dtype, tuple(t.shape), tuple(t.stride()))
            raise ValueError(f"quantize_append: {name} must be a contiguous (num_blocks, block_size, {width}) {dtype} "
                             f"pool, or a view of one with any block stride stride(0) (a page), got {got}")
    if x.dim() != 2 or x.stride(-1) != 1 or rows.shape != (n,) or pos.shape != (n,):
        raise ValueError(f"quantize_append: x (N, d) contiguous in d and rows, pos (N,) expected, got x "
                         f"{tuple(x.shape)}, rows {tuple(rows.shape)}, pos {tuple(pos.shape)}")
    if block_table.dtype != torch.int32 or not block_table.is_contiguous():
        raise ValueError(f"quantize_append: block_table must be contiguous int32, got {block_table.dtype}")
    if n == 0:
        return
    block_d = max(triton.next_power_of_2(d), layout.per_word)
    _quantize_append_kernel[(n,)](
        x, x.stride(0), rows, pos, block_table, block_table.shape[1], block_size, codes, _bits(scales),
        _bits(scales if zeros is None else zeros), codes.stride(0), scales.stride(0),
        (scales if zeros is None else zeros).stride(0), D=d, BLOCK_D=block_d, BITS=bits, GROUP=group,
        SYM=bool(symmetric), KIND=SCALE_KINDS[scale_dtype], num_warps=4,
    )
