"""vLLM engine runs in a process of their own: each a checkpoint folder, prompts as token ids, greedy decoding, a KV
memory budget; what the engine did, as JSON. `experiment=serve` runs one per cache (unquantized, then the exported
format, both stored by `mla_quant.serving.vllm_backend`) and, with suites, lm-eval's vLLM model over them: one after
another in one process (vLLM is imported once), each engine shut down before the next starts; no engine state
outlives the process.

    python -m mla_quant.serving.vllm_run request.json result.json [request2.json result2.json ...]

(`python -m mla_quant.stages.serve` with the same arguments also takes lm-eval requests, below.)

request: {"model": folder, "prompts": [[ids], ...], "max_tokens": n, "dtype": "float32", "kv_cache_memory_bytes": b,
          "max_model_len": n, "max_num_seqs": n, "repeats": n, "sweep": [n, ...] (concurrent requests),
          "prefill_chunk": null or n (chunked prefill, n tokens per engine step), "prefix_caching": bool (vLLM's;
          its cache emptied before each run of the trace, so each run finds the same blocks)}; with
          "lm_eval": {"tasks", "include_path", "limit", "gen_kwargs", "seed"} (`mla_quant.stages.serve` only):
          those suites scored through lm-eval's vLLM model on the folder instead (result: {"results": lm-eval's})
result:  {"tokens": [[ids], ...] (the last run's), "runs": [{"seconds", "output_tokens", "preemptions",
          "prefix_hit_tokens", "ttft_s", "inter_token_s"} per repeat, from vLLM's own counters],
          "sweep": [{"requests", "seconds",
          "output_tokens", "preemptions"} per level], "num_blocks": n,
          "block_size": n, "page_bytes_per_block": n (a layer's, the mean over the MLA layers), "layer_page_bytes":
          {layer name: its bytes per block, from the cache vLLM allocated}, "format": name or null,
          "decode_backend": ...,
          "scheduler": the engine's scheduler settings, "layer_formats": {layer name: the format it stored and read},
          "protected": null, or the protected region's pools: {"bytes" (every layer's), "slots", "misses" (the
          engine's: its layers share one slot table)}}
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path

import torch


def engine_args(request: dict) -> dict:
    """vLLM's engine arguments for a request (the same for generation and for lm-eval's vLLM model)."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # share the machine's cores with the caller
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")  # no usage report sent from a study's engine
    # vLLM's C++ rotary op gives wrong query RoPE values for some heads at small head dims on the CPU; its PyTorch
    # rotary is exact.
    args = dict(runner="generate", enforce_eager=True, dtype=request.get("dtype", "float32"),
                compilation_config={"custom_ops": ["-rotary_embedding"]}, max_model_len=int(request["max_model_len"]),
                kv_cache_memory_bytes=int(request["kv_cache_memory_bytes"]), disable_log_stats=False,
                max_num_seqs=int(request.get("max_num_seqs", 256)), seed=0)
    chunk = request.get("prefill_chunk")  # chunked prefill: at most this many tokens per engine step
    args["enable_chunked_prefill"] = chunk is not None
    args["enable_prefix_caching"] = bool(request.get("prefix_caching", False))
    if chunk is not None:
        args["max_num_batched_tokens"] = int(chunk)
    from vllm.platforms import current_platform

    from mla_quant.serving.vllm_backend import engine_block_size
    from mla_quant.serving.vllm_plugin import register

    args["block_size"] = engine_block_size()  # the references' blocks (prefix caching) are the engine's, any platform
    register()  # the engine runs in this process: its backends registered here too, the package installed or not
    if current_platform.is_cpu():  # on a CPU with AMX vLLM would pick AMX_MLA (BF16 weights only) for the
        # unquantized checkpoint: CPU_MLA for every run, as the plugin asks for an exported format's (vllm_plugin.py)
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        args["attention_config"] = {"backend": AttentionBackendEnum.CPU_MLA}
    return args


def vllm_cpu_version() -> None:
    """lm-eval's vLLM model reads vLLM's version by the distribution name `vllm`; the CPU build's distribution is
    `vllm-cpu` (the same `vllm` package). In this engine process only, the one name answers for the other."""
    import importlib.metadata as md

    from vllm.platforms import current_platform

    if getattr(md.version, "vllm_cpu", False):
        return
    current_platform.device_type  # vLLM finds its platform by its own distribution's name first: before the shim
    version = md.version

    def either(name: str) -> str:
        try:
            return version(name)
        except md.PackageNotFoundError:
            if name == "vllm":
                return version("vllm-cpu")
            raise

    either.vllm_cpu = True
    md.version = either


