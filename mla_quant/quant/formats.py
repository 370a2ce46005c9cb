"""Cache formats: one registry of codecs, and the validated format of each path (content latent c, RoPE key k).

`PathFormat` mirrors one path block of `conf/quant/*.yaml` (`quant.content`, `quant.rope`); `CacheFormat` the whole
`quant` group. Both are built and validated from the config BEFORE any model work, so a bad value fails at once
with the value and the allowed ones in the message. Everything that depends on the storage format lives in the
codec of that format (`CODECS`), in one place: allowed widths, the byte formula, encode/decode, and whether (and
with which arguments) the Triton decode kernel reads it. Adding a format = one `Codec` subclass here.

    fmt = cache_format(cfg.quant, d_c=512, d_r=64)        # raises ValueError on bad bits / group sizes
    fmt.content.bytes_per_token(512)                       # 272 for INT4, group 128, fp16 scale + zero
    cache_bytes_per_token(fmt, 512, 64, context=131072)    # includes the protected region
    fq = fake_quantizer(cfg.quant.content, d=512, path="content")   # x -> stored-and-read-back x (noise studies)

Codecs (`format`), see docs/cache.md "Formats":
    bf16  kept unquantized, in the activation dtype (BF16 on real models; the formulas count 2 B/value)
    int   `bits` in {2,3,4,8}, per-token groups of `group_size` (null = whole vector), symmetric or scale + zero,
          codes in int32 words (kernels/layout.py; INT3: the byte stream of packing.py), scales/zeros in
          `scale_dtype` (fp16 | bf16 | fp32 | pow2 = int8 exponent)
    fp8   e4m3 (torch.float8_e4m3fn), bits 8; granularity "group": one scale per group_size values
          (null = per token, 128 = FlashMLA tiles), or "tensor": one float32 scale per sequence and layer, the
          amax/448 of that sequence's first append, optionally shared by both paths (`shared_scale`)
    codebook  `bits` in {2,3,4,8}: one norm per token and a Lloyd-Max Gaussian level per coordinate (TurboQuant's
          MSE quantizer; pair it with a Hadamard rotation, transform=turboquant)
    channel_block  `bits` in {2,3,4,8}, KIVI's key quantization: per channel over blocks of `token_block`
          consecutive tokens of one sequence, scale + zero per channel and block, spread over the block's tokens
          (token j of a block stores the scales and zeros of channels [j S, (j + 1) S), S = ceil(d / token_block));
          encode/decode take whole blocks along the token dim (-2); the cache keeps a block's tokens unquantized
          until it fills (cache/layer.py)
    pairs  the RoPE key with `bits` a list: one width (2/3/4/8, 16 unquantized) per group of consecutive frequency
          pairs in the model's RoPE layout, each group one integer group (byte-stream codes, its own scale + zero)
A `layers` list gives each cache layer its own paths (`LayeredFormat`).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields

import torch

from mla_quant.checks import int_setting
from mla_quant.kernels.layout import WORD_BITS, WordLayout
from mla_quant.quant import packing, quantizers

GRANULARITIES = ("group", "tensor")
MODES = ("simulated", "serving")
BACKENDS = ("auto", "torch", "triton", "cpu")  # auto: decode steps through the Triton kernel on a CUDA device and
# through the fused C++ kernel on the CPU where the kernel reads the format (and, on the CPU, builds here), PyTorch
# otherwise; prefill and multi-token steps always in PyTorch
STEP_TYPES = ("prefill", "decode")  # multi-token steps (prefill, scoring) / one query token per sequence
SCALE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4, "pow2": 1}
ZERO_BYTES = {name: torch.empty(0, dtype=dt).element_size() for name, dt in quantizers.ZERO_DTYPES.items()}
TENSOR_SCALE_BYTES = 4  # one float32 per tensor-granularity path (or one shared by both paths), per sequence and layer
TRITON_INT_BITS = WORD_BITS  # what the decode kernel unpacks: the int32 word layout (kernels/layout.py)
# dtype codes of the decode kernel's typed reads from a page of bytes (format=pairs)
DTYPE_KINDS = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.int8: 3}
PAIR_LAYOUTS = ("half", "interleaved")  # which channels of the RoPE key form a frequency pair (format=pairs)
DERIVED_KEYS = ("pair_layout", "levels")  # PathFormat fields set from the model (or fitted on it), never from a config
CODEBOOK_LEVEL_BYTES = 4  # quantizer=lloyd: each level of a layer's codebook is one float32


def _plain(cfg) -> dict:
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(cfg):
            return OmegaConf.to_container(cfg, resolve=True)
    except ImportError:  # pragma: no cover - hydra ships omegaconf
        pass
    if not isinstance(cfg, Mapping):
        raise ValueError(f"expected a mapping for a quant config, got {type(cfg).__name__}: {cfg!r}")
    return dict(cfg)


def _check_keys(cfg: dict, allowed, where: str) -> None:
    unknown = sorted(set(cfg) - set(allowed))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")


# ---------------------------------------------------------------------------------------------- codecs
class Codec:
    """How one path is stored. Subclasses fill in the hooks; `PathFormat` delegates to its codec."""

    name = "?"
    widths: tuple[int, ...] = ()
    granularities: tuple[str, ...] = ("group",)
    token_blocks = False  # True: encode/decode take whole blocks of `token_block` tokens along dim -2

    def check(self, fmt: "PathFormat", where: str) -> None:
        """Format-specific checks (widths, granularity, scale dtype), independent of the dimension."""
        if fmt.token_block is not None and not self.token_blocks:
            raise ValueError(f"{where}.token_block={fmt.token_block!r}: format={self.name} quantizes each token on its "
                             f"own; allowed: null (format=channel_block quantizes over blocks of tokens)")
        if fmt.bits not in self.widths:
            raise ValueError(f"{where}.bits={fmt.bits!r} is not a width of format={self.name}; allowed: "
                             f"{list(self.widths)} (formats and their widths: "
                             f"{ {n: list(c.widths) for n, c in CODECS.items()} })")
        if fmt.granularity not in self.granularities:
            raise ValueError(f"{where}.granularity={fmt.granularity!r}: format={self.name} takes "
                             f"{list(self.granularities)}")

    def n_groups(self, fmt: "PathFormat", d: int) -> int:
        return 0

    def bytes_per_token(self, fmt: "PathFormat", d: int, act_bytes: int) -> float:
        raise NotImplementedError

    def encode(self, fmt: "PathFormat", x: torch.Tensor, tensor_scale: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """x (N, d) -> the stored tensors of N tokens, each (N, *). `tensor_scale`: (N,) per-token view of the
        per-sequence scale (fp8 tensor granularity) or None."""
        raise NotImplementedError

    def decode(self, fmt: "PathFormat", parts: Mapping[str, torch.Tensor], d: int, dtype: torch.dtype,
               tensor_scale: torch.Tensor | None) -> torch.Tensor:
        """The stored tensors (..., *) -> x_hat (..., d) in `dtype`; `tensor_scale` broadcast over (...)."""
        raise NotImplementedError

    def fake_quantize(self, fmt: "PathFormat", x: torch.Tensor, tensor_scale: torch.Tensor | None,
                      where: str = "fake_quantize") -> torch.Tensor:
        """x (..., d) -> x as stored and read back, in x.dtype; stored scales or zeros that overflow their dtype are
        refused (`check_finite`, naming `where`), as the cache refuses them, never read back as inf."""
        parts = self.encode(fmt, x, tensor_scale)
        check_finite(parts, where)
        return self.decode(fmt, parts, x.shape[-1], x.dtype, tensor_scale)

    def kernel_unsupported(self, fmt: "PathFormat", d: int) -> str | None:
        """Why the Triton decode kernel cannot read this format, or None if it can."""
        return f"format={self.name}"

    def kernel_spec(self, fmt: "PathFormat", d: int) -> dict:
        """The kernel's compile-time description of the stored tensors (see kernels/latent_decode.py)."""
        raise NotImplementedError

    def describe(self, fmt: "PathFormat") -> str:
        return self.name

    uses_tensor_scale = staticmethod(lambda fmt: False)


