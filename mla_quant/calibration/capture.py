"""Capture, for one MLA block, everything its calibration objectives need, on the unquantized model.

    cap = capture_layer(model, ids, layer=2)      # one forward, stopped right after block 2's attention input

LayerCapture (float32, on the model's device; N sequences, T tokens, H heads):
    x_hat    (N, T, d_c)   x / rms(x): the latent before its norm weight (the content transform acts on this)
    gamma    (d_c,)        the latent norm's weight; the cached latent is c = sigma * gamma * x_hat
    q_latent (N, H, T, d_c) the absorbed query W_UK^T q_nope (score side of the content path)
    q_rope   (N, H, T, d_r) the query's RoPE part after RoPE;  k_rope (N, T, d_r) the cached RoPE key after RoPE
    w_uv     (H, d_v, d_c)  each head's value map (the attention output per head is W_UV o_latent)
Only block `layer` is captured and the forward stops there, so memory holds one block's tensors at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mla_quant.models.absorbed import attention_modules
from mla_quant.models.families import family_for_config


@dataclass
class LayerCapture:
    layer: int
    x_hat: torch.Tensor
    gamma: torch.Tensor
    latent_scale: float
    q_latent: torch.Tensor
    q_rope: torch.Tensor
    k_rope: torch.Tensor
    w_uv: torch.Tensor
    scale: float
    cached_layout: str  # pair layout of the cached (post-RoPE) key
    ref_out: torch.Tensor | None = None  # (N, H, T, d_v) unquantized attention output per head (see `reference`)
    ids: torch.Tensor | None = None  # (N, T) the token ids captured (end-to-end objectives rerun the model on them)
    model: Any = field(default=None, repr=False, compare=False)  # the model they came from

    @property
    def content(self) -> torch.Tensor:
        return self.latent_scale * self.gamma * self.x_hat

    def rows(self, idx) -> "LayerCapture":
        """The same capture restricted to sequences `idx`."""
        return LayerCapture(self.layer, self.x_hat[idx], self.gamma, self.latent_scale, self.q_latent[idx],
                            self.q_rope[idx], self.k_rope[idx], self.w_uv, self.scale, self.cached_layout,
                            None if self.ref_out is None else self.ref_out[idx],
                            None if self.ids is None else self.ids[idx], self.model)


class _Stop(Exception):
    pass


def check_finite(name: str, x: torch.Tensor, layer: int) -> None:
    if not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(f"calibration capture, layer {layer}: {name} holds {bad} NaN/inf value(s) of {x.numel()}; "
                         f"check the model's dtype (float16 overflow?) and the calibration data")


@torch.no_grad()
def capture_layer(model, ids: torch.Tensor, layer: int, batch_size: int = 8) -> LayerCapture:
    family = family_for_config(model.config)
    modules = attention_modules(model)
    if not 0 <= layer < len(modules):
        raise ValueError(f"layer {layer} out of range: the model has {len(modules)} MLA blocks")
    attn = modules[layer]
    w = family.mla_weights(attn)
    device = next(model.parameters()).device
    parts: dict[str, list[torch.Tensor]] = {"x_hat": [], "q_latent": [], "q_rope": [], "k_rope": []}

    def hook(module, args, kwargs):
        h = kwargs.get("hidden_states", args[0] if args else None)
        pe = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)
        x_hat, q_latent, q_rope, k_rope = block_pieces(family, module, w, h, pe)
        for name, value in (("x_hat", x_hat), ("q_latent", q_latent), ("q_rope", q_rope), ("k_rope", k_rope)):
            check_finite(name, value, layer)
            parts[name].append(value.float())
        raise _Stop

    handle = attn.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for start in range(0, ids.shape[0], batch_size):
            try:
                model(input_ids=ids[start : start + batch_size].to(device), use_cache=False)
            except _Stop:
                pass
    finally:
        handle.remove()
    gamma = w.kv_norm.detach().float()
    check_finite("the latent norm weight", gamma, layer)
    return LayerCapture(layer=layer, x_hat=torch.cat(parts["x_hat"]), gamma=gamma, latent_scale=w.latent_scale,
                        q_latent=torch.cat(parts["q_latent"]), q_rope=torch.cat(parts["q_rope"]),
                        k_rope=torch.cat(parts["k_rope"]), w_uv=w.w_uv().detach().float(), scale=float(attn.scaling),
                        cached_layout=family.cached_rope_layout(model.config), ids=ids.cpu(), model=model)


def block_pieces(family, module, w, h: torch.Tensor, pe):
    """One MLA block's x_hat (x / rms(x)), absorbed query, RoPE query and RoPE key (after RoPE), float32."""
    q_nope, q_rope, _ = family.query(module, h)
    compressed = module.kv_a_proj_with_mqa(h)
    x, k_rope = torch.split(compressed, [w.d_c, w.d_r], dim=-1)
    xf = x.float()
    x_hat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + w.norm_eps)
    q_rope, k_rope = family.rotate(module, q_rope, k_rope, pe)
    return x_hat, q_nope.float() @ w.w_uk().float(), q_rope.float(), k_rope.float()
