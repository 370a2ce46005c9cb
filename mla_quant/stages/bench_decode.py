"""Decode benchmark: the absorbed latent path against the untouched transformers model, on one model, in one run.

    python run.py experiment=bench_decode                      # tiny model with DeepSeek-V2-Lite's attention dims
    python run.py experiment=bench_decode quant=int4_joint     # + the absorbed path over the INT4 cache
    python run.py experiment=bench_decode 'task.contexts=[1024,4096,16384]' device=cuda model.dtype=bfloat16

For each context length: prefill a random prompt (every path), then time `task.decode_steps` single-token decode
steps fed the same tokens; `task.repeats` rounds, the paths interleaved, each path's fastest round's median kept
(memory is measured in the first round). Paths: transformers (its own cache; `task.transformers=false` leaves it
out: its eager prefill holds every head's T x T scores, ~17 GB at 16K on V2-Lite's 16 heads), the absorbed latent
path over an unquantized cache (PyTorch), and, when `quant` quantizes or a decode kernel reads its format
(`quant=bf16` through the C++ kernel on the CPU), the absorbed path over the configured cache format (named by the
quant option). Reports decode tokens/s of each and their ratios, and the cache bytes per token per
layer each one holds, measured from the cache tensors, and what each cache holds after the steps: its distinct tensor
storages, the process's resident set grown since before the prefill, and what the resident set shrinks by when the
cache is let go (CPU: the cache's own resident memory), per token per layer and against a BF16 cache of those tokens
(2 (d_c + d_r) bytes). transformers 5.24 also caches only the latent, but re-expands
per-head K and V from the whole cached latent at every step: that transient is reported too (values per token per
layer materialised per step). One tidy row per (context, path) goes to bench_decode.csv.
"""

from __future__ import annotations

import copy
import statistics
import time
from pathlib import Path

import pandas as pd
import torch
from omegaconf import DictConfig
from tqdm.auto import tqdm
from transformers import DynamicCache

from mla_quant.checks import int_setting
from mla_quant.models.absorbed import absorb, attention_blocks, cache_kwargs, latent_dims, new_cache
from mla_quant.models.families import text_config
from mla_quant.memory import settled_resident_bytes, tensor_bytes
from mla_quant.models.build import resolve_device
from mla_quant.prepare import prepare_model
from mla_quant.stages import StageResult
from mla_quant.record import write_text_atomic


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def cache_bytes(cache) -> int:
    """Bytes held by any transformers cache of latents: LatentCache measures itself; DynamicCache layers hold
    keys (the content latent) and values (the RoPE key)."""
    if hasattr(cache, "nbytes"):
        return cache.nbytes()
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


@torch.no_grad()
def time_decode(model, prompt, steps: int, warmup: int, make_cache, device: str) -> tuple[float, int, dict, dict]:
    """Median seconds per decode step after prefilling `prompt` into a new cache (`make_cache()`), the cache bytes
    after prefill, what the cache holds after the steps: {"tensor_bytes": its distinct tensor storages,
    "resident_bytes": the process's resident set grown since before the prefill (CPU; freed memory handed back
    first, and one short run through a cache of the same kind before, so what a first call sets up once is not
    counted as the cache's), "released_bytes": what the resident set shrinks by when the cache is let go (CPU: the
    cache's own resident memory, without what the run's other allocations left behind)}, and the backend of each
    step type the cache ran (empty for transformers' cache)."""
    model(prompt[:, :16], use_cache=True, **cache_kwargs(make_cache()))
    before = settled_resident_bytes() if device == "cpu" else None
    cache = make_cache()
    model(prompt, use_cache=True, **cache_kwargs(cache))
    n_bytes = cache_bytes(cache)
    feed = torch.randint(3, text_config(model.config).vocab_size, (prompt.shape[0], warmup + steps),
                         generator=torch.Generator().manual_seed(1)).to(device)
    times = []
    for i in range(warmup + steps):
        _sync(device)
        start = time.perf_counter()
        model(feed[:, i : i + 1], use_cache=True, **cache_kwargs(cache))
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    del feed
    held = {"tensor_bytes": tensor_bytes(cache), "resident_bytes": None, "released_bytes": None}
    backends = cache.backends_run() if hasattr(cache, "backends_run") else {}
    if before is not None:
        with_cache = settled_resident_bytes()
        held["resident_bytes"] = with_cache - before
        del cache
        held["released_bytes"] = with_cache - settled_resident_bytes()
    return statistics.median(times), n_bytes, held, backends


