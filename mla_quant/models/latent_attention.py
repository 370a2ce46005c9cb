"""Absorbed MLA attention over the latent cache, in plain PyTorch (the reference every kernel is checked against).

score(t, s) = scale * (q_latent_t . c_s + q_rope_t . k_s),   o_latent_t = sum_s softmax_s(score) c_s

with q_latent = W_UK^T q_nope per head (DESIGN.md section 1). All heads share the single latent "head", so this is
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


def latent_attention(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    content: torch.Tensor,
    rope: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """q_latent (B, H, T, d_c), q_rope (B, H, T, d_r), content (B, S, d_c), rope (B, S, d_r) -> o_latent (B, H, T, d_c)."""
    content = content.to(q_latent.dtype).unsqueeze(1)  # (B, 1, S, d_c), broadcast over heads
    rope = rope.to(q_rope.dtype).unsqueeze(1)  # (B, 1, S, d_r)
    scores = (q_latent @ content.transpose(-1, -2) + q_rope @ rope.transpose(-1, -2)) * scale  # (B, H, T, S)
    scores = apply_attention_mask(scores, mask)
    # Softmax in float32 as transformers' eager attention does, then back to the activation dtype.
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q_latent.dtype)
    return probs @ content  # (B, H, T, d_c)
