"""The quantized latent cache: each path (content latent c, RoPE key k) stored in its own format, plus a BF16
protected region (attention sinks and the recent window). A drop-in `LatentCacheLayer`, so `model.generate` and
the absorbed attention work unchanged.

    factory = cache_layer_factory(cfg.quant, d_c=512, d_r=64)   # validates the config first; bf16 -> LatentCacheLayer
    cache = new_cache(model, factory)                             # or quantized_cache(model, cfg.quant)
    model.generate(ids, **cache_kwargs(cache), max_new_tokens=16)
    python -m mla_quant.quant.cache                               # prints the byte table (real dims, up to 128K)

Token order and regions (S tokens held per sequence):
    [ sinks: first n_sink tokens | quantized: n_quantized tokens | recent: the latest <= `recent` tokens ]
Sinks and recent tokens stay in the activation dtype. A token is quantized exactly once, when it leaves the recent
window (during prefill for long prompts, or one at a time during decode), and never changes after that.

Storage layout of one layer (what the Triton decode kernel reads; B = batch, cap >= n_quantized = buffer capacity):
    layer.content, layer.rope                   (B, P, d_c), (B, P, d_r)   protected tokens, sinks first (P <= n_sink
                                                                           + recent), activation dtype
    layer.stored["content"] / ["rope"]          one dict per path of SEPARATE contiguous (B, cap, *) buffers, valid
                                                tokens [:, :n_quantized]:
        int:   "codes"  uint8 (B, cap, ceil(d*bits/8))  packed LSB-first (packing.py)
               "scales" (B, cap, d/group)  fp16|bf16|fp32, or int8 exponents for pow2
               "zeros"  (B, cap, d/group)  asymmetric only (fp16 for pow2)
        fp8:   "codes"  uint8 (B, cap, d)  the bits of float8_e4m3fn; "scales" (B, cap, d/group) per group/tile
        bf16:  "values" (B, cap, d)  activation dtype
    layer.tensor_scales["content"/"rope"]       0-d float32 per-tensor fp8 scale (the same tensor for both paths
                                                when shared), else None
x_hat = q * s + z (asym) or (q - 2^(b-1)) * s (sym), x_hat = e4m3 * s for fp8; see quantizers.py.

Per-tensor fp8 scales (granularity=tensor, e.g. vLLM's flat layout) are set ONCE, at the first append, to the
amax of that append's tokens / 448 (jointly over content and RoPE when shared_scale), and then frozen: this is
vLLM's `calculate_kv_scales` (first-batch amax), not its static default k_scale = 1.0, which assumes a value range.
Later tokens beyond that range saturate at +-448 * scale, as in vLLM.

Semantics (`quant.mode`): "simulated": every read sees the stored (dequantized) values outside the protected
region, the prefill step included. "serving": the step that appends tokens sees its own fresh latents; only later
steps see stored values. The read path here dequantizes the whole quantized region at each read (the reference);
with `quant.backend=triton` decode steps run mla_quant/kernels/latent_decode.py, which reads the stored tensors in
place (prefill keeps this path).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

from mla_quant.models.absorbed import latent_dims, new_cache
from mla_quant.models.latent_cache import LatentCache, LatentCacheLayer, check_latents
from mla_quant.quant.formats import (
    CacheFormat,
    cache_bytes_per_token,
    cache_format,
    decode_path,
    encode_path,
    tensor_scale_for,
)

PATHS = ("content", "rope")


class TokenStore:
    """Named growable buffers (B, capacity, *) holding `length` valid tokens each (one store per path)."""

    def __init__(self):
        self.parts: dict[str, torch.Tensor] = {}
        self.length = 0

    def append(self, new: dict[str, torch.Tensor]) -> None:
        t = next(iter(new.values())).shape[1]
        if not self.parts:
            self.parts = {k: v.new_empty(v.shape[0], 0, *v.shape[2:]) for k, v in new.items()}
        capacity = next(iter(self.parts.values())).shape[1]
        if self.length + t > capacity:  # grow geometrically: a long decode costs O(S) copies in all
            capacity = max(self.length + t, 2 * capacity, 16)
            for k, old in self.parts.items():
                grown = old.new_zeros(old.shape[0], capacity, *old.shape[2:])
                grown[:, : self.length] = old[:, : self.length]
                self.parts[k] = grown
        for k, v in new.items():
            self.parts[k][:, self.length : self.length + t] = v
        self.length += t

    def view(self) -> dict[str, torch.Tensor]:
        return {k: v[:, : self.length] for k, v in self.parts.items()}

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def map(self, fn) -> None:
        self.parts = {k: fn(v).contiguous() for k, v in self.view().items()}

    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.view().values())


class QuantizedLatentCacheLayer(LatentCacheLayer):
    """One layer's latent cache in `fmt` (see the module docstring for regions, layout and semantics)."""

    def __init__(self, fmt: CacheFormat, **kwargs):
        super().__init__(**kwargs)
        self.fmt = fmt
        self._clear_stored()

    def _clear_stored(self) -> None:
        self.stored = {p: TokenStore() for p in PATHS}
        self.tensor_scales: dict[str, torch.Tensor | None] = {p: None for p in PATHS}

    @property
    def n_quantized(self) -> int:
        return self.stored["content"].length

    @property
    def n_sink_held(self) -> int:
        return min(self.fmt.n_sink, self.content.shape[1])

    # ------------------------------------------------------------------ the latent interface
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        dims = (key_states.shape[-1], value_states.shape[-1])
        if dims != (self.fmt.d_c, self.fmt.d_r):
            raise ValueError(f"quant format {self.fmt.name!r} was validated for (d_c, d_r) = "
                             f"{(self.fmt.d_c, self.fmt.d_r)}, got latents with {dims}")
        super().lazy_initialization(key_states, value_states)
        self._clear_stored()

    def append(self, content: torch.Tensor, rope: torch.Tensor) -> None:
        """Store new tokens; those pushed out of the recent window are quantized now. (B, T, d_c), (B, T, d_r)."""
        check_latents(content, rope)
        if not self.is_initialized:
            self.lazy_initialization(content, rope)
        if self.length == 0 and content.shape[1] > 0:
            self._set_tensor_scales(content, rope)
        unq_c = torch.cat([self.content, content.to(self.content.dtype)], dim=1)  # (B, P + T, d_c)
        unq_r = torch.cat([self.rope, rope.to(self.rope.dtype)], dim=1)  # (B, P + T, d_r)
        n_s = min(self.fmt.n_sink, unq_c.shape[1])
        leave = max(0, unq_c.shape[1] - n_s - self.fmt.recent)  # oldest non-sink tokens beyond the window
        if leave:
            for path, unq in (("content", unq_c), ("rope", unq_r)):
                part = unq[:, n_s : n_s + leave]  # (B, leave, d)
                self.stored[path].append(encode_path(self.fmt.path(path), part, self.tensor_scales[path]))
            unq_c = torch.cat([unq_c[:, :n_s], unq_c[:, n_s + leave :]], dim=1)
            unq_r = torch.cat([unq_r[:, :n_s], unq_r[:, n_s + leave :]], dim=1)
        self.content, self.rope = unq_c, unq_r
        self.length += content.shape[1]

    def _set_tensor_scales(self, content: torch.Tensor, rope: torch.Tensor) -> None:
        per_tensor = [p for p in PATHS if self.fmt.path(p).format == "fp8" and self.fmt.path(p).granularity == "tensor"]
        if not per_tensor or self.tensor_scales[per_tensor[0]] is not None:
            return
        x = {"content": content, "rope": rope}
        if self.fmt.shared_scale:
            shared = tensor_scale_for(content, rope)  # one scale over latent AND RoPE key (vLLM flat FP8)
            self.tensor_scales = {p: shared for p in PATHS}
        else:
            for p in per_tensor:
                self.tensor_scales[p] = tensor_scale_for(x[p])

    def read_stored(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token as stored: protected ones exact, quantized ones dequantized (to `dtype`, default the
        activation dtype). (B, S, d_c), (B, S, d_r)."""
        if not self.is_initialized:
            raise RuntimeError("read() on an empty latent cache layer")
        if self.n_quantized == 0:
            return (self.content, self.rope) if dtype is None else (self.content.to(dtype), self.rope.to(dtype))
        n_s, out = self.n_sink_held, []
        for path, protected, d in (("content", self.content, self.fmt.d_c), ("rope", self.rope, self.fmt.d_r)):
            fmt = self.fmt.path(path)
            protected = protected if dtype is None else protected.to(dtype)
            middle = decode_path(fmt, self.stored[path].view(), d, protected.dtype, self.tensor_scales[path])
            out.append(torch.cat([protected[:, :n_s], middle, protected[:, n_s:]], dim=1))
        return out[0], out[1]

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.read_stored()

    def update_and_read(self, content: torch.Tensor, rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append, then what this step's attention sees: in serving mode its own tokens fresh, in simulated stored."""
        t = content.shape[1]
        self.append(content, rope)
        all_c, all_r = self.read_stored()
        if self.fmt.mode == "serving" and t > 0 and self.n_quantized > 0:
            all_c = torch.cat([all_c[:, :-t], content.to(all_c.dtype)], dim=1)
            all_r = torch.cat([all_r[:, :-t], rope.to(all_r.dtype)], dim=1)
        return all_c, all_r

    def nbytes(self) -> int:
        """Bytes held, measured from the stored tensors: protected tokens, codes, scales, zeros, tensor scales."""
        if not self.is_initialized or self.length == 0:
            return 0
        total = self.content.numel() * self.content.element_size() + self.rope.numel() * self.rope.element_size()
        total += sum(store.nbytes() for store in self.stored.values())
        unique_scales = {id(s): s for s in self.tensor_scales.values() if s is not None}
        return total + sum(s.numel() * s.element_size() for s in unique_scales.values())

    # ------------------------------------------------------------------ cache management
    def reset(self) -> None:
        super().reset()
        self._clear_stored()

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last -tokens_to_remove tokens (recent first, then quantized, then sinks). Quantized tokens that
        end up inside the recent window stay quantized: the window is refilled by later appends."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens to remove, got {tokens_to_remove}")
        if not self.is_initialized:
            return
        k = min(-tokens_to_remove, self.length)
        recent_held = self.content.shape[1] - self.n_sink_held
        from_recent = min(k, recent_held)
        from_quantized = min(k - from_recent, self.n_quantized)
        from_sinks = k - from_recent - from_quantized
        keep = self.content.shape[1] - from_recent - from_sinks
        self.content, self.rope = self.content[:, :keep], self.rope[:, :keep]
        for store in self.stored.values():
            store.truncate(store.length - from_quantized)
        self.length -= k
        if self.indexer_keys is not None:
            self.indexer_keys = self.indexer_keys[:, : self.length]

    def _map_batch(self, fn) -> None:
        if not self.is_initialized:
            return
        self.content, self.rope = fn(self.content).contiguous(), fn(self.rope).contiguous()
        for store in self.stored.values():
            store.map(fn)  # also when empty, so that later appends meet buffers of the new batch size
        if self.indexer_keys is not None:
            self.indexer_keys = fn(self.indexer_keys)

    def _move_tensor_scales(self, device) -> None:
        moved = {id(s): s.to(device) for s in self.tensor_scales.values() if s is not None}
        self.tensor_scales = {p: None if s is None else moved[id(s)] for p, s in self.tensor_scales.items()}

    def offload(self) -> None:
        super().offload()
        self._move_tensor_scales("cpu")

    def prefetch(self) -> None:
        if self.is_initialized and self.content.device != self.device:
            super().prefetch()
            self._move_tensor_scales(self.device)