def run(cfg: DictConfig, run_dir: Path) -> StageResult:
    task = cfg.task
    repeats = task.repeats
    int_setting(repeats, "task.repeats", allowed="a number of timed rounds per path >= 1")
    with_reference = task.transformers
    if not isinstance(with_reference, bool):
        raise ValueError(f"task.transformers={with_reference!r}; allowed: true (also time the untouched transformers "
                         f"model) or false")
    device = resolve_device(cfg.device)
    prep = prepare_model(cfg, tokenizer=False, absorbed=False, attn_implementation=task.reference_attention)
    reference = prep.model.to(device)
    absorbed = absorb(copy.deepcopy(reference), attention_blocks(cfg.get("attention")))
    # the configured format's own path: a quantized one, or an unquantized one that a decode kernel reads (quant=bf16
    # through the C++ kernel on the CPU, the Triton kernel on a GPU)
    format_path = prep.fmt is not None and (
        prep.fmt.quantized or prep.fmt.step_backends(torch.device(device).type)["decode"] != "torch")
    factory = prep.layer_factory() if format_path else None
    dims = latent_dims(absorbed)
    attn = absorbed.mla_family.attention_modules(absorbed)[0]
    expanded_values = attn.num_heads * (attn.qk_head_dim + attn.v_head_dim)
    layers = dims["layers"]
    bf16_bytes = 2 * (dims["d_c"] + dims["d_r"])  # a BF16 cache's bytes per token per layer

    rows, metrics = [], {}
    for ctx in tqdm(list(task.contexts), desc="bench_decode", unit="context"):
        prompt = torch.randint(3, text_config(reference.config).vocab_size, (task.batch_size, ctx),
                               generator=torch.Generator().manual_seed(cfg.seed)).to(device)
        per_path = {}
        paths = {"transformers": (reference, lambda: DynamicCache(config=reference.config))} if with_reference else {}
        paths["absorbed_latent"] = (absorbed, lambda: new_cache(absorbed))
        if format_path:
            paths[f"absorbed_{prep.fmt.name}"] = (absorbed, lambda: new_cache(absorbed, factory))
        measured = {}  # path -> (seconds, bytes, held, backends) of its first round, seconds the fastest round's
        for round_ in range(repeats):  # the paths interleaved, round by round (the machine's noise is additive)
            for path, (model, make_cache) in paths.items():
                got = time_decode(model, prompt, task.decode_steps, task.warmup_steps, make_cache, device)
                measured[path] = got if round_ == 0 else (min(measured[path][0], got[0]), *measured[path][1:])
        for path in paths:
            seconds, n_bytes, held, backends = measured[path]
            tokens = task.batch_size * (ctx + task.warmup_steps + task.decode_steps) * layers
            per_path[path] = dict(
                context=ctx, path=path, seconds_per_step=seconds,
                tokens_per_s=task.batch_size / seconds,
                cache_bytes_per_token_per_layer=n_bytes / (task.batch_size * ctx * layers),
                materialised_values_per_token_per_layer=expanded_values if path == "transformers" else 0,
                tensor_bytes_per_token_per_layer=held["tensor_bytes"] / tokens,
                **{f"{key}_per_token_per_layer": None if held[key] is None else held[key] / tokens
                   for key in ("resident_bytes", "released_bytes")},
            )
            per_path[path].update({f"backend_{step}": b for step, b in backends.items()})  # each step type's
            rows.append(per_path[path])
        for path, row in per_path.items():
            metrics[f"bench/decode/ctx{ctx}/{path}/tokens_per_s"] = row["tokens_per_s"]
            metrics.update({f"bench/decode/ctx{ctx}/{path}/backend/{key[8:]}": value for key, value in row.items()
                            if key.startswith("backend_")})
            for key in ("cache_bytes", "tensor_bytes", "resident_bytes", "released_bytes"):
                if row[f"{key}_per_token_per_layer"] is not None:
                    metrics[f"bench/decode/ctx{ctx}/{path}/{key}_per_token_per_layer"] = row[
                        f"{key}_per_token_per_layer"]
        if with_reference:
            metrics[f"bench/decode/ctx{ctx}/speedup_absorbed_vs_transformers"] = (
                per_path["absorbed_latent"]["tokens_per_s"] / per_path["transformers"]["tokens_per_s"])
            metrics[f"bench/decode/ctx{ctx}/cache_bytes_ratio_absorbed_vs_transformers"] = (
                per_path["absorbed_latent"]["cache_bytes_per_token_per_layer"]
                / per_path["transformers"]["cache_bytes_per_token_per_layer"])
        if format_path:
            q = per_path[f"absorbed_{prep.fmt.name}"]
            metrics[f"bench/decode/ctx{ctx}/speed_{prep.fmt.name}_vs_absorbed"] = (
                q["tokens_per_s"] / per_path["absorbed_latent"]["tokens_per_s"])
            metrics[f"bench/decode/ctx{ctx}/cache_bytes_ratio_{prep.fmt.name}_vs_absorbed"] = (
                q["cache_bytes_per_token_per_layer"] / per_path["absorbed_latent"]["cache_bytes_per_token_per_layer"])
            for key in ("tensor_bytes", "resident_bytes", "released_bytes"):  # against a BF16 cache of those tokens
                if q[f"{key}_per_token_per_layer"] is not None:
                    metrics[f"bench/decode/ctx{ctx}/{key}_ratio_{prep.fmt.name}_vs_bf16"] = (
                        q[f"{key}_per_token_per_layer"] / bf16_bytes)

    metrics["bench/decode/latent_values_per_token_per_layer"] = dims["d_c"] + dims["d_r"]
    table = pd.DataFrame(rows)
    write_text_atomic(run_dir / "bench_decode.csv", table.to_csv(index=False))
    print(f"model: {cfg.model.family}, {layers} MLA layers, d_c={dims['d_c']}, d_r={dims['d_r']}, "
          f"heads={attn.num_heads}, dtype={cfg.model.dtype}, device={device}, reference={task.reference_attention}")
    print(table.to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    for ctx in task.contexts:
        if format_path:
            resident = metrics.get(f"bench/decode/ctx{ctx}/resident_bytes_ratio_{prep.fmt.name}_vs_bf16")
            released = metrics.get(f"bench/decode/ctx{ctx}/released_bytes_ratio_{prep.fmt.name}_vs_bf16")
            backend = metrics.get(f"bench/decode/ctx{ctx}/absorbed_{prep.fmt.name}/backend/decode")
            print(f"context {ctx}: {prep.fmt.name} cache ({backend} decode): decode speed "
                  f"{metrics[f'bench/decode/ctx{ctx}/speed_{prep.fmt.name}_vs_absorbed']:.2f}x the unquantized "
                  f"absorbed path (PyTorch), cache bytes ratio "
                  f"{metrics[f'bench/decode/ctx{ctx}/cache_bytes_ratio_{prep.fmt.name}_vs_absorbed']:.3f}; it holds "
                  f"{metrics[f'bench/decode/ctx{ctx}/tensor_bytes_ratio_{prep.fmt.name}_vs_bf16']:.3f}x a BF16 cache's "
                  "bytes in tensors" + ("" if resident is None else
                                        f", {resident:.3f}x in the process's resident set grown since before the "
                                        f"prefill, {released:.3f}x handed back when the cache is let go"))
        if with_reference:
            print(f"context {ctx}: absorbed latent decode "
                  f"{metrics[f'bench/decode/ctx{ctx}/speedup_absorbed_vs_transformers']:.2f}x the transformers "
                  f"tokens/s; cache bytes ratio "
                  f"{metrics[f'bench/decode/ctx{ctx}/cache_bytes_ratio_absorbed_vs_transformers']:.3f}")
    return StageResult(metrics=metrics)
