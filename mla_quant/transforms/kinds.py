"""The transform kinds per path (`transform.<path>.kind`): a registry, one class per kind.

    content  none | hadamard (randomized Hadamard, QuaRot) | smooth (range-balancing scale, SmoothQuant)
             | rotation (rotation fitted, no scale; ablation) | rotation_scaling (QuantMLA: rotation and scale)
    rope     none | pair_scale (range-balancing scale per frequency pair) | pairwise (QuantMLA: 2x2 rotation + tied
             scale per pair)

A kind says what its transform needs and where a fit starts:
    data_free      computed without calibration data (`free`)
    fitted         refined by Adam after its closed-form start (calibration.fit)
    starts(ctx)    the closed-form candidates on one layer's capture; the fit keeps the best under its objective.
                   `ctx` holds the layer's identity, randomized Hadamard and range-balancing scale (`ctx.balanced`)
    sample(...)    a random member of its space (the invariance check folds such draws into a model)

A new baseline is one class here (`@register`) and one `conf/transform/*.yaml` naming it.
Content values are (rotation R or None, scale s or None); RoPE values are (angle phi or None, pair scale t or None).
"""

from __future__ import annotations

from typing import Callable

import torch

from mla_quant.transforms.hadamard import random_hadamard, random_orthogonal

CONTENT: dict[str, TransformKind] = {}
ROPE: dict[str, TransformKind] = {}
KINDS = {"content": CONTENT, "rope": ROPE}


def register(cls):
    KINDS[cls.path][cls.name] = cls()
    return cls


def kind(path: str, name: str) -> TransformKind:
    if path not in KINDS:
        raise ValueError(f"transform path {path!r}; allowed: {list(KINDS)}")
    if name not in KINDS[path]:
        raise ValueError(f"transform.{path}.kind={name!r}; allowed: {list(KINDS[path])}")
    return KINDS[path][name]


class TransformKind:
    path = "content"
    name = "none"
    data_free = True  # needs no calibration data
    fitted = False  # refined by gradient descent from the best start
    learns_scale = False  # content: the fit trains the channel scale too

    def free(self, d: int, generator: torch.Generator) -> tuple:
        """The transform of a data-free kind (no capture needed)."""
        return None, None

    def starts(self, ctx) -> list[tuple]:
        """Closed-form candidates on one layer's capture ([] = the identity only)."""
        return []

    def sample(self, d: int, generator: torch.Generator, log_normal: Callable[[int], torch.Tensor]) -> tuple:
        return None, None


@register
class ContentNone(TransformKind):
    path, name = "content", "none"


@register
class Hadamard(TransformKind):
    path, name = "content", "hadamard"

    def free(self, d, generator):
        return random_hadamard(d, generator), None

    def starts(self, ctx):
        return [(ctx.hadamard, None)]

    def sample(self, d, generator, log_normal):
        return self.free(d, generator)


@register
class Smooth(TransformKind):
    path, name = "content", "smooth"
    data_free = False

    def starts(self, ctx):
        return [(ctx.eye, ctx.balanced(ctx.eye))]

    def sample(self, d, generator, log_normal):
        return None, log_normal(d)


@register
class Rotation(TransformKind):
    path, name = "content", "rotation"
    data_free, fitted = False, True

    def starts(self, ctx):
        return [(ctx.eye, None), (ctx.hadamard, None)]

    def sample(self, d, generator, log_normal):
        return random_orthogonal(d, generator), None


@register
class RotationScaling(TransformKind):
    path, name = "content", "rotation_scaling"
    data_free, fitted, learns_scale = False, True, True

    def starts(self, ctx):
        return [(ctx.eye, None), (ctx.hadamard, None), (ctx.eye, ctx.balanced(ctx.eye)),
                (ctx.hadamard, ctx.balanced(ctx.hadamard))]

    def sample(self, d, generator, log_normal):
        return random_orthogonal(d, generator), log_normal(d)


class PairKind(TransformKind):
    """A RoPE kind acts per frequency pair: the key's dimension must be even. `rotates`: it rotates within pairs
    (a family that RMS-norms its RoPE key before RoPE cannot fold that; a scale per pair folds into the norm)."""
    path = "rope"
    rotates = False

    def sample(self, d, generator, log_normal):
        if d % 2:
            raise ValueError(f"transform.rope.kind={self.name!r} pairs RoPE coordinates; d_r={d} is odd")
        return self.sample_pairs(d // 2, generator, log_normal)

    def sample_pairs(self, n, generator, log_normal):
        return None, None


@register
class RopeNone(PairKind):
    name = "none"

    def sample(self, d, generator, log_normal):
        return None, None


@register
class PairScale(PairKind):
    name = "pair_scale"
    data_free = False

    def starts(self, ctx):
        return [(ctx.zeros, ctx.balanced())]

    def sample_pairs(self, n, generator, log_normal):
        return None, log_normal(n)


@register
class Pairwise(PairKind):
    name = "pairwise"
    rotates = True
    data_free, fitted = False, True

    def starts(self, ctx):
        return [(ctx.zeros, ctx.ones), (ctx.zeros, ctx.balanced())]

    def sample_pairs(self, n, generator, log_normal):
        angle = (torch.rand(n, generator=generator, dtype=torch.float64, device="cpu") * 2 - 1) * torch.pi
        return angle, log_normal(n)
