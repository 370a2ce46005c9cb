"""The `quant` group of a config -> its validated format (`cache_format`): keys, widths and group sizes against the
model's dims, the protected region, the backend, per-layer entries."""

from __future__ import annotations

import warnings

from mla_quant.checks import int_setting
from mla_quant.kernels.backends import DECODE_BACKENDS
from mla_quant.quant.codecs import PAIR_LAYOUTS
from mla_quant.quant.format import (BACKENDS, LAYER_KEYS, MIXED_KEYS, MODES, TOP_KEYS, CacheFormat, CacheSpec,
                                     as_spec)
from mla_quant.quant.path import PathFormat, _check_keys, _plain


def layered_format(cfg: dict, layers, d_c: int | None, d_r: int | None, context: int | None,
                   num_layers: int | None, source: str = "quant.layers", rope_layout: str = "half",
                   layer_dims: list[tuple[int, int]] | None = None) -> CacheSpec:
    """`quant.layers`: a list with one entry per cache layer, each null (the option's own paths) or a mapping of
    `content` / `rope` blocks whose keys replace those of the option's blocks for that layer. Each layer is
    validated against (d_c, d_r), or against its own dims in `layer_dims` (a model whose layers differ)."""
    name = cfg.get("name", "?")
    if not isinstance(layers, (list, tuple)):
        raise ValueError(f"quant.layers={layers!r}; allowed: null or a list with one entry per cache layer")
    if layer_dims is not None:
        num_layers = len(layer_dims)
    if num_layers is not None and len(layers) != num_layers:
        raise ValueError(f"quant.layers has {len(layers)} entries; the model has {num_layers} cache layers: allowed "
                         f"one entry per layer (null keeps the option's format)")
    formats = []
    for i, entry in enumerate(layers):
        if layer_dims is not None:
            d_c, d_r = layer_dims[i]
        entry = {} if entry is None else _plain(entry)
        _check_keys(entry, LAYER_KEYS, f"quant.layers[{i}]")
        merged = dict(cfg)
        for path in LAYER_KEYS:
            if entry.get(path) is not None:
                merged[path] = {**_plain(cfg.get(path, {})), **_plain(entry[path])}
        try:
            formats.append(cache_format({**merged, "name": f"{name}/layer{i}"}, d_c, d_r, context,
                                        rope_layout=rope_layout))
        except ValueError as err:
            raise ValueError(f"quant.layers[{i}]: {err}") from err
    return CacheSpec(name, tuple(formats), source)


def model_format(quant_cfg, layer_dims: list[tuple[int, int]], context: int | None = None,
                 rope_layout: str = "half"):
    """The resolved `CacheSpec` of a `quant` config for a model whose MLA layers have (d_c, d_r) = `layer_dims`, in
    cache-layer order: `cache_format` repeated where every layer has the same dims (or each layer's own with
    `quant.layers`); where they differ (Mistral Large 4's NoPE layers cache no RoPE key), each layer validated against
    its own dims (`quant.layers` entries applied), a RoPE part skipped in the layers without a RoPE key (said once)."""
    layer_dims = [tuple(d) for d in layer_dims]
    if len(set(layer_dims)) <= 1:
        d_c, d_r = layer_dims[0] if layer_dims else (None, None)
        return as_spec(cache_format(quant_cfg, d_c, d_r, context, len(layer_dims), rope_layout), len(layer_dims) or 1)
    cfg = _plain(quant_cfg)
    name = cfg.get("name", "?")
    from mla_quant.quant.peers import is_peer

    if is_peer(cfg):
        raise ValueError(f"quant={name}: transformers' quantized cache takes one (d_c, d_r) for every layer; this "
                         f"model's MLA layers differ ({sorted(set(layer_dims))}): use one of the project's options")
    no_rope = [i for i, (_, d_r) in enumerate(layer_dims) if d_r == 0]
    if no_rope and PathFormat.from_cfg(cfg.get("rope", {}), "quant.rope") != PathFormat():
        warnings.warn(f"quant={name}: MLA layers {no_rope} have no RoPE key (qk_rope_head_dim 0 there); quant.rope "
                      f"is skipped in them: those layers cache the content latent alone", stacklevel=2)
    layers = cfg.pop("layers", None)
    with warnings.catch_warnings():  # said once above, not once per layer
        warnings.filterwarnings("ignore", message=".*has no RoPE key.*")
        return layered_format(cfg, [None] * len(layer_dims) if layers is None else layers, None, None, context,
                              None, source="quant.layers" if layers is not None else "the model's layer dims",
                              rope_layout=rope_layout, layer_dims=layer_dims)


def _nonneg_int(value, where: str, least: int = 0) -> int:
    return int_setting(value, where, least)


