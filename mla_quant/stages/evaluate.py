"""Stage: lm-eval (offline) over the absorbed MLA model with a fresh latent cache per call.

    python run.py model=toy_mla experiment=evaluate logger=none
    python run.py model=toy_mla experiment=evaluate eval.allow_code_execution=true   # + toy_humaneval (pass@1)
    python run.py model=toy_mla experiment=evaluate quant=int4_joint                 # quantized latent cache

Writes the toy task files (mla_quant.eval.task_files) into <run_dir>/lm_eval_tasks, runs lm_eval.simple_evaluate
with a TaskManager over them, prints the scores as a table (eval.md) and writes lm_eval_results.json. Metrics are
flat: eval/<task>/<metric> (eval/toy_gsm8k/exact_match is the strict `#### N` match), and, with
eval.control_no_rope.enabled, eval/control_no_rope/<task>/<metric> for the needle tasks rerun with every RoPE
angle at zero (retrieval should collapse). Options: conf/eval/toy.yaml.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch
from omegaconf import DictConfig, OmegaConf

from mla_quant.cache.bytes import HeldBytes
from mla_quant.eval import HEADLINE_FILTERS
from mla_quant.eval.harness import LatentCacheHFLM, compact_samples, evaluate_tasks, rope_zeroed
from mla_quant.eval.needles import check_placement, needle_region, region_metrics
from mla_quant.eval.task_files import CODE_TASKS, TOY_TASKS, write_task_files
from mla_quant.eval.task_utils import ALLOW_ENV, OPT_IN_HINT
from mla_quant.eval.suites import CODE_STOCK_TASKS, TaskPlan, check_eval, load_stock_tasks, plan_tasks
from mla_quant.memory import allocated_bytes
from mla_quant.metrics import eval_prefix, parse_eval
from mla_quant.models.build import load_tokenizer
from mla_quant.prepare import check_context, model_dims, preflight, prepare_model
from mla_quant.stages import StageResult
from mla_quant.record import progress, write_json_atomic, write_text_atomic



def flat_metrics(results: dict, prefix: str) -> dict[str, float]:
    """lm-eval's {"task": {"metric,filter": value}} -> {"<prefix>/<task>/<metric>[@filter]": value}."""
    out = {}
    for task, scores in results.get("results", {}).items():
        for key, value in scores.items():
            if "," not in key or not isinstance(value, (int, float)) or value == -1.0:
                continue  # -1: a per-length metric for a length this run did not evaluate; "N/A" stderr: skipped
            metric, filt = key.split(",", 1)  # "exact_match_stderr,strict-match" -> eval/<task>/exact_match_stderr
            if metric.endswith("_stderr") and scores.get(f"{metric[:-len('_stderr')]},{filt}") == -1.0:
                continue  # the standard error of a metric this run did not evaluate
            name = metric if filt in HEADLINE_FILTERS else f"{metric}@{filt}"
            out[f"{prefix}/{task}/{name}"] = float(value)
    return out


RESULT_FIELDS = ("results", "n-shot", "n-samples", "versions", "needles", "cache", "held")


def task_metrics(res: dict, prefix: str) -> dict[str, float]:
    """A task's record metrics: lm-eval's scores (`flat_metrics`), accuracy by where the needle sat
    (<prefix>/<task>/needle_<region>/...) and the bytes its caches held (<prefix>/<task>/cache/...)."""
    out = flat_metrics(res, prefix)
    for field in ("needles", "cache"):
        for task, values in (res.get(field) or {}).items():
            out.update({f"{prefix}/{task}/{k}": float(v) for k, v in values.items()})
    return out


def evaluate_each(lm, tasks: list[str], folder, prefix: str, loaded: dict | None = None,
                  samples_dir: Path | None = None, needle_of=None, **kwargs) -> dict:
    """lm-eval one task at a time; each task's results go into the run's progress as soon as it finishes, so an
    interrupted run keeps them and its rerun does not evaluate them again. -> lm-eval's result fields, merged, with
    "needles" (accuracy by the needle's region, from the samples and `needle_of`) and "cache" (bytes per token and
    layer its caches held, `HeldBytes`) per task. samples_dir: each task's per-example scores written there as
    <task>.jsonl (`compact_samples`) before the task counts as finished."""
    def one(task):
        before = lm.held.copy()
        res = evaluate_tasks(lm, [(loaded or {}).get(task, task)], folder, log_samples=samples_dir is not None,
                             **kwargs)
        held = lm.held - before
        res["cache"] = {name: held.metrics("cache") for name in res.get("results", {})}
        res["held"] = {task: held.tally()}  # the unit's own tallies: the run's bytes pool them, resumed units too
        res["needles"] = {}
        for name, samples in (res.get("samples") or {}).items():
            rows = compact_samples(samples, needle_of)
            res["needles"][name] = region_metrics(rows)
            lines = [json.dumps(row, default=str) for row in rows]
            write_text_atomic(Path(samples_dir) / f"{name}.jsonl", "".join(f"{line}\n" for line in lines))
        return json.loads(json.dumps({f: res.get(f) for f in RESULT_FIELDS}, default=str))

    parts = [progress().unit(f"{prefix}/{t}", lambda t=t: one(t), metrics=lambda r: task_metrics(r, prefix))
             for t in tasks]
    return {f: {k: v for part in parts for k, v in (part.get(f) or {}).items()} for f in RESULT_FIELDS}


