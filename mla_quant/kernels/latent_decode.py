"""Triton decode attention over a (quantized) paged latent cache: one query token per sequence, all heads per program.

    o_latent = latent_decode(q_latent, q_rope, scale, segments)             # (B, H, d_c) float32
    o_latent = latent_decode_reference(q_latent, q_rope, scale, segments)   # same signature, plain PyTorch

The kernel takes tensors only, in the spirit of FlashMLA's `flash_mla_with_kvcache(q, k_cache, block_table,
cache_seqlens, ...)`, and knows nothing of cache objects. A `Segment` is a set of tokens per sequence: for each path
(content latent, RoPE key) a `PagedPath` (a pool of blocks (num_blocks, block_size, *) holding packed integer codes
with their scales and zeros, or float values), one block table (B, max_blocks) int32 shared by both paths, and the
number of tokens of each sequence (B,). A dense (B, P, d) buffer is the segment whose block b is row b
(`Segment.dense`). The cache passes its quantized blocks and its protected (sinks, recent) buffers as segments;
one decode query attends to the union, so the order of segments does not matter (RoPE is already in the keys).

Design (flash-decoding, split-KV): stage 1 runs one program per (sequence, split) of a segment, specialised per path
format; each program holds all heads (BLOCK_H rows: one dequantized tile serves every head, the MQA view of absorbed
MLA, docs/method.md section 1), walks its tokens in BLOCK_N tiles through the block table with an online softmax,
and writes a normalised partial output and its log-sum-exp. Stage 2 merges the partials (PyTorch).

Per path: float values (bits=0) or int codes with bits 2, 4, 8, packed LSB-first (codes per byte = 8 // bits), with
`group` values per scale (a multiple of the codes per byte), symmetric (x = (q - 2^(b-1)) s) or asymmetric
(x = q s + z), scales float or pow2 (int8 exponents). Anything else is refused before launch, naming the argument.
On the CPU the kernel runs under TRITON_INTERPRET=1 (set before this module is imported).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mla_quant.kernels.attention import latent_attention

KERNEL_BITS = (0, 2, 4, 8)  # 0 = float values


@dataclass
class PagedPath:
    """One path's stored tensors, each a pool (num_blocks, block_size, *): `data` is uint8 packed codes
    (.., ceil(d * bits / 8)) or float values (.., d); `scales`/`zeros` (.., d / group) for codes."""

    data: torch.Tensor
    scales: torch.Tensor | None = None
    zeros: torch.Tensor | None = None
    bits: int = 0
    group: int = 1
    symmetric: bool = True
    pow2: bool = False


@dataclass
class Segment:
    """Tokens of every sequence: both paths' pools, one block table (B, max_blocks) int32, lengths (B,)."""

    content: PagedPath
    rope: PagedPath
    block_table: torch.Tensor
    lengths: torch.Tensor

    @classmethod
    def dense(cls, content: torch.Tensor, rope: torch.Tensor, lengths: torch.Tensor) -> "Segment":
        """Float buffers (B, P, d) holding lengths[b] valid tokens in row b."""
        table = torch.arange(content.shape[0], dtype=torch.int32, device=content.device)[:, None]
        return cls(PagedPath(content), PagedPath(rope), table, lengths)


def require_triton(what: str = "quant.backend=triton", hint: str = "") -> None:
    """Raise RuntimeError naming `what` unless the kernel can launch here (a CUDA GPU, or the CPU interpreter)."""
    if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        raise RuntimeError(f"{what} cannot run: no CUDA GPU here (set TRITON_INTERPRET=1 before starting to run the "
                           f"kernel in Triton's CPU interpreter){hint}")


