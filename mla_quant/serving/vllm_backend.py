"""vLLM's MLA attention backend with the latent cache in this project's formats: what was calibrated, served.

A checkpoint written by `experiment=export` carries `mla_quant_cache.json` (the resolved `quant` group). When vLLM
loads such a folder, this backend (registered by the package's `vllm.general_plugins` entry point, `register`)
stores each token's content latent and RoPE key in that format inside vLLM's own KV blocks and reads them back in
decode with the project's decode kernels; any other model gets vLLM's own backend unchanged.

- **Pages.** One vLLM block of `block_size` tokens holds the content path's page, then the RoPE path's page, each
  laid out as the project's paged store lays out a path (`PageLayout`: codes or values, scales, zeros, 16-byte
  aligned). The block's bytes are the format's: `customize_spec` sets vLLM's per-token page bytes
  (`state_content_bytes`) to the block's bytes / `block_size`, so vLLM's block budget counts the format's bytes.
- **Write** (`do_kv_cache_update`): the step's latents encoded by the format's codecs (the encoder the cache uses)
  straight into their slots.
- **Decode** (`forward_mqa`): the format's decode kernel (the fused C++ kernel on the CPU where it reads the format,
  the framework's PyTorch decode otherwise, `quant.backend` as in the framework) reads the pages through vLLM's
  block table; a format no kernel reads (3-bit codes, fp8) is decoded by its codec into a dense buffer. As in the
  framework's `quant.mode=serving`, the step's own token is read with its fresh values, every earlier token as
  stored; prefill attends to the prompt's fresh latents (vLLM's prefill path).
- **Refused by name** at engine start: a protected region (sinks or a recent window in full precision: the engine
  stores every token in the format; export with `quant.protected.n_sink=0 quant.protected.recent=0`), formats
  quantized over blocks of tokens or scaled per sequence, and `quant.mode=simulated` (an engine serves: prefill reads
  fresh latents).
- **A format per layer** (`quant.layers`, `quant=mixed`'s allocation, lloyd codebooks per layer): rebuilt from the
  description's layers; vLLM gives every layer of a cache group one page size, so each layer's block takes the
  largest layer's bytes (the budget counts the largest layer's bytes for every layer).

The module imports vLLM; `mla_quant.serving.vllm_plugin` registers it without importing vLLM's model code.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadata, MLACommonMetadataBuilder
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend, CPUMLAImpl

from mla_quant.cache.paged import read_path
from mla_quant.kernels.layout import PageLayout, Segment
from mla_quant.kernels.backends import DECODE_BACKENDS
from mla_quant.kernels.torch_decode import segment_attention
from mla_quant.quant.format import MIXED_KEYS
from mla_quant.quant.formats import PATHS, CacheFormat, CacheSpec, as_spec, cache_format, check_finite, model_format
from mla_quant.serving import CACHE_FILE


def read_description(model: str | Path) -> dict | None:
    """The cache description of an exported checkpoint folder, or None (not one of ours: vLLM's own backend)."""
    path = Path(model) / CACHE_FILE
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def served_format(description: dict, fitted: bool = True) -> CacheSpec:
    """The spec an exported checkpoint's description names (one format for every layer, or each layer's rebuilt from
    its paths and codebooks), as the engine can store it; refused by name where it cannot. fitted=False:
    checked before the preparation step allocates layers or fits codebooks (a `quant` config and the model's dims)."""
    quant, cache = dict(description.get("quant") or {}), description.get("cache") or {}
    if not fitted or cache.get("layers_quant") is not None:  # the allocation's settings: done, or not yet
        quant = {k: v for k, v in quant.items() if k not in MIXED_KEYS}
    if cache.get("format") in (None, "none"):
        raise ValueError(f"{CACHE_FILE}: the checkpoint was exported without a cache format (quant=none)")
    if "d_c" not in cache or "d_r" not in cache:
        raise ValueError(f"{CACHE_FILE}: the cache description names no latent dims (d_c, d_r); export it again")
    if cache.get("layers_quant") is not None:  # a format per layer (quant.layers, quant=mixed, lloyd codebooks)
        quant["layers"] = cache["layers_quant"]
    layout = cache.get("rope_layout", "half")
    if cache.get("layer_dims"):  # a model whose layers' dims differ: each layer at its own
        fmt = model_format(quant, [(int(c), int(r)) for c, r in cache["layer_dims"]], rope_layout=layout)
    else:
        fmt = as_spec(cache_format(quant, int(cache["d_c"]), int(cache["d_r"]), rope_layout=layout))
    name = fmt.name
    if fmt.peer:
        raise ValueError(f"quant={name}: a transformers QuantizedCache peer has no engine layout")
    if cache.get("codebooks"):  # with a format per layer (layers_quant)
        books = cache["codebooks"]
        fmt = CacheSpec(fmt.name, tuple(
            dataclasses.replace(f, **{p: dataclasses.replace(f.path(p), levels=tuple(levels))
                                      for p, levels in book.items()}) for f, book in zip(fmt.layers, books)),
            fmt.source)
    if fmt.mode != "serving":
        raise ValueError(f"quant={name}: quant.mode={fmt.mode}: an engine serves (prefill attends to the prompt's "
                         "fresh latents, decode reads the stored cache); export with quant.mode=serving")
    if fmt.n_sink or fmt.recent:
        raise ValueError(f"quant={name}: quant.protected n_sink={fmt.n_sink}, recent={fmt.recent}: the engine stores "
                         "every token in the format (no full-precision sinks or recent window in its blocks yet); "
                         "export with quant.protected.n_sink=0 quant.protected.recent=0")
    for i, layer in enumerate(fmt.layers):
        where = f"quant={name}" + (f", layer {i}" if fmt.uniform is None else "")
        if layer.token_block is not None:
            raise ValueError(f"{where}: token_block={layer.token_block}: a path quantized over blocks of tokens "
                             "waits for whole blocks, which the engine's per-token writes do not give; use a per-token "
                             "format")
        for p in PATHS:
            path = layer.path(p)
            if fitted and path.fitted_levels and path.levels is None:
                raise ValueError(f"{where}: quant.{p}.quantizer={path.quantizer} reads a codebook fitted per layer, "
                                 f"and {CACHE_FILE} holds none for it; export the checkpoint again")
            if path.tensor_scaled:
                raise ValueError(f"{where}: quant.{p}.granularity=tensor scales each sequence once, which the "
                                 "engine's blocks do not hold; use granularity=group")
    return fmt


def page_token_bytes(fmt, block_size: int, act_dtype: torch.dtype) -> int:
    """vLLM's per-token page bytes for a served format: vLLM gives every layer of a cache group one page size, so a
    format per layer takes its largest layer's."""
    return max(EnginePages(f, block_size, act_dtype).token_bytes for f in fmt.layers)


@dataclass(frozen=True)
class EnginePages:
    """Where a format's two paths sit in one vLLM block: the content page at byte 0, the RoPE page after it."""

    fmt: CacheFormat
    block_size: int
    act_dtype: torch.dtype

    @functools.cached_property
    def layouts(self) -> dict[str, PageLayout]:
        out = {}
        for p in PATHS:
            d = self.fmt.dim(p)
            parts = self.fmt.path(p).encode(torch.zeros(1, d, dtype=self.act_dtype))  # part shapes and dtypes
            out[p] = PageLayout.of(self.block_size, {f"{p}/{k}": (tuple(v.shape[1:]), v.dtype)
                                                     for k, v in parts.items()})
        return out

    @functools.cached_property
    def offsets(self) -> dict[str, int]:
        return {"content": 0, "rope": self.layouts["content"].page_bytes}

    @property
    def block_bytes(self) -> int:
        return sum(layout.page_bytes for layout in self.layouts.values())

    @property
    def token_bytes(self) -> int:
        """vLLM's per-token page bytes: the block's bytes over its tokens, rounded up."""
        return -(-self.block_bytes // self.block_size)

    def pages(self, kv_cache: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each path's pages (num_blocks, page bytes) uint8: views into vLLM's blocks (block stride: vLLM's)."""
        raw = kv_cache.view(torch.uint8)
        if raw.shape[0] and not raw[0].is_contiguous():  # flatten would copy, and writes would be lost
            raise ValueError(f"vLLM's KV cache layout does not keep a block's bytes together (strides "
                             f"{tuple(raw.stride())}); the latent formats need one block per contiguous page")
        blocks = raw.flatten(1)  # (num_blocks, block bytes, padded to whole tokens)
        return {p: blocks[:, self.offsets[p]: self.offsets[p] + self.layouts[p].page_bytes] for p in PATHS}

    def write(self, kv_cache: torch.Tensor, slots: torch.Tensor, tokens: dict[str, torch.Tensor]) -> None:
        """Encode tokens {path: (N, d)} into slots (N,) (block * block_size + position) of vLLM's cache."""
        pages = self.pages(kv_cache)
        block, pos = slots // self.block_size, slots % self.block_size
        for p in PATHS:
            fmt = self.fmt.path(p)
            encoded = fmt.encode(tokens[p].to(self.act_dtype) if not fmt.quantized else tokens[p])
            if fmt.quantized:  # scales that overflow their dtype are refused, as the framework's cache refuses them
                check_finite(encoded, f"quant.{p} ({fmt.describe()})")
            layout = self.layouts[p]
            for part, value in encoded.items():
                if value.numel():
                    layout.view(pages[p], f"{p}/{part}")[block, pos] = value.to(layout.spec()[f"{p}/{part}"][1])

    def segment(self, kv_cache: torch.Tensor, block_table: torch.Tensor, lengths: torch.Tensor) -> Segment:
        """The stored tokens of each sequence as a decode segment: (B, max_blocks) table, (B,) tokens. A format the
        decode kernels read stays in its pages; any other (3-bit codes, fp8, codebooks over channels) is decoded by
        its codec into a dense float32 segment of every sequence's tokens."""
        pages = self.pages(kv_cache)
        table, lengths = block_table.to(torch.int32).contiguous(), lengths.to(torch.int32)
        if self.fmt.kernel_unsupported() is None:
            paths = {p: read_path(self.fmt.path(p), self.fmt.dim(p), self.layouts[p], pages[p]) for p in PATHS}
            return Segment(paths["content"], paths["rope"], table, lengths)
        pos = torch.arange(table.shape[1] * self.block_size, device=table.device)
        blocks, slot = table.long().clamp(min=0)[:, pos // self.block_size], pos % self.block_size  # (B, L), (L,)
        dense = {}
        for p in PATHS:
            layout = self.layouts[p]
            parts = {name.split("/", 1)[1]: layout.view(pages[p], name)[blocks, slot] for name in layout.spec()}
            dense[p] = self.fmt.path(p).decode(parts, self.fmt.dim(p), torch.float32)
        return Segment.dense(dense["content"], dense["rope"], lengths)


@functools.lru_cache(maxsize=8)
def served(model: str) -> CacheSpec | None:
    """The served format of an exported checkpoint folder (read once per process), or None (not one of ours)."""
    description = read_description(model)
    return None if description is None else served_format(description)


_LOADED: dict[str, object] = {}  # the format of the model this process loaded (see current_format)


def current_format() -> tuple[CacheSpec | None, object | None]:
    """The served format of the model vLLM is loading (None: not an exported checkpoint) and vLLM's config. Where
    vLLM asks outside its config context (sizing the KV cache), the format found when the model's attention layers
    were built in this process."""
    from vllm.config import get_current_vllm_config

    try:
        config = get_current_vllm_config()
    except AssertionError:
        return _LOADED.get("format"), _LOADED.get("config")
    model = getattr(config.model_config, "model", None)
    fmt = None if model is None else served(str(model))
    if fmt is not None:
        _LOADED.update(format=fmt, config=config)
    return fmt, config


@dataclass
class LatentMetadata(MLACommonMetadata):
    """vLLM's MLA metadata without its head-size list (576, 512, 320: DeepSeek's): what decode reads is the
    format's pages, whatever the model's latent dims."""

    def __post_init__(self):
        pass


class LatentMetadataBuilder(MLACommonMetadataBuilder[LatentMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device, **kwargs):
        kwargs.setdefault("metadata_cls", LatentMetadata)
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, **kwargs)


class LatentMLABackend(CPUMLABackend):
    """vLLM's CPU MLA backend, storing an exported checkpoint's latent cache in its format (module docstring)."""

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [] if current_format()[0] is not None else super().get_supported_head_sizes()

    @staticmethod
    def get_builder_cls():
        return LatentMetadataBuilder

    @staticmethod
    def get_impl_cls():
        return LatentMLAImpl

    @classmethod
    def customize_spec(cls, spec):
        fmt, config = current_format()
        if fmt is None:
            return super().customize_spec(spec)
        token_bytes = page_token_bytes(fmt, spec.block_size, config.model_config.dtype)
        return replace(spec, dtype=torch.uint8, state_content_bytes=token_bytes)


class LatentMLAImpl(CPUMLAImpl):
    """Writes and reads the served format (module docstring); vLLM's own CPU MLA where the model is not ours."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.served, config = current_format()
        self.act_dtype = None if config is None else config.model_config.dtype
        self.block_size = None if config is None else config.cache_config.block_size
        self._fresh: dict[str, torch.Tensor] | None = None

    @functools.cached_property
    def fmt(self) -> CacheFormat:
        """This layer's format: the served one, or its entry for this layer (the layer found by its name among the
        engine's MLA layers, in decoder order, on the first step)."""
        if self.served.uniform is not None:
            return self.served.uniform
        layers = self.served.layers
        from vllm.forward_context import get_forward_context

        ours = {name: layer for name, layer in get_forward_context().no_compile_layers.items()
                if isinstance(getattr(layer, "impl", None), LatentMLAImpl)}
        order = sorted(ours, key=lambda name: [int(n) for n in re.findall(r"\d+", name)])
        if len(order) != len(layers):
            raise ValueError(f"quant={self.served.name}: a format for each of {len(layers)} cache layers, and the "
                             f"engine runs {len(order)} MLA layers")
        return layers[next(i for i, name in enumerate(order) if ours[name].impl is self)]

    @functools.cached_property
    def pages(self) -> EnginePages:
        return EnginePages(self.fmt, self.block_size, self.act_dtype)

    @functools.cached_property
    def decode_backend(self) -> str:
        return self.fmt.step_backends("cpu")["decode"]  # "cpu" (the C++ kernel) or "torch"

    def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale):
        if self.served is None:
            return super().do_kv_cache_update(kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale)
        k_pe = k_pe.reshape(k_pe.shape[0], -1)
        self._fresh = {"content": kv_c_normed, "rope": k_pe}  # decode reads its own token fresh (serving semantics)
        if kv_cache.numel() == 0:
            return
        slots = slot_mapping.flatten().long()
        ok = slots >= 0  # -1: padding
        n = slots.shape[0]
        self.pages.write(kv_cache, slots[ok], {"content": kv_c_normed[:n][ok], "rope": k_pe[:n][ok]})

    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        if self.served is None:
            return super().forward_mqa(q, kv_c_and_k_pe_cache, attn_metadata, layer)
        decode = attn_metadata.decode
        q_latent, q_rope = q if isinstance(q, tuple) else q.split([self.kv_lora_rank, self.qk_rope_head_dim], -1)
        b = q_latent.shape[0]
        lengths = decode.seq_lens[:b]
        stored = self.pages.segment(kv_c_and_k_pe_cache, decode.block_table[:b], lengths - 1)
        fresh = Segment.dense(self._fresh["content"][:b, None].to(q_latent.dtype),
                              self._fresh["rope"][:b, None].to(q_latent.dtype),
                              torch.ones(b, dtype=torch.int32))
        chosen = DECODE_BACKENDS.get(self.decode_backend)
        kernel = chosen.op() if chosen is not None else segment_attention
        out = kernel(q_latent.contiguous(), q_rope.contiguous(), self.scale, [stored, fresh])
        return out.to(q_latent.dtype), None
