"""Per-layer fitting of the content (R, s) and RoPE (phi, t) transforms on one block's captured activations.

The kinds (`transform.<path>.kind`) are mla_quant.transforms.kinds' registry. A kind's transform starts from the best
of its closed-form candidates (`starts`: identity, Hadamard, balanced scale, both) under its objective; a fitted kind
then runs Adam: R stays orthogonal through `torch.nn.utils.parametrizations.orthogonal`, s and t stay positive as
exp(log), rounding is straight-through. The best iterate (objective on every calibration sequence) is kept, so a
fitted transform is never worse than its initialisation on the calibration data.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import nn
from torch.nn.utils.parametrizations import orthogonal
from tqdm.auto import tqdm

from mla_quant.calibration.capture import LayerCapture
from mla_quant.calibration.objectives import content_objective, rope_objective
from mla_quant.transforms import random_hadamard
from mla_quant.transforms.kinds import kind as transform_kind
from mla_quant.transforms.fold import pair_index


@dataclass
class FitOptions:
    steps: int = 100
    lr: float = 0.01
    alpha: float = 0.5  # range-balancing exponent
    batch: int = 8  # calibration sequences per step
    eval_every: int = 25
    seed: int = 0


def balance(x_amax: torch.Tensor, w_amax: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant's divisor max|X|^alpha / max|W|^(1-alpha), normalised to geometric mean 1."""
    s = x_amax.clamp_min(1e-8) ** alpha / w_amax.clamp_min(1e-8) ** (1 - alpha)
    return s / torch.exp(torch.log(s).mean())


def smooth_scale(cap: LayerCapture, rotation: torch.Tensor | None, alpha: float) -> torch.Tensor:
    """s for the cache c' = sigma R x_hat / s, balancing its channel ranges against the query's in the same basis
    (the score q~ . c = (R (gamma q~)) . (sigma R x_hat)); R None: the identity (no product over the captures)."""
    d = cap.x_hat.shape[-1]
    z, u = cap.latent_scale * cap.x_hat.reshape(-1, d), cap.q_latent.reshape(-1, d) * cap.gamma
    if rotation is not None:
        z, u = z @ rotation.T, u @ rotation.T
    return balance(z.abs().amax(0), u.abs().amax(0), alpha)


def pair_balance(cap: LayerCapture, alpha: float) -> torch.Tensor:
    """t_i per RoPE pair: the key is multiplied by t (k' = t k), the query divided, balancing pair magnitudes."""
    a, b = pair_index(cap.cached_layout, cap.k_rope.shape[-1], cap.k_rope.device)
    k_mag = torch.sqrt(cap.k_rope[..., a] ** 2 + cap.k_rope[..., b] ** 2).reshape(-1, len(a)).amax(0)
    q_mag = torch.sqrt(cap.q_rope[..., a] ** 2 + cap.q_rope[..., b] ** 2).reshape(-1, len(a)).amax(0)
    return 1.0 / balance(k_mag, q_mag, alpha)


def _evaluate(fn, cap: LayerCapture, *params) -> float:
    """Objective over every sequence of the capture (mean of the relative error over its chunks of sequences)."""
    with torch.no_grad():
        values = [float(fn(part, *params)) for part in cap.eval_chunks()]
        return sum(values) / len(values)


def _adam(params, loss_fn, evaluate, opts: FitOptions, n_rows: int, desc: str, best):
    """Adam on `params` with minibatches of sequences; returns the best (value, snapshot) seen."""
    opt = torch.optim.Adam(params, lr=opts.lr)
    g = torch.Generator().manual_seed(opts.seed)
    for step in tqdm(range(opts.steps), desc=desc, leave=False, unit="step"):
        idx = torch.randperm(n_rows, generator=g, device="cpu")[: opts.batch]  # the generator is the host's
        loss = loss_fn(idx)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (step + 1) % opts.eval_every == 0 or step + 1 == opts.steps:
            value, snapshot = evaluate()
            if value < best[0]:
                best = (value, snapshot)
    return best


