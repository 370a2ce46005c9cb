"""The storage layout that the kernels read and write: integer codes as whole int32 words, chunked along channels,
and one page per block and path holding its codes, scales and zeros.

One spec for the encoder (mla_quant/quant/codecs/), the decode and store kernels and the byte accounting:

    layout = WordLayout(bits=4, d=512)      # P = 32 // bits codes per word, W = ceil(d / P) words per token
    words = layout.pack(codes)              # codes (..., d) uint8 < 2^bits -> (..., W) int32
    codes = layout.unpack(words)            # and back
    layout.row_bytes                        # 4 W: the bytes of one token's codes (256 at int4, d = 512)

Field k (bits [k b, (k + 1) b), LSB first) of word j holds the code of channel k W + j; fields of channels >= d are
0. So a tile of N tokens unpacks from one load of its (N, W) words with a broadcast shift and mask,
`(words[:, None, :] >> b k) & (2^b - 1)` for k < P, into (N, P, W) codes whose row-major flattening is channel
order: each field of a word is a contiguous run of W channels. No code is gathered per element, no interleave is
needed, and each run is a whole operand of a `tl.dot` against the matching W channels of the query. When the scale
group is a multiple of W (every release format at d_c = 512: W = 64 at int4, 32 at int2, 128 at int8), a run lies
inside one group, so its scale and zero are one value per token and run.

Widths: 2, 4 and 8 bits (16, 8 and 4 codes per word). Other widths (INT3) keep the LSB-first byte stream of
mla_quant/quant/packing.py and are not read by the kernels.

What a decode kernel reads (`PagedPath`, `Segment`) and the checks every one of them runs on its arguments before a
call (`check_inputs`: the Triton kernel, kernels/latent_decode.py, and the C++ CPU kernel, kernels/cpu_decode.py)
are defined here too.

The paged store keeps a block's stored tensors together: one page per block and path, its codes (or values), then
its scales, then its zeros (`PageLayout` below, docs/kernel.md "Page layout"); each is read as a view with a block
stride of one page.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

WORD_BITS = (2, 4, 8)
# A scale dtype's name -> the stored scales' dtype (pow2: an int8 power-of-two exponent) and the asymmetric zeros'
# (a value in the data's range, so a float type; pow2 keeps it in fp16): what the encoders and the kernels store.
SCALE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "pow2": torch.int8}
ZERO_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "pow2": torch.float16}
DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.int8: 3}  # the kernels' typed reads
POW2_CODE = DTYPE_CODES[SCALE_DTYPES["pow2"]]  # int8 scales are power-of-two exponents
# How a path's codes are stored (`PagedPath.codes`): int32 words (WordLayout; also float values), the engines'
# floating-point byte codes: e4m3 (one byte per value) and e2m1 (two per byte, the even value in the low nibble),
# or a stream: `bits`-bit indices into a codebook (`levels`) as one LSB-first bit stream per token
# (mla_quant/quant/packing.py; TurboQuant's 3- and 4-bit codes).
CODES = ("words", "e4m3", "e2m1", "stream")
CODE_BITS = {"e4m3": (8,), "e2m1": (4,), "stream": (3, 4)}  # what each byte-code kind is read at
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # an e2m1 code's magnitude by code & 7; code & 8 is the sign
# What a stored scale is (`scale_kind`): a float dtype, an int8 power-of-two exponent (pow2), an E8M0 byte
# (2^(s - 127)), e4m3 bits, or no scale at all.
SCALE_KINDS = ("float", "pow2", "e8m0", "e4m3", "none")


@dataclass(frozen=True)
class WordLayout:
    """Codes of one path of `d` values at `bits` bits as int32 words (see the module docstring)."""

    bits: int
    d: int

    def __post_init__(self):
        if self.bits not in WORD_BITS:
            raise ValueError(f"WordLayout bits={self.bits!r}; allowed: {list(WORD_BITS)}")
        if self.d < 1:
            raise ValueError(f"WordLayout d={self.d!r}; allowed: an integer >= 1")

    @property
    def per_word(self) -> int:
        """P: codes per int32 word."""
        return 32 // self.bits

    @property
    def words(self) -> int:
        """W: words per token, also the length of each channel run."""
        return -(-self.d // self.per_word)

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's codes."""
        return 4 * self.words

    def channels(self, device=None) -> torch.Tensor:
        """(P, W) int64: the channel each field of each word holds (>= d: padding, stored as 0)."""
        k = torch.arange(self.per_word, device=device)[:, None]
        return k * self.words + torch.arange(self.words, device=device)[None, :]

    def pack(self, codes: torch.Tensor) -> torch.Tensor:
        """codes (..., d) uint8 < 2^bits -> (..., W) int32."""
        if codes.shape[-1] != self.d:
            raise ValueError(f"WordLayout(bits={self.bits}, d={self.d}).pack: codes (..., {self.d}) expected, got "
                             f"{tuple(codes.shape)}")
        pad = self.per_word * self.words - self.d
        v = torch.cat([codes, codes.new_zeros(*codes.shape[:-1], pad)], -1) if pad else codes
        v = v.to(torch.int64).reshape(*codes.shape[:-1], self.per_word, self.words)  # (..., P, W): run k, word j
        shifts = (torch.arange(self.per_word, device=codes.device) * self.bits)[:, None]
        word = (v << shifts).sum(-2)  # (..., W): disjoint bit fields, so the sum is their OR (< 2^32)
        return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)

    def unpack(self, words: torch.Tensor) -> torch.Tensor:
        """(..., W) int32 -> codes (..., d) uint8."""
        return self._codes(words, "unpack").to(torch.uint8)

    def unpack_float(self, words: torch.Tensor) -> torch.Tensor:
        """`unpack` as float32 codes (what dequantization multiplies). On a little-endian machine from the words'
        bytes: byte m of word j holds fields m F .. m F + F - 1 (F = 8 // bits codes per byte), so each field of
        every word is one shift and mask of a uint8 tensor a quarter of the words' elements, written into its run
        of the float output once (~2x faster on the CPU than the int32 shifts of `unpack`)."""
        if sys.byteorder != "little":
            return self._codes(words, "unpack_float").float()
        self._check(words, "unpack_float")
        lead = words.shape[:-1]
        by = words.contiguous().view(torch.uint8).view(*lead, self.words, 4).transpose(-1, -2).contiguous()
        # out[..., m, f, j] = field m F + f of word j = channel (m F + f) W + j
        return self._fields(by).view(*lead, -1)[..., : self.d]

    def unpack_bytes(self, words: torch.Tensor) -> torch.Tensor:
        """The codes as float32 in byte order, (..., P W): position (f, j, m) (F = 8 // bits fields per byte, W words,
        4 bytes per word) holds field m F + f of word j, the code of channel (m F + f) W + j (`byte_channels`; padding
        fields 0). Each field is one shift and mask of the words' uint8 view, written contiguously, with no
        transpose: for a consumer that permutes its queries instead (one scale per token). Little-endian only."""
        if sys.byteorder != "little":
            raise RuntimeError("WordLayout.unpack_bytes reads int32 words as little-endian bytes")
        self._check(words, "unpack_bytes")
        by = words.contiguous().view(torch.uint8)  # (..., W * 4): byte m of word j at 4 j + m
        return self._fields(by).view(*words.shape[:-1], -1)

    def _fields(self, by: torch.Tensor) -> torch.Tensor:
        """Bytes (..., X) uint8 -> float32 (..., F, X): [..., f, x] = field f (bits [f b, (f + 1) b)) of byte x,
        one shift and mask per field written straight into the float output."""
        per_byte, mask = 8 // self.bits, (1 << self.bits) - 1
        out = torch.empty(*by.shape[:-1], per_byte, by.shape[-1], dtype=torch.float32, device=by.device)
        for f in range(per_byte):
            field = by if f == 0 else by >> (f * self.bits)
            out[..., f, :].copy_(field if f == per_byte - 1 else field & mask)  # the top field needs no mask
        return out

    def byte_channels(self, device=None) -> torch.Tensor:
        """(P W,) int64: the channel each position of `unpack_bytes` holds (>= d: padding)."""
        per_byte = 8 // self.bits
        f = torch.arange(per_byte, device=device)[:, None, None]
        j = torch.arange(self.words, device=device)[None, :, None]
        m = torch.arange(4, device=device)[None, None, :]
        return ((m * per_byte + f) * self.words + j).reshape(-1)

    def _check(self, words: torch.Tensor, caller: str) -> None:
        if words.dtype != torch.int32 or words.shape[-1] != self.words:
            raise ValueError(f"WordLayout(bits={self.bits}, d={self.d}).{caller}: int32 (..., {self.words}) "
                             f"expected, got {words.dtype} {tuple(words.shape)}")

    def _codes(self, words: torch.Tensor, caller: str) -> torch.Tensor:
        """(..., W) int32 -> codes (..., d) int32, in int32 arithmetic (the mask drops what an arithmetic shift
        brings in)."""
        self._check(words, caller)
        shifts = (torch.arange(self.per_word, device=words.device, dtype=torch.int32) * self.bits)[:, None]
        v = (words[..., None, :] >> shifts).bitwise_and_((1 << self.bits) - 1)  # (..., P, W)
        return v.reshape(*words.shape[:-1], -1)[..., : self.d]


