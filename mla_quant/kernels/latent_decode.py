"""Triton decode attention over a (quantized) paged latent cache: one query token per sequence, every head.

    o_latent = latent_decode(q_latent, q_rope, scale, segments)             # (B, H, d_c) float32
    o_latent = latent_decode_reference(q_latent, q_rope, scale, segments)   # kernels/torch_decode.py: the same in PyTorch

The kernel takes tensors only, in the spirit of FlashMLA's `flash_mla_with_kvcache(q, k_cache, block_table,
cache_seqlens, ...)`, and knows nothing of cache objects. A `Segment` is a set of tokens per sequence: for each path
(content latent, RoPE key) a `PagedPath` (tensors (num_blocks, block_size, *) holding packed integer codes with their
scales and zeros, or float values), one block table (B, max_blocks) int32 shared by both paths, and the number of
tokens of each sequence (B,). A cache's tensors are views of one page pool per path (codes | scales | zeros of a
block in one page, `PageLayout` in kernels/layout.py): each has its own block stride, stride(0). A dense (B, P, d)
buffer is the segment whose block b is row b (`Segment.dense`). The cache passes its quantized blocks and its
protected (sinks, recent) buffers as segments; one decode query attends to the union, so the order of segments does
not matter (RoPE is already in the keys).

Design (flash-decoding, split-KV, docs/kernel.md): two launches per call whatever the number of segments. Stage 1
is one grid (head blocks, sequences, splits of every segment) over one descriptor per segment (`_descriptor`: its
tensors, strides, block table, lengths and splits; its formats compile-time, `_format_constexprs`): a program
finds its segment from its split index, walks that split's tokens in BLOCK_N tiles through the segment's block
table, dequantizes each tile once for its BLOCK_H heads (the MQA view of absorbed MLA, docs/method.md section 1),
keeps an online softmax and writes a normalised partial output and its log-sum-exp. Each path's format is
compile-time, per segment. Stage 2 (Triton) merges every split of every segment with log-sum-exp weights.
The split count follows FlashMLA's get_mla_metadata: enough programs to fill the GPU's SMs about twice, never
splits shorter than a few tiles (`split_plan`).

Per path: float values (bits=0) or int codes with bits 2, 4, 8 in int32 words chunked along channels
(`WordLayout`, kernels/layout.py: a tile unpacks from one load of its words by a broadcast shift and mask, in channel
order), with `group` values per scale (any divisor of d), symmetric (x = (q - 2^(b-1)) s) or asymmetric
(x = q s + z), scales float or pow2 (int8 exponents); with a codebook (`levels`, the lloyd quantizer) code q
reads levels[q] in place of q. Stored tensors must be contiguous within a block (their
(block_size, *) dims); their block stride is free, so a token's words, scales and zeros are read at
block * stride(0) + slot * row size of each. Anything else is refused before launch, naming the argument and what is
allowed. Products run in float32 (`dot="ieee"`) or with bfloat16 operands and float32 accumulation (`dot="bf16"`,
the default for bfloat16 queries on a GPU, as FlashMLA does).
On the CPU the kernel runs under TRITON_INTERPRET=1 (set before this module is imported).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from mla_quant.kernels.decode_plan import launch_config, merge_heads, next_pow2, num_sms, split_plan
from mla_quant.kernels.layout import (  # noqa: F401 (Segment, the checks: part of this API)
    CODES, FLOAT_DTYPES, KERNEL_BITS, POW2_CODE, PagedPath, Segment, WordLayout, check_inputs,
    flat_pairs, in_bases, rows_contiguous, scale_kind,
)

DOTS = ("auto", "ieee", "bf16")
_POW2 = tl.constexpr(POW2_CODE)  # the code of int8 (power-of-two exponent) scales, as the kernels read it
COMPILE_ONLY: list[int] = []  # the target architecture while `kernels.aot.ahead_of_time` is active


def require_triton(what: str = "quant.backend=triton", hint: str = "") -> None:
    """Raise RuntimeError naming `what` unless the kernel can launch here (a CUDA GPU, or the CPU interpreter)."""
    if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1" or COMPILE_ONLY):
        raise RuntimeError(f"{what} cannot run: no CUDA GPU here (set TRITON_INTERPRET=1 before starting to run the "
                           f"kernel in Triton's CPU interpreter){hint}")


# ------------------------------------------------------------------------------------------------------ kernel
@triton.jit
def _layout(D: tl.constexpr, BITS: tl.constexpr, BLOCK_D: tl.constexpr, CODES: tl.constexpr):
    """Positions of a path's tile in its storage order and the channel each holds: position k * BLOCK_W + j is
    field k of word j, channel k W + j (WordLayout; float values and byte codes read bytewise: the identity; byte
    codes read as int32 words, CODES >= 5: field k of word j holds channel P j + k). Returns (channel, valid)."""
    if CODES >= 5:
        P: tl.constexpr = 32 // BITS
        BLOCK_W_: tl.constexpr = BLOCK_D // P
        pos = tl.arange(0, BLOCK_D)
        j = pos % BLOCK_W_
        ch = j * P + pos // BLOCK_W_
        ok = ch < D
    elif BITS == 0 or CODES != 0:
        ch = tl.arange(0, BLOCK_D)
        ok = ch < D
    else:
        PW: tl.constexpr = 32 // BITS
        W: tl.constexpr = (D + PW - 1) // PW
        BLOCK_W: tl.constexpr = BLOCK_D // PW
        pos = tl.arange(0, BLOCK_D)
        j = pos % BLOCK_W
        ch = (pos // BLOCK_W) * W + j
        ok = (j < W) & (ch < D)
    return ch, ok


@triton.jit
def _e4m3(b):
    """e4m3fn bits (int32, 0..255) -> their float32 values, exactly: the exponent and mantissa fields moved into a
    float32's (normal values), m 2^-9 (subnormal). No NaN is ever stored (the encoders saturate at +-448)."""
    e = (b >> 3) & 15
    m = b & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    return tl.where((b & 128) != 0, -mag, mag)