# ---------------------------------------------------------------------------------------------- building caches
def cache_layer_factory(quant_cfg, d_c: int, d_r: int, context: int | None = None) -> Callable[[], LatentCacheLayer]:
    """A zero-argument layer constructor for `new_cache(model, factory)`; validates the config first (with
    `context`, also that the protected region leaves something to quantize).
    An all-bf16 format returns the plain `LatentCacheLayer` itself (exact, nothing changed)."""
    fmt = cache_format(quant_cfg, d_c, d_r, context)
    if fmt.backend == "triton":  # decode steps through the Triton kernel (mla_quant/kernels/latent_decode.py)
        from mla_quant.kernels import latent_decode as kernels

        kernels.check_triton_format(fmt)
        kernels.require_triton(hint="; or use quant.backend=torch")
        if not fmt.quantized:
            return kernels.TritonLatentCacheLayer
        return functools.partial(kernels.TritonQuantizedLatentCacheLayer, fmt)
    if not fmt.quantized:
        return LatentCacheLayer
    return functools.partial(QuantizedLatentCacheLayer, fmt)


def model_layer_factory(model, quant_cfg) -> Callable[[], LatentCacheLayer]:
    """`cache_layer_factory` for `model`: (d_c, d_r) from its MLA modules, the context from its config."""
    dims = latent_dims(model)
    context = getattr(model.config, "max_position_embeddings", None)
    return cache_layer_factory(quant_cfg, dims["d_c"], dims["d_r"], context=context)


