"""Serving capacity on vLLM's own scheduler: how each cache format's bytes turn into KV blocks, preemptions and
throughput for a request trace, under both of vLLM's admission policies (docs/serving.md).

    python run.py experiment=serving                                   # the paper's case: 8 x H200, 5 x 128K requests
    python run.py experiment=serving model=spec_kimi_k2 task.num_gpus=16
    python run.py experiment=serving 'task.formats=[bf16,int4_joint]' task.requests.count=8 task.sweep.concurrency=[]

For the model's shape (config only: mla_quant.serving.shape), the GPU preset `task.gpu` x `task.num_gpus` and
`task.parallel`, each format of `task.formats` gets a KV block budget from its bytes per token (the project's byte
formula at the trace's context: protected region and scales included) and vLLM's scheduler
(mla_quant.serving.engine) runs the trace of `task.requests` under each policy of `task.policies`
(`reserve_full_prompt`: vLLM's default, a request is admitted only when its whole prompt fits;
`chunked_admission`: scheduler_reserve_full_isl=false, older vLLM's behaviour). Each engine step is timed by the
roofline of mla_quant.serving.capacity (or the measured decode kernel of a bench_kernel CSV, `task.kernel_csv`).
Writes serving.csv / serving.md (per format and policy), serving_sweep.csv and serving_throughput.png (throughput
and preemptions against concurrency), serving_budget.csv and serving_budget.png (the trace at the fixed KV budgets of
`task.sweep.kv_budget_gb`), serving_capacity.csv and serving_capacity.png (the longest context each format
serves N requests without preemption).
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from mla_quant.cache.bytes import load_quant_option  # noqa: E402
from mla_quant.checks import int_setting  # noqa: E402
from mla_quant.prepare import model_config  # noqa: E402
from mla_quant.quant.peers import refuse_peer  # noqa: E402
from mla_quant.quant.formats import BASELINE, cache_bytes_per_token, cache_format  # noqa: E402
from mla_quant.record import write_text_atomic  # noqa: E402
from mla_quant.serving.capacity import GPU, Deployment, StepTime, kernel_lookup, kv_blocks  # noqa: E402
from mla_quant.serving.engine import TraceRequest, import_vllm, schedule_trace  # noqa: E402
from mla_quant.serving.shape import serving_shape  # noqa: E402
from mla_quant.stages import StageResult  # noqa: E402

NULL_BLOCKS = 1  # vLLM's block pool keeps one block aside (its null block)
POLICIES = {"reserve_full_prompt": True, "chunked_admission": False}  # -> SchedulerConfig.scheduler_reserve_full_isl
PAPER = Path(__file__).resolve().parents[2] / "analysis" / "paper_results.csv"


def _positive(name: str, value) -> int:
    return int_setting(value, name, allowed="a positive integer")


def trace(req, count: int | None = None, input_tokens: int | None = None) -> list[TraceRequest]:
    n = _positive("task.requests.count", req.count if count is None else count)
    inp = _positive("task.requests.input", req.input if input_tokens is None else input_tokens)
    out = _positive("task.requests.output", req.output)
    gap = float(req.get("arrival_interval_s", 0.0))
    if gap < 0:
        raise ValueError(f"task.requests.arrival_interval_s={gap}: not negative")
    return [TraceRequest(inp, out, i * gap) for i in range(n)]


def deployment(task) -> Deployment:
    if task.gpu not in task.gpus:
        raise ValueError(f"task.gpu={task.gpu!r}; allowed: {sorted(task.gpus)}")
    g = task.gpus[task.gpu]
    gpu = GPU(task.gpu, float(g.memory_gb), float(g.hbm_tbps), float(g.bf16_tflops),
              None if g.get("fp8_tflops") is None else float(g.fp8_tflops))
    return Deployment(gpu, task.num_gpus, task.parallel, float(task.gpu_memory_utilization),
                      float(task.activation_reserve_gb), float(task.flops_efficiency), float(task.bandwidth_efficiency))


def formats(cfg, shape) -> dict:
    """{option: CacheFormat} at the model's dims; unknown options refused with the allowed names."""
    groups = OmegaConf.to_container(cfg.model.get("quant_group_size")) if cfg.model.get("quant_group_size") else None
    out = {}
    for name in cfg.task.formats:
        quant = load_quant_option(name, groups=groups)
        refuse_peer(quant, "experiment=serving (vLLM's blocks sized by the format's bytes)")
        out[name] = cache_format(quant, shape.d_c, shape.d_r)
    if not out:
        raise ValueError("task.formats is empty: name the quant options to serve (e.g. [bf16, int4_joint])")
    return out