def _check_path(p: PagedPath, d: int, name: str, blocks: tuple[int, int]) -> None:
    if p.bits not in KERNEL_BITS:
        raise ValueError(f"{name}.bits={p.bits}; allowed: {list(KERNEL_BITS)} (0 = float values)")
    if p.data.dim() != 3 or tuple(p.data.shape[:2]) != blocks:
        raise ValueError(f"{name}.data must be (num_blocks, block_size, *) = {blocks + ('*',)}, "
                         f"got {tuple(p.data.shape)}")
    if p.data.stride(-1) != 1:
        raise ValueError(f"{name}.data must be contiguous in its last dimension (stride {p.data.stride(-1)})")
    if p.bits == 0:
        if not p.data.is_floating_point() or p.data.shape[-1] != d:
            raise ValueError(f"{name}.data: float values (.., {d}) expected for bits=0, got {p.data.dtype} "
                             f"{tuple(p.data.shape)}")
        return
    per_byte = 8 // p.bits
    if p.data.dtype != torch.uint8 or p.data.shape[-1] != math.ceil(d / per_byte):
        raise ValueError(f"{name}.data: uint8 codes (.., {math.ceil(d / per_byte)}) expected for bits={p.bits}, "
                         f"got {p.data.dtype} {tuple(p.data.shape)}")
    if p.group <= 0 or d % p.group or p.group % per_byte:
        raise ValueError(f"{name}.group={p.group}: must divide d={d} and be a multiple of {per_byte} "
                         f"(codes per byte at bits={p.bits})")
    groups = d // p.group
    for part, t in [("scales", p.scales)] + ([] if p.symmetric else [("zeros", p.zeros)]):
        if t is None:
            raise ValueError(f"{name}.{part} is missing (bits={p.bits}, symmetric={p.symmetric})")
        if tuple(t.shape) != blocks + (groups,) or t.stride(-1) != 1:
            raise ValueError(f"{name}.{part} must be contiguous (num_blocks, block_size, {groups}), got "
                             f"{tuple(t.shape)}")
    if p.pow2 != (p.scales.dtype == torch.int8):
        raise ValueError(f"{name}.pow2={p.pow2} but scales are {p.scales.dtype} (pow2 scales are int8 exponents)")


def check_inputs(q_latent: torch.Tensor, q_rope: torch.Tensor, segments) -> None:
    """Shapes, dtypes and layouts of every argument, before any launch; errors name the argument."""
    if q_latent.dim() != 3 or q_rope.dim() != 3 or q_latent.shape[:2] != q_rope.shape[:2]:
        raise ValueError(f"q_latent (B, H, d_c) and q_rope (B, H, d_r) expected, got {tuple(q_latent.shape)} and "
                         f"{tuple(q_rope.shape)}")
    if not segments:
        raise ValueError("segments is empty: nothing to attend to")
    b, _, d_c = q_latent.shape
    d_r = q_rope.shape[-1]
    for i, seg in enumerate(segments):
        blocks = tuple(seg.content.data.shape[:2])
        _check_path(seg.content, d_c, f"segments[{i}].content", blocks)
        _check_path(seg.rope, d_r, f"segments[{i}].rope", blocks)
        if seg.block_table.dtype != torch.int32 or seg.block_table.dim() != 2 or seg.block_table.shape[0] != b:
            raise ValueError(f"segments[{i}].block_table must be int32 (B={b}, max_blocks), got "
                             f"{seg.block_table.dtype} {tuple(seg.block_table.shape)}")
        if seg.lengths.shape != (b,):
            raise ValueError(f"segments[{i}].lengths must be (B,) = ({b},), got {tuple(seg.lengths.shape)}")


# --------------------------------------------------------------------------------------------------- reference
def _unpack(codes: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """uint8 (..., ceil(d*bits/8)) LSB-first -> (..., d) float32 codes (the kernel's read, spelled out)."""
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, device=codes.device, dtype=torch.uint8) * bits
    q = (codes[..., None] >> shifts) & ((1 << bits) - 1)  # (..., bytes, per_byte)
    return q.reshape(*codes.shape[:-1], -1)[..., :d].float()


def _gather_path(p: PagedPath, table: torch.Tensor, d: int) -> torch.Tensor:
    """(B, max_blocks * block_size, d) float32 tokens of one path, read through the block table."""
    idx = table.long()

    def rows(t):
        x = t[idx]  # (B, max_blocks, block_size, *)
        return x.reshape(x.shape[0], -1, *t.shape[2:])

    if p.bits == 0:
        return rows(p.data).float()
    q = _unpack(rows(p.data), p.bits, d)
    s = rows(p.scales)
    s = torch.exp2(s.float()) if p.pow2 else s.float()
    s = s.repeat_interleave(p.group, dim=-1)
    if p.symmetric:
        return (q - (1 << (p.bits - 1))) * s
    return q * s + rows(p.zeros).float().repeat_interleave(p.group, dim=-1)


