"""The latent KV cache of MLA: per layer, the content latent c (d_c values) and the RoPE key k (d_r values) of every
real token of every sequence, each path in its own format (docs/cache.md).

The cache is a `transformers.Cache`, so `model(...)`, `model.generate(...)` and masking work unchanged. Per layer:

    layer.append(content, rope, valid)    # content (B, T, d_c), rope (B, T, d_r), valid (B, T) bool (None = all real)
    content, rope = layer.read()          # (B, S, d_c), (B, S, d_r) slot-aligned: what attention sees
    layer.length                          # S slots (padding included, as transformers counts positions)
    layer.nbytes(), layer.held_bytes()    # bytes of the valid tokens / bytes allocated
    layer.attend(q_latent, q_rope, content_new, rope_new, scale, mask, valid) -> o_latent

Storage per sequence (padding slots are never stored; `slot_valid` remembers which slots were real):
    sinks    (B, <=n_sink, d) its first n_sink real tokens, activation dtype, `n_sinks` (B,) held
    store    PagedStore      the real tokens that left the recent window, encoded by the path's codec, in blocks
    pending  (B, P, d)       with a token block (`fmt.token_block`, format channel_block): the tokens that left the
                             window since its last whole block, P < token_block, activation dtype, `n_pending` (B,)
    recent   (B, R, d)       its latest <= `recent` real tokens, oldest first, activation dtype, `n_recent` (B,)
A real token is quantized exactly once, when it leaves its sequence's recent window (with a token block: when the
block it joins fills, all its tokens together), and never changes after that. Order per sequence: sinks | store |
pending | recent.
With both paths bf16 there is nothing to protect: every token goes to the store, exactly as given.

Semantics (`quant.mode`, docs/method.md section 3): "simulated": every read sees the stored values outside the
protected region, the appending step included. "serving": the step that appends tokens sees its own fresh latents.

This module writes (regions, the paged store, encode on write, transformers' crop and batch operations);
cache/reads.py reads (decoded tokens, `StoredKeys`, segments, the attention dispatch), cache/accounting.py counts
bytes, cache/contract.py is transformers' layer contract, and cache/latent_cache.py the model's `LatentCache`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from mla_quant.cache.accounting import LayerBytes
from mla_quant.cache.contract import LatentLayerContract, host_copy, host_places, scatter_host, to_device
from mla_quant.cache.paged import PagedStore
from mla_quant.cache.reads import LayerReads
from mla_quant.quant.formats import PATHS, PathFormat, check_finite, finite_checks
from mla_quant.quant.quantizers import FP8_MAX


class LatentCacheLayer(LayerReads, LayerBytes, LatentLayerContract):
    """One attention layer's latent cache in the format `fmt` (a `CacheFormat`; None = both paths unquantized)."""

    is_sliding = False
    is_croppable = True
    is_compileable = False

    def __init__(self, fmt=None, layer_idx: int | None = None, **kwargs):
        super().__init__()
        self.fmt = fmt
        self.layer_idx = layer_idx
        self.block_size = 64 if fmt is None else fmt.block_size
        self.token_block = None if fmt is None else fmt.token_block
        self.backend_steps: Counter = Counter()  # (step type, backend) -> attention steps run, over resets
        self.deferred_checks: list | None = None  # a model's cache: where the stored parts' finite checks wait
        if fmt is not None:
            for p in PATHS:  # a lloyd path needs its fitted codebook before any token is stored
                try:
                    fmt.path(p).codebook(required=True)
                except ValueError as err:
                    raise ValueError(f"quant.{p}: {err}") from err
        self._clear()

    def _clear(self) -> None:
        self.length = 0
        self.slot_valid: torch.Tensor | None = None  # (B, S) bool
        self.store: PagedStore | None = None
        self.sinks: dict[str, torch.Tensor] = {}  # path -> (B, n_sink, d)
        self.recent: dict[str, torch.Tensor] = {}  # path -> (B, R, d), R <= fmt.recent (steady state: a ring)
        self.pending: dict[str, torch.Tensor] = {}  # path -> (B, P, d), P < token_block: a block not yet full
        self.n_sinks = self.n_recent = self.n_pending = None  # (B,) long
        self._steady_state: bool | None = None  # `_steady`'s answer while the regions stay as they are
        self._stage: _Stage | None = None  # the steady state's ring head and tokens written ahead
        self.tensor_scales: dict[str, torch.Tensor | None] = {p: None for p in PATHS}  # (B,) float32 per sequence
        self._scaled: np.ndarray | None = None  # (B,) bool on the host: which sequences have their tensor scales
        # the regions' sizes per sequence on the host (B,) int64: "sinks", "recent", "pending" (as n_sinks, ...)
        self._host: dict[str, np.ndarray] = {}
        # DeepSeek-V3.2's sparse-attention indexer keeps its own key cache next to the latent (B, S, d_index).
        self.indexer_keys: torch.Tensor | None = None

    # ------------------------------------------------------------------ format
    @property
    def quantized(self) -> bool:
        return self.fmt is not None and self.fmt.quantized

    def path_format(self, path: str) -> PathFormat:
        return PathFormat() if self.fmt is None else self.fmt.path(path)

    @property
    def where(self) -> str:
        return f"cache layer {self.layer_idx if self.layer_idx is not None else '?'}"

    @property
    def n_quantized(self) -> int:
        """Tokens in the paged store of the longest sequence (per sequence: `store.lengths`); all real tokens
        when nothing is quantized. Read from the device (a report, not a step's bookkeeping)."""
        return int(self.store.lengths.max()) if self.store is not None and self.store.batch else 0

    def stored_parts(self, path: str) -> dict[str, torch.Tensor]:
        """The stored tensors of `path` per sequence, left-aligned: {part: (B, L, *)} (L = n_quantized)."""
        dense, _ = self.store.dense()
        return {k.split("/", 1)[1]: v for k, v in dense.items() if k.startswith(path + "/")}

    # ------------------------------------------------------------------ writing
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        dims = (key_states.shape[-1], value_states.shape[-1])
        if self.fmt is not None and dims != (self.fmt.d_c, self.fmt.d_r):
            raise ValueError(f"quant format {self.fmt.name!r} was validated for (d_c, d_r) = "
                             f"{(self.fmt.d_c, self.fmt.d_r)}, got latents with {dims}")
        self.device, self.dtype = key_states.device, key_states.dtype
        self._dims = {"content": dims[0], "rope": dims[1]}
        b = key_states.shape[0]
        self.slot_valid = torch.zeros(b, 0, dtype=torch.bool, device=self.device)
        self.store = PagedStore(b, self.block_size, self.device)
        for name in ("sinks", "recent", "pending"):
            self._set_host(name, np.zeros(b, dtype=np.int64))
        if self.quantized:
            for path, x in (("content", key_states), ("rope", value_states)):
                self.sinks[path] = x.new_zeros(b, 0, x.shape[-1])  # grows to n_sink as sinks arrive
                self.recent[path] = x.new_zeros(b, 0, x.shape[-1])
                self.pending[path] = x.new_zeros(b, 0, x.shape[-1])
        self.is_initialized = True

    @torch.compiler.disable  # under torch.compile the cache's bookkeeping runs eagerly (its pages are written in place
    # through views of other dtypes, which AOT autograd does not trace); the model's math and the kernel compile
    def append(self, content: torch.Tensor, rope: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Store new tokens. content (B, T, d_c), rope (B, T, d_r), valid (B, T) bool: False marks padding.
        The regions' bookkeeping is worked out on the host from host copies of their sizes and of `valid` (read once
        per forward: every layer asks for the same tensor), the places copied to the device: the steady decode
        step reads nothing, any other append one host copy of `valid` per forward."""
        all_real = valid is None
        valid = self._count_slots(content, rope, valid)
        b, t = valid.shape
        if t == 0:
            return
        new = {"content": content.to(self.dtype), "rope": rope.to(self.dtype)}
        if not self.quantized and t == 1:  # a decode step: every row's token written past its last, the real counted
            rows, pos = self.store.reserve_ahead(1)
            self._write(rows, pos, {p: x[:, 0] for p, x in new.items()}, on_device=True)
            self.store.advance(None if all_real else valid[:, 0])
            return
        if not self.quantized:
            sb, at = host_places(self._host_valid(valid, all_real), self.device)
            self._store(sb, {p: x[at[0], at[1]] for p, x in new.items()}, at[0])
            return
        self._set_tensor_scales(new, valid, all_real)
        window = self.recent["content"].shape[1]
        if t == 1 and self._steady(window):
            self._steady_step(new, window, None if all_real else valid[:, 0])
            return
        self._regions_change()
        host = self._host
        # Each sequence's real tokens in order: [its recent window | its new tokens], then split into
        # [to sinks | leaving the window (quantized now) | the new recent window]; sizes and places on the host.
        held = np.arange(window)[None, :] < host["recent"][:, None]
        ok = np.concatenate([held, self._host_valid(valid, all_real)], axis=1)  # (B, R + T)
        seq = {p: torch.cat([self.recent[p], new[p]], dim=1) for p in PATHS}  # (B, R + T, d)
        rank = ok.cumsum(1) - 1  # (B, R + T) index among the sequence's real tokens here
        total = ok.sum(1)
        to_sink = np.minimum(np.clip(self.fmt.n_sink - host["sinks"], 0, None), total)  # (B,)
        leave = np.clip(total - to_sink - self.fmt.recent, 0, None)
        keep = total - to_sink - leave
        sink_ok = ok & (rank < to_sink[:, None])
        store_ok = ok & (rank >= to_sink[:, None]) & (rank < (to_sink + leave)[:, None])
        recent_ok = ok & (rank >= (to_sink + leave)[:, None])
        grow = int((host["sinks"] + to_sink).max()) - self.sinks["content"].shape[1]
        for p in PATHS:
            if grow > 0:
                pad = self.sinks[p].new_zeros(b, grow, self.sinks[p].shape[-1])
                self.sinks[p] = torch.cat([self.sinks[p], pad], dim=1)
            scatter_host(self.sinks[p], rank + host["sinks"][:, None], sink_ok, seq[p])
        self._set_host("sinks", host["sinks"] + to_sink)
        sb, at = host_places(store_ok, self.device)
        tokens = {p: seq[p][at[0], at[1]] for p in PATHS}
        if self.token_block:
            self._store_blocks(sb, at[0], tokens)
        else:
            self._store(sb, tokens, at[0])
        width = max(window, int(keep.max()))
        for p in PATHS:
            fresh = seq[p].new_zeros(b, width, seq[p].shape[-1])
            scatter_host(fresh, rank - (to_sink + leave)[:, None], recent_ok, seq[p])
            self.recent[p] = fresh
        self._set_host("recent", keep)

    def _host_valid(self, valid: torch.Tensor, all_real: bool) -> np.ndarray:
        """`valid` (B, T) on the host: all True when no validity was given (nothing read), else its host copy (read
        once per forward)."""
        return np.ones(tuple(valid.shape), dtype=bool) if all_real else host_copy(valid)

    def _set_host(self, name: str, counts: np.ndarray) -> None:
        """A region's per-sequence size (B,) worked out on the host: kept there and copied to the device
        (`n_sinks`, `n_recent`, `n_pending`)."""
        self._host[name] = counts
        setattr(self, f"n_{name}", to_device(counts, self.device))

    def _sync_host(self) -> None:
        """The regions' sizes read back from the device, after an edit that worked them out there (crop, batch
        edits: outside a forward)."""
        self._host = {name: getattr(self, f"n_{name}").cpu().numpy() for name in ("sinks", "recent", "pending")}
        scales = [s for s in self.tensor_scales.values() if s is not None]
        self._scaled = (scales[0] != 0).cpu().numpy() if scales else None

    fast_append = True  # the steady-state decode step below (False: always the general path; tests compare both)
    stage_tokens = 16  # steady state: at most this many window tokens quantized together before they leave it

    def _regions_change(self) -> None:
        """The sinks, window or store are about to change otherwise than by a steady step: the window back in order
        (from the ring of the steady state), and forget what holds only while the regions stay as they are (the
        steady check, the ring's head; tokens written ahead stay uncounted, and are written over)."""
        if self._stage is not None:
            self.recent = {p: self._window(p) for p in PATHS}
        self._steady_state = None
        self._stage = None

    def _window(self, path: str) -> torch.Tensor:
        """The recent window of `path` in order, oldest first (B, R, d) (a copy while the steady state's ring has
        moved)."""
        if self._stage is None:
            return self.recent[path]
        return self._ring(path, self.recent[path].shape[1])

    def _ring(self, path: str, k: int) -> torch.Tensor:
        """The k oldest tokens of each sequence's ring (B, k, d), read from its head on."""
        x, window = self.recent[path], self.recent[path].shape[1]
        slots = (self._stage.head[:, None] + torch.arange(k, device=self.device)[None, :]) % window  # (B, k)
        return x.gather(1, slots[..., None].expand(-1, -1, x.shape[-1]))

    def _steady_step(self, new: dict[str, torch.Tensor], window: int, real: torch.Tensor | None) -> None:
        """A decode step in the steady state (sinks and window full everywhere): the oldest window token of each
        sequence leaves into the store, the new token (B, 1, d) per path takes its slot; what the general path
        does then, without its per-token bookkeeping. The window is a ring (a decode step's attention over it does
        not depend on the order of its tokens, each key carrying its position): the new token is written in place
        over the leaving one, and `_Stage.head` (B,) marks each sequence's oldest. Up to `stage_tokens` of the next
        tokens to leave are quantized together and written into the pages ahead of time, not counted in
        (`PagedStore.reserve_ahead`), so a step counts one written token in (`advance`) and writes the new token:
        no window rebuilt and no encode per step. The same codes as one token at a time (each token's groups are
        its own). `real` (B,) bool: which sequences' new token is real (None: all); a padding token leaves every
        region of its sequence as it was, decided on the device (no host read)."""
        stage = self._stage
        if stage is None or stage.ahead == 0:
            stage = self._restage(window)
        self.store.advance(real)
        rows = torch.arange(stage.head.shape[0], device=self.device)
        for p in PATHS:
            x = new[p][:, 0]
            if real is not None:
                x = torch.where(real[:, None], x, self.recent[p][rows, stage.head])
            self.recent[p][rows, stage.head] = x
        stage.head = (stage.head + (1 if real is None else real.long())) % window
        stage.ahead -= 1

    def _restage(self, window: int) -> "_Stage":
        """Encode each window's oldest tokens (as many as `stage_tokens`, the window and every sequence's last
        block hold, so the store still holds at most one partly filled block per sequence) and write them past each
        sequence's stored tokens. A sequence that took fewer steps than were staged (padding tokens) has its
        staged tokens written again, with the same codes."""
        k = min(self.stage_tokens, window, self.store.room())
        if self._stage is None:
            self._stage = _Stage(head=torch.zeros(self.store.batch, dtype=torch.long, device=self.device), ahead=0)
        rows, pos = self.store.reserve_ahead(k)
        self._write(rows, pos, {p: self._ring(p, k).flatten(0, 1) for p in PATHS}, on_device=True)
        self._stage.ahead = k
        return self._stage

    def _steady(self, window: int) -> bool:
        """Every sequence has its sinks and a full recent window (of width `window` = quant.protected.recent), and
        tokens leave the window straight into the store (no token blocks pending). Known on the host once checked,
        until the regions change (a steady step keeps them as they are)."""
        if not (self.fast_append and self.token_block is None and window == self.fmt.recent > 0):
            return False
        if self._steady_state is None:
            host = self._host
            self._steady_state = bool((host["recent"] == window).all() and (host["sinks"] == self.fmt.n_sink).all())
        return self._steady_state

    def _store(self, rows: np.ndarray, tokens: dict[str, torch.Tensor], on_device: torch.Tensor) -> None:
        """Append tokens (N, d) per path, belonging to sequences `rows` (N,) ascending (on the host, and
        `on_device`), to the paged store."""
        if rows.size:
            self._write(on_device, self.store.reserve(on_device, rows), tokens)

    def _write(self, rows: torch.Tensor, pos: torch.Tensor, tokens: dict[str, torch.Tensor],
               on_device: bool = False) -> None:
        """Encode tokens (N, d) per path and write token i at position pos[i] of sequence rows[i] (reserved).
        `on_device`: their stored scales checked finite on the device (a decode step's writes: no host read)."""
        parts = {}
        for p in PATHS:
            fmt = self.path_format(p)
            scale = self.tensor_scales[p]
            encoded = fmt.encode(tokens[p], None if scale is None else scale[rows])
            if fmt.quantized:
                self._check_stored(encoded, f"{self.where}, quant.{p} ({fmt.describe()})", on_device)
            parts.update({f"{p}/{k}": v for k, v in encoded.items()})
        self.store.write(rows, pos, parts)

    def _check_stored(self, parts: dict[str, torch.Tensor], where: str, on_device: bool) -> None:
        """Refuse stored scales, zeros or values that overflowed their dtype: at once (a host read), on the device
        (`on_device`: the decode step's writes), or, in a model's cache (`deferred_checks` set), with every layer's
        checks of the forward in one host read after its last layer (`LatentCache.check_stored`)."""
        if on_device or self.deferred_checks is None:
            check_finite(parts, where, on_device)
        else:
            self.deferred_checks.extend(finite_checks(parts, where))

    def _store_blocks(self, rows: np.ndarray, on_device: torch.Tensor, tokens: dict[str, torch.Tensor]) -> None:
        """Tokens (N, d) leaving the window of sequences `rows` (N,) ascending (on the host, and `on_device`) join
        their sequence's pending tokens; every whole block of `token_block` tokens is encoded and stored, the rest
        stays pending (exact). Sizes and places worked out on the host."""
        if rows.size == 0:
            return
        pending, t = self._host["pending"], self.token_block
        b = pending.shape[0]
        counts = np.bincount(rows, minlength=b)  # (B,)
        total = pending + counts
        full = total - total % t  # (B,) tokens that now make whole blocks
        width = int(total.max())
        j = np.arange(width)[None, :]  # (1, width)
        starts = np.cumsum(counts) - counts
        pos = to_device(pending[rows] + np.arange(rows.size) - starts[rows], self.device)  # (N,)
        seq = {}
        for p in PATHS:  # each sequence's [pending | leaving] tokens, in order: (B, width, d)
            x = self.pending[p].new_zeros(b, width, self.pending[p].shape[-1])
            held = self.pending[p][:, : min(width, self.pending[p].shape[1])]
            cols = j[:, : held.shape[1]]
            scatter_host(x, np.repeat(cols, b, axis=0), cols < pending[:, None], held)
            x[on_device, pos] = tokens[p].to(x.dtype)
            seq[p] = x
        wb, at = host_places(j < full[:, None], self.device)  # (B, width): the whole blocks
        self._store(wb, {p: seq[p][at[0], at[1]] for p in PATHS}, at[0])
        keep = total - full  # (B,) < token_block
        capacity = max(self.pending["content"].shape[1], int(keep.max()))
        left = full[:, None] + j[:, :capacity]  # (B, capacity) where each new pending token sits in seq
        ok = to_device(j[:, :capacity] < keep[:, None], self.device)
        index = to_device(np.minimum(left, width - 1), self.device)
        for p in PATHS:
            gathered = seq[p].gather(1, index[..., None].expand(-1, -1, seq[p].shape[-1]))
            self.pending[p] = torch.where(ok[..., None], gathered, 0)
        self._set_host("pending", keep)

    def _set_tensor_scales(self, new: dict[str, torch.Tensor], valid: torch.Tensor, all_real: bool) -> None:
        """Per-sequence fp8 scales (granularity=tensor): amax/448 of the sequence's first append of real tokens.
        Which sequences have theirs is known on the host (`_scaled`): once all do, nothing is read."""
        paths = [p for p in PATHS if self.path_format(p).tensor_scaled]
        if not paths or (self._scaled is not None and self._scaled.all()):
            return
        b = valid.shape[0]
        for p in paths:
            if self.tensor_scales[p] is None:
                self.tensor_scales[p] = torch.zeros(b, dtype=torch.float32, device=self.device)
        scaled = np.zeros(b, dtype=bool) if self._scaled is None else self._scaled
        unset_host = ~scaled & self._host_valid(valid, all_real).any(1)  # (B,)
        if not unset_host.any():
            return
        unset = to_device(unset_host, self.device)
        groups = [paths] if self.fmt.shared_scale else [[p] for p in paths]
        for group in groups:
            amax = torch.stack([(new[p].float().abs() * valid[..., None]).amax(dim=(1, 2)) for p in group]).amax(0)
            scale = amax / FP8_MAX  # (B,)
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))
            merged = torch.where(unset, scale, self.tensor_scales[group[0]])
            for p in group:  # one tensor for a shared scale (its bytes count once)
                self.tensor_scales[p] = merged
        self._scaled = scaled | unset_host

    # ------------------------------------------------------------------ transformers' CacheLayerMixin contract
    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last -tokens_to_remove slots: per sequence its latest real tokens, recent window first, then
        pending tokens, then the store, then sinks. Stored tokens that end up inside the recent window stay
        quantized; with a token block, the kept tokens of a cut block become pending with their stored values."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens to remove, got {tokens_to_remove}")
        if not self.is_initialized:
            return
        k = min(-tokens_to_remove, self.length)
        if k == 0:
            return
        self._regions_change()
        drop = self.slot_valid[:, self.length - k :].sum(1)  # (B,) real tokens removed per sequence
        if self.quantized:
            from_recent = torch.minimum(drop, self.n_recent)
            self.n_recent = self.n_recent - from_recent
            drop = drop - from_recent
            from_pending = torch.minimum(drop, self.n_pending)
            self.n_pending = self.n_pending - from_pending
            drop = drop - from_pending
        from_store = torch.minimum(drop, self.store.lengths)
        kept = self.store.lengths - from_store
        if self.token_block and bool((kept % self.token_block).any()):
            kept = self._unblock(kept)
        self.store.truncate(kept)
        self.n_sinks = self.n_sinks - (drop - from_store)
        self.slot_valid = self.slot_valid[:, : self.length - k]
        self.length -= k
        if self.indexer_keys is not None:
            self.indexer_keys = self.indexer_keys[:, : self.length]
        self._sync_host()

    def _unblock(self, kept: torch.Tensor) -> torch.Tensor:
        """Crop inside stored blocks: of `kept` (B,) stored tokens per sequence, those past the last whole block
        (their pending tokens were all dropped) become pending with their stored (decoded) values. Returns the
        stored tokens left per sequence (whole blocks)."""
        decoded = self._decode_store(self.dtype)  # {path: (B, L, d)}
        aligned = kept - kept % self.token_block
        keep = kept - aligned  # (B,)
        width = max(self.pending["content"].shape[1], int(keep.max()))
        j = torch.arange(width, device=self.device)[None, :]
        cut = keep > 0
        for p in PATHS:
            stored = decoded[p]
            index = (aligned[:, None] + j).clamp(max=stored.shape[1] - 1)[..., None].expand(-1, -1, stored.shape[-1])
            moved = stored.gather(1, index)  # (B, width, d)
            old = self.pending[p].new_zeros(stored.shape[0], width, stored.shape[-1])
            old[:, : self.pending[p].shape[1]] = self.pending[p]
            self.pending[p] = torch.where(cut[:, None, None] & (j < keep[:, None])[..., None], moved, old)
        self.n_pending = torch.where(cut, keep, self.n_pending)
        return aligned

    def _map_batch(self, fn) -> None:
        if not self.is_initialized:
            return
        self._regions_change()
        self.slot_valid = fn(self.slot_valid).contiguous()
        self.store = self.store.rebuilt(fn)
        self.n_sinks, self.n_recent, self.n_pending = fn(self.n_sinks), fn(self.n_recent), fn(self.n_pending)
        self.sinks = {p: fn(v).contiguous() for p, v in self.sinks.items()}
        self.recent = {p: fn(v).contiguous() for p, v in self.recent.items()}
        self.pending = {p: fn(v).contiguous() for p, v in self.pending.items()}
        self.tensor_scales = self._shared_map(fn)
        if self.indexer_keys is not None:
            self.indexer_keys = fn(self.indexer_keys)
        self._sync_host()

    def _shared_map(self, fn) -> dict:
        """Apply fn to the tensor scales, keeping one tensor where both paths share it."""
        mapped = {id(s): fn(s) for s in self.tensor_scales.values() if s is not None}
        return {p: None if s is None else mapped[id(s)] for p, s in self.tensor_scales.items()}

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices])

    def _move(self, device) -> None:
        if not self.is_initialized:
            return
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        self._regions_change()
        self.store.to(device)
        self.slot_valid, self.n_sinks, self.n_recent = move(self.slot_valid), move(self.n_sinks), move(self.n_recent)
        self.n_pending = move(self.n_pending)
        self.sinks = {p: move(v) for p, v in self.sinks.items()}
        self.recent = {p: move(v) for p, v in self.recent.items()}
        self.pending = {p: move(v) for p, v in self.pending.items()}
        self.tensor_scales = self._shared_map(move)
        if self.indexer_keys is not None:
            self.indexer_keys = move(self.indexer_keys)

    def offload(self) -> None:
        self._move("cpu")

    def prefetch(self) -> None:
        if self.is_initialized and self.store.device != self.device:
            self._move(self.device)

@dataclass
class _Stage:
    """The steady state's ring: the slot of each sequence's oldest window token (`head`, (B,) long), and how many
    steps the tokens written into the pages ahead (not yet counted in) cover (`ahead`)."""

    head: torch.Tensor
    ahead: int

