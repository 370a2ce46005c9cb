"""Paged token storage: each sequence's tokens in fixed-size blocks taken from one pool on demand.

As in serving engines (vLLM's block manager, FlashMLA's `block_table`), memory held tracks memory used: a sequence
holds ceil(length / block_size) blocks, so held <= used + one partly filled block per sequence. Every stored tensor
("part", e.g. "content/codes", "rope/scales") has its own pool (num_blocks, block_size, *); all parts share one
block table, since they describe the same tokens.

    store = PagedStore(batch=2, block_size=64)
    store.append(rows, {"content/values": x})       # rows (N,) ascending, x (N, d): tokens in order per row
    dense, lengths = store.dense()                   # {"content/values": (B, L_max, d)}, (B,)
    store.gather(rows, pos, ["content/values"])      # token pos[i] of sequence rows[i]: {"content/values": (N, d)}
    store.block_table(), store.lengths               # what a kernel reads: (B, max_blocks) int32, (B,) int32
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class PagedStore:
    """Per-sequence tokens in blocks of `block_size` from a growing pool (see the module docstring)."""

    def __init__(self, batch: int, block_size: int, device: torch.device | str = "cpu"):
        if block_size < 1:
            raise ValueError(f"block_size={block_size}; allowed: an integer >= 1")
        self.batch, self.block_size, self.device = batch, block_size, torch.device(device)
        self.pool: dict[str, torch.Tensor] = {}  # part -> (num_blocks, block_size, *)
        self.tables: list[list[int]] = [[] for _ in range(batch)]
        self.lengths = torch.zeros(batch, dtype=torch.long, device=self.device)  # (B,) tokens per sequence
        self._table: torch.Tensor | None = None
        self.num_blocks = 0

    # ------------------------------------------------------------------ writing
    def append(self, rows: torch.Tensor, parts: dict[str, torch.Tensor]) -> None:
        """Append N tokens: rows (N,) ascending (a row's tokens in order), parts {name: (N, *)}."""
        if rows.numel():
            self.write(rows, self.reserve(rows), parts)

    def reserve(self, rows: torch.Tensor) -> torch.Tensor:
        """Make room for N new tokens of sequences rows (N,) ascending and count them in; their positions (N,) in
        their sequences. The caller writes them (`write`, or a kernel through `block_table()`)."""
        n = rows.numel()
        counts = torch.bincount(rows, minlength=self.batch)  # (B,)
        new_lengths = self.lengths + counts
        self._allocate(new_lengths)
        starts = torch.cumsum(counts, 0) - counts  # (B,) first flat index of each row
        pos = self.lengths[rows] + torch.arange(n, device=rows.device) - starts[rows]  # (N,) position in its row
        self.lengths = new_lengths
        return pos

    def write(self, rows: torch.Tensor, pos: torch.Tensor, parts: dict[str, torch.Tensor]) -> None:
        """Token pos[i] of sequence rows[i] takes parts {name: (N, *)} (its blocks reserved)."""
        blocks, offsets = self._locate(rows, pos)
        for name, x in parts.items():
            self.part(name, x.shape[1:], x.dtype)[blocks, offsets] = x

    def part(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The pool (num_blocks, block_size, *shape) of part `name`, created (zeros) on first use."""
        if name not in self.pool:
            self.pool[name] = torch.zeros(self.num_blocks, self.block_size, *shape, dtype=dtype, device=self.device)
        return self.pool[name]

    def _allocate(self, new_lengths: torch.Tensor) -> None:
        needed = ((new_lengths + self.block_size - 1) // self.block_size).tolist()
        extra = [max(0, need - len(table)) for need, table in zip(needed, self.tables)]
        total = sum(extra)
        if total == 0:
            return
        for table, k in zip(self.tables, extra):
            table.extend(range(self.num_blocks, self.num_blocks + k))
            self.num_blocks += k
        for name, pool in self.pool.items():
            grown = pool.new_zeros(total, *pool.shape[1:])
            self.pool[name] = torch.cat([pool, grown])
        self._table = None

    def truncate(self, new_lengths: torch.Tensor) -> None:
        """Keep the first new_lengths[b] tokens of each sequence (blocks stay allocated for reuse)."""
        self.lengths = torch.minimum(self.lengths, new_lengths.to(self.lengths))

    # ------------------------------------------------------------------ reading
    def block_table(self) -> torch.Tensor:
        """(B, max_blocks) int32; unused entries point at block 0 (never read past a sequence's length)."""
        if self._table is None:
            width = max(1, max(len(t) for t in self.tables))
            table = torch.zeros(self.batch, width, dtype=torch.int32)
            for b, blocks in enumerate(self.tables):
                table[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            self._table = table.to(self.device)
        return self._table

    def _locate(self, rows: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset in block) of token `pos` of sequence `rows`, both (N,)."""
        return self.block_table().long()[rows, pos // self.block_size], pos % self.block_size

    def gather(self, rows: torch.Tensor, pos: torch.Tensor, parts: list[str]) -> dict[str, torch.Tensor]:
        """Token pos[i] of sequence rows[i], both (N,): {part: (N, *)}."""
        blocks, offsets = self._locate(rows, pos)
        return {name: self.pool[name][blocks, offsets] for name in parts}

    def dense(self, parts: list[str] | None = None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Each sequence's tokens left-aligned: {part: (B, L_max, *)} (entries past a length are arbitrary), (B,)."""
        names = list(self.pool) if parts is None else parts
        longest = int(self.lengths.max()) if self.batch else 0
        if longest == 0 or not self.pool:
            return {}, self.lengths
        n_blocks = (longest + self.block_size - 1) // self.block_size
        table = self.block_table()[:, :n_blocks].long()  # (B, n_blocks)
        out = {}
        for name in names:
            pool = self.pool[name]
            x = pool[table]  # (B, n_blocks, block_size, *)
            out[name] = x.reshape(self.batch, n_blocks * self.block_size, *pool.shape[2:])[:, :longest]
        return out, self.lengths

    # ------------------------------------------------------------------ bytes
    def token_bytes(self) -> int:
        """Bytes one token takes over all parts."""
        return sum(p[0, 0].numel() * p.element_size() for p in self.pool.values()) if self.num_blocks else 0

    def used_bytes(self) -> int:
        return int(self.lengths.sum()) * self.token_bytes()

    def held_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.pool.values())

    # ------------------------------------------------------------------ batch edits
    def rebuilt(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "PagedStore":
        """A new store whose batch is `fn` of this one's (reorder, repeat, select): sequences are copied, so no
        block is shared between two sequences."""
        dense, lengths = self.dense()
        lengths = fn(lengths)
        store = PagedStore(lengths.shape[0], self.block_size, self.device)
        if not dense:
            return store
        dense = {k: fn(v) for k, v in dense.items()}
        keep = torch.arange(next(iter(dense.values())).shape[1], device=lengths.device)[None, :] < lengths[:, None]
        rows = keep.nonzero(as_tuple=True)[0]
        store.append(rows, {k: v[keep] for k, v in dense.items()})
        return store

    def to(self, device) -> None:
        self.device = torch.device(device)
        self.pool = {k: v.to(device, non_blocking=True) for k, v in self.pool.items()}
        self.lengths = self.lengths.to(device)
        self._table = None
