"""The model's latent cache: a `transformers.Cache` with one latent layer per MLA layer (and, in a hybrid stack, the
other decoder layers' own cache layers), and its byte totals."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from transformers.cache_utils import Cache

from mla_quant.cache.layer import LatentCacheLayer
from mla_quant.quant.formats import raise_unless_finite


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
        # The stored parts' finite checks of a forward, read on the host once, after its last latent layer.
        self._checks: list = []
        for layer in latent:
            layer.deferred_checks = self._checks
        self._last_slot = layers.index(latent[-1]) if latent else -1

    def attend(self, layer_idx: int, q_latent, q_rope, content, rope, scale, mask, valid=None, **absorbed):
        """The attention of the MLA module in cache slot `layer_idx` (its decoder layer)."""
        out = self.layers[layer_idx].attend(q_latent, q_rope, content, rope, scale, mask, valid, **absorbed)
        if layer_idx == self._last_slot:
            self.check_stored()
        return out

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if layer_idx == self._last_slot:
            self.check_stored()
        return out

    def check_stored(self) -> None:
        """Refuse, naming the layer and path, any stored scale, zero or value of this forward that overflowed its
        dtype: every layer's checks in one host read."""
        checks, self._checks[:] = list(self._checks), []
        raise_unless_finite(checks)

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
