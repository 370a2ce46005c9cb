"""Cache formats: what one path (content latent c, RoPE key k) is stored as, validated against its dimension.

`PathFormat` mirrors one path block of `conf/quant/*.yaml` (`quant.content`, `quant.rope`); `CacheFormat` the whole
`quant` group. Both are built and validated from the config BEFORE any model work, so a bad value fails at once
with the value and the allowed ones in the message. They also give the byte formulas the byte table checks
against measured storage, and `encode_path` / `decode_path`, the per-path codec the quantized cache stores.

    fmt = cache_format(cfg.quant, d_c=512, d_r=64)        # raises ValueError on bad bits / group sizes
    fmt.content.bytes_per_token(512)                       # 272 for INT4, group 128, fp16 scale + zero
    cache_bytes_per_token(fmt, 512, 64, context=131072)    # includes the BF16 protected region
    fq = fake_quantizer(cfg.quant.content, d=512, path="content")   # x -> stored-and-read-back x (noise studies)

Path formats (`format`):
    bf16  kept unquantized, in the activation dtype (BF16 on real models; the formulas count 2 B/value)
    int   `bits` in {2,3,4,8}, per-token groups of `group_size` (null = whole vector), symmetric or scale + zero,
          codes packed (packing.py), scales/zeros in `scale_dtype` (fp16 | bf16 | fp32 | pow2 = int8 exponent)
    fp8   e4m3 (torch.float8_e4m3fn), bits 8; granularity "group": one scale per group_size values
          (null = per token, 128 = FlashMLA tiles), or "tensor": one float32 scale for the whole layer,
          the amax/448 of the first append (see cache.py), optionally shared by both paths (`shared_scale`)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields

import torch

from mla_quant.quant import packing, quantizers

FORMATS = ("bf16", "int", "fp8")
GRANULARITIES = ("group", "tensor")
MODES = ("simulated", "serving")
BACKENDS = ("torch", "triton")
SCALE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4, "pow2": 1}
ZERO_BYTES = {name: torch.empty(0, dtype=dt).element_size() for name, dt in quantizers.ZERO_DTYPES.items()}
TENSOR_SCALE_BYTES = 4  # one float32 per tensor-granularity path (or one shared by both paths), per layer


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

    @classmethod
    def from_cfg(cls, cfg, where: str = "quant.<path>") -> "PathFormat":
        cfg = _plain(cfg)
        _check_keys(cfg, [f.name for f in fields(cls)], where)
        # A low bit width on a bf16 path means an integer format: `quant.content.bits=3` works from quant=bf16.
        if cfg.get("format", "bf16") == "bf16" and cfg.get("bits", 16) not in (16, None):
            cfg = {**cfg, "format": "int"}
        fmt = cls(**cfg)
        fmt.check(where=where)
        return fmt

    def check(self, d: int | None = None, where: str = "quant.<path>") -> None:
        """Raise ValueError on a value this path cannot take (d: the path's dimension, d_c or d_r)."""
        if self.format not in FORMATS:
            raise ValueError(f"{where}.format={self.format!r} is unknown; allowed: {list(FORMATS)}")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"{where}.granularity={self.granularity!r} is unknown; allowed: {list(GRANULARITIES)}")
        if self.format == "bf16" and self.bits != 16:
            raise ValueError(
                f"{where}.bits={self.bits!r} but {where}.format=bf16 stores 16 bits; "
                f"set {where}.format=int for bits in {list(quantizers.INT_BITS)} (or fp8 for bits 8)"
            )
        if self.format == "int":
            if self.bits not in quantizers.INT_BITS:
                raise ValueError(f"{where}.bits={self.bits!r} is not an integer cache width; "
                                 f"allowed with format=int: {list(quantizers.INT_BITS)}")
            if self.granularity != "group":
                raise ValueError(f"{where}.granularity={self.granularity!r}: format=int takes only 'group'")
        if self.format == "fp8" and self.bits != 8:
            raise ValueError(f"{where}.bits={self.bits!r} but format=fp8 (e4m3) stores 8 bits; allowed: [8]")
        if self.format != "bf16":
            quantizers.check_scale_dtype(self.scale_dtype)
        if self.group_size is not None and (
            isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size <= 0
        ):
            raise ValueError(f"{where}.group_size={self.group_size!r}; allowed: null or a positive integer")
        if d is not None and self.quantized and self.granularity == "group" and self.group_size is not None:
            if d % self.group_size:
                divisors = [g for g in range(1, d + 1) if d % g == 0]
                raise ValueError(
                    f"{where}.group_size={self.group_size} does not divide the path dimension {d}; "
                    f"allowed: null (whole vector) or one of {divisors}"
                )

    # ------------------------------------------------------------------ shape and bytes
    @property
    def quantized(self) -> bool:
        return self.format != "bf16"

    def n_groups(self, d: int) -> int:
        """Scales (and zeros) per token; 0 for bf16 and per-tensor fp8."""
        if not self.quantized or self.granularity == "tensor":
            return 0
        return quantizers.n_groups(d, self.group_size)

    def bytes_per_token(self, d: int, act_bytes: int = 2) -> float:
        """Bytes one token of this path takes in the quantized region (codes + scales + zeros), from the format."""
        if self.format == "bf16":
            return d * act_bytes
        if self.format == "fp8":
            return d + self.n_groups(d) * SCALE_BYTES[self.scale_dtype]
        zeros = 0 if self.symmetric else ZERO_BYTES[self.scale_dtype]
        return packing.packed_dim(d, self.bits) + self.n_groups(d) * (SCALE_BYTES[self.scale_dtype] + zeros)

    def describe(self) -> str:
        if self.format == "bf16":
            return "bf16"
        if self.format == "fp8" and self.granularity == "tensor":
            return "fp8 e4m3, per-tensor fp32 scale"
        group = "per-token" if self.group_size is None else f"g={self.group_size}"
        kind = "sym" if self.symmetric or self.format == "fp8" else "asym"
        return f"{self.format}{self.bits if self.format == 'int' else ''} {group} {kind} {self.scale_dtype}"


