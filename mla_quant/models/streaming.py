"""Models larger than memory: a checkpoint run layer by layer from its safetensors shards (`model.streaming=true`).

The model's skeleton is built on the meta device (buffers such as RoPE frequencies are real: they come from the
config, not the checkpoint). Each decoder layer's tensors, and only those, are read from the shards through their
index, converted by transformers' own loading code (renamings, per-expert tensors fused, as from_pretrained does),
placed on the compute device, run over every sequence of the stage, then returned to the meta device; the next
layer's tensors are read by a background thread meanwhile. The hidden states of every sequence wait on the host
between layers (pinned on a GPU box), spilled to a scratch folder beyond `model.streaming_host_gb`.

    stream = streamed_model(cfg.model, device="cpu")                     # mla_quant.models.build
    stream.load_outer()
    hidden, arguments = layer_arguments(stream.model, ids, cache)        # layer 0's input, every layer's arguments
    stream.release_outer()
    for j, layer in stream.layers():                                     # resident one at a time
        hidden, carried = run_layer(layer, stream.family, hidden, arguments[j], carried)
    stream.load_outer()
    logits = head_logits(stream.model, ids, hidden)                      # or stream.logits(ids): all of the above
    stream.figures()   # bytes read against the checkpoint, seconds per layer, the share of reading hidden

A decoder layer's arguments (masks, RoPE tables, positions) are recorded by one forward of the text model whose
decoder layers are stand-ins that record what they are given and return their input (`layer_arguments`): what the
family's own model loop passes each layer, hybrid stacks included, without running a layer.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn

from mla_quant.memory import hand_back_freed
from mla_quant.models.fp8 import (FP8_CHECKPOINT_CONFIG, FP8_DTYPES, block_fp8_config, dequantize_blocks,
                                  quantization_config)
from mla_quant.models.absorbed import CACHE_KEYWORD, absorb, decoder_layers, new_cache
from mla_quant.models.families import MLAFamily, family_for_config

# The stages that run a streamed model; the others load the whole model (model.device_map spreads it over GPUs).
STREAMED_STAGES = ("quality", "sensitivity", "calibrate", "export")


def streaming_refusal(stage: str) -> str:
    return (f"model.streaming=true: experiment={stage} loads the whole model (generation and the stages that are not "
            f"layer-separable do not stream); streamed stages: {', '.join(STREAMED_STAGES)}. Without streaming, "
            f"model.device_map=auto spreads a large model over the GPUs (and the CPU) this machine has")


class Shards:
    """A checkpoint folder's safetensors tensors: where each lives and its size (from the headers alone), read on
    demand, the bytes read counted."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.folder.glob("*.safetensors"))
            weight_map = None
        if not files:
            raise ValueError(f"model.streaming=true reads safetensors shards, and {str(self.folder)!r} has none "
                             "(model.path must be a folder with *.safetensors, as save_pretrained writes)")
        self.where: dict[str, str] = {}
        self.nbytes: dict[str, int] = {}
        self.dtypes: dict[str, str] = {}
        from mla_quant.models.safetensors_files import check_safetensors

        for name in files:  # each shard's header, checked as a loaded checkpoint's files are
            for key, info in check_safetensors(self.folder / name).items():
                if key != "__metadata__":
                    self.where[key], self.dtypes[key] = name, info["dtype"]
                    self.nbytes[key] = info["data_offsets"][1] - info["data_offsets"][0]
        if weight_map is not None:
            missing = sorted(set(weight_map) - set(self.where))
            if missing:
                raise ValueError(f"{index}: {len(missing)} tensor(s) the index names are in no shard, e.g. "
                                 f"{missing[:3]}; the folder is incomplete")
        self.bytes_read = 0
        self.read_seconds = 0.0

    @property
    def total_bytes(self) -> int:
        return sum(self.nbytes.values())

    def floating_dtype(self) -> torch.dtype | None:
        """The floating dtype holding most of the checkpoint's bytes (None: none of BF16, F16, F32)."""
        by = {}
        for key, kind in self.dtypes.items():
            if kind in FLOATING:
                by[kind] = by.get(kind, 0) + self.nbytes[key]
        return FLOATING[max(by, key=by.get)] if by else None

    def read(self, names) -> dict[str, torch.Tensor]:
        """The named tensors, as stored (each shard opened once)."""
        from safetensors import safe_open

        t0 = time.perf_counter()
        by_file: dict[str, list[str]] = {}
        for name in names:
            by_file.setdefault(self.where[name], []).append(name)
        out = {}
        for file, keys in by_file.items():
            with safe_open(self.folder / file, framework="pt") as f:
                for key in keys:
                    out[key] = f.get_tensor(key)
                    self.bytes_read += self.nbytes[key]
        self.read_seconds += time.perf_counter() - t0
        return out


