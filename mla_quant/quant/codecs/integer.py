"""format=int: integer codes per group of a token's values, packed in int32 words (INT3: a byte stream), a scale
(and zero) per group."""

from __future__ import annotations

from mla_quant.kernels.layout import WORD_BITS, WordLayout
from mla_quant.quant import packing, quantizers
from mla_quant.quant.codecs.base import SCALE_BYTES, TRITON_INT_BITS, ZERO_BYTES, Codec, register


@register
class IntCodec(Codec):
    """Integer codes per group, packed; scale (and zero) per group in `scale_dtype`."""

    name = "int"
    widths = quantizers.INT_BITS
    integer_groups = True

    def store_unsupported(self, fmt):
        if fmt.quantizer not in quantizers.STORED_BY_KERNEL:  # PyTorch encodes the searched and fitted quantizers
            return f"quantizer={fmt.quantizer}"
        return None

    def check(self, fmt, where):
        super().check(fmt, where)
        quantizers.check_scale_dtype(fmt.scale_dtype)

    def n_groups(self, fmt, d):
        return quantizers.n_groups(d, fmt.group_size)

    @staticmethod
    def code_bytes(fmt, d) -> int:
        """Bytes of one token's codes: whole int32 words (WordLayout) at 2/4/8 bits, the LSB-first stream at 3."""
        return WordLayout(fmt.bits, d).row_bytes if fmt.bits in WORD_BITS else packing.packed_dim(d, fmt.bits)

    def bytes_per_token(self, fmt, d, act_bytes):
        zeros = 0 if fmt.symmetric else ZERO_BYTES[fmt.scale_dtype]
        return self.code_bytes(fmt, d) + self.n_groups(fmt, d) * (SCALE_BYTES[fmt.scale_dtype] + zeros)

    @staticmethod
    def pack_codes(fmt, codes: torch.Tensor) -> torch.Tensor:
        """codes (..., d) uint8 -> int32 words (WordLayout) at 2/4/8 bits, the LSB-first byte stream at 3."""
        if fmt.bits in WORD_BITS:
            return WordLayout(fmt.bits, codes.shape[-1]).pack(codes)
        return packing.pack(codes, fmt.bits, check=False)

    @staticmethod
    def unpack_codes(fmt, packed: torch.Tensor, d: int) -> torch.Tensor:
        if fmt.bits in WORD_BITS:
            return WordLayout(fmt.bits, d).unpack(packed)
        return packing.unpack(packed, fmt.bits, d)

    def encode(self, fmt, x, tensor_scale):
        codes, scales, zeros = quantizers.group_quantize(x, fmt.bits, fmt.group_size, fmt.symmetric, fmt.scale_dtype,
                                                         fmt.quantizer, fmt.codebook(required=True, device=x.device))
        parts = {"codes": self.pack_codes(fmt, codes), "scales": scales}
        if zeros is not None:
            parts["zeros"] = zeros
        return parts

    def decode(self, fmt, parts, d, dtype, tensor_scale):
        if fmt.bits in WORD_BITS:  # straight from the int32 words to float codes (the same values as unpack_codes)
            codes = WordLayout(fmt.bits, d).unpack_float(parts["codes"])
        else:
            codes = self.unpack_codes(fmt, parts["codes"], d)
        return quantizers.group_dequantize(codes, parts["scales"], parts.get("zeros"), fmt.bits, dtype,
                                           fmt.codebook(required=True, device=codes.device))

    def fake_quantize(self, fmt, x, tensor_scale, where="fake_quantize"):
        if fmt.quantizer == "lloyd" and fmt.levels is None:  # a study's quantizer: levels fitted on the x it is given
            return quantizers.fake_quantize(x, fmt.bits, fmt.group_size, fmt.symmetric, fmt.scale_dtype, "lloyd")
        return super().fake_quantize(fmt, x, tensor_scale, where)

    def kernel_unsupported(self, fmt, d):
        if fmt.bits not in TRITON_INT_BITS:
            return f"bits={fmt.bits} (the kernel unpacks {list(TRITON_INT_BITS)})"
        return None

    def kernel_spec(self, fmt, d):
        return dict(bits=fmt.bits, group=fmt.group_size or d, symmetric=fmt.symmetric, pow2=fmt.scale_dtype == "pow2")

    def describe(self, fmt):
        group = "per-token" if fmt.group_size is None else f"g={fmt.group_size}"
        return f"int{fmt.bits} {group} {'sym' if fmt.symmetric else 'asym'} {fmt.scale_dtype}{fmt.quantizer_label}"

    def label(self, fmt):
        return f"int{fmt.bits} " + (f"g{fmt.group_size}" if fmt.group_size else "tok") + fmt.quantizer_label