@triton.jit
def _e2m1(c):
    """e2m1 codes (int32, 0..15: bit 3 the sign) -> their float32 values 0, 0.5, 1, 1.5, 2, 3, 4, 6 (signed)."""
    e = (c >> 1) & 3
    man = (c & 1).to(tl.float32)
    mag = tl.where(e == 0, 0.5 * man, (2.0 + man) * (1 << e).to(tl.float32) * 0.25)
    return tl.where((c & 8) != 0, -mag, mag)


@triton.jit
def _scale_values(s, SKIND: tl.constexpr):
    """Stored scales -> float32 by their kind (`SCALE_KINDS`): a float dtype, int8 power-of-two exponents (2^s),
    E8M0 bytes (2^(s - 127), 0 -> 2^-127), e4m3 bytes."""
    if SKIND == 1:
        out = tl.exp2(s.to(tl.float32))
    elif SKIND == 2:
        e = s.to(tl.int32) & 255
        out = tl.where(e == 0, 1 << 22, e << 23).to(tl.float32, bitcast=True)
    elif SKIND == 3:
        out = _e4m3(s.to(tl.int32) & 255)
    else:
        out = s.to(tl.float32)
    return out


@triton.jit
def _levels_at(qi, lv_base, BITS: tl.constexpr):
    """Codes (int32, < 2^BITS <= 16) -> the codebook's levels at them: a select over the levels, held in registers."""
    q = tl.zeros(qi.shape, tl.float32)
    for v in tl.static_range(1 << BITS):
        q = tl.where(qi == v, tl.load(lv_base + v), q)
    return q


