"""Absorbed MLA attention over the latent cache, in plain PyTorch (the reference every kernel is checked against).

score(t, s) = scale * (q_latent_t . c_s + q_rope_t . k_s),   o_latent_t = sum_s softmax_s(score) c_s

with q_latent = W_UK^T q_nope per head (docs/method.md section 1). All heads share the single latent "head", so this is
multi-query attention with key [c ; k] (d_c + d_r) and value c (d_c); per-head K and V are never formed.
"""

from __future__ import annotations

import torch


def causal_mask(t: int, s: int, device) -> torch.Tensor:
    """Boolean (T, S) mask, True = may attend: query i sits at absolute position s - t + i."""
    q_pos = torch.arange(s - t, s, device=device)[:, None]
    k_pos = torch.arange(s, device=device)[None, :]
    return k_pos <= q_pos


def apply_attention_mask(scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Apply one of the masks transformers hands to attention modules to scores (B, H, T, S).

    None: causal (sdpa without padding). bool (B, 1, T, S): True = attend. float (B, 1, T, S): additive, exactly as
    transformers' eager attention adds it, so the absorbed path reproduces eager bit for bit where it can.
    """
    t, s = scores.shape[-2:]
    if mask is None:
        return scores.masked_fill(~causal_mask(t, s, scores.device), torch.finfo(scores.dtype).min)
    if mask.dtype == torch.bool:
        return scores.masked_fill(~mask[..., -s:], torch.finfo(scores.dtype).min)
    return scores + mask[..., -s:].to(scores.dtype)


def visible(mask: torch.Tensor) -> torch.Tensor:
    """A bool or additive attention mask (any shape) -> bool, True where a key is visible."""
    return mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2


def latent_attention(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    content: torch.Tensor,
    rope: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
) -> torch.Tensor:
    """q_latent (B, H, T, d_c), q_rope (B, H, T, d_r), content (B, S, d_c), rope (B, S, d_r) -> o_latent (B, H, T, d_c).

    `values` (B, S, d_c) replaces the content on the aggregation side only (default: the content itself); the
    sensitivity study uses it to split the score-side and value-side effects of a content error.
    """
    b, h, t, d_c = q_latent.shape
    content = content.to(q_latent.dtype)
    values = content if values is None else values.to(q_latent.dtype)
    rope = rope.to(q_rope.dtype)
    # Heads and queries share one latent "head": fold them into one row dimension so each product is a single
    # (B, H*T, d) @ (B, d, S) batch matmul over the cache, with no per-head copy of it.
    scores = q_latent.reshape(b, h * t, d_c) @ content.transpose(1, 2)  # (B, H*T, S)
    scores = scores + q_rope.reshape(b, h * t, -1) @ rope.transpose(1, 2)
    scores = apply_attention_mask(scores.view(b, h, t, -1) * scale, mask)  # (B, H, T, S)
    # Softmax in float32 as transformers' eager attention does, then back to the activation dtype.
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q_latent.dtype)
    return (probs.view(b, h * t, -1) @ values).view(b, h, t, d_c)  # (B, H, T, d_c)
