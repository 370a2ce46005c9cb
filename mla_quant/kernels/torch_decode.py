"""A decode step over a cache's stored tensors in PyTorch, the two forms every decode kernel is held to:

    out = latent_decode_reference(q_latent, q_rope, scale, segments)   # the specification: every token dequantized
    out = segment_attention(q_latent, q_rope, scale, segments)         # the Triton kernel's arithmetic, in place

`latent_decode_reference` dequantizes every segment's tokens to float32, then runs absorbed attention over their
union. `segment_attention` is the Triton kernel's arithmetic (kernels/latent_decode.py) reading the paged store's
codes in place through its block table, with no dequantized copy of the latent (the scales and zeros of an integer
path apply per group after the products). Both take q_latent (B, H, d_c), q_rope (B, H, d_r) and a list of `Segment`
(kernels/layout.py) and return (B, H, d_c) float32. `bytes_read` counts what one call reads from the tensors.

Attention sinks (`sinks`, (H,)): one more logit per head in the softmax, with no value (kernels/attention.py).
"""

from __future__ import annotations

import functools
import sys

import torch

from mla_quant.kernels.attention import reference_attention
from mla_quant.kernels.layout import E2M1_VALUES, PagedPath, Segment, WordLayout, check_inputs


def bytes_read(q_latent: torch.Tensor, q_rope: torch.Tensor, segments) -> int:
    """Bytes one call reads, measured from the tensors: every valid token's stored bytes (both paths, codes, scales,
    zeros), the block table rows, the lengths and the queries. (Partials are written and re-read on chip-near L2.)"""
    total = q_latent.numel() * q_latent.element_size() + q_rope.numel() * q_rope.element_size()
    for seg in segments:
        per_token = 0
        for p in (seg.content, seg.rope):
            if p.parts is not None:
                per_token += sum(t[0, 0].numel() * t.element_size() for t in p.parts.values())
                continue
            stored = [p.data] + ([] if p.bits == 0 else [p.scales] + ([] if p.symmetric else [p.zeros]))
            per_token += sum(t[0, 0].numel() * t.element_size() for t in stored)
        tokens = int(seg.lengths.sum())
        blocks = -(-seg.lengths.long() // max(1, seg.content.data.shape[1]))
        total += tokens * per_token + int(blocks.sum()) * 4 + seg.lengths.numel() * seg.lengths.element_size()
        total += sum(p.levels.numel() * 4 for p in (seg.content, seg.rope) if p.levels is not None)
    return total


def _gather_path(p: PagedPath, table: torch.Tensor, d: int) -> torch.Tensor:
    """(B, max_blocks * block_size, d) float32 tokens of one path, read through the block table."""
    idx = table.long()

    def rows(t):
        x = t[idx]  # (B, max_blocks, block_size, *)
        return x.reshape(x.shape[0], -1, *t.shape[2:])

    if p.decode is not None:  # parts of several widths (format=pairs), an engine's byte codes: its codec
        return p.decode({k: rows(v) for k, v in p.parts.items()}).float()
    if p.bits == 0:
        return rows(p.data).float()
    if p.codes != "words":
        return byte_codes(p, rows(p.data), None if p.scales is None else rows(p.scales), d)
    q = WordLayout(p.bits, d).unpack(rows(p.data))
    q = q.float() if p.levels is None else p.levels.float()[q.long()]
    s = rows(p.scales)
    s = torch.exp2(s.float()) if p.pow2 else s.float()
    s = s.repeat_interleave(p.group, dim=-1)
    if p.symmetric:
        return (q - (1 << (p.bits - 1))) * s
    return q * s + rows(p.zeros).float().repeat_interleave(p.group, dim=-1)


def byte_codes(p: PagedPath, data: torch.Tensor, scales: torch.Tensor | None, d: int) -> torch.Tensor:
    """An engine's byte codes as stored (`PagedPath`: e4m3 bytes, e2m1 nibbles two per byte, the even value low, or
    a stream of codebook indices) (..., row) uint8, and their scales (..., ceil(d / group)) of kind `p.scales_as` or
    None -> the values (..., d) float32, rotated back where the path is stored rotated (x = y @ rotation): the rule
    the kernels implement, written from torch's own e4m3 cast and the stream's bits read one by one."""
    if p.codes == "stream":  # value i at bits [i b, (i + 1) b) of the token's bytes, LSB first
        bits = ((data[..., None].long() >> torch.arange(8, device=data.device)) & 1).flatten(-2)  # bit 8 j + k
        weights = 1 << torch.arange(p.bits, device=data.device)
        codes = (bits[..., : d * p.bits].unflatten(-1, (d, p.bits)) * weights).sum(-1)
        x = p.levels.float()[codes]
    elif p.codes == "e4m3":
        x = data.view(torch.float8_e4m3fn).float()
    else:
        nibbles = torch.stack([data & 15, data >> 4], dim=-1).flatten(-2)[..., :d].long()
        mag = torch.tensor(E2M1_VALUES, device=data.device)[nibbles & 7]
        x = torch.where((nibbles & 8) != 0, -mag, mag)
    if scales is not None:
        if p.scales_as == "e8m0":
            s = torch.exp2(scales.float() - 127)
        elif p.scales_as == "e4m3":
            s = scales.view(torch.float8_e4m3fn).float()
        else:
            s = torch.exp2(scales.float()) if p.pow2 else scales.float()
        x = x * s.repeat_interleave(p.group, dim=-1)[..., :d]
    return x if p.rotation is None else x @ p.rotation


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
    out = reference_attention(q_latent.float()[:, :, None], q_rope.float()[:, :, None], torch.cat(cs, 1),
                              torch.cat(rs, 1), scale, mask)
    return out[:, :, 0].nan_to_num(0.0)  # a sequence with no token at all attends to nothing


class _Chunk:
    """One chunk of one path of a segment, as stored. A float path's values (B, n, d). An integer path with one
    group per token (the RoPE key's formats): its codes as floats in the words' byte order (`unpack_bytes`, no
    transpose) with the scale and zero (B, n) applied to the products, q . x = s (q' . c) + z sum(q) with q' the
    query's channels in that order. Several groups: the codes unpacked in channel order and dequantized in place,
    x = c s + z per group. (A symmetric path's zero is -2^(b-1) s.) A codebook (`levels`) reads c = levels[code].
    A path of parts of several widths (format=pairs) is decoded by its codec."""

    def __init__(self, p: PagedPath, read, d: int):
        self.order = None
        if p.decode is not None:  # parts of several widths (format=pairs): decoded by its codec
            self.x = p.decode({k: read(v) for k, v in p.parts.items()})
            return
        if p.bits == 0:
            self.x = read(p.data).float()
            return
        if p.codes != "words":  # an engine's byte codes without their codec at hand
            self.x = byte_codes(p, read(p.data), None if p.scales is None else read(p.scales), d)
            return
        layout = WordLayout(p.bits, d)
        s = read(p.scales)
        s = torch.exp2(s.float()) if p.pow2 else s.float()  # (B, n, G)
        z = -float(1 << (p.bits - 1)) * s if p.symmetric else read(p.zeros).float()
        b, n, g = s.shape
        if g == 1 and sys.byteorder == "little":
            self.x = _levels(layout.unpack_bytes(read(p.data)), p)
            self.s, self.z = s[..., 0][:, None], z[..., 0][:, None]
            self.order = _byte_order(p.bits, d, self.x.device)
            return
        c = _levels(layout.unpack_float(read(p.data)), p).reshape(b, n, g, d // g)
        self.x = c.mul_(s[..., None]).add_(z[..., None]).view(b, n, d)

    def scores(self, q: torch.Tensor) -> torch.Tensor:
        """q (B, H, d) float32 -> q . x (B, H, n)."""
        if self.order is None:
            return q @ self.x.transpose(1, 2)
        q_bytes = torch.nn.functional.pad(q, (0, 1))[..., self.order[0]]  # zero at padding positions
        return (q_bytes @ self.x.transpose(1, 2)) * self.s + q.sum(-1, keepdim=True) * self.z

    def values(self, p: torch.Tensor) -> torch.Tensor:
        """p (B, H, n) float32 -> p @ x (B, H, d)."""
        if self.order is None:
            return p @ self.x
        return ((p * self.s) @ self.x)[..., self.order[1]] + p @ self.z.transpose(1, 2)


def _levels(codes: torch.Tensor, p: PagedPath) -> torch.Tensor:
    """Float codes -> the codebook's levels at them (the codes themselves without a codebook)."""
    return codes if p.levels is None else p.levels.to(torch.float32)[codes.long()]


@functools.lru_cache(maxsize=None)
def _byte_order(bits: int, d: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(the channel at each `unpack_bytes` position, padding -> d) (P W,), (each channel's position) (d,)."""
    channels = WordLayout(bits, d).byte_channels(device)
    real = channels < d
    inverse = torch.empty(d, dtype=torch.long, device=device)
    inverse[channels[real]] = torch.arange(channels.numel(), device=device)[real]
    return channels.clamp(max=d), inverse


def _chunks(seg: Segment, keys: int | None):
    """(read, first, n) per chunk of a segment's tokens: read(t) -> the chunk's (B, n, *) rows of a pool tensor t,
    the index of its first token and n. Paged segments are read whole blocks at a time through the block table."""
    n_tokens = seg.longest()
    if seg.rows:  # dense buffers: block b is row b
        step = n_tokens if keys is None else max(1, keys)
        for k0 in range(0, n_tokens, step):
            yield (lambda t, k0=k0: t[:, k0 : k0 + step]), k0, min(step, n_tokens - k0)
        return
    block = seg.content.data.shape[1]
    n_blocks = -(-n_tokens // block)
    per = n_blocks if keys is None else max(1, keys // block)
    table = seg.block_table.long()
    for b0 in range(0, n_blocks, per):
        index = table[:, b0 : min(b0 + per, n_blocks)]  # the table may hold blocks past the longest
        yield (lambda t, index=index: t[index].flatten(1, 2)), b0 * block, index.shape[1] * block


def _softmax_group(chunks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chunks [(scores (B, H, n), valid (B, n), the content `_Chunk`)] under one softmax: their max (B, H, 1), the
    sum of their exponentials (B, H, 1) and the unnormalised output (B, H, d_c)."""
    s = torch.cat([c[0] for c in chunks], -1)
    s = s + torch.where(torch.cat([c[1] for c in chunks], -1), 0.0, float("-inf"))[:, None]
    m = s.amax(-1, keepdim=True)  # -inf where the group holds none of the sequence's tokens
    p = torch.exp(s - torch.where(m == float("-inf"), 0.0, m))
    out, k0 = 0, 0
    for _, _, x in chunks:
        n = x.x.shape[1]
        out = out + x.values(p[..., k0 : k0 + n])
        k0 += n
    return m, p.sum(-1, keepdim=True), out


def segment_attention(q_latent: torch.Tensor, q_rope: torch.Tensor, scale: float, segments,
                      keys_per_block: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence over the union of `segments`: q_latent (B, H, d_c), q_rope (B, H, d_r) ->
    o_latent (B, H, d_c) float32, the arithmetic of `latent_decode_reference` (every token as stored, float32)
    without its dequantized copy of the cache. Each segment is read `keys_per_block` tokens at a time (whole blocks
    of a paged one; None: each segment at once) and decoded into a workspace of at most `keys_per_block` tokens:
    the chunks that fit in it share one softmax, and the groups are merged by log-sum-exp weights (split-KV, as the
    Triton kernel does). A sequence with no token at all attends to nothing (zeros). `sinks` (H,): one more group per
    head, the sink's logit with no value (module docstring)."""
    q, qr = q_latent.float(), q_rope.float()
    d_c, d_r = q.shape[-1], qr.shape[-1]
    groups, chunks, held = [], [], 0
    for seg in segments:
        if seg.longest() == 0:
            continue
        lengths = seg.lengths.to(q.device)
        for read, first, n in _chunks(seg, keys_per_block):
            if keys_per_block is not None and chunks and held + n > keys_per_block:  # before this chunk is decoded
                groups.append(_softmax_group(chunks))
                chunks, held = [], 0
            content, rope = _Chunk(seg.content, read, d_c), _Chunk(seg.rope, read, d_r)
            valid = torch.arange(first, first + n, device=q.device)[None, :] < lengths[:, None]  # (B, n)
            chunks.append(((content.scores(q) + rope.scores(qr)) * scale, valid, content))
            held += n
    if chunks:
        groups.append(_softmax_group(chunks))
    if sinks is not None:
        b, h = q.shape[:2]
        groups.append((sinks.to(device=q.device, dtype=torch.float32).view(1, h, 1).expand(b, h, 1),
                       q.new_ones(b, h, 1), q.new_zeros(q.shape)))
    if not groups:
        return q.new_zeros(q.shape)
    if len(groups) == 1:
        m, total, out = groups[0]
    else:
        maxes = torch.stack([g[0] for g in groups])  # (groups, B, H, 1)
        m = maxes.amax(0)
        weights = torch.exp(maxes - torch.where(m == float("-inf"), 0.0, m))
        total = (torch.stack([g[1] for g in groups]) * weights).sum(0)
        out = (torch.stack([g[2] for g in groups]) * weights).sum(0)
    return torch.where(total > 0, out / total, 0.0)
