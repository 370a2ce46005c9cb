"""Latent cache layers whose one-token decode steps run the Triton kernel (`quant.backend=triton`).

The layer hands the kernel tensors only (mla_quant/kernels/latent_decode.py): its paged store as one segment (packed
codes, scales, zeros or values per path, the block table, tokens per sequence) and its protected sinks and recent
window as dense segments. Prefill and multi-token steps, masks that hide real tokens (DeepSeek-V3.2's sparse
indexer), and serving mode without a recent window (the step must see its own fresh latent) take the PyTorch path.
"""

from __future__ import annotations

import torch

from mla_quant.cache.layer import PATHS, LatentCacheLayer, step_type
from mla_quant.kernels.attention import visible
from mla_quant.kernels.latent_decode import PagedPath, Segment, latent_decode


def kernel_segments(layer: LatentCacheLayer) -> list[Segment]:
    """The layer's stored tokens as kernel segments: the paged store, then the sinks and the recent window."""
    store, segments = layer.store, []
    if store.num_blocks and int(store.lengths.max()) > 0:
        paths = {}
        for p in PATHS:
            fmt = layer.path_format(p)
            spec = fmt.kernel_spec(layer._dim(p))
            pool = {k.split("/", 1)[1]: v for k, v in store.pool.items() if k.startswith(p + "/")}
            data = pool["values"] if spec["bits"] == 0 else pool["codes"]
            paths[p] = PagedPath(data, pool.get("scales"), pool.get("zeros"), spec["bits"], spec["group"],
                                 spec["symmetric"], spec["pow2"])
        longest = max(len(t) for t in store.tables) * store.block_size  # host-side bound: no device sync
        segments.append(Segment(paths["content"], paths["rope"], store.block_table(), store.lengths, longest))
    if layer.quantized:
        for buffers, lengths in ((layer.sinks, layer.n_sinks), (layer.recent, layer.n_recent)):
            if buffers["content"].shape[1] and int(lengths.max()) > 0:
                segments.append(Segment.dense(buffers["content"], buffers["rope"], lengths))
    return segments


class KernelDecode:
    """Mixin for `LatentCacheLayer`: one-token decode steps attend through `latent_decode` where the format's
    backend picks the kernel for the device of the step's tensors (`CacheFormat.step_backends`)."""

    def attend(self, q_latent, q_rope, content, rope, scale, mask, valid=None):
        fresh_needed = self.quantized and self.fmt.mode == "serving" and self.fmt.recent == 0
        chosen = self.fmt.step_backends(q_latent.device.type)[step_type(q_latent)]
        if chosen != "triton" or fresh_needed or not self._hides_only_padding(mask, valid):
            return super().attend(q_latent, q_rope, content, rope, scale, mask, valid)
        self.append(content, rope, valid)
        self._drop_view()  # the kernel reads the stored tensors: no decoded copy lingers after a torch-path prefill
        out = latent_decode(q_latent[:, :, 0], q_rope[:, :, 0], scale, kernel_segments(self))
        self.backend_steps["decode", "triton"] += 1
        return out.to(q_latent.dtype)[:, :, None]

    def _hides_only_padding(self, mask, valid) -> bool:
        """True when the one query's mask hides padding slots and nothing else (the kernel never sees padding)."""
        if mask is None:
            return True
        seen = visible(mask[:, 0, -1, :])  # (B, S + 1)
        slots = self.slot_valid if self.slot_valid is not None else seen.new_zeros(seen.shape[0], 0)
        new = torch.ones_like(seen[:, -1:]) if valid is None else valid.bool()
        expected = torch.cat([slots, new], dim=1)
        return expected.shape == seen.shape and bool((seen == expected).all())


class TritonLatentCacheLayer(KernelDecode, LatentCacheLayer):
    """Latent cache layer (any format the kernel reads) whose decode steps run the Triton kernel."""
