"""A deployment's KV block budget per cache format, and the time of one engine step (docs/serving.md).

    dep = Deployment(gpu=GPU(...), num_gpus=8, parallel="tp")
    blocks = kv_blocks(shape, dep, bytes_per_token, block_size=64)     # per rank
    step = StepTime(shape, dep, bytes_per_token_fn)                    # plan [(new, context), ...] -> seconds

Memory per rank: `gpu_memory_utilization` of the GPU, less the rank's weights (tensor parallel: 1/N of every
weight; data-parallel attention: the attention and dense weights whole, the routed experts split over the ranks) and
an activation reserve; what is left holds KV blocks of `block_size` tokens x the format's bytes per token x the
cache layers. MLA's latent is one head: under tensor parallelism every rank holds the whole latent of every token,
so the budget in tokens is one rank's; with data-parallel attention each rank holds its own requests' tokens.

Step time (roofline, per rank): max(FLOPs / (peak x flops_efficiency), bytes / (HBM bandwidth x
bandwidth_efficiency)). FLOPs: 2 x active parameters per token (dense + the routed experts' k/E share; FP8 peak for
the matmuls of an FP8 checkpoint), the LM head per scheduled request, attention per request and layer (a prefill
chunk of n new tokens over c cached ones in the expanded form: 2 H n (c + (n+1)/2) (d_nope + d_r + d_v) plus the
up-projection 2 (c + n) d_c H (d_nope + d_v); a decode step in the absorbed form: 2 H (c + 1) (2 d_c + d_r)).
Bytes: the dense weights and LM head once per step, the routed experts the step activates (1 - (1 - k/E)^tokens of
them), and every scheduled request's cache (c + n tokens x the format's bytes per token x layers). With a
`bench_kernel` CSV from a GPU run, a decode step's attention takes the measured kernel time of its format, heads
and context instead of its cache bytes over the bandwidth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from mla_quant.checks import int_setting
from mla_quant.serving.shape import ServingShape

PARALLEL = ("tp", "dp_attention")
GB = 1e9


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gb: float
    hbm_tbps: float
    bf16_tflops: float
    fp8_tflops: float | None = None  # None: no FP8 tensor cores (the matmuls run at the bf16 peak)


@dataclass(frozen=True)
class Deployment:
    gpu: GPU
    num_gpus: int = 1
    parallel: str = "tp"
    gpu_memory_utilization: float = 0.9
    activation_reserve_gb: float = 4.0
    flops_efficiency: float = 0.5
    bandwidth_efficiency: float = 0.8

    def __post_init__(self):
        if self.parallel not in PARALLEL:
            raise ValueError(f"task.parallel={self.parallel!r}; allowed: {list(PARALLEL)}")
        int_setting(self.num_gpus, "task.num_gpus", allowed="a positive integer")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"task.gpu_memory_utilization={self.gpu_memory_utilization}: in (0, 1]")
        for name in ("flops_efficiency", "bandwidth_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"task.{name}={getattr(self, name)}: in (0, 1]")
        if self.activation_reserve_gb < 0:
            raise ValueError(f"task.activation_reserve_gb={self.activation_reserve_gb}: not negative")

    @property
    def ranks(self) -> int:
        """Schedulers: one per data-parallel attention rank, one for a tensor-parallel group."""
        return self.num_gpus if self.parallel == "dp_attention" else 1


def weights_per_rank(shape: ServingShape, dep: Deployment) -> float:
    """Stored weight bytes on one GPU."""
    if dep.parallel == "tp":
        return shape.weight_bytes / dep.num_gpus
    return shape.weight_bytes - shape.expert_bytes + shape.expert_bytes / dep.num_gpus


def kv_budget_bytes(shape: ServingShape, dep: Deployment) -> float:
    """Bytes one GPU has for KV blocks; refused by name when the weights do not fit."""
    usable = dep.gpu.memory_gb * GB * dep.gpu_memory_utilization
    weights = weights_per_rank(shape, dep)
    left = usable - weights - dep.activation_reserve_gb * GB
    if left <= 0:
        raise ValueError(
            f"model {shape.name} does not fit: {weights / GB:.1f} GB of weights per GPU ({shape.weight_bytes / GB:.1f} "
            f"GB in all, task.parallel={dep.parallel}, task.num_gpus={dep.num_gpus}) and a "
            f"{dep.activation_reserve_gb} GB activation reserve against {usable / GB:.1f} GB usable on task.gpu="
            f"{dep.gpu.name} (task.gpu_memory_utilization={dep.gpu_memory_utilization}); use more GPUs or a larger one")
    return left


def kv_blocks(shape: ServingShape, dep: Deployment, bytes_per_token: float, block_size: int,
              budget_gb: float | None = None) -> int:
    """KV blocks per scheduler rank for a format of `bytes_per_token` per token per layer, in what the GPU's memory
    leaves or in a fixed `budget_gb` per GPU."""
    budget = kv_budget_bytes(shape, dep) if budget_gb is None else float(budget_gb) * GB
    return int(budget // (block_size * bytes_per_token * shape.layers))


class StepTime:
    """Seconds of one engine step on one rank (see the module docstring). `bytes_per_token(context)`: the format's
    bytes per token per layer at that context; `kernel(heads, context)`: measured seconds of one decode query's
    attention over one layer (from bench_kernel), or None for the roofline."""

    def __init__(self, shape: ServingShape, dep: Deployment, bytes_per_token: Callable[[int], float],
                 kernel: Callable[[int, int], float] | None = None):
        self.shape, self.dep, self.bytes_per_token, self.kernel = shape, dep, bytes_per_token, kernel
        s = shape
        self.expanded = 2 * s.heads * (s.d_nope + s.d_r + s.d_v)
        self.up_projection = 2 * s.d_c * s.heads * (s.d_nope + s.d_v)
        self.absorbed = 2 * s.heads * (2 * s.d_c + s.d_r)
        gpu = dep.gpu
        self.matmul_peak = (gpu.fp8_tflops if s.fp8 and gpu.fp8_tflops else gpu.bf16_tflops) * 1e12
        self.attention_peak = gpu.bf16_tflops * 1e12

    def parts(self, plan: list[tuple[int, int]]) -> dict[str, float]:
        s, dep = self.shape, self.dep
        tokens = sum(n for n, _ in plan)
        tp = dep.num_gpus if dep.parallel == "tp" else 1
        matmul = 2 * s.active_params() * tokens + 2 * s.lm_head_params * len(plan)
        attention, kv_bytes, kernel_s = 0.0, 0.0, 0.0
        for new, ctx in plan:
            if new > 1 or self.kernel is None:
                kv_bytes += (ctx + new) * self.bytes_per_token(ctx + new) * s.layers
            if new > 1:
                attention += s.layers * (self.expanded * new * (ctx + (new + 1) / 2) + self.up_projection * (ctx + new))
            else:
                attention += s.layers * self.absorbed * (ctx + 1)
                if self.kernel is not None:
                    kernel_s += s.layers * self.kernel(max(1, s.heads // tp), ctx + 1)
        if dep.parallel == "tp":
            weights = (s.weight_bytes - s.embedding_bytes - s.expert_bytes) / tp \
                + s.expert_bytes / tp * s.expert_fraction_read(tokens)
        else:  # the rank's attention and dense weights whole; its 1/N of the experts, hit by every rank's tokens
            weights = s.weight_bytes - s.embedding_bytes - s.expert_bytes \
                + s.expert_bytes / dep.num_gpus * s.expert_fraction_read(tokens * dep.num_gpus)
        compute = (matmul / tp / self.matmul_peak + attention / tp / self.attention_peak) / dep.flops_efficiency
        memory = (weights + kv_bytes) / (dep.gpu.hbm_tbps * 1e12 * dep.bandwidth_efficiency)
        return {"compute_s": compute, "memory_s": memory, "kernel_s": kernel_s,
                "seconds": max(compute, memory) + kernel_s}

    def __call__(self, plan: list[tuple[int, int]]) -> float:
        return self.parts(plan)["seconds"]


def kernel_lookup(csv_path: str, option: str) -> Callable[[int, int], float] | None:
    """Seconds of one decode query's attention over one layer for `option`, from a bench_kernel CSV (heads: the
    nearest measured; context: linear between the measured ones, proportional beyond them); None when the CSV has
    no row of that format."""
    import numpy as np
    import pandas as pd

    df = pd.read_csv(csv_path)
    missing = sorted({"format", "heads", "batch", "context", "kernel_us"} - set(df.columns))
    if missing:
        raise ValueError(f"task.kernel_csv={csv_path}: not a bench_kernel CSV (no column {missing})")
    df = df[df["format"] == option]
    if "mode" in df.columns and (df["mode"] == "throughput").any():
        df = df[df["mode"] == "throughput"]
    if df.empty:
        return None
    table = {h: g.groupby("context").apply(lambda x: float((x["kernel_us"] / x["batch"]).min()), include_groups=False)
             for h, g in df.groupby("heads")}

    def seconds(heads: int, context: int) -> float:
        h = min(table, key=lambda k: abs(math.log(k) - math.log(heads)))
        per = table[h]
        xs, ys = per.index.to_numpy(float), per.to_numpy(float)
        if context > xs[-1]:
            return ys[-1] * context / xs[-1] * heads / h * 1e-6
        return float(np.interp(context, xs, ys)) * heads / h * 1e-6

    return seconds
