"""vLLM's MLA attention backend with the latent cache in this project's formats: what was calibrated, served.

A checkpoint written by `experiment=export` carries `mla_quant_cache.json` (the resolved `quant` group). When vLLM
loads such a folder, this backend (registered by the package's `vllm.general_plugins` entry point, `register`)
stores each token's content latent and RoPE key in that format inside vLLM's own KV blocks and reads them back in
decode with the project's decode kernels; any other model gets vLLM's own backend unchanged. One implementation of
the format's writes and reads (`LatentFormatImpl`) serves two platforms: vLLM's CPU one (`LatentMLABackend`, over
vLLM's CPU MLA) and a CUDA GPU (`LatentTritonMLABackend`, over vLLM's Triton MLA, registered as vLLM's CUSTOM
backend), the pools on the engine's device, their bookkeeping on the host.

- **Pages.** One vLLM block of `block_size` tokens holds the content path's page, then the RoPE path's page, each
  laid out as the project's paged store lays out a path (`PageLayout`: codes or values, scales, zeros, 16-byte
  aligned). The block's bytes are the format's: `customize_spec` sets vLLM's per-token page bytes
  (`state_content_bytes`) to the block's bytes / `block_size`, so vLLM's block budget counts the format's bytes.
- **Write** (`do_kv_cache_update`): the step's latents encoded by the format's codecs (the encoder the cache uses)
  straight into their slots.
- **Decode** (`forward_mqa`): the format's decode kernel (the fused C++ kernel on the CPU and the Triton kernel on a
  GPU where it reads the format, the framework's PyTorch decode otherwise, `quant.backend` as in the framework, for
  the engine's device) reads the pages through vLLM's
  block table; a format no kernel reads (3-bit codes, fp8) is decoded by its codec into a dense buffer. As in the
  framework's `quant.mode=serving`, the step's own token is read with its fresh values, every earlier token as
  stored; prefill attends to the prompt's fresh latents (vLLM's prefill path).
- **Chunked prefill** (`_compute_prefill_context`): a prompt continued over its cached context (the engine cut it
  into chunks) attends to that context as the framework's cache reads it in a step of several tokens once they are
  appended: the stored tokens decoded from the pages, the protected ones from the pool (`_context`); its own tokens
  fresh. The pool takes a chunk's tokens at their positions, and a token block that fills mid-prompt is stored from
  the tokens that waited in the ring and the chunk's own. A prompt whose leading blocks vLLM's prefix caching found
  cached reads them the same way, as its context (formats without a pool or a scale per sequence).
- **The protected region** (`quant.protected`: each sequence's first `n_sink` tokens and its latest `recent`, in the
  activation dtype): every token is written in the format into its block as above, and the protected ones also into
  a pool beside vLLM's blocks (`ProtectedPool`), a slot per sequence the engine may run at once (`max_num_seqs`),
  found by the sequence's first block: a block has one owner (prefix caching stays off for such a format,
  `shared_blocks_refused`), and a sequence keeps its first block until it ends or is preempted (then recomputed from
  its prompt into new blocks). Decode reads the protected tokens from the pool, the rest from the blocks, as the
  framework's cache does. The pools are part of the KV cache's bytes: the engine's worker takes them out of the
  memory it gives vLLM's blocks (`count_pools`: `kv_cache_memory_bytes` when set, else what vLLM measured free),
  so a budget holds the blocks and the pools together, whoever starts the engine. A sequence whose slot was taken
  while it waited (more sequences started meanwhile than the pool holds) reads its tokens as stored, and is counted
  (`SlotTable.misses`).
  One slot table per engine serves every layer's pool: a step assigns its sequences' slots once.
- **A scale per sequence** (fp8 `granularity=tensor`, `fp8_flat`): set from the sequence's prompt as the
  framework's cache sets it on a first append (amax / 448, joint over the paths with `shared_scale`) and held in 16
  bytes at the end of its first block's page (`EnginePages.set_sequence_scales`); a decode step's tokens are
  encoded with it and every read decodes with it. A preempted sequence, recomputed from its prompt and the tokens
  it had generated, sets its scale again from those.
- **A path over blocks of tokens** (KIVI's `channel_block`: one scale and zero per channel and 32-token block): a
  block is quantized when its last token leaves the window, all its tokens together, as the framework's cache
  stores it. Until then its tokens wait in the pool, whose ring holds `token_block` tokens more than the window
  (`ProtectedPool`); the step that fills a block encodes it from the pool (or a prompt from its own tokens) into its
  tokens' slots (`_store_blocks`; a block's per-channel scales are spread over its tokens' slots by the codec), and
  decode reads the whole blocks from the pages, the rest from the pool. The pending tokens' bytes are counted with
  the pools. A sequence whose pending tokens were lost (its slot taken while it waited) is refused by name.
- **Refused by name** at engine start: sinks that do not fit a sequence's first block, and `quant.mode=simulated`
  (an engine serves: prefill reads fresh latents).
- **A format per layer** (`quant.layers`, `quant=mixed`'s allocation, lloyd codebooks per layer): rebuilt from the
  description's layers, each engine layer finding its own by its place among the engine's MLA layers. Each layer's
  page takes its own format's bytes (`layer_pages`: the layer's spec, which vLLM's own spec method cannot know, set
  when vLLM asks the layer; vLLM keeps layers of one kind with different page sizes in one cache group, a block
  spanning every layer), so the budget counts the allocation's bytes, not the largest layer's for all.

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
from vllm.model_executor.layers.attention.mla_attention import (MLACommonMetadata, MLACommonMetadataBuilder,
                                                                 QueryLenSupport)
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend, CPUMLAImpl
from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend, TritonMLAImpl, TritonMLAMetadataBuilder

from mla_quant.cache.paged import read_path
from mla_quant.kernels.layout import PageLayout, Segment
from mla_quant.kernels.backends import DECODE_BACKENDS
from mla_quant.kernels.torch_decode import segment_attention
from mla_quant.quant.format import MIXED_KEYS
from mla_quant.quant.formats import (PATHS, CacheFormat, CacheSpec, as_spec, cache_format, check_finite, model_format,
                                     tensor_scale_for)
from mla_quant.serving import CACHE_FILE

SEQUENCE_SCALE_BYTES = 16  # a block's room for its sequence's scales (two float32, 16-byte aligned)


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
    for i, layer in enumerate(fmt.layers):
        where = f"quant={name}" + (f", layer {i}" if fmt.uniform is None else "")
        for p in PATHS:
            path = layer.path(p)
            if fitted and path.fitted_levels and path.levels is None:
                raise ValueError(f"{where}: quant.{p}.quantizer={path.quantizer} reads a codebook fitted per layer, "
                                 f"and {CACHE_FILE} holds none for it; export the checkpoint again")
    return fmt


def page_token_bytes(fmt, block_size: int, act_dtype: torch.dtype) -> int:
    """vLLM's per-token page bytes for a served format where no layer is named (vLLM sizing a page for the backend
    alone): the largest layer's. Each layer's own page is its format's (`layer_pages`)."""
    return max(EnginePages(f, block_size, act_dtype).token_bytes for f in fmt.layers)