def validate(cfg):
    """Everything checked before vLLM starts: the shape, the deployment (weights fit), formats, trace, policies."""
    task = cfg.task
    shape = serving_shape(model_config(cfg.model), name=str(cfg.model.get("family", "model")))
    dep = deployment(task)
    fmts = formats(cfg, shape)
    bad = sorted(set(task.policies) - set(POLICIES))
    if bad or not task.policies:
        raise ValueError(f"task.policies={list(task.policies)}; allowed: {list(POLICIES)}")
    reqs = trace(task.requests)
    sweep_inputs = [int(task.sweep.input)] if task.sweep.concurrency else []
    for n in [*task.sweep.concurrency, *task.capacity_requests]:
        _positive("task.sweep.concurrency / task.capacity_requests", n)
    for gb in task.sweep.kv_budget_gb:
        if isinstance(gb, bool) or not isinstance(gb, (int, float)) or gb <= 0:
            raise ValueError(f"task.sweep.kv_budget_gb has {gb!r}: positive GB per GPU")
    longest = max([r.input_tokens for r in reqs] + sweep_inputs) + int(task.requests.output)
    if longest > shape.max_positions:
        raise ValueError(f"task.requests: {longest} tokens (input + output) exceed the model's limit of "
                         f"{shape.max_positions} positions")
    for name in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
        _positive(f"task.{name}", task[name])
    if task.kv_budget_gb is not None and float(task.kv_budget_gb) <= 0:
        raise ValueError(f"task.kv_budget_gb={task.kv_budget_gb}: positive GB per GPU, or null")
    if task.kernel_csv is not None and not Path(task.kernel_csv).is_file():
        raise ValueError(f"task.kernel_csv={task.kernel_csv}: no such file (a bench_kernel.csv of a GPU run, or null)")
    from mla_quant.serving.capacity import kv_budget_bytes

    kv_budget_bytes(shape, dep)  # refuses a model that does not fit
    return shape, dep, fmts, reqs


def blocks_for(task, shape, dep, fmt, context: int, budget_gb: float | None = None) -> tuple[int, float]:
    """(KV blocks per scheduler rank, bytes per token per layer at `context`); `budget_gb` (or task.kv_budget_gb)
    fixes the KV bytes per GPU instead of what the memory leaves."""
    bpt = cache_bytes_per_token(fmt, shape.d_c, shape.d_r, context)
    return kv_blocks(shape, dep, bpt, int(task.block_size), task.kv_budget_gb if budget_gb is None else budget_gb), bpt


def run_one(task, shape, dep, fmt, reqs, policy: str, kernel, budget_gb: float | None = None) -> dict:
    context = max(r.input_tokens + r.output_tokens for r in reqs)
    blocks, bpt = blocks_for(task, shape, dep, fmt, context, budget_gb)
    if blocks < 1:
        raise ValueError(f"format {fmt.name}: no KV block fits the memory left ({task.kv_budget_gb or 'computed'})")
    step = StepTime(shape, dep, lambda c: cache_bytes_per_token(fmt, shape.d_c, shape.d_r, max(1, c)), kernel)
    ranks = dep.ranks
    parts = [reqs[i::ranks] for i in range(ranks)]  # data-parallel attention: requests round-robin over the ranks
    results = [schedule_trace(p, blocks, int(task.block_size), POLICIES[policy], step,
                              int(task.max_num_batched_tokens), int(task.max_num_seqs)) for p in parts if p]
    makespan = max(r.makespan_s for r in results)
    out_tokens = sum(r.output_tokens for r in results)
    ttft = [t for r in results for t in r.ttft_s]
    return {"format": fmt.name, "policy": policy, "requests": len(reqs), "input": reqs[0].input_tokens,
            "kv_budget_gb": budget_gb if budget_gb is not None else task.kv_budget_gb,
            "output": reqs[0].output_tokens, "bytes_per_token_per_layer": bpt, "kv_blocks": blocks,
            "kv_tokens": blocks * int(task.block_size), "preemptions": sum(r.preemptions for r in results),
            "preempted_requests": sum(r.preempted_requests for r in results),
            "recomputed_tokens": sum(r.recomputed_tokens for r in results),
            "steps": max(r.steps for r in results), "max_running": sum(r.max_running for r in results),
            "makespan_s": makespan, "output_tok_s": out_tokens / makespan if makespan > 0 else 0.0,
            "ttft_mean_s": sum(ttft) / len(ttft) if ttft else float("nan")}


