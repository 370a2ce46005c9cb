"""Calibration objectives per path (docs/method.md section 4), all relative errors on captured activations.

Content, transform (R, s): the cache holds c' = sigma diag(1/s) R x_hat and is read back into the original basis as
c_hat = gamma * R^T (s * Q(c')); RoPE key, pair parameters (phi, t): k' = T k, k_hat = T^{-1} Q(k'). Q is the cache
format's quantizer (straight-through in the backward pass, `ste_quantizer`).

    attention_output  sum ||W_UV (o(c_hat) - o(c))||^2 / sum ||W_UV o(c)||^2   per head, every causal query
    positional_qk     sum_{t>=s, h} (q^R_{h,t} . (k_hat_s - k_s))^2 / sum (q^R . k)^2
    cache_mse         ||c_hat - c||^2 / ||c||^2  (content)  or  ||k_hat - k||^2 / ||k||^2  (RoPE)  (ablation)
    next_token_kl     KL(p_model || p_quantized) of the next-token distribution, mean per token, with only this
                      layer's path read back quantized (ablation; reruns the whole model on the sequences)

The positional-score error bounds the attention-output error: for one query, the scores move by d = tau q^R . dk,
and ||o(s + d) - o(s)|| <= max_s |d_s| * diam{v_s} (the softmax average moves by at most the spread of the values
times the largest score change). `rope_output_bound` reports the measured output error beside that bound.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mla_quant.calibration.capture import LayerCapture, head_outputs
from mla_quant.kernels.attention import causal_latent_attention, causal_mask
from mla_quant.models.fp8 import compute_dtype, linear
from mla_quant.quant.formats import PathFormat, fake_quantizer
from mla_quant.quant.quantizers import fake_quantize, fit_levels, group_dequantize, group_quantize, load_scale
from mla_quant.transforms.fold import pair_index

CONTENT_OBJECTIVES = ("attention_output", "cache_mse", "next_token_kl")  # the first is each path's default
ROPE_OBJECTIVES = ("positional_qk", "cache_mse", "next_token_kl")


def _ste_round(x: torch.Tensor) -> torch.Tensor:
    return x + (torch.round(x) - x).detach()


def ste_quantizer(fmt: PathFormat, d: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> the cache's fake-quantized x in the forward pass (exactly `fake_quantizer`), with gradients through a
    float copy of the integer grid: for rtn and hqq the min/max grid (rounding straight-through, group ranges
    differentiable); for clip and lloyd straight through inside the grid each group's search chose, zero where it
    clips (`searched`); for fp8 and bf16 straight through."""
    if not fmt.integer_groups:
        cast = fake_quantizer(fmt, d)
        return lambda x: x + (cast(x.detach()) - x).detach()
    bits, group = int(fmt.bits), fmt.group_size or d
    fake_quantizer(fmt, d)  # validates the format against d
    codebook = [fmt.codebook()]  # quantizer=lloyd without fitted levels: fitted on the first values quantized

    def levels(x: torch.Tensor) -> torch.Tensor | None:  # lloyd's codebook, fitted on the first values without one
        if fmt.fitted_levels and codebook[0] is None:
            codebook[0] = fit_levels(x.detach(), bits, fmt.group_size, fmt.scale_dtype)
        return codebook[0]

    def exact(x: torch.Tensor) -> torch.Tensor:  # the cache's codes and stored scales, without bit packing
        return fake_quantize(x, bits, fmt.group_size, fmt.symmetric, fmt.scale_dtype, fmt.quantizer, levels(x))

    def approx(x: torch.Tensor) -> torch.Tensor:
        xg = x.reshape(*x.shape[:-1], d // group, group)
        if fmt.symmetric:
            half = 2 ** (bits - 1)
            s = (xg.abs().amax(-1, keepdim=True) / (half - 1)).clamp_min(1e-12)
            out = _ste_round(xg / s).clamp(-half, half - 1) * s
        else:
            lo, hi = xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)
            s = ((hi - lo) / (2**bits - 1)).clamp_min(1e-12)
            out = _ste_round((xg - lo) / s).clamp(0, 2**bits - 1) * s + lo
        return out.reshape(x.shape)

    def searched(x: torch.Tensor) -> torch.Tensor:
        """clip / lloyd: the cache's values in the forward pass; the gradient straight through inside the grid the
        quantizer chose for each group (its searched scale and zero, or levels, held constant), zero outside it
        (where the group's range clips). The range-differentiable RTN grid of `approx` is not the grid these store,
        and steers the fit toward RTN's optimum instead of theirs. hqq keeps `approx`: its zero points are optimised
        afresh for every input, so a grid held constant misleads the fit (measured: a 4x higher content objective
        at int2_content_int4_rope), while the min/max range follows how its grid moves."""
        book = levels(x)
        codes, scales, zeros = group_quantize(x.detach(), bits, fmt.group_size, fmt.symmetric, fmt.scale_dtype,
                                              fmt.quantizer, book)
        value = group_dequantize(codes, scales, zeros, bits, x.dtype, book)
        step = load_scale(scales).unsqueeze(-1)
        first, last = (0.0, 2.0**bits - 1) if book is None else (float(book[0]), float(book[-1]))
        start = -(2.0 ** (bits - 1)) * step if zeros is None else zeros.float().unsqueeze(-1)
        xg = x.reshape(*x.shape[:-1], d // group, group)
        inside = torch.clamp(xg, start + first * step, start + last * step).reshape(x.shape)
        return value + (inside - inside.detach())  # exactly the values forward, inside's gradient backward

    def quantize(x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():  # an evaluation: the cache's values themselves
            return exact(x)
        if fmt.searched:
            return searched(x)
        a = approx(x)
        return a + (exact(x.detach()) - a).detach()

    return quantize


def apply_pairs(k: torch.Tensor, angle: torch.Tensor | None, scale: torch.Tensor, layout: str) -> torch.Tensor:
    """k (..., d_r) -> T k with T = blockdiag(scale_i Rot(angle_i)) on the pairs of `layout` (differentiable);
    angle None: no rotation (each pair's two coordinates times its scale)."""
    a, b = pair_index(layout, k.shape[-1], k.device)
    if angle is None:
        per_channel = torch.empty(k.shape[-1], dtype=scale.dtype, device=scale.device)
        per_channel[a], per_channel[b] = scale, scale
        return k * per_channel
    ka, kb = k[..., a], k[..., b]
    c, s = scale * torch.cos(angle), scale * torch.sin(angle)
    out = torch.empty_like(k)
    out[..., a] = c * ka - s * kb
    out[..., b] = s * ka + c * kb
    return out


def content_roundtrip(cap: LayerCapture, rotation: torch.Tensor | None, scale: torch.Tensor, quantize
                      ) -> torch.Tensor:
    """c_hat in the original basis after storing c' = sigma diag(1/s) R x_hat through `quantize` (R None: I)."""
    if rotation is None:
        return quantize(cap.latent_scale * cap.x_hat / scale) * scale * cap.gamma
    cached = cap.latent_scale * (cap.x_hat @ rotation.T) / scale
    return (quantize(cached) * scale) @ rotation * cap.gamma


def rope_roundtrip(cap: LayerCapture, angle: torch.Tensor | None, scale: torch.Tensor, quantize) -> torch.Tensor:
    """k_hat in the original basis after storing k' = T k through `quantize` (angle None: no rotation)."""
    cached = apply_pairs(cap.k_rope, angle, scale, cap.cached_layout)
    back = None if angle is None else -angle
    return apply_pairs(quantize(cached), back, 1.0 / scale, cap.cached_layout)  # T^{-1} = Rot(-phi) / t


def _attend(cap: LayerCapture, content: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """o_latent (N, H, T_q, d_c) of the captured queries (at their positions) over every key of the sequences."""
    return causal_latent_attention(cap.q_latent, cap.q_rope, content, rope, cap.scale, cap.q_pos, cap.sinks)


def _causal(cap: LayerCapture, device) -> torch.Tensor:
    """(T_q, T) float32: 1 at the keys each captured query sees, else 0 (a product with it is a masked fill, and
    ~10x faster on the CPU than `masked_fill` over the (N, H, T_q, T) scores)."""
    t = cap.k_rope.shape[1]
    return causal_mask(t, t, device, cap.q_pos).float()


def _largest_visible(q_rope: torch.Tensor, e: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """(N, H, T_q) max over the keys s a query sees of |q^R_t . e_s|, for keys e (N, T, d_r): one batched product of
    every head's queries with the shared keys, masked and reduced in place."""
    n, h, t_q, d_r = q_rope.shape
    scores = torch.bmm(q_rope.reshape(n, h * t_q, d_r), e.transpose(1, 2)).view(n, h, t_q, e.shape[1])
    return scores.mul_(keep).abs_().amax(-1)


def reference_output(cap: LayerCapture) -> torch.Tensor:
    """The unquantized attention output per head (N, H, T, d_v); stored on the capture after the first call."""
    if cap.ref_out is None:
        with torch.no_grad():
            cap.ref_out = head_outputs(_attend(cap, cap.content, cap.k_rope), cap.w_uv)
    return cap.ref_out


def attention_output_error(cap: LayerCapture, c_hat: torch.Tensor, k_hat: torch.Tensor | None = None) -> torch.Tensor:
    k = cap.k_rope
    ref = reference_output(cap)
    out = head_outputs(_attend(cap, c_hat, k if k_hat is None else k_hat), cap.w_uv)
    return (out - ref).pow(2).sum() / ref.pow(2).sum()


def _visible_energy(cap: LayerCapture, e: torch.Tensor) -> torch.Tensor:
    """Sum over the captured queries t and the keys s <= t they see of (q^R_t . e_s)^2, for keys e (N, T, d_r): as
    sum_t q_t^T C_t q_t with C_t = sum_{s <= t} e_s e_s^T (a cumulative sum of (d_r, d_r) outer products), so no
    (N, H, T_q, T) score tensor exists (at V2-Lite dims, 8 x 2K tokens: 0.27 GB instead of 2.1 GB, 2x faster)."""
    c = (e.unsqueeze(-1) * e.unsqueeze(-2)).cumsum(1)  # (N, T, d_r, d_r)
    if cap.q_pos is not None:
        c = c[:, cap.q_pos.to(c.device)]
    return (torch.einsum("nhtd,ntde->nhte", cap.q_rope, c) * cap.q_rope).sum()


def positional_qk_error(cap: LayerCapture, k_hat: torch.Tensor) -> torch.Tensor:
    """||q^R . (k_hat - k)||^2 / ||q^R . k||^2 over the (query, key) pairs the causal mask lets attend."""
    if cap.qk_energy is None:  # the reference scores' energy: once per capture (chunks are kept, see `chunk`)
        with torch.no_grad():
            cap.qk_energy = _visible_energy(cap, cap.k_rope)
    return _visible_energy(cap, k_hat - cap.k_rope) / cap.qk_energy


def relative_mse(x_hat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (x_hat - x).pow(2).sum() / x.pow(2).sum()


def next_token_kl(path: str):
    """The end-to-end objective of one path: rerun the model with this block's attention output computed from the
    read-back path (the other path exact), KL of the next-token distribution against the unquantized model."""

    def error(cap: LayerCapture, x_hat: torch.Tensor) -> torch.Tensor:
        if cap.model is None or cap.ids is None:
            raise ValueError("objective next_token_kl needs the capture's model and token ids (capture_layer keeps them)")
        if cap.q_pos is not None:
            raise ValueError("objective next_token_kl replaces the attention output at every token: it needs every "
                             "query, so calib.query_tokens must be null")
        from mla_quant.models.absorbed import attention_modules

        content = x_hat if path == "content" else cap.content
        rope = x_hat if path == "rope" else cap.k_rope
        out = head_outputs(_attend(cap, content, rope), cap.w_uv)
        n, h, t, d_v = out.shape
        merged = out.transpose(1, 2).reshape(n, t, h * d_v)
        model = cap.model
        device = next(model.parameters()).device
        ids = cap.ids.to(device)

        def replace(module, args, kwargs, output):
            return linear(module.o_proj, merged.to(compute_dtype(model))), None

        with torch.no_grad():
            ref = torch.log_softmax(model(input_ids=ids, use_cache=False).logits.float(), -1)
        handle = attention_modules(model)[cap.layer].register_forward_hook(replace, with_kwargs=True)
        try:
            logits = torch.log_softmax(model(input_ids=ids, use_cache=False).logits.float(), -1)
        finally:
            handle.remove()
        return torch.nn.functional.kl_div(logits, ref, log_target=True, reduction="sum") / (n * t)

    return error


ERRORS = {
    "content": {"attention_output": attention_output_error,
                "cache_mse": lambda cap, c_hat: relative_mse(c_hat, cap.content),
                "next_token_kl": next_token_kl("content")},
    "rope": {"positional_qk": positional_qk_error,
             "cache_mse": lambda cap, k_hat: relative_mse(k_hat, cap.k_rope),
             "next_token_kl": next_token_kl("rope")},
}


def _error(path: str, kind: str):
    if kind not in ERRORS[path]:
        raise ValueError(f"objective.{path}.kind={kind!r}; allowed: {list(ERRORS[path])}")
    return ERRORS[path][kind]


def content_objective(kind: str, cap: LayerCapture, rotation, scale, quantize) -> torch.Tensor:
    """The content objective `kind` of the transform (rotation, scale) on a capture."""
    return _error("content", kind)(cap, content_roundtrip(cap, rotation, scale, quantize))


def rope_objective(kind: str, cap: LayerCapture, angle, scale, quantize) -> torch.Tensor:
    """The RoPE-key objective `kind` of the pair transform (angle, scale) on a capture."""
    return _error("rope", kind)(cap, rope_roundtrip(cap, angle, scale, quantize))


@torch.no_grad()
def rope_output_bound(cap: LayerCapture, angle, scale, quantize) -> dict[str, float]:
    """Mean over (sequence, head, query) of the measured attention-output change ||W_UV (o(k_hat) - o(k))|| caused by
    the RoPE key's quantization alone, and of its bound tau max_s |q^R . dk_s| * diam{W_UV c_s : s <= t}. Evaluated
    over the capture's chunks of sequences (their reference outputs are the fit's)."""
    total, count = {"measured": 0.0, "bound": 0.0}, 0
    for part in cap.eval_chunks():
        k_hat = rope_roundtrip(part, angle, scale, quantize)
        c = part.content
        out = head_outputs(_attend(part, c, k_hat), part.w_uv)
        measured = (out - reference_output(part)).norm(dim=-1)  # (N, H, T_q)
        d_max = part.scale * _largest_visible(part.q_rope, k_hat - part.k_rope, _causal(part, c.device))  # (N,H,T)
        v_norm = torch.einsum("ntc,hvc->nhtv", c, part.w_uv).norm(dim=-1)  # (N, H, S)
        radius = torch.cummax(v_norm, dim=-1).values  # max over s <= t
        radius = radius if part.q_pos is None else radius[..., part.q_pos.to(c.device)]
        bound = d_max * 2 * radius  # diam <= 2 max ||v_s||
        total["measured"] += float(measured.sum())
        total["bound"] += float(bound.sum())
        count += measured.numel()
    return {key: value / count for key, value in total.items()}
