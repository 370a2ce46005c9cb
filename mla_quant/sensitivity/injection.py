"""Fixed-NMSE error injection into one path of the latent cache (docs/method.md section 2).

    eps = fixed_nmse_noise(x, 0.01, torch.randn_like(x))        # ||eps||^2 / ||x||^2 == 0.01 exactly
    cache = LatentCache(n_layers, injection_factory(InjectionSpec(path="rope", nmse=0.01, layers={3})))

NMSE(x_hat, x) = ||x_hat - x||^2 / ||x||^2, reduced per layer over every token (and batch row) appended in one call;
the sensitivity study prefills its whole probe in one forward, so each injected layer's cache error is exactly the
target. Noise shapes: isotropic Gaussian, or the real error of a quantizer (`fake_quant(x) - x`) rescaled to the same
NMSE. For the content path the error can be confined to the score side (q~.c) or the value side (sum p c); for the
RoPE key it can be confined to one frequency pair.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mla_quant.cache import LatentCacheLayer
from mla_quant.kernels.attention import latent_attention
from mla_quant.quant.rope import rope_pair
from mla_quant.quant.formats import PATHS

SIDES = ("both", "score", "value")


def check_nmse_target(nmse: float) -> float:
    if not 0.0 < float(nmse) < 1.0:
        raise ValueError(f"NMSE target {nmse!r} is outside (0, 1); e.g. 0.01 is the paper's 1%")
    return float(nmse)


def nmse(x_hat: torch.Tensor, x: torch.Tensor) -> float:
    """||x_hat - x||^2 / ||x||^2 over the whole tensor, in float64."""
    x64 = x.double()
    return ((x_hat.double() - x64).pow(2).sum() / x64.pow(2).sum()).item()


def fixed_nmse_noise(x: torch.Tensor, target: float, direction: torch.Tensor, refine: int = 24) -> torch.Tensor:
    """`direction` rescaled so that ||(x + eps) - x||^2 / ||x||^2 == target, returned in x's dtype.

    The scale is computed in float64, then corrected for the rounding of x + eps in x's dtype (float32/bfloat16):
    fixed-point steps until the target is bracketed, bisection after (the achieved NMSE is a step function of the
    scale, coarse on a small bfloat16 tensor, where fixed-point steps alone can cycle), at most `refine` evaluations,
    keeping the scale whose rounded error is closest to the target. So the error the model actually sees has the
    target NMSE to rounding precision.
    """
    d = direction.double()
    energy = d.pow(2).sum()
    if energy == 0:
        raise ValueError("the noise direction is all zeros (a lossless quantizer?): nothing to rescale")
    alpha = torch.sqrt(target * x.double().pow(2).sum() / energy)
    best, best_gap, low, high = alpha, float("inf"), None, None
    for _ in range(refine):
        achieved = nmse(x + (d * alpha).to(x.dtype), x)
        if achieved == 0:
            break
        gap = abs(achieved / target - 1)
        if gap < best_gap:
            best, best_gap = alpha, gap
        if gap < 1e-6:
            break
        if achieved < target:
            low = alpha if low is None else max(low, alpha)
        else:
            high = alpha if high is None else min(high, alpha)
        alpha = (low + high) / 2 if low is not None and high is not None else alpha * (target / achieved) ** 0.5
    return (d * best).to(x.dtype)


@dataclass
class InjectionSpec:
    """What to inject: `path` content|rope, at `nmse`, in `layers` (None = all), with `shape` gaussian|quantizer.

    side: for content, where the error acts (both | score | value). pair: for rope, the only frequency pair hit.
    quantizer: for shape="quantizer", a function x -> fake-quantized x (same shape).
    """

    path: str
    nmse: float
    layers: set[int] | None = None
    shape: str = "gaussian"
    side: str = "both"
    pair: int | tuple[int, ...] | None = None  # rope: the only frequency pair (or pairs) hit
    rope_layout: str = "half"
    quantizer: Callable[[torch.Tensor], torch.Tensor] | None = None
    seed: int = 0
    # filled during the run: per layer, the achieved NMSE and the mean squared error per coordinate
    achieved: dict[int, float] = field(default_factory=dict)
    error_energy: dict[int, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self):
        if self.path not in PATHS:
            raise ValueError(f"injection path {self.path!r}; allowed: {PATHS}")
        if self.side not in SIDES:
            raise ValueError(f"injection side {self.side!r}; allowed: {SIDES}")
        if self.side != "both" and self.path != "content":
            raise ValueError(f"side={self.side!r} applies to the content path only (RoPE errors act on scores only)")
        if self.pair is not None and self.path != "rope":
            raise ValueError("pair= applies to the rope path only")
        if self.shape not in ("gaussian", "quantizer"):
            raise ValueError(f"noise shape {self.shape!r}; allowed: gaussian, quantizer")
        if self.shape == "quantizer" and self.quantizer is None:
            raise ValueError("shape='quantizer' needs a quantizer function")
        check_nmse_target(self.nmse)

    def direction(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        if self.shape == "gaussian":
            # drawn on the host (the generator is the CPU's: the same noise on every device), then moved
            z = torch.randn(x.shape, generator=generator, dtype=torch.float64, device="cpu").to(x.device)
        else:
            z = self.quantizer(x).double() - x.double()
        if self.pair is not None:  # one frequency pair, or a group of them (those this layer's key has)
            keep = torch.zeros(x.shape[-1], dtype=z.dtype, device=z.device)
            for i in self.pairs_in(x.shape[-1]):
                keep[list(rope_pair(self.rope_layout, x.shape[-1], i))] = 1.0
            z = z * keep
        return z

    def pairs_in(self, d: int) -> list[int]:
        """The injected pairs a d-dim RoPE key has (a model whose layers' d_r differ: fewer in the smaller ones)."""
        pairs = (self.pair,) if isinstance(self.pair, int) else self.pair
        return [i for i in pairs if i < d // 2]

    def hits(self, d: int) -> bool:
        """Whether a layer whose `path` has d dims takes this injection: it has dims, and the pairs injected."""
        return d > 0 and (self.pair is None or bool(self.pairs_in(d)))

    def perturb(self, layer_idx: int, x: torch.Tensor) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + layer_idx)
        eps = fixed_nmse_noise(x, self.nmse, self.direction(x, generator))
        x_hat = x + eps
        self.achieved[layer_idx] = nmse(x_hat, x)
        self.error_energy[layer_idx] = eps.double().pow(2).reshape(-1, x.shape[-1]).mean(0).cpu()
        return x_hat


class InjectedLatentLayer(LatentCacheLayer):
    """A latent cache layer that stores the perturbed path and keeps the clean latent beside it (for side splits)."""

    def __init__(self, layer_idx: int, spec: InjectionSpec):
        super().__init__()
        self.layer_idx = layer_idx
        self.spec = spec
        self.clean = LatentCacheLayer()

    def append(self, content: torch.Tensor, rope: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        self.clean.append(content, rope, valid)
        if self.spec.path == "content":
            content = self.spec.perturb(self.layer_idx, content)
        elif self.spec.hits(rope.shape[-1]):  # a layer without a RoPE key (a NoPE layer), or without the pair
            rope = self.spec.perturb(self.layer_idx, rope)  # injected, has nothing to perturb on this path
        super().append(content, rope, valid)

    def attend(self, q_latent, q_rope, content, rope, scale, mask, valid=None, **absorbed):
        self.append(content, rope, valid)
        noisy_c, noisy_k = self.read()
        clean_c, _ = self.clean.read()
        side = self.spec.side
        score_c = noisy_c if side in ("both", "score") else clean_c
        value_c = noisy_c if side in ("both", "value") else clean_c
        return latent_attention(q_latent, q_rope, score_c, noisy_k, scale, mask, values=value_c, **absorbed)


def injection_factory(spec: InjectionSpec):
    """A layer factory for `LatentCache`: injected layers where `spec.layers` says, clean ones elsewhere."""
    counter = iter(range(1_000_000))

    def make():
        idx = next(counter)
        if spec.layers is None or idx in spec.layers:
            return InjectedLatentLayer(idx, spec)
        return LatentCacheLayer()

    return make