FLOATING = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def _recast(name: str, p: torch.Tensor) -> bool:
    """Whether a parameter takes the model's floating dtype: not block-FP8 codes, nor their scales."""
    return p.is_floating_point() and p.dtype not in FP8_DTYPES and not name.endswith("scale_inv")


def _fp8_loading(config, folder, device: torch.device):
    """How a checkpoint's block-FP8 weights load, as from_pretrained decides for `device`: -> (transformers' quantizer
    where FP8 is kept (a GPU of compute capability >= 8.9: the linears become FP8Linear), "kept" | "dequantized" |
    None (a full-precision checkpoint), the block size). Dequantized weights are codes x block scale into the compute
    dtype through `mla_quant.models.fp8.dequantize_blocks` (transformers' dequantizer refuses DeepSeek-V3's partial
    blocks). Any other quantization is refused by name."""
    quant = quantization_config(config)
    if not quant:
        return None, None, None
    if block_fp8_config(config) is None:
        raise ValueError(f"model.streaming=true: the checkpoint at {str(folder)!r} is quantized with "
                         f"quantization_config quant_method {quant.get('quant_method')!r}; streaming reads "
                         "full-precision and block-FP8 (quant_method 'fp8') shards: run it without streaming "
                         "(model.device_map=auto)")
    from transformers.quantizers.auto import get_hf_quantizer

    quantizer, _, _ = get_hf_quantizer(config, None, {"": str(device)}, True, {})
    qc = quantizer.quantization_config
    size = None if qc.weight_block_size is None else tuple(int(v) for v in qc.weight_block_size)
    if qc.dequantize:
        return None, "dequantized", size
    return quantizer, "kept", size


def _to_meta(module: nn.Module, recurse: bool = True, dtype: torch.dtype | None = None) -> None:
    """Return a module's parameters and persistent buffers (its submodules' too where `recurse`) to the meta device
    (what a checkpoint holds), floating parameters as `dtype` where given; non-persistent buffers (computed from the
    config) stay."""
    for sub in (module.modules() if recurse else [module]):
        for name, p in list(sub._parameters.items()):
            if p is not None and (p.device.type != "meta" or (dtype is not None and _recast(name, p))):
                sub._parameters[name] = nn.Parameter(torch.empty_like(
                    p, device="meta", dtype=dtype if dtype is not None and _recast(name, p) else p.dtype),
                    requires_grad=False)
        for name, b in list(sub._buffers.items()):
            if b is not None and name not in sub._non_persistent_buffers_set and b.device.type != "meta":
                sub._buffers[name] = torch.empty_like(b, device="meta")


class HostStore:
    """Tensors waiting on the host between layers, by key: in memory up to `limit_bytes`, beyond it written to a
    scratch folder (removed on close) and read back when asked. Pinned when the compute device is a GPU."""

    def __init__(self, limit_bytes: float, pin: bool = False, scratch: str | Path | None = None):
        self.limit = float(limit_bytes)
        self.pin = pin
        self._held: dict = {}
        self._spilled: dict = {}
        self._dir = Path(tempfile.mkdtemp(prefix="mla_quant_stream_", dir=scratch))
        self.bytes_in_memory = self.peak_bytes_in_memory = 0
        self.bytes_spilled = 0

    def put(self, key, value: torch.Tensor) -> None:
        self.pop(key, missing_ok=True)
        value = value.detach().to("cpu")
        size = value.numel() * value.element_size()
        if self.bytes_in_memory + size > self.limit:
            path = self._dir / f"{len(self._spilled) + len(self._held)}_{abs(hash(key))}.pt"
            torch.save(value.contiguous(), path)
            self._spilled[key] = path
            self.bytes_spilled += size
            return
        self._held[key] = value.pin_memory() if self.pin else value
        self.bytes_in_memory += size
        self.peak_bytes_in_memory = max(self.peak_bytes_in_memory, self.bytes_in_memory)

    def pop(self, key, missing_ok: bool = False) -> torch.Tensor | None:
        if key in self._held:
            value = self._held.pop(key)
            self.bytes_in_memory -= value.numel() * value.element_size()
            return value
        if key in self._spilled:
            path = self._spilled.pop(key)
            value = torch.load(path, weights_only=True)
            path.unlink()
            return value
        if missing_ok:
            return None
        raise KeyError(key)

    def close(self) -> None:
        self._held.clear()
        self._spilled.clear()
        shutil.rmtree(self._dir, ignore_errors=True)


def _stand_in(hidden_states, family: MLAFamily):
    """What a decoder layer stand-in returns: its input, shaped as the family's model loop unpacks a layer's output
    (a family whose layers hand the next one something returns (hidden, None))."""
    carries = type(family).carried is not MLAFamily.carried
    return (hidden_states, None) if carries else hidden_states