def latent_decode_reference(q_latent: torch.Tensor, q_rope: torch.Tensor, scale: float, segments,
                            **_launch) -> torch.Tensor:
    """The kernel's specification: every segment's tokens dequantized to float32, then absorbed attention in
    float32 over their union. q_latent (B, H, d_c), q_rope (B, H, d_r) -> (B, H, d_c) float32."""
    check_inputs(q_latent, q_rope, segments)
    d_c, d_r = q_latent.shape[-1], q_rope.shape[-1]
    cs, rs, oks = [], [], []
    for seg in segments:
        c = _gather_path(seg.content, seg.block_table, d_c)
        cs.append(c)
        rs.append(_gather_path(seg.rope, seg.block_table, d_r))
        oks.append(torch.arange(c.shape[1], device=c.device)[None, :] < seg.lengths.to(c.device)[:, None])
    ok = torch.cat(oks, dim=1)
    mask = torch.zeros(ok.shape, device=ok.device).masked_fill(~ok, float("-inf"))[:, None, None, :]
    out = latent_attention(q_latent.float()[:, :, None], q_rope.float()[:, :, None], torch.cat(cs, 1),
                           torch.cat(rs, 1), scale, mask)
    return out[:, :, 0].nan_to_num(0.0)  # a sequence with no token at all attends to nothing


