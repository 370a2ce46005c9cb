"""Random members of each transform kind's space (mla_quant.transforms.kinds): the invariance check
(experiment=verify) folds such draws into a model, which must leave its function unchanged whatever the values."""

from __future__ import annotations

import torch

from mla_quant.transforms.fold import LayerTransform
from mla_quant.transforms.kinds import kind


def sample_layer_transform(content: str, rope: str, d_c: int, d_r: int, generator: torch.Generator,
                           spread: float = 0.5) -> LayerTransform:
    """A random transform of the given kinds: scales log-normal with std `spread`, angles uniform in [-pi, pi)."""
    content_kind, rope_kind = kind("content", content), kind("rope", rope)

    def log_normal(n):
        return torch.exp(spread * torch.randn(n, generator=generator, dtype=torch.float64, device="cpu"))

    rotation, scale = content_kind.sample(d_c, generator, log_normal)
    angle, pair_scale = rope_kind.sample(d_r, generator, log_normal)
    return LayerTransform(rotation=rotation, scale=scale, angle=angle, pair_scale=pair_scale)