@torch.no_grad()
def layer_arguments(model: nn.Module, ids: torch.Tensor, cache, attention_mask=None
                    ) -> tuple[torch.Tensor, list[dict]]:
    """(the embedded input of decoder layer 0, each decoder layer's keyword arguments) for `ids` over `cache` (None:
    no cache, use_cache=False): one forward of the text model with every decoder layer replaced by a stand-in that
    records its arguments and returns its input. Only the embedding (and whatever runs before the layers) must be
    resident."""
    family = family_for_config(model.config)
    text = family.text_model(model)
    layers = decoder_layers(model)
    first: list[torch.Tensor] = []
    arguments: list[dict] = []

    def recorder(j: int):
        def forward(hidden_states, *args, **kwargs):
            if args:
                raise RuntimeError(f"{family.name}: decoder layer {j} was called with {len(args)} positional "
                                   "argument(s) beside its hidden states; streaming records keyword arguments only")
            if j == 0:
                first.append(hidden_states)
            arguments.append(kwargs)
            return _stand_in(hidden_states, family)
        return forward

    for j, layer in enumerate(layers):
        layer.forward = recorder(j)
    try:
        text(input_ids=ids, attention_mask=attention_mask, use_cache=cache is not None,
             **({CACHE_KEYWORD: cache} if cache is not None else {}))
    finally:
        for layer in layers:
            del layer.forward
    if len(arguments) != len(layers):
        raise RuntimeError(f"{family.name}: the model loop called {len(arguments)} decoder layers of {len(layers)}")
    return first[0], arguments


@torch.no_grad()
def run_layer(layer: nn.Module, family: MLAFamily, hidden: torch.Tensor, arguments: dict, carried: dict
              ) -> tuple[torch.Tensor, dict]:
    """One decoder layer over one batch: (its output hidden states, what it hands the next layer)."""
    out = layer(hidden, **{**arguments, **carried})
    carried = family.carried(out)
    return (out[0] if isinstance(out, tuple) else out), carried