@dataclass(frozen=True)
class EnginePages:
    """Where a format's two paths sit in one vLLM block: the content page at byte 0, the RoPE page after it; for a
    path scaled once per sequence (fp8 `granularity=tensor`), 16 bytes after them holding the sequence's scales
    (content, rope: float32), written in the sequence's first block (`set_sequence_scales`)."""

    fmt: CacheFormat
    block_size: int
    act_dtype: torch.dtype

    @functools.cached_property
    def layouts(self) -> dict[str, PageLayout]:
        out = {}
        for p in PATHS:
            d = self.fmt.dim(p)
            scale = torch.ones(1, device="cpu") if self.fmt.path(p).tensor_scaled else None
            rows = self.fmt.path(p).blocked or 1  # a path over blocks of tokens encodes whole blocks
            probe = torch.zeros(rows, d, dtype=self.act_dtype, device="cpu")
            parts = self.fmt.path(p).encode(probe, scale)  # the parts' shapes and dtypes
            out[p] = PageLayout.of(self.block_size, {f"{p}/{k}": (tuple(v.shape[1:]), v.dtype)
                                                     for k, v in parts.items()})
        return out

    @functools.cached_property
    def offsets(self) -> dict[str, int]:
        return {"content": 0, "rope": self.layouts["content"].page_bytes}

    @functools.cached_property
    def scaled(self) -> list[str]:
        """The paths scaled once per sequence (their scale read from the sequence's first block)."""
        return [p for p in PATHS if self.fmt.path(p).tensor_scaled]

    @functools.cached_property
    def blocked(self) -> list[str]:
        """The paths quantized over blocks of tokens (KIVI's channel_block): written when their block fills."""
        return [p for p in PATHS if self.fmt.path(p).blocked]

    @property
    def pages_bytes(self) -> int:
        return sum(layout.page_bytes for layout in self.layouts.values())

    @property
    def block_bytes(self) -> int:
        return self.pages_bytes + (SEQUENCE_SCALE_BYTES if self.scaled else 0)

    def _scale_slots(self, kv_cache: torch.Tensor) -> torch.Tensor:
        return self.blocks(kv_cache)[:, self.pages_bytes: self.pages_bytes + 8].view(torch.float32)  # (blocks, 2)

    def sequence_scales(self, kv_cache: torch.Tensor, first_blocks: torch.Tensor) -> dict[str, torch.Tensor]:
        """{path: (B,) float32}: the scales of the sequences whose first blocks are `first_blocks` (B,)."""
        held = self._scale_slots(kv_cache)[first_blocks.to(kv_cache.device, torch.long)]
        return {p: held[:, PATHS.index(p)] for p in self.scaled}

    def set_sequence_scales(self, kv_cache: torch.Tensor, first_blocks: torch.Tensor,
                            scales: dict[str, torch.Tensor]) -> None:
        """Write the sequences' scales {path: (B,)} into their first blocks (B,)."""
        slots, first_blocks = self._scale_slots(kv_cache), first_blocks.to(kv_cache.device, torch.long)
        for p, value in scales.items():
            slots[first_blocks, PATHS.index(p)] = value.float()

    def prompt_scales(self, tokens: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The scales a sequence's first append sets, as the framework's cache sets them: amax / 448 of its tokens
        {path: (N, d)} (joint over the paths with `shared_scale`; 1 where all are zero). -> {path: 0-d}."""
        groups = [self.scaled] if self.fmt.shared_scale else [[p] for p in self.scaled]
        out = {}
        for group in groups:
            scale = tensor_scale_for(*(tokens[p] for p in group))
            out.update({p: scale for p in group})
        return out

    @property
    def token_bytes(self) -> int:
        """vLLM's per-token page bytes: the block's bytes over its tokens, rounded up."""
        return -(-self.block_bytes // self.block_size)

    @staticmethod
    def blocks(kv_cache: torch.Tensor) -> torch.Tensor:
        """vLLM's blocks as (num_blocks, block bytes, padded to whole tokens) uint8: a view (block stride: vLLM's)."""
        raw = kv_cache.view(torch.uint8)
        if raw.shape[0] and not raw[0].is_contiguous():  # flatten would copy, and writes would be lost
            raise ValueError(f"vLLM's KV cache layout does not keep a block's bytes together (strides "
                             f"{tuple(raw.stride())}); the latent formats need one block per contiguous page")
        return raw.flatten(1)

    def pages(self, kv_cache: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each path's pages (num_blocks, page bytes) uint8: views into vLLM's blocks (block stride: vLLM's)."""
        blocks = self.blocks(kv_cache)
        return {p: blocks[:, self.offsets[p]: self.offsets[p] + self.layouts[p].page_bytes] for p in PATHS}

    def write(self, kv_cache: torch.Tensor, slots: torch.Tensor, tokens: dict[str, torch.Tensor],
              scales: dict[str, torch.Tensor] | None = None, paths: list[str] | tuple[str, ...] = PATHS) -> None:
        """Encode tokens {path: (N, d)} into slots (N,) (block * block_size + position) of vLLM's cache; `scales`
        {path: (N,)}: each token's sequence scale, for the paths scaled once per sequence. `paths`: those written (a
        path over blocks of tokens takes whole blocks, each run of `token_block` tokens one block)."""
        pages = self.pages(kv_cache)
        slots = slots.to(kv_cache.device)
        block, pos = slots // self.block_size, slots % self.block_size
        for p in paths:
            fmt = self.fmt.path(p)
            scale = scales[p] if fmt.tensor_scaled else None
            encoded = fmt.encode(tokens[p].to(self.act_dtype) if not fmt.quantized else tokens[p], scale)
            if fmt.quantized:  # scales that overflow their dtype are refused, as the framework's cache refuses them
                # (on a GPU by a device-side assert: no host read in the step)
                check_finite(encoded, f"quant.{p} ({fmt.describe()})", on_device=kv_cache.is_cuda)
            layout = self.layouts[p]
            for part, value in encoded.items():
                if value.numel():
                    layout.view(pages[p], f"{p}/{part}")[block, pos] = value.to(layout.spec()[f"{p}/{part}"][1])

    def segment(self, kv_cache: torch.Tensor, block_table: torch.Tensor, lengths: torch.Tensor) -> Segment:
        """The stored tokens of each sequence as a decode segment: (B, max_blocks) table, (B,) tokens. A format the
        decode kernels read stays in its pages; any other (3-bit codes, fp8, codebooks over channels) is decoded by
        its codec into a dense float32 segment of every sequence's tokens."""
        table, lengths = block_table.to(torch.int32).contiguous(), lengths.to(block_table.device, torch.int32)
        if self.fmt.kernel_unsupported() is None:
            pages = self.pages(kv_cache)
            paths = {p: read_path(self.fmt.path(p), self.fmt.dim(p), self.layouts[p], pages[p]) for p in PATHS}
            return Segment(paths["content"], paths["rope"], table, lengths)
        dense = self.decoded(kv_cache, table)
        return Segment.dense(dense["content"], dense["rope"], lengths)

    def decoded(self, kv_cache: torch.Tensor, block_table: torch.Tensor, start: int = 0,
                width: int | None = None) -> dict[str, torch.Tensor]:
        """The tokens at positions [start, start + width) (default: every token) of the blocks of each row of
        `block_table` (B, n), decoded by their codecs: {path: (B, width, d)} float32. A path over blocks of tokens
        decodes each run of `token_block` tokens from `start` as one block."""
        pages = self.pages(kv_cache)
        width = block_table.shape[1] * self.block_size - start if width is None else width
        pos = start + torch.arange(width, device=block_table.device)
        blocks, slot = block_table.long().clamp(min=0)[:, pos // self.block_size], pos % self.block_size  # (B, L)
        scales = self.sequence_scales(kv_cache, block_table[:, 0].long().clamp(min=0)) if self.scaled else {}
        dense = {}
        for p in PATHS:
            layout = self.layouts[p]
            parts = {name.split("/", 1)[1]: layout.view(pages[p], name)[blocks, slot] for name in layout.spec()}
            scale = scales[p][:, None].expand(blocks.shape) if p in scales else None
            dense[p] = self.fmt.path(p).decode(parts, self.fmt.dim(p), torch.float32, scale)
        return dense


def pool_bytes(fmt: CacheSpec, slots: int, act_dtype: torch.dtype, num_layers: int) -> int:
    """The bytes of the protected region's pools of the engine's `num_layers` MLA layers (`ProtectedPool`): `slots`
    sequences x (n_sink + recent + token_block) tokens x each layer's d_c + d_r values in the activation dtype (its
    positions, host-side bookkeeping, not counted). A uniform spec (one entry) is every layer's."""
    layers = fmt.layers * num_layers if len(fmt.layers) == 1 else fmt.layers
    if len(layers) != num_layers:
        raise ValueError(f"quant={fmt.name}: a format for each of {len(fmt.layers)} cache layers, and the model has "
                         f"{num_layers} MLA layers")
    return sum(layer_pool_bytes(f, slots, act_dtype) for f in layers)


def pool_tokens(fmt: CacheFormat) -> tuple[int, int]:
    """(sinks, ring) a layer's pool holds per sequence: `n_sink`, and its latest `recent` tokens with, for a path
    over blocks of tokens, `token_block` more: those that wait for their block to fill. (0, 0): no pool."""
    return fmt.n_sink, fmt.recent + (fmt.token_block or 0)


def layer_pool_bytes(fmt: CacheFormat, slots: int, act_dtype: torch.dtype) -> int:
    """One layer's protected pool (`ProtectedPool`): `slots` sequences x its tokens (`pool_tokens`) x its d_c + d_r
    values in the activation dtype (its positions, host-side bookkeeping, not counted)."""
    return slots * sum(pool_tokens(fmt)) * (fmt.d_c + fmt.d_r) * act_dtype.itemsize


def worker_pool_bytes(config) -> int:
    """The bytes of the protected pools of a worker's MLA layers served by this backend (vLLM's config: its layers)."""
    return sum(module.impl.pool_bytes for module in config.compilation_config.static_forward_context.values()
               if isinstance(getattr(module, "impl", None), LatentFormatImpl))


def count_pools(config) -> None:
    """vLLM sizes its blocks from the memory its worker reports (`determine_available_memory`:
    `kv_cache_memory_bytes` when set, else what it measured free) and allocates no protected pool: they are this
    backend's, allocated on the first step. So the worker class (vLLM's config names it) reports that memory less its
    layers' pools (`worker_pool_bytes`), and a budget that leaves the blocks nothing is refused by name. Wrapped once
    per process; a worker without pools reports as before."""
    from vllm.utils.import_utils import resolve_obj_by_qualname

    worker = config.parallel_config.worker_cls
    worker = resolve_obj_by_qualname(worker) if isinstance(worker, str) else worker
    measure = worker.determine_available_memory
    if getattr(measure, "counts_pools", False):
        return

    @functools.wraps(measure)
    def determine_available_memory(self):
        available = measure(self)
        pools = worker_pool_bytes(self.vllm_config)
        if pools and pools >= available:
            raise ValueError(f"the protected region's pools take {pools} bytes for max_num_seqs="
                             f"{self.vllm_config.scheduler_config.max_num_seqs} sequences, and the KV cache has "
                             f"{available}; allowed: a larger kv_cache_memory_bytes, or a smaller max_num_seqs")
        return available - pools

    determine_available_memory.counts_pools = True
    worker.determine_available_memory = determine_available_memory


def shared_blocks_refused(fmt: CacheSpec) -> str | None:
    """Why sequences cannot share this format's blocks (vLLM's prefix caching: a prompt's leading blocks taken from
    an earlier sequence with the same tokens), or None: each block then holds its tokens alone, encoded as any
    sequence with the same prefix encodes them, and a prompt continued over them reads them as its cached context."""
    if any(sum(pool_tokens(f)) for f in fmt.layers):
        return ("its protected pool (sinks, the recent window, tokens waiting for their token block) finds a "
                "sequence by the block it owns first")
    if any(f.path(p).tensor_scaled for f in fmt.layers for p in PATHS):
        return "each sequence's scale is held in its first block"
    return None


def check_sinks_fit(fmt: CacheSpec, block_size: int) -> None:
    """Sinks that do not fit a sequence's first block, refused by name: the pool finds a sequence by that block, and
    decode reads the tokens after the sinks from it."""
    n_sink = max(f.n_sink for f in fmt.layers)
    if n_sink > block_size:
        raise ValueError(f"quant={fmt.name}: quant.protected.n_sink={n_sink} sinks do not fit a sequence's first "
                         f"block (block_size {block_size}); allowed: n_sink <= block_size")


def is_layer_page(spec) -> bool:
    """A layer's page as `layer_pages` sets it: bytes (uint8) of the layer's format, in a cache vLLM would otherwise
    store in the activation dtype (`kv_cache_dtype="auto"`)."""
    return spec.dtype == torch.uint8 and spec.cache_dtype_str == "auto" and spec.state_content_bytes is not None


def layer_pages() -> None:
    """Each MLA layer served by this backend asks vLLM for its own format's page bytes: vLLM's MLA layer makes its
    spec (`get_kv_cache_spec`) before the backend sees it (`customize_spec`, a class method, not told the layer),
    so the layer's method is wrapped to set the layer's bytes (`is_layer_page`), which `customize_spec` keeps.
    Wrapped once per process; every other layer's spec is vLLM's."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    make = MLAAttention.get_kv_cache_spec
    if getattr(make, "layer_pages", False):
        return

    @functools.wraps(make)
    def get_kv_cache_spec(self, vllm_config):
        spec = make(self, vllm_config)
        impl = getattr(self, "impl", None)
        if spec is None or not isinstance(impl, LatentFormatImpl) or impl.served is None:
            return spec
        token_bytes = EnginePages(impl.fmt, spec.block_size, vllm_config.model_config.dtype).token_bytes
        return replace(spec, dtype=torch.uint8, state_content_bytes=token_bytes)

    get_kv_cache_spec.layer_pages = True
    MLAAttention.get_kv_cache_spec = get_kv_cache_spec


def engine_block_size() -> int:
    """The block size of the engines `experiment=serve` starts (`vllm_run.engine_args` asks for it), known before
    they start: the one vLLM's CPU MLA allows (its C++ decode kernel's, which vLLM's CPU platform sets for every MLA
    model), a multiple of 16 as vLLM's Triton MLA (the GPU backend's) wants."""
    sizes = LatentMLABackend.get_supported_kernel_block_sizes()
    assert len(sizes) == 1 and isinstance(sizes[0], int) and LatentTritonMLABackend.supports_block_size(sizes[0])
    return sizes[0]


class SlotTable:
    """The slots of the engine's sequences in its layers' protected pools: one table per engine, shared by every
    layer's pool (each holds the same sequences in the same slots), so a step assigns them once. A sequence's slot is
    found by its first block; `slots` is the engine's max_num_seqs."""

    def __init__(self, slots: int):
        self.slots = slots
        self.owner: list[int | None] = [None] * slots  # the first block of the sequence in each slot
        self.slot_of: dict[int, int] = {}
        self.used = [0] * slots  # the step each slot was last written
        self.step = 0
        self.misses = 0  # sequences that came back to find their slot taken (read as stored from then on)
        self._assigned: tuple[object, tuple[list[int], list[int]]] | None = None  # the last step's key and answer

    def assign(self, keys: list[int], starts: list[bool], step: object = None) -> tuple[list[int], list[int]]:
        """(the slot of each sequence of a step, by its first block; the slots that start afresh: a sequence writing
        its position 0, a prompt or a preempted one recomputed). `step`: the step's key (its forward context), one
        object for every layer of a step, which then gets the first layer's answer."""
        if step is not None and self._assigned is not None and self._assigned[0] is step:
            return self._assigned[1]
        self.step += 1
        touched, out, fresh = set(keys), [], []
        for key, start in zip(keys, starts):
            idx = self.slot_of.get(key)
            if idx is None:
                idx = self._take(touched)
                self.owner[idx], self.slot_of[key] = key, idx
                self.misses += not start
                start = True
            if start:
                fresh.append(idx)
            self.used[idx] = self.step
            out.append(idx)
        if step is not None:
            self._assigned = (step, (out, fresh))
        return out, fresh

    def _take(self, touched: set[int]) -> int:
        """A free slot, else the one written longest ago among those of sequences outside this step."""
        free = [i for i, key in enumerate(self.owner) if key is None]
        if not free:
            free = sorted((i for i, key in enumerate(self.owner) if key not in touched), key=self.used.__getitem__)
            if not free:
                raise RuntimeError(f"one engine step runs more sequences than the protected region's pool holds "
                                   f"({self.slots}, the engine's max_num_seqs)")
            del self.slot_of[self.owner[free[0]]]
        return free[0]


