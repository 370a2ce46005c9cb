"""format=bf16: the path kept unquantized, in the activation dtype."""

from __future__ import annotations

from mla_quant.quant.codecs.base import Codec, register


@register
class ValuesCodec(Codec):
    """Unquantized: the values in the activation dtype."""

    name = "bf16"
    widths = (16,)
    quantized = False

    def store_unsupported(self, fmt):
        return None  # nothing to encode

    def bytes_per_token(self, fmt, d, act_bytes):
        return d * act_bytes

    def encode(self, fmt, x, tensor_scale):
        return {"values": x}

    def decode(self, fmt, parts, d, dtype, tensor_scale):
        return parts["values"].to(dtype)

    def kernel_unsupported(self, fmt, d):
        return None

    def kernel_spec(self, fmt, d):
        return dict(bits=0, group=1, symmetric=True, pow2=False)
