"""Cache quantization: quantizers (pure functions), bit packing, and the format codecs of each path.

    from mla_quant.quant.formats import cache_format
    fmt = cache_format(cfg.quant, d_c=512, d_r=64)
"""