class ProtectedPool:
    """One engine layer's protected region (module docstring): the sequences of `table` (its slots) with their first
    `n_sink` tokens and a ring of their latest `recent` (slot p % ring holds position p), in the activation dtype,
    with the position each ring entry holds (-1: none), so that a read takes only what this sequence wrote. With a
    path over blocks of tokens (`token_block`, KIVI's), the ring holds `token_block` tokens more: those that left the
    window since the sequence's last whole block, read as they are until their block fills (the framework's pending
    tokens), and held until the engine stores the block (`held`)."""

    def __init__(self, n_sink: int, recent: int, width: int, table: SlotTable, dtype: torch.dtype,
                 token_block: int | None = None, device: torch.device | str = "cpu"):
        self.n_sink, self.recent, self.table, self.slots = n_sink, recent, table, table.slots
        self.token_block = token_block
        self.ring = recent + (token_block or 0)
        self.device = torch.device(device)
        self.sinks = torch.zeros(self.slots, n_sink, width, dtype=dtype, device=device)  # the tokens: the device's
        self.window = torch.zeros(self.slots, self.ring, width, dtype=dtype, device=device)
        self.window_pos = torch.full((self.slots, self.ring), -1, dtype=torch.long, device="cpu")  # the host's
        self.sinks_held = torch.zeros(self.slots, dtype=torch.long, device="cpu")

    @property
    def nbytes(self) -> int:
        return self.sinks.nbytes + self.window.nbytes

    def assign(self, keys: list[int], starts: list[bool], step: object = None) -> list[int]:
        """The slot of each sequence of a step (`SlotTable.assign`); the slots that start afresh emptied here."""
        idx, fresh = self.table.assign(keys, starts, step)
        if fresh:
            self.window_pos[fresh] = -1
            self.sinks_held[fresh] = 0
        return idx

    def write(self, idx: torch.Tensor, pos: torch.Tensor, x: torch.Tensor, length: torch.Tensor) -> None:
        """Tokens x (N, width) (on the pool's device) at positions pos (N,) of the sequences in slots idx (N,),
        whose sequences hold `length` (N,) tokens after this step (host tensors): the sinks, and those among the
        latest `ring` (so no two of a step share a ring entry)."""
        sink = pos < self.n_sink
        if sink.any():
            i, p = idx[sink], pos[sink]
            self.sinks[i.to(self.device), p.to(self.device)] = x[sink.to(x.device)].to(self.sinks.dtype)
            self.sinks_held.scatter_reduce_(0, i, p + 1, "amax")
        in_ring = pos >= length - self.ring
        if self.ring and in_ring.any():
            i, p = idx[in_ring], pos[in_ring]
            self.window[i.to(self.device), (p % self.ring).to(self.device)] = \
                x[in_ring.to(x.device)].to(self.window.dtype)
            self.window_pos[i, p % self.ring] = p

    def first_held(self, length: torch.Tensor) -> torch.Tensor:
        """The first position read from the ring (B,) of sequences of `length` tokens: the window's, or with a token
        block the first of the tokens after the sequence's last whole block (the blocks start after the sinks)."""
        lo = torch.clamp(length - self.recent, min=self.n_sink)
        if self.token_block:
            lo = self.n_sink + (lo - self.n_sink) // self.token_block * self.token_block
        return lo

    def whole_blocks(self, length: torch.Tensor) -> torch.Tensor:
        """The whole token blocks (B,) stored of sequences of `length` tokens (0 without a token block)."""
        if not self.token_block:
            return torch.zeros_like(length)
        return (self.first_held(length) - self.n_sink) // self.token_block

    def held(self, idx: int, pos: torch.Tensor) -> torch.Tensor:
        """The ring's tokens (n, width) at positions pos (n,) of the sequence in slot idx; a token it no longer holds
        (the slot was taken while the sequence waited) refused by name."""
        ring = pos % self.ring
        self.refuse_lost(self.window_pos[idx, ring] != pos)
        return self.window[idx, ring.to(self.device)]

    def refuse_lost(self, miss: torch.Tensor) -> None:
        """With a token block, a sequence's pending tokens are nowhere else: a slot that no longer holds them (`miss`,
        any) is refused by name rather than read as stored."""
        if self.token_block and bool(miss.any()):
            raise RuntimeError(f"a sequence's tokens waiting for their token block (token_block={self.token_block}) "
                               "were lost: its protected pool slot was taken while it waited (more sequences started "
                               "than max_num_seqs slots)")

    def read(self, idx: torch.Tensor, stored: torch.Tensor, new: torch.Tensor | int = 1):
        """For sequences in slots idx (B,) holding `stored` (B,) tokens before this step's `new` (a decode step's
        one, a chunk of a prompt's) (host tensors): (sinks (B, n_sink, width), window (B, ring, width) oldest first:
        on the pool's device; the sinks' count, the window's count, lo (B,): the first position of the window,
        miss (B,): True where the slot does not hold all of them: on the host)."""
        lo = self.first_held(stored + new)  # with this step's tokens
        sink_len = torch.clamp(stored, max=self.n_sink)
        miss = self.sinks_held[idx] < sink_len
        at = idx.to(self.device)
        if not self.ring:
            return self.sinks[at], sink_len, self.window[at], torch.zeros_like(stored), lo, miss
        want = lo[:, None] + torch.arange(self.ring, device="cpu")  # (B, ring)
        ring = want % self.ring
        win_len = torch.clamp(stored - lo, min=0)
        held = (self.window_pos[idx[:, None], ring] == want) | (want >= stored[:, None])
        miss = miss | ~held.all(1)
        return self.sinks[at], sink_len, self.window[at[:, None], ring.to(self.device)], win_len, lo, miss


