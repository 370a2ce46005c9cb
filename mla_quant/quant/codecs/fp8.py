"""format=fp8: e4m3 values with a scale per group, per token, or per sequence and layer (tensor granularity), or
none at all (granularity=unscaled: the values cast as they are, saturating at +-448; vLLM's nvfp4_ds_mla RoPE key)."""

from __future__ import annotations

import torch

from mla_quant.quant.codecs.base import GRANULARITIES, SCALE_BYTES, Codec, register
from mla_quant.quant.quantizers import (FP8_DTYPE, FP8_MAX, Quantized, check_scale_dtype, grouped, load_scale, n_groups,
                                       store_scale)


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
        check_scale_dtype(fmt.scale_dtype)

    @staticmethod
    def uses_tensor_scale(fmt):
        return fmt.granularity == "tensor"

    def n_groups(self, fmt, d):
        return 0 if fmt.granularity in ("tensor", "unscaled") else n_groups(d, fmt.group_size)

    def bytes_per_token(self, fmt, d, act_bytes):
        return d + self.n_groups(fmt, d) * SCALE_BYTES[fmt.scale_dtype]

    def encode(self, fmt, x, tensor_scale):
        if fmt.granularity == "unscaled":
            codes = x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
            return {"codes": codes.view(torch.uint8)}
        if fmt.granularity == "tensor":
            s = tensor_scale.float().reshape(*x.shape[:-1], 1)  # (N, 1): the sequence's scale, per token
            codes = (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
            return {"codes": codes.view(torch.uint8)}
        codes, scales, _ = fp8_quantize(x, fmt.group_size, scale_dtype=fmt.scale_dtype)
        return {"codes": codes.view(torch.uint8), "scales": scales}

    def decode(self, fmt, parts, d, dtype, tensor_scale):
        if fmt.granularity == "unscaled":
            return parts["codes"].view(FP8_DTYPE).to(dtype)
        if fmt.granularity == "tensor":
            x = parts["codes"].view(FP8_DTYPE).float()
            return (x * tensor_scale.float().reshape(*x.shape[:-1], 1)).to(dtype)
        return fp8_dequantize(parts["codes"], parts["scales"], dtype)

    def kernel_unsupported(self, fmt, d):
        return "granularity=tensor (a scale per sequence)" if fmt.granularity == "tensor" else None

    def kernel_spec(self, fmt, d):
        return self.byte_codes_spec("e4m3", fmt.group_size or d, pow2=fmt.scale_dtype == "pow2")

    def describe(self, fmt):
        if fmt.granularity == "unscaled":
            return "fp8 e4m3, unscaled"
        if fmt.granularity == "tensor":
            return "fp8 e4m3, per-sequence fp32 scale"
        group = "per-token" if fmt.group_size is None else f"g={fmt.group_size}"
        return f"fp8 {group} sym {fmt.scale_dtype}"


def fp8_quantize(
    x: torch.Tensor,
    group_size: int | None = None,
    per_tensor: bool = False,
    scale_dtype: str = "fp32",
    scale: torch.Tensor | float | None = None,
) -> Quantized:
    """x (..., d) -> codes (..., d) float8_e4m3fn, scales; zeros is always None.

    per_tensor=True: one scale for the whole tensor (scales is 0-d float32); `scale` fixes it (static/calibrated)
    instead of amax/448. Otherwise per token (group_size=None, scales (..., 1)) or per tile of group_size values
    (scales (..., d/group_size)), s = amax/448 rounded up to scale_dtype. Values are clamped to +-448 before
    torch's own round-to-nearest-even cast.
    """
    check_scale_dtype(scale_dtype)
    xf = x.float()
    if per_tensor:
        if scale is None:
            s = xf.abs().amax() / FP8_MAX
            s = torch.where(s > 0, s, torch.ones_like(s))
        else:
            s = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
            if s.dim() != 0 or not bool(s > 0):
                raise ValueError(f"a per-tensor fp8 scale must be one positive number, got {scale!r}")
        scales = s.reshape(())
        codes = (xf / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return Quantized(codes, scales, None)
    if scale is not None:
        raise ValueError("a fixed fp8 `scale` is only for per_tensor=True")
    xg = grouped(xf, group_size)  # (..., G, g)
    s = xg.abs().amax(-1) / FP8_MAX
    s = torch.where(s > 0, s, torch.ones_like(s))
    scales = store_scale(s, scale_dtype)  # (..., G)
    codes = (xg / load_scale(scales).unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return Quantized(codes.reshape(x.shape), scales, None)


def fp8_dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes (..., d) float8_e4m3fn (or its uint8 view), scales 0-d or (..., n_groups) -> x_hat (..., d)."""
    if codes.dtype == torch.uint8:
        codes = codes.view(FP8_DTYPE)
    x = codes.float()
    s = load_scale(scales)
    if s.dim() == 0:
        return (x * s).to(dtype)
    d, g = codes.shape[-1], scales.shape[-1]
    x = x.reshape(*codes.shape[:-1], g, d // g) * s.unsqueeze(-1)
    return x.reshape(codes.shape).to(dtype)


def fp8_fake_quantize(x: torch.Tensor, group_size: int | None = None, per_tensor: bool = False,
                      scale_dtype: str = "fp32") -> torch.Tensor:
    """FP8 quantize then dequantize, back in x.dtype."""
    codes, scales, _ = fp8_quantize(x, group_size, per_tensor, scale_dtype)
    return fp8_dequantize(codes, scales, x.dtype)