@dataclass(frozen=True)
class CacheFormat:
    """The whole `quant` group, validated against (d_c, d_r)."""

    name: str
    mode: str
    backend: str
    n_sink: int
    recent: int
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

    def tensor_scale_bytes(self) -> int:
        """Per-layer constant bytes: float32 per-tensor fp8 scales (one if shared)."""
        n = sum(p.format == "fp8" and p.granularity == "tensor" for p in (self.content, self.rope))
        return TENSOR_SCALE_BYTES * (min(n, 1) if self.shared_scale else n)


TOP_KEYS = ("name", "mode", "backend", "protected", "content", "rope", "shared_scale")


def cache_format(quant_cfg, d_c: int, d_r: int, context: int | None = None) -> CacheFormat:
    """Build and validate the format of a `quant` config for a model with latent dims (d_c, d_r).

    With `context` (the longest sequence the run will hold), a quantized format whose protected region covers the
    whole context is refused: nothing would ever be quantized.
    """
    cfg = _plain(quant_cfg)
    _check_keys(cfg, TOP_KEYS, "quant")
    mode, backend = cfg.get("mode", "simulated"), cfg.get("backend", "torch")
    if mode not in MODES:
        raise ValueError(f"quant.mode={mode!r} is unknown; allowed: {list(MODES)}")
    if backend not in BACKENDS:
        raise ValueError(f"quant.backend={backend!r} is unknown; allowed: {list(BACKENDS)}")
    protected = _plain(cfg.get("protected", {}))
    _check_keys(protected, ("n_sink", "recent"), "quant.protected")
    n_sink, recent = protected.get("n_sink", 4), protected.get("recent", 128)
    for key, value in (("n_sink", n_sink), ("recent", recent)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"quant.protected.{key}={value!r}; allowed: an integer >= 0")
    content = PathFormat.from_cfg(cfg.get("content", {}), "quant.content")
    rope = PathFormat.from_cfg(cfg.get("rope", {}), "quant.rope")
    content.check(d_c, "quant.content")
    rope.check(d_r, "quant.rope")
    if context is not None and (content.quantized or rope.quantized) and n_sink + recent >= context:
        raise ValueError(
            f"quant.protected: n_sink + recent = {n_sink} + {recent} = {n_sink + recent} covers the whole context of "
            f"{context} tokens, so nothing would be quantized; allowed: n_sink + recent < {context} "
            "(lower quant.protected.recent or use longer sequences)"
        )
    shared = bool(cfg.get("shared_scale", False))
    if shared and not all(p.format == "fp8" and p.granularity == "tensor" for p in (content, rope)):
        raise ValueError(
            "quant.shared_scale=true needs both paths in format=fp8 with granularity=tensor (vLLM's flat FP8 "
            f"layout); got content {content.describe()!r}, rope {rope.describe()!r}"
        )
    return CacheFormat(cfg.get("name", "?"), mode, backend, n_sink, recent, content, rope, shared, d_c, d_r)


