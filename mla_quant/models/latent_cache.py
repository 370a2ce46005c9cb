"""The latent KV cache of MLA: per layer, the content latent c (d_c values) and the RoPE key k (d_r values).

This is the only thing an MLA model needs to keep per token (576 values at DeepSeek-V2/V3 dims). The cache is a
`transformers.Cache`, so `model(...)`, `model.generate(...)` and masking work unchanged, and every layer has a small
interface that the absorbed attention (and later the quantized formats and the Triton kernel) go through:

    layer.append(content, rope)           # content (B, T, d_c), rope (B, T, d_r)
    content, rope = layer.read()          # (B, S, d_c), (B, S, d_r): what attention sees
    layer.length                          # S
    layer.nbytes()                        # bytes of the stored tensors (valid tokens only)
    layer.attend(q_latent, q_rope, content_new, rope_new, scale, mask) -> o_latent

`attend` is the single decode/prefill read: quantized cache layers override `update_and_read`, a kernel backend
overrides `attend`.

Usage:
    cache = LatentCache.for_model(model)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=16)
    cache.nbytes(), cache.bytes_per_token_per_layer()
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from mla_quant.models.latent_attention import latent_attention


def check_latents(content: torch.Tensor, rope: torch.Tensor) -> None:
    """content (B, T, d_c) and rope (B, T, d_r) with the same B and T."""
    if content.dim() != 3 or rope.dim() != 3 or content.shape[:2] != rope.shape[:2]:
        raise ValueError(
            f"append expects content (B, T, d_c) and rope (B, T, d_r) with the same B, T; "
            f"got {tuple(content.shape)} and {tuple(rope.shape)}"
        )


class LatentCacheLayer(CacheLayerMixin):
    """One attention layer's latent cache, in full precision (the dtype of the tensors it receives)."""

    is_sliding = False
    is_croppable = True
    is_compileable = False

    def __init__(self, **kwargs):
        super().__init__()
        self.content: torch.Tensor | None = None  # (B, capacity, d_c)
        self.rope: torch.Tensor | None = None  # (B, capacity, d_r)
        self.length = 0
        # DeepSeek-V3.2's sparse-attention indexer keeps its own key cache next to the latent (B, S, d_index).
        self.indexer_keys: torch.Tensor | None = None

    # ------------------------------------------------------------------ the latent interface
    def append(self, content: torch.Tensor, rope: torch.Tensor) -> None:
        """Store new tokens. content (B, T, d_c), rope (B, T, d_r)."""
        check_latents(content, rope)
        if not self.is_initialized:
            self.lazy_initialization(content, rope)
        t = content.shape[1]
        self._reserve(self.length + t)
        self.content[:, self.length : self.length + t] = content
        self.rope[:, self.length : self.length + t] = rope
        self.length += t

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All stored tokens: content (B, S, d_c), rope (B, S, d_r) (views, no copy)."""
        if not self.is_initialized:
            raise RuntimeError("read() on an empty latent cache layer")
        return self.content[:, : self.length], self.rope[:, : self.length]

    def update_and_read(self, content: torch.Tensor, rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new tokens and return what attention must see for this step (old and new tokens)."""
        self.append(content, rope)
        return self.read()

    def attend(
        self,
        q_latent: torch.Tensor,
        q_rope: torch.Tensor,
        content: torch.Tensor,
        rope: torch.Tensor,
        scale: float,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Append this step's latents and attend over the whole cache. Returns o_latent (B, H, T, d_c)."""
        all_content, all_rope = self.update_and_read(content, rope)
        return latent_attention(q_latent, q_rope, all_content, all_rope, scale, mask)

    def nbytes(self) -> int:
        """Bytes held for the valid tokens, measured from the stored tensors."""
        if not self.is_initialized or self.length == 0:
            return 0
        content, rope = self.read()
        return content.numel() * content.element_size() + rope.numel() * rope.element_size()

    # ------------------------------------------------------------------ storage
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        b = key_states.shape[0]
        self.content = key_states.new_empty(b, 0, key_states.shape[-1])
        self.rope = value_states.new_empty(b, 0, value_states.shape[-1])
        self.length = 0
        self.is_initialized = True

    def _reserve(self, needed: int) -> None:
        # Grow geometrically so a long decode costs O(S) copies in all, not O(S^2).
        capacity = self.content.shape[1]
        if needed <= capacity:
            return
        new_capacity = max(needed, 2 * capacity, 16)
        for name in ("content", "rope"):
            old = getattr(self, name)
            new = old.new_zeros(old.shape[0], new_capacity, old.shape[2])
            new[:, : self.length] = old[:, : self.length]
            setattr(self, name, new)

    # ------------------------------------------------------------------ transformers' CacheLayerMixin contract
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """transformers' MLA classes call update(c_kv (B,1,T,d_c), k_pe (B,1,T,d_r)); same data, 4-D views."""
        content, rope = self.update_and_read(key_states[:, 0], value_states[:, 0])
        return content.unsqueeze(1), rope.unsqueeze(1)

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.content = self.rope = self.indexer_keys = None
        self.length = 0
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens to remove, got {tokens_to_remove}")
        self.length = max(0, self.length + tokens_to_remove)
        if self.indexer_keys is not None:
            self.indexer_keys = self.indexer_keys[:, : self.length]

    def _map_batch(self, fn) -> None:
        if not self.is_initialized:
            return
        self.content = fn(self.content[:, : self.length]).contiguous()
        self.rope = fn(self.rope[:, : self.length]).contiguous()
        if self.indexer_keys is not None:
            self.indexer_keys = fn(self.indexer_keys)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices])

    def offload(self) -> None:
        self._map_batch(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        if self.is_initialized and self.content.device != self.device:
            self._map_batch(lambda t: t.to(self.device, non_blocking=True))

    # ------------------------------------------------------------------ DSA indexer keys (DeepSeek-V3.2)
    def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
        if self.indexer_keys is None:
            self.indexer_keys = indexer_key_states
        else:
            self.indexer_keys = torch.cat([self.indexer_keys, indexer_key_states], dim=1)
        return self.indexer_keys


class LatentCache(Cache):
    """A `transformers.Cache` with one `LatentCacheLayer` (or a subclass) per MLA attention module."""

    def __init__(self, num_layers: int, layer_factory=LatentCacheLayer):
        super().__init__(layers=[layer_factory() for _ in range(num_layers)])

    @classmethod
    def for_model(cls, model, layer_factory=LatentCacheLayer) -> "LatentCache":
        # LongCat has two MLA blocks per decoder layer: its config's num_hidden_layers is 2 * num_layers.
        n = model.config.get_text_config(decoder=True).num_hidden_layers
        return cls(n, layer_factory)

    def attend(self, layer_idx: int, q_latent, q_rope, content, rope, scale, mask) -> torch.Tensor:
        return self.layers[layer_idx].attend(q_latent, q_rope, content, rope, scale, mask)

    def nbytes(self) -> int:
        """Bytes held by all layers, measured from the stored tensors."""
        return sum(layer.nbytes() for layer in self.layers)

    def bytes_per_token_per_layer(self) -> float:
        tokens = self.get_seq_length()
        batch = self.layers[0].content.shape[0] if self.layers[0].is_initialized else 1
        if tokens == 0:
            raise ValueError("the cache is empty: no bytes per token to report")
        return self.nbytes() / (tokens * batch * len(self.layers))
