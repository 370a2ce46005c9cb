"""The registry of codecs, one module each: `CODECS[name]` is how a path with `format: <name>` is stored.
Adding a format = a `Codec` subclass decorated with `register` in a module of its own here, imported below (the
imports fill the registry, in the order formats are listed)."""

from __future__ import annotations

# isort: off
from mla_quant.quant.codecs.base import CODECS, Codec, check_finite, register
from mla_quant.quant.codecs.values import ValuesCodec
from mla_quant.quant.codecs.integer import IntCodec
from mla_quant.quant.codecs.fp8 import Fp8Codec
from mla_quant.quant.codecs.codebook import CodebookCodec
from mla_quant.quant.codecs.channel_block import ChannelBlockCodec
from mla_quant.quant.codecs.pairs import PAIR_LAYOUTS, PairsCodec, pair_channels
from mla_quant.quant.codecs.nvfp4 import Nvfp4Codec
# isort: on

FORMATS = tuple(CODECS)

__all__ = ["CODECS", "FORMATS", "PAIR_LAYOUTS", "ChannelBlockCodec", "Codec", "CodebookCodec", "Fp8Codec", "IntCodec",
           "Nvfp4Codec", "PairsCodec", "ValuesCodec", "check_finite", "pair_channels", "register"]
