"""The transform kinds per path (`transform.<path>.kind`) and random members of each kind's space.

    content  none | hadamard (randomized Hadamard) | smooth (channel scale) | rotation (fitted rotation only)
             | rotation_scaling (rotation + scale)
    rope     none | pair_scale (tied scale per frequency pair) | pairwise (2x2 rotation + tied scale per pair)

`sample_layer_transform` draws a random member of a kind's space; the invariance check (experiment=verify) folds such
draws into a model, which must leave its function unchanged whatever the values.
"""

from __future__ import annotations

import torch

from mla_quant.transforms.fold import LayerTransform
from mla_quant.transforms.hadamard import random_hadamard, random_orthogonal

CONTENT_KINDS = ("none", "hadamard", "smooth", "rotation", "rotation_scaling")
ROPE_KINDS = ("none", "pair_scale", "pairwise")
KINDS = {"content": CONTENT_KINDS, "rope": ROPE_KINDS}


def check_kind(path: str, kind: str) -> None:
    if kind not in KINDS[path]:
        raise ValueError(f"transform.{path}.kind={kind!r}; allowed: {list(KINDS[path])}")


def sample_layer_transform(content: str, rope: str, d_c: int, d_r: int, generator: torch.Generator,
                           spread: float = 0.5) -> LayerTransform:
    """A random transform of the given kinds: scales log-normal with std `spread`, angles uniform in [-pi, pi)."""
    check_kind("content", content)
    check_kind("rope", rope)
    lt = LayerTransform()

    def log_normal(n):
        return torch.exp(spread * torch.randn(n, generator=generator, dtype=torch.float64))

    if content == "hadamard":
        lt.rotation = random_hadamard(d_c, generator)
    elif content == "smooth":
        lt.scale = log_normal(d_c)
    elif content == "rotation":
        lt.rotation = random_orthogonal(d_c, generator)
    elif content == "rotation_scaling":
        lt.rotation, lt.scale = random_orthogonal(d_c, generator), log_normal(d_c)
    if rope != "none" and d_r % 2:
        raise ValueError(f"transform.rope.kind={rope!r} pairs RoPE coordinates; d_r={d_r} is odd")
    if rope == "pair_scale":
        lt.pair_scale = log_normal(d_r // 2)
    elif rope == "pairwise":
        lt.angle = (torch.rand(d_r // 2, generator=generator, dtype=torch.float64) * 2 - 1) * torch.pi
        lt.pair_scale = log_normal(d_r // 2)
    return lt
