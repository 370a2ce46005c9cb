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
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from mla_quant.cache.paged import PagedStore, read_path
from mla_quant.kernels.attention import DEFAULT_BLOCKS, CausalMask, latent_attention, segment_attention, visible
from mla_quant.kernels.layout import Segment
from mla_quant.quant.formats import PATHS, PathFormat, check_finite
from mla_quant.quant.quantizers import FP8_MAX


def check_latents(content: torch.Tensor, rope: torch.Tensor) -> None:
    """content (B, T, d_c) and rope (B, T, d_r) with the same B and T."""
    if content.dim() != 3 or rope.dim() != 3 or content.shape[:2] != rope.shape[:2]:
        raise ValueError(
            f"append expects content (B, T, d_c) and rope (B, T, d_r) with the same B, T; "
            f"got {tuple(content.shape)} and {tuple(rope.shape)}"
        )


def step_type(q_latent: torch.Tensor) -> str:
    """"decode" for one query token per sequence, "prefill" for more (q_latent (B, H, T, d_c))."""
    return "decode" if q_latent.shape[2] == 1 else "prefill"


def _scatter_rows(dest: torch.Tensor, index: torch.Tensor, ok: torch.Tensor, src: torch.Tensor) -> None:
    """dest[b, index[b, j]] = src[b, j] where ok[b, j]. dest (B, L, d), index/ok (B, J), src (B, J, d)."""
    b, j = ok.nonzero(as_tuple=True)
    dest[b, index[b, j]] = src[b, j].to(dest.dtype)


