"""The bytes a latent cache layer holds (the accounting half of `LatentCacheLayer`, cache/layer.py), measured from its
tensors: used by the real tokens (`nbytes`), allocated (`held_bytes`) and by part (`byte_parts`: quantized, full
precision, side)."""

from __future__ import annotations

from mla_quant.quant.formats import PATHS


class LayerBytes:
    """The byte accounting of `LatentCacheLayer` (its regions, store and format are the layer's)."""

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