class ValuesCodec(Codec):
    """Unquantized: the values in the activation dtype."""

    name = "bf16"
    widths = (16,)

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


class IntCodec(Codec):
    """Integer codes per group, packed; scale (and zero) per group in `scale_dtype`."""

    name = "int"
    widths = quantizers.INT_BITS

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
        how = "" if fmt.quantizer == "rtn" else f" {fmt.quantizer}"
        return f"int{fmt.bits} {group} {'sym' if fmt.symmetric else 'asym'} {fmt.scale_dtype}{how}"


class Fp8Codec(Codec):
    """e4m3 codes (stored as their uint8 bits); a scale per group/tile, or one per sequence (tensor granularity)."""

    name = "fp8"
    widths = (8,)
    granularities = GRANULARITIES

    def check(self, fmt, where):
        super().check(fmt, where)
        quantizers.check_scale_dtype(fmt.scale_dtype)

    @staticmethod
    def uses_tensor_scale(fmt):
        return fmt.granularity == "tensor"

    def n_groups(self, fmt, d):
        return 0 if fmt.granularity == "tensor" else quantizers.n_groups(d, fmt.group_size)

    def bytes_per_token(self, fmt, d, act_bytes):
        return d + self.n_groups(fmt, d) * SCALE_BYTES[fmt.scale_dtype]

    def encode(self, fmt, x, tensor_scale):
        if fmt.granularity == "tensor":
            s = tensor_scale.float().reshape(*x.shape[:-1], 1)  # (N, 1): the sequence's scale, per token
            codes = (x.float() / s).clamp(-quantizers.FP8_MAX, quantizers.FP8_MAX).to(quantizers.FP8_DTYPE)
            return {"codes": codes.view(torch.uint8)}
        codes, scales, _ = quantizers.fp8_quantize(x, fmt.group_size, scale_dtype=fmt.scale_dtype)
        return {"codes": codes.view(torch.uint8), "scales": scales}

    def decode(self, fmt, parts, d, dtype, tensor_scale):
        if fmt.granularity == "tensor":
            x = parts["codes"].view(quantizers.FP8_DTYPE).float()
            return (x * tensor_scale.float().reshape(*x.shape[:-1], 1)).to(dtype)
        return quantizers.fp8_dequantize(parts["codes"], parts["scales"], dtype)

    def describe(self, fmt):
        if fmt.granularity == "tensor":
            return "fp8 e4m3, per-sequence fp32 scale"
        group = "per-token" if fmt.group_size is None else f"g={fmt.group_size}"
        return f"fp8 {group} sym {fmt.scale_dtype}"


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