def check_lengths(cfg: DictConfig, plan) -> None:
    """Toy needle lengths and RULER lengths within the model's positions (read from its config, no weights)."""
    dims = model_dims(cfg.model)
    if plan.toy:
        check_context("eval.data.niah_lengths", cfg.eval.data.niah_lengths, dims)
    if plan.ruler:
        check_context("eval.ruler.lengths", cfg.eval.ruler.lengths, dims)


def code_tasks_allowed(tasks: list[str], allow: bool) -> list[str]:
    """The task list without code-executing tasks unless code execution was opted into (prints why)."""
    code = [t for t in tasks if t in CODE_TASKS or t in CODE_STOCK_TASKS]
    if code and not allow:
        print(f"[evaluate] refusing {code}: they execute model-written code; {OPT_IN_HINT}")
        return [t for t in tasks if t not in code]
    return list(tasks)


def table(metrics: dict[str, float]) -> pd.DataFrame:
    """Long table (setting, task, metric, score) of the eval/... metrics."""
    rows = []
    for key, value in metrics.items():
        k = parse_eval(key)
        if k is not None and k.score and k.region is None:
            rows.append({"setting": k.setting, "task": k.task, "metric": k.metric, "score": value})
    return pd.DataFrame(rows)


def check(cfg: DictConfig, data_folder: Path | None = None, data: bool = True) -> tuple[TaskPlan, dict]:
    """`checked`, without what it validated."""
    plan, stock, _ = checked(cfg, data_folder, data)
    return plan, stock


def checked(cfg: DictConfig, data_folder: Path | None = None, data: bool = True) -> tuple[TaskPlan, dict, tuple]:
    """Everything this stage refuses, before any weight is read: every eval.* value, the task names, code execution,
    the tokenizer, the lengths against the model's positions, the quant/transform/objective/calib settings
    (`preflight`), then every stock task's dataset (loaded, or refused naming the task, its dataset and the local
    alternative). -> (the task plan, the loaded stock tasks, (dims, format) as `preflight` validated them).
    data_folder: where local task files go (None: a temporary folder, dropped: the check only). data=False: the
    datasets are not loaded (nor returned)."""
    ev = cfg.eval
    check_eval(ev)
    plan = plan_tasks(ev, TOY_TASKS)  # unknown names, RULER without lengths, idle data_files: refused here
    allow = bool(ev.get("allow_code_execution", False))
    plan.toy = code_tasks_allowed(plan.toy, allow)
    plan.stock = code_tasks_allowed(plan.stock, allow)
    if not plan.toy and not plan.stock:
        raise ValueError("eval.tasks is empty (after refusing code execution); nothing to evaluate")
    if cfg.model.get("tokenizer") is None:
        raise ValueError(f"model {cfg.model.get('_target_')} has no tokenizer (a random tiny model?); "
                         f"evaluate needs a trained model, e.g. model=toy_mla")
    check_lengths(cfg, plan)
    dims, fmt, _ = preflight(cfg)  # quant, transform, objective, calib, the tokenizer's files
    check_placement((ev.get("data") or {}).get("needle_outside") if plan.toy else None, fmt)
    # The stock tasks' datasets before any weight is read: offline, the error names the task and its dataset.
    # (RULER builds its samples with the tokenizer; no other stock task reads it before the model is prepared)
    if not data:
        return plan, {}, (dims, fmt)
    return plan, stock_tasks(plan, ev, load_tokenizer(cfg.model) if plan.ruler else None, data_folder), (dims, fmt)


def stock_tasks(plan: TaskPlan, ev: DictConfig, tokenizer, data_folder: Path | None) -> dict:
    """The plan's stock tasks loaded (local task files into data_folder; None: a temporary folder, dropped)."""
    if data_folder is None:
        with tempfile.TemporaryDirectory() as tmp:
            return load_stock_tasks(plan, ev, tokenizer, Path(tmp))
    return load_stock_tasks(plan, ev, tokenizer, data_folder)