@functools.lru_cache(maxsize=8)
def served(model: str) -> CacheSpec | None:
    """The served format of an exported checkpoint folder (read once per process), or None (not one of ours)."""
    description = read_description(model)
    return None if description is None else served_format(description)


_LOADED: dict[str, object] = {}  # the format of the model this process loaded (see current_format)
_SLOT_TABLES: dict[int, tuple[object, SlotTable]] = {}  # per engine (its vLLM config): the layers' shared slots
_STEP: list = []  # the last step's forward context, metadata and host view (`LatentFormatImpl._step`)


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
    format's pages, whatever the model's latent dims; with the host copies vLLM's runner keeps of the step's query
    starts and sequence lengths (`HostCopies`), so a step reads neither back from the device."""

    host_starts: torch.Tensor | None = None  # (R + 1,) where each sequence's tokens begin, on the host
    host_seq_lens: torch.Tensor | None = None  # (R,) each sequence's tokens with this step's, on the host

    def __post_init__(self):
        pass


class HostCopies:
    """A metadata builder (the class after it in a subclass's bases) that hands the step's host copies to the
    format's metadata: vLLM's runner keeps the query starts on the host, and the sequence lengths too, exact where
    each decode row takes one token (no speculative decoding: the backends' builders ask for one)."""

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        meta = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if isinstance(meta, LatentMetadata):
            meta.host_starts = common_attn_metadata.query_start_loc_cpu
            meta.host_seq_lens = common_attn_metadata.seq_lens_cpu_upper_bound
        return meta


class LatentMetadataBuilder(HostCopies, MLACommonMetadataBuilder[LatentMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device, **kwargs):
        kwargs.setdefault("metadata_cls", LatentMetadata)
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, **kwargs)


class LatentBackend:
    """A vLLM MLA backend storing an exported checkpoint's latent cache in its format (module docstring), over the
    vLLM backend after it in a subclass's bases."""

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [] if current_format()[0] is not None else super().get_supported_head_sizes()

    @classmethod
    def customize_spec(cls, spec):
        fmt, config = current_format()
        if fmt is None:
            return super().customize_spec(spec)
        if any(f.n_sink for f in fmt.layers):
            check_sinks_fit(fmt, spec.block_size)  # at engine start, before any step
        if is_layer_page(spec):  # a layer's own page (`layer_pages`)
            return spec
        token_bytes = page_token_bytes(fmt, spec.block_size, config.model_config.dtype)
        return replace(spec, dtype=torch.uint8, state_content_bytes=token_bytes)


class LatentMLABackend(LatentBackend, CPUMLABackend):
    """On vLLM's CPU platform (the plugin overrides its CPU_MLA member): decode by the C++ kernel where it reads the
    format."""

    @staticmethod
    def get_builder_cls():
        return LatentMetadataBuilder

    @staticmethod
    def get_impl_cls():
        return LatentMLAImpl


class LatentTritonMetadataBuilder(HostCopies, TritonMLAMetadataBuilder):
    """vLLM's Triton MLA metadata, with one token per decode row (a step's new token is read fresh and written into
    the pools one per sequence) and attention run outside CUDA graphs (the pools' slots and positions are worked
    out on the host each step, from the rows' first blocks read back from the device)."""

    _cudagraph_support = AttentionCGSupport.NEVER
    query_len_support = QueryLenSupport.SINGLE_ONLY
    supports_non_causal_multi_token_decode = False

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.metadata_cls = LatentMetadata


class LatentTritonMLABackend(LatentBackend, TritonMLABackend):
    """On a CUDA GPU (the plugin registers it as vLLM's CUSTOM backend and names it for an exported checkpoint):
    decode by the project's Triton kernel where it reads the format, prefill through vLLM's prefill backend."""

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_builder_cls():
        return LatentTritonMetadataBuilder

    @staticmethod
    def get_impl_cls():
        return LatentTritonMLAImpl

    @classmethod
    def supports_non_causal(cls) -> bool:
        return False


class LatentFormatImpl:
    """Writes and reads the served format (module docstring), over a vLLM MLA implementation (the class after it in
    a subclass's bases: `LatentMLAImpl` on the CPU, `LatentTritonMLAImpl` on a CUDA GPU), which serves any model
    that is not ours, prefills, and runs everything else. Host-side bookkeeping (the step's lengths, the pools'
    positions and slots) lives on the CPU, named so; what the engine's tensors hold (pages, pools, segments) on their
    device."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.served, config = current_format()
        self.act_dtype = None if config is None else config.model_config.dtype
        self.block_size = None if config is None else config.cache_config.block_size
        self.max_num_seqs = None if config is None else config.scheduler_config.max_num_seqs
        self.config = config
        self._fresh: dict[str, torch.Tensor] | None = None
        self._slots: torch.Tensor | None = None  # the protected pool's slot of each sequence of this step
        if self.served is not None:
            layer_pages()  # each layer's page its own format's bytes
        if self.served is not None and any(sum(pool_tokens(f)) for f in self.served.layers):
            count_pools(config)  # vLLM's blocks get the KV cache's bytes less the pools

    @functools.cached_property
    def pool_bytes(self) -> int:
        """The bytes of this layer's protected pool (0: none), once the model is built (its format known)."""
        return 0 if self.served is None else layer_pool_bytes(self.fmt, int(self.max_num_seqs), self.act_dtype)

    @functools.cached_property
    def fmt(self) -> CacheFormat:
        """This layer's format: the served one, or its entry for this layer (the layer found among the engine's MLA
        layers, in decoder order, once the model is built)."""
        if self.served.uniform is not None:
            return self.served.uniform
        layers = self.served.layers
        ours = [name for name, module in self.config.compilation_config.static_forward_context.items()
                if isinstance(getattr(module, "impl", None), LatentFormatImpl)]
        order = sorted(ours, key=lambda name: [int(n) for n in re.findall(r"\d+", name)])
        if len(order) != len(layers):
            raise ValueError(f"quant={self.served.name}: a format for each of {len(layers)} cache layers, and the "
                             f"engine runs {len(order)} MLA layers")
        return layers[order.index(self.layer_name)]

    @functools.cached_property
    def layer_name(self) -> str:
        """The name of the engine's attention layer this implements (found once the model is built)."""
        return next(name for name, module in self.config.compilation_config.static_forward_context.items()
                    if getattr(module, "impl", None) is self)

    @functools.cached_property
    def pages(self) -> EnginePages:
        return EnginePages(self.fmt, self.block_size, self.act_dtype)

    @functools.cached_property
    def pool(self) -> ProtectedPool | None:
        """This layer's protected region (None: the format protects nothing)."""
        fmt = self.fmt
        if not any(pool_tokens(fmt)):
            return None
        check_sinks_fit(self.served, self.block_size)
        return ProtectedPool(fmt.n_sink, fmt.recent, fmt.d_c + fmt.d_r, self.slot_table, self.act_dtype,
                             fmt.token_block, self.device)

    @functools.cached_property
    def device(self) -> torch.device:
        """The device of the engine's KV cache (vLLM's config), where the pools are kept."""
        config = getattr(self, "config", None)
        return torch.device("cpu") if config is None else torch.device(config.device_config.device_type)

    @functools.cached_property
    def slot_table(self) -> SlotTable:
        """The engine's slot table (`SlotTable`), shared by its layers' pools."""
        held = _SLOT_TABLES.get(id(self.config))
        if held is None or held[0] is not self.config:
            held = _SLOT_TABLES[id(self.config)] = (self.config, SlotTable(int(self.max_num_seqs)))
        return held[1]

    def _step(self):
        """This layer's view of the step: (its forward context, one per step; its metadata; starts (R + 1,): where
        each sequence's tokens begin, decode rows first; row (N,): each token's sequence; cached (R,): the tokens each
        sequence held before this step: a decode row's all but its new one, a prompt's its context, 0 unless
        chunked prefill continues it; first (R,): each sequence's first block), or None in a warm-up run without
        sequences. All but the context and metadata are host tensors, made once per step and metadata (every layer
        of a step sharing its metadata gets the first layer's): the starts and lengths from the runner's host copies
        where the builder handed them (`HostCopies`), the first blocks (and otherwise the rest) read from the
        metadata's device tensors."""
        from vllm.forward_context import get_forward_context

        context = get_forward_context()
        meta = context.attn_metadata  # per layer (layers with different page sizes have their own builders)
        meta = meta.get(self.layer_name) if isinstance(meta, dict) else meta
        if not isinstance(meta, MLACommonMetadata):
            return None
        if _STEP and _STEP[0] is context and _STEP[1] is meta:
            return _STEP[2]
        host = functools.partial(torch.as_tensor, device="cpu", dtype=torch.long)
        held = getattr(meta, "host_starts", None), getattr(meta, "host_seq_lens", None)  # the runner's host copies
        starts = host(meta.query_start_loc if held[0] is None else held[0])[: meta.num_reqs + 1]
        row = torch.searchsorted(starts[1:], torch.arange(meta.num_actual_tokens, device="cpu"), right=True)
        d = meta.num_decodes
        cached = torch.zeros(meta.num_reqs, dtype=torch.long, device="cpu")
        first = torch.empty(meta.num_reqs, dtype=torch.long, device="cpu")
        if d:
            cached[:d] = host(meta.decode.seq_lens[:d] if held[1] is None else held[1][:d]) - 1
            first[:d] = host(meta.decode.block_table[:d, 0])
        if meta.num_prefills:
            first[d:] = host(meta.prefill.block_table[:, 0])
            if meta.prefill.chunked_context is not None:  # chunked prefill: a prompt continued over its context
                cached[d:] = host(meta.prefill.chunked_context.context_lens_list)
        _STEP[:] = [context, meta, (context, meta, starts, row, cached, first)]
        return _STEP[2]

    def _protect(self, kv_cache: torch.Tensor, x: torch.Tensor) -> None:
        """Write this step's protected tokens x (N, d_c + d_r) into the pool: each token's sequence and position from
        the step's metadata (decode rows first, one token each; a prompt from position 0, or with chunked prefill
        from its cached context on). With a token block, the blocks this step fills are then stored
        (`_store_blocks`)."""
        step = self._step()
        if step is None:  # a warm-up run without sequences
            return
        context, meta, starts, row, cached, first = step  # the context: the key of the step's slots, for every layer
        n, d = meta.num_actual_tokens, meta.num_decodes
        if meta.num_decode_tokens != d:
            raise ValueError(f"quant={self.served.name}: a protected region takes one token per decode step "
                             f"({meta.num_decode_tokens} tokens for {d} sequences: speculative decoding)")
        x = x[:n]
        length = cached + starts[1:] - starts[:-1]  # each sequence's tokens after this step
        pos = cached[row] + torch.arange(n, device="cpu") - starts[row]
        idx = torch.tensor(self.pool.assign(first.tolist(), (cached == 0).tolist(), step=context), dtype=torch.long,
                           device="cpu")
        self._slots = idx
        if self.pool.token_block:  # the sequences' whole token blocks before and after this step (R,)
            blocks = self.pool.whole_blocks(cached), self.pool.whole_blocks(length)
            pending = self._pending(meta, idx, cached, blocks)
        self.pool.write(idx[row], pos, x, length[row])
        if self.pool.token_block:
            self._store_blocks(kv_cache, meta, starts, idx, cached, blocks, x, pending)

    def _pending(self, meta, idx: torch.Tensor, cached: torch.Tensor,
                 blocks: tuple[torch.Tensor, torch.Tensor]) -> dict[int, torch.Tensor]:
        """With a token block: the cached tokens of each prompt continued by chunked prefill whose block this step
        fills (`blocks`: each sequence's whole blocks before and after it), waiting in the ring for it {row: (n,
        width)}, taken before this step's tokens overwrite the ring's entries."""
        pool, d = self.pool, meta.num_decodes
        before, done = blocks
        out = {}
        for r in range(d, meta.num_reqs):
            if int(cached[r]) and int(done[r]) > int(before[r]):
                lo = pool.n_sink + int(before[r]) * pool.token_block
                out[r] = pool.held(int(idx[r]), torch.arange(lo, int(cached[r]), device="cpu"))
        return out

    def _store_blocks(self, kv_cache: torch.Tensor, meta, starts: torch.Tensor, idx: torch.Tensor,
                      cached: torch.Tensor, blocks: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                      pending: dict[int, torch.Tensor]) -> None:
        """Encode the token blocks this step fills (`blocks`: each sequence's whole blocks before and after it; the
        paths over blocks of tokens, KIVI's) into their tokens' slots, as the framework's cache stores a block when
        its last token leaves the window: a prompt's from its own tokens (x: the step's) after the tokens of its
        cached context that waited for the block (`pending`), a decode row's from its pool's ring, which held them
        since they were written."""
        pool, t, bs, d = self.pool, self.pool.token_block, self.block_size, meta.num_decodes
        before, done = blocks
        held, where = [], []
        for r in torch.nonzero(done > before).flatten().tolist():
            pos = pool.n_sink + t * int(before[r]) + torch.arange(t * int(done[r] - before[r]), device="cpu")
            if r < d:
                held.append(pool.held(int(idx[r]), pos))
            else:
                new = pos >= cached[r]
                waited = pending.get(r, x[:0])[: int((~new).sum())]
                held.append(torch.cat([waited, x[(starts[r] + pos[new] - cached[r]).to(x.device)]]))
            table = (meta.decode.block_table[r] if r < d else meta.prefill.block_table[r - d]).to("cpu", torch.long)
            where.append(table[pos // bs] * bs + pos % bs)
        if held:
            tokens = torch.cat(held)
            d_c = self.fmt.d_c
            self.pages.write(kv_cache, torch.cat(where), {"content": tokens[:, :d_c], "rope": tokens[:, d_c:]},
                             paths=self.pages.blocked)

    def _sequence_scales(self, kv_cache: torch.Tensor, slots: torch.Tensor,
                         tokens: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The scale of each of this step's tokens {path: (N,)}, for the paths scaled once per sequence: a prompt's
        set from its tokens (as the framework's cache sets it on a sequence's first append) and written into its
        first block; a decode row's read from its first block. A recomputed prompt (a preempted sequence) sets its
        scale again from the tokens it recomputes."""
        step = self._step()
        if step is None:  # a warm-up run without sequences: one scale for its tokens
            return {p: s.expand(slots.shape[0]) for p, s in self.pages.prompt_scales(tokens).items()}
        _, meta, starts, row, cached, first = step
        n = meta.num_actual_tokens
        device = kv_cache.device
        per_row = {p: torch.empty(meta.num_reqs, dtype=torch.float32, device=device) for p in self.pages.scaled}
        going = cached > 0  # a decode row, or a prompt continued by chunked prefill: its scale is set
        if going.any():
            held = self.pages.sequence_scales(kv_cache, first[going])
            for p in per_row:
                per_row[p][going.to(device)] = held[p]
        for r in torch.nonzero(~going).flatten().tolist():  # a prompt from position 0: its first tokens set it
            a, b = int(starts[r]), int(starts[r + 1])
            scales = self.pages.prompt_scales({p: x[a:b] for p, x in tokens.items()})
            self.pages.set_sequence_scales(kv_cache, slots[a:a + 1] // self.block_size,
                                           {p: s.reshape(1) for p, s in scales.items()})
            for p in per_row:
                per_row[p][r] = scales[p]
        out = {p: x[row.to(device)] for p, x in per_row.items()}
        if slots.shape[0] > n:  # padding slots after the step's tokens (written nowhere)
            out = {p: torch.cat([x, x.new_ones(slots.shape[0] - n)]) for p, x in out.items()}
        return out

    def _protected_segments(self, kv_cache: torch.Tensor, table: torch.Tensor, stored: torch.Tensor,
                            dtype: torch.dtype) -> list[Segment]:
        """The stored tokens of each decode row as segments: its sinks and its recent window from the pool, the rest
        from its blocks (all from its blocks for a row whose slot was taken)."""
        pool, bs, d_c, device = self.pool, self.block_size, self.fmt.d_c, kv_cache.device
        sinks, sink_len, window, win_len, lo, miss = pool.read(self._slots[: table.shape[0]], stored.long())
        if pool.token_block:  # the whole blocks after the sinks (a row whose slot was taken: refused)
            segments = self._block_segments(kv_cache, table, stored.long(), lo, miss, dtype)
        else:
            start = torch.where(miss, 0, pool.n_sink)  # the blocks' tokens: [start, end)
            end = torch.where(miss, stored.long(), torch.minimum(lo, stored.long()))
            sink_len, win_len = torch.where(miss, 0, sink_len), torch.where(miss, 0, win_len)
            segments = []
            if pool.n_sink:  # the first block after the sinks, decoded; the blocks after it read as they are
                first = self.pages.decoded(kv_cache, table[:, :1])
                at = torch.clamp(start[:, None] + torch.arange(bs, device="cpu"), max=bs - 1)[..., None].to(device)
                segments.append(Segment.dense(*(first[p].gather(1, at.expand(-1, -1, first[p].shape[-1])).to(dtype)
                                                for p in PATHS),
                                              torch.clamp(torch.clamp(end, max=bs) - start, min=0).to(device,
                                                                                                      torch.int32)))
                if table.shape[1] > 1:
                    segments.append(self.pages.segment(kv_cache, table[:, 1:], torch.clamp(end - bs, min=0)))
            else:
                segments.append(self.pages.segment(kv_cache, table, end))
        for held, count in ((sinks, sink_len), (window, win_len)):
            if held.shape[1]:
                segments.append(Segment.dense(held[..., :d_c].to(dtype).contiguous(),
                                              held[..., d_c:].to(dtype).contiguous(), count.to(device, torch.int32)))
        return segments

    def _block_segments(self, kv_cache: torch.Tensor, table: torch.Tensor, stored: torch.Tensor, lo: torch.Tensor,
                        miss: torch.Tensor, dtype: torch.dtype) -> list[Segment]:
        """With a token block: each decode row's whole blocks stored after its sinks, up to `lo` (the ring's first
        position; not this step's token, read fresh), decoded from its blocks as one dense segment (zero past each
        row's tokens). A row whose slot was taken lost its pending tokens: refused by name."""
        self.pool.refuse_lost(miss)
        t, n_sink = self.pool.token_block, self.pool.n_sink
        count = torch.clamp(torch.minimum(lo, stored) - n_sink, min=0)  # (B,)
        width = -(-int(count.max()) // t) * t  # whole blocks: the codec decodes a block at once
        if not width:
            return []
        dense = self.pages.decoded(kv_cache, table, n_sink, width)
        keep = (torch.arange(width, device="cpu") < count[:, None])[..., None].to(kv_cache.device)
        return [Segment.dense(*(torch.where(keep, dense[p], 0).to(dtype).contiguous() for p in PATHS),
                              count.to(kv_cache.device, torch.int32))]

    def _context(self, kv_cache: torch.Tensor, meta, dtype: torch.dtype) -> list[torch.Tensor]:
        """Each prompt's cached context (chunked prefill), as the framework's cache reads it in a step of several
        tokens once they are appended: {prompt row: (context, d_c + d_r)} in `dtype`, the tokens as stored, the
        protected ones (sinks, the window of the sequence with this step's tokens, a token block's tokens waiting
        for it to fill) from the pool."""
        prefill, d, pool = meta.prefill, meta.num_decodes, self.pool
        queries = prefill.query_lens_cpu.tolist()

        def stored(table, start, width):  # the row's tokens [start, start + width) as stored: (width, d_c + d_r)
            dense = self.pages.decoded(kv_cache, table, start, width)
            return torch.cat([dense[p][0] for p in PATHS], -1).to(dtype)

        out = []
        for r, cached in enumerate(prefill.chunked_context.context_lens_list):
            table = prefill.block_table[r : r + 1]
            if not cached:
                out.append(torch.empty(0, self.fmt.d_c + self.fmt.d_r, dtype=dtype, device=kv_cache.device))
                continue
            if pool is None:
                out.append(stored(table, 0, cached))
                continue
            sinks, n_sinks, window, n_window, lo, miss = pool.read(self._slots[d + r : d + r + 1],
                                                                   torch.tensor([cached], device="cpu"), queries[r])
            lo, n_sinks, n_window = int(lo[0]), int(n_sinks[0]), int(n_window[0])
            sinks, window = sinks[0, :n_sinks].to(dtype), window[0, :n_window].to(dtype)
            if pool.token_block:  # the sinks, the whole blocks after them (decoded a block at once), the ring
                pool.refuse_lost(miss)
                blocks = stored(table, pool.n_sink, lo - pool.n_sink)[: max(cached - pool.n_sink, 0)] \
                    if lo > pool.n_sink else window[:0]
                out.append(torch.cat([sinks, blocks, window]))
                continue
            x = stored(table, 0, cached)
            if not bool(miss[0]):  # a sequence whose slot was taken reads its tokens as stored
                x[:n_sinks], x[lo: lo + n_window] = sinks, window
            out.append(x)
        return out

    def _compute_prefill_context(self, q, kv_c_and_k_pe_cache, attn_metadata, k_scale):
        """Chunked prefill: the step's prompt tokens attend to their cached context read in the format (`_context`),
        through vLLM's prefill backend a workspace chunk at a time, merged by log-sum-exp as vLLM's own does (with
        its FP8 prefill queries where vLLM was asked for them); the step's own tokens are attended fresh by vLLM's
        prefill path (`forward_mha`)."""
        if self.served is None:
            return super()._compute_prefill_context(q, kv_c_and_k_pe_cache, attn_metadata, k_scale)
        from vllm.model_executor.layers.attention.mla_attention import (_get_kv_b_proj_input_dtype,
                                                                        accumulate_mla_context_chunk,
                                                                        init_mla_context_partial)
        from vllm.platforms import current_platform

        prefill = attn_metadata.prefill
        chunked = prefill.chunked_context
        fp8 = getattr(prefill, "q_data_type", None) == current_platform.fp8_dtype()  # vLLM's FP8 prefill queries
        proj_dtype = _get_kv_b_proj_input_dtype(self.kv_b_proj, fp8)
        context = self._context(kv_c_and_k_pe_cache, attn_metadata, self.act_dtype or q.dtype)
        if fp8:
            q = q.to(prefill.q_data_type)
        output = output_lse = None
        for chunk in chunked.chunks:
            rows = range(chunk.request_slice.start, chunk.request_slice.stop)
            tokens = torch.cat([context[r][a: a + n]
                                for r, a, n in zip(rows, chunk.starts.tolist(), chunk.seq_lens.tolist())])
            latent, k_pe = tokens[:, : self.kv_lora_rank], tokens[:, None, self.kv_lora_rank:]
            kv_nope = self.kv_b_proj(latent if proj_dtype is None else latent.to(proj_dtype))[0].view(
                -1, self.num_heads, self.qk_nope_head_dim + self.v_head_dim)
            if fp8:
                kv_nope, k_pe = kv_nope.to(prefill.q_data_type), k_pe.to(prefill.q_data_type)
            k_nope, v = kv_nope.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
            k = self._concat_k_nope_k_pe(k_nope, k_pe)
            out, lse = prefill.prefill_backend.run_prefill_context_chunk(chunk=chunk, q=q[chunk.token_slice], k=k,
                                                                         v=v)
            if output is None:
                if len(chunked.chunks) == 1 and not chunked.empty_token_slices:
                    return out, lse
                output, output_lse = init_mla_context_partial(chunked, out, lse, num_tokens=q.shape[0])
            accumulate_mla_context_chunk(chunk, out, lse, output, output_lse)
        return output, output_lse

    def decode_backend(self, device_type: str) -> str:
        """The decode kernel on the engine's device ("cpu": the C++ kernel; "triton" on a CUDA GPU, or on the CPU
        under TRITON_INTERPRET=1 with quant.backend=triton), or "torch" (the PyTorch path), as in the framework."""
        return self.fmt.step_backends(device_type)["decode"]

    def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale):
        if self.served is None:
            return super().do_kv_cache_update(kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale)
        k_pe = k_pe.reshape(k_pe.shape[0], -1)
        self._fresh = {"content": kv_c_normed, "rope": k_pe}  # decode reads its own token fresh (serving semantics)
        if kv_cache.numel() == 0:
            return
        slots = slot_mapping.flatten().long()
        step = self._step()
        if step is None:  # a warm-up run without sequences: the slots that are not padding (-1)
            ok = slots >= 0
        else:  # the step's tokens come first, padding after them: their slots valid (checked on the device)
            ok = slice(0, step[1].num_actual_tokens)
            torch._assert_async((slots[ok] >= 0).all(), "a step's token without a cache slot")
        n = slots.shape[0]
        tokens = {"content": kv_c_normed[:n], "rope": k_pe[:n]}
        scales = self._sequence_scales(kv_cache, slots, tokens) if self.pages.scaled else None
        per_token = [p for p in PATHS if p not in self.pages.blocked]  # a path over token blocks: when a block fills
        self.pages.write(kv_cache, slots[ok], {p: x[ok] for p, x in tokens.items()},
                         None if scales is None else {p: x[ok] for p, x in scales.items()}, paths=per_token)
        if self.pool is not None:
            self._protect(kv_cache, torch.cat([kv_c_normed[:n], k_pe[:n]], dim=-1))

    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        if self.served is None:
            return super().forward_mqa(q, kv_c_and_k_pe_cache, attn_metadata, layer)
        decode = attn_metadata.decode
        q_latent, q_rope = q if isinstance(q, tuple) else q.split([self.kv_lora_rank, self.qk_rope_head_dim], -1)
        b = q_latent.shape[0]
        lengths = decode.seq_lens[:b]
        if self.pool is None:
            stored = [self.pages.segment(kv_c_and_k_pe_cache, decode.block_table[:b], lengths - 1)]
        else:  # the rows' stored tokens as the step's host view has them (a decode row's: all but its new one)
            step = self._step()
            held = torch.as_tensor(lengths - 1, device="cpu") if step is None else step[4][:b]
            stored = self._protected_segments(kv_c_and_k_pe_cache, decode.block_table[:b], held, q_latent.dtype)
        fresh = Segment.dense(self._fresh["content"][:b, None].to(q_latent.dtype),
                              self._fresh["rope"][:b, None].to(q_latent.dtype),
                              torch.ones(b, dtype=torch.int32, device=q_latent.device))
        chosen = DECODE_BACKENDS.get(self.decode_backend(q_latent.device.type))
        kernel = chosen.op() if chosen is not None else segment_attention
        out = kernel(q_latent.contiguous(), q_rope.contiguous(), self.scale, [*stored, fresh])
        return out.to(q_latent.dtype), None


class LatentMLAImpl(LatentFormatImpl, CPUMLAImpl):
    """The served format on vLLM's CPU platform (`LatentMLABackend`)."""


class LatentTritonMLAImpl(LatentFormatImpl, TritonMLAImpl):
    """The served format on a CUDA GPU (`LatentTritonMLABackend`): its decode returns no log-sum-exp, so decode
    context parallelism is refused by name."""

    can_return_lse_for_decode = False
    supports_dcp = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.served is not None and self.dcp_world_size > 1:
            raise ValueError(f"decode_context_parallel_size={self.dcp_world_size}: the latent formats are served "
                             "without decode context parallelism; allowed: 1")
