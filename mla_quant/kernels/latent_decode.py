"""Triton decode attention over the (quantized) latent cache: one query token per sequence, all heads per program.

    o_latent = latent_decode(q_latent, q_rope, layer, scale, bias)     # (B, H, d_c) float32
    o_latent = latent_decode_reference(q_latent, q_rope, layer, scale, bias)   # same signature, plain PyTorch

`layer` is a `LatentCacheLayer` (every token BF16/float in layer.content, layer.rope) or a
`QuantizedLatentCacheLayer`: its quantized tokens are read IN PLACE from the stored tensors documented in
mla_quant/quant/cache.py (packed codes, scales, zeros per path) and dequantized in registers; its protected tokens
(sinks and the recent window) are read from layer.content / layer.rope. Nothing is dequantized to memory.

Design (flash-decoding, split-KV): stage 1 runs one program per (sequence, split) over a segment of tokens (the
quantized region and the protected region are separate launches of the same kernel, specialised per path format);
each program holds all heads (BLOCK_H rows, so one dequantized tile serves every head, as in DESIGN.md's MQA view
of absorbed MLA), walks its tokens in BLOCK_N tiles with an online softmax and writes a normalised partial output
and its log-sum-exp. Stage 2 merges the partials with log-sum-exp weights (PyTorch).

Supported per path: float values (bf16 / fp16 / fp32) or int with bits 2, 4, 8 (symmetric or asymmetric, group size
a multiple of the codes per byte, scales fp16 / bf16 / fp32 / pow2). `check_triton_format` names anything else.
On the CPU the kernel runs under TRITON_INTERPRET=1 (set before this module is imported); tests compare it with the
reference there, and `python run.py experiment=bench_kernel` (mla_quant/stages/bench_kernel.py) measures it on a GPU.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from mla_quant.models.latent_attention import latent_attention
from mla_quant.models.latent_cache import LatentCacheLayer
from mla_quant.quant.cache import QuantizedLatentCacheLayer

TRITON_INT_BITS = (2, 4, 8)


def check_triton_format(fmt) -> None:
    """Raise ValueError if the Triton decode kernel cannot read `fmt` (a CacheFormat)."""
    for path in ("content", "rope"):
        p = fmt.path(path)
        if p.format == "bf16":
            continue
        if p.format != "int" or p.bits not in TRITON_INT_BITS:
            what = f"format={p.format}" if p.format != "int" else f"bits={p.bits}"
            raise ValueError(f"quant.{path}.{what}: quant.backend=triton reads bf16 or int with bits "
                             f"{list(TRITON_INT_BITS)}; use quant.backend=torch for this format")
        d = fmt.d_c if path == "content" else fmt.d_r
        group = p.group_size or d
        if group % (8 // p.bits):
            raise ValueError(f"quant.{path}.group_size={group}: quant.backend=triton needs groups that are a "
                             f"multiple of {8 // p.bits} (the codes in one byte at bits={p.bits})")


def require_triton(what: str = "quant.backend=triton", hint: str = "") -> None:
    """Raise RuntimeError naming `what` unless the kernel can launch here (a CUDA GPU, or the CPU interpreter)."""
    if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        raise RuntimeError(f"{what} cannot run: no CUDA GPU here (set TRITON_INTERPRET=1 before starting to run the "
                           f"kernel in Triton's CPU interpreter){hint}")


def mask_to_bias(mask: torch.Tensor | None, batch: int, length: int) -> torch.Tensor | None:
    """An attention mask as transformers hands it for one query, (B, 1, 1, S) bool or additive -> (B, S) float32."""
    if mask is None:
        return None
    m = mask[:, 0, -1, -length:].expand(batch, length)
    if m.dtype == torch.bool:
        return torch.zeros(m.shape, dtype=torch.float32, device=m.device).masked_fill(~m, float("-inf"))
    return m.float()


# --------------------------------------------------------------------------------------------------- reference
def latent_decode_reference(q_latent: torch.Tensor, q_rope: torch.Tensor, layer, scale: float,
                            bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's specification: dequantize every stored token to float32 (as the kernel does in registers), then
    absorbed attention in float32. q_latent (B, H, d_c), q_rope (B, H, d_r), bias (B, S) additive or None ->
    (B, H, d_c) float32."""
    content, rope = layer.read_stored(torch.float32) if hasattr(layer, "read_stored") else layer.read()
    mask = None if bias is None else bias[:, None, None, :]
    if mask is None:  # one query at the last position: every token is visible
        mask = torch.zeros(content.shape[0], 1, 1, content.shape[1], device=content.device)
    out = latent_attention(q_latent.float()[:, :, None], q_rope.float()[:, :, None], content.float(), rope.float(),
                           scale, mask)
    return out[:, :, 0]


