"""Kernel benchmark: the Triton decode kernel over each cache format, against the BF16 kernel and the PyTorch read
path, at DeepSeek-V2-Lite's attention dims (d_c 512, d_r 64, 16 heads) unless configured otherwise.

    python run.py experiment=bench_kernel                                        # on a CUDA GPU
    TRITON_INTERPRET=1 python run.py experiment=bench_kernel task.contexts=[256] task.iters=1   # CPU smoke run

For each context and format: fill one layer's cache with random latents (the quantized ones through the real
encoder), then time `latent_decode` (one query token per sequence, all heads) and the PyTorch reference
(dequantize everything, then attend). Reports microseconds per call, the bytes the kernel reads (the stored
tensors, measured) and the bandwidth that implies, and speed-ups vs the BF16 kernel and vs the PyTorch path.
Under the CPU interpreter the times measure the interpreter, not the kernel: only the GPU figures mean anything.
"""

from __future__ import annotations

import time
from pathlib import Path

import pandas as pd
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from mla_quant.cache.bytes import load_quant_option
from mla_quant.cache.factory import cache_layer_factory
from mla_quant.cache.triton import kernel_segments
from mla_quant.kernels.latent_decode import latent_decode, latent_decode_reference, require_triton
from mla_quant.models.build import resolve_device
from mla_quant.record import write_text_atomic
from mla_quant.stages import StageResult


def _timed(fn, device: str, iters: int, warmup: int) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def run(cfg: DictConfig, run_dir: Path) -> StageResult:
    task = cfg.task
    require_triton("experiment=bench_kernel")
    device = resolve_device(cfg.device)
    dtype = getattr(torch, task.dtype)
    g = torch.Generator().manual_seed(cfg.seed)
    rows, metrics = [], {}
    jobs = [(ctx, option) for ctx in task.contexts for option in task.formats]
    for ctx, option in tqdm(jobs, desc="bench_kernel", unit="case"):
        quant = OmegaConf.merge(load_quant_option(option), {"backend": "triton"}, task.quant_overrides or {})
        layer = cache_layer_factory(quant, task.d_c, task.d_r, context=max(ctx + 1, 4096))()
        c = torch.randn(task.batch_size, ctx, task.d_c, generator=g).to(device, dtype)
        r = torch.randn(task.batch_size, ctx, task.d_r, generator=g).to(device, dtype)
        layer.append(c, r)
        q = torch.randn(task.batch_size, task.heads, task.d_c, generator=g).to(device, dtype)
        qr = torch.randn(task.batch_size, task.heads, task.d_r, generator=g).to(device, dtype)
        scale = (task.d_c + task.d_r) ** -0.5
        segments = kernel_segments(layer)
        kernel_s = _timed(lambda: latent_decode(q, qr, scale, segments), device, task.iters, task.warmup)
        torch_s = _timed(lambda: latent_decode_reference(q, qr, scale, segments), device, task.iters, task.warmup)
        err = (latent_decode(q, qr, scale, segments) - latent_decode_reference(q, qr, scale, segments)).abs().max().item()
        nbytes = layer.nbytes()
        rows.append({"context": ctx, "format": option, "kernel_us": kernel_s * 1e6, "torch_us": torch_s * 1e6,
                     "bytes": nbytes, "kernel_GBps": nbytes / kernel_s / 1e9, "max_abs_err": err})
    df = pd.DataFrame(rows)
    bf16 = df[df.format == "bf16"].set_index("context")["kernel_us"] if "bf16" in set(df.format) else None
    df["speedup_vs_torch"] = df.torch_us / df.kernel_us
    if bf16 is not None:
        df["speedup_vs_bf16_kernel"] = df.context.map(bf16) / df.kernel_us
    for row in df.to_dict("records"):
        for key in ("kernel_us", "torch_us", "kernel_GBps", "speedup_vs_torch", "speedup_vs_bf16_kernel",
                    "max_abs_err", "bytes"):
            if key in row:
                metrics[f"bench_kernel/{row['format']}/ctx{row['context']}/{key}"] = float(row[key])
    df.to_csv(run_dir / "bench_kernel.csv", index=False)
    table = df.to_markdown(index=False, floatfmt=".4g")
    note = "" if device.startswith("cuda") else "\n(CPU interpreter: times are not kernel figures)\n"
    write_text_atomic(run_dir / "bench_kernel.md", f"# Triton decode kernel, {device}, {task.dtype}\n\n{table}\n{note}")
    print(table + note)
    return StageResult(metrics=metrics)