def run(cfg: DictConfig, run_dir: Path) -> StageResult:
    ev = cfg.eval
    torch.set_num_threads(int(ev.get("threads", 2)))
    before = allocated_bytes()
    plan, _, validated = checked(cfg, data=False)
    tokenizer = load_tokenizer(cfg.model)  # once, its files checked: RULER's samples, the toy task files, the model's
    stock = stock_tasks(plan, ev, tokenizer, run_dir / "lm_eval_tasks" / "local")
    after = allocated_bytes()  # lm-eval, its loaded tasks (RULER's haystacks: ~0.15 GB) are held through the run
    allow = bool(ev.get("allow_code_execution", False))

    # the toy task files before any weight is read: a needle placement that cannot be had fails here
    folder = (write_task_files(run_dir / "lm_eval_tasks", tokenizer, tasks=plan.toy,
                               **OmegaConf.to_container(ev.data, resolve=True)) if plan.toy else None)
    # validates quant/transform/objective against the model before loading weights; plans memory with the tasks
    prep = prepare_model(cfg, tokenizer=tokenizer, validated=validated,  # checked above: the plan is made again
                         host=None if after is None else {"lm-eval tasks": max(0, after - before)})
    model = prep.model
    lm = LatentCacheHFLM(model, tokenizer, layer_factory=prep.layer_factory(),
                         batch_size=int(ev.batch_size))
    gen_kwargs = OmegaConf.to_container(ev.gen_kwargs, resolve=True) if ev.get("gen_kwargs") else None
    if allow:
        os.environ[ALLOW_ENV] = "1"  # read by mla_quant.eval.task_utils.run_program (toy_humaneval)
        os.environ["HF_ALLOW_CODE_EVAL"] = "1"  # read by the `code_eval` metric of lm-eval's humaneval
    options = dict(limit=ev.limit, num_fewshot=ev.get("num_fewshot"), gen_kwargs=gen_kwargs, seed=cfg.seed)
    samples = run_dir / "samples" if ev.get("log_samples", True) else None  # per-example scores (paired analysis)

    metrics: dict[str, float | str] = dict(prep.metrics())
    progress().add_metrics(metrics)  # the calibration's metrics are finished: an interruption keeps them
    raw: dict = {}
    toy = plan.toy
    start = time.perf_counter()
    needle_of = lambda doc: needle_region(doc, prep.fmt)  # noqa: E731  where each needle sits in this cache
    if toy:
        res = evaluate_each(lm, toy, folder, "eval", allow_code_execution=allow, samples_dir=samples,
                            needle_of=needle_of, **options)
        raw["toy"] = res
        metrics.update(task_metrics(res, eval_prefix()))
    if plan.stock:
        res = evaluate_each(lm, plan.stock, None, "eval", loaded=stock, allow_code_execution=allow,
                            samples_dir=samples, needle_of=needle_of, **options)
        raw["stock"] = res
        metrics.update(task_metrics(res, eval_prefix()))
    held = sum((HeldBytes.from_tally(t) for part in raw.values() for t in (part.get("held") or {}).values()),
               HeldBytes())  # the bytes held over every task, the ones a resumed run kept included
    metrics.update(held.metrics("cache"))
    metrics[f"{eval_prefix()}/seconds"] = time.perf_counter() - start
    metrics[f"{eval_prefix()}/cache_calls"] = lm.cache_calls

    control = ev.get("control_no_rope")
    control_tasks = [t for t in (control.tasks if control else []) if t in toy]
    if control and control.enabled and control_tasks:
        start = time.perf_counter()
        with rope_zeroed(model):
            res = evaluate_each(lm, control_tasks, folder, eval_prefix("rope=0"),
                                samples_dir=samples and samples / "control_no_rope", needle_of=needle_of, **options)
        raw["control_no_rope"] = res
        metrics.update(task_metrics(res, eval_prefix("rope=0")))
        metrics[f"{eval_prefix('rope=0')}/seconds"] = time.perf_counter() - start

    write_json_atomic(run_dir / "lm_eval_results.json",
                      json.loads(json.dumps({k: {f: v.get(f) for f in RESULT_FIELDS}
                                             for k, v in raw.items()}, default=str)))
    df = table(metrics)
    text = df.to_markdown(index=False, floatfmt=".3f") if len(df) else "(no scores)"
    seconds = {k: round(v, 1) for k, v in metrics.items() if k.endswith("seconds")}
    write_text_atomic(run_dir / "eval.md", f"{text}\n\nseconds: {seconds}\n")
    print(text)
    print(f"[evaluate] seconds: {seconds}")
    return StageResult(metrics=metrics)
