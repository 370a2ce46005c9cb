"""transformers' cache-layer contract shared by every latent cache layer (ours in cache/layer.py, the peers' in
cache/peers.py), and the small helpers the layers share: the latents' shape check, the step type, a row scatter."""

from __future__ import annotations

import weakref

import numpy as np
import torch
from transformers.cache_utils import CacheLayerMixin


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


def scatter_rows(dest: torch.Tensor, index: torch.Tensor, ok: torch.Tensor, src: torch.Tensor) -> None:
    """dest[b, index[b, j]] = src[b, j] where ok[b, j]. dest (B, L, d), index/ok (B, J), src (B, J, d)."""
    b, j = ok.nonzero(as_tuple=True)
    dest[b, index[b, j]] = src[b, j].to(dest.dtype)


def host_places(ok: np.ndarray, device: torch.device) -> tuple[np.ndarray, torch.Tensor]:
    """The (b, j) where ok (B, J) holds, found on the host: (the rows b on the host, (2, N) long [b; j] on `device`),
    so `x[at[0], at[1]]` takes them from a device tensor (no device value read)."""
    b, j = ok.nonzero()
    return b, to_device(np.stack([b, j]), device)


def scatter_host(dest: torch.Tensor, index: np.ndarray, ok: np.ndarray, src: torch.Tensor) -> None:
    """`scatter_rows` with index and ok (B, J) on the host (numpy): the places are worked out there and copied to
    the device (no device value read)."""
    b, j = ok.nonzero()
    if b.size:
        bji = to_device(np.stack([b, j, index[b, j]]), dest.device)
        dest[bji[0], bji[2]] = src[bji[0], bji[1]].to(dest.dtype)


def to_device(x: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array (bookkeeping worked out on the host) as a tensor on `device`: on a GPU copied from pinned memory
    without waiting for the device's stream."""
    t = torch.from_numpy(np.ascontiguousarray(x))
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


_last_host: tuple | None = None  # (weak reference to a device tensor, its version, its host copy)


def host_copy(x: torch.Tensor) -> np.ndarray:
    """`x` (a step's key validity) on the host: read once while the same tensor, unchanged, is asked for again
    (every layer of a forward asks for the same one: `CausalMask.validity`), or given by `remember_host`."""
    if _last_host is not None and _last_host[0]() is x and _last_host[1] == x._version:
        return _last_host[2]
    host = x.cpu().numpy()
    remember_host(x, host)
    return host


def remember_host(x: torch.Tensor, host: np.ndarray) -> None:
    """Record `host` as the host copy of `x` as it is now (read already by the caller)."""
    global _last_host
    _last_host = (weakref.ref(x), x._version, host)


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
        if valid is None:
            valid = torch.ones(b, t, dtype=torch.bool, device=content.device)
        elif valid.dtype != torch.bool:  # a bool mask kept as the same tensor: its host copy is read once per forward
            valid = valid.bool()
        if valid.shape != (b, t):
            raise ValueError(f"valid must be (B, T) = {(b, t)}, got {tuple(valid.shape)}")
        self.slot_valid = torch.cat([self.slot_valid, valid], dim=1)
        self.length += t
        return valid