# ------------------------------------------------------------------------------------------------------ kernel
@triton.jit
def _dequant_tile(base, tok_ok, d_offs, d_ok, stride_t, sc_base, sc_stride_t, z_base, z_stride_t, tok,
                  BITS: tl.constexpr, GROUP: tl.constexpr, SYM: tl.constexpr, POW2: tl.constexpr):
    """[BLOCK_N, BLOCK_D] float32 tile of one path for tokens `tok` (BITS=0: float values)."""
    ok = tok_ok[:, None] & d_ok[None, :]
    if BITS == 0:
        x = tl.load(base + tok[:, None] * stride_t + d_offs[None, :], mask=ok, other=0.0).to(tl.float32)
    else:
        per_byte: tl.constexpr = 8 // BITS
        byte = tl.load(base + tok[:, None] * stride_t + (d_offs // per_byte)[None, :], mask=ok, other=0)
        shift = ((d_offs % per_byte) * BITS).to(tl.uint8)
        q = ((byte >> shift[None, :]) & ((1 << BITS) - 1)).to(tl.float32)
        g = (d_offs // GROUP)[None, :]
        s = tl.load(sc_base + tok[:, None] * sc_stride_t + g, mask=ok, other=0)
        if POW2:
            s = tl.exp2(s.to(tl.float32))
        else:
            s = s.to(tl.float32)
        if SYM:
            x = (q - (1 << (BITS - 1))) * s
        else:
            z = tl.load(z_base + tok[:, None] * z_stride_t + g, mask=ok, other=0.0).to(tl.float32)
            x = q * s + z
    return x

@triton.jit
def _stage1_kernel(
    Q, QR, stride_qb, stride_qh, stride_qrb, stride_qrh,
    C, C_SC, C_Z, stride_cb, stride_ct, stride_cscb, stride_csct, stride_czb, stride_czt,
    R, R_SC, R_Z, stride_rb, stride_rt, stride_rscb, stride_rsct, stride_rzb, stride_rzt,
    BIAS, stride_biasb,
    O_PART, LSE_PART, stride_ob, stride_os, stride_oh, stride_lb, stride_ls,
    n_tokens, tokens_per_split, split_base, pos_offset, gap_at, gap, scale, H,
    DC: tl.constexpr, DR: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DC: tl.constexpr, BLOCK_DR: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
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
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, n_tokens)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DC], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        tok = t0 + tl.arange(0, BLOCK_N)
        tok_ok = tok < end
        c = _dequant_tile(C + b * stride_cb, tok_ok, dc, dc_ok, stride_ct, C_SC + b * stride_cscb, stride_csct,
                          C_Z + b * stride_czb, stride_czt, tok, C_BITS, C_GROUP, C_SYM, C_POW2)
        r = _dequant_tile(R + b * stride_rb, tok_ok, dr, dr_ok, stride_rt, R_SC + b * stride_rscb, stride_rsct,
                          R_Z + b * stride_rzb, stride_rzt, tok, R_BITS, R_GROUP, R_SYM, R_POW2)
        s = (tl.dot(q, tl.trans(c)) + tl.dot(qr, tl.trans(r))) * scale  # [BLOCK_H, BLOCK_N]
        if HAS_BIAS:
            pos = tok + pos_offset + tl.where(tok >= gap_at, gap, 0)
            s += tl.load(BIAS + b * stride_biasb + pos, mask=tok_ok, other=0.0)[None, :]
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
    slot = split_base + split
    tl.store(O_PART + b * stride_ob + slot * stride_os + h[:, None] * stride_oh + dc[None, :], out,
             mask=h_ok[:, None] & dc_ok[None, :])
    tl.store(LSE_PART + b * stride_lb + slot * stride_ls + h, lse, mask=h_ok)


def _next_pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (n - 1).bit_length())


def _path_args(parts: dict, fmt, d: int, dummy: torch.Tensor) -> tuple[list, dict]:
    """Pointer/stride arguments and constexprs of one path's stored tensors (fmt None or bf16: float values)."""
    if fmt is None or fmt.format == "bf16":
        v = parts["values"]
        return [v, dummy, dummy, v.stride(0), v.stride(1), 0, 0, 0, 0], dict(BITS=0, GROUP=1, SYM=True, POW2=False)
    codes, sc = parts["codes"], parts["scales"]
    z = parts.get("zeros")
    args = [codes, sc, dummy if z is None else z, codes.stride(0), codes.stride(1), sc.stride(0), sc.stride(1),
            0 if z is None else z.stride(0), 0 if z is None else z.stride(1)]
    return args, dict(BITS=fmt.bits, GROUP=fmt.group_size or d, SYM=z is None, POW2=sc.dtype == torch.int8)


def latent_decode(q_latent: torch.Tensor, q_rope: torch.Tensor, layer, scale: float,
                  bias: torch.Tensor | None = None, block_n: int = 32, split_tokens: int = 256) -> torch.Tensor:
    """Triton decode attention (see the module docstring). q_latent (B, H, d_c), q_rope (B, H, d_r), bias (B, S)
    additive (0 / -inf) or None -> o_latent (B, H, d_c) float32."""
    require_triton()
    b, h, d_c = q_latent.shape
    d_r = q_rope.shape[-1]
    fmt = getattr(layer, "fmt", None)
    if fmt is not None:
        check_triton_format(fmt)
    n_q = layer.n_quantized if fmt is not None else 0
    n_s = layer.n_sink_held if fmt is not None else 0
    # protected tokens: the quantized layer's content/rope hold exactly them; a plain layer's buffers have spare room
    prot_c, prot_r = (layer.content, layer.rope) if fmt is not None else layer.read()
    n_p = prot_c.shape[1]
    dev = q_latent.device
    dummy = torch.zeros(1, device=dev)
    # (n_tokens, content args, rope args, pos_offset, gap_at, gap): token i of a segment sits at cache position
    # i + pos_offset + (gap if i >= gap_at), which indexes the bias
    segments = []
    if n_q:  # the quantized tokens follow the sinks
        c_args, c_k = _path_args(layer.stored["content"].view(), fmt.content, d_c, dummy)
        r_args, r_k = _path_args(layer.stored["rope"].view(), fmt.rope, d_r, dummy)
        segments.append((n_q, c_args, c_k, r_args, r_k, n_s, n_q, 0))
    if n_p:  # the protected tokens: sinks, then the recent window after the quantized ones
        c_args, c_k = _path_args({"values": prot_c}, None, d_c, dummy)
        r_args, r_k = _path_args({"values": prot_r}, None, d_r, dummy)
        segments.append((n_p, c_args, c_k, r_args, r_k, 0, n_s, n_q))
    if not segments:
        raise RuntimeError("latent_decode on an empty cache layer")
    splits = [math.ceil(n / split_tokens) for n, *_ in segments]
    o_part = torch.empty(b, sum(splits), h, d_c, device=dev, dtype=torch.float32)
    lse_part = torch.empty(b, sum(splits), h, device=dev, dtype=torch.float32)
    q_latent, q_rope = q_latent.contiguous(), q_rope.contiguous()
    if bias is not None:
        bias = bias.float().contiguous()
    kernel, base = _stage1_kernel, 0
    for (n, c_args, c_k, r_args, r_k, pos_offset, gap_at, gap), n_split in zip(segments, splits):
        kernel[(b, n_split)](
            q_latent, q_rope, q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
            *c_args, *r_args,
            dummy if bias is None else bias, 0 if bias is None else bias.stride(0),
            o_part, lse_part, o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0),
            lse_part.stride(1),
            n, split_tokens, base, pos_offset, gap_at, gap, float(scale), h,
            DC=d_c, DR=d_r, BLOCK_H=_next_pow2(h), BLOCK_DC=_next_pow2(d_c), BLOCK_DR=_next_pow2(d_r),
            BLOCK_N=block_n, HAS_BIAS=bias is not None,
            C_BITS=c_k["BITS"], C_GROUP=c_k["GROUP"], C_SYM=c_k["SYM"], C_POW2=c_k["POW2"],
            R_BITS=r_k["BITS"], R_GROUP=r_k["GROUP"], R_SYM=r_k["SYM"], R_POW2=r_k["POW2"],
        )
        base += n_split
    # stage 2: merge the splits with log-sum-exp weights
    weights = torch.softmax(lse_part, dim=1).nan_to_num(0.0)  # (B, splits, H); a split with no token weighs 0
    return (weights[..., None] * o_part).sum(dim=1)


