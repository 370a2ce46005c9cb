"""Paged token storage: each sequence's tokens in fixed-size blocks taken from one pool on demand.

As in serving engines (vLLM's block manager, FlashMLA's `block_table`), memory held tracks memory used: a sequence
holds ceil(length / block_size) blocks, so held <= used + one partly filled block per sequence. A stored tensor
("part", e.g. "content/codes", "rope/scales") belongs to the path named before its "/", and each path keeps ONE
page per block (`PageLayout`, mla_quant/kernels/layout.py: the block's codes or values, then its scales, then its
zeros, at 16-byte aligned offsets) in a uint8 pool (num_blocks, page_bytes). A part is a strided view (num_blocks,
block_size, *) of its path's pool: block stride one page, its (block_size, *) dims contiguous. All paths share one
block table, since they describe the same tokens.

    store = PagedStore(batch=2, block_size=64)
    store.append(rows, {"content/values": x})       # rows (N,) ascending, x (N, d): tokens in order per row
    dense, lengths = store.dense()                   # {"content/values": (B, L_max, d)}, (B,)
    store.gather(rows, pos, ["content/values"])      # token pos[i] of sequence rows[i]: {"content/values": (N, d)}
    store.gather_grid(pos, ["content/values"])       # token pos[b, j] of sequence b: {"content/values": (B, J, d)}
    store.block_table(), store.lengths               # what a kernel reads: (B, max_blocks) int32, (B,) int32
    rows, pos = store.reserve_ahead(k)               # room for k more tokens per sequence, not yet counted in
    store.write(rows, pos, parts); store.advance()   # written ahead, then counted in one token per sequence a step
    store.declare({"rope/codes": ((W,), torch.int32), "rope/scales": ((G,), torch.float16)})  # a path's page
    store.part("rope/scales")                        # its view (num_blocks, block_size, G), stride(0) = page

A path's page is laid out when its parts are first declared (`declare`, or the first `write`/`part` naming them),
all at once: once the path holds blocks, a new part of it is refused. A view, like the pool, is replaced when the
pool grows (`reserve`), so take views after reserving.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from mla_quant.cache.contract import to_device
from mla_quant.kernels.layout import PagedPath, PageLayout

Spec = tuple[tuple[int, ...], torch.dtype]  # a part's shape per token and dtype


def path_of(part: str) -> str:
    """The path a part belongs to: the name before its "/" ("content/codes" -> "content")."""
    return part.split("/", 1)[0]


class PagedStore:
    """Per-sequence tokens in blocks of `block_size` from a growing pool (see the module docstring)."""

    def __init__(self, batch: int, block_size: int, device: torch.device | str = "cpu"):
        if block_size < 1:
            raise ValueError(f"block_size={block_size}; allowed: an integer >= 1")
        self.batch, self.block_size, self.device = batch, block_size, torch.device(device)
        self.layouts: dict[str, PageLayout] = {}  # path -> its page layout (its parts by full name)
        self.pages: dict[str, torch.Tensor] = {}  # path -> (num_blocks, page_bytes) uint8
        self.tables: list[list[int]] = [[] for _ in range(batch)]
        self.lengths = torch.zeros(batch, dtype=torch.long, device=self.device)  # (B,) tokens per sequence
        # the same on the host (no device sync to decide on allocation); after `advance(counted)` an upper bound (and
        # so after later `reserve`s, which add their counts), exact again after `truncate`
        self._host_lengths = [0] * batch
        self._table: torch.Tensor | None = None
        self._table_long: torch.Tensor | None = None  # the block table as int64, for indexing
        self._declared: dict[str, Spec] = {}  # part -> its (shape, dtype), every declared part
        self._views: dict[str, torch.Tensor] = {}  # part -> its view of the current pages
        self.num_blocks = 0

    # ------------------------------------------------------------------ layout
    def declare(self, parts: dict[str, Spec]) -> None:
        """Lay out parts {name: (shape per token, dtype)}: each path's new parts join its page, all at once (a
        path that holds blocks takes no new part); a part declared before must keep its shape and dtype."""
        if all(self._declared.get(name) == (tuple(shape), dtype) for name, (shape, dtype) in parts.items()):
            return  # every part as declared before (each append's case)
        by_path: dict[str, dict[str, Spec]] = {}
        for name, (shape, dtype) in parts.items():
            by_path.setdefault(path_of(name), {})[name] = (tuple(int(n) for n in shape), dtype)
        for path, new in by_path.items():
            old = self.layouts[path].spec() if path in self.layouts else {}
            for name, spec in new.items():
                if name in old and old[name] != spec:
                    raise ValueError(f"PagedStore part {name}: declared as {old[name]}, now {spec}")
            added = {k: v for k, v in new.items() if k not in old}
            if not added:
                continue
            if path in self.pages and self.pages[path].shape[0]:
                raise ValueError(f"PagedStore part {next(iter(added))}: path {path!r} already holds blocks laid out "
                                 f"as {list(old)}; declare all of a path's parts before its first block")
            self.layouts[path] = layout = PageLayout.of(self.block_size, {**old, **added})
            self.pages[path] = torch.zeros(self.num_blocks, layout.page_bytes, dtype=torch.uint8, device=self.device)
            self._views = {}
            self._declared.update(layout.spec())

    def part(self, name: str, shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The view (num_blocks, block_size, *shape) of part `name` into its path's pages (block stride: one page);
        declared (zeros) first if new, which needs `shape` and `dtype`."""
        if shape is not None:
            self.declare({name: (tuple(shape), dtype)})
        if name not in self._views:
            layout = self.layouts.get(path_of(name))
            if layout is None or name not in layout.spec():
                raise KeyError(f"PagedStore has no part {name!r}; parts: {self.part_names()}")
            self._views[name] = layout.view(self.pages[path_of(name)], name)
        return self._views[name]

    def part_names(self) -> list[str]:
        """Every part, path by path in page order."""
        return [name for layout in self.layouts.values() for name, _, _ in layout.parts]

    @property
    def pool(self) -> dict[str, torch.Tensor]:
        """{part: its view (num_blocks, block_size, *)} for every part (see `part`)."""
        return {name: self.part(name) for name in self.part_names()}

    # ------------------------------------------------------------------ writing
    def append(self, rows: torch.Tensor, parts: dict[str, torch.Tensor]) -> None:
        """Append N tokens: rows (N,) ascending (a row's tokens in order), parts {name: (N, *)}."""
        if rows.numel():
            self.write(rows, self.reserve(rows), parts)

    def reserve_ahead(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Room for k tokens per sequence past its last, allocated but not counted in (`advance` counts them in, one
        per sequence at a time): their (rows, positions), both (B k,), sequence by sequence. What is written there
        stays out of every read until counted in; a later `append` overwrites it."""
        self._ensure_blocks([n + k for n in self._host_lengths])
        pos = self.lengths[:, None] + torch.arange(k, device=self.device)[None, :]  # (B, k)
        rows = torch.arange(self.batch, device=self.device).repeat_interleave(k)
        return rows, pos.reshape(-1)

    def advance(self, counted: torch.Tensor | None = None) -> None:
        """Count in one more token of every sequence, already written past its last (`reserve_ahead`); `counted`
        (B,) bool: only of these sequences, decided on the device (the host's lengths then bound the device's from
        above until the next `reserve` or `truncate`)."""
        if any(len(table) * self.block_size < n + 1 for table, n in zip(self.tables, self._host_lengths)):
            raise RuntimeError("PagedStore.advance: a sequence has no token reserved past its last")
        self.lengths = self.lengths + (1 if counted is None else counted.long())
        self._host_lengths = [n + 1 for n in self._host_lengths]

    def reserve(self, rows: torch.Tensor, host: np.ndarray | None = None) -> torch.Tensor:
        """Make room for N new tokens of sequences rows (N,) ascending and count them in; their positions (N,) in
        their sequences. `host`: the same rows on the host, where the caller has them (else read from `rows`). The
        caller writes them (`write`, or a kernel through `block_table()`)."""
        n = rows.numel()
        host = rows.cpu().numpy() if host is None else host
        counts = np.bincount(host, minlength=self.batch)  # (B,) on the host
        self._host_lengths = [a + int(c) for a, c in zip(self._host_lengths, counts)]
        self._ensure_blocks(self._host_lengths)
        counts = to_device(counts, self.device)
        starts = torch.cumsum(counts, 0) - counts  # (B,) first flat index of each row
        pos = self.lengths[rows] + torch.arange(n, device=rows.device) - starts[rows]  # (N,) position in its row
        self.lengths = self.lengths + counts
        return pos

    def write(self, rows: torch.Tensor | None, pos: torch.Tensor, parts: dict[str, torch.Tensor]) -> None:
        """Token pos[i] of sequence rows[i] takes parts {name: (N, *)} (its blocks reserved; rows None: pos (B,),
        one token per sequence)."""
        self.declare({name: (tuple(x.shape[1:]), x.dtype) for name, x in parts.items()})
        blocks, offsets = self._locate(rows, pos)
        for name, x in parts.items():
            self.part(name)[blocks, offsets] = x

    def _ensure_blocks(self, tokens: list[int]) -> None:
        """Enough blocks in each sequence's table for tokens[b] tokens."""
        needed = [-(-n // self.block_size) for n in tokens]
        extra = [max(0, need - len(table)) for need, table in zip(needed, self.tables)]
        total = sum(extra)
        if total == 0:
            return
        for table, k in zip(self.tables, extra):
            table.extend(range(self.num_blocks, self.num_blocks + k))
            self.num_blocks += k
        for path, pages in self.pages.items():
            self.pages[path] = torch.cat([pages, pages.new_zeros(total, pages.shape[1])])
        self._views = {}
        self._table = self._table_long = None

    def truncate(self, new_lengths: torch.Tensor) -> None:
        """Keep the first new_lengths[b] tokens of each sequence (blocks stay allocated for reuse)."""
        self.lengths = torch.minimum(self.lengths, new_lengths.to(self.lengths))
        self._host_lengths = self.lengths.tolist()

    # ------------------------------------------------------------------ reading
    @property
    def longest(self) -> int:
        """Tokens of the longest sequence, from the host-side lengths (no device sync; an upper bound after
        `advance(counted)`)."""
        return max(self._host_lengths, default=0)

    def room(self) -> int:
        """Tokens every sequence takes before it needs a new block (a whole block where its last one is full)."""
        return min((self.block_size - n % self.block_size for n in self._host_lengths), default=self.block_size)

    def block_table(self) -> torch.Tensor:
        """(B, max_blocks) int32; unused entries point at block 0 (never read past a sequence's length)."""
        if self._table is None:
            width = max(1, max(len(t) for t in self.tables))
            table = torch.zeros(self.batch, width, dtype=torch.int32, device="cpu")  # built on the host, then moved
            for b, blocks in enumerate(self.tables):
                table[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32, device="cpu")
            self._table = table.to(self.device)
        return self._table

    def _locate(self, rows: torch.Tensor | None, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset in block) of token `pos` of sequence `rows`, both (N,) (rows None: pos (B,), one per
        sequence)."""
        if self._table_long is None:
            self._table_long = self.block_table().long()
        if rows is None:
            return self._table_long.gather(1, (pos // self.block_size)[:, None])[:, 0], pos % self.block_size
        return self._table_long[rows, pos // self.block_size], pos % self.block_size

    def gather(self, rows: torch.Tensor, pos: torch.Tensor, parts: list[str]) -> dict[str, torch.Tensor]:
        """Token pos[i] of sequence rows[i], both (N,): {part: (N, *)}."""
        blocks, offsets = self._locate(rows, pos)
        return {name: self.part(name)[blocks, offsets] for name in parts}

    def gather_grid(self, pos: torch.Tensor, parts: list[str]) -> dict[str, torch.Tensor]:
        """Token pos[b, j] of sequence b, pos (B, J) within each sequence's length: {part: (B, J, *)}."""
        blocks = self.block_table().long().gather(1, pos // self.block_size)
        return {name: self.part(name)[blocks, pos % self.block_size] for name in parts}

    def dense(self, parts: list[str] | None = None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Each sequence's tokens left-aligned: {part: (B, L_max, *)} (entries past a length are arbitrary), (B,)."""
        names = self.part_names() if parts is None else parts
        longest = self.longest
        if longest == 0 or not names:
            return {}, self.lengths
        n_blocks = (longest + self.block_size - 1) // self.block_size
        table = self.block_table()[:, :n_blocks].long()  # (B, n_blocks)
        out = {}
        for name in names:
            view = self.part(name)
            x = view[table]  # (B, n_blocks, block_size, *)
            out[name] = x.reshape(self.batch, n_blocks * self.block_size, *view.shape[2:])[:, :longest]
        return out, self.lengths

    # ------------------------------------------------------------------ bytes
    def token_bytes(self) -> int:
        """Bytes one token takes over all parts (a page's alignment pads, if any, are held, not used)."""
        return sum(layout.token_bytes for layout in self.layouts.values()) if self.num_blocks else 0

    def used_bytes(self) -> int:
        return int(self.lengths.sum()) * self.token_bytes()

    def held_bytes(self) -> int:
        """Whole pages of every block, alignment pads included."""
        return sum(pages.numel() for pages in self.pages.values())

    # ------------------------------------------------------------------ batch edits
    def rebuilt(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "PagedStore":
        """A new store, with the same page layouts, whose batch is `fn` of this one's (reorder, repeat, select):
        sequences are copied, so no block is shared between two sequences."""
        dense, lengths = self.dense()
        lengths = fn(lengths)
        store = PagedStore(lengths.shape[0], self.block_size, self.device)
        store.declare({name: spec for layout in self.layouts.values() for name, spec in layout.spec().items()})
        if not dense:
            return store
        dense = {k: fn(v) for k, v in dense.items()}
        keep = torch.arange(next(iter(dense.values())).shape[1], device=lengths.device)[None, :] < lengths[:, None]
        rows = keep.nonzero(as_tuple=True)[0]
        store.append(rows, {k: v[keep] for k, v in dense.items()})
        return store

    def to(self, device) -> None:
        self.device = torch.device(device)
        self.pages = {k: v.to(device, non_blocking=True) for k, v in self.pages.items()}
        self._views = {}
        self.lengths = self.lengths.to(device)
        self._table = self._table_long = None


def read_path(fmt, d: int, layout: PageLayout, pages: torch.Tensor,
              views: dict[str, torch.Tensor] | None = None) -> PagedPath:
    """One path's pages as a decode kernel reads them: `fmt` (a `PathFormat` of `d` dims) stored in `layout`'s pages
    `pages` (num_blocks, page bytes) uint8, any block stride; `views`: its parts' views {"content/codes": ...} where
    the caller holds them (a store's, made outside any compiled region), else made here. Formats with parts of
    several widths (`whole_page`) are read as whole pages; the others as their codes or values, scales, zeros and
    codebook."""
    spec = layout.spec()
    path = layout.parts[0][0].split("/", 1)[0] if layout.parts else ""
    views = {name.split("/", 1)[1]: (layout.view(pages, name) if views is None else views[name]) for name in spec}
    def decode(parts):  # the codec's own decoding, for the PyTorch paths
        return fmt.decode(parts, d, torch.float32)

    if fmt.whole_page:
        desc = fmt.codec.kernel_pairs(fmt, d, lambda part: layout.offset(f"{path}/{part}"),
                                      lambda part: spec[f"{path}/{part}"][1])
        return PagedPath(pages, pairs=desc, parts=views, decode=decode)
    k = fmt.kernel_spec(d)
    data = views["values"] if k["bits"] == 0 else views["codes"]
    codes = k.get("codes", "words")
    if codes != "words":  # an engine's byte codes: the PyTorch paths read them through the codec
        extra = fmt.kernel_tensors(d, data.device)  # a stream's codebook and rotation
        return PagedPath(data, views.get("scales"), None, k["bits"], k["group"], True, k["pow2"], extra.get("levels"),
                         codes=codes, scales_as=k.get("scales_as"), parts=views, decode=decode,
                         rotation=extra.get("rotation"))
    return PagedPath(data, views.get("scales"), views.get("zeros"), k["bits"], k["group"], k["symmetric"], k["pow2"],
                     fmt.codebook(required=True, device=data.device))