PAGE_ALIGN = 16  # bytes: every part of a page, and every page, starts at a multiple of this
PART_ORDER = ("values", "codes", "scales", "zeros")  # order of a page's parts; other parts follow, as declared


@dataclass(frozen=True)
class PageLayout:
    """One path's page: every stored part of one block of `block_size` tokens in one buffer, in `PART_ORDER`
    (codes or values, then scales, then zeros), each a (block_size, *shape) row-major array of its dtype starting at
    a `PAGE_ALIGN`-aligned byte offset; the page size is rounded up to `PAGE_ALIGN` too. A pool of pages is a
    uint8 (num_blocks, page_bytes) tensor, and `view` gives a part as a (num_blocks, block_size, *shape) tensor whose
    block stride is the page size and whose (block_size, *shape) dims are contiguous:

        layout = PageLayout.of(64, {"codes": ((64,), torch.int32), "scales": ((4,), torch.float16)})
        layout.offset("scales")           # 64 * 64 * 4 = 16384: the scales right after the codes
        layout.view(pages, "scales")      # pages (num_blocks, layout.page_bytes) uint8 -> (num_blocks, 64, 4) fp16

    Alignment pads (none when every part's block bytes are a multiple of 16: always for block_size a multiple of
    16, e.g. the default 64) are held bytes, not used bytes: `token_bytes` counts the parts only."""

    block_size: int
    parts: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]  # (name, shape per token, dtype), in page order

    @classmethod
    def of(cls, block_size: int, parts: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> "PageLayout":
        """The layout of parts {name: (shape per token, dtype)}, put in `PART_ORDER` by the name's last "/" field
        ("content/scales" ranks as "scales")."""
        kinds = {name: name.rsplit("/", 1)[-1] for name in parts}
        rank = {name: (PART_ORDER.index(kinds[name]) if kinds[name] in PART_ORDER else len(PART_ORDER), i)
                for i, name in enumerate(parts)}
        return cls(block_size, tuple((name, tuple(int(n) for n in parts[name][0]), parts[name][1])
                                     for name in sorted(parts, key=rank.__getitem__)))

    def spec(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {name: (shape, dtype) for name, shape, dtype in self.parts}

    def part_bytes(self, name: str) -> int:
        """Bytes of one block of part `name` (block_size rows)."""
        shape, dtype = self.spec()[name]
        return self.block_size * math.prod(shape) * dtype.itemsize

    def offset(self, name: str) -> int:
        """Byte offset of part `name` in the page."""
        return self._offsets()[name]

    @property
    def page_bytes(self) -> int:
        return self._offsets()[None]

    @property
    def token_bytes(self) -> int:
        """Bytes of one token over all parts (no pads)."""
        return sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in self.parts)

    def _offsets(self) -> dict[str | None, int]:
        """{part: byte offset, None: page bytes}."""
        out, at = {}, 0
        for name, _, _ in self.parts:
            out[name] = at
            at = _aligned(at + self.part_bytes(name))
        out[None] = at
        return out

    def view(self, pages: torch.Tensor, name: str) -> torch.Tensor:
        """Part `name` of every page of `pages` (num_blocks, page_bytes) uint8: (num_blocks, block_size, *shape)."""
        shape, dtype = self.spec()[name]
        if self.part_bytes(name) == 0:  # a part of no values (a path of zero dims: no RoPE key)
            return torch.zeros(pages.shape[0], self.block_size, *shape, dtype=dtype, device=pages.device)
        start = self.offset(name)
        flat = pages[:, start : start + self.part_bytes(name)].view(dtype)  # (num_blocks, block elements)
        return flat.view(pages.shape[0], self.block_size, *shape)


def _aligned(n: int) -> int:
    return -(-n // PAGE_ALIGN) * PAGE_ALIGN


def flat_pairs(desc: tuple) -> tuple[int, ...]:
    """A RoPE-pairs descriptor (1, interleaved, pairs per group, symmetric, groups of 8 ints; the codec's
    `kernel_pairs`) as one flat tuple of ints: the four fields, the number of groups, then each group's 8 fields
    (field k of group g at 5 + 8 g + k). Flat because Triton before 3.9 takes no nested tuple as a constexpr, and an
    operator takes a list of ints; `nested_pairs` inverts it."""
    *head, groups = desc
    if any(len(g) != 8 for g in groups):
        raise ValueError(f"a pairs group has 8 fields, got {[len(g) for g in groups]}")
    return (*head, len(groups), *(int(v) for g in groups for v in g))


def nested_pairs(flat) -> tuple:
    head, n = tuple(flat[:4]), flat[4]
    return (*head, tuple(tuple(flat[5 + 8 * i: 13 + 8 * i]) for i in range(n)))

# --------------------------------------------------------------------------------------------- what a decode reads
@dataclass
class PagedPath:
    """One path's stored tensors, each (num_blocks, block_size, *) with contiguous (block_size, *) dims and any block
    stride (e.g. views of one page pool, `PageLayout`): `data` is int32 code words (.., WordLayout(bits, d).words) or
    float values (.., d); `scales`/`zeros` (.., d / group) for codes. `levels`: a codebook (2^bits,) float32 (the
    lloyd quantizer): code q reads levels[q] in place of q, x = levels[q] s + z.
    A path stored in parts of several widths (the RoPE key with bits per group of frequency pairs): `data` is its
    page pool (num_blocks, page bytes) uint8, `pairs` the kernel's static description of a page (the codec's
    `kernel_pairs`), `parts` its parts' page views and `decode` their rows -> values (..., d).
    Floating-point byte codes (the engines' formats, `codes` "e4m3" or "e2m1" at bits 8 or 4): `data` is uint8
    (.., ceil(d bits / 8)) in channel order, `scales` (.., ceil(d / group)) one per group (the last group may be
    shorter) of kind `scales_as` ("e8m0", "e4m3": uint8 bytes; None: a float dtype) or None (unscaled), x = value
    times scale; `parts` and `decode` give the PyTorch paths the codec's own decoding.
    A stream (`codes` "stream", bits 3 or 4): `data` uint8 (.., ceil(d bits / 8)), value i at bits [i b, (i + 1) b)
    of the token's bytes (LSB first), an index into `levels` (2^bits float32); x = levels[q] times its group's scale.
    `rotation`: (d, d) float32 or None. With one, what is stored is y, the values of the path in a rotated basis, and
    x = y @ rotation: a kernel reads y against the rotated query (q @ rotation^T) and rotates its output back
    (`in_bases`); the codec's `decode` gives x itself."""

    data: torch.Tensor
    scales: torch.Tensor | None = None
    zeros: torch.Tensor | None = None
    bits: int = 0
    group: int = 1
    symmetric: bool = True
    pow2: bool = False
    levels: torch.Tensor | None = None
    pairs: tuple | None = None
    parts: dict[str, torch.Tensor] | None = None
    decode: Callable[[dict[str, torch.Tensor]], torch.Tensor] | None = None
    codes: str = "words"
    scales_as: str | None = None
    rotation: torch.Tensor | None = None


@dataclass
class Segment:
    """Tokens of every sequence: both paths' pools, one block table (B, max_blocks) int32, lengths (B,).
    `max_len`: a host-side upper bound of the lengths (spares the launch a device sync); None reads the lengths."""

    content: PagedPath
    rope: PagedPath
    block_table: torch.Tensor
    lengths: torch.Tensor
    max_len: int | None = None
    rows: bool = False  # True: block b is sequence b's whole buffer (`dense`), read without the table

    @classmethod
    def dense(cls, content: torch.Tensor, rope: torch.Tensor, lengths: torch.Tensor) -> "Segment":
        """Float buffers (B, P, d) holding lengths[b] valid tokens in row b."""
        table = torch.arange(content.shape[0], dtype=torch.int32, device=content.device)[:, None]
        return cls(PagedPath(content), PagedPath(rope), table, lengths, max_len=int(content.shape[1]), rows=True)

    def longest(self) -> int:
        if self.max_len is not None:
            return self.max_len
        return int(self.lengths.max()) if self.lengths.numel() else 0


def scale_kind(p: PagedPath) -> int:
    """The index in `SCALE_KINDS` of what a path's stored scales are."""
    if p.codes != "words" and p.scales is None:
        return SCALE_KINDS.index("none")
    if p.scales_as is not None:
        return SCALE_KINDS.index(p.scales_as)
    return SCALE_KINDS.index("pow2" if p.pow2 else "float")


def _check_byte_codes(p: PagedPath, d: int, name: str, blocks: tuple[int, int]) -> list[tuple[str, torch.Tensor]]:
    """The checks of a path of floating-point byte codes (`PagedPath`); returns its (part, tensor) pairs."""
    if p.codes not in CODE_BITS or p.bits not in CODE_BITS[p.codes]:
        raise ValueError(f"{name}.codes={p.codes!r} with bits={p.bits}; allowed: {CODE_BITS} (codes: bits)")
    row = -(-d * p.bits // 8)
    if p.data.dtype != torch.uint8 or p.data.shape[-1] != row:
        raise ValueError(f"{name}.data: uint8 {p.codes} codes (.., {row}) expected, got {p.data.dtype} "
                         f"{tuple(p.data.shape)}")
    if not p.symmetric or p.zeros is not None:
        raise ValueError(f"{name}: {p.codes} codes take no zeros (symmetric=True, zeros=None)")
    if p.codes == "stream":
        if p.levels is None or p.levels.dtype != torch.float32 or tuple(p.levels.shape) != (1 << p.bits,) or \
                not p.levels.is_contiguous():
            got = None if p.levels is None else f"{p.levels.dtype} {tuple(p.levels.shape)}"
            raise ValueError(f"{name}.levels: a stream's codebook of {1 << p.bits} contiguous float32 levels "
                             f"expected, got {got}")
        if p.scales_as is not None or p.pow2:
            raise ValueError(f"{name}.scales: a stream's scales are of a float dtype (scales_as=None, pow2=False)")
    elif p.levels is not None:
        raise ValueError(f"{name}: {p.codes} codes take no codebook (levels=None)")
    if p.group <= 0:
        raise ValueError(f"{name}.group={p.group}: must be a positive number of values per scale")
    parts = [("data", p.data)] + ([("levels", p.levels)] if p.levels is not None else [])
    if p.scales is not None:
        groups = -(-d // p.group)
        if tuple(p.scales.shape) != blocks + (groups,):
            raise ValueError(f"{name}.scales must be (num_blocks, block_size, {groups}), got shape "
                             f"{tuple(p.scales.shape)}")
        wanted = {None: (torch.int8,) if p.pow2 else FLOAT_DTYPES, "e8m0": (torch.uint8,), "e4m3": (torch.uint8,)}
        if p.scales_as not in wanted or p.scales.dtype not in wanted[p.scales_as]:
            raise ValueError(f"{name}.scales: {p.scales.dtype} as {p.scales_as!r} (pow2={p.pow2}); allowed: a float "
                             f"dtype (None), int8 exponents (None, pow2=True), or uint8 bytes as 'e8m0' or 'e4m3'")
        parts.append(("scales", p.scales))
    return parts


# ---------------------------------------------------------------------------------- what every decode kernel checks
KERNEL_BITS = (0, 2, 4, 8)  # 0 = float values
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def rows_contiguous(t: torch.Tensor) -> bool:
    """True for a (num_blocks, block_size, *) tensor whose (block_size, *) dims are contiguous (a block's rows lie
    one after another, as in a page); its block stride, stride(0), may be anything."""
    return t.shape[0] == 0 or t[0].is_contiguous()


def _check_path(p: PagedPath, d: int, name: str, blocks: tuple[int, int], device: torch.device) -> None:
    if p.rotation is not None:
        r = p.rotation
        if p.codes != "stream":
            raise ValueError(f"{name}.rotation: a rotated basis is read for a stream of codebook indices only "
                             f"(codes='stream'), not codes={p.codes!r}")
        if r.dtype != torch.float32 or tuple(r.shape) != (d, d) or not r.is_contiguous() or r.device != device:
            raise ValueError(f"{name}.rotation: a contiguous ({d}, {d}) float32 matrix on {device} expected, got "
                             f"{r.dtype} {tuple(r.shape)} on {r.device}")
    if p.pairs is not None:  # a page pool of parts of several widths, described by `pairs`
        if p.data.dtype != torch.uint8 or p.data.dim() != 2 or p.data.shape[0] != blocks[0] or \
                p.data.stride(1) != 1:
            raise ValueError(f"{name}.data: a page pool (num_blocks={blocks[0]}, page bytes) uint8 expected with "
                             f"pairs, got {p.data.dtype} {tuple(p.data.shape)}")
        if p.data.device != device:
            raise ValueError(f"{name}.data is on {p.data.device}; the queries are on {device}")
        return
    if p.codes not in CODES:
        raise ValueError(f"{name}.codes={p.codes!r}; allowed: {list(CODES)}")
    if p.codes == "words" and p.bits not in KERNEL_BITS:
        raise ValueError(f"{name}.bits={p.bits}; allowed: {list(KERNEL_BITS)} (0 = float values)")
    if p.data.dim() != 3 or tuple(p.data.shape[:2]) != blocks:
        raise ValueError(f"{name}.data must be (num_blocks, block_size, *) = {blocks + ('*',)}, "
                         f"got {tuple(p.data.shape)}")
    if p.codes != "words":
        parts = _check_byte_codes(p, d, name, blocks)
    elif p.bits == 0:
        if p.data.dtype not in FLOAT_DTYPES or p.data.shape[-1] != d:
            raise ValueError(f"{name}.data: float values (.., {d}) in one of {[str(t) for t in FLOAT_DTYPES]} "
                             f"expected for bits=0, got {p.data.dtype} {tuple(p.data.shape)}")
        parts = [("data", p.data)]
    else:
        words = WordLayout(p.bits, d).words
        if p.data.dtype != torch.int32 or p.data.shape[-1] != words:
            raise ValueError(f"{name}.data: int32 code words (.., {words}) expected for bits={p.bits} "
                             f"(WordLayout), got {p.data.dtype} {tuple(p.data.shape)}")
        if p.group <= 0 or d % p.group:
            raise ValueError(f"{name}.group={p.group}: must be a positive divisor of d={d}")
        groups = d // p.group
        parts = [("data", p.data)]
        for part, t in [("scales", p.scales)] + ([] if p.symmetric else [("zeros", p.zeros)]):
            if t is None:
                raise ValueError(f"{name}.{part} is missing (bits={p.bits}, symmetric={p.symmetric})")
            if tuple(t.shape) != blocks + (groups,):
                raise ValueError(f"{name}.{part} must be contiguous (num_blocks, block_size, {groups}) in its "
                                 f"(block_size, *) dims (any block stride), got shape {tuple(t.shape)}")
            parts.append((part, t))
        if p.pow2 != (p.scales.dtype == torch.int8):
            raise ValueError(f"{name}.pow2={p.pow2} but scales are {p.scales.dtype} (pow2 scales are int8 "
                             f"exponents)")
        if not p.pow2 and p.scales.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name}.scales: {p.scales.dtype}; allowed: {[str(t) for t in FLOAT_DTYPES]} "
                             f"(or int8 with pow2=True)")
        if not p.symmetric and p.zeros.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name}.zeros: {p.zeros.dtype}; allowed: {[str(t) for t in FLOAT_DTYPES]}")
        if p.levels is not None:
            if p.levels.dtype != torch.float32 or tuple(p.levels.shape) != (1 << p.bits,) or \
                    not p.levels.is_contiguous():
                raise ValueError(f"{name}.levels: a codebook of {1 << p.bits} contiguous float32 levels expected for "
                                 f"bits={p.bits}, got {p.levels.dtype} {tuple(p.levels.shape)}")
            parts.append(("levels", p.levels))
    for part, t in parts:
        if part != "levels" and not rows_contiguous(t):
            raise ValueError(f"{name}.{part} must be contiguous in its (block_size, *) dims (any block stride "
                             f"stride(0)), got shape {tuple(t.shape)} strides {tuple(t.stride())}")
        if t.device != device:
            raise ValueError(f"{name}.{part} is on {t.device}; the queries are on {device}")


def check_inputs(q_latent: torch.Tensor, q_rope: torch.Tensor, segments) -> None:
    """Shapes, dtypes and layouts of every argument, before any launch; errors name the argument."""
    if q_latent.dim() != 3 or q_rope.dim() != 3 or q_latent.shape[:2] != q_rope.shape[:2]:
        raise ValueError(f"q_latent (B, H, d_c) and q_rope (B, H, d_r) expected, got {tuple(q_latent.shape)} and "
                         f"{tuple(q_rope.shape)}")
    if q_latent.dtype not in FLOAT_DTYPES or q_rope.dtype != q_latent.dtype:
        raise ValueError(f"q_latent and q_rope must share one dtype of {[str(t) for t in FLOAT_DTYPES]}, got "
                         f"{q_latent.dtype} and {q_rope.dtype}")
    for name, q in (("q_latent", q_latent), ("q_rope", q_rope)):
        if q.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, got strides {tuple(q.stride())}")
    if q_rope.device != q_latent.device:
        raise ValueError(f"q_rope is on {q_rope.device}, q_latent on {q_latent.device}")
    if not segments:
        raise ValueError("segments is empty: nothing to attend to")
    b, _, d_c = q_latent.shape
    d_r = q_rope.shape[-1]
    for i, seg in enumerate(segments):
        blocks = tuple(seg.content.data.shape[:2])
        if seg.content.pairs is not None:
            raise ValueError(f"segments[{i}].content: a path of several widths (pairs) is the RoPE key's only")
        _check_path(seg.content, d_c, f"segments[{i}].content", blocks, q_latent.device)
        _check_path(seg.rope, d_r, f"segments[{i}].rope", blocks, q_latent.device)
        table = seg.block_table
        if table.dtype != torch.int32 or table.dim() != 2 or table.shape[0] != b or not table.is_contiguous():
            raise ValueError(f"segments[{i}].block_table must be int32, contiguous, (B={b}, max_blocks), got "
                             f"{table.dtype} {tuple(table.shape)} strides {tuple(table.stride())}")
        if seg.lengths.shape != (b,) or seg.lengths.is_floating_point():
            raise ValueError(f"segments[{i}].lengths must be (B,) = ({b},) integers, got {seg.lengths.dtype} "
                             f"{tuple(seg.lengths.shape)}")
        if table.device != q_latent.device or seg.lengths.device != q_latent.device:
            raise ValueError(f"segments[{i}].block_table and .lengths must be on {q_latent.device}")


def in_bases(q_latent: torch.Tensor, q_rope: torch.Tensor, segments, run, return_lse: bool = False):
    """Decode over segments whose paths may be stored in rotated bases (`PagedPath.rotation`, x = y @ R): the
    segments grouped by their paths' rotations, each group read by `run(q_latent, q_rope, segments)` -> (out, lse)
    (B, H, d_c), (B, H) float32 with the group's queries rotated (q @ R^T) and its segments' rotations dropped, its
    output rotated back (out @ R), and the groups merged by their log-sum-exp. One group without rotation (every
    format but TurboQuant's 3- and 4-bit codes) is one call of `run` as it is. Returns out, or (out, lse)."""
    groups: list[list] = []
    for seg in segments:
        for g in groups:
            if g[0].content.rotation is seg.content.rotation and g[0].rope.rotation is seg.rope.rotation:
                g.append(seg)
                break
        else:
            groups.append([seg])
    results = []
    for group in groups:
        rc, rr = group[0].content.rotation, group[0].rope.rotation
        ql = q_latent if rc is None else (q_latent.float() @ rc.T).to(q_latent.dtype)
        qr = q_rope if rr is None else (q_rope.float() @ rr.T).to(q_rope.dtype)
        if rc is not None or rr is not None:
            group = [replace(seg, content=replace(seg.content, rotation=None), rope=replace(seg.rope, rotation=None))
                     for seg in group]
        out, lse = run(ql.contiguous(), qr.contiguous(), group)
        results.append((out if rc is None else out @ rc, lse))
    if len(results) == 1:
        out, lse = results[0]
    else:
        lses = torch.stack([lse for _, lse in results])  # (groups, B, H)
        lse = torch.logsumexp(lses, 0)
        w = torch.exp(lses - torch.where(torch.isinf(lse), 0.0, lse)).nan_to_num(0.0)  # a group without tokens: 0
        out = sum(w[i][..., None] * o for i, (o, _) in enumerate(results))
    return (out, lse) if return_lse else out
