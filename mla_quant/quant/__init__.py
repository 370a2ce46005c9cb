"""Cache quantization: quantizers (pure functions), bit packing, per-path cache formats, the quantized latent cache.

    from mla_quant.quant.cache import quantized_cache
    cache = quantized_cache(model, cfg.quant)
"""
