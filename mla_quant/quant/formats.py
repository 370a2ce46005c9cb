"""Cache formats: one registry of codecs, and the validated format of each path (content latent c, RoPE key k).

`PathFormat` mirrors one path block of `conf/quant/*.yaml` (`quant.content`, `quant.rope`); `CacheFormat` the whole
`quant` group. Both are built and validated from the config BEFORE any model work, so a bad value fails at once
with the value and the allowed ones in the message. Everything that depends on the storage format lives in the
codec of that format (`CODECS`), in one place: allowed widths, the byte formula, encode/decode, and whether (and
with which arguments) the Triton decode kernel reads it. Adding a format = one `Codec` subclass in a module of its
own under `quant/codecs/`, registered in `quant/codecs/__init__.py`.

This module is the public face of the formats; each part lives in its own module:
    quant/codecs/   one module per codec (`base.py`: the interface and the byte sizes they share)
    quant/path.py   `PathFormat` (one path) and the helpers that store and read back one path
    quant/format.py `CacheFormat` (the quant group), `CacheSpec` (one per cache layer), the bytes per token
    quant/parse.py  `cache_format`: a config's `quant` group -> its validated format

    fmt = cache_format(cfg.quant, d_c=512, d_r=64)        # raises ValueError on bad bits / group sizes
    fmt.content.bytes_per_token(512)                       # 272 for INT4, group 128, fp16 scale + zero
    cache_bytes_per_token(fmt, 512, 64, context=131072)    # includes the protected region
    fq = fake_quantizer(cfg.quant.content, d=512, path="content")   # x -> stored-and-read-back x (noise studies)

Codecs (`format`), see docs/cache.md "Formats":
    bf16  kept unquantized, in the activation dtype (BF16 on real models; the formulas count 2 B/value)
    int   `bits` in {2,3,4,8}, per-token groups of `group_size` (null = whole vector), symmetric or scale + zero,
          codes in int32 words (kernels/layout.py; INT3: the byte stream of packing.py), scales/zeros in
          `scale_dtype` (fp16 | bf16 | fp32 | pow2 = int8 exponent)
    fp8   e4m3 (torch.float8_e4m3fn), bits 8; granularity "group": one scale per group_size values
          (null = per token, 128 = FlashMLA tiles), or "tensor": one float32 scale per sequence and layer, the
          amax/448 of that sequence's first append, optionally shared by both paths (`shared_scale`)
    codebook  `bits` in {2,3,4,8}: one norm per token and a Lloyd-Max Gaussian level per coordinate (TurboQuant's
          MSE quantizer; pair it with a Hadamard rotation, transform=turboquant)
    channel_block  `bits` in {2,3,4,8}, KIVI's key quantization: per channel over blocks of `token_block`
          consecutive tokens of one sequence, scale + zero per channel and block, spread over the block's tokens
          (token j of a block stores the scales and zeros of channels [j S, (j + 1) S), S = ceil(d / token_block));
          encode/decode take whole blocks along the token dim (-2); the cache keeps a block's tokens unquantized
          until it fills (cache/layer.py)
    pairs  the RoPE key with `bits` a list: one width (2/3/4/8, 16 unquantized) per group of consecutive frequency
          pairs in the model's RoPE layout, each group one integer group (byte-stream codes, its own scale + zero)
A `layers` list gives each cache layer its own paths (`CacheSpec`).
"""

from mla_quant.quant.codecs import (CODECS, FORMATS, PAIR_LAYOUTS, Codec, check_finite, finite_checks, pair_channels,
                                    raise_unless_finite)
from mla_quant.quant.codecs.base import (
    CODEBOOK_LEVEL_BYTES,
    GRANULARITIES,
    SCALE_BYTES,
    TRITON_INT_BITS,
    ZERO_BYTES,
)
from mla_quant.quant.format import (
    BACKENDS,
    BASELINE,
    COMMON,
    LAYER_KEYS,
    MIXED_KEYS,
    MODES,
    PATHS,
    STEP_TYPES,
    TENSOR_SCALE_BYTES,
    TOP_KEYS,
    CacheFormat,
    CacheSpec,
    as_spec,
    cache_bytes_per_token,
    layer_format,
    refuse_layered,
)
from mla_quant.quant.parse import cache_format, layered_format, model_format
from mla_quant.quant.path import (
    DERIVED_KEYS,
    PathFormat,
    _check_keys,
    _plain,
    decode_path,
    encode_path,
    fake_quantizer,
    tensor_scale_for,
)

__all__ = ["BACKENDS", "BASELINE", "CODEBOOK_LEVEL_BYTES", "CODECS", "COMMON", "DERIVED_KEYS", "FORMATS",
           "GRANULARITIES", "LAYER_KEYS", "MIXED_KEYS", "MODES", "PAIR_LAYOUTS", "PATHS", "SCALE_BYTES", "STEP_TYPES",
           "TENSOR_SCALE_BYTES", "TOP_KEYS", "TRITON_INT_BITS", "ZERO_BYTES", "CacheFormat", "Codec", "CacheSpec",
           "PathFormat", "_check_keys", "as_spec", "_plain", "cache_bytes_per_token", "cache_format", "check_finite",
           "decode_path", "encode_path", "fake_quantizer", "finite_checks", "layer_format", "layered_format",
           "model_format", "pair_channels", "raise_unless_finite", "refuse_layered", "tensor_scale_for"]