class LatentLayerContract(CacheLayerMixin):
    """transformers' `CacheLayerMixin` contract of a latent cache layer, from its `length`, `update_and_read` and
    `_clear`: the part every latent layer (ours, and the peers' in cache/peers.py) shares."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """transformers' MLA classes call update(c_kv (B,1,T,d_c), k_pe (B,1,T,d_r)); same data, 4-D views."""
        content, rope = self.update_and_read(key_states[:, 0], value_states[:, 0])
        return content.unsqueeze(1), rope.unsqueeze(1)

    def get_seq_length(self) -> int:
        return self.length

    # A DSA indexer (DeepSeek-V3.2, GLM-5, GLM-5.3, ...) keeps its own key cache next to the latent, unquantized:
    # `indexer_keys` (B, S, d_index), set to None by `_clear`.
    def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
        if self.indexer_keys is None:
            self.indexer_keys = indexer_key_states
        else:
            self.indexer_keys = torch.cat([self.indexer_keys, indexer_key_states], dim=1)
        return self.indexer_keys

    def indexer_bytes(self) -> int:
        """Bytes of the indexer's keys of the real tokens (as held: unquantized)."""
        keys = self.indexer_keys
        return 0 if keys is None else self.real_tokens() * keys.shape[-1] * keys.element_size()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self._clear()
        self.is_initialized = False

    def _count_slots(self, content: torch.Tensor, rope: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """The start of every append: check the latents, initialize on the first, count the T new slots (their
        validity joins `slot_valid`). Returns valid (B, T) bool (None: every slot real)."""
        check_latents(content, rope)
        if not self.is_initialized:
            self.lazy_initialization(content, rope)
        b, t = content.shape[:2]
        valid = torch.ones(b, t, dtype=torch.bool, device=content.device) if valid is None else valid.bool()
        if valid.shape != (b, t):
            raise ValueError(f"valid must be (B, T) = {(b, t)}, got {tuple(valid.shape)}")
        self.slot_valid = torch.cat([self.slot_valid, valid], dim=1)
        self.length += t
        return valid


class LatentCacheLayer(LatentLayerContract):
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
        when nothing is quantized."""
        return self.store.longest if self.store is not None else 0

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
        self.n_sinks = torch.zeros(b, dtype=torch.long, device=self.device)
        self.n_recent = torch.zeros(b, dtype=torch.long, device=self.device)
        self.n_pending = torch.zeros(b, dtype=torch.long, device=self.device)
        if self.quantized:
            for path, x in (("content", key_states), ("rope", value_states)):
                self.sinks[path] = x.new_zeros(b, 0, x.shape[-1])  # grows to n_sink as sinks arrive
                self.recent[path] = x.new_zeros(b, 0, x.shape[-1])
                self.pending[path] = x.new_zeros(b, 0, x.shape[-1])
        self.is_initialized = True

    @torch.compiler.disable  # under torch.compile the cache's bookkeeping runs eagerly (its pages are written in place
    # through views of other dtypes, which AOT autograd does not trace); the model's math and the kernel compile
    def append(self, content: torch.Tensor, rope: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Store new tokens. content (B, T, d_c), rope (B, T, d_r), valid (B, T) bool: False marks padding."""
        all_real = valid is None
        valid = self._count_slots(content, rope, valid)
        b, t = valid.shape
        if t == 0:
            return
        new = {"content": content.to(self.dtype), "rope": rope.to(self.dtype)}
        if not self.quantized:
            rows = valid.nonzero(as_tuple=True)[0]
            self._store(rows, {p: x[valid] for p, x in new.items()})
            return
        self._set_tensor_scales(new, valid)
        window = self.recent["content"].shape[1]
        if t == 1 and self._steady(window) and (all_real or bool(valid.all())):
            self._steady_step(new, window)
            return
        self._regions_change()
        # Each sequence's real tokens in order: [its recent window | its new tokens], then split into
        # [to sinks | leaving the window (quantized now) | the new recent window].
        held = torch.arange(window, device=self.device)[None, :] < self.n_recent[:, None]
        ok = torch.cat([held, valid], dim=1)  # (B, R + T)
        seq = {p: torch.cat([self.recent[p], new[p]], dim=1) for p in PATHS}  # (B, R + T, d)
        rank = ok.long().cumsum(1) - 1  # (B, R + T) index among the sequence's real tokens here
        total = ok.sum(1)
        to_sink = torch.clamp(self.fmt.n_sink - self.n_sinks, min=0).minimum(total)  # (B,)
        leave = torch.clamp(total - to_sink - self.fmt.recent, min=0)
        keep = total - to_sink - leave
        sink_ok = ok & (rank < to_sink[:, None])
        store_ok = ok & (rank >= to_sink[:, None]) & (rank < (to_sink + leave)[:, None])
        recent_ok = ok & (rank >= (to_sink + leave)[:, None])
        grow = int((self.n_sinks + to_sink).max()) - self.sinks["content"].shape[1]
        for p in PATHS:
            if grow > 0:
                pad = self.sinks[p].new_zeros(b, grow, self.sinks[p].shape[-1])
                self.sinks[p] = torch.cat([self.sinks[p], pad], dim=1)
            _scatter_rows(self.sinks[p], rank + self.n_sinks[:, None], sink_ok, seq[p])
        self.n_sinks = self.n_sinks + to_sink
        rows = store_ok.nonzero(as_tuple=True)[0]
        tokens = {p: seq[p][store_ok] for p in PATHS}
        if self.token_block:
            self._store_blocks(rows, tokens)
        else:
            self._store(rows, tokens)
        width = max(window, int(keep.max()))
        for p in PATHS:
            fresh = seq[p].new_zeros(b, width, seq[p].shape[-1])
            _scatter_rows(fresh, rank - (to_sink + leave)[:, None], recent_ok, seq[p])
            self.recent[p] = fresh
        self.n_recent = keep

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
        if self._stage is None or not self._stage.head:
            return self.recent[path]
        return torch.roll(self.recent[path], -self._stage.head, dims=1)

    def _steady_step(self, new: dict[str, torch.Tensor], window: int) -> None:
        """A decode step in the steady state (sinks and window full everywhere): the oldest window token of each
        sequence leaves into the store, the new token (B, 1, d) per path takes its slot; what the general path
        does then, without its per-token bookkeeping. The window is a ring (a decode step's attention over it does
        not depend on the order of its tokens, each key carrying its position): the new token is written in place
        over the leaving one, and `_Stage.head` marks the oldest. Up to `stage_tokens` of the next tokens to leave
        are quantized together and written into the pages ahead of time, not counted in
        (`PagedStore.reserve_ahead`), so a step counts one written token in (`advance`) and writes the new token:
        no window rebuilt and no encode per step. The same codes as one token at a time (each token's groups are
        its own)."""
        stage = self._stage
        if stage is None or stage.ahead == 0:
            stage = self._restage(window)
        self.store.advance()
        for p in PATHS:
            self.recent[p][:, stage.head] = new[p][:, 0]
        stage.head = (stage.head + 1) % window
        stage.ahead -= 1

    def _restage(self, window: int) -> "_Stage":
        """Encode the window's oldest tokens (as many as `stage_tokens`, the window and every sequence's last
        block hold, so the store still holds at most one partly filled block per sequence) and write them past each
        sequence's stored tokens."""
        k = min(self.stage_tokens, window, self.store.room())
        head = 0 if self._stage is None else self._stage.head
        slots = torch.arange(head, head + k, device=self.device) % window
        rows, pos = self.store.reserve_ahead(k)
        self._write(rows, pos, {p: self.recent[p][:, slots].flatten(0, 1) for p in PATHS})
        self._stage = _Stage(head=head, ahead=k)
        return self._stage

    def _steady(self, window: int) -> bool:
        """Every sequence has its sinks and a full recent window (of width `window` = quant.protected.recent), and
        tokens leave the window straight into the store (no token blocks pending). Known on the host once checked,
        until the regions change (a steady step keeps them as they are)."""
        if not (self.fast_append and self.token_block is None and window == self.fmt.recent > 0):
            return False
        if self._steady_state is None:
            self._steady_state = bool((self.n_recent == window).all()) and bool((self.n_sinks == self.fmt.n_sink).all())
        return self._steady_state

    def _store(self, rows: torch.Tensor, tokens: dict[str, torch.Tensor]) -> None:
        """Append tokens (N, d) per path, belonging to sequences `rows` (N,) ascending, to the paged store."""
        if rows.numel():
            self._write(rows, self.store.reserve(rows), tokens)

    def _write(self, rows: torch.Tensor, pos: torch.Tensor, tokens: dict[str, torch.Tensor]) -> None:
        """Encode tokens (N, d) per path and write token i at position pos[i] of sequence rows[i] (reserved)."""
        parts = {}
        for p in PATHS:
            fmt = self.path_format(p)
            scale = self.tensor_scales[p]
            encoded = fmt.encode(tokens[p], None if scale is None else scale[rows])
            if fmt.quantized:
                check_finite(encoded, f"{self.where}, quant.{p} ({fmt.describe()})")
            parts.update({f"{p}/{k}": v for k, v in encoded.items()})
        self.store.write(rows, pos, parts)

    def _store_blocks(self, rows: torch.Tensor, tokens: dict[str, torch.Tensor]) -> None:
        """Tokens (N, d) leaving the window of sequences `rows` (N,) ascending join their sequence's pending tokens;
        every whole block of `token_block` tokens is encoded and stored, the rest stays pending (exact)."""
        if rows.numel() == 0:
            return
        b, t = self.n_pending.shape[0], self.token_block
        counts = torch.bincount(rows, minlength=b)  # (B,)
        total = self.n_pending + counts
        full = total - total % t  # (B,) tokens that now make whole blocks
        width = int(total.max())
        j = torch.arange(width, device=self.device)[None, :]  # (1, width)
        starts = torch.cumsum(counts, 0) - counts
        pos = self.n_pending[rows] + torch.arange(rows.numel(), device=self.device) - starts[rows]  # (N,)
        seq = {}
        for p in PATHS:  # each sequence's [pending | leaving] tokens, in order: (B, width, d)
            x = self.pending[p].new_zeros(b, width, self.pending[p].shape[-1])
            held = self.pending[p][:, : min(width, self.pending[p].shape[1])]
            _scatter_rows(x, j[:, : held.shape[1]].expand(b, -1), j[:, : held.shape[1]] < self.n_pending[:, None],
                          held)
            x[rows, pos] = tokens[p].to(x.dtype)
            seq[p] = x
        whole = j < full[:, None]  # (B, width)
        self._store(whole.nonzero(as_tuple=True)[0], {p: seq[p][whole] for p in PATHS})
        keep = total - full  # (B,) < token_block
        capacity = max(self.pending["content"].shape[1], int(keep.max()))
        left = full[:, None] + j[:, :capacity]  # (B, capacity) where each new pending token sits in seq
        ok = j[:, :capacity] < keep[:, None]
        for p in PATHS:
            index = left.clamp(max=width - 1)[..., None].expand(-1, -1, seq[p].shape[-1])
            self.pending[p] = torch.where(ok[..., None], seq[p].gather(1, index), 0)
        self.n_pending = keep

    def _set_tensor_scales(self, new: dict[str, torch.Tensor], valid: torch.Tensor) -> None:
        """Per-sequence fp8 scales (granularity=tensor): amax/448 of the sequence's first append of real tokens."""
        paths = [p for p in PATHS if self.path_format(p).tensor_scaled]
        if not paths:
            return
        b = valid.shape[0]
        for p in paths:
            if self.tensor_scales[p] is None:
                self.tensor_scales[p] = torch.zeros(b, dtype=torch.float32, device=self.device)
        unset = (self.tensor_scales[paths[0]] == 0) & valid.any(1)  # (B,)
        if not bool(unset.any()):
            return
        groups = [paths] if self.fmt.shared_scale else [[p] for p in paths]
        for group in groups:
            amax = torch.stack([(new[p].float().abs() * valid[..., None]).amax(dim=(1, 2)) for p in group]).amax(0)
            scale = amax / FP8_MAX  # (B,)
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))
            merged = torch.where(unset, scale, self.tensor_scales[group[0]])
            for p in group:  # one tensor for a shared scale (its bytes count once)
                self.tensor_scales[p] = merged

    # ------------------------------------------------------------------ reading
    def read_compact(self, dtype: torch.dtype | None = None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Each sequence's real tokens as stored, in order, left-aligned: {path: (B, L, d)}, lengths (B,).
        Quantized tokens are decoded to `dtype` (default: the activation dtype), into a new tensor: the cache keeps
        no decoded copy (attention reads the stored tensors block by block, `StoredKeys`)."""
        return self._decode_all(self.dtype if dtype is None else dtype)

    def _decode_store(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Every stored token decoded to `dtype`, left-aligned per sequence: {path: (B, L, d)} (L = n_quantized)."""
        dense, _ = self.store.dense()
        out = {}
        for p in PATHS:
            d = self._dim(p)
            if dense:
                parts = {k.split("/", 1)[1]: v for k, v in dense.items() if k.startswith(p + "/")}
                scale = self.tensor_scales[p]
                scale = None if scale is None else scale[:, None].expand(-1, next(iter(parts.values())).shape[1])
                out[p] = self.path_format(p).decode(parts, d, dtype, scale)
            else:
                out[p] = torch.zeros(self.slot_valid.shape[0], 0, d, dtype=dtype, device=self.device)
        return out

    def _decode_all(self, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """read_compact in any dtype: every stored token decoded to `dtype`, the pieces assembled."""
        decoded, n_store = self._decode_store(dtype), self.store.lengths
        pieces = {p: [] for p in PATHS}
        for p in PATHS:
            stored = decoded[p]
            if self.quantized:
                pieces[p] = [(self.sinks[p], self.n_sinks), (stored, n_store), (self.pending[p], self.n_pending),
                             (self._window(p), self.n_recent)]
            else:
                pieces[p] = [(stored, n_store)]
        lengths = sum(n for _, n in pieces["content"])
        if len(pieces["content"]) == 1:
            return {p: pieces[p][0][0].to(dtype) for p in PATHS}, lengths
        longest = int(lengths.max())
        out = {}
        for p in PATHS:
            full = torch.zeros(lengths.shape[0], longest + 1, self._dim(p), dtype=dtype, device=self.device)
            offset = torch.zeros_like(lengths)
            for x, n in pieces[p]:
                j = torch.arange(x.shape[1], device=self.device)[None, :]
                _scatter_rows(full, offset[:, None] + j, j < n[:, None], x)
                offset = offset + n
            out[p] = full[:, :longest]
        return out, lengths

    def _dim(self, path: str) -> int:
        return self._dims[path]

    def read_stored(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every slot as stored, slot-aligned: (B, S, d_c), (B, S, d_r). Padding slots hold arbitrary values
        (attention masks them)."""
        if not self.is_initialized:
            raise RuntimeError("read() on an empty latent cache layer")
        compact, lengths = self.read_compact(dtype)
        b, s = self.slot_valid.shape
        if compact["content"].shape[1] == s and bool(self.slot_valid.all()):
            return compact["content"], compact["rope"]
        if compact["content"].shape[1] == 0:
            return tuple(compact[p].new_zeros(b, s, compact[p].shape[-1]) for p in PATHS)
        index = (self.slot_valid.long().cumsum(1) - 1).clamp(min=0)  # (B, S) the real token each slot shows
        return tuple(compact[p].gather(1, index[..., None].expand(-1, -1, compact[p].shape[-1])) for p in PATHS)

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.read_stored()

    def update_and_read(self, content, rope, valid=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Append, then what this step's attention sees, every slot at once: in serving mode its own tokens fresh,
        in simulated stored."""
        keys = self._step_keys(content, rope, valid)
        return keys(0, keys.length)

    def _step_keys(self, content, rope, valid) -> "StoredKeys":
        """Append this step's latents; what its attention reads (serving mode: its own tokens fresh)."""
        fresh = (content, rope) if self.quantized and self.fmt.mode == "serving" and content.shape[1] > 0 else None
        self.append(content, rope, valid)
        return StoredKeys(self, fresh)

    def attend(self, q_latent, q_rope, content, rope, scale, mask, valid=None, blocks=None, w_uk=None, w_uv=None,
               sinks=None) -> torch.Tensor:
        """Append this step's latents and attend over the whole cache. Returns o_latent (B, H, T, d_c).
        With w_uk (H, d_nope, d_c), q_latent is q_nope; with w_uv (H, d_v, d_c) the result is per-head values
        (B, H, T, d_v); `blocks`: `latent_attention`'s block sizes; `sinks` (H,): attention sinks. A decode step whose mask hides padding only, in
        a format the decode kernel reads, attends over the stored segments (`segment_attention`: the store's codes
        read in place, `blocks.key` tokens at a time); any other step reads the stored tensors through
        `StoredKeys`, one block of keys decoded at a time. Nothing decoded outlives the step."""
        if self._reads_segments(q_latent, mask, valid):
            self.append(content, rope, valid)
            self.backend_steps["decode", "torch"] += 1
            blocks = DEFAULT_BLOCKS if blocks is None else blocks
            keys = blocks.keys_per_block(1) if blocks.blocked else None  # the workspace of a one-query step
            return self._decode_segments(q_latent, q_rope, scale, w_uk, w_uv,
                                         lambda q, qr: segment_attention(q, qr, scale, self.segments(), keys,
                                                                         sinks))
        keys = self._step_keys(content, rope, valid)
        self.backend_steps[step_type(q_latent), "torch"] += 1
        return latent_attention(q_latent, q_rope, keys, None, scale, mask, blocks=blocks, w_uk=w_uk, w_uv=w_uv,
                                sinks=sinks)

    @staticmethod
    def _decode_segments(q_latent, q_rope, scale, w_uk, w_uv, attend) -> torch.Tensor:
        """A one-query step over segments: q_latent (formed from q_nope with w_uk), attend(q (B, H, d_c),
        q_rope (B, H, d_r)) -> (B, H, d_c), then the per-head values with w_uv. Returns (B, H, 1, d)."""
        q = (q_latent if w_uk is None else q_latent @ w_uk)[:, :, 0]  # (B, H, d_c)
        out = attend(q, q_rope[:, :, 0]).to(q.dtype)[:, :, None]
        return out if w_uv is None else out @ w_uv.transpose(-1, -2)

    def _reads_segments(self, q_latent, mask, valid) -> bool:
        """A decode step that the stored segments serve: one query token, every path in a format the decode kernel
        reads (int at 2/4/8 bits, or unquantized), its mask hiding padding slots only, and in serving mode a recent
        window for the step's fresh token."""
        if q_latent.shape[2] != 1 or (self.fmt is not None and self.fmt.kernel_unsupported() is not None):
            return False
        if self.quantized and self.fmt.mode == "serving" and self.fmt.recent == 0:
            return False
        return self._hides_only_padding(mask, valid)

    def _hides_only_padding(self, mask, valid) -> bool:
        """True when the one query's mask hides padding slots and nothing else (segments hold no padding)."""
        if mask is None:
            return True
        seen = mask.keys if isinstance(mask, CausalMask) else visible(mask[:, 0, -1, :])  # (B, S + 1)
        slots = self.slot_valid if self.slot_valid is not None else seen.new_zeros(seen.shape[0], 0)
        new = torch.ones_like(seen[:, -1:]) if valid is None else valid.bool()
        expected = torch.cat([slots, new], dim=1)
        return expected.shape == seen.shape and bool((seen == expected).all())

    def segments(self) -> list[Segment]:
        """The stored tokens as decode segments (what `segment_attention` and the Triton kernel read, tensors only):
        the paged store (per path, views of its page pool: codes or values, scales, zeros; the block table, tokens
        per sequence), then the sinks and the recent window as dense buffers. Only formats the kernel reads."""
        store, segments = self.store, []
        if store.num_blocks and store.longest > 0:
            pool = store.pool  # the store's part views (made once, outside any compiled region)
            paths = {p: read_path(self.path_format(p), self._dim(p), store.layouts[p], store.pages[p], pool)
                     for p in PATHS}
            longest = -(-store.longest // store.block_size) * store.block_size  # host-side bound: no device sync
            segments.append(Segment(paths["content"], paths["rope"], store.block_table(), store.lengths, longest))
        if self.quantized:
            for buffers, lengths in ((self.sinks, self.n_sinks), (self.recent, self.n_recent)):
                if buffers["content"].shape[1]:
                    segments.append(Segment.dense(buffers["content"], buffers["rope"], lengths))
        return segments

    # ------------------------------------------------------------------ bytes
    def real_tokens(self) -> int:
        return 0 if self.slot_valid is None else int(self.slot_valid.sum())

    def _protected_bytes(self, held: bool) -> int:
        return self._window_bytes(held) + self._tensor_scale_bytes(held)

    def _window_bytes(self, held: bool, act_bytes: int | None = None) -> int:
        """Sinks, recent and pending tokens: their slots (held) or the real ones, at their dtype's size or `act_bytes`
        per value."""
        total = 0
        for p in self.sinks:
            per_token = self.sinks[p].shape[-1] * (act_bytes or self.sinks[p].element_size())
            if held:
                slots = self.sinks[p].shape[1] + self.recent[p].shape[1] + self.pending[p].shape[1]
                total += slots * self.sinks[p].shape[0] * per_token
            else:
                total += int(self.n_sinks.sum() + self.n_recent.sum() + self.n_pending.sum()) * per_token
        return total

    def _tensor_scale_bytes(self, held: bool) -> int:
        """Per-sequence fp8 tensor scales (one tensor when shared by both paths): all slots, or the set ones."""
        scales = {id(s): s for s in self.tensor_scales.values() if s is not None}
        return sum((s.numel() if held else int((s > 0).sum())) * s.element_size() for s in scales.values())

    def codebook_bytes(self) -> int:
        """Bytes of the layer's lloyd codebooks (float32 levels per path, shared by every sequence)."""
        books = [self.path_format(p).codebook() for p in PATHS] if self.quantized else []
        return sum(t.numel() * t.element_size() for t in books if t is not None)

    def nbytes(self) -> int:
        """Bytes used by the real tokens, measured from the stored tensors: protected and pending tokens, codes,
        scales, zeros, per-sequence tensor scales, and the layer's codebooks."""
        if not self.is_initialized:
            return 0
        return self.store.used_bytes() + self._protected_bytes(held=False) + self.codebook_bytes()

    def byte_parts(self, act_bytes: int | None = None) -> dict[str, float]:
        """Bytes used by the real tokens, by part: "quantized" (the paged store's codes, scales and zeros; a path
        the format leaves unquantized in its activation dtype), "full precision" (sinks, recent window, pending tokens;
        every token when nothing is quantized) and "side" (per-sequence tensor scales, the layer's codebooks).
        act_bytes=None: as held (their sum is `nbytes()`); else what activation-dtype values would take at
        `act_bytes` each (2: a BF16 checkpoint's cache, whatever dtype this run computes in)."""
        if not self.is_initialized:
            return {"quantized": 0.0, "full precision": 0.0, "side": 0.0}
        tokens = self._window_bytes(held=False, act_bytes=act_bytes)
        side = self._tensor_scale_bytes(held=False) + self.codebook_bytes()
        stored = self.store.used_bytes()
        if act_bytes is not None:
            n = int(self.store.lengths.sum())
            stored = (n * sum(self.path_format(p).bytes_per_token(self._dims[p], act_bytes) for p in PATHS)
                      if self.quantized else n * sum(self._dims.values()) * act_bytes)
        if not self.quantized:
            return {"quantized": 0.0, "full precision": float(stored + tokens), "side": float(side)}
        return {"quantized": float(stored), "full precision": float(tokens), "side": float(side)}

    def held_bytes(self) -> int:
        """Bytes allocated: whole blocks of the paged store plus the protected and pending buffers."""
        if not self.is_initialized:
            return 0
        return self.store.held_bytes() + self._protected_bytes(held=True) + self.codebook_bytes()

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
    """The steady state's ring: the slot of the window's oldest token (`head`), and how many of the oldest tokens are
    written into the pages ahead, not yet counted in (`ahead`)."""

    head: int
    ahead: int


class StoredKeys:
    """What one attention step reads from a cache layer: every slot (B, S) as stored, slot-aligned as `read_stored`
    gives it, decoded on demand one block of slots at a time (`keys(k0, k1)` -> content (B, k1 - k0, d_c), rope
    (B, k1 - k0, d_r) in the activation dtype), so the cache holds its stored tensors only and the workspace is one
    block. `fresh` (serving mode): the step's own latents (B, t, d), shown at the last t slots instead of their
    stored values. Padding slots show a neighbouring real token (attention masks them).
    A path stored over blocks of tokens (channel_block) decodes its sequences' stored blocks once per step."""

    def __init__(self, layer: LatentCacheLayer, fresh: tuple[torch.Tensor, torch.Tensor] | None = None):
        if not layer.is_initialized:
            raise RuntimeError("attention over an empty latent cache layer")
        self.layer, self.fresh = layer, fresh
        self.length = layer.slot_valid.shape[1]
        self.dims = (layer._dim("content"), layer._dim("rope"))
        self.dtype = layer.dtype
        self.index = (layer.slot_valid.long().cumsum(1) - 1).clamp(min=0)  # (B, S): the real token each slot shows
        store = layer.store
        self.n_store = store.lengths
        self.stored = bool(store.num_blocks) and int(self.n_store.max()) > 0
        first = layer.n_sinks if layer.quantized else torch.zeros_like(self.n_store)
        self.store_start = first  # (B,) index of each sequence's first stored token among its real tokens
        dense = []  # (buffers, first index, count) of the unquantized regions
        if layer.quantized:
            dense = [(layer.sinks, torch.zeros_like(first), layer.n_sinks),
                     (layer.pending, first + self.n_store, layer.n_pending),
                     ({p: layer._window(p) for p in PATHS}, first + self.n_store + layer.n_pending, layer.n_recent)]
        self.dense = [(buf, start, n) for buf, start, n in dense if buf["content"].shape[1]]
        self._whole: dict[str, torch.Tensor] | None = None  # channel_block: the store decoded once per step

    def __call__(self, k0: int, k1: int) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.index[:, k0:k1]  # (B, Kb) each slot's real-token index
        regions = []  # the slots (b, j) of the block each unquantized region shows, and their index there
        for buf, start, n in self.dense:
            q = p - start[:, None]
            b, j = ((q >= 0) & (q < n[:, None])).nonzero(as_tuple=True)
            if b.numel():
                regions.append((buf, b, j, q[b, j]))
        out = []
        for i, (path, d) in enumerate(zip(PATHS, self.dims)):
            x = self._stored(path, p - self.store_start[:, None], d)
            for buf, b, j, q in regions:  # a few tokens per sequence (sinks, pending, recent): written over
                x[b, j] = buf[path][b, q].to(x.dtype)
            if self.fresh is not None:  # serving: the step's own tokens at the last t slots
                new = self.fresh[i]
                t = new.shape[1]
                if k1 > self.length - t:
                    lo = max(k0, self.length - t)
                    x[:, lo - k0:] = new[:, lo - (self.length - t):k1 - (self.length - t)].to(x.dtype)
            out.append(x)
        return out[0], out[1]

    def _stored(self, path: str, q: torch.Tensor, d: int) -> torch.Tensor:
        """The stored tokens q (B, Kb) (clamped into each sequence's store) of `path`, decoded: (B, Kb, d)."""
        if not self.stored:
            return torch.zeros(*q.shape, d, dtype=self.dtype, device=q.device)
        layer, fmt = self.layer, self.layer.path_format(path)
        q = torch.minimum(q.clamp(min=0), (self.n_store - 1).clamp(min=0)[:, None])
        if fmt.blocked:  # decoded in whole token blocks, once per step
            if self._whole is None:
                self._whole = layer._decode_store(self.dtype)
            return self._whole[path].gather(1, q[..., None].expand(-1, -1, d))
        store = layer.store
        names = [n for n in store.part_names() if n.startswith(path + "/")]
        parts = store.gather_grid(q, names)
        parts = {n.split("/", 1)[1]: v for n, v in parts.items()}
        scale = layer.tensor_scales[path]
        scale = None if scale is None else scale[:, None].expand_as(q)
        return fmt.decode(parts, d, self.dtype, scale)


class LatentCache(Cache):
    """A `transformers.Cache` with one `LatentCacheLayer` (or a subclass) per MLA layer; in a hybrid stack, the other
    decoder layers' own transformers cache layers (linear attention's recurrent and convolution states) beside
    them, each in its decoder layer's slot."""

    def __init__(self, num_layers: int, layer_factory=LatentCacheLayer, other_layers: Mapping[int, Any] | None = None):
        """`layer_factory`: a zero-argument layer constructor, or a list of them, one per MLA layer (a per-layer
        format). `other_layers`: {slot: cache layer} of the decoder layers that are not MLA; the MLA layers fill the
        remaining slots in order (MLA layer i keeps `layer_idx` i)."""
        if isinstance(layer_factory, (list, tuple)):
            if len(layer_factory) != num_layers:
                raise ValueError(f"a cache format per layer for {len(layer_factory)} layers (quant.layers); the model "
                                 f"has {num_layers} cache layers")
            latent = [make() for make in layer_factory]
        else:
            latent = [layer_factory() for _ in range(num_layers)]
        for idx, layer in enumerate(latent):
            layer.layer_idx = idx
        other_layers = dict(other_layers or {})
        slots = num_layers + len(other_layers)
        free = iter(latent)
        layers = [other_layers[i] if i in other_layers else next(free) for i in range(slots)]
        self.latent_layers = latent
        super().__init__(layers=layers)

    def attend(self, layer_idx: int, q_latent, q_rope, content, rope, scale, mask, valid=None, **absorbed):
        """The attention of the MLA module in cache slot `layer_idx` (its decoder layer)."""
        return self.layers[layer_idx].attend(q_latent, q_rope, content, rope, scale, mask, valid, **absorbed)

    def nbytes(self) -> int:
        """Bytes used by all latent layers (valid tokens only), measured from the stored tensors."""
        return sum(layer.nbytes() for layer in self.latent_layers)

    def byte_parts(self, act_bytes: int | None = None) -> dict[str, float]:
        """Every latent layer's `byte_parts`, summed."""
        out: dict[str, float] = {}
        for layer in self.latent_layers:
            for part, b in layer.byte_parts(act_bytes).items():
                out[part] = out.get(part, 0.0) + b
        return out

    def held_bytes(self) -> int:
        """Bytes allocated by all latent layers (whole blocks, protected buffers)."""
        return sum(layer.held_bytes() for layer in self.latent_layers)

    def indexer_bytes(self) -> int:
        """Bytes of the DSA indexers' keys (unquantized, beside the latent) of the real tokens, over every layer."""
        return sum(layer.indexer_bytes() for layer in self.latent_layers)

    def state_bytes(self) -> int:
        """Bytes of the other decoder layers' states (a hybrid's linear-attention recurrent and convolution states),
        counted apart from the latent cache: they do not grow with the tokens."""
        latent = {id(layer) for layer in self.latent_layers}
        total = 0
        for layer in self.layers:
            if id(layer) in latent:
                continue
            for name in ("recurrent_states", "conv_states", "keys", "values"):
                states = getattr(layer, name, None)
                tensors = states.values() if isinstance(states, dict) else [states]
                total += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
        return total

    def sequences(self) -> int:
        """The batch size of what the cache holds (0 while empty)."""
        valid = self.latent_layers[0].slot_valid if self.latent_layers else None
        return 0 if valid is None else int(valid.shape[0])

    def backends_run(self) -> dict[str, str]:
        """{step type: backend(s) that ran it, "+"-joined} over every latent layer, for the run record."""
        ran: dict[str, set] = {}
        for layer in self.latent_layers:
            for step, backend in getattr(layer, "backend_steps", {}):
                ran.setdefault(step, set()).add(backend)
        return {step: "+".join(sorted(b)) for step, b in sorted(ran.items())}

    def bytes_per_token_per_layer(self, held: bool = False) -> float:
        tokens = self.latent_layers[0].real_tokens()
        if tokens == 0:
            raise ValueError("the cache is empty: no bytes per token to report")
        return (self.held_bytes() if held else self.nbytes()) / (tokens * len(self.latent_layers))