def quantized_cache(model, quant_cfg) -> LatentCache:
    """An empty cache for `model` in the format of `quant_cfg` (the `quant` config group)."""
    return new_cache(model, model_layer_factory(model, quant_cfg))


# ---------------------------------------------------------------------------------------------- byte table
QUANT_DIR = Path(__file__).resolve().parents[2] / "conf" / "quant"
BYTE_TABLE_OPTIONS = ("bf16", "fp8_flat", "fp8_ds_mla", "int8_joint", "int4_content", "int4_joint",
                      "int2_content_int4_rope")


def load_quant_option(name: str, conf_dir: Path | str | None = None):
    """conf/quant/<name>.yaml as a DictConfig (what `quant=<name>` composes to)."""
    from omegaconf import OmegaConf

    conf_dir = Path(conf_dir) if conf_dir is not None else QUANT_DIR
    path = conf_dir / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown quant option {name!r}; allowed: {sorted(p.stem for p in conf_dir.glob('*.yaml'))}")
    return OmegaConf.load(path)


def measure_bytes(quant_cfg, contexts: Iterable[int], d_c: int = 512, d_r: int = 64, batch: int = 1,
                  chunk: int = 4096, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> dict[int, int]:
    """Fill one layer with a synthetic latent in chunks and return {context: layer.nbytes()} along the way.
    One random chunk is appended repeatedly: the bytes a format takes do not depend on the values."""
    layer = cache_layer_factory(quant_cfg, d_c, d_r)()
    gen = torch.Generator().manual_seed(seed)
    block_c = torch.randn(batch, chunk, d_c, generator=gen).to(dtype)  # (B, chunk, d_c)
    block_r = torch.randn(batch, chunk, d_r, generator=gen).to(dtype)  # (B, chunk, d_r)
    filled, out = 0, {}
    for ctx in sorted(contexts):
        while filled < ctx:
            t = min(chunk, ctx - filled)
            layer.append(block_c[:, :t], block_r[:, :t])
            filled += t
        out[ctx] = layer.nbytes()
    return out


def byte_table(options: Sequence[str] = BYTE_TABLE_OPTIONS, contexts: Sequence[int] = (4096, 32768, 131072),
               d_c: int = 512, d_r: int = 64, batch: int = 1, chunk: int = 4096, conf_dir=None) -> list[dict]:
    """Bytes per token per layer for every quant option and context: measured from a filled cache and the formula,
    the protected region included, with % of BF16 ((d_c + d_r) * 2 bytes). One row per (option, context)."""
    bf16 = (d_c + d_r) * 2
    rows = []
    for name in options:
        cfg = load_quant_option(name, conf_dir)
        fmt = cache_format(cfg, d_c, d_r)
        measured = measure_bytes(cfg, contexts, d_c, d_r, batch, chunk)
        for ctx in contexts:
            per_token = measured[ctx] / (batch * ctx)
            rows.append({
                "option": name, "content": fmt.content.describe(), "rope": fmt.rope.describe(),
                "protected": f"{fmt.n_sink}+{fmt.recent}" if fmt.quantized else "all",
                "context": ctx, "measured_bytes": measured[ctx], "measured_B_per_token": per_token,
                "formula_B_per_token": cache_bytes_per_token(fmt, d_c, d_r, ctx, batch),
                "pct_of_bf16": 100.0 * per_token / bf16,
            })
    return rows


def format_byte_table(rows: Sequence[dict]) -> str:
    """Markdown table of `byte_table` rows."""
    head = "| option | content | rope | protected | context | measured B/tok/layer | formula | % of BF16 |"
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        lines.append(f"| {r['option']} | {r['content']} | {r['rope']} | {r['protected']} | {r['context']} | "
                     f"{r['measured_B_per_token']:.3f} | {r['formula_B_per_token']:.3f} | {r['pct_of_bf16']:.2f}% |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(format_byte_table(byte_table()))
