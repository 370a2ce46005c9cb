"""A latent cache layer whose storage is transformers' own quantized cache layer (`QuantoQuantizedLayer`,
`HQQQuantizedLayer`), one per sequence, holding the content latent as its keys and the RoPE key as its values
(quant options `hf_*`, mla_quant/quant/peers.py).

Each sequence's real tokens go to its own transformers layer (padding is never stored), so a sequence's cache, and
everything it scores, is the same alone and in a padded batch, as for the project's formats; what transformers does
with those tokens is left as it is (the prefill step sees its tokens unquantized, later tokens wait unquantized until
`residual_length` gathered, then the whole history is quantized again). Bytes are measured from the tensors the
transformers layers hold: packed codes, scales, zeros (shifts) and the unquantized residual.

    layer = PeerLatentCacheLayer(peer_format(cfg.quant, d_c, d_r))
    layer.attend(q_latent, q_rope, content, rope, scale, mask, valid)   # as LatentCacheLayer.attend
"""

from __future__ import annotations

import copy
import functools
import math
from collections import Counter

import torch
import transformers.cache_utils as cache_utils

from mla_quant.cache.contract import LatentLayerContract, step_type
from mla_quant.kernels.attention import latent_attention
from mla_quant.quant.peers import LIBRARIES, PeerFormat


