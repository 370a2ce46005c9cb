"""Fold per-path transforms into one MLA block's weights (docs/method.md section 4), exact up to float rounding.

Content, rotation R and channel scale s (gamma = the latent norm's weight, sigma = a family's fixed latent scale):
    kv_a latent rows  <- R W_x                  (RMSNorm's rms is rotation invariant)
    latent norm gamma <- 1 / s                  so the cached latent is c' = sigma diag(1/s) R x / rms(x)
    kv_b (W_UK, W_UV) <- W diag(gamma) R^T diag(s)     so that W' c' = W c for both halves
RoPE key, per frequency pair i a block T_i = t_i Rot(phi_i) (it commutes with the RoPE rotation of that pair):
    kv_a RoPE rows    <- T W_r                  so the cached key is k' = T k = RoPE(T r, pos)
    each head's query RoPE rows <- T^{-T} W_q   with T^{-T} = blockdiag(Rot(phi_i) / t_i), so q' . k' = q . k
Pairs are taken in the family's pre-RoPE layout (`MLAWeights.rope_layout`). All arithmetic in float64, then cast
back to each weight's dtype.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import nn

from mla_quant.models import fp8
from mla_quant.models.families import MLAWeights, family_for_config
from mla_quant.quant.rope import rope_pair


@dataclass
class LayerTransform:
    """One MLA block's transforms; None = identity for that factor."""

    rotation: torch.Tensor | None = None  # (d_c, d_c) orthogonal
    scale: torch.Tensor | None = None  # (d_c,) > 0
    angle: torch.Tensor | None = None  # (d_r/2,) radians, per RoPE frequency pair
    pair_scale: torch.Tensor | None = None  # (d_r/2,) > 0, per RoPE frequency pair

    FIELDS = ("rotation", "scale", "angle", "pair_scale")

    @property
    def identity(self) -> bool:
        return all(getattr(self, f) is None for f in self.FIELDS)

    def content_maps(self, d_c: int, dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
        """(R, s) with identity defaults."""
        r = torch.eye(d_c, dtype=dtype) if self.rotation is None else self.rotation.to(dtype)
        s = torch.ones(d_c, dtype=dtype) if self.scale is None else self.scale.to(dtype)
        return r, s

    def rope_params(self, d_r: int, dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
        """(phi, t) with identity defaults."""
        phi = torch.zeros(d_r // 2, dtype=dtype) if self.angle is None else self.angle.to(dtype)
        t = torch.ones(d_r // 2, dtype=dtype) if self.pair_scale is None else self.pair_scale.to(dtype)
        return phi, t


@dataclass
class TransformSet:
    """Transforms of every MLA block of a model, in cache-layer order, plus how they were made (`meta`)."""

    layers: list[LayerTransform]
    meta: dict[str, str] = field(default_factory=dict)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Flat {"layers.<i>.<field>": tensor} (float32, contiguous) for safetensors."""
        out = {}
        for i, lt in enumerate(self.layers):
            for f in LayerTransform.FIELDS:
                value = getattr(lt, f)
                if value is not None:
                    out[f"layers.{i}.{f}"] = value.detach().to(torch.float64).contiguous()
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], num_layers: int, meta: dict | None = None):
        layers = [LayerTransform() for _ in range(num_layers)]
        for key, value in tensors.items():
            _, idx, name = key.split(".", 2)
            if name not in LayerTransform.FIELDS or not 0 <= int(idx) < num_layers:
                raise ValueError(f"unexpected transform tensor {key!r} for {num_layers} layers")
            setattr(layers[int(idx)], name, value)
        return cls(layers, dict(meta or {}))


@functools.cache
def pair_index(layout: str, d_r: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Coordinates (a_i), (b_i) of every RoPE frequency pair i in `layout`, on `device` (one pair of tensors per
    layout, width and device: read them, never write them)."""
    idx = torch.tensor([rope_pair(layout, d_r, i) for i in range(d_r // 2)], dtype=torch.long, device="cpu")
    idx = idx.view(-1, 2).to(device)
    return idx[:, 0], idx[:, 1]


def pair_matrix(angle: torch.Tensor, scale: torch.Tensor, layout: str, d_r: int) -> torch.Tensor:
    """(d_r, d_r) block-diagonal matrix with block scale_i * Rot(angle_i) on RoPE pair i (in `layout`)."""
    n = d_r // 2
    if angle.shape != (n,) or scale.shape != (n,):
        raise ValueError(f"RoPE transform: angle {tuple(angle.shape)} and scale {tuple(scale.shape)} must both be "
                         f"({n},) for d_r={d_r}")
    m = torch.zeros(d_r, d_r, dtype=angle.dtype, device=angle.device)
    c, s = scale * torch.cos(angle), scale * torch.sin(angle)
    a, b = pair_index(layout, d_r, angle.device)
    m[a, a], m[a, b], m[b, a], m[b, b] = c, -s, s, c
    return m


def _update(param: torch.Tensor, value: torch.Tensor) -> None:
    param.data.copy_(value.to(dtype=param.dtype, device=param.device))


def check_layer_transform(w: MLAWeights, lt: LayerTransform, where: str) -> None:
    """Shapes and values a transform needs to fit this block; ValueError naming the layer and the value."""
    d_c, n = w.d_c, w.d_r // 2
    if lt.rotation is not None and tuple(lt.rotation.shape) != (d_c, d_c):
        raise ValueError(f"{where}: content rotation is {tuple(lt.rotation.shape)} but d_c={d_c}; it must be "
                         f"({d_c}, {d_c})")
    if lt.scale is not None and (tuple(lt.scale.shape) != (d_c,) or not bool((lt.scale > 0).all())):
        raise ValueError(f"{where}: content scale must be ({d_c},) and positive, got shape {tuple(lt.scale.shape)}, "
                         f"min {float(lt.scale.min()):.3g}")
    if (lt.angle is not None or lt.pair_scale is not None) and w.d_r % 2:
        raise ValueError(f"{where}: a RoPE pair transform needs an even RoPE dimension, got d_r={w.d_r}")
    for name in ("angle", "pair_scale"):
        value = getattr(lt, name)
        if value is not None and tuple(value.shape) != (n,):
            raise ValueError(f"{where}: RoPE {name} is {tuple(value.shape)} but d_r={w.d_r} has {n} pairs")
    if w.rope_norm is not None and lt.angle is not None and bool((lt.angle != 0).any()):
        raise ValueError(f"{where}: {ROPE_NORM_REFUSAL}")
    if lt.pair_scale is not None and not bool((lt.pair_scale > 0).all()):
        raise ValueError(f"{where}: RoPE pair scales must be positive, min {float(lt.pair_scale.min()):.3g}")
    for name in LayerTransform.FIELDS:
        value = getattr(lt, name)
        if value is not None and not bool(torch.isfinite(value).all()):
            raise ValueError(f"{where}: transform {name} holds NaN or inf")


@torch.no_grad()
def fold_content(w: MLAWeights, rotation: torch.Tensor, scale: torch.Tensor) -> None:
    """Fold R and s into the latent rows of kv_a, the latent norm and kv_b (in place)."""
    d_c = w.d_c
    r, s = rotation.double().cpu(), scale.double().cpu()
    gamma = w.kv_norm.detach().double().cpu()
    _update(w.kv_a.weight[:d_c], r @ w.latent_rows().detach().double().cpu())
    if w.kv_a.bias is not None:
        _update(w.kv_a.bias[:d_c], r @ w.kv_a.bias[:d_c].detach().double().cpu())
    _update(w.kv_norm, 1.0 / s)
    m = gamma[:, None] * r.T * s[None, :]  # diag(gamma) R^T diag(s)
    _update(w.kv_b.weight, w.kv_b.weight.detach().double().cpu() @ m)


ROPE_NORM_REFUSAL = ("the RoPE key is RMS-normed before RoPE (dots.3 Note's k_rope_only_layernorm), and a rotation "
                     "within its pairs does not fold through the norm's per-dim weight; allowed: a RoPE kind that "
                     "scales pairs without rotating them (transform.rope.kind=pair_scale or none)")


@torch.no_grad()
def fold_rope(w: MLAWeights, angle: torch.Tensor, scale: torch.Tensor) -> None:
    """Fold the pairwise T into the RoPE rows of kv_a and T^{-T} into every head's query RoPE rows (in place). A RoPE
    key RMS-normed before RoPE (`w.rope_norm`) takes a scale per pair only, into the norm's weight (the RMS of the
    rows it normalizes unchanged)."""
    d_r, d_c = w.d_r, w.d_c
    angle, scale = angle.double().cpu(), scale.double().cpu()
    t = pair_matrix(angle, scale, w.rope_layout, d_r)
    t_inv_t = pair_matrix(angle, 1.0 / scale, w.rope_layout, d_r)
    if w.rope_norm is not None:
        if bool((angle != 0).any()):
            raise ValueError(ROPE_NORM_REFUSAL)
        _update(w.rope_norm, t.diagonal() * w.rope_norm.detach().double().cpu())
    else:
        _update(w.kv_a.weight[d_c:], t @ w.rope_rows().detach().double().cpu())
        if w.kv_a.bias is not None:
            _update(w.kv_a.bias[d_c:], t @ w.kv_a.bias[d_c:].detach().double().cpu())
    rope = slice(w.d_nope, w.d_nope + d_r)  # of each head's q_out rows (AXK2's gate rows follow them)
    q = w.q_out.weight.view(w.num_heads, w.q_rows, -1)
    _update(q[:, rope], t_inv_t @ w.q_rope_rows().detach().double().cpu())
    if w.q_out.bias is not None:
        qb = w.q_out.bias.view(w.num_heads, w.q_rows)
        _update(qb[:, rope], qb[:, rope].detach().double().cpu() @ t_inv_t.T)


def fold_layer(w: MLAWeights, lt: LayerTransform, where: str = "layer") -> None:
    check_layer_transform(w, lt, where)
    if lt.rotation is not None or lt.scale is not None:
        fold_content(w, *lt.content_maps(w.d_c))
    if lt.angle is not None or lt.pair_scale is not None:
        fold_rope(w, *lt.rope_params(w.d_r))


def rewritten_linears(attn: nn.Module, lt: LayerTransform) -> list[str]:
    """The projections of one MLA module a fold of `lt` rewrites (content: kv_a, kv_b; RoPE: kv_a, the query's)."""
    names = []
    if lt.rotation is not None or lt.scale is not None:
        names += ["kv_a_proj_with_mqa", "kv_b_proj"]
    if lt.angle is not None or lt.pair_scale is not None:
        q_out = family_for_config(attn.config).q_out(attn)
        names += ["kv_a_proj_with_mqa", next(n for n, m in attn.named_children() if m is q_out)]
    return list(dict.fromkeys(names))


def apply_transforms(model: nn.Module, tset: TransformSet) -> nn.Module:
    """Fold `tset` into every MLA block of `model` (in place; every layer is checked before any weight changes).
    Block-FP8 projections a fold rewrites become full-precision linears in the model's compute dtype first; their
    names are kept in `model.mla_dequantized` (export lists them as not quantized)."""
    family = family_for_config(model.config)
    modules = family.attention_modules(model)
    if len(tset.layers) != len(modules):
        raise ValueError(f"the transform set has {len(tset.layers)} layers but the model has {len(modules)} MLA "
                         f"blocks")
    for i, (attn, lt) in enumerate(zip(modules, tset.layers)):
        check_layer_transform(family.mla_weights(attn), lt, f"layer {i}")
    names = {id(m): n for n, m in model.named_modules()}
    dequantized = list(getattr(model, "mla_dequantized", []))
    dtype = fp8.compute_dtype(model)
    for attn, lt in zip(modules, tset.layers):
        dequantized += [f"{names[id(attn)]}.{n}" for n in fp8.dense(attn, rewritten_linears(attn, lt), dtype)]
    model.mla_dequantized = dequantized
    for i, (attn, lt) in enumerate(zip(modules, tset.layers)):
        fold_layer(family.mla_weights(attn), lt, f"layer {i}")
    return model
