"""Latent cache layers whose one-token decode steps run the Triton kernel (`quant.backend=triton`).

The layer hands the kernel tensors only (mla_quant/kernels/latent_decode.py): its paged store as one segment (per
path, views of its one page pool: the packed codes or values, scales and zeros of a block side by side in one page;
the block table, tokens per sequence) and its protected sinks and recent window as dense segments. Prefill and
multi-token steps, masks that hide real tokens (DeepSeek-V3.2's sparse indexer), and serving mode without a recent
window (the step must see its own fresh latent) take the PyTorch path.
Tokens leaving the recent window are quantized and written into the pages by the Triton store kernel
(mla_quant/kernels/quant_store.py) where decode steps run the kernel.
"""

from __future__ import annotations

import torch

from mla_quant.cache.layer import PATHS, LatentCacheLayer, step_type
from mla_quant.kernels.attention import CausalMask, visible
from mla_quant.kernels.latent_decode import PagedPath, Segment, latent_decode
from mla_quant.kernels.layout import WordLayout
from mla_quant.kernels.quant_store import kernel_store_unsupported, quantize_append
from mla_quant.quant.formats import check_finite
from mla_quant.quant.quantizers import SCALE_DTYPES, ZERO_DTYPES


def kernel_segments(layer: LatentCacheLayer) -> list[Segment]:
    """The layer's stored tokens as kernel segments: the paged store, then the sinks and the recent window."""
    store, segments = layer.store, []
    if store.num_blocks and int(store.lengths.max()) > 0:
        paths = {}
        for p in PATHS:
            fmt = layer.path_format(p)
            spec = fmt.kernel_spec(layer._dim(p))
            pool = {k.split("/", 1)[1]: v for k, v in store.pool.items() if k.startswith(p + "/")}  # page views
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

    def attend(self, q_latent, q_rope, content, rope, scale, mask, valid=None, blocks=None, w_uk=None, w_uv=None):
        fresh_needed = self.quantized and self.fmt.mode == "serving" and self.fmt.recent == 0
        chosen = self.fmt.step_backends(q_latent.device.type)[step_type(q_latent)]
        if chosen != "triton" or fresh_needed or not self._hides_only_padding(mask, valid):
            return super().attend(q_latent, q_rope, content, rope, scale, mask, valid, blocks=blocks, w_uk=w_uk,
                                  w_uv=w_uv)
        self.append(content, rope, valid)
        q = (q_latent if w_uk is None else q_latent @ w_uk)[:, :, 0]  # (B, H, d_c)
        out = latent_decode(q, q_rope[:, :, 0], scale, kernel_segments(self)).to(q.dtype)[:, :, None]
        self.backend_steps["decode", "triton"] += 1
        return out if w_uv is None else out @ w_uv.transpose(-1, -2)

    def _store(self, rows, tokens):
        """New tokens into the paged store: where decode steps run the kernel, int paths are quantized and written
        into the pool by the Triton store kernel (bit-exact with the PyTorch encoder), float paths copied; formats
        the store kernel does not encode (and every format on the torch path) go through the PyTorch encoder."""
        if (rows.numel() == 0 or not self.quantized or self.fmt.step_backends(self.device.type)["decode"] != "triton"
                or any(self._store_unsupported(p) for p in PATHS)):
            return super()._store(rows, tokens)
        pos = self.store.reserve(rows)
        table = self.store.block_table()
        for p in PATHS:
            fmt, d = self.path_format(p), self._dim(p)
            if not fmt.quantized:
                self.store.write(rows, pos, {f"{p}/values": tokens[p]})
                continue
            groups = fmt.n_groups(d)
            specs = {"codes": ((WordLayout(fmt.bits, d).words,), torch.int32),
                     "scales": ((groups,), SCALE_DTYPES[fmt.scale_dtype])}
            if not fmt.symmetric:
                specs["zeros"] = ((groups,), ZERO_DTYPES[fmt.scale_dtype])
            self.store.declare({f"{p}/{part}": spec for part, spec in specs.items()})  # the path's page, at once
            pools = {part: self.store.part(f"{p}/{part}") for part in specs}  # views into it (block stride: a page)
            quantize_append(tokens[p].contiguous(), rows, pos, table, self.store.block_size, pools["codes"],
                            pools["scales"], pools.get("zeros"), bits=fmt.bits, group=fmt.group_size,
                            symmetric=fmt.symmetric, scale_dtype=fmt.scale_dtype)
            written = self.store.gather(rows, pos, [f"{p}/scales"] + ([] if fmt.symmetric else [f"{p}/zeros"]))
            check_finite(written, f"{self.where}, quant.{p} ({fmt.describe()})")

    def _store_unsupported(self, path: str) -> str | None:
        fmt = self.path_format(path)
        if fmt.format == "bf16":
            return None
        if fmt.format != "int":
            return f"format={fmt.format}"
        if fmt.quantizer != "rtn":  # the store kernel rounds to the group's min/max range: PyTorch encodes these
            return f"quantizer={fmt.quantizer}"
        return kernel_store_unsupported(fmt.bits, self._dim(path), fmt.group_size)

    def _hides_only_padding(self, mask, valid) -> bool:
        """True when the one query's mask hides padding slots and nothing else (the kernel never sees padding)."""
        if mask is None:
            return True
        seen = mask.keys if isinstance(mask, CausalMask) else visible(mask[:, 0, -1, :])  # (B, S + 1)
        slots = self.slot_valid if self.slot_valid is not None else seen.new_zeros(seen.shape[0], 0)
        new = torch.ones_like(seen[:, -1:]) if valid is None else valid.bool()
        expected = torch.cat([slots, new], dim=1)
        return expected.shape == seen.shape and bool((seen == expected).all())


class TritonLatentCacheLayer(KernelDecode, LatentCacheLayer):
    """Latent cache layer (any format the kernel reads) whose decode steps run the Triton kernel."""