# ------------------------------------------------------------------------------------------------------ kernel
@triton.jit
def _dequant_tile(base, sb, st, sc_base, scb, sct, z_base, zb, zt, blk, slot, ok_t, d_offs, d_ok,
                  BITS: tl.constexpr, GROUP: tl.constexpr, SYM: tl.constexpr, POW2: tl.constexpr):
    """[BLOCK_N, BLOCK_D] float32 tile of one path for the tokens at (blk, slot) (BITS=0: float values)."""
    ok = ok_t[:, None] & d_ok[None, :]
    if BITS == 0:
        x = tl.load(base + (blk * sb + slot * st)[:, None] + d_offs[None, :], mask=ok, other=0.0).to(tl.float32)
    else:
        per_byte: tl.constexpr = 8 // BITS
        byte = tl.load(base + (blk * sb + slot * st)[:, None] + (d_offs // per_byte)[None, :], mask=ok, other=0)
        shift = ((d_offs % per_byte) * BITS).to(tl.uint8)
        q = ((byte >> shift[None, :]) & ((1 << BITS) - 1)).to(tl.float32)
        g = (d_offs // GROUP)[None, :]
        s = tl.load(sc_base + (blk * scb + slot * sct)[:, None] + g, mask=ok, other=0)
        if POW2:
            s = tl.exp2(s.to(tl.float32))
        else:
            s = s.to(tl.float32)
        if SYM:
            x = (q - (1 << (BITS - 1))) * s
        else:
            z = tl.load(z_base + (blk * zb + slot * zt)[:, None] + g, mask=ok, other=0.0).to(tl.float32)
            x = q * s + z
    return x


@triton.jit
def _stage1_kernel(
    Q, QR, stride_qb, stride_qh, stride_qrb, stride_qrh,
    C, C_SC, C_Z, c_sb, c_st, c_scb, c_sct, c_zb, c_zt,
    R, R_SC, R_Z, r_sb, r_st, r_scb, r_sct, r_zb, r_zt,
    TABLE, stride_tb, LENS,
    O_PART, LSE_PART, stride_ob, stride_os, stride_oh, stride_lb, stride_ls,
    tokens_per_split, split_base, scale, H,
    DC: tl.constexpr, DR: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DC: tl.constexpr, BLOCK_DR: tl.constexpr,
    BLOCK_N: tl.constexpr, BS: tl.constexpr,
    C_BITS: tl.constexpr, C_GROUP: tl.constexpr, C_SYM: tl.constexpr, C_POW2: tl.constexpr,
    R_BITS: tl.constexpr, R_GROUP: tl.constexpr, R_SYM: tl.constexpr, R_POW2: tl.constexpr,
):
    b = tl.program_id(0)
    split = tl.program_id(1)
    h = tl.arange(0, BLOCK_H)
    dc = tl.arange(0, BLOCK_DC)
    dr = tl.arange(0, BLOCK_DR)
    h_ok, dc_ok, dr_ok = h < H, dc < DC, dr < DR
    q = tl.load(Q + b * stride_qb + h[:, None] * stride_qh + dc[None, :],
                mask=h_ok[:, None] & dc_ok[None, :], other=0.0).to(tl.float32)
    qr = tl.load(QR + b * stride_qrb + h[:, None] * stride_qrh + dr[None, :],
                 mask=h_ok[:, None] & dr_ok[None, :], other=0.0).to(tl.float32)
    n_tokens = tl.load(LENS + b).to(tl.int32)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, n_tokens)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DC], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        tok = t0 + tl.arange(0, BLOCK_N)
        tok_ok = tok < end
        blk = tl.load(TABLE + b * stride_tb + tok // BS, mask=tok_ok, other=0).to(tl.int64)
        slot = (tok % BS).to(tl.int64)
        c = _dequant_tile(C, c_sb, c_st, C_SC, c_scb, c_sct, C_Z, c_zb, c_zt, blk, slot, tok_ok, dc, dc_ok,
                          C_BITS, C_GROUP, C_SYM, C_POW2)
        r = _dequant_tile(R, r_sb, r_st, R_SC, r_scb, r_sct, R_Z, r_zb, r_zt, blk, slot, tok_ok, dr, dr_ok,
                          R_BITS, R_GROUP, R_SYM, R_POW2)
        s = (tl.dot(q, tl.trans(c)) + tl.dot(qr, tl.trans(r))) * scale  # [BLOCK_H, BLOCK_N]
        s = tl.where(tok_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row masked so far stays empty, not NaN
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, c)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    lse = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
    slot_out = split_base + split
    tl.store(O_PART + b * stride_ob + slot_out * stride_os + h[:, None] * stride_oh + dc[None, :], out,
             mask=h_ok[:, None] & dc_ok[None, :])
    tl.store(LSE_PART + b * stride_lb + slot_out * stride_ls + h, lse, mask=h_ok)


def _next_pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (n - 1).bit_length())


def _path_args(p: PagedPath, dummy: torch.Tensor) -> tuple[list, dict]:
    """Pointer/stride arguments and constexprs of one path's pools."""
    sc = dummy if p.scales is None else p.scales
    z = dummy if p.zeros is None or p.symmetric else p.zeros
    args = [p.data, sc, z, p.data.stride(0), p.data.stride(1),
            0 if p.scales is None else sc.stride(0), 0 if p.scales is None else sc.stride(1),
            0 if z is dummy else z.stride(0), 0 if z is dummy else z.stride(1)]
    return args, dict(BITS=p.bits, GROUP=p.group if p.bits else 1, SYM=p.symmetric or p.bits == 0,
                      POW2=p.pow2 and p.bits > 0)


def latent_decode(q_latent: torch.Tensor, q_rope: torch.Tensor, scale: float, segments, *, block_n: int = 32,
                  split_tokens: int = 256) -> torch.Tensor:
    """Triton decode attention (see the module docstring). q_latent (B, H, d_c), q_rope (B, H, d_r), segments
    (a list of `Segment`) -> o_latent (B, H, d_c) float32."""
    require_triton()
    check_inputs(q_latent, q_rope, segments)
    b, h, d_c = q_latent.shape
    d_r = q_rope.shape[-1]
    dev = q_latent.device
    dummy = torch.zeros(1, device=dev)
    longest = [int(seg.lengths.max()) if b else 0 for seg in segments]
    splits = [max(1, math.ceil(n / split_tokens)) for n in longest]
    o_part = torch.empty(b, sum(splits), h, d_c, device=dev, dtype=torch.float32)
    lse_part = torch.empty(b, sum(splits), h, device=dev, dtype=torch.float32)
    q_latent, q_rope = q_latent.contiguous(), q_rope.contiguous()
    base = 0
    for seg, n_split in zip(segments, splits):
        c_args, c_k = _path_args(seg.content, dummy)
        r_args, r_k = _path_args(seg.rope, dummy)
        table = seg.block_table.contiguous()
        _stage1_kernel[(b, n_split)](
            q_latent, q_rope, q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
            *c_args, *r_args,
            table, table.stride(0), seg.lengths.to(device=dev, dtype=torch.int32).contiguous(),
            o_part, lse_part, o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0),
            lse_part.stride(1),
            split_tokens, base, float(scale), h,
            DC=d_c, DR=d_r, BLOCK_H=_next_pow2(h), BLOCK_DC=_next_pow2(d_c), BLOCK_DR=_next_pow2(d_r),
            BLOCK_N=block_n, BS=int(seg.content.data.shape[1]),
            C_BITS=c_k["BITS"], C_GROUP=c_k["GROUP"], C_SYM=c_k["SYM"], C_POW2=c_k["POW2"],
            R_BITS=r_k["BITS"], R_GROUP=r_k["GROUP"], R_SYM=r_k["SYM"], R_POW2=r_k["POW2"],
        )
        base += n_split
    # stage 2: merge the splits with log-sum-exp weights
    weights = torch.softmax(lse_part, dim=1).nan_to_num(0.0)  # (B, splits, H); a split with no token weighs 0
    return (weights[..., None] * o_part).sum(dim=1)
