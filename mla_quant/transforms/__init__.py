"""Per-path transforms of the latent cache, folded offline into an MLA block's weights (docs/method.md section 4).

    content:  rotation R (d_c x d_c, orthogonal) + channel scale s > 0       c' = diag(1/s) R x / rms(x)
    RoPE key: per frequency pair a 2x2 rotation Rot(phi_i) and a tied scale t_i, which commutes with RoPE

    tset = TransformSet([LayerTransform(rotation=R, scale=s, angle=phi, pair_scale=t), ...])
    apply_transforms(model, tset)         # in place; with the cache unquantized the model is the same function
"""

from mla_quant.transforms.fold import (
    LayerTransform,
    TransformSet,
    apply_transforms,
    fold_content,
    fold_rope,
    pair_matrix,
)
from mla_quant.transforms.hadamard import random_hadamard, random_orthogonal
from mla_quant.transforms.kinds import KINDS, TransformKind, kind, register
from mla_quant.transforms.spaces import sample_layer_transform

__all__ = ["KINDS", "LayerTransform", "TransformKind", "TransformSet", "apply_transforms", "kind",
           "fold_content", "fold_rope", "pair_matrix", "random_hadamard", "random_orthogonal",
           "register", "sample_layer_transform"]
