"""Latent cache layers whose one-token decode steps run a decode kernel: the Triton kernel on a GPU
(`quant.backend=triton`, or `auto` on a CUDA device) or the fused C++ kernel on the CPU (`quant.backend=cpu`, or
`auto` on the CPU).

The layer hands the kernel tensors only (mla_quant/kernels/latent_decode.py, mla_quant/kernels/cpu_decode.py): its
paged store as one segment (per path, views of its one page pool: the packed codes or values, scales and zeros of a
block side by side in one page; the block table, tokens per sequence) and its protected sinks and recent window as
dense segments. Prefill and multi-token steps, masks that hide real tokens (DeepSeek-V3.2's sparse indexer), and
serving mode without a recent window (the step must see its own fresh latent) take the PyTorch path.
Tokens leaving the recent window are quantized and written into the pages by the Triton store kernel
(mla_quant/kernels/quant_store.py) where decode steps run the Triton kernel, by the PyTorch encoder otherwise.
"""

from __future__ import annotations

import torch

from mla_quant.cache.contract import step_type
from mla_quant.cache.layer import PATHS, LatentCacheLayer
from mla_quant.kernels.backends import DECODE_BACKENDS
from mla_quant.kernels.layout import WordLayout
from mla_quant.quant.quantizers import SCALE_DTYPES, ZERO_DTYPES


def store_unsupported(fmt, d: int) -> str | None:
    """Why the Triton store kernel does not encode path format `fmt` of `d` dims (the PyTorch encoder then stores
    it), or None (also for float paths, which are copied)."""
    if not fmt.quantized:
        return None
    why = fmt.store_kernel_unsupported()  # the codec's and the quantizer's (PyTorch encodes what it refuses)
    if why is not None:
        return why
    from mla_quant.kernels.quant_store import kernel_store_unsupported

    return kernel_store_unsupported(fmt.bits, d, fmt.group_size)


def store_quantized(store, rows, pos, table, path: str, fmt, d: int, x: torch.Tensor) -> None:
    """Quantize x (N, d), path `path` of format `fmt`, with the Triton store kernel straight into the paged store's
    pages at the reserved positions `pos` of `rows` (the path's page parts declared at once; the kernel writes
    through their views, whose block stride is a page)."""
    from mla_quant.kernels.quant_store import quantize_append

    groups = fmt.n_groups(d)
    specs = {"codes": ((WordLayout(fmt.bits, d).words,), torch.int32),
             "scales": ((groups,), SCALE_DTYPES[fmt.scale_dtype])}
    if not fmt.symmetric:
        specs["zeros"] = ((groups,), ZERO_DTYPES[fmt.scale_dtype])
    store.declare({f"{path}/{part}": spec for part, spec in specs.items()})
    pools = {part: store.part(f"{path}/{part}") for part in specs}
    quantize_append(x.contiguous(), rows, pos, table, store.block_size, pools["codes"], pools["scales"],
                    pools.get("zeros"), bits=fmt.bits, group=fmt.group_size, symmetric=fmt.symmetric,
                    scale_dtype=fmt.scale_dtype)


class KernelDecode:
    """Mixin for `LatentCacheLayer`: one-token decode steps attend through the kernel that the format's backend picks
    for the device of the step's tensors (`CacheFormat.step_backends`: a registered kernel, kernels/backends.py, or
    "torch": the PyTorch path)."""

    def attend(self, q_latent, q_rope, content, rope, scale, mask, valid=None, blocks=None, w_uk=None, w_uv=None,
               sinks=None):
        chosen = DECODE_BACKENDS.get(self._step_backends(q_latent.device.type)[step_type(q_latent)])
        if sinks is not None and chosen is not None and not chosen.sinks and self.fmt.backend != "auto":
            raise ValueError(f"{self.where}: quant.backend={self.fmt.backend}: the {chosen.name} decode kernel has no "
                             "attention sinks, which this model's attention has; use quant.backend=torch (or auto)")
        if chosen is None or (sinks is not None and not chosen.sinks) or not self._reads_segments(q_latent, mask,
                                                                                                   valid):
            return super().attend(q_latent, q_rope, content, rope, scale, mask, valid, blocks=blocks, w_uk=w_uk,
                                  w_uv=w_uv, sinks=sinks)
        kernel = chosen.op()
        self.append(content, rope, valid)
        self.backend_steps["decode", chosen.name] += 1
        return self._decode_segments(q_latent, q_rope, scale, w_uk, w_uv,
                                     lambda q, qr: kernel(q, qr, scale, self.segments()))

    def _step_backends(self, device_type: str) -> dict[str, str]:
        """The format's backend per step type on `device_type`, worked out once per device type (the format is
        frozen)."""
        cache = self.__dict__.setdefault("_backends", {})
        if device_type not in cache:
            backends = self.fmt.step_backends(device_type)
            for name in backends.values():
                kernel = DECODE_BACKENDS.get(name)
                if kernel is not None and not kernel.runs_on(device_type):
                    raise ValueError(f"{self.where}: quant.backend={name} decodes {'/'.join(kernel.devices)} "
                                     f"tensors; this layer's are on {device_type} ({kernel.device_hint})")
            cache[device_type] = backends
        return cache[device_type]

    def _write(self, rows, pos, tokens, on_device=False):
        """New tokens into their reserved places in the paged store: where decode steps run the Triton kernel, int paths
        are quantized and written into the pool by the Triton store kernel (bit-exact with the PyTorch encoder),
        float paths copied; formats the store kernel does not encode (and every format on the torch path) go
        through the PyTorch encoder."""
        chosen = DECODE_BACKENDS.get(self._step_backends(self.device.type)["decode"])
        if (not self.quantized or chosen is None or not chosen.stores
                or any(self._store_unsupported(p) for p in PATHS)):
            return super()._write(rows, pos, tokens, on_device)
        table = self.store.block_table()
        for p in PATHS:
            fmt = self.path_format(p)
            if not fmt.quantized:
                self.store.write(rows, pos, {f"{p}/values": tokens[p]})
                continue
            store_quantized(self.store, rows, pos, table, p, fmt, self._dim(p), tokens[p])
            written = self.store.gather(rows, pos, [f"{p}/scales"] + ([] if fmt.symmetric else [f"{p}/zeros"]))
            self._check_stored(written, f"{self.where}, quant.{p} ({fmt.describe()})", on_device)

    def _store_unsupported(self, path: str) -> str | None:
        return store_unsupported(self.path_format(path), self._dim(path))


class KernelLatentCacheLayer(KernelDecode, LatentCacheLayer):
    """Latent cache layer (any format a decode kernel reads) whose decode steps run the kernel its backend picks."""
