"""The registry of codecs, one module each: `CODECS[name]` is how a path with `format: <name>` is stored.
Adding a format = a module here holding a `Codec` subclass decorated with `register`: every module of this package
is imported below (in name order), which fills the registry; nothing else is edited."""

from __future__ import annotations

import importlib
import pkgutil

from mla_quant.quant.codecs.base import CODECS, Codec, check_finite, finite_checks, raise_unless_finite, register
from mla_quant.quant.codecs.pairs import PAIR_LAYOUTS, pair_channels

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")

FORMATS = tuple(CODECS)
CONTENT_CODECS = (None, *(n for n, c in CODECS.items() if c.recodes_content))  # transform.content.codec

__all__ = ["CODECS", "CONTENT_CODECS", "FORMATS", "PAIR_LAYOUTS", "Codec", "check_finite", "finite_checks",
           "pair_channels", "raise_unless_finite", "register"]
