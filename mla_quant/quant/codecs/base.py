"""The codec interface: how one path of the cache is stored (encode, decode, bytes, what the kernels read), and
the byte sizes and dtype codes every codec shares. The registry is `mla_quant.quant.codecs.CODECS`."""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch

from mla_quant.kernels.layout import CODE_BITS, SCALE_DTYPES, WORD_BITS, ZERO_DTYPES
from mla_quant.quant import quantizers

GRANULARITIES = ("group", "tensor")
SCALE_BYTES = {name: torch.empty(0, dtype=dt).element_size() for name, dt in SCALE_DTYPES.items()}  # pow2: 1
ZERO_BYTES = {name: torch.empty(0, dtype=dt).element_size() for name, dt in ZERO_DTYPES.items()}
TRITON_INT_BITS = WORD_BITS  # what the decode kernel unpacks: the int32 word layout (kernels/layout.py)
CODEBOOK_LEVEL_BYTES = 4  # quantizer=lloyd: each level of a layer's codebook is one float32


CODECS: dict[str, Codec] = {}  # the registry: format name -> codec (filled by `register`, see codecs/__init__.py)


def register(cls: type[Codec]) -> type[Codec]:
    """Class decorator: one instance of the codec in `CODECS` under its name (a name is registered once)."""
    if cls.name in CODECS:
        raise ValueError(f"codec {cls.name!r} is registered twice ({type(CODECS[cls.name]).__name__}, {cls.__name__})")
    CODECS[cls.name] = cls()
    return cls


class Codec:
    """How one path is stored. Subclasses fill in the hooks; `PathFormat` delegates to its codec."""

    name = "?"
    widths: tuple[int, ...] = ()
    granularities: tuple[str, ...] = ("group",)
    token_blocks = False  # True: encode/decode take whole blocks of `token_block` tokens along dim -2
    quantized = True  # False: the values kept as they are (bf16)
    integer_groups = False  # True: integer codes per group of each token's values (the objectives' closed-form STE)
    whole_page = False  # True: parts of several widths, the kernel reads the whole page (pairs)
    partial_groups = False  # True: a dimension that group_size does not divide ends in one shorter group (mxfp8)
    recodes_content = False  # True: a transform may store an integer content path in it at its width
    # (transform.content.codec: TurboQuant's codebook after its rotation)

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

    def check_block_format(self, fmt: "PathFormat", where: str, block: int, scale_dtype: str, scales: str) -> None:
        """The refusals of a fixed block format (an engine's: nvfp4, mxfp8): one scale of `scale_dtype` (`scales`
        says what it is) per `block` values, signed codes with no zero point."""
        if fmt.group_size != block:
            raise ValueError(f"{where}.group_size={fmt.group_size!r}: format={self.name} scales every {block} values; "
                             f"allowed: {block}")
        if fmt.scale_dtype != scale_dtype:
            raise ValueError(f"{where}.scale_dtype={fmt.scale_dtype!r}: format={self.name} stores {scales}; allowed: "
                             f"{scale_dtype}")
        if not fmt.symmetric:
            raise ValueError(f"{where}.symmetric=false: format={self.name} codes are signed values with no zero "
                             "point; allowed: true")

    def check_dim(self, fmt: "PathFormat", d: int, where: str) -> None:
        """Checks against the path's dimension that the format adds (pairs, packing blocks); none by default."""

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

    def store_unsupported(self, fmt: "PathFormat") -> str | None:
        """Why the Triton store kernel cannot encode this format, or None if it can (or nothing is encoded)."""
        return f"format={self.name}"

    def kernel_spec(self, fmt: "PathFormat", d: int) -> dict:
        """The kernel's compile-time description of the stored tensors (see kernels/latent_decode.py)."""
        raise NotImplementedError

    def kernel_tensors(self, fmt: "PathFormat", d: int, device) -> dict[str, torch.Tensor]:
        """Constant tensors a kernel reads beside the pages (a stream's codebook `levels`, its `rotation`; `PagedPath`
        fields), on `device`; none by default."""
        return {}

    @staticmethod
    def byte_codes_spec(codes: str, group: int, scales_as: str | None = None, pow2: bool = False,
                        bits: int | None = None) -> dict:
        """`kernel_spec` of an engine format stored as byte codes (`PagedPath`, kernels/layout.py): e4m3 or e2m1 codes
        or a stream of `bits`-bit codebook indices, one scale per `group` values (none when the format stores none)
        of kind `scales_as`."""
        return dict(bits=CODE_BITS[codes][0] if bits is None else bits, group=group, symmetric=True, pow2=pow2,
                    codes=codes, scales_as=scales_as)

    def describe(self, fmt: "PathFormat") -> str:
        return self.name

    def label(self, fmt: "PathFormat") -> str:
        """The path in a few characters, for tables (bf16, fp8, int4 g32, int2 tok lloyd)."""
        return self.name

    uses_tensor_scale = staticmethod(lambda fmt: False)


def finite_checks(parts: Mapping[str, torch.Tensor], where: str) -> list[tuple[torch.Tensor, str]]:
    """Per floating part: (a device bool, True when it holds no inf or NaN; the error if not). One sum in float64
    (a NaN or inf anywhere makes it non-finite, and no sum of finite float32/16 values overflows it)."""
    checks = []
    for name, t in parts.items():
        if t.is_floating_point():
            dtype = str(t.dtype).replace("torch.", "")
            checks.append((torch.isfinite(t.sum(dtype=torch.float64)),
                           f"{where}: the stored {name} ({dtype}) overflow to inf/NaN (the latent holds values beyond "
                           f"the {dtype} range, or is itself not finite); use scale_dtype=fp32 for this path, or find "
                           f"where the model overflows"))
    return checks


def raise_unless_finite(checks: list[tuple[torch.Tensor, str]]) -> None:
    """Refuse, with the first failed check's error, unless every check of `finite_checks` holds: one host read."""
    if checks and not bool(torch.stack([flag for flag, _ in checks]).all()):
        raise ValueError(next(why for flag, why in checks if not bool(flag)))


def check_finite(parts: Mapping[str, torch.Tensor], where: str, on_device: bool = False) -> None:
    """Refuse stored scales/zeros/values that overflowed their dtype (inf or NaN would decode to inf silently).
    `on_device`: checked without reading on the host (`torch._assert_async`: a device-side error on a GPU, raised
    at once on the CPU), for the decode step's writes."""
    checks = finite_checks(parts, where)
    if on_device:
        for flag, why in checks:
            torch._assert_async(flag, why)
    else:
        raise_unless_finite(checks)


@functools.lru_cache(maxsize=256)
def _levels_tensor(levels: tuple[float, ...], device: str) -> torch.Tensor:
    """A codebook's levels as one float32 tensor per distinct codebook and device (read, never written), so a decode
    step does not copy them to its device again."""
    return torch.tensor(levels, dtype=torch.float32, device=device)
