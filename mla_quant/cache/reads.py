"""What a latent cache layer gives attention (the reading half of `LatentCacheLayer`, cache/layer.py): its tokens
decoded (`read_compact`, `read_stored`), the keys one attention step reads block by block (`StoredKeys`), the stored
tokens as decode segments (`segments`) and the dispatch of a step to the segment kernel or the block-wise reference
(`attend`). Nothing decoded outlives the step."""

from __future__ import annotations

import torch

from mla_quant.cache.contract import scatter_rows, step_type
from mla_quant.cache.paged import read_path
from mla_quant.kernels.attention import DEFAULT_BLOCKS, CausalMask, latent_attention, visible
from mla_quant.kernels.layout import Segment
from mla_quant.kernels.torch_decode import segment_attention
from mla_quant.quant.formats import PATHS


_MASK_DIFFERS = ("a decode step's attention mask differs from the cache's record of which earlier slots hold real tokens: "
                 "pass each step's mask with the earlier columns unchanged (as generate does), or run a multi-token "
                 "step with the mask it needs")


class LayerReads:
    """The reads of `LatentCacheLayer` (its regions, store and format are the layer's)."""

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
                scatter_rows(full, offset[:, None] + j, j < n[:, None], x)
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
        (B, H, T, d_v); `blocks`: `latent_attention`'s block sizes; `sinks` (H,): attention sinks. A decode step
        whose mask hides padding only, in a format the decode kernel reads, attends over the stored segments
        (`segment_attention`: the store's codes read in place, `blocks.key` tokens at a time); any other step reads
        the stored tensors through `StoredKeys`, one block of keys decoded at a time. Nothing decoded outlives the
        step."""
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
        """True when the one query's mask hides padding slots and nothing else (segments hold no padding). A
        `CausalMask` (the 2-D padding mask) must show the cached slots as the cache recorded them, real or padding,
        as generate's mask does: checked on the device (`torch._assert_async`: no host read, a device-side error
        if it fails); any other mask (a custom 4-D mask) is compared on the host, and one that hides a real token
        takes the `StoredKeys` path."""
        if mask is None:
            return True
        slots = self.slot_valid
        if isinstance(mask, CausalMask):
            seen = mask.keys
            if seen.shape[1] == slots.shape[1] + 1:
                torch._assert_async((seen[:, :-1] == slots).all(), _MASK_DIFFERS)
                return True
        else:
            seen = visible(mask[:, 0, -1, :])  # (B, S + 1)
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


class StoredKeys:
    """What one attention step reads from a cache layer (a `LatentCacheLayer`): every slot (B, S) as stored,
    slot-aligned as `read_stored` gives it, decoded on demand one block of slots at a time (`keys(k0, k1)` -> content
    (B, k1 - k0, d_c), rope (B, k1 - k0, d_r) in the activation dtype), so the cache holds its stored tensors only and
    the workspace is one block. `fresh` (serving mode): the step's own latents (B, t, d), shown at the last t slots
    instead of their stored values. Padding slots show a neighbouring real token (attention masks them).
    A path stored over blocks of tokens (channel_block) decodes its sequences' stored blocks once per step."""

    def __init__(self, layer: LayerReads, fresh: tuple[torch.Tensor, torch.Tensor] | None = None):
        if not layer.is_initialized:
            raise RuntimeError("attention over an empty latent cache layer")
        self.layer, self.fresh = layer, fresh
        self.length = layer.slot_valid.shape[1]
        self.dims = (layer._dim("content"), layer._dim("rope"))
        self.dtype = layer.dtype
        self.index = (layer.slot_valid.long().cumsum(1) - 1).clamp(min=0)  # (B, S): the real token each slot shows
        store = layer.store
        self.n_store = store.lengths
        self.stored = bool(store.num_blocks) and store.longest > 0  # the host's bound: nothing read
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
        regions = []  # per unquantized region: which slots of the block it shows (B, Kb), and their index there
        for buf, start, n in self.dense:
            q = p - start[:, None]
            regions.append((buf, (q >= 0) & (q < n[:, None]), q.clamp(0, buf["content"].shape[1] - 1)))
        out = []
        for i, (path, d) in enumerate(zip(PATHS, self.dims)):
            x = self._stored(path, p - self.store_start[:, None], d)
            for buf, shows, q in regions:  # sinks, pending, recent: their tokens over the stored ones, where shown
                held = buf[path].gather(1, q[..., None].expand(-1, -1, d)).to(x.dtype)
                x = torch.where(shows[..., None], held, x)
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
