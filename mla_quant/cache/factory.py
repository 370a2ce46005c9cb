"""One factory for latent cache layers: a validated `CacheFormat` (or a `quant` config) -> a layer constructor.

    fmt = cache_format(cfg.quant, d_c=512, d_r=64)          # mla_quant.quant.formats; validates first
    factory = layer_factory(fmt)                           # zero-argument constructor of one layer
    cache = LatentCache(num_layers, factory)               # a transformers Cache (models.absorbed.new_cache)
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from mla_quant.cache.layer import LatentCacheLayer
from mla_quant.kernels.backends import DECODE_BACKENDS, TORCH
from mla_quant.quant.formats import CacheFormat, CacheSpec, cache_format
from mla_quant.quant.peers import PeerFormat


def layer_factory(fmt: CacheFormat | CacheSpec | None
                  ) -> Callable[[], LatentCacheLayer] | list[Callable[[], LatentCacheLayer]]:
    """A zero-argument layer constructor for `fmt` (None: unquantized, torch backend). backend=triton: decode steps
    through the Triton kernel, backend=cpu through the C++ kernel (a clear error where it cannot run);
    backend=auto: a kernel-capable layer when a kernel would run here (a visible CUDA GPU and a format the Triton
    kernel reads, or the C++ kernel built and a format it reads; each decode step then picks by the device of its
    tensors, `CacheFormat.step_backends`), the PyTorch layer otherwise. A `PeerFormat`: transformers' quantized
    layers. A `CacheSpec`: one constructor per cache layer, in order (`LatentCache` takes the list)."""
    if fmt is None:
        return LatentCacheLayer
    if isinstance(fmt, CacheSpec):  # one constructor for a uniform spec (any number of layers), else one per layer
        return layer_factory(fmt.uniform) if fmt.uniform is not None else [layer_factory(f) for f in fmt.layers]
    if isinstance(fmt, PeerFormat):
        from mla_quant.cache.peers import PeerLatentCacheLayer

        return functools.partial(PeerLatentCacheLayer, fmt)
    kernel = DECODE_BACKENDS.get(fmt.backend)
    if kernel is not None:
        kernel.require(f"quant.backend={fmt.backend}", "; or use quant.backend=torch (or auto)")
    # a visible GPU is asked first: where the Triton kernel reads the format the C++ kernel is not built for nothing
    # (it is built when a decode step on CPU tensors first asks for it)
    devices = (["cuda"] if torch.cuda.is_available() else []) + ["cpu"]
    if kernel is not None or any(fmt.step_backends(d)["decode"] != TORCH for d in devices):
        from mla_quant.cache.kernel import KernelLatentCacheLayer

        return functools.partial(KernelLatentCacheLayer, fmt)
    return functools.partial(LatentCacheLayer, fmt)


def cache_layer_factory(quant_cfg, d_c: int, d_r: int, context: int | None = None) -> Callable[[], LatentCacheLayer]:
    """`layer_factory` for a `quant` config validated against (d_c, d_r) (and, with `context`, that the protected
    region leaves something to quantize)."""
    return layer_factory(cache_format(quant_cfg, d_c, d_r, context))