def capacity(task, shape, dep, fmt, n: int, output: int) -> int:
    """The longest input each of n concurrent requests can have with every block of all n resident at once (no
    preemption under either policy): n x ceil((input + output) / block) <= blocks - 1 (vLLM's null block), bytes
    per token at that length (fixed point over the protected region's share)."""
    block = int(task.block_size)
    length = shape.max_positions
    for _ in range(4):
        blocks, _ = blocks_for(task, shape, dep, fmt, max(length, 1))
        length = ((blocks - NULL_BLOCKS) // n) * block - output
        if length <= 0:
            return 0
    return min(length, shape.max_positions - output)


def _ratio(rows: list[dict], key: str) -> None:
    base = {r["policy"]: r[key] for r in rows if r["format"] == BASELINE}
    for r in rows:
        b = base.get(r["policy"])
        r[f"{key}_vs_bf16"] = r[key] / b if b else float("nan")


def _paper_lines() -> str:
    if not PAPER.is_file():
        return ""
    df = pd.read_csv(PAPER)
    df = df[df["table"] == "serving"]
    return "\n".join(f"  paper: {r.cache} {r.metric} = {r.value} ({r.note})" for r in df.itertuples())


def run(cfg: DictConfig, run_dir: Path) -> StageResult:
    task = cfg.task
    shape, dep, fmts, reqs = validate(cfg)
    import_vllm()  # a clear error naming the install command before any work
    kernels = {name: kernel_lookup(task.kernel_csv, name) if task.kernel_csv else None for name in fmts}
    timing = {name: ("bench_kernel:" + str(task.kernel_csv)) if kernels[name] else "roofline" for name in fmts}
    rows = [run_one(task, shape, dep, fmt, reqs, policy, kernels[name]) | {"timing": timing[name]}
            for name, fmt in tqdm(fmts.items(), desc="serving", unit="format") for policy in task.policies]
    _ratio(rows, "output_tok_s")
    _ratio(rows, "makespan_s")
    table = pd.DataFrame(rows)
    metrics = {}
    for r in rows:
        key = f"serving/{r['format']}/{r['policy']}"
        for k in ("preemptions", "recomputed_tokens", "steps", "max_running", "makespan_s", "output_tok_s",
                  "output_tok_s_vs_bf16", "ttft_mean_s", "kv_blocks"):
            metrics[f"{key}/{k}"] = r[k]
    head = (f"{shape.name}: {shape.params / 1e9:.1f}B parameters ({shape.weight_bytes / 1e9:.1f} GB stored"
            f"{', FP8' if shape.fp8 else ''}), {shape.layers} cache layers; {dep.num_gpus} x {dep.gpu.name} "
            f"({dep.parallel}), gpu_memory_utilization {dep.gpu_memory_utilization}; {len(reqs)} requests x "
            f"({reqs[0].input_tokens} + {reqs[0].output_tokens}) tokens; block {task.block_size}; timing: "
            f"{sorted(set(timing.values()))}")
    text = table.to_markdown(index=False, floatfmt=".4g")
    paper = _paper_lines()
    write_text_atomic(run_dir / "serving.csv", table.to_csv(index=False))
    write_text_atomic(run_dir / "serving.md", f"{head}\n\n{text}\n\n{paper}\n")
    print(head)
    print(table[["format", "policy", "kv_blocks", "preemptions", "recomputed_tokens", "steps", "max_running",
                 "makespan_s", "output_tok_s", "output_tok_s_vs_bf16"]].to_string(index=False,
                                                                                  float_format=lambda x: f"{x:.4g}"))
    if paper:
        print(paper)
    tables, images = {"serving": table}, {}
    sweeps = {  # table -> (figure, runs as (trace, KV budget or None), x column, x label, x scale)
        "serving_sweep": ("serving_throughput", [(trace(task.requests, n, int(task.sweep.input)), None)
                                                 for n in task.sweep.concurrency],
                          "requests", "concurrent requests", "log"),
        "serving_budget": ("serving_budget", [(reqs, float(gb)) for gb in task.sweep.kv_budget_gb],  # fixed budgets
                           "kv_budget_gb", "KV budget per GPU (GB)", "linear"),
    }
    for name_of_table, (figure, runs, x, xlabel, xscale) in sweeps.items():
        if not runs:
            continue
        df = pd.DataFrame([run_one(task, shape, dep, fmt, r, policy, kernels[name], gb)
                           for name, fmt in tqdm(fmts.items(), desc=name_of_table, unit="format")
                           for policy in task.policies for r, gb in runs])
        write_text_atomic(run_dir / f"{name_of_table}.csv", df.to_csv(index=False))
        images[figure] = _outcome_figure(df, run_dir, x, xlabel, figure, xscale)
        tables[name_of_table] = df
    if task.capacity_requests:
        cap = []
        out_tokens = int(task.requests.output)
        concurrent_at = reqs[0].input_tokens + out_tokens
        for name, fmt in fmts.items():
            blocks, bpt = blocks_for(task, shape, dep, fmt, concurrent_at)
            per_request = math.ceil(concurrent_at / int(task.block_size))
            for n in task.capacity_requests:
                cap.append({"format": name, "requests": int(n), "longest_input": capacity(task, shape, dep, fmt,
                                                                                           int(n), out_tokens),
                            "concurrent_at_trace_length": (blocks - NULL_BLOCKS) // per_request,
                            "bytes_per_token_per_layer": bpt})
        cap_df = pd.DataFrame(cap)
        base = cap_df[cap_df["format"] == BASELINE]
        if not base.empty:
            b = base.iloc[0]
            first = cap_df.groupby("format").first()
            for name, r in first.iterrows():
                metrics[f"serving/{name}/concurrent_at_trace_length"] = int(r["concurrent_at_trace_length"])
                metrics[f"serving/{name}/capacity_vs_bf16"] = r["concurrent_at_trace_length"] / max(
                    b["concurrent_at_trace_length"], 1)
                metrics[f"serving/{name}/byte_ratio_vs_bf16"] = b["bytes_per_token_per_layer"] / r[
                    "bytes_per_token_per_layer"]
        write_text_atomic(run_dir / "serving_capacity.csv", cap_df.to_csv(index=False))
        images["serving_capacity"] = _capacity_figure(cap_df, run_dir, out_tokens)
        tables["serving_capacity"] = cap_df
    return StageResult(metrics=metrics, tables=tables, images=images)


def _outcome_figure(df: pd.DataFrame, run_dir: Path, x: str, xlabel: str, name: str, xscale: str = "linear") -> str:
    """Throughput and preemptions against column `x`, one line per format and policy -> <name>.png/.pdf."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for (fmt, policy), g in df.groupby(["format", "policy"]):
        style = "-" if policy == "chunked_admission" else "--"
        axes[0].plot(g[x], g["output_tok_s"], style, marker="o", label=f"{fmt} ({policy})")
        axes[1].plot(g[x], g["preemptions"], style, marker="o", label=f"{fmt} ({policy})")
    axes[0].set(xlabel=xlabel, ylabel="output tokens / s", xscale=xscale, title="throughput")
    axes[1].set(xlabel=xlabel, ylabel="preemptions", xscale=xscale, title="preemptions")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    for ext in ("png", "pdf"):
        fig.savefig(run_dir / f"{name}.{ext}")
    plt.close(fig)
    return str(run_dir / f"{name}.png")


def _capacity_figure(df: pd.DataFrame, run_dir: Path, output: int) -> str:
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, g in df.groupby("format"):
        ax.plot(g["requests"], g["longest_input"], marker="o", label=name)
    ax.set(xlabel="concurrent requests", ylabel=f"longest input without preemption (+{output} out)", xscale="log",
           yscale="log", title="KV capacity per format")
    ax.legend(fontsize=8)
    fig.tight_layout()
    for ext in ("png", "pdf"):
        fig.savefig(run_dir / f"serving_capacity.{ext}")
    plt.close(fig)
    return str(run_dir / "serving_capacity.png")
