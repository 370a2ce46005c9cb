"""format=channel_block: KIVI's key quantization, per channel over blocks of consecutive tokens of one sequence."""

from __future__ import annotations

import torch

from mla_quant.checks import int_setting
from mla_quant.quant import quantizers
from mla_quant.quant.codecs.base import SCALE_BYTES, ZERO_BYTES, Codec, register
from mla_quant.quant.codecs.integer import IntCodec
from mla_quant.quant.quantizers import Quantized, group_dequantize, group_quantize


@register
class ChannelBlockCodec(Codec):
    """KIVI's key quantization: asymmetric integer codes per channel over blocks of `token_block` consecutive tokens
    (`channel_block_quantize`), so an outlier channel gets its own step instead of widening every
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
        codes, scales, zeros = channel_block_quantize(x, fmt.bits, fmt.token_block, fmt.scale_dtype)
        return {"codes": IntCodec.pack_codes(fmt, codes), "scales": self._spread(fmt, scales),
                "zeros": self._spread(fmt, zeros)}

    def decode(self, fmt, parts, d, dtype, tensor_scale):
        codes = IntCodec.unpack_codes(fmt, parts["codes"], d)
        return channel_block_dequantize(codes, self._gather(fmt, parts["scales"], d),
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


def channel_block_quantize(x: torch.Tensor, bits: int, block: int, scale_dtype: str = "fp16") -> Quantized:
    """KIVI's key quantization: per channel over blocks of `block` consecutive tokens (asymmetric).
    x (..., T, d), T a multiple of block -> codes (..., T, d) uint8, scales and zeros (..., T / block, d): one scale
    and zero per channel and block, so a channel whose values are large everywhere (an outlier channel) gets its own
    step instead of widening every token's step."""
    t = x.shape[-2]
    if block < 1 or t % block:
        raise ValueError(f"channel_block_quantize: {t} tokens do not fill blocks of block={block}; allowed: a "
                         f"positive divisor of the token count")
    xb = x.reshape(*x.shape[:-2], t // block, block, x.shape[-1]).transpose(-1, -2)  # (..., nb, d, block)
    codes, scales, zeros = group_quantize(xb, bits, None, False, scale_dtype)  # one group: a channel's block
    codes = codes.transpose(-1, -2).reshape(x.shape)
    return Quantized(codes, scales[..., 0], zeros[..., 0])


def channel_block_dequantize(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
                             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes (..., T, d), scales/zeros (..., T / block, d) -> x_hat (..., T, d) in `dtype`."""
    nb, d = scales.shape[-2:]
    cb = codes.reshape(*codes.shape[:-2], nb, -1, d).transpose(-1, -2)  # (..., nb, d, block)
    x = group_dequantize(cb, scales[..., None], zeros[..., None], bits, dtype)
    return x.transpose(-1, -2).reshape(codes.shape)
