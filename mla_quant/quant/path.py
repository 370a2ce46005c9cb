"""`PathFormat`: how one path (content latent or RoPE key) is stored, the keys of `quant.content` / `quant.rope`,
validated before any model work; the helpers that store and read back one path."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields

import torch

from mla_quant.quant import quantizers
from mla_quant.quant.codecs import CODECS, Codec
from mla_quant.quant.codecs.base import CODEBOOK_LEVEL_BYTES, _levels_tensor

DERIVED_KEYS = ("pair_layout", "levels")  # PathFormat fields set from the model (or fitted on it), never from a config


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
    quantizer: str = quantizers.DEFAULT_QUANTIZER  # format=int: how each group's codes are chosen (quantizers.QUANTIZERS)
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
        if d is not None:
            self.codec.check_dim(self, d, where)
        if (d is not None and self.quantized and self.granularity == "group" and self.group_size is not None
                and not self.codec.partial_groups):
            if d % self.group_size:
                divisors = [g for g in range(1, d + 1) if d % g == 0]
                raise ValueError(
                    f"{where}.group_size={self.group_size} does not divide the path dimension {d}; "
                    f"allowed: null (whole vector) or one of {divisors}"
                )

    def recoded(self, codec: str, d: int, where: str = "quant.content") -> "PathFormat":
        """This integer path stored in `codec` (one of CONTENT_CODECS, e.g. TurboQuant's codebook) at its bit width and
        scale dtype, checked against its dimension `d`."""
        if not self.integer_groups:
            raise ValueError(f"transform.content.codec={codec} re-encodes an integer content path at its bit width; "
                             f"{where} is format={self.format}")
        out = PathFormat(format=codec, bits=self.bits, group_size=None, scale_dtype=self.scale_dtype)
        out.check(d, where)
        return out

    def to_cfg(self) -> dict:
        """The config block this format parses from (`from_cfg`): its config keys, without what the model sets or
        the preparation step fits (DERIVED_KEYS)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in DERIVED_KEYS}
        return {**out, "bits": list(out["bits"]) if isinstance(out["bits"], tuple) else out["bits"]}

    @property
    def quantized(self) -> bool:
        return self.codec.quantized

    @property
    def fitted_levels(self) -> bool:
        """Its codes index levels fitted on calibration latents (quantizer=lloyd: a codebook per layer and path)."""
        return self.quantizer in quantizers.FITTED

    @property
    def searched(self) -> bool:
        """Its codes are chosen by a search over ranges or levels (clip, lloyd), not rounded in closed form."""
        return self.quantizer in quantizers.SEARCHED

    @property
    def integer_groups(self) -> bool:
        """Integer codes per group of each token's values, on a uniform grid or a codebook (format=int)."""
        return self.codec.integer_groups and self.granularity == "group"

    @property
    def whole_page(self) -> bool:
        """The kernel reads this path's page as a whole (parts of several widths: format=pairs)."""
        return self.codec.whole_page

    def store_kernel_unsupported(self) -> str | None:
        """Why the Triton store kernel cannot encode this path (naming the setting), or None (bf16: nothing to
        encode; its values are stored as they are)."""
        return self.codec.store_unsupported(self)

    def codebook(self, required: bool = False, device: torch.device | str = "cpu") -> torch.Tensor | None:
        """quantizer=lloyd: the levels as a float32 tensor on `device` (None for other quantizers). required=True: a
        lloyd path without fitted levels is refused (the cache stores codes against one fixed codebook)."""
        if not self.fitted_levels:
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
        return CODEBOOK_LEVEL_BYTES * 2**self.bits if self.fitted_levels else 0

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

    def kernel_tensors(self, d: int, device) -> dict[str, torch.Tensor]:
        return self.codec.kernel_tensors(self, d, device)

    @property
    def quantizer_label(self) -> str:
        """" <quantizer>" where the codes are chosen otherwise than the default's min/max range, else ""."""
        return "" if self.quantizer == quantizers.DEFAULT_QUANTIZER else f" {self.quantizer}"

    def label(self) -> str:
        return self.codec.label(self)

    def describe(self) -> str:
        return self.codec.describe(self)


def path_label(block) -> str:
    """A quant config's path block (as a run's record holds it) in a few characters, for tables: bf16, fp8, int4 g32,
    int2 tok lloyd; a block this version cannot read shows its format's name."""
    try:
        return PathFormat.from_cfg(block).label()
    except (TypeError, ValueError):
        return str(_plain(block).get("format"))


def quantizer_label(block) -> str:
    """" <quantizer>" of a quant config's path block, "" for the default (`PathFormat.quantizer_label`)."""
    quantizer = _plain(block).get("quantizer") or quantizers.DEFAULT_QUANTIZER
    return PathFormat(quantizer=quantizer).quantizer_label


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