@triton.jit
def _byte_tile(base, sc_base, lv_base, blk, slot, ok_t, stride, sc_stride, D: tl.constexpr, BLOCK_D: tl.constexpr,
               BITS_: tl.constexpr, GROUP: tl.constexpr, SKIND: tl.constexpr, CODES: tl.constexpr):
    """[BLOCK_N, BLOCK_D] float32 tile of a path of byte codes (the engines' formats): e4m3 (CODES 1 and 5, one byte
    per value), e2m1 (CODES 2 and 6, two per byte, the even value in the low nibble) or a stream of BITS_-bit indices
    into the codebook at lv_base (CODES 3 and 7, LSB first), times a scale per group of GROUP values (the last group
    may be shorter: ceil(D / GROUP) per token) of kind SKIND, or none (SKIND=4). CODES 1-3: in channel order, a byte
    per value (a stream's value from the two bytes its bits lie in; a 3-bit stream with D and GROUP multiples of 8:
    each three bytes loaded once and cut into their eight values). CODES 5-7 (8 or 4 bits; a token's bytes a whole
    number of int32 words, a group a whole number of words): one load of the tile's words, a broadcast shift and
    mask into (N, P, BLOCK_W) fields (field k of word j: channel P j + k, `_layout`), the scale one per token and
    word. A codebook's level is a gather from its 2^BITS_ levels (fewer live registers than a select over them)."""
    if CODES >= 5:
        BITS: tl.constexpr = 8 if CODES == 5 else 4
        P: tl.constexpr = 32 // BITS
        W: tl.constexpr = D // P
        BLOCK_W: tl.constexpr = BLOCK_D // P
        j = tl.arange(0, BLOCK_W)
        k = tl.arange(0, P)
        w_ok = ok_t[:, None] & (j < W)[None, :]
        words = tl.load(base.to(tl.pointer_type(tl.int32)) + (blk * (stride // 4) + slot * W)[:, None] + j[None, :],
                        mask=w_ok, other=0)
        f = (words[:, None, :] >> (k * BITS)[None, :, None]) & ((1 << BITS) - 1)  # [N, P, BLOCK_W]
        if CODES == 5:
            v = _e4m3(f)
        elif CODES == 6:
            v = _e2m1(f)
        else:
            v = tl.load(lv_base + f)
        if SKIND != 4:
            G: tl.constexpr = (D + GROUP - 1) // GROUP
            s = tl.load(sc_base + (blk * sc_stride + slot * G)[:, None] + ((j * P) // GROUP)[None, :], mask=w_ok,
                        other=0)
            v = v * _scale_values(s, SKIND)[:, None, :]
        x = tl.reshape(v, [v.shape[0], BLOCK_D])
    elif CODES == 3 and BITS_ == 3 and D % 8 == 0 and GROUP % 8 == 0:
        # 3 bits: eight values in each three bytes, each byte loaded once: (N, T, 8) fields, in channel order
        ROW3: tl.constexpr = D * 3 // 8
        BLOCK_T: tl.constexpr = BLOCK_D // 8
        t = tl.arange(0, BLOCK_T)
        t_ok = ok_t[:, None] & (t < D // 8)[None, :]
        at = (blk * stride + slot * ROW3)[:, None] + 3 * t[None, :]
        v24 = (tl.load(base + at, mask=t_ok, other=0).to(tl.int32) & 255) \
            | ((tl.load(base + at + 1, mask=t_ok, other=0).to(tl.int32) & 255) << 8) \
            | ((tl.load(base + at + 2, mask=t_ok, other=0).to(tl.int32) & 255) << 16)
        v = tl.load(lv_base + ((v24[:, :, None] >> (3 * tl.arange(0, 8))[None, None, :]) & 7))  # [N, BLOCK_T, 8]
        if SKIND != 4:
            G3: tl.constexpr = (D + GROUP - 1) // GROUP
            s = tl.load(sc_base + (blk * sc_stride + slot * G3)[:, None] + ((8 * t) // GROUP)[None, :], mask=t_ok,
                        other=0)
            v = v * _scale_values(s, SKIND)[:, :, None]
        x = tl.reshape(v, [v.shape[0], BLOCK_D])
    else:
        ch = tl.arange(0, BLOCK_D)
        m = ok_t[:, None] & (ch < D)[None, :]
        if CODES == 1:
            b = tl.load(base + (blk * stride + slot * D)[:, None] + ch[None, :], mask=m, other=0).to(tl.int32)
            v = _e4m3(b & 255)
        elif CODES == 3:  # value i at bits [i b, (i + 1) b): from its first byte and the next (when in the row)
            ROW_S: tl.constexpr = (D * BITS_ + 7) // 8
            bit = ch * BITS_
            at = (blk * stride + slot * ROW_S)[:, None] + (bit // 8)[None, :]
            lo = tl.load(base + at, mask=m, other=0).to(tl.int32) & 255
            hi = tl.load(base + at + 1, mask=m & (bit // 8 + 1 < ROW_S)[None, :], other=0).to(tl.int32) & 255
            v = tl.load(lv_base + (((lo | (hi << 8)) >> (bit % 8)[None, :]) & ((1 << BITS_) - 1)))
        else:
            ROW: tl.constexpr = (D + 1) // 2
            b = tl.load(base + (blk * stride + slot * ROW)[:, None] + (ch // 2)[None, :], mask=m,
                        other=0).to(tl.int32)
            v = _e2m1((b >> ((ch % 2) * 4)[None, :]) & 15)
        if SKIND != 4:
            G: tl.constexpr = (D + GROUP - 1) // GROUP
            s = tl.load(sc_base + (blk * sc_stride + slot * G)[:, None] + (ch // GROUP)[None, :], mask=m, other=0)
            v = v * _scale_values(s, SKIND)
        x = v
    return x


@triton.jit
def _dequant_tile(base, sc_base, z_base, lv_base, blk, slot, ok_t, stride, sc_stride, z_stride, D: tl.constexpr,
                  BLOCK_D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, SYM: tl.constexpr,
                  SKIND: tl.constexpr, CB: tl.constexpr, CODES: tl.constexpr):
    """[BLOCK_N, BLOCK_D] float32 tile of one path for the tokens in slots `slot` of blocks `blk` (int64), in the
    path's storage order (`_layout`). Each tensor has its own block stride (`stride`, `sc_stride`, `z_stride`: a page
    when they are views of one page pool) and contiguous rows, so a token's words start at blk * stride + slot * W, its
    scales at blk * sc_stride + slot * groups, its zeros at blk * z_stride + slot * groups.
    Codes: one load of the tile's int32 words, a broadcast shift and mask into (N, P, BLOCK_W) runs of channels, the
    scale and zero applied per run where a run lies in one group (per value otherwise), flattened in place.
    CB: a codebook of 2^BITS levels at lv_base; code q reads levels[q] (a select over levels held in registers at
    2 and 4 bits, a gather at 8). CODES != 0: byte codes (`_byte_tile`)."""
    if CODES != 0:
        x = _byte_tile(base, sc_base, lv_base, blk, slot, ok_t, stride, sc_stride, D, BLOCK_D, BITS, GROUP, SKIND,
                       CODES)
    elif BITS == 0:
        ch, ch_ok = _layout(D, BITS, BLOCK_D, CODES)
        x = tl.load(base + (blk * stride + slot * D)[:, None] + ch[None, :], mask=ok_t[:, None] & ch_ok[None, :],
                    other=0.0).to(tl.float32)
    else:
        PW: tl.constexpr = 32 // BITS
        W: tl.constexpr = (D + PW - 1) // PW
        BLOCK_W: tl.constexpr = BLOCK_D // PW
        groups: tl.constexpr = D // GROUP
        j = tl.arange(0, BLOCK_W)
        k = tl.arange(0, PW)
        words = tl.load(base + (blk * stride + slot * W)[:, None] + j[None, :], mask=ok_t[:, None] & (j < W)[None, :],
                        other=0)
        qi = (words[:, None, :] >> (k * BITS)[None, :, None]) & ((1 << BITS) - 1)  # [N, PW, BW]
        if CB:
            if BITS <= 4:
                q = _levels_at(qi, lv_base, BITS)
            else:
                q = tl.load(lv_base + qi)
        else:
            q = qi.to(tl.float32)
        s_row = (blk * sc_stride + slot * groups)[:, None, None]  # [N, 1, 1] first scale of each token
        if GROUP % W == 0:  # each run of W channels lies in one group: one scale (and zero) per token and run
            g = ((k * W) // GROUP)[None, :, None]  # [1, PW, 1] group of each run
            g_ok = (ok_t[:, None] & (k * W < D)[None, :])[:, :, None]
        else:
            ch = k[:, None] * W + j[None, :]  # [PW, BW]
            g = (ch // GROUP)[None, :, :]
            g_ok = ok_t[:, None, None] & ((j < W)[None, :] & (ch < D))[None, :, :]
        s = _scale_values(tl.load(sc_base + s_row + g, mask=g_ok, other=0), SKIND)
        if SYM:
            x = (q - (1 << (BITS - 1))) * s
        else:
            z_row = (blk * z_stride + slot * groups)[:, None, None]
            x = q * s + tl.load(z_base + z_row + g, mask=g_ok, other=0.0).to(tl.float32)
        x = tl.reshape(x, [x.shape[0], BLOCK_D])
    return x


@triton.jit
def _typed(p, KIND: tl.constexpr):
    """A byte pointer (block) as a pointer to the dtype of DTYPE_CODES code KIND (fp16, bf16, fp32, int8)."""
    if KIND == 0:
        out = p.to(tl.pointer_type(tl.float16))
    elif KIND == 1:
        out = p.to(tl.pointer_type(tl.bfloat16))
    elif KIND == 2:
        out = p.to(tl.pointer_type(tl.float32))
    else:
        out = p.to(tl.pointer_type(tl.int8))
    return out


@triton.jit
def _pairs_tile(page_base, blk, slot, ok_t, page_stride, D: tl.constexpr, BLOCK_D: tl.constexpr, DESC: tl.constexpr):
    """[BLOCK_N, BLOCK_D] float32 tile, in channel order, of a RoPE key stored with bits per group of frequency pairs
    (format=pairs) for the tokens in slots `slot` of blocks `blk`: every part of a block lies in its page at the
    byte offsets of DESC = (1, interleaved, pairs per group, symmetric, number of groups, then each group's 8 fields
    in turn: `layout.flat_pairs`). Channel c belongs to
    pair i = c mod D/2 (rotate-half order) or c // 2 (interleaved), so to group i // per at position
    j = 2 (i mod per) + (second channel of its pair); a group is (bits, row bytes, data offset, scales offset, zeros
    offset, data kind, scale kind, zero kind): its codes an LSB-first byte stream (code j at bits [j b, (j + 1) b)),
    one scale (and zero) per token; 16 bits: its values."""
    INTERLEAVED: tl.constexpr = DESC[1]
    PER: tl.constexpr = DESC[2]
    SYM: tl.constexpr = DESC[3]
    NG: tl.constexpr = DESC[4]
    HALF: tl.constexpr = D // 2
    c = tl.arange(0, BLOCK_D)
    c_ok = c < D
    if INTERLEAVED:
        i = c // 2
        second = c % 2
    else:
        i = c % HALF
        second = (c >= HALF).to(tl.int32)
    grp = i // PER
    j = 2 * (i % PER) + second
    page = page_base + blk * page_stride  # [BLOCK_N] byte pointers: each token's page
    x = tl.zeros([blk.shape[0], BLOCK_D], tl.float32)
    for g in tl.static_range(NG):
        m = ok_t[:, None] & (c_ok & (grp == g))[None, :]
        v = _pairs_group(page, slot, ok_t, m, j, PER, SYM, DESC[5 + 8 * g], DESC[6 + 8 * g], DESC[7 + 8 * g],
                         DESC[8 + 8 * g], DESC[9 + 8 * g], DESC[10 + 8 * g], DESC[11 + 8 * g], DESC[12 + 8 * g])
        x = tl.where(m, v, x)
    return x


@triton.jit
def _pairs_group(page, slot, ok_t, m, j, PER: tl.constexpr, SYM: tl.constexpr, BITS: tl.constexpr, ROW: tl.constexpr,
                 AT_DATA: tl.constexpr, AT_SC: tl.constexpr, AT_Z: tl.constexpr, KIND_DATA: tl.constexpr,
                 KIND_SC: tl.constexpr, KIND_Z: tl.constexpr):
    """One group of `_pairs_tile`: its values at positions j of the tokens' pages (masked by m), float32."""
    if BITS == 16:
        v = tl.load(_typed(page + AT_DATA, KIND_DATA)[:, None] + (slot * (2 * PER))[:, None] + j[None, :],
                    mask=m, other=0.0).to(tl.float32)
    else:
        at = (j * BITS) // 8
        byte = page[:, None] + AT_DATA + (slot * ROW)[:, None] + at[None, :]
        lo = tl.load(byte, mask=m, other=0).to(tl.int32)
        hi = tl.load(byte + 1, mask=m & (at + 1 < ROW)[None, :], other=0).to(tl.int32)
        q = (((lo | (hi << 8)) >> ((j * BITS) % 8)[None, :]) & ((1 << BITS) - 1)).to(tl.float32)
        # int8 scales are power-of-two exponents (`SCALE_KINDS` 1), the others a float dtype (0)
        s = tl.load(_typed(page + AT_SC, KIND_SC) + slot, mask=ok_t, other=0)
        s = _scale_values(s, 1 if KIND_SC == _POW2 else 0)
        if SYM:
            v = (q - (1 << (BITS - 1))) * s[:, None]
        else:
            z = tl.load(_typed(page + AT_Z, KIND_Z) + slot, mask=ok_t, other=0).to(tl.float32)
            v = q * s[:, None] + z[:, None]
    return v


@triton.jit
def _operand(x, MODE: tl.constexpr):
    """x as `_dot` multiplies it: bfloat16 (MODE=1), bfloat16-rounded float32 (2), float32 (0). Applying it once to a
    tile that several products read (or to the queries, once before the loop) keeps the tile at half the registers
    in bfloat16 and the numbers as they were (`_dot` applying it again changes nothing)."""
    if MODE == 1:
        out = x.to(tl.bfloat16)
    elif MODE == 2:
        out = x.to(tl.bfloat16).to(tl.float32)
    else:
        out = x
    return out


@triton.jit
def _dot(a, b, MODE: tl.constexpr):
    """a @ b in float32: exact float32 products (MODE=0), bfloat16 operands on tensor cores (1), or bfloat16-rounded
    operands multiplied in float32 (2: the same numbers, for Triton's CPU interpreter, whose bfloat16 dot is wrong)."""
    a, b = _operand(a, MODE), _operand(b, MODE)  # (a no-op on an operand converted already)
    if MODE == 1:
        out = tl.dot(a, b)
    else:
        out = tl.dot(a, b, input_precision="ieee")
    return out


@triton.jit
def _split_partial(Q, QR, stride_qb, stride_qh, stride_qrb, stride_qrh, b, h, h_ok, out_slot, local_split, scale,
                   O_PART, LSE_PART, stride_ob, stride_os, stride_oh, stride_lb, stride_ls, SEG,
                   DC: tl.constexpr, DR: tl.constexpr, BLOCK_DC: tl.constexpr, BLOCK_DR: tl.constexpr,
                   BLOCK_N: tl.constexpr, DOT_MODE: tl.constexpr, FMT: tl.constexpr):
    """Attend the heads `h` of sequence b over one split of the segment SEG (its descriptor, `_descriptor`; FMT its
    formats, `_format_constexprs`); store its partial output and LSE. The queries are read, and the output written,
    in the storage order of the segment's paths (`_layout`)."""
    C, C_SC, C_Z, R, R_SC, R_Z = SEG[0], SEG[1], SEG[2], SEG[3], SEG[4], SEG[5]
    C_ST, C_SC_ST, C_Z_ST, R_ST, R_SC_ST, R_Z_ST = SEG[6], SEG[7], SEG[8], SEG[9], SEG[10], SEG[11]
    TABLE, TABLE_W, LENS, BS, TPS = SEG[12], SEG[13], SEG[14], SEG[15], SEG[16]
    C_LV, R_LV = SEG[19], SEG[20]
    C_BITS: tl.constexpr = FMT[0]
    C_GROUP: tl.constexpr = FMT[1]
    C_SYM: tl.constexpr = FMT[2]
    C_SKIND: tl.constexpr = FMT[3]
    R_BITS: tl.constexpr = FMT[4]
    R_GROUP: tl.constexpr = FMT[5]
    R_SYM: tl.constexpr = FMT[6]
    R_SKIND: tl.constexpr = FMT[7]
    C_CB: tl.constexpr = FMT[8]
    R_CB: tl.constexpr = FMT[9]
    R_PAIRS: tl.constexpr = FMT[10]
    C_CODES: tl.constexpr = FMT[11]
    R_CODES: tl.constexpr = FMT[12]
    dc, dc_ok = _layout(DC, C_BITS, BLOCK_DC, C_CODES)
    dr, dr_ok = _layout(DR, R_BITS, BLOCK_DR, R_CODES)
    q = tl.load(Q + b.to(tl.int64) * stride_qb + h[:, None] * stride_qh + dc[None, :],
                mask=h_ok[:, None] & dc_ok[None, :], other=0.0).to(tl.float32)
    qr = tl.load(QR + b.to(tl.int64) * stride_qrb + h[:, None] * stride_qrh + dr[None, :],
                 mask=h_ok[:, None] & dr_ok[None, :], other=0.0).to(tl.float32)
    q, qr = _operand(q, DOT_MODE), _operand(qr, DOT_MODE)  # once, not per tile
    n_tokens = tl.load(LENS + b).to(tl.int32)
    start = local_split * TPS
    end = tl.minimum(start + TPS, n_tokens)
    m_i = tl.zeros_like(h).to(tl.float32) + float("-inf")
    l_i = tl.zeros_like(m_i)
    acc = tl.zeros(q.shape, tl.float32)
    for t0 in range(start, end, BLOCK_N):
        tok = t0 + tl.arange(0, BLOCK_N)
        tok_ok = tok < end
        blk = tl.load(TABLE + b.to(tl.int64) * TABLE_W + tok // BS, mask=tok_ok, other=0).to(tl.int64)
        slot = (tok % BS).to(tl.int64)
        c = _dequant_tile(C, C_SC, C_Z, C_LV, blk, slot, tok_ok, C_ST, C_SC_ST, C_Z_ST, DC, BLOCK_DC, C_BITS,
                          C_GROUP, C_SYM, C_SKIND, C_CB, C_CODES)
        if R_PAIRS[0] == 1:  # bits per group of RoPE pairs: the tile from the path's pages, in channel order
            r = _pairs_tile(R, blk, slot, tok_ok, R_ST, DR, BLOCK_DR, R_PAIRS)
        else:
            r = _dequant_tile(R, R_SC, R_Z, R_LV, blk, slot, tok_ok, R_ST, R_SC_ST, R_Z_ST, DR, BLOCK_DR, R_BITS,
                              R_GROUP, R_SYM, R_SKIND, R_CB, R_CODES)
        c, r = _operand(c, DOT_MODE), _operand(r, DOT_MODE)  # the tile both products read, in their dtype once
        s = (_dot(q, tl.trans(c), DOT_MODE) + _dot(qr, tl.trans(r), DOT_MODE)) * scale  # [BLOCK_H, BLOCK_N]
        s = tl.where(tok_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row masked so far stays empty, not NaN
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p, c, DOT_MODE)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    lse = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
    o_base = O_PART + b.to(tl.int64) * stride_ob + out_slot * stride_os
    tl.store(o_base + h[:, None] * stride_oh + dc[None, :], out, mask=h_ok[:, None] & dc_ok[None, :])
    tl.store(LSE_PART + b.to(tl.int64) * stride_lb + out_slot * stride_ls + h, lse, mask=h_ok)


@triton.jit
def _stage1_kernel(
    Q, QR, stride_qb, stride_qh, stride_qrb, stride_qrh,
    O_PART, LSE_PART, stride_ob, stride_os, stride_oh, stride_lb, stride_ls, scale, H,
    SEGS,  # one descriptor per segment (`_descriptor`)
    FMTS: tl.constexpr,  # per segment, its paths' formats (`_format_constexprs`)
    NSEG: tl.constexpr, DC: tl.constexpr, DR: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DC: tl.constexpr,
    BLOCK_DR: tl.constexpr, BLOCK_N: tl.constexpr, DOT_MODE: tl.constexpr,
):
    hb = tl.program_id(0)
    b = tl.program_id(1)
    split = tl.program_id(2)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < H
    for i in tl.static_range(NSEG):  # the program's segment: the one whose splits hold its split index
        first = SEGS[i][17]
        if (split >= first) & (split < first + SEGS[i][18]):
            _split_partial(Q, QR, stride_qb, stride_qh, stride_qrb, stride_qrh, b, h, h_ok, split, split - first,
                           scale, O_PART, LSE_PART, stride_ob, stride_os, stride_oh, stride_lb, stride_ls, SEGS[i],
                           DC, DR, BLOCK_DC, BLOCK_DR, BLOCK_N, DOT_MODE, FMTS[i])


@triton.jit
def _merge_kernel(O_PART, LSE_PART, OUT, LSE, stride_ob, stride_os, stride_oh, stride_lb, stride_ls, stride_outb,
                  stride_outh, n_splits, H, DC: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DC: tl.constexpr,
                  BLOCK_HM: tl.constexpr):
    """Stage 2, one program per (sequence, block of BLOCK_HM heads): out = sum_s softmax_s(lse) o_s over every split
    of every segment, and its log-sum-exp (LSE (B, H)); a split without tokens (lse = -inf) weighs 0, a sequence
    without any token gets 0 and -inf."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_HM + tl.arange(0, BLOCK_HM)
    h_ok = h < H
    s = tl.arange(0, BLOCK_S)
    lse = tl.load(LSE_PART + b * stride_lb + s[:, None] * stride_ls + h[None, :],
                  mask=(s[:, None] < n_splits) & h_ok[None, :], other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp(lse - m_safe[None, :]), 0)
    inv = tl.where(total > 0, 1.0 / tl.where(total > 0, total, 1.0), 0.0)
    dc = tl.arange(0, BLOCK_DC)
    tile = h_ok[:, None] & (dc < DC)[None, :]
    acc = tl.zeros([BLOCK_HM, BLOCK_DC], tl.float32)
    for i in range(n_splits):
        lse_i = tl.load(LSE_PART + b * stride_lb + i * stride_ls + h, mask=h_ok, other=float("-inf"))
        w = tl.exp(lse_i - m_safe) * inv
        o = tl.load(O_PART + b * stride_ob + i * stride_os + h[:, None] * stride_oh + dc[None, :], mask=tile,
                    other=0.0)
        acc += w[:, None] * o
    tl.store(OUT + b * stride_outb + h[:, None] * stride_outh + dc[None, :], acc, mask=tile)
    tl.store(LSE + b * H + h, tl.where(total > 0, m_safe + tl.log(tl.where(total > 0, total, 1.0)), float("-inf")),
             mask=h_ok)


def _codes_constexpr(p: PagedPath, d: int) -> int:
    """How the kernel reads a path's codes: 0 int32 words or float values; byte codes as int32 words (5 e4m3, 6 e2m1,
    7 a 4-bit stream) where a token's bytes are whole words, every group whole words and the tensor word-aligned,
    else a byte per value (1 e4m3, 2 e2m1, 3 a stream)."""
    kind = CODES.index(p.codes)
    if kind == 0:
        return 0
    if 32 % p.bits:  # a 3-bit stream: values cross bytes
        return kind
    per_word = 32 // p.bits
    group = p.group if p.scales is not None else d
    aligned = p.data.stride(0) % 4 == 0 and p.data.data_ptr() % 4 == 0
    return kind + 4 if d % per_word == 0 and group % per_word == 0 and aligned else kind


def _format_constexprs(seg: Segment, d_c: int, d_r: int) -> tuple:
    """A segment's formats, compile-time: per path bits, group, symmetric, the scales' kind (`scale_kind`; content,
    then rope), whether each path reads a codebook, the RoPE pairs descriptor ((0,): none), then how each path's
    codes are read (`_codes_constexpr`)."""
    out = []
    for p in (seg.content, seg.rope):
        out += [p.bits, p.group if p.bits else 1, bool(p.symmetric or p.bits == 0),
                scale_kind(p) if p.bits > 0 else 0]
    out += [p.levels is not None and p.bits > 0 for p in (seg.content, seg.rope)]
    out.append(flat_pairs(seg.rope.pairs) if seg.rope.pairs is not None else (0,))
    out += [_codes_constexpr(seg.content, d_c), _codes_constexpr(seg.rope, d_r)]
    return tuple(out)


def _descriptor(seg: Segment, first: int, plan: tuple[int, int], dummy: torch.Tensor) -> tuple:
    """A segment as the kernel reads it: per path its data, scales and zeros (content, then rope), their block
    strides (a page for views), the block table, its width, the lengths, the block size, tokens per split, the
    segment's first split and its number of splits, then each path's codebook levels."""
    tensors = []
    for p in (seg.content, seg.rope):
        tensors += [p.data, None if p.bits == 0 else p.scales,
                    None if p.bits == 0 or p.symmetric or p.codes != "words" else p.zeros]
    strides = [0 if t is None else t.stride(0) for t in tensors]
    lengths = seg.lengths if seg.lengths.dtype == torch.int32 else seg.lengths.to(torch.int32)
    tokens_per_split, splits = plan
    return tuple([dummy if t is None else t for t in tensors] + strides
                 + [seg.block_table, seg.block_table.shape[1], lengths, int(seg.content.data.shape[1]),
                    tokens_per_split, first, splits]
                 + [dummy if p.levels is None else p.levels for p in (seg.content, seg.rope)])


def latent_decode(q_latent: torch.Tensor, q_rope: torch.Tensor, scale: float, segments, *,
                  block_n: int | None = None, block_h: int | None = None, num_warps: int | None = None,
                  num_stages: int | None = None, split_tokens: int | None = None, dot: str = "auto",
                  return_lse: bool = False):
    """Triton decode attention (see the module docstring). q_latent (B, H, d_c), q_rope (B, H, d_r), segments
    (a list of `Segment`) -> o_latent (B, H, d_c) float32 (with return_lse, also its log-sum-exp (B, H) float32).
    Two launches: stage 1 over every segment, stage 2; paths in a rotated basis (`PagedPath.rotation`) are read
    against the rotated query, each rotation's segments in their own two launches (`in_bases`)."""
    require_triton()
    check_inputs(q_latent, q_rope, segments)
    if dot not in DOTS:
        raise ValueError(f"dot={dot!r}; allowed: {list(DOTS)}")
    if block_n is not None and (block_n < 16 or block_n & (block_n - 1)):
        raise ValueError(f"block_n={block_n}; allowed: a power of two >= 16")
    launch = dict(block_n=block_n, block_h=block_h, num_warps=num_warps, num_stages=num_stages,
                  split_tokens=split_tokens, dot=dot)
    return in_bases(q_latent, q_rope, segments, lambda ql, qr, segs: launch_decode(ql, qr, scale, segs, **launch),
                    return_lse)


def launch_decode(q_latent: torch.Tensor, q_rope: torch.Tensor, scale: float, segments, *, block_n: int | None,
                  block_h: int | None, num_warps: int | None, num_stages: int | None, split_tokens: int | None,
                  dot: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The two launches over checked segments with no rotation: (o_latent, lse)."""
    b, h, d_c = q_latent.shape
    d_r = q_rope.shape[-1]
    dev = q_latent.device
    cfg = launch_config(h, d_c, block_h, block_n, num_warps)
    head_blocks = math.ceil(h / cfg["block_h"])
    # compiled ahead of time for a GPU (`kernels.aot`): the specialization a GPU launch builds
    on_gpu = dev.type == "cuda" or bool(COMPILE_ONLY)
    dot_bf16 = dot == "bf16" or (dot == "auto" and on_gpu and q_latent.dtype == torch.bfloat16)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    dot_mode = (2 if interpreted else 1) if dot_bf16 else 0
    plan = split_plan(b, head_blocks, [seg.longest() for seg in segments], cfg["block_n"], num_sms(dev),
                      split_tokens)
    n_splits = sum(n for _, n in plan)
    o_part = torch.empty(b, n_splits, h, d_c, device=dev, dtype=torch.float32)
    lse_part = torch.empty(b, n_splits, h, device=dev, dtype=torch.float32)
    out = torch.empty(b, h, d_c, device=dev, dtype=torch.float32)
    lse = torch.empty(b, h, device=dev, dtype=torch.float32)
    if b == 0 or h == 0:
        return out, lse
    dummy = torch.zeros(1, device=dev)
    extra = {} if num_stages is None else {"num_stages": num_stages}
    firsts = [sum(n for _, n in plan[:i]) for i in range(len(segments))]
    _stage1_kernel[(head_blocks, b, n_splits)](
        q_latent, q_rope, q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
        o_part, lse_part, o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0),
        lse_part.stride(1), float(scale), h,
        tuple(_descriptor(seg, first, p, dummy) for seg, first, p in zip(segments, firsts, plan)),
        tuple(_format_constexprs(seg, d_c, d_r) for seg in segments),
        NSEG=len(segments), DC=d_c, DR=d_r, BLOCK_H=cfg["block_h"], BLOCK_DC=next_pow2(d_c),
        BLOCK_DR=next_pow2(d_r), BLOCK_N=cfg["block_n"], DOT_MODE=dot_mode, num_warps=cfg["num_warps"], **extra,
    )
    # the CPU interpreter runs programs one after another: the widest head tile, fewest programs (the same sums)
    tile = merge_heads(b, h, 1 if interpreted else num_sms(dev))
    _merge_kernel[(b, math.ceil(h / tile))](
        o_part, lse_part, out, lse, o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0),
        lse_part.stride(1), out.stride(0), out.stride(1), n_splits, h, DC=d_c, BLOCK_S=next_pow2(n_splits, 2),
        BLOCK_DC=next_pow2(d_c), BLOCK_HM=tile, num_warps=4,
    )
    return out, lse
