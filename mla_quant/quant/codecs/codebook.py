"""format=codebook: a norm per token and a Lloyd-Max Gaussian level per coordinate (TurboQuant's MSE quantizer)."""

from __future__ import annotations

from mla_quant.quant import packing, quantizers
from mla_quant.quant.codecs.base import SCALE_BYTES, Codec, register


@register
class CodebookCodec(Codec):
    """TurboQuant's MSE quantizer: one norm per token (in `scale_dtype`) and per coordinate a `bits`-bit index into
    the Lloyd-Max levels of a unit Gaussian (the coordinates of a randomly rotated unit vector, times sqrt(d))."""

    name = "codebook"
    widths = (2, 3, 4, 8)

    def check(self, fmt, where):
        super().check(fmt, where)
        quantizers.check_scale_dtype(fmt.scale_dtype)
        if fmt.group_size is not None:
            raise ValueError(f"{where}.group_size={fmt.group_size!r}: format=codebook keeps one norm per token; "
                             f"allowed: null")

    def bytes_per_token(self, fmt, d, act_bytes):
        return packing.packed_dim(d, fmt.bits) + SCALE_BYTES[fmt.scale_dtype]

    def encode(self, fmt, x, tensor_scale):
        codes, norms = quantizers.codebook_quantize(x, fmt.bits, fmt.scale_dtype)
        return {"codes": packing.pack(codes, fmt.bits, check=False), "scales": norms}

    def decode(self, fmt, parts, d, dtype, tensor_scale):
        codes = packing.unpack(parts["codes"], fmt.bits, d)
        return quantizers.codebook_dequantize(codes, parts["scales"], fmt.bits, dtype)

    def describe(self, fmt):
        return f"codebook{fmt.bits} (Lloyd-Max) per-token norm {fmt.scale_dtype}"