def run_engine(request: dict) -> dict:
    args = engine_args(request)
    from vllm import LLM, SamplingParams
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    from mla_quant.quant.formats import PATHS
    from mla_quant.serving.vllm_backend import LatentFormatImpl, served

    llm = LLM(model=request["model"], **args)
    config = llm.llm_engine.vllm_config
    params = SamplingParams(max_tokens=int(request["max_tokens"]), temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(p)} for p in request["prompts"]]
    runs = []
    for _ in range(int(request.get("repeats", 1))):  # the same trace again: the spread of tokens/s
        outs, seconds, delta = _timed_generate(llm, prompts, params)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        runs.append({"seconds": seconds, "output_tokens": sum(len(t) for t in tokens),
                     "preemptions": int(delta.get("vllm:num_preemptions", (0, 0))[0]),
                     "prefix_hit_tokens": int(delta.get("vllm:prefix_cache_hits", (0, 0))[0]),
                     "ttft_s": _mean(delta.get("vllm:time_to_first_token_seconds")),
                     "inter_token_s": _mean(delta.get("vllm:inter_token_latency_seconds"))})
    sweep = []
    for n in request.get("sweep") or []:  # the trace's prompts cycled to n concurrent requests, one run each
        outs, seconds, delta = _timed_generate(llm, [prompts[i % len(prompts)] for i in range(int(n))], params)
        sweep.append({"requests": int(n), "seconds": seconds,
                      "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                      "preemptions": int(delta.get("vllm:num_preemptions", (0, 0))[0])})
    # the format each engine layer stored and read (a format per layer: found by the layer itself)
    ours = {name: module.impl for name, module in config.compilation_config.static_forward_context.items()
            if isinstance(getattr(module, "impl", None), LatentFormatImpl) and "fmt" in vars(module.impl)}
    layers = {name: {p: impl.fmt.path(p).describe() for p in PATHS} for name, impl in ours.items()}
    pools = [impl.pool for impl in ours.values() if impl.pool is not None]
    protected = None if not pools else {"bytes": sum(pool.nbytes for pool in pools), "slots": pools[0].slots,
                                        "misses": pools[0].table.misses}
    sched = config.scheduler_config
    fmt = served(str(request["model"]))  # as the backend read it in this process
    block_size, num_blocks = int(config.cache_config.block_size), int(config.cache_config.num_gpu_blocks)
    # each MLA layer's bytes per block, from the cache the engine allocated (a format per layer: each its own)
    pages = {name: module.kv_cache.nbytes // num_blocks
             for name, module in config.compilation_config.static_forward_context.items()
             if isinstance(module, MLAAttention) and isinstance(module.kv_cache, torch.Tensor)
             and module.kv_cache.numel()}
    if not pages:
        raise RuntimeError("the engine holds no MLA layer's KV cache")
    page = sum(pages.values()) / len(pages)
    out = {"tokens": tokens, "runs": runs, "sweep": sweep, "layer_formats": layers, "protected": protected,
           "num_blocks": num_blocks,
           "block_size": block_size, "page_bytes_per_block": int(page) if page == int(page) else page,
           "layer_page_bytes": pages, "format": None if fmt is None else fmt.name,
           "decode_backend": "vllm" if fmt is None else fmt.step_backends(config.device_config.device_type)["decode"],
           "scheduler": {"chunked_prefill": bool(sched.enable_chunked_prefill),
                         "max_num_batched_tokens": int(sched.max_num_batched_tokens),
                         "max_num_seqs": int(sched.max_num_seqs),
                         "prefix_caching": bool(config.cache_config.enable_prefix_caching),
                         "reserve_full_isl": bool(sched.scheduler_reserve_full_isl)}}
    shut_down(llm)
    return out


def _timed_generate(llm, prompts, params):
    """One `generate` over the prompts -> (outputs, seconds, the change of vLLM's metrics over it). With prefix
    caching, the cache is emptied first: each run finds only what its own requests wrote."""
    if llm.llm_engine.vllm_config.cache_config.enable_prefix_caching and not llm.reset_prefix_cache():
        raise RuntimeError("vLLM could not empty its prefix cache before a run")
    before = _metrics(llm)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = _metrics(llm)
    return outs, seconds, {k: tuple(a - b for a, b in zip(v, before.get(k, (0, 0)))) for k, v in after.items()}


def _metrics(llm) -> dict[str, tuple[float, float]]:
    """vLLM's counters as (value, 0) and histograms as (sum, count), summed over their labels."""
    out: dict[str, tuple[float, float]] = {}
    for m in llm.get_metrics():
        if hasattr(m, "count") and hasattr(m, "sum"):
            v = (float(m.sum), float(m.count))
        elif hasattr(m, "value"):
            v = (float(m.value), 0.0)
        else:
            continue
        old = out.get(m.name, (0.0, 0.0))
        out[m.name] = (old[0] + v[0], old[1] + v[1])
    return out


def _mean(sum_count) -> float | None:
    return None if not sum_count or not sum_count[1] else sum_count[0] / sum_count[1]


def shut_down(llm) -> None:
    """Stop an engine; what it holds (its KV cache, its model) is freed with it (`main` collects between runs), so
    the next run of the process starts on the memory the first had."""
    llm.llm_engine.engine_core.shutdown()


def main(argv: list[str], run=None) -> None:
    """Request/result pairs, run one after another in this process (`run`: request -> result; `run_engine` by
    default), each result written as its run ends."""
    from mla_quant.record import write_json_atomic

    if not argv or len(argv) % 2:
        raise SystemExit("usage: python -m mla_quant.serving.vllm_run request.json result.json [request.json "
                         "result.json ...]")
    for request, result in zip(argv[::2], argv[1::2]):
        write_json_atomic(Path(result), (run or run_engine)(json.loads(Path(request).read_text())))
        gc.collect()  # the engine just shut down, freed before the next starts


if __name__ == "__main__":
    main(sys.argv[1:])