def pair_channels(layout: str, d: int, groups: int) -> list[list[int]]:
    """The channels of each of `groups` equal groups of RoPE frequency pairs (pair 0 = the highest frequency), for
    a d-dim key whose pair i is (i, i + d/2) (`half`, rotate-half order) or (2i, 2i + 1) (`interleaved`)."""
    if layout not in PAIR_LAYOUTS:
        raise ValueError(f"RoPE pair layout {layout!r}; allowed: {list(PAIR_LAYOUTS)}")
    per = d // 2 // groups
    out = []
    for g in range(groups):
        pairs = range(g * per, (g + 1) * per)
        out.append([c for i in pairs for c in ((i, i + d // 2) if layout == "half" else (2 * i, 2 * i + 1))])
    return out


class PairsCodec(Codec):
    """The RoPE key with bits per group of frequency pairs: `bits` a list, one width per group of d/2/len(bits)
    consecutive pairs (a pair's two channels always together; 16 keeps a group unquantized). Each group is one
    integer group of its own (codes as an LSB-first byte stream, a scale and a zero in `scale_dtype`), so the bytes
    of a path are the sum of its groups'. Which channels form a pair is the model's RoPE layout (`pair_layout`, set
    from the model's family when the format is built for it)."""

    name = "pairs"
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
        parts named as the codec's: g0/codes, g0/scales, ...) and kinds `DTYPE_KINDS[dtype_of(part)]`."""
        groups = []
        for g, (bits, channels) in enumerate(self._groups(fmt, d)):
            if bits == 16:
                dt = dtype_of(f"g{g}/values")
                groups.append((16, len(channels) * dt.itemsize, offset(f"g{g}/values"), 0, 0, DTYPE_KINDS[dt], 0, 0))
                continue
            zero = (0, 0) if fmt.symmetric else (offset(f"g{g}/zeros"), DTYPE_KINDS[dtype_of(f"g{g}/zeros")])
            groups.append((bits, packing.packed_dim(len(channels), bits), offset(f"g{g}/codes"),
                           offset(f"g{g}/scales"), zero[0], 0, DTYPE_KINDS[dtype_of(f"g{g}/scales")], zero[1]))
        return (1, int(fmt.pair_layout == "interleaved"), d // 2 // len(fmt.bits), int(fmt.symmetric), tuple(groups))

    def describe(self, fmt):
        return (f"pairs int{'/'.join(str(b) for b in fmt.bits)} over {len(fmt.bits)} groups of pairs "
                f"{'sym' if fmt.symmetric else 'asym'} {fmt.scale_dtype}")


class ChannelBlockCodec(Codec):
    """KIVI's key quantization: asymmetric integer codes per channel over blocks of `token_block` consecutive tokens
    (`quantizers.channel_block_quantize`), so an outlier channel gets its own step instead of widening every
    token's. Codes are packed per token as for `int`; a block's (d,) scales and zeros are spread over its tokens,
    S = ceil(d / token_block) of each per token (the last token's tail padded), so every stored tensor stays one
    row per token and the paged store, batch edits and byte counts work as for any codec. Encode and decode take
    whole blocks: x (..., N, d), N a multiple of token_block, each run of token_block tokens one block."""

    name = "channel_block"
    widths = quantizers.INT_BITS
    granularities = ("channel",)
    token_blocks = True

    def check(self, fmt, where):
        super().check(fmt, where)
        quantizers.check_scale_dtype(fmt.scale_dtype)
        int_setting(fmt.token_block, f"{where}.token_block", why="format=channel_block needs the tokens per block",
                    allowed="a positive integer (KIVI uses 32)")
        if fmt.group_size is not None:
            raise ValueError(f"{where}.group_size={fmt.group_size!r}: format=channel_block keeps one scale and zero "
                             f"per channel and token block; allowed: null")
        if fmt.symmetric:
            raise ValueError(f"{where}.symmetric=true: format=channel_block is asymmetric (scale + zero per channel "
                             f"and block); allowed: false")

    @staticmethod
    def scale_slots(fmt, d) -> int:
        """Scales (and zeros) each token stores: its share of its block's d per-channel values."""
        return -(-d // fmt.token_block)

    def n_groups(self, fmt, d):
        return self.scale_slots(fmt, d)

    def bytes_per_token(self, fmt, d, act_bytes):
        return IntCodec.code_bytes(fmt, d) + self.scale_slots(fmt, d) * (SCALE_BYTES[fmt.scale_dtype]
                                                                         + ZERO_BYTES[fmt.scale_dtype])

    def _blocks(self, fmt, n: int) -> int:
        if n % fmt.token_block:
            raise ValueError(f"format=channel_block: {n} tokens are not whole blocks of token_block="
                             f"{fmt.token_block}; encode and decode take whole blocks along the token dim")
        return n // fmt.token_block

    def _spread(self, fmt, v: torch.Tensor) -> torch.Tensor:
        """(..., nb, d) per block -> (..., nb * token_block, S) per token (zero padded past d)."""
        t, d = fmt.token_block, v.shape[-1]
        s = self.scale_slots(fmt, d)
        padded = torch.nn.functional.pad(v, (0, s * t - d)) if s * t > d else v
        return padded.reshape(*v.shape[:-2], v.shape[-2] * t, s)

    def _gather(self, fmt, v: torch.Tensor, d: int) -> torch.Tensor:
        """(..., N, S) per token -> (..., N / token_block, d) per block."""
        nb = self._blocks(fmt, v.shape[-2])
        return v.reshape(*v.shape[:-2], nb, -1)[..., :d]

    def encode(self, fmt, x, tensor_scale):
        self._blocks(fmt, x.shape[-2])
        codes, scales, zeros = quantizers.channel_block_quantize(x, fmt.bits, fmt.token_block, fmt.scale_dtype)
        return {"codes": IntCodec.pack_codes(fmt, codes), "scales": self._spread(fmt, scales),
                "zeros": self._spread(fmt, zeros)}

    def decode(self, fmt, parts, d, dtype, tensor_scale):
        codes = IntCodec.unpack_codes(fmt, parts["codes"], d)
        return quantizers.channel_block_dequantize(codes, self._gather(fmt, parts["scales"], d),
                                                   self._gather(fmt, parts["zeros"], d), fmt.bits, dtype)

    def fake_quantize(self, fmt, x, tensor_scale, where="fake_quantize"):
        """Whole blocks along dim -2 (from its first token) as stored and read back; the tokens of a last, partial
        block exact, as the cache keeps them until their block fills."""
        if x.dim() < 2:
            return x
        full = x.shape[-2] - x.shape[-2] % fmt.token_block
        head = x[..., :full, :]
        if full:
            head = super().fake_quantize(fmt, head, None, where)
        return torch.cat([head, x[..., full:, :]], dim=-2)

    def describe(self, fmt):
        return f"int{fmt.bits} per channel over {fmt.token_block}-token blocks asym {fmt.scale_dtype}"


CODECS: dict[str, Codec] = {c.name: c for c in (ValuesCodec(), IntCodec(), Fp8Codec(), CodebookCodec(),
                                                  ChannelBlockCodec(), PairsCodec())}
FORMATS = tuple(CODECS)


def check_finite(parts: Mapping[str, torch.Tensor], where: str) -> None:
    """Refuse stored scales/zeros/values that overflowed their dtype (inf or NaN would decode to inf silently)."""
    for name, t in parts.items():
        if t.is_floating_point() and not quantizers.all_finite(t):
            dtype = str(t.dtype).replace("torch.", "")
            raise ValueError(f"{where}: the stored {name} ({dtype}) overflow to inf/NaN (the latent holds values "
                             f"beyond the {dtype} range, or is itself not finite); use scale_dtype=fp32 for this "
                             f"path, or find where the model overflows")


@functools.lru_cache(maxsize=256)
def _levels_tensor(levels: tuple[float, ...], device: str) -> torch.Tensor:
    """A codebook's levels as one float32 tensor per distinct codebook and device (read, never written), so a decode
    step does not copy them to its device again."""
    return torch.tensor(levels, dtype=torch.float32, device=device)


# ---------------------------------------------------------------------------------------------- path format
@dataclass(frozen=True)
class PathFormat:
    """How one path is stored (the keys of `quant.content` / `quant.rope`)."""

    format: str = "bf16"
    bits: int = 16
    group_size: int | None = None
    symmetric: bool = False
    scale_dtype: str = "fp16"
    granularity: str = "group"
    token_block: int | None = None  # format=channel_block: tokens per block (one scale + zero per channel and block)
    quantizer: str = "rtn"  # format=int: how each group's codes are chosen (quantizers.QUANTIZERS)
    pair_layout: str = "half"  # format=pairs: the model's RoPE pair layout (set from the model, not a config key)
    # quantizer=lloyd: this layer's codebook, 2^bits ascending levels in code units (fitted on calibration latents by
    # the preparation step, mla_quant/calibration/codebooks.py; not a config key)
    levels: tuple[float, ...] | None = field(default=None, repr=False)  # (so a format's repr, which identifies
    # the fitted transforms, is the configured format's)

    @classmethod
    def from_cfg(cls, cfg, where: str = "quant.<path>") -> "PathFormat":
        cfg = _plain(cfg)
        _check_keys(cfg, [f.name for f in fields(cls) if f.name not in DERIVED_KEYS], where)
        if isinstance(cfg.get("bits"), (list, tuple)):  # a width per group of RoPE pairs: format=pairs
            cfg = {**cfg, "bits": tuple(cfg["bits"])}
            if cfg.get("format", "bf16") in ("bf16", "int"):
                cfg["format"] = "pairs"
        # A low bit width on a bf16 path means an integer format: `quant.content.bits=3` works from quant=bf16.
        elif cfg.get("format", "bf16") == "bf16" and cfg.get("bits", 16) not in (16, None):
            cfg = {**cfg, "format": "int"}
        fmt = cls(**cfg)
        fmt.check(where=where)
        return fmt

    @property
    def codec(self) -> Codec:
        return CODECS[self.format]

    def check(self, d: int | None = None, where: str = "quant.<path>") -> None:
        """Raise ValueError on a value this path cannot take (d: the path's dimension, d_c or d_r)."""
        if self.format not in CODECS:
            raise ValueError(f"{where}.format={self.format!r} is unknown; allowed: {list(CODECS)}")
        self.codec.check(self, where)
        if self.format in ("int", "pairs"):
            quantizers.check_quantizer(self.quantizer, self.symmetric, f"{where}.quantizer")
            if self.quantizer == "lloyd":
                if self.format != "int":
                    raise ValueError(f"{where}.quantizer=lloyd fits one codebook per path: format=pairs (a width per "
                                     f"group of RoPE pairs) takes rtn, clip or hqq")
                if self.bits not in quantizers.LLOYD_BITS:
                    raise ValueError(f"{where}.quantizer=lloyd fits non-uniform levels at bits "
                                     f"{list(quantizers.LLOYD_BITS)}; got bits={self.bits}")
            if self.levels is not None:
                if self.quantizer != "lloyd":
                    raise ValueError(f"{where}: a codebook (levels) is for quantizer=lloyd; quantizer="
                                     f"{self.quantizer} takes none")
                quantizers.check_levels(self.levels, self.bits, f"{where} codebook")
        elif self.quantizer != "rtn":
            raise ValueError(f"{where}.quantizer={self.quantizer!r} chooses integer groups' ranges: it applies to "
                             f"format=int; format={self.format} takes quantizer=rtn")
        if self.group_size is not None and (
            isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size <= 0
        ):
            raise ValueError(f"{where}.group_size={self.group_size!r}; allowed: null or a positive integer")
        if d is not None and self.format == "pairs":
            self.codec.check_dim(self, d, where)
        if d is not None and self.quantized and self.granularity == "group" and self.group_size is not None:
            if d % self.group_size:
                divisors = [g for g in range(1, d + 1) if d % g == 0]
                raise ValueError(
                    f"{where}.group_size={self.group_size} does not divide the path dimension {d}; "
                    f"allowed: null (whole vector) or one of {divisors}"
                )

    @property
    def quantized(self) -> bool:
        return self.format != "bf16"

    def codebook(self, required: bool = False, device: torch.device | str = "cpu") -> torch.Tensor | None:
        """quantizer=lloyd: the levels as a float32 tensor on `device` (None for other quantizers). required=True: a
        lloyd path without fitted levels is refused (the cache stores codes against one fixed codebook)."""
        if self.quantizer != "lloyd":
            return None
        if self.levels is None:
            if required:
                raise ValueError("quantizer=lloyd stores codes against a codebook fitted on calibration latents, and "
                                 "this format has none: the preparation step fits it (prepare_model with calib=...), "
                                 "or give the format its levels (fitted_codebooks)")
            return None
        return _levels_tensor(self.levels, str(torch.device(device)))

    def codebook_bytes(self) -> int:
        """Bytes of this path's codebook in one cache layer (constant, shared by every sequence): 0 unless lloyd."""
        return CODEBOOK_LEVEL_BYTES * 2**self.bits if self.quantizer == "lloyd" else 0

    @property
    def tensor_scaled(self) -> bool:
        return self.codec.uses_tensor_scale(self)

    def n_groups(self, d: int) -> int:
        """Scales (and zeros) per token; 0 for bf16 and per-tensor fp8."""
        return self.codec.n_groups(self, d)

    def bytes_per_token(self, d: int, act_bytes: int = 2) -> float:
        """Bytes one token of this path takes in the quantized region (codes + scales + zeros), from the format."""
        return self.codec.bytes_per_token(self, d, act_bytes)

    def encode(self, x: torch.Tensor, tensor_scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        return self.codec.encode(self, x, tensor_scale)

    def decode(self, parts: Mapping[str, torch.Tensor], d: int, dtype: torch.dtype,
               tensor_scale: torch.Tensor | None = None) -> torch.Tensor:
        return self.codec.decode(self, parts, d, dtype, tensor_scale)

    @property
    def blocked(self) -> int | None:
        """Tokens per block when this path is quantized over blocks of tokens (channel_block), else None."""
        return self.token_block if self.codec.token_blocks else None

    def kernel_unsupported(self, d: int) -> str | None:
        return self.codec.kernel_unsupported(self, d)

    def kernel_spec(self, d: int) -> dict:
        return self.codec.kernel_spec(self, d)

    def describe(self) -> str:
        return self.codec.describe(self)


# ---------------------------------------------------------------------------------------------- the quant group
@dataclass(frozen=True)
class CacheFormat:
    """The whole `quant` group, validated against (d_c, d_r)."""

    name: str
    mode: str
    backend: str
    n_sink: int
    recent: int
    block_size: int
    content: PathFormat
    rope: PathFormat
    shared_scale: bool
    d_c: int
    d_r: int

    @property
    def quantized(self) -> bool:
        return self.content.quantized or self.rope.quantized

    def path(self, name: str) -> PathFormat:
        return {"content": self.content, "rope": self.rope}[name]

    def dim(self, name: str) -> int:
        return {"content": self.d_c, "rope": self.d_r}[name]

    @property
    def token_block(self) -> int | None:
        """Tokens per block of a path quantized over blocks of tokens (channel_block), else None: a sequence's
        tokens that left the recent window wait unquantized (both paths) until they fill a block."""
        blocks = {p.blocked for p in (self.content, self.rope)} - {None}
        return blocks.pop() if blocks else None

    def codebook_bytes(self) -> int:
        """Per layer constant bytes, shared by every sequence: the lloyd codebooks of both paths."""
        return self.content.codebook_bytes() + self.rope.codebook_bytes()

    def tensor_scale_bytes(self) -> int:
        """Per sequence and layer constant bytes: float32 per-tensor fp8 scales (one if shared)."""
        n = sum(p.tensor_scaled for p in (self.content, self.rope))
        return TENSOR_SCALE_BYTES * (min(n, 1) if self.shared_scale else n)

    def kernel_unsupported(self) -> str | None:
        """Why the Triton decode kernel cannot read this format (naming the setting), or None."""
        for path in ("content", "rope"):
            why = self.path(path).kernel_unsupported(self.dim(path))
            if why is not None:
                return f"quant.{path}.{why}"
        return None

    def cpu_kernel_unsupported(self) -> str | None:
        """Why the C++ CPU decode kernel cannot read this format (naming the setting), or None: what the Triton
        kernel cannot read, and a RoPE key of several widths (format=pairs)."""
        why = self.kernel_unsupported()
        if why is None and self.rope.format == "pairs":
            why = "quant.rope.format=pairs"
        return why

    def step_backends(self, device_type: str) -> dict[str, str]:
        """Which backend runs each step type (STEP_TYPES) on a device of `device_type` ("cpu", "cuda"): prefill
        and multi-token steps always in PyTorch; decode steps through the Triton kernel with backend=triton, the C++
        kernel with backend=cpu, and with backend=auto the Triton kernel on a CUDA device and the C++ kernel on the
        CPU where the kernel reads the format (and the C++ one builds here: `cpu_kernel_usable`)."""
        if self.backend == "triton" or (self.backend == "auto" and device_type == "cuda"
                                        and self.kernel_unsupported() is None):
            decode = "triton"
        elif self.backend == "cpu" or (self.backend == "auto" and device_type == "cpu"
                                       and self.cpu_kernel_unsupported() is None and cpu_kernel_usable()):
            decode = "cpu"
        else:
            decode = "torch"
        return {"prefill": "torch", "decode": decode}


@functools.lru_cache(maxsize=None)
def cpu_kernel_usable() -> bool:
    """True when the C++ decode kernel builds and loads here (built on the first call); otherwise a warning says why
    once, and backend=auto decodes in PyTorch on the CPU."""
    from mla_quant.kernels.cpu_decode import cpu_kernel_unavailable

    why = cpu_kernel_unavailable()
    if why is not None:
        warnings.warn(f"the C++ CPU decode kernel is unavailable ({why}); quant.backend=auto decodes CPU tensors in "
                      f"PyTorch", stacklevel=2)
    return why is None


TOP_KEYS = ("name", "mode", "backend", "protected", "content", "rope", "shared_scale", "block_size", "layers")
MIXED_KEYS = ("budget", "choices", "allocation")  # quant=mixed: allocated per layer by the preparation step
LAYER_KEYS = ("content", "rope")  # what one entry of quant.layers may change
COMMON = ("mode", "backend", "n_sink", "recent", "block_size", "d_c", "d_r")  # one value for every layer


@dataclass(frozen=True)
class LayeredFormat:
    """A cache format per cache layer (`quant.layers`, or the allocation of `quant=mixed`): each layer its own
    validated `CacheFormat`, with the protected region, mode, backend and block size common to all. Duck-types
    what stages read of a `CacheFormat` that holds for every layer (name, quantized, mode, backend, step_backends,
    kernel_unsupported); what differs per layer is read per layer (`layer(i)`), and a stage that reads one format
    for the whole model refuses it by name (`refuse_layered`)."""

    name: str
    layers: tuple[CacheFormat, ...]
    source: str = "quant.layers"  # where the per-layer formats came from (an allocation file for quant=mixed)

    def __post_init__(self):
        if not self.layers:
            raise ValueError(f"quant={self.name}: quant.layers is empty; allowed: one entry per cache layer")
        for key in COMMON:
            values = {getattr(f, key) for f in self.layers}
            if len(values) > 1:
                raise ValueError(f"quant={self.name}: {key} differs between layers ({sorted(values)}); it is "
                                 f"common to all layers")

    def __len__(self) -> int:
        return len(self.layers)

    def layer(self, idx: int) -> CacheFormat:
        return self.layers[idx]

    def __getattr__(self, key):  # the settings common to all layers
        if key in COMMON:
            return getattr(self.layers[0], key)
        raise AttributeError(f"{type(self).__name__} has no {key!r}: it differs per layer (use .layer(i))")

    @property
    def quantized(self) -> bool:
        return any(f.quantized for f in self.layers)

    @property
    def token_block(self) -> int | None:
        blocks = {f.token_block for f in self.layers} - {None}
        return blocks.pop() if len(blocks) == 1 else None

    def kernel_unsupported(self) -> str | None:
        return self._first_refusal("kernel_unsupported")

    def cpu_kernel_unsupported(self) -> str | None:
        return self._first_refusal("cpu_kernel_unsupported")

    def _first_refusal(self, check: str) -> str | None:
        """The first layer's reason from its `check` method (naming the layer), or None when every layer passes."""
        for i, f in enumerate(self.layers):
            why = getattr(f, check)()
            if why is not None:
                return f"layers[{i}]: {why}"
        return None

    def step_backends(self, device_type: str) -> dict[str, str]:
        per_layer = [f.step_backends(device_type) for f in self.layers]
        return {step: "+".join(sorted({b[step] for b in per_layer})) for step in STEP_TYPES}

    def bytes_per_token(self, act_bytes: int = 2) -> list[float]:
        """Per layer: bytes one token takes in the quantized region (both paths; unquantized ones at `act_bytes`)."""
        return [f.content.bytes_per_token(f.d_c, act_bytes) + f.rope.bytes_per_token(f.d_r, act_bytes)
                for f in self.layers]

    def describe(self) -> list[dict[str, str]]:
        return [{"content": f.content.describe(), "rope": f.rope.describe()} for f in self.layers]


def refuse_layered(fmt, what: str) -> None:
    """Where `what` reads one cache format for the whole model, a per-layer format is refused by name."""
    if isinstance(fmt, LayeredFormat):
        raise ValueError(f"quant={fmt.name} gives each cache layer its own format ({fmt.source}): {what} reads one "
                         f"format for the whole model; use a uniform option (e.g. int2_content_int4_rope)")


def layered_format(cfg: dict, layers, d_c: int, d_r: int, context: int | None, num_layers: int | None,
                   source: str = "quant.layers", rope_layout: str = "half") -> LayeredFormat:
    """`quant.layers`: a list with one entry per cache layer, each null (the option's own paths) or a mapping of
    `content` / `rope` blocks whose keys replace those of the option's blocks for that layer."""
    name = cfg.get("name", "?")
    if not isinstance(layers, (list, tuple)):
        raise ValueError(f"quant.layers={layers!r}; allowed: null or a list with one entry per cache layer")
    if num_layers is not None and len(layers) != num_layers:
        raise ValueError(f"quant.layers has {len(layers)} entries; the model has {num_layers} cache layers: allowed "
                         f"one entry per layer (null keeps the option's format)")
    formats = []
    for i, entry in enumerate(layers):
        entry = {} if entry is None else _plain(entry)
        _check_keys(entry, LAYER_KEYS, f"quant.layers[{i}]")
        merged = dict(cfg)
        for path in LAYER_KEYS:
            if entry.get(path) is not None:
                merged[path] = {**_plain(cfg.get(path, {})), **_plain(entry[path])}
        try:
            formats.append(cache_format({**merged, "name": f"{name}/layer{i}"}, d_c, d_r, context,
                                        rope_layout=rope_layout))
        except ValueError as err:
            raise ValueError(f"quant.layers[{i}]: {err}") from err
    return LayeredFormat(name, tuple(formats), source)


def _nonneg_int(value, where: str, least: int = 0) -> int:
    return int_setting(value, where, least)


def cache_format(quant_cfg, d_c: int, d_r: int, context: int | None = None, num_layers: int | None = None,
                 rope_layout: str = "half") -> CacheFormat:
    """Build and validate the format of a `quant` config for a model with latent dims (d_c, d_r).

    With `context` (the longest sequence the run will hold), a quantized format whose protected region covers the
    whole context is refused: nothing would ever be quantized. A backend that cannot read the format is refused.
    A config with a `peer` block is a peer option: its `PeerFormat` (mla_quant/quant/peers.py). A `layers` list
    gives each cache layer its own paths: a `LayeredFormat` (its length checked against `num_layers` when given).
    `rope_layout`: the model's RoPE pair layout (`half` | `interleaved`), which a RoPE key with bits per group of
    pairs (format=pairs) groups by.
    """
    cfg = _plain(quant_cfg)
    from mla_quant.quant.peers import is_peer, peer_format

    if is_peer(cfg):  # transformers' own QuantizedCache over the latent (conf/quant/hf_*.yaml)
        return peer_format(cfg, d_c, d_r)
    mixed = [k for k in MIXED_KEYS if k in cfg]
    if mixed:
        raise ValueError(f"quant={cfg.get('name', '?')} ({mixed}) allocates bits per layer from the model's "
                         f"sensitivity when a stage prepares the model; here one fixed format is read: use a "
                         f"uniform option, or the allocation's layers (quant.layers)")
    _check_keys(cfg, TOP_KEYS, "quant")
    if cfg.get("layers") is not None:
        return layered_format({k: v for k, v in cfg.items() if k != "layers"}, cfg["layers"], d_c, d_r, context,
                              num_layers, rope_layout=rope_layout)
    cfg.pop("layers", None)
    mode, backend = cfg.get("mode", "simulated"), cfg.get("backend", "auto")
    if mode not in MODES:
        raise ValueError(f"quant.mode={mode!r} is unknown; allowed: {list(MODES)}")
    if backend not in BACKENDS:
        raise ValueError(f"quant.backend={backend!r} is unknown; allowed: {list(BACKENDS)}")
    protected = _plain(cfg.get("protected", {}))
    _check_keys(protected, ("n_sink", "recent"), "quant.protected")
    n_sink = _nonneg_int(protected.get("n_sink", 4), "quant.protected.n_sink")
    recent = _nonneg_int(protected.get("recent", 128), "quant.protected.recent")
    block_size = _nonneg_int(cfg.get("block_size", 64), "quant.block_size", least=1)
    content_bits = _plain(cfg.get("content") or {}).get("bits")
    if isinstance(content_bits, (list, tuple)) or _plain(cfg.get("content") or {}).get("format") == "pairs":
        raise ValueError(f"quant.content.bits={content_bits}: widths per group of RoPE frequency pairs apply to the "
                         f"RoPE key; the content latent takes one width (an integer)")
    content = PathFormat.from_cfg(cfg.get("content", {}), "quant.content")
    rope = PathFormat.from_cfg(cfg.get("rope", {}), "quant.rope")
    if rope.format == "pairs":
        if rope_layout not in PAIR_LAYOUTS:
            raise ValueError(f"RoPE pair layout {rope_layout!r}; allowed: {list(PAIR_LAYOUTS)}")
        import dataclasses

        rope = dataclasses.replace(rope, pair_layout=rope_layout)
    content.check(d_c, "quant.content")
    rope.check(d_r, "quant.rope")
    if context is not None and (content.quantized or rope.quantized) and n_sink + recent >= context:
        raise ValueError(
            f"quant.protected: n_sink + recent = {n_sink} + {recent} = {n_sink + recent} covers the whole context of "
            f"{context} tokens, so nothing would be quantized; allowed: n_sink + recent < {context} "
            "(lower quant.protected.recent or use longer sequences)"
        )
    shared = bool(cfg.get("shared_scale", False))
    if shared and not (content.tensor_scaled and rope.tensor_scaled):
        raise ValueError(
            "quant.shared_scale=true needs both paths in format=fp8 with granularity=tensor (vLLM's flat FP8 "
            f"layout); got content {content.describe()!r}, rope {rope.describe()!r}"
        )
    if content.blocked and rope.blocked and content.blocked != rope.blocked:
        raise ValueError(f"quant.content.token_block={content.blocked} and quant.rope.token_block={rope.blocked}: "
                         "both paths wait for the same blocks of tokens; allowed: the same token_block on both")
    fmt = CacheFormat(cfg.get("name", "?"), mode, backend, n_sink, recent, block_size, content, rope, shared, d_c, d_r)
    reads = {"triton": (fmt.kernel_unsupported, f"bf16 paths, int with bits {list(TRITON_INT_BITS)}, or widths per "
                                                "group of RoPE pairs"),
             "cpu": (fmt.cpu_kernel_unsupported, f"bf16 paths or int with bits {list(TRITON_INT_BITS)}, one width "
                                                 "per path")}
    if backend in reads:
        why = reads[backend][0]()
        if why is not None:
            raise ValueError(f"quant={fmt.name}: {why}: quant.backend={backend} cannot read it (it reads "
                             f"{reads[backend][1]}); use quant.backend=torch for this format")
    return fmt


def cache_bytes_per_token(fmt: CacheFormat, d_c: int, d_r: int, context: int, batch: int = 1,
                          act_bytes: int = 2) -> float:
    """Formula: bytes per token per layer of a cache holding `context` tokens per sequence for `batch` sequences,
    protected region (n_sink + recent tokens, in the activation dtype), per-sequence tensor scales and the layer's
    codebooks (lloyd: shared by the batch) included. With a token block (channel_block), the tokens past the last
    whole block wait in the activation dtype too."""
    if context <= 0:
        raise ValueError(f"context={context}: need at least one token")
    if not fmt.quantized:
        return float((d_c + d_r) * act_bytes)
    protected = min(context, fmt.n_sink + fmt.recent)
    if fmt.token_block:
        protected += (context - protected) % fmt.token_block  # the pending tokens of a block not yet full
    per_quantized = fmt.content.bytes_per_token(d_c, act_bytes) + fmt.rope.bytes_per_token(d_r, act_bytes)
    per_sequence = protected * (d_c + d_r) * act_bytes + (context - protected) * per_quantized
    return (per_sequence + fmt.tensor_scale_bytes() + fmt.codebook_bytes() / batch) / context


# ---------------------------------------------------------------------------------------------- helpers
def encode_path(fmt: PathFormat, x: torch.Tensor, tensor_scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """x (..., d) -> the stored tensors of this path (see the codec)."""
    return fmt.encode(x, tensor_scale)


def decode_path(fmt: PathFormat, parts: Mapping[str, torch.Tensor], d: int, dtype: torch.dtype,
                tensor_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The stored tensors of `encode_path` -> x_hat (..., d) in `dtype`."""
    return fmt.decode(parts, d, dtype, tensor_scale)


def fake_quantizer(path_cfg, d: int, path: str = "<path>") -> Callable[[torch.Tensor], torch.Tensor]:
    """x (..., d) -> x as the cache would store and read it back in the format `path_cfg` (one `quant.<path>`
    block), same dtype. Validated against d first. Per-tensor fp8 takes the amax of the x it is given; bf16 is the
    identity; channel_block quantizes whole blocks of tokens along dim -2 from its first token and keeps the tokens
    of a last, partial block exact (a cache with no protected region)."""
    fmt = path_cfg if isinstance(path_cfg, PathFormat) else PathFormat.from_cfg(path_cfg, f"quant.{path}")
    fmt.check(d, f"quant.{path}")

    def quantize(x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != d:
            raise ValueError(f"quant.{path}: validated for dimension {d}, got x of shape {tuple(x.shape)}")
        scale = tensor_scale_for(x).expand(x.shape[:-1]) if fmt.tensor_scaled else None
        return fmt.codec.fake_quantize(fmt, x, scale, f"quant.{path} ({fmt.describe()})")

    return quantize


def tensor_scale_for(*xs: torch.Tensor) -> torch.Tensor:
    """A per-tensor fp8 scale: joint amax of the given tensors / 448 (float32, 0-d; 1.0 if all zero)."""
    amax = torch.stack([x.detach().float().abs().amax() for x in xs]).amax()
    s = amax / quantizers.FP8_MAX
    return torch.where(s > 0, s, torch.ones_like(s))