def cache_format(quant_cfg, d_c: int, d_r: int, context: int | None = None, num_layers: int | None = None,
                 rope_layout: str = "half") -> CacheFormat:
    """Build and validate the format of a `quant` config for a model with latent dims (d_c, d_r).

    With `context` (the longest sequence the run will hold), a quantized format whose protected region covers the
    whole context is refused: nothing would ever be quantized. A backend that cannot read the format is refused.
    A config with a `peer` block is a peer option: its `PeerFormat` (mla_quant/quant/peers.py). A `layers` list
    gives each cache layer its own paths: a `CacheSpec` (its length checked against `num_layers` when given).
    `rope_layout`: the model's RoPE pair layout (`half` | `interleaved`), which a RoPE key with bits per group of
    pairs (format=pairs) groups by.
    """
    cfg = _plain(quant_cfg)
    from mla_quant.quant.peers import is_peer, peer_format

    if is_peer(cfg):  # transformers' own QuantizedCache over the latent (conf/quant/hf_*.yaml)
        return peer_format(cfg, d_c, d_r)
    mixed = [k for k in MIXED_KEYS if k in cfg]
    if mixed:
        raise ValueError(f"quant={cfg.get('name', '?')} ({mixed}) allocates bits per layer from the model's "
                         f"sensitivity when a stage prepares the model; here one fixed format is read: use a "
                         f"uniform option, or the allocation's layers (quant.layers)")
    _check_keys(cfg, TOP_KEYS, "quant")
    if cfg.get("layers") is not None:
        return layered_format({k: v for k, v in cfg.items() if k != "layers"}, cfg["layers"], d_c, d_r, context,
                              num_layers, rope_layout=rope_layout)
    cfg.pop("layers", None)
    mode, backend = cfg.get("mode", "simulated"), cfg.get("backend", "auto")
    if mode not in MODES:
        raise ValueError(f"quant.mode={mode!r} is unknown; allowed: {list(MODES)}")
    if backend not in BACKENDS:
        raise ValueError(f"quant.backend={backend!r} is unknown; allowed: {list(BACKENDS)}")
    protected = _plain(cfg.get("protected", {}))
    _check_keys(protected, ("n_sink", "recent"), "quant.protected")
    n_sink = _nonneg_int(protected.get("n_sink", 4), "quant.protected.n_sink")
    recent = _nonneg_int(protected.get("recent", 128), "quant.protected.recent")
    block_size = _nonneg_int(cfg.get("block_size", 64), "quant.block_size", least=1)
    content_bits = _plain(cfg.get("content") or {}).get("bits")
    if isinstance(content_bits, (list, tuple)) or _plain(cfg.get("content") or {}).get("format") == "pairs":
        raise ValueError(f"quant.content.bits={content_bits}: widths per group of RoPE frequency pairs apply to the "
                         f"RoPE key; the content latent takes one width (an integer)")
    content = PathFormat.from_cfg(cfg.get("content", {}), "quant.content")
    rope = PathFormat.from_cfg(cfg.get("rope", {}), "quant.rope")
    if rope.format == "pairs":
        if rope_layout not in PAIR_LAYOUTS:
            raise ValueError(f"RoPE pair layout {rope_layout!r}; allowed: {list(PAIR_LAYOUTS)}")
        import dataclasses

        rope = dataclasses.replace(rope, pair_layout=rope_layout)
    content.check(d_c, "quant.content")
    if d_r == 0 and rope != PathFormat():  # no RoPE key (qk_rope_head_dim 0): nothing for quant.rope to store
        warnings.warn(f"quant={cfg.get('name', '?')}: the model has no RoPE key (qk_rope_head_dim 0); quant.rope "
                      f"({rope.describe()}) is skipped: the cache holds the content latent alone", stacklevel=2)
        rope = PathFormat()
    rope.check(d_r, "quant.rope")
    if context is not None and (content.quantized or rope.quantized) and n_sink + recent >= context:
        raise ValueError(
            f"quant.protected: n_sink + recent = {n_sink} + {recent} = {n_sink + recent} covers the whole context of "
            f"{context} tokens, so nothing would be quantized; allowed: n_sink + recent < {context} "
            "(lower quant.protected.recent or use longer sequences)"
        )
    shared = bool(cfg.get("shared_scale", False)) and d_r > 0  # one path: nothing to share a scale with
    if shared and not (content.tensor_scaled and rope.tensor_scaled):
        raise ValueError(
            "quant.shared_scale=true needs both paths in format=fp8 with granularity=tensor (vLLM's flat FP8 "
            f"layout); got content {content.describe()!r}, rope {rope.describe()!r}"
        )
    if content.blocked and rope.blocked and content.blocked != rope.blocked:
        raise ValueError(f"quant.content.token_block={content.blocked} and quant.rope.token_block={rope.blocked}: "
                         "both paths wait for the same blocks of tokens; allowed: the same token_block on both")
    fmt = CacheFormat(cfg.get("name", "?"), mode, backend, n_sink, recent, block_size, content, rope, shared, d_c, d_r)
    kernel = DECODE_BACKENDS.get(backend)
    why = kernel and kernel.unsupported(fmt)
    if why:
        raise ValueError(f"quant={fmt.name}: {why}: quant.backend={backend} cannot read it (it reads {kernel.reads}); "
                         f"use quant.backend=torch for this format")
    return fmt
