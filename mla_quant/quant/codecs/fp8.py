"""format=fp8: e4m3 values with a scale per group, per token, or per sequence and layer (tensor granularity), or
none at all (granularity=unscaled: the values cast as they are, saturating at +-448; vLLM's nvfp4_ds_mla RoPE key)."""

from __future__ import annotations

import torch

from mla_quant.quant import quantizers
from mla_quant.quant.codecs.base import GRANULARITIES, SCALE_BYTES, Codec, register


@register
class Fp8Codec(Codec):
    """e4m3 codes (stored as their uint8 bits); a scale per group/tile, or one per sequence (tensor granularity)."""

    name = "fp8"
    widths = (8,)
    granularities = (*GRANULARITIES, "unscaled")

    def check(self, fmt, where):
        super().check(fmt, where)
        if fmt.granularity == "unscaled":
            if fmt.group_size is not None:
                raise ValueError(f"{where}.group_size={fmt.group_size!r}: granularity=unscaled stores no scale; "
                                 "allowed: null")
            return
        quantizers.check_scale_dtype(fmt.scale_dtype)

    @staticmethod
    def uses_tensor_scale(fmt):
        return fmt.granularity == "tensor"

    def n_groups(self, fmt, d):
        return 0 if fmt.granularity in ("tensor", "unscaled") else quantizers.n_groups(d, fmt.group_size)

    def bytes_per_token(self, fmt, d, act_bytes):
        return d + self.n_groups(fmt, d) * SCALE_BYTES[fmt.scale_dtype]

    def encode(self, fmt, x, tensor_scale):
        if fmt.granularity == "unscaled":
            codes = x.float().clamp(-quantizers.FP8_MAX, quantizers.FP8_MAX).to(quantizers.FP8_DTYPE)
            return {"codes": codes.view(torch.uint8)}
        if fmt.granularity == "tensor":
            s = tensor_scale.float().reshape(*x.shape[:-1], 1)  # (N, 1): the sequence's scale, per token
            codes = (x.float() / s).clamp(-quantizers.FP8_MAX, quantizers.FP8_MAX).to(quantizers.FP8_DTYPE)
            return {"codes": codes.view(torch.uint8)}
        codes, scales, _ = quantizers.fp8_quantize(x, fmt.group_size, scale_dtype=fmt.scale_dtype)
        return {"codes": codes.view(torch.uint8), "scales": scales}

    def decode(self, fmt, parts, d, dtype, tensor_scale):
        if fmt.granularity == "unscaled":
            return parts["codes"].view(quantizers.FP8_DTYPE).to(dtype)
        if fmt.granularity == "tensor":
            x = parts["codes"].view(quantizers.FP8_DTYPE).float()
            return (x * tensor_scale.float().reshape(*x.shape[:-1], 1)).to(dtype)
        return quantizers.fp8_dequantize(parts["codes"], parts["scales"], dtype)

    def describe(self, fmt):
        if fmt.granularity == "unscaled":
            return "fp8 e4m3, unscaled"
        if fmt.granularity == "tensor":
            return "fp8 e4m3, per-sequence fp32 scale"
        group = "per-token" if fmt.group_size is None else f"g={fmt.group_size}"
        return f"fp8 {group} sym {fmt.scale_dtype}"
