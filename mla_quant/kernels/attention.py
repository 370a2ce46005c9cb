"""Absorbed MLA attention over the latent cache, in plain PyTorch (the reference every kernel is checked against).

score(t, s) = scale * (q_latent_t . c_s + q_rope_t . k_s),   o_latent_t = sum_s softmax_s(score) c_s

with q_latent = W_UK^T q_nope per head (docs/method.md section 1). All heads share the single latent "head", so this is
multi-query attention with key [c ; k] (d_c + d_r) and value c (d_c); per-head K and V are never formed.

Prefill over many tokens runs in blocks (`AttentionBlocks`): query blocks of `query` tokens, and within one, key
blocks of `key * query / T_block` keys merged by an online softmax, so the workspace is at most H x query x key
scores per batch row, whatever the context length; under a causal mask a query block skips the keys after its last
query. `reference_attention` is the unblocked form (all H x T x S scores at once), kept as the spec.

    out = latent_attention(q_latent, q_rope, content, rope, scale, mask)                   # default blocks
    out = latent_attention(..., blocks=AttentionBlocks(query=128, key=1024))
    out = latent_attention(q_nope, ..., w_uk=w_uk, w_uv=w_uv, blocks=AttentionBlocks(256, 2048, expand_from=256))
    mask = CausalMask(keys)      # causal + padding without a (B, 1, T, S) tensor: keys (B, S) bool, True = real

The expanded form (`expanded_attention`, serving engines' prefill): with many queries per forward it pays to
up-project the latent to per-head keys [W_UK c ; k] and values W_UV c once and call
`torch.nn.functional.scaled_dot_product_attention` (flash / memory-efficient attention on CUDA): per key and head it
multiplies d_nope + d_r + d_v numbers instead of 2 d_c + d_r (320 against 1088 at V2's dims), for a one-off H x S x
d_c x (d_nope + d_v) up-projection. `AttentionBlocks.expand_from` sets the query count from which a forward takes it.

Masks: None (causal, queries are the last T of the S slots), a `CausalMask`, or one of the (B, 1, T, S) tensors
transformers hands attention modules (bool: True = attend; float: additive, as its eager attention adds it).

Attention sinks (`sinks`, (H,) float: Hunyuan V4's learned per-head logits, as gpt-oss's): one more logit per head in
every softmax, with no value: o_t = sum_s exp(score_ts) c_s / (exp(sink) + sum_s exp(score_ts)). Every PyTorch form
takes them; the decode kernels do not (a sink family decodes on the PyTorch path, `cache/kernel.py`).

A decode step (one query per sequence) over a cache's stored tensors runs `segment_attention`
(kernels/torch_decode.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class AttentionBlocks:
    """Block sizes of the absorbed attention: `query` tokens per query block and `key` keys per key block at that
    query block size (a block of fewer query tokens, e.g. a decode step, takes proportionally more keys, and a step
    over fewer keys takes proportionally more queries per block, so the workspace bound H x query x key holds for
    every step). None for both: one block (the unblocked reference)."""

    query: int | None = 64
    key: int | None = 2048
    expand_from: int | None = None  # queries per forward from which the expanded form runs (None: never)

    def __post_init__(self):
        if (self.query is None) != (self.key is None):
            raise ValueError(f"attention blocks: query={self.query!r} and key={self.key!r} must both be set (positive "
                             "integers) or both be null (unblocked)")
        for name in ("query", "key"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"attention.{name}_block={value!r}: must be a positive integer (or null with the "
                                 "other one null: unblocked)")
        e = self.expand_from
        if e is not None and (isinstance(e, bool) or not isinstance(e, int) or e <= 0):
            raise ValueError(f"attention.expand_from={e!r}: a positive number of queries per forward (or null: the "
                             "latent form always)")

    @property
    def blocked(self) -> bool:
        return self.query is not None

    def keys_per_block(self, query_tokens: int) -> int:
        """Keys per key block for a query block of `query_tokens` tokens (workspace <= query x key per head)."""
        return max(self.key, self.key * self.query // max(query_tokens, 1))

    def queries_per_block(self, keys: int) -> int:
        """Query tokens per block over `keys` keys: `query`, or more when there are fewer than `key` keys, within the
        same workspace (query x key per head), so a short sequence's prefill runs as one block."""
        return max(self.query, self.query * self.key // max(keys, 1))


UNBLOCKED = AttentionBlocks(None, None)
DEFAULT_BLOCKS = AttentionBlocks()


@dataclass(frozen=True)
class CausalMask:
    """A causal mask with padding, without a (B, 1, T, S) tensor: query i of T sits at slot S - T + i and sees the
    slots at or before it that hold real tokens. keys (B, S) bool, True = a real token."""

    keys: torch.Tensor
    _validity: dict = field(default_factory=dict, repr=False, compare=False)  # t -> validity(t), made once

    def validity(self, t: int) -> torch.Tensor:
        """(B, t) which of the last t slots hold real tokens: one tensor per mask and t, so every layer of a forward
        asks for the same one (its host copy is then read once)."""
        if t not in self._validity:
            self._validity[t] = self.keys[:, self.keys.shape[1] - t:]
        return self._validity[t]

    def block(self, q_slots: torch.Tensor, k0: int, k1: int) -> torch.Tensor:
        """(B, 1, len(q_slots), k1 - k0) bool, True = attend: the queries at absolute slots `q_slots` over keys k0:k1."""
        k_slots = torch.arange(k0, k1, device=self.keys.device)
        causal = k_slots[None, :] <= q_slots[:, None]  # (Tb, Kb)
        return (causal[None] & self.keys[:, None, k0:k1])[:, None]

    def dense(self, t: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The full (B, 1, T, S) mask for code that needs one (DeepSeek-V3.2's indexer): bool, or additive in
        `dtype` as transformers' eager mask (0 / dtype min)."""
        s = self.keys.shape[1]
        t = s if t is None else t
        ok = self.block(torch.arange(s - t, s, device=self.keys.device), 0, s)
        return ok if dtype is None else additive(ok, dtype)


def causal_mask(t: int, s: int, device, q_positions: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean (T, S) mask, True = may attend: query i sits at absolute position s - t + i, or at q_positions[i]."""
    q_pos = torch.arange(s - t, s, device=device) if q_positions is None else q_positions.to(device)
    k_pos = torch.arange(s, device=device)[None, :]
    return k_pos <= q_pos[:, None]


def apply_attention_mask(scores: torch.Tensor, mask) -> torch.Tensor:
    """Apply one of the masks transformers hands to attention modules to scores (B, H, T, S).

    None: causal (sdpa without padding). bool (B, 1, T, S): True = attend. float (B, 1, T, S): additive, exactly as
    transformers' eager attention adds it, so the absorbed path reproduces eager bit for bit where it can.
    A `CausalMask`: causal and its padding.
    """
    t, s = scores.shape[-2:]
    if mask is None:
        return scores.masked_fill(~causal_mask(t, s, scores.device), torch.finfo(scores.dtype).min)
    if isinstance(mask, CausalMask):
        mask = mask.dense(t)
    if mask.dtype == torch.bool:
        return scores.masked_fill(~mask[..., -s:], torch.finfo(scores.dtype).min)
    return scores + mask[..., -s:].to(scores.dtype)


def visible(mask: torch.Tensor) -> torch.Tensor:
    """A bool or additive attention mask (any shape) -> bool, True where a key is visible."""
    return mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool attention mask (True = attend) -> its additive form in `dtype`: 0 where visible, the dtype's min else."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


def key_validity(mask, t: int) -> torch.Tensor | None:
    """(B, T) bool: which of the last T slots hold real tokens (False = padding), read off the attention mask
    (a `CausalMask`, or the (B, 1, T, S) tensor transformers builds: a new token's own query sees its key, and no
    query sees padding, for left and right padding alike and under a sliding window, which hides a real key from
    the later queries only), or a (B, S) padding mask (1 = real; a model that hands its attention the 2-D mask:
    GLM-5.3). None: no mask, every slot is real."""
    if mask is None:
        return None
    if isinstance(mask, CausalMask):
        return mask.validity(t)
    if mask.dim() == 2:
        return mask[:, mask.shape[1] - t:].bool()
    return visible(mask[:, 0, -t:, mask.shape[-1] - t:]).any(dim=1)


def reference_attention(q_latent, q_rope, content, rope, scale, mask=None, values=None, sinks=None) -> torch.Tensor:
    """The unblocked absorbed attention, every (B, H, T, S) score at once: the spec `latent_attention` is checked
    against (same arguments, without blocks)."""
    b, h, t, d_c = q_latent.shape
    content = content.to(q_latent.dtype)
    values = content if values is None else values.to(q_latent.dtype)
    rope = rope.to(q_rope.dtype)
    scores = q_latent.reshape(b, h * t, d_c) @ content.transpose(1, 2)  # (B, H*T, S)
    scores = scores + q_rope.reshape(b, h * t, -1) @ rope.transpose(1, 2)
    scores = apply_attention_mask(scores.view(b, h, t, -1) * scale, mask)  # (B, H, T, S)
    probs = _softmax(scores, sinks).to(q_latent.dtype)
    return (probs.view(b, h * t, -1) @ values).view(b, h, t, d_c)


def _softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """float32 softmax over the last dim of (B, H, T, S) scores, with each head's sink logit in the denominator."""
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32)
    b, h, t, _ = scores.shape
    sink = sinks.to(device=scores.device, dtype=scores.dtype).view(1, h, 1, 1).expand(b, h, t, 1)
    return torch.softmax(torch.cat([scores, sink], -1), dim=-1, dtype=torch.float32)[..., :-1]


def latent_attention(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    content: torch.Tensor,
    rope: torch.Tensor,
    scale: float,
    mask=None,
    values: torch.Tensor | None = None,
    blocks: AttentionBlocks | None = None,
    w_uk: torch.Tensor | None = None,
    w_uv: torch.Tensor | None = None,
    q_positions: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q_latent (B, H, T, d_c), q_rope (B, H, T, d_r), content (B, S, d_c), rope (B, S, d_r) -> o_latent (B, H, T, d_c).

    `values` (B, S, d_c) replaces the content on the aggregation side only (default: the content itself); the
    sensitivity study uses it to split the score-side and value-side effects of a content error. `blocks`: the
    block sizes (default `DEFAULT_BLOCKS`; `UNBLOCKED` = all scores at once).
    With `w_uk` (H, d_nope, d_c) the first argument is q_nope (B, H, T, d_nope) and q_latent = q_nope @ w_uk is formed
    one query block at a time; with `w_uv` (H, d_v, d_c) the result is each head's value o_latent @ w_uv^T
    (B, H, T, d_v), also per block: then no (B, H, T, d_c) tensor exists for the whole step.
    `content` may also be a key source (the cache's `StoredKeys`: content(k0, k1) -> the content and rope blocks of
    slots k0:k1, `.length` slots, `.dims` (d_c, d_r)) with rope=None: a step of one query block decodes one key block
    of `blocks.key` keys at a time; a longer step decodes every key once.
    `q_positions` (T,) ascending: the slots of the T queries (default: the last T of the S slots), for queries
    sampled from a sequence (calibration); the mask is then causal at those slots (None or a `CausalMask` only).
    `sinks` (H,): attention sinks (module docstring); the expanded form is not taken with them.
    """
    blocks = DEFAULT_BLOCKS if blocks is None else blocks
    b, h, t = q_latent.shape[:3]
    s = content.length if callable(content) else content.shape[1]
    q_block = t if not blocks.blocked else min(t, blocks.queries_per_block(s))
    expanded = (blocks.expand_from is not None and t >= blocks.expand_from and w_uk is not None and w_uv is not None
                and sinks is None)
    if callable(content):  # a key source (the cache's StoredKeys): keys(k0, k1) -> content, rope blocks
        if values is not None:
            raise ValueError("latent_attention: `values` replace tensor keys' values; a key source gives its own")
        # Many query blocks would decode every key block again, and the expanded form up-projects every key: once.
        if t > q_block or not blocks.blocked or expanded:
            content, rope = content(0, content.length)
    if expanded:
        return expanded_attention(q_latent, q_rope, content, rope, scale, mask, values, blocks, w_uk, w_uv,
                                  q_positions)
    dtype = q_latent.dtype if w_uk is None else torch.promote_types(q_latent.dtype, w_uk.dtype)
    if callable(content):  # one query block: each key block decoded when it is read, blocks.key keys at a time
        source, d_c = content, content.dims[0]
        k_block = blocks.key

        def keys(k0, k1):
            c, r = source(k0, k1)
            c = c.to(dtype)
            return c, r.to(q_rope.dtype), c
    else:
        d_c = content.shape[-1]
        content = content.to(dtype)
        values = content if values is None else values.to(dtype)
        rope = rope.to(q_rope.dtype)
        k_block = s if not blocks.blocked else blocks.keys_per_block(q_block)

        def keys(k0, k1):
            return content[:, k0:k1], rope[:, k0:k1], values[:, k0:k1]
    # Stored as (B, T, H, d): the caller's merge of the heads, out.transpose(1, 2).reshape(B, T, H * d), is then a view.
    out = q_latent.new_empty(b, t, h, d_c if w_uv is None else w_uv.shape[1], dtype=dtype).transpose(1, 2)
    for t0, t1, limit, block_mask in query_blocks(t, s, q_block, mask, q_positions, q_latent.device):
        ql = q_latent[:, :, t0:t1] if w_uk is None else q_latent[:, :, t0:t1] @ w_uk  # (B, H, Tb, d_c)
        qr = q_rope[:, :, t0:t1]
        if limit <= k_block:
            o = _one_block(ql, qr, *keys(0, limit), scale, block_mask(0, limit), sinks)
        else:
            o = _online_blocks(ql, qr, keys, scale, limit, k_block, block_mask, sinks)
        out[:, :, t0:t1] = o if w_uv is None else o @ w_uv.transpose(-1, -2)  # (B, H, Tb, d_v)
    return out


def query_blocks(t: int, s: int, q_block: int, mask, q_positions, device):
    """The query blocks of a step of t queries over s slots, for both forms: (t0, t1, limit, block_mask) per block,
    `limit` the keys it can see (under a causal mask, none after its last query's slot) and block_mask(k0, k1) its
    mask over keys k0:k1 (bool, True = attend; or the slice of a dense additive mask)."""
    causal = mask is None or isinstance(mask, CausalMask)
    if q_positions is not None and not causal:
        raise ValueError("latent_attention: q_positions take a causal mask (None or a CausalMask), not a dense one")
    slots = (torch.arange(s - t, s, device=device) if q_positions is None
             else q_positions.to(device=device, dtype=torch.long))
    dense = None if causal else mask[..., -s:]
    if isinstance(mask, CausalMask):
        mask = CausalMask(mask.keys[:, -s:])
    for t0 in range(0, t, q_block):
        t1 = min(t, t0 + q_block)
        q_slots = slots[t0:t1]
        last = s - t + t1 - 1 if q_positions is None else int(q_slots[-1])  # (no device sync in the common case)
        limit = min(s, last + 1) if causal else s

        def block_mask(k0, k1, q_slots=q_slots, t0=t0, t1=t1):
            if mask is None:
                return (torch.arange(k0, k1, device=device)[None, :] <= q_slots[:, None])[None, None]
            if isinstance(mask, CausalMask):
                return mask.block(q_slots, k0, k1)
            return dense[..., t0:t1, k0:k1]

        yield t0, t1, limit, block_mask


def fused_causal_attention(q_latent: torch.Tensor, q_rope: torch.Tensor, content: torch.Tensor, rope: torch.Tensor,
                           scale: float, q_positions: torch.Tensor | None = None) -> torch.Tensor:
    """`latent_attention` under a causal mask without padding (the T queries at the last T of the S slots, or at
    `q_positions`), through PyTorch's fused scaled_dot_product_attention: the latent is one key and value head shared
    by every query head (expanded, not copied), the query and key [latent ; RoPE], the values the content zero-padded
    to the keys' width (so the kernel is the flash one, whose workspace is a tile, not the (T, S) scores; the padding
    changes no product). On the CPU its flash kernel takes any head width and runs ~1.5x (V2-Lite dims) to ~5x (tiny
    dims) faster than the blocked form; CUDA's flash kernels stop at head dims of 256, where the latent's 576 would
    fall back to the math path that holds every score, so this is the CPU's form (calibration's objectives)."""
    import torch.nn.functional as F

    b, h, t, d_c = q_latent.shape
    s, d_r = content.shape[1], rope.shape[-1]
    q = torch.cat([q_latent, q_rope.to(q_latent.dtype)], -1)
    k = torch.cat([content.to(q.dtype), rope.to(q.dtype)], -1)[:, None].expand(b, h, s, d_c + d_r)
    v = F.pad(content.to(q.dtype), (0, d_r))[:, None].expand(b, h, s, d_c + d_r)
    if q_positions is None and t == s:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(t, s, q.device, q_positions), scale=scale)
    return out[..., :d_c]


def causal_latent_attention(q_latent: torch.Tensor, q_rope: torch.Tensor, content: torch.Tensor, rope: torch.Tensor,
                            scale: float, q_positions: torch.Tensor | None = None,
                            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """o_latent (B, H, T, d_c) of causal queries without padding (the last T of the S slots, or at `q_positions`):
    `fused_causal_attention` on the CPU, the blocked `latent_attention` elsewhere or with attention sinks (the same
    numbers to float32 rounding; CUDA's flash kernels do not take the latent's head width)."""
    if content.device.type == "cpu" and sinks is None:
        return fused_causal_attention(q_latent, q_rope, content, rope, scale, q_positions)
    return latent_attention(q_latent, q_rope, content, rope, scale, q_positions=q_positions, sinks=sinks)


EXPANDED_HEAD_GROUP = 16  # heads whose keys and values the expanded form holds at once (V2-Lite has 16 in all)


def expanded_attention(q_nope, q_rope, content, rope, scale, mask, values, blocks: AttentionBlocks, w_uk, w_uv,
                       q_positions=None) -> torch.Tensor:
    """`latent_attention` with w_uk and w_uv in the expanded form, (B, H, T, d_v): per group of EXPANDED_HEAD_GROUP
    heads, keys [content @ w_uk^T ; rope] and values values @ w_uv^T formed once, then scaled_dot_product_attention.
    Pure causal prefill (T = S, no padding, no sampled positions) is one call per head group with is_causal;
    otherwise one call per query block of `blocks.query` tokens over the keys up to its last query, with that block's
    mask in additive form (so a row without any visible key averages its keys as the reference does, never NaN).
    Memory: one head group's keys and values (16 x S x (d_nope + d_r + d_v) numbers, the values padded to the keys'
    head dim) and one block's mask."""
    import torch.nn.functional as F

    b, h, t = q_nope.shape[:3]
    s = content.shape[1]
    dtype = torch.promote_types(q_nope.dtype, w_uk.dtype)
    content = content.to(dtype)
    values = content if values is None else values.to(dtype)
    whole = mask is None and q_positions is None and t == s  # one is_causal call
    q_block = t if not blocks.blocked else min(t, blocks.query)
    # Stored as (B, T, H, d_v): the caller's merge of the heads is then a view.
    out = content.new_empty(b, t, h, w_uv.shape[1]).transpose(1, 2)
    for h0 in range(0, h, EXPANDED_HEAD_GROUP):
        h1 = min(h, h0 + EXPANDED_HEAD_GROUP)
        k = torch.cat([content[:, None] @ w_uk[h0:h1].to(dtype).transpose(1, 2)[None],  # (B, Hg, S, d_nope)
                       rope.to(dtype)[:, None].expand(b, h1 - h0, s, rope.shape[-1])], dim=-1)
        v = values[:, None] @ w_uv[h0:h1].to(dtype).transpose(1, 2)[None]  # (B, Hg, S, d_v)
        q = torch.cat([q_nope[:, h0:h1].to(dtype), q_rope[:, h0:h1].to(dtype)], dim=-1)  # (B, Hg, T, d_nope + d_r)
        # Flash attention (CUDA, and PyTorch's CPU kernel) wants one head dim for q, k and v: zeros pad the smaller
        # side (the values' 128 up to the keys' 192 at DeepSeek's dims, as vLLM does), which changes no product.
        # Without it SDPA falls back to its math path, which holds every (T, S) score.
        d_v, d_qk = v.shape[-1], q.shape[-1]
        if d_v < d_qk:
            v = F.pad(v, (0, d_qk - d_v))
        elif d_v > d_qk:
            q, k = F.pad(q, (0, d_v - d_qk)), F.pad(k, (0, d_v - d_qk))
        if whole:
            out[:, h0:h1] = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)[..., :d_v]
            continue
        for t0, t1, limit, block_mask in query_blocks(t, s, q_block, mask, q_positions, q.device):
            bias = additive(visible(block_mask(0, limit)), dtype)
            out[:, h0:h1, t0:t1] = F.scaled_dot_product_attention(q[:, :, t0:t1], k[:, :, :limit], v[:, :, :limit],
                                                                  attn_mask=bias, scale=scale)[..., :d_v]
    return out


def _masked_scores(ql, qr, content, rope, scale, mask) -> torch.Tensor:
    """Scaled, masked scores (B, H, Tb, Kb) in the activation dtype. mask: bool (True = attend) or additive."""
    b, h, tb, d_c = ql.shape
    # Heads and queries share one latent "head": fold them into one row dimension so each product is a single
    # (B, H*Tb, d) @ (B, d, Kb) batch matmul over the cache, with no per-head copy of it.
    scores = ql.reshape(b, h * tb, d_c) @ content.transpose(1, 2)  # (B, H*Tb, Kb)
    scores = scores + qr.reshape(b, h * tb, -1) @ rope.transpose(1, 2)
    scores = scores.view(b, h, tb, -1) * scale
    if mask.dtype == torch.bool:
        if scores.dtype == torch.float16:  # min + a score can overflow to -inf in fp16's range: fill instead
            return scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        # The same numbers as masked_fill (min + s rounds to min for any |s| < 1e31, 0 + s = s), but a broadcast add of
        # a bias the mask's size (no batch or head dims) is ~10x faster on the CPU than filling the scores.
        mask = additive(mask, scores.dtype)
    return scores + mask.to(scores.dtype)


def _one_block(ql, qr, content, rope, values, scale, mask, sinks=None) -> torch.Tensor:
    """Every key of the query block at once: exactly the reference's arithmetic."""
    b, h, tb, d_c = ql.shape
    scores = _masked_scores(ql, qr, content, rope, scale, mask)
    # Softmax in float32 as transformers' eager attention does, then back to the activation dtype.
    probs = _softmax(scores, sinks).to(ql.dtype)
    return (probs.view(b, h * tb, -1) @ values).view(b, h, tb, d_c)


def _online_blocks(ql, qr, keys, scale, limit: int, k_block: int, block_mask, sinks=None) -> torch.Tensor:
    """Keys 0:limit in blocks of k_block (keys(k0, k1) -> content, rope, values), merged by an online softmax
    (running max, sum and output in float32; a sink starts each head's running max and sum as a key without value)."""
    b, h, tb, d_c = ql.shape
    if sinks is None:
        m = ql.new_full((b, h, tb, 1), float("-inf"), dtype=torch.float32)
        total = torch.zeros(b, h, tb, 1, dtype=torch.float32, device=ql.device)
    else:
        m = sinks.to(device=ql.device, dtype=torch.float32).view(1, h, 1, 1).expand(b, h, tb, 1)
        total = torch.ones(b, h, tb, 1, dtype=torch.float32, device=ql.device)
    acc = torch.zeros(b, h * tb, d_c, dtype=torch.float32, device=ql.device)
    for k0 in range(0, limit, k_block):
        k1 = min(limit, k0 + k_block)
        content, rope, values = keys(k0, k1)
        scores = _masked_scores(ql, qr, content, rope, scale, block_mask(k0, k1)).float()
        m_new = torch.maximum(m, scores.amax(-1, keepdim=True))
        m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)  # a row masked so far stays empty, not NaN
        alpha = torch.exp(m - m_safe)  # (B, H, Tb, 1)
        p = torch.exp(scores - m_safe)  # (B, H, Tb, Kb)
        total = total * alpha + p.sum(-1, keepdim=True)
        part = p.to(ql.dtype).view(b, h * tb, -1) @ values  # (B, H*Tb, d_c)
        acc = acc * alpha.view(b, h * tb, 1) + part.float()
        m = m_new
    return (acc / total.view(b, h * tb, 1)).view(b, h, tb, d_c).to(ql.dtype)
