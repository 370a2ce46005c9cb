"""The latent KV cache of MLA (docs/cache.md): per-sequence paged storage, each path in its format, a protected
region per sequence, and layers whose decode steps run a decode kernel (Triton on a GPU, C++ on the CPU).

    from mla_quant.cache import LatentCache, layer_factory
    cache = LatentCache(num_layers, layer_factory(cache_format(cfg.quant, d_c, d_r)))
"""

from mla_quant.cache.factory import cache_layer_factory, layer_factory
from mla_quant.cache.contract import check_latents
from mla_quant.cache.latent_cache import LatentCache
from mla_quant.cache.layer import LatentCacheLayer
from mla_quant.cache.paged import PagedStore

__all__ = ["LatentCache", "LatentCacheLayer", "PagedStore", "cache_layer_factory", "check_latents", "layer_factory"]