class StreamedModel:
    """A checkpoint's model with one decoder layer resident at a time (module docstring)."""

    def __init__(self, model_class, config, folder: str | Path, dtype: torch.dtype, device: str | torch.device,
                 blocks=None, prefetch: bool = True, host_gb: float = 8.0, absorbed: bool = True):
        from accelerate import init_empty_weights
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, rename_source_key
        from transformers.modeling_utils import LoadStateDictConfig

        self.device = torch.device(device)
        self.dtype = dtype
        self.host_gb = float(host_gb)  # the hidden states' host memory before they spill (model.streaming_host_gb)
        self.shards = Shards(folder)
        config._attn_implementation = config._attn_implementation or "eager"
        quantizer, self.fp8, self.fp8_block = _fp8_loading(config, folder, self.device)
        with init_empty_weights():
            model = model_class(config)
            if quantizer is not None:  # FP8 kept (a GPU that runs it): the linears become FP8Linear, on meta
                quantizer.preprocess_model(model=model, dtype=dtype, device_map={"": str(self.device)},
                                           checkpoint_files=[str(self.shards.folder / f) for f in
                                                             sorted(set(self.shards.where.values()))])
        model.eval()
        # Parameters are read in the checkpoint's own dtype (a BF16 layer is converted, experts merged, at half the
        # bytes) and cast to the compute dtype parameter by parameter after: a layer's peak is its stored bytes plus
        # its computing bytes, not several computing copies. Block-FP8 weights dequantized on load are written
        # straight in the compute dtype (as from_pretrained does), so the skeleton of an FP8 checkpoint holds it.
        self.storage_dtype = dtype if self.fp8 else (self.shards.floating_dtype() or dtype)
        _to_meta(model, dtype=self.storage_dtype)
        self.model = absorb(model, blocks) if absorbed else model
        model.mla_streamed = (dtype, self.device)  # what its resident layers compute in (the skeleton's meta dtype
        # is the checkpoint's)
        self.family = family_for_config(model.config)
        self._layers = decoder_layers(model)
        mapping = get_model_conversion_mapping(model, None, quantizer)
        self._load_config = LoadStateDictConfig(dtype=self.storage_dtype, device_map={"": str(self.device)},
                                                weight_mapping=mapping, hf_quantizer=quantizer)
        # Which decoder layer each checkpoint tensor belongs to, by its name in the model (after transformers'
        # renamings); None: outside the decoder layers (embedding, final norm, LM head, a wrapper's other towers).
        meta = model.state_dict()
        converters = [m for m in mapping if isinstance(m, WeightConverter)]
        renamings = [m for m in mapping if not isinstance(m, WeightConverter)]
        prefix = {id(layer): name for name, layer in model.named_modules()}
        pattern = re.compile("|".join(rf"^{re.escape(prefix[id(layer)])}\.(?P<l{j}>)" for j, layer
                                      in enumerate(self._layers)))
        self.groups: dict[int | None, list[str]] = {}
        self._renamed: dict[str, str] = {}
        self._prefix = prefix
        # called with (j, blocks(j)) after decoder layer j is read, before it runs (a fitted transform's fold)
        self.after_load: list = []
        embedding = prefix[id(model.get_input_embeddings())] + "."
        self._embedding_keys: set[str] = set()  # kept resident: the first pass and the last (logits) both embed
        for key in self.shards.where:
            renamed, _ = rename_source_key(key, renamings, converters, model.base_model_prefix, meta)
            self._renamed[key] = renamed
            match = pattern.match(renamed)
            j = int(match.lastgroup[1:]) if match else None
            self.groups.setdefault(j, []).append(key)
            if renamed.startswith(embedding):
                self._embedding_keys.add(key)
        empty = [j for j in range(len(self._layers)) if not self.groups.get(j)]
        if empty:
            raise ValueError(f"model.streaming=true: the checkpoint at {str(folder)!r} holds no tensor of decoder "
                             f"layer(s) {empty[:5]} (the model has {len(self._layers)}); the folder is incomplete")
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="layer-read") if prefetch else None
        self.seconds_per_layer: list[float] = []
        self.passes = 0  # passes over the decoder layers begun (prepare's fits, then the stage's own)
        self.wait_seconds = 0.0
        self.outer_loaded = False

    def host_store(self, scratch: str | Path | None = None) -> "HostStore":
        """A store for the hidden states waiting between layers: `host_gb` in host memory (pinned on a GPU), the
        rest spilled under `scratch` (None: the system's temporary folder)."""
        return HostStore(self.host_gb * 1e9, pin=self.device.type == "cuda", scratch=scratch)

    # -- loading ---------------------------------------------------------------------------------------------------
    def _load(self, tensors: dict[str, torch.Tensor], what: str) -> None:
        """Load the read `tensors` into the skeleton (emptying the dict: what was read is freed as it is converted),
        then cast each parameter to the compute dtype, one at a time."""
        from transformers.core_model_loading import convert_and_load_state_dict_in_model

        # Each (codes, scales) pair -> the weight in the compute dtype, then freed: all of them where FP8 does not
        # run, else those of the linears a fold made full precision (`fp8.dense`); FP8Linear keeps its pairs.
        for key in [k for k in tensors if k.endswith(".weight_scale_inv")] if self.fp8 else ():
            weight = key.removesuffix("_scale_inv")
            if self.fp8 == "dequantized" or not self._holds_fp8(weight):
                tensors[weight] = dequantize_blocks(tensors[weight], tensors.pop(key), self.fp8_block, self.dtype,
                                                    weight)
        bad = [k for k, t in tensors.items() if t.is_floating_point() and t.dtype not in FP8_DTYPES
               and not bool(torch.isfinite(t).all())]
        if bad:
            raise ValueError(f"checkpoint {str(self.shards.folder)!r}: {what} holds NaN or inf in {bad[:3]}; "
                             "refusing to run with them")
        with _quiet_loading():
            info, _ = convert_and_load_state_dict_in_model(self.model, tensors, self._load_config)
        tensors.clear()  # a parameter that is a view of a read tensor keeps it; the rest is freed now
        if info.mismatched_keys or info.conversion_errors:
            raise ValueError(f"model.streaming=true: {what} does not fit the model: mismatched "
                             f"{sorted(info.mismatched_keys)[:3]}, conversion errors "
                             f"{list(info.conversion_errors.items())[:2]}")
        for module in self.model.modules():  # in the compute dtype, one parameter at a time; inference only (no
            for name in list(module._parameters):  # autograd graph may hold a released layer's weights)
                p = module._parameters[name]
                if p is not None and p.device.type != "meta" and (p.requires_grad or (
                        _recast(name, p) and p.dtype != self.dtype)):
                    module._parameters[name] = nn.Parameter(p.detach().to(self.dtype) if _recast(name, p)
                                                            else p.detach(), requires_grad=False)
                del p

    def _holds_fp8(self, key: str) -> bool:
        """Whether the skeleton's module of checkpoint tensor `key` holds FP8 codes (an FP8Linear, FP8 experts)."""
        path = self._renamed.get(key, key).rsplit(".", 1)[0]
        try:
            module = self.model.get_submodule(path)
        except AttributeError:  # a per-expert name merged into a fused experts module: FP8 experts
            return True
        return any(p.dtype in FP8_DTYPES for p in module.parameters(recurse=False))

    def materialize(self) -> nn.Module:
        """The whole model read into memory through the same per-layer loading, every layer kept (the in-memory model
        where transformers' own loading cannot read the checkpoint: block FP8 with partial blocks, dequantized).
        A weight the checkpoint lacks is refused by name. -> the model (no longer a streamed skeleton)."""
        self.load_outer()
        for j in range(self.num_layers):
            self._load(self.shards.read(self.groups[j]), f"decoder layer {j}")
            for hook in self.after_load:
                hook(j, self.blocks(j))
        missing = [n for n, t in [*self.model.named_parameters(), *self.model.named_buffers()] if t.is_meta]
        if missing:
            raise ValueError(f"checkpoint {str(self.shards.folder)!r} lacks {len(missing)} weight(s) of the model, "
                             f"e.g. {missing[:3]}: refusing to run with randomly initialised weights")
        del self.model.mla_streamed
        if self.fp8 == "dequantized":  # full precision now, as transformers leaves a model it dequantized
            del self.model.config.quantization_config
        return self.model

    def load_outer(self) -> None:
        """The tensors outside the decoder layers (embedding, final norm, LM head), kept until `release_outer`; the
        embedding is read once (it stays resident)."""
        if not self.outer_loaded:
            names = [k for k in self.groups.get(None, []) if not (self._embedded and k in self._embedding_keys)]
            self._load(self.shards.read(names), "the embedding, final norm and LM head")
            self.model.tie_weights()
            self.outer_loaded = self._embedded = True

    _embedded = False

    def release_outer(self) -> None:
        """Everything outside the decoder layers back to the meta device, but the input embedding (and what is tied
        to it)."""
        keep = self.model.get_input_embeddings()
        for module in _outer_modules(self.model):
            if module is not keep:
                _to_meta(module, recurse=False, dtype=self.storage_dtype)
        self.model.tie_weights()
        self.outer_loaded = False

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    def layers(self) -> Iterator[tuple[int, nn.Module]]:
        """Each decoder layer, resident while the caller's loop body runs, released after; the next one's tensors
        read meanwhile (prefetch)."""
        n = len(self._layers)
        self.passes += 1
        submit = (lambda j: self._pool.submit(self.shards.read, self.groups[j])) if self._pool else None
        pending = submit(0) if submit else None
        for j in range(n):
            t0 = time.perf_counter()
            tensors = pending.result() if pending is not None else self.shards.read(self.groups[j])
            self.wait_seconds += time.perf_counter() - t0
            pending = submit(j + 1) if submit and j + 1 < n else None
            self._load(tensors, f"decoder layer {j}")
            del tensors
            for hook in self.after_load:
                hook(j, self.blocks(j))
            start = time.perf_counter()
            try:
                yield j, self._layers[j]
            finally:
                _to_meta(self._layers[j], dtype=self.storage_dtype)
                hand_back_freed()
            self.seconds_per_layer.append(time.perf_counter() - start)

    def blocks(self, j: int) -> list[tuple[int, nn.Module]]:
        """(cache-layer index, module) of the MLA blocks inside decoder layer j."""
        inside = {id(m) for m in self._layers[j].modules()}
        return [(i, a) for i, a in enumerate(self.family.attention_modules(self.model)) if id(a) in inside]

    def cached_latents(self, ids: torch.Tensor, batch: int, desc: str = "cache latents"):
        """`mla_quant.models.absorbed.cached_latents` streamed (`streamed_latents`)."""
        return streamed_latents(self, ids, batch, desc)

    def weights_sha256(self, after_load: bool = False) -> str:
        """The fingerprint `mla_quant.calibration.weights_sha256` gives the whole model in memory, from each layer's
        attention tensors alone (read layer by layer, the rest of each layer not read). after_load=True: of the
        weights as the layers run, the `after_load` hooks (a folded transform) applied."""
        import hashlib

        from mla_quant.models.fp8 import weight_of

        h = hashlib.sha256()
        for j, layer in enumerate(self._layers):
            blocks = self.blocks(j)
            prefixes = tuple(self._prefix[id(a)] + "." for _, a in blocks)
            names = [k for k in self.groups[j] if self._renamed[k].startswith(prefixes)]
            if not blocks:
                continue
            self._load(self.shards.read(names), f"the attention of decoder layer {j}")
            for hook in self.after_load if after_load else ():
                hook(j, blocks)
            for _, attn in blocks:
                w = self.family.mla_weights(attn)
                for t in (weight_of(w.kv_a), w.kv_norm, weight_of(w.kv_b), weight_of(w.q_out)):
                    h.update(t.detach().float().cpu().numpy().tobytes())
            _to_meta(layer, dtype=self.storage_dtype)
        return h.hexdigest()

    @torch.no_grad()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 logits of `ids` (B, T), no cache: one pass over the layers."""
        ids = ids.to(self.device)
        self.load_outer()
        hidden, arguments = layer_arguments(self.model, ids, None)
        self.release_outer()
        carried: dict = {}
        for j, layer in self.layers():
            hidden, carried = run_layer(layer, self.family, hidden, arguments[j], carried)
        self.load_outer()
        return head_logits(self.model, ids, hidden)

    def export(self, out: str | Path, shard_bytes: int) -> dict:
        """The model as read (transforms folded, in the compute dtype) written to `out` one piece at a time: the
        outer tensors, then each decoder layer as it is done (`ShardWriter`); never the whole model in memory."""
        writer = ShardWriter(self.model, out, shard_bytes)
        self.load_outer()
        writer.add(_state(self.model, _outer_modules(self.model), recurse=False))
        self.release_outer()
        for _, layer in self.layers():
            writer.add(_state(self.model, [layer], recurse=True))
        config = self.model.config
        stored = getattr(config, "dtype", None), getattr(config, "quantization_config", None)
        config.dtype = self.dtype  # what the shards hold now
        if self.fp8 == "dequantized":  # every weight written in full precision, as save_pretrained does then
            config.quantization_config = None
            del config.quantization_config
        elif self.fp8 == "kept":  # the projections a fold rewrote are full precision: listed as not converted
            qc = stored[1].to_dict() if hasattr(stored[1], "to_dict") else dict(stored[1])
            rewritten = sorted(getattr(self.model, "mla_dequantized", []) or [])
            qc["modules_to_not_convert"] = sorted(set(qc.get("modules_to_not_convert") or []) | set(rewritten))
            config.quantization_config = qc
        try:
            written = writer.finish(config)
        finally:
            config.dtype = stored[0]
            if stored[1] is not None:
                config.quantization_config = stored[1]
        if getattr(self.model, "generation_config", None) is not None:
            self.model.generation_config.save_pretrained(out)
        return written

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def figures(self, prefix: str = "streaming") -> dict:
        """For the run record: bytes read against the checkpoint (over every pass: a fit in the preparation, as
        quant=mixed's, reads the layers again), seconds per layer, the share of reading hidden behind compute (1 - time
        waited for a layer's tensors / time spent reading them)."""
        read = self.shards.read_seconds
        return {f"{prefix}/checkpoint_gb": self.shards.total_bytes / 1e9,
                f"{prefix}/read_gb": self.shards.bytes_read / 1e9,
                f"{prefix}/read_ratio": self.shards.bytes_read / max(1, self.shards.total_bytes),
                f"{prefix}/layers": len(self._layers), f"{prefix}/passes": self.passes,
                f"{prefix}/seconds_per_layer": (sum(self.seconds_per_layer) / len(self.seconds_per_layer)
                                                if self.seconds_per_layer else 0.0),
                f"{prefix}/read_seconds": read, f"{prefix}/wait_seconds": self.wait_seconds,
                f"{prefix}/read_hidden_share": max(0.0, 1 - self.wait_seconds / read) if read > 0 else 1.0}


class _quiet_loading:
    """transformers' per-call loading bar off while a layer loads (one bar per layer would flood the log)."""

    def __enter__(self):
        from transformers.utils import logging

        self._was = logging.is_progress_bar_enabled()
        logging.disable_progress_bar()

    def __exit__(self, *exc):
        from transformers.utils import logging

        if self._was:
            logging.enable_progress_bar()


def check_streaming(model_cfg, stage: str | None = None) -> None:
    """model.streaming=true is taken by checkpoint models with a local folder, in the streamed stages; refused by
    name elsewhere, before any weight is read."""
    if not model_cfg.get("streaming"):
        return
    if stage is not None and stage not in STREAMED_STAGES:
        raise ValueError(streaming_refusal(stage))
    if model_cfg.get("_target_") != "mla_quant.models.build.pretrained_model":
        raise ValueError(f"model.streaming=true streams a checkpoint's safetensors shards; model._target_="
                         f"{model_cfg.get('_target_')!r} builds its model in memory. Write a checkpoint folder "
                         "(experiment=write_checkpoint, or save_pretrained) and run it as a checkpoint model with "
                         "model.path=<folder>")
    if not model_cfg.get("path"):
        raise ValueError("model.streaming=true reads the checkpoint's shards from a local folder: set model.path "
                         "(download the checkpoint first, e.g. huggingface-cli download <id> --local-dir <folder>)")
    if not Path(str(model_cfg.path)).is_dir():
        raise ValueError(f"model.streaming=true: model.path={model_cfg.path!r} is not a folder")
    host = model_cfg.get("streaming_host_gb")
    if isinstance(host, bool) or not isinstance(host, (int, float)) or host < 0:
        raise ValueError(f"model.streaming_host_gb={host!r}: the host memory (GB) the hidden states may take before "
                         "they spill to disk, a number >= 0")
    if model_cfg.get("device_map") not in (None, "auto"):
        raise ValueError(f"model.streaming=true places each layer on `device`; model.device_map="
                         f"{model_cfg.device_map!r} would place the whole model: set model.device_map=null (or auto)")


@torch.no_grad()
def streamed_latents(stream: StreamedModel, ids: torch.Tensor, batch: int, desc: str = "cache latents"
                     ) -> Iterator[tuple[int, tuple[torch.Tensor, torch.Tensor]]]:
    """`mla_quant.models.absorbed.cached_latents` streamed: every batch of `batch` sequences through each decoder
    layer while it is resident, into an unquantized cache per batch; yields (cache layer i, (content, rope)) of each
    batch once its decoder layer has run them all, then frees that layer's slots."""
    from tqdm.auto import tqdm

    model, device = stream.model, stream.device
    starts = list(range(0, ids.shape[0], batch))
    store = stream.host_store()
    caches, arguments, carried = {}, {}, {}
    try:
        stream.load_outer()
        for s in starts:
            caches[s] = new_cache(model)
            hidden, arguments[s] = layer_arguments(model, ids[s:s + batch].to(device), caches[s])
            store.put(s, hidden)
            carried[s] = {}
        stream.release_outer()
        for j, layer in tqdm(stream.layers(), total=stream.num_layers, desc=f"{desc} (streamed)", unit="layer"):
            for s in starts:
                h, carried[s] = run_layer(layer, stream.family, store.pop(s).to(device), arguments[s][j], carried[s])
                store.put(s, h)
            blocks = stream.blocks(j)
            for i, _ in blocks:
                for s in starts:
                    yield i, caches[s].latent_layers[i].read()
            for s in starts:
                drop_cache_slots(caches[s], [attn.layer_idx for _, attn in blocks])
    finally:
        store.close()


def drop_cache_slots(cache, slots) -> None:
    """Free what a cache holds in `slots` once their decoder layer has run over every sequence (a streamed stage that
    reads no cache afterwards); a layer's other attributes (e.g. recorded query energies) stay."""
    for slot in slots:
        layer = cache.layers[slot]
        for part in (layer, getattr(layer, "clean", None)):  # an injected layer keeps its clean latent beside
            if part is not None and hasattr(part, "reset"):
                part.reset()


@torch.no_grad()
def head_logits(model: nn.Module, ids: torch.Tensor, final_hidden: torch.Tensor) -> torch.Tensor:
    """float32 logits of the last decoder layer's output `final_hidden` for `ids`: the model's own forward with its
    decoder layers replaced by stand-ins, the first returning `final_hidden` (so the final norm, LM head and any
    family's logit scaling run as the family writes them). Only the outer tensors must be resident."""
    family = family_for_config(model.config)
    layers = decoder_layers(model)

    def first(hidden_states, *args, **kwargs):
        return _stand_in(final_hidden.to(hidden_states.device), family)

    def rest(hidden_states, *args, **kwargs):
        return _stand_in(hidden_states, family)

    for j, layer in enumerate(layers):
        layer.forward = first if j == 0 else rest
    try:
        return model(input_ids=ids, use_cache=False).logits.float()
    finally:
        for layer in layers:
            del layer.forward


def _initializers(model: nn.Module) -> dict:
    """{id(module): the `_init_weights` that initialises it}: the nearest enclosing transformers model's, as
    transformers' own initialisation dispatches (a multimodal wrapper's text decoder by the decoder's own rule)."""
    from transformers import PreTrainedModel

    out = {}

    def visit(module: nn.Module, owner):
        owner = module if isinstance(module, PreTrainedModel) else owner
        out[id(module)] = owner._init_weights
        for child in module.children():
            visit(child, owner)

    visit(model, model)
    return out


class ShardWriter:
    """A checkpoint folder written piece by piece: each piece's tensors (the model's names) converted to the
    checkpoint layout as save_pretrained does (`revert_weight_conversion`: fused experts back to per-expert
    tensors) and appended to safetensors shards of at most `shard_bytes`; `finish` names the shards
    model-0000i-of-0000n, writes model.safetensors.index.json and config.json. Shards of an earlier write in the
    folder are removed first. `fp8_block` (rows, columns): every decoder layer's linear weight (`*_proj.weight`, the
    layout DeepSeek-V3 and Kimi-K2 ship) stored as e4m3 codes with a float32 `weight_scale_inv` per block, and the
    config's `quantization_config` says so."""

    def __init__(self, model: nn.Module, out: str | Path, shard_bytes: int, fp8_block: tuple[int, int] | None = None):
        self.model, self.out, self.shard_bytes = model, Path(out), int(shard_bytes)
        self.fp8_block = fp8_block
        self._fp8_key = re.compile(r"(^|\.)layers\.\d+\..*_proj(_with_mqa)?\.weight$")
        self.out.mkdir(parents=True, exist_ok=True)
        for old in self.out.glob("*.safetensors"):
            old.unlink()
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files = 0
        self.weight_map: dict[str, int] = {}
        self.total_bytes = self.parameters = 0

    def add(self, state: dict[str, torch.Tensor]) -> None:
        from transformers.core_model_loading import revert_weight_conversion

        self.parameters += sum(v.numel() for v in state.values())
        for key, tensor in self._stored(revert_weight_conversion(self.model, state)):
            tensor = tensor.detach().contiguous()
            size = tensor.numel() * tensor.element_size()
            if self.pending and self.pending_bytes + size > self.shard_bytes:
                self._flush()
            # a view of a larger tensor (an expert's slice) is stored alone
            self.pending[key] = tensor.clone() if tensor.untyped_storage().nbytes() != size else tensor
            self.pending_bytes += size
            self.weight_map[key] = self.files
            self.total_bytes += size

    def _stored(self, state: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        from mla_quant.models.fp8 import quantize_blocks

        for key, tensor in state.items():
            if self.fp8_block is None or tensor.dim() != 2 or not self._fp8_key.search(key):
                yield key, tensor
                continue
            codes, scale = quantize_blocks(tensor, self.fp8_block)
            yield key, codes
            yield f"{key}_scale_inv", scale

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if self.pending:
            save_file(self.pending, str(self.out / f"part-{self.files:05d}.safetensors"), metadata={"format": "pt"})
            self.files += 1
            self.pending, self.pending_bytes = {}, 0

    def finish(self, config) -> dict:
        """-> {"shards": [file names], "total_bytes": N, "parameters": P}."""
        self._flush()
        names = [f"model-{i + 1:05d}-of-{self.files:05d}.safetensors" for i in range(self.files)]
        for i, name in enumerate(names):
            (self.out / f"part-{i:05d}.safetensors").rename(self.out / name)
        index = {"metadata": {"total_size": self.total_bytes},
                 "weight_map": {k: names[i] for k, i in sorted(self.weight_map.items())}}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        if self.fp8_block is not None:
            config.quantization_config = FP8_CHECKPOINT_CONFIG | {"weight_block_size": list(self.fp8_block)}
        config.save_pretrained(self.out)
        return {"shards": names, "total_bytes": self.total_bytes, "parameters": self.parameters}


def _state(model: nn.Module, modules: list[nn.Module], recurse: bool, dtype: torch.dtype | None = None
           ) -> dict[str, torch.Tensor]:
    """The parameters and persistent buffers of `modules` under the model's names (a tensor tied to one already
    taken, as an LM head to the embedding, left out as save_pretrained does), floating ones as `dtype` if given."""
    names = {id(m): n for n, m in model.named_modules()}
    state, seen = {}, set()
    for module in modules:
        prefix = names[id(module)]
        if recurse:
            items = list(module.state_dict().items())
        else:
            items = list(module.named_parameters(recurse=False)) + [
                (n, b) for n, b in module.named_buffers(recurse=False) if n not in module._non_persistent_buffers_set]
        for k, v in items:
            if v.data_ptr() in seen:
                continue
            seen.add(v.data_ptr())
            key = f"{prefix}.{k}" if prefix else k
            state[key] = v.detach().to(dtype) if dtype is not None and v.is_floating_point() else v.detach()
    return state


def _outer_modules(model: nn.Module) -> list[nn.Module]:
    inside = {id(m) for layer in decoder_layers(model) for m in layer.modules()}
    return [m for m in model.modules() if id(m) not in inside]


def write_random_checkpoint(model_class, config, out: str | Path, dtype: torch.dtype, shard_bytes: int,
                            seed: int = 0, fp8_block: tuple[int, int] | None = None) -> dict:
    """A Hugging Face checkpoint folder of `config`'s model with random weights, written one decoder layer at a time
    (a model larger than memory: only one layer's weights exist at once): the skeleton on the meta device; the
    outer tensors and then each layer materialized on the CPU, initialised by the model's own `_init_weights`
    (seeded per layer), cast to `dtype` and appended to the shards (`ShardWriter`; `fp8_block`: the layers' linear
    weights in block FP8), then released. -> {"shards": [...], "total_bytes": N, "parameters": P}."""
    from accelerate import init_empty_weights
    from tqdm.auto import tqdm

    with init_empty_weights():
        model = model_class(config)
    initializer = _initializers(model)
    writer = ShardWriter(model, out, shard_bytes, fp8_block)
    outer = _outer_modules(model)
    torch.manual_seed(seed * 1_000_003)
    for module in outer:
        for holder in (module._parameters, module._buffers):
            for n, p in list(holder.items()):
                if p is not None and p.device.type == "meta" and n not in module._non_persistent_buffers_set:
                    empty = torch.empty_like(p, device="cpu")
                    holder[n] = nn.Parameter(empty, requires_grad=False) if isinstance(p, nn.Parameter) else empty
        initializer[id(module)](module)
    writer.add(_state(model, outer, recurse=False, dtype=dtype))
    for module in outer:
        _to_meta(module, recurse=False)
    for j, layer in enumerate(tqdm(decoder_layers(model), desc="write checkpoint", unit="layer")):
        torch.manual_seed(seed * 1_000_003 + j + 1)
        layer.to_empty(device="cpu")
        for sub in layer.modules():
            initializer[id(sub)](sub)
        writer.add(_state(model, [layer], recurse=True, dtype=dtype))
        _to_meta(layer)
    return writer.finish(config)