# ------------------------------------------------------------------------------------------------ cache layers
class KernelDecode:
    """Mixin for a latent cache layer: one-token decode steps attend through `latent_decode`, reading the stored
    tensors in place; prefill and multi-token steps (and serving mode with no recent window, where the step must
    see its own fresh latent) take the PyTorch path of the layer it is mixed into."""

    def attend(self, q_latent, q_rope, content, rope, scale, mask):
        fmt = getattr(self, "fmt", None)
        fresh_needed = fmt is not None and fmt.mode == "serving" and fmt.recent == 0
        if q_latent.shape[2] != 1 or fresh_needed or (mask is not None and mask.shape[1] != 1):
            return super().attend(q_latent, q_rope, content, rope, scale, mask)
        self.append(content, rope)
        bias = mask_to_bias(mask, q_latent.shape[0], self.length)
        out = latent_decode(q_latent[:, :, 0], q_rope[:, :, 0], self, scale, bias)
        return out.to(q_latent.dtype)[:, :, None]


class TritonLatentCacheLayer(KernelDecode, LatentCacheLayer):
    """Plain (BF16 / float) latent cache whose decode steps run the Triton kernel."""


class TritonQuantizedLatentCacheLayer(KernelDecode, QuantizedLatentCacheLayer):
    """Quantized latent cache whose decode steps run the Triton kernel over the packed storage."""