@functools.cache
def row_class(library: str, pack: int | None) -> type:
    """transformers' quantized layer class of `library`; where its packing takes `pack` groups at once (HQQ:
    `PeerFormat.pack_rows`) a subclass that pads each tensor it quantizes with zero tokens up to whole packs of
    groups. HQQ packs several groups together and transformers hands it
    the tensor as it is, so it fails on other lengths (at 2 bits, an odd number of tokens on a path with one group per
    token). The groups are per token and zero groups add nothing to HQQ's stopping rule, so the real tokens quantize
    exactly as they would; the padding is dropped after dequantization and not counted as used bytes."""
    base = getattr(cache_utils, LIBRARIES[library][0])
    if pack is None:
        return base

    class PaddedHQQQuantizedLayer(base):
        def _quantize(self, tensor, axis):
            groups_per_token = tensor[..., 0, :].numel() // self.q_group_size
            pad = (-tensor.shape[-2]) % (pack // math.gcd(pack, groups_per_token))
            if pad:
                tensor = torch.nn.functional.pad(tensor, (0, 0, 0, pad))
            qtensor, meta = super()._quantize(tensor, axis)
            meta["padding_tokens"] = pad
            return qtensor, meta

        def _dequantize(self, qtensor):
            x = super()._dequantize(qtensor)
            pad = qtensor[1].get("padding_tokens", 0)
            return x[..., : x.shape[-2] - pad, :] if pad else x

    return PaddedHQQQuantizedLayer


def _held_tensors(state) -> list[torch.Tensor]:
    """The plain tensors inside a quantized state of transformers' layers: HQQ's (codes, meta) tuple, or a quanto
    QTensor (its inner tensors, recursively)."""
    if state is None:
        return []
    if isinstance(state, tuple):  # HQQ: (packed codes, {"scale", "zero", ...})
        codes, meta = state
        return [codes] + [v for k, v in meta.items() if k in ("scale", "zero") and torch.is_tensor(v)]
    if hasattr(state, "__tensor_flatten__"):
        names, _ = state.__tensor_flatten__()
        return [t for name in names for t in _held_tensors(getattr(state, name))]
    return [state] if torch.is_tensor(state) else []


class PeerLatentCacheLayer(LatentLayerContract):
    """One attention layer's latent cache held by transformers' quantized layer class of `fmt` (a `PeerFormat`)."""

    is_sliding = False
    is_croppable = False
    is_compileable = False

    def __init__(self, fmt: PeerFormat, layer_idx: int | None = None, **kwargs):
        super().__init__()
        self.fmt = fmt
        self.layer_idx = layer_idx
        self.backend_steps: Counter = Counter()
        self._clear()

    def _clear(self) -> None:
        self.length = 0
        self.slot_valid: torch.Tensor | None = None  # (B, S) bool
        self.rows: list = []  # per sequence: its transformers layer (None until its first real token)
        self.seen: list[tuple[torch.Tensor, torch.Tensor] | None] = []  # per sequence: (L, d_c), (L, d_r) last read
        self.indexer_keys: torch.Tensor | None = None  # a DSA indexer's keys (B, S, d_index): `update_indexer`

    def _new_row(self):
        f = self.fmt
        return row_class(f.library, f.pack_rows)(nbits=f.bits, axis_key=f.axis, axis_value=f.axis, q_group_size=f.group_size,
                             residual_length=f.residual_length)

    @property
    def quantized(self) -> bool:
        return True

    # ------------------------------------------------------------------ writing and reading
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        dims = (key_states.shape[-1], value_states.shape[-1])
        if dims != (self.fmt.d_c, self.fmt.d_r):
            raise ValueError(f"quant={self.fmt.name} was validated for (d_c, d_r) = {(self.fmt.d_c, self.fmt.d_r)}, "
                             f"got latents with {dims}")
        self.device, self.dtype = key_states.device, key_states.dtype
        b = key_states.shape[0]
        self.slot_valid = torch.zeros(b, 0, dtype=torch.bool, device=self.device)
        self.rows, self.seen = [None] * b, [None] * b
        self.is_initialized = True

    def append(self, content: torch.Tensor, rope: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Each sequence's real tokens of this step into its transformers layer; content (B, T, d_c), rope
        (B, T, d_r), valid (B, T) bool (None = all real)."""
        valid = self._count_slots(content, rope, valid)
        for row in range(valid.shape[0]):
            real = valid[row]
            if not bool(real.any()):
                continue
            c = content[row, real].to(self.dtype)[None, None]  # (1, 1, T_real, d_c)
            r = rope[row, real].to(self.dtype)[None, None]
            if self.rows[row] is None:
                self.rows[row] = self._new_row()
            keys, values = self.rows[row].update(c.contiguous(), r.contiguous())
            self.seen[row] = (keys[0, 0], values[0, 0])

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What this step's attention sees, slot-aligned: (B, S, d_c), (B, S, d_r); padding slots hold zeros."""
        if not self.is_initialized:
            raise RuntimeError("read() on an empty latent cache layer")
        b, s = self.slot_valid.shape
        out = []
        for i, d in enumerate((self.fmt.d_c, self.fmt.d_r)):
            full = torch.zeros(b, s, d, dtype=self.dtype, device=self.device)
            for row, held in enumerate(self.seen):
                if held is not None:
                    full[row, self.slot_valid[row]] = held[i].to(self.dtype)
            out.append(full)
        return out[0], out[1]

    def update_and_read(self, content, rope, valid=None) -> tuple[torch.Tensor, torch.Tensor]:
        self.append(content, rope, valid)
        return self.read()

    def attend(self, q_latent, q_rope, content, rope, scale, mask, valid=None, **absorbed) -> torch.Tensor:
        """Append this step's latents and attend over what transformers' layers return (see `LatentCacheLayer`)."""
        all_content, all_rope = self.update_and_read(content, rope, valid)
        self.backend_steps[step_type(q_latent), "torch"] += 1
        return latent_attention(q_latent, q_rope, all_content, all_rope, scale, mask, **absorbed)

    # ------------------------------------------------------------------ bytes
    def real_tokens(self) -> int:
        return 0 if self.slot_valid is None else int(self.slot_valid.sum())

    def held_bytes(self) -> int:
        """Bytes of every tensor the transformers layers hold: quantized codes, scales, zeros and the residual."""
        total = 0
        for layer in self.rows:
            if layer is not None:
                for state in (layer._quantized_keys, layer._quantized_values, layer.keys, layer.values):
                    total += sum(t.numel() * t.element_size() for t in _held_tensors(state))
        return total

    def nbytes(self) -> int:
        """Bytes of the real tokens: each quantized token's codes at `bits` per value and its scales and zeros
        (shifts), plus the residual; the packing's alignment (quanto pads its packed rows, `row_class` pads HQQ's
        tokens) is held, not used."""
        total = 0.0
        for layer in self.rows:
            if layer is None:
                continue
            for state in (layer._quantized_keys, layer._quantized_values):
                total += self._used_bytes(state)
            total += sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))
        return int(round(total))

    def byte_parts(self, act_bytes: int | None = None) -> dict[str, float]:
        """Bytes of the real tokens by part (as `LatentCacheLayer.byte_parts`): "quantized" (codes, scales, zeros),
        "full precision" (the residual), "side" (none). act_bytes: activation-dtype tensors (the residual, and the
        scales and zeros, which transformers keeps in the activation dtype) at `act_bytes` per value."""
        quantized = full = 0.0
        for layer in self.rows:
            if layer is None:
                continue
            for state in (layer._quantized_keys, layer._quantized_values):
                quantized += self._used_bytes(state, act_bytes)
            full += sum(t.numel() * (act_bytes or t.element_size()) for t in (layer.keys, layer.values))
        return {"quantized": quantized, "full precision": full, "side": 0.0}

    def _used_bytes(self, state, act_bytes: int | None = None) -> float:
        size = (lambda t: t.numel() * t.element_size()) if act_bytes is None else (lambda t: t.numel() * act_bytes)
        if isinstance(state, tuple):  # HQQ: (codes, meta), its shape including the padding tokens
            meta = state[1]
            shape = meta["shape"]
            real = 1.0 - meta.get("padding_tokens", 0) / shape[-2]
            side = sum(size(meta[k]) for k in ("scale", "zero"))
            return real * (math.prod(shape) * self.fmt.bits / 8 + side)
        side = sum(size(t) for t in (state._scale, state._shift))  # quanto: per real group
        return math.prod(state.shape) * self.fmt.bits / 8 + side

    # ------------------------------------------------------------------ batch edits
    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(f"quant={self.fmt.name}: transformers' quantized cache layers cannot be cropped "
                                  "(their quantized history is one tensor); use a project format for assisted or "
                                  "speculative decoding")

    def _select(self, index: torch.Tensor) -> None:
        """The sequences `index` (B',) in that order; a sequence taken twice gets its own copy."""
        if not self.is_initialized:
            return
        index = index.to(self.slot_valid.device)
        taken = set()
        rows, seen = [], []
        for i in index.tolist():
            layer = self.rows[i]
            rows.append(copy.deepcopy(layer) if i in taken else layer)
            seen.append(self.seen[i])
            taken.add(i)
        self.rows, self.seen = rows, seen
        self.slot_valid = self.slot_valid[index]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._select(torch.arange(len(self.rows)).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._select(torch.arange(len(self.rows))[indices])

    def offload(self) -> None:
        raise NotImplementedError(f"quant={self.fmt.name}: offloading transformers' quantized layers is not supported")

    def prefetch(self) -> None:
        return None