def fit_content(cap: LayerCapture, kind: str, objective: str, quantize, opts: FitOptions,
                generator: torch.Generator) -> tuple[torch.Tensor | None, torch.Tensor | None, dict]:
    """-> (R or None, s or None, {"none": error, "fitted": error})."""
    spec = transform_kind("content", kind)
    d = cap.x_hat.shape[-1]
    eye, ones = torch.eye(d, device=cap.x_hat.device), torch.ones(d, device=cap.x_hat.device)
    had = random_hadamard(d, generator).float().to(cap.x_hat.device)

    def obj(c, r, s):  # the identity as None: no product with it
        return content_objective(objective, c, None if r is eye else r, s, quantize)

    base = _evaluate(obj, cap, eye, ones)
    candidates = spec.starts(SimpleNamespace(eye=eye, hadamard=had,
                                             balanced=lambda r: smooth_scale(cap, None if r is eye else r, opts.alpha)))
    if not candidates:
        return None, None, {"none": base, "fitted": base}
    scored = [(base if (r is eye and s is None) else _evaluate(obj, cap, r, ones if s is None else s), r, s)
              for r, s in candidates]
    value, r0, s0 = min(scored, key=lambda x: x[0])
    if not spec.fitted:
        return (None if r0 is eye else r0), s0, {"none": base, "fitted": value}

    lin = nn.Linear(d, d, bias=False, device=cap.x_hat.device)
    with torch.no_grad():
        lin.weight.copy_(r0)
    orthogonal(lin)
    log_s = nn.Parameter(torch.log(ones if s0 is None else s0).clone(), requires_grad=spec.learns_scale)

    def loss_fn(idx):
        return obj(cap.rows(idx), lin.weight, torch.exp(log_s))

    def evaluate():
        r, s = lin.weight.detach().clone(), torch.exp(log_s).detach().clone()
        return _evaluate(obj, cap, r, s), (r, s)

    params = [*lin.parameters()] + ([log_s] if log_s.requires_grad else [])
    best = _adam(params, loss_fn, evaluate, opts, cap.x_hat.shape[0],
                 f"content layer {cap.layer}", (value, (r0, ones if s0 is None else s0)))
    value, (r, s) = best
    return r, (s if spec.learns_scale else None), {"none": base, "fitted": value}


def fit_rope(cap: LayerCapture, kind: str, objective: str, quantize, opts: FitOptions
             ) -> tuple[torch.Tensor | None, torch.Tensor | None, dict]:
    """-> (phi or None, t or None, {"none": error, "fitted": error})."""
    spec = transform_kind("rope", kind)
    n = cap.k_rope.shape[-1] // 2
    zeros, ones = torch.zeros(n, device=cap.k_rope.device), torch.ones(n, device=cap.k_rope.device)

    def obj(c, phi, t):  # no rotation as None: no product with it
        return rope_objective(objective, c, None if phi is zeros else phi, t, quantize)

    base = _evaluate(obj, cap, zeros, ones)
    candidates = spec.starts(SimpleNamespace(zeros=zeros, ones=ones, balanced=lambda: pair_balance(cap, opts.alpha)))
    if not candidates:
        return None, None, {"none": base, "fitted": base}
    scored = [(base if (p0 is zeros and t0 is ones) else _evaluate(obj, cap, p0, t0), p0, t0) for p0, t0 in candidates]
    value, p0, t0 = min(scored, key=lambda x: x[0])
    if not spec.fitted:
        return (None if p0 is zeros else p0), (None if t0 is ones else t0), {"none": base, "fitted": value}
    phi = nn.Parameter(p0.clone())
    log_t = nn.Parameter(torch.log(t0).clone())

    def loss_fn(idx):
        return obj(cap.rows(idx), phi, torch.exp(log_t))

    def evaluate():
        p, t = phi.detach().clone(), torch.exp(log_t).detach().clone()
        return _evaluate(obj, cap, p, t), (p, t)

    value, (p, t) = _adam([phi, log_t], loss_fn, evaluate, opts, cap.k_rope.shape[0], f"rope layer {cap.layer}",
                          (value, (p0, t0)))
    return p, t, {"none": base, "fitted": value}
