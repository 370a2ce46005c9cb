"""The storage layout that the kernels read and write: integer codes as whole int32 words, chunked along channels,
and one page per block and path holding its codes, scales and zeros.

One spec for the encoder (mla_quant/quant/formats.py), the decode and store kernels and the byte accounting:

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

The paged store keeps a block's stored tensors together: one page per block and path, its codes (or values), then
its scales, then its zeros (`PageLayout` below, docs/kernel.md "Page layout"); each is read as a view with a block
stride of one page.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

WORD_BITS = (2, 4, 8)


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
        start = self.offset(name)
        flat = pages[:, start : start + self.part_bytes(name)].view(dtype)  # (num_blocks, block elements)
        return flat.view(pages.shape[0], self.block_size, *shape)


def _aligned(n: int) -> int:
    return -(-n // PAGE_ALIGN) * PAGE_ALIGN


# --------------------------------------------------------------------------------------------- what a decode reads
@dataclass
class PagedPath:
    """One path's stored tensors, each (num_blocks, block_size, *) with contiguous (block_size, *) dims and any block
    stride (e.g. views of one page pool, `PageLayout`): `data` is int32 code words (.., WordLayout(bits, d).words) or
    float values (.., d); `scales`/`zeros` (.., d / group) for codes. `levels`: a codebook (2^bits,) float32 (the
    lloyd quantizer): code q reads levels[q] in place of q, x = levels[q] s + z.
    A path stored in parts of several widths (the RoPE key with bits per group of frequency pairs): `data` is its
    page pool (num_blocks, page bytes) uint8, `pairs` the kernel's static description of a page (the codec's
    `kernel_pairs`), `parts` its parts' page views and `decode` their rows -> values (..., d)."""

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