def cache_bytes_per_token(fmt: CacheFormat, d_c: int, d_r: int, context: int, batch: int = 1,
                          act_bytes: int = 2) -> float:
    """Formula: bytes per token per layer of a cache holding `context` tokens (per sequence), protected region
    (n_sink + recent tokens, in the activation dtype) and per-tensor scales included."""
    if context <= 0:
        raise ValueError(f"context={context}: need at least one token")
    if not fmt.quantized:
        return float((d_c + d_r) * act_bytes)
    protected = min(context, fmt.n_sink + fmt.recent)
    per_quantized = fmt.content.bytes_per_token(d_c, act_bytes) + fmt.rope.bytes_per_token(d_r, act_bytes)
    total = batch * (protected * (d_c + d_r) * act_bytes + (context - protected) * per_quantized)
    total += fmt.tensor_scale_bytes()  # set at the first append, held from then on
    return total / (batch * context)


# ---------------------------------------------------------------------------------------------- per-path codec
def encode_path(fmt: PathFormat, x: torch.Tensor, tensor_scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """x (B, L, d) -> the stored tensors of this path for L tokens, each (B, L, *):
    bf16: values (B, L, d) act dtype | int: codes (B, L, packed_dim) uint8, scales (B, L, G), zeros (B, L, G)
    fp8: codes (B, L, d) uint8 (e4m3 bits), scales (B, L, G) (absent for per-tensor: `tensor_scale`, 0-d fp32)."""
    if fmt.format == "bf16":
        return {"values": x}
    if fmt.format == "int":
        codes, scales, zeros = quantizers.group_quantize(x, fmt.bits, fmt.group_size, fmt.symmetric, fmt.scale_dtype)
        parts = {"codes": packing.pack(codes, fmt.bits, check=False), "scales": scales}
        if zeros is not None:
            parts["zeros"] = zeros
        return parts
    if fmt.granularity == "tensor":
        codes, _, _ = quantizers.fp8_quantize(x, per_tensor=True, scale=tensor_scale)
        return {"codes": codes.view(torch.uint8)}
    codes, scales, _ = quantizers.fp8_quantize(x, fmt.group_size, scale_dtype=fmt.scale_dtype)
    return {"codes": codes.view(torch.uint8), "scales": scales}


def decode_path(fmt: PathFormat, parts: Mapping[str, torch.Tensor], d: int, dtype: torch.dtype,
                tensor_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The stored tensors of `encode_path` -> x_hat (B, L, d) in `dtype`."""
    if fmt.format == "bf16":
        return parts["values"].to(dtype)
    if fmt.format == "int":
        codes = packing.unpack(parts["codes"], fmt.bits, d)
        return quantizers.group_dequantize(codes, parts["scales"], parts.get("zeros"), fmt.bits, dtype)
    scales = tensor_scale if fmt.granularity == "tensor" else parts["scales"]
    return quantizers.fp8_dequantize(parts["codes"], scales, dtype)


def fake_quantizer(path_cfg, d: int, path: str = "<path>") -> Callable[[torch.Tensor], torch.Tensor]:
    """x (..., d) -> x as the cache would store and read it back in the format `path_cfg` (one `quant.<path>`
    block), same dtype. Validated against d first. Per-tensor fp8 takes the amax of the x it is given; bf16 is the
    identity."""
    fmt = path_cfg if isinstance(path_cfg, PathFormat) else PathFormat.from_cfg(path_cfg, f"quant.{path}")
    fmt.check(d, f"quant.{path}")

    def quantize(x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != d:
            raise ValueError(f"quant.{path}: validated for dimension {d}, got x of shape {tuple(x.shape)}")
        scale = tensor_scale_for(x) if fmt.format == "fp8" and fmt.granularity == "tensor" else None
        return decode_path(fmt, encode_path(fmt, x, scale), d, x.dtype, scale)

    return quantize


def tensor_scale_for(*xs: torch.Tensor) -> torch.Tensor:
    """A per-tensor fp8 scale: joint amax of the given tensors / 448 (float32, 0-d; 1.0 if all zero)."""
    amax = torch.stack([x.detach().float().abs().amax() for x in xs]).amax()
    s = amax / quantizers.FP8_MAX
    return torch.where(s > 0, s, torch.ones_like(s))
