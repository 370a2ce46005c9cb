"""format=pairs: the RoPE key with a bit width per group of frequency pairs, each group an integer group of its own."""

from __future__ import annotations

import torch

from mla_quant.kernels.layout import DTYPE_CODES
from mla_quant.quant import packing, quantizers
from mla_quant.quant.codecs.base import SCALE_BYTES, ZERO_BYTES, Codec, register
from mla_quant.quant.rope import PAIR_LAYOUTS, rope_pair



def pair_channels(layout: str, d: int, groups: int) -> list[list[int]]:
    """The channels of each of `groups` equal groups of RoPE frequency pairs (pair 0 = the highest frequency), for
    a d-dim key whose pair i is (i, i + d/2) (`half`, rotate-half order) or (2i, 2i + 1) (`interleaved`)."""
    if layout not in PAIR_LAYOUTS:
        raise ValueError(f"RoPE pair layout {layout!r}; allowed: {list(PAIR_LAYOUTS)}")
    per = d // 2 // groups
    out = []
    for g in range(groups):
        pairs = range(g * per, (g + 1) * per)
        out.append([c for i in pairs for c in rope_pair(layout, d, i)])
    return out


@register
class PairsCodec(Codec):
    """The RoPE key with bits per group of frequency pairs: `bits` a list, one width per group of d/2/len(bits)
    consecutive pairs (a pair's two channels always together; 16 keeps a group unquantized). Each group is one
    integer group of its own (codes as an LSB-first byte stream, a scale and a zero in `scale_dtype`), so the bytes
    of a path are the sum of its groups'. Which channels form a pair is the model's RoPE layout (`pair_layout`, set
    from the model's family when the format is built for it)."""

    name = "pairs"
    whole_page = True
    widths = (*quantizers.INT_BITS, 16)

    def check(self, fmt, where):
        if fmt.token_block is not None:
            raise ValueError(f"{where}.token_block={fmt.token_block!r}: format=pairs quantizes each token on its own; "
                             f"allowed: null")
        bits = fmt.bits
        if not isinstance(bits, tuple) or not bits or any(b not in self.widths for b in bits):
            raise ValueError(f"{where}.bits={list(bits) if isinstance(bits, tuple) else bits!r}: format=pairs takes "
                             f"one width per group of RoPE pairs, each in {list(self.widths)} (16 = unquantized)")
        if fmt.group_size is not None:
            raise ValueError(f"{where}.group_size={fmt.group_size!r}: with bits per group of pairs each group is one "
                             f"quantization group; allowed: null")
        if fmt.granularity != "group":
            raise ValueError(f"{where}.granularity={fmt.granularity!r}: format=pairs takes ['group']")
        quantizers.check_scale_dtype(fmt.scale_dtype)

    def check_dim(self, fmt, d, where):
        groups = len(fmt.bits)
        if d % 2 or (d // 2) % groups:
            raise ValueError(f"{where}.bits has {groups} groups of RoPE pairs; the path has {d} channels ({d // 2} "
                             f"pairs): allowed a number of groups dividing {d // 2}, on an even dimension")

    def _groups(self, fmt, d):
        return list(zip(fmt.bits, pair_channels(fmt.pair_layout, d, len(fmt.bits))))

    def group_bytes(self, fmt, bits: int, n: int, act_bytes: int) -> int:
        if bits == 16:
            return n * act_bytes
        zeros = 0 if fmt.symmetric else ZERO_BYTES[fmt.scale_dtype]
        return packing.packed_dim(n, bits) + SCALE_BYTES[fmt.scale_dtype] + zeros

    def bytes_per_token(self, fmt, d, act_bytes):
        return sum(self.group_bytes(fmt, b, len(ch), act_bytes) for b, ch in self._groups(fmt, d))

    def encode(self, fmt, x, tensor_scale):
        parts = {}
        for g, (bits, channels) in enumerate(self._groups(fmt, x.shape[-1])):
            sub = x[..., channels]
            if bits == 16:
                parts[f"g{g}/values"] = sub
                continue
            codes, scales, zeros = quantizers.group_quantize(sub, bits, None, fmt.symmetric, fmt.scale_dtype,
                                                             fmt.quantizer)
            parts[f"g{g}/codes"] = packing.pack(codes, bits, check=False)
            parts[f"g{g}/scales"] = scales
            if zeros is not None:
                parts[f"g{g}/zeros"] = zeros
        return parts

    def decode(self, fmt, parts, d, dtype, tensor_scale):
        lead = next(iter(parts.values())).shape[:-1]
        out = torch.empty(*lead, d, dtype=dtype, device=next(iter(parts.values())).device)
        for g, (bits, channels) in enumerate(self._groups(fmt, d)):
            if bits == 16:
                out[..., channels] = parts[f"g{g}/values"].to(dtype)
                continue
            codes = packing.unpack(parts[f"g{g}/codes"], bits, len(channels))
            out[..., channels] = quantizers.group_dequantize(codes, parts[f"g{g}/scales"], parts.get(f"g{g}/zeros"),
                                                             bits, dtype)
        return out

    def kernel_unsupported(self, fmt, d):
        return None

    def kernel_spec(self, fmt, d):
        # the kernel reads the path's whole page (`kernel_pairs`); its tile is in channel order, as float values'
        return dict(bits=0, group=1, symmetric=True, pow2=False)

    def kernel_pairs(self, fmt, d: int, offset: Callable[[str], int], dtype_of: Callable[[str], torch.dtype]
                     ) -> tuple:
        """The decode kernel's static description of a page of this path (kernels/latent_decode.py `_pairs_tile`):
        (1, interleaved, pairs per group, symmetric, groups), each group (bits, row bytes, data offset, scales
        offset, zeros offset, data kind, scale kind, zero kind) with byte offsets in the page (`offset(part)`,
        parts named as the codec's: g0/codes, g0/scales, ...) and kinds `DTYPE_CODES[dtype_of(part)]`."""
        groups = []
        for g, (bits, channels) in enumerate(self._groups(fmt, d)):
            if bits == 16:
                dt = dtype_of(f"g{g}/values")
                groups.append((16, len(channels) * dt.itemsize, offset(f"g{g}/values"), 0, 0, DTYPE_CODES[dt], 0, 0))
                continue
            zero = (0, 0) if fmt.symmetric else (offset(f"g{g}/zeros"), DTYPE_CODES[dtype_of(f"g{g}/zeros")])
            groups.append((bits, packing.packed_dim(len(channels), bits), offset(f"g{g}/codes"),
                           offset(f"g{g}/scales"), zero[0], 0, DTYPE_CODES[dtype_of(f"g{g}/scales")], zero[1]))
        return (1, int(fmt.pair_layout == "interleaved"), d // 2 // len(fmt.bits), int(fmt.symmetric), tuple(groups))

    def describe(self, fmt):
        return (f"pairs int{'/'.join(str(b) for b in fmt.bits)} over {len(fmt.bits)} groups of pairs "
                f"{'sym' if fmt.symmetric else 'asym'} {fmt.scale_dtype}")
