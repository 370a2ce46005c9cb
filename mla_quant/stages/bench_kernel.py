"""Kernel benchmark: the Triton decode kernel over each cache format, against our BF16 kernel and the PyTorch read
path, at DeepSeek's attention dims (d_c 512, d_r 64) with 16 heads (V2-Lite) and 128 heads (V3).

    python run.py experiment=bench_kernel                                        # on a CUDA GPU
    TRITON_INTERPRET=1 python run.py experiment=bench_kernel 'task.contexts=[256]' task.iters=1 ...   # CPU smoke

Per context and mode: "throughput" fills batch = task.throughput_tokens // context sequences (batch x context >= 1M
tokens by default), "latency" task.latency_batch sequences. Each format's cache layer is filled with random latents
(the quantized ones through the real encoder, with the configured protected region; stored as the cache stores them,
one page per block and path: codes | scales | zeros, docs/kernel.md "Page layout"), then per head count the
kernel is timed as the GPU runs it: one CUDA graph of the call, replayed after a 256 MB L2 flush, CUDA events around
the replay, the median of task.iters (on the CPU interpreter: wall time, meaningless). Reported per case:
microseconds, the bytes one call reads measured from the stored tensors (`bytes_read`: every valid token's codes,
scales, zeros or values, the block table, the queries), the bandwidth that implies and its share of
task.peak_bandwidth, the speed-up vs our BF16 kernel on the same case, vs the PyTorch decode path (what
quant.backend=torch runs: `segment_attention` over the same segments, a bounded chunk dequantized at a time;
task.torch_reference), and vs FlashInfer's MLA paged decode over the same BF16 pools (task.flashinfer:
`flashinfer.mla.BatchMLAPagedAttentionWrapper`, the external BF16 peer; where it cannot run, the record and the
table say why, e.g. not installed). With task.tune, launch configurations are tried per head count and format on
the first case, and the fastest is used throughout. bench_kernel.csv / .md / .png in the run dir.
"""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path

import pandas as pd
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from mla_quant.cache.bytes import load_quant_option
from mla_quant.cache.factory import layer_factory
from mla_quant.calibration.codebooks import fitted_on
from mla_quant.kernels.attention import DEFAULT_BLOCKS
from mla_quant.kernels.decode_plan import launch_config
from mla_quant.kernels.latent_decode import latent_decode, require_triton
from mla_quant.kernels.torch_decode import bytes_read, latent_decode_reference, segment_attention
from mla_quant.models.build import resolve_device
from mla_quant.quant.formats import BASELINE, cache_format
from mla_quant.quant.peers import refuse_peer
from mla_quant.record import write_text_atomic
from mla_quant.stages import StageResult

FLUSH_BYTES = 256 << 20  # more than any GPU's L2


def _cuda_time(fn, iters: int, warmup: int, graph: bool = True) -> float:
    """Median seconds of `fn` on the GPU, cold L2, launch overhead excluded where a CUDA graph can hold `fn`."""
    for _ in range(max(1, warmup)):
        fn()
    torch.cuda.synchronize()
    run = fn
    if graph:
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fn()
            torch.cuda.current_stream().wait_stream(stream)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            run = g.replay
        except RuntimeError as e:  # something in fn cannot be captured: time the plain calls
            print(f"(no CUDA graph: {e}; timing plain calls)")
            torch.cuda.synchronize()
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        flush.zero_()
        start.record()
        run()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events) / 1e3


def _cpu_time(fn, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def timer(device: str, iters: int, warmup: int):
    if device.startswith("cuda"):
        return lambda fn, graph=True: _cuda_time(fn, iters, warmup, graph)
    return lambda fn, graph=True: _cpu_time(fn, iters, warmup)


def filled_layer(option: str, task, context: int, batch: int, device: str, dtype: torch.dtype, g: torch.Generator):
    """One cache layer of quant option `option` holding `batch` sequences of `context` random latents."""
    refuse_peer(load_quant_option(option), "experiment=bench_kernel (the Triton kernel)")
    quant = OmegaConf.merge(load_quant_option(option), {"backend": "triton"}, task.quant_overrides or {})
    if quant.get("layers") is not None:
        raise ValueError(f"task.quant_overrides.layers: experiment=bench_kernel times one cache layer of one format; "
                         f"allowed: the path settings of quant={option} (no per-layer formats)")
    content = torch.randn(batch, context, task.d_c, generator=g, device=device, dtype=dtype)
    rope = torch.randn(batch, context, task.d_r, generator=g, device=device, dtype=dtype)
    # a lloyd path's codebook fitted on the benchmark's own latents
    layer = layer_factory(fitted_on(cache_format(quant, task.d_c, task.d_r, context=max(context + 1, 4096)),
                                    content, rope))()
    layer.append(content, rope)
    return layer


def flashinfer_peer(layer, q, qr, scale: float):
    """FlashInfer's MLA decode (`flashinfer.mla.BatchMLAPagedAttentionWrapper`, the external BF16 peer) over the
    same paged BF16 pools as our kernel's bf16 case (a bf16 path's page holds its values only, so its view is a
    contiguous (num_blocks, block_size, d) pool): (a zero-argument call, None), or (None, why it cannot run)."""
    if not q.is_cuda:
        return None, "needs a CUDA GPU"
    try:
        import flashinfer
    except ImportError as err:
        return None, f"not installed ({err}; pip install flashinfer-python)"
    store = layer.store
    b, h, d_c = q.shape
    pages = -(-store.lengths // store.block_size)  # (B,) pages per sequence
    table = store.block_table()
    kv_indices = torch.cat([table[i, : int(n)] for i, n in enumerate(pages.tolist())])
    kv_indptr = torch.cat([pages.new_zeros(1), pages.cumsum(0)]).to(torch.int32)
    wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(torch.empty(128 << 20, dtype=torch.int8, device=q.device))
    wrapper.plan(torch.arange(b + 1, dtype=torch.int32, device=q.device), kv_indptr.to(q.device), kv_indices,
                 store.lengths.to(torch.int32), h, d_c, qr.shape[-1], store.block_size, False, scale, q.dtype,
                 store.pool["content/values"].dtype)
    ckv, kpe = store.pool["content/values"], store.pool["rope/values"]
    return (lambda: wrapper.run(q, qr, ckv, kpe)), None


def _cases(task) -> list[tuple[str, int, int]]:
    """(mode, context, batch) in order: throughput cases first (the first one tunes)."""
    out = []
    for mode in task.modes:
        if mode not in ("throughput", "latency"):
            raise ValueError(f"task.modes: {mode!r}; allowed: throughput, latency")
        for ctx in task.contexts:
            batch = max(1, task.throughput_tokens // ctx) if mode == "throughput" else task.latency_batch
            out.append((mode, ctx, batch))
    return out


def run(cfg: DictConfig, run_dir: Path) -> StageResult:
    task = cfg.task
    require_triton("experiment=bench_kernel")
    device = resolve_device(cfg.device)
    dtype = getattr(torch, task.dtype)
    g = torch.Generator(device=device).manual_seed(cfg.seed)
    time_it = timer(device, task.iters, task.warmup)
    time_torch = timer(device, max(1, task.iters // 4), 1)
    fixed = {k: v for k, v in OmegaConf.to_container(task.launch or {}).items() if v is not None}
    tuned: dict[tuple[int, str], dict] = {}
    scale = (task.d_c + task.d_r) ** -0.5
    torch_keys = DEFAULT_BLOCKS.keys_per_block(1)  # the torch backend's decode step reads this many tokens at a time
    rows, skipped = [], {}
    cases = _cases(task)
    for mode, ctx, batch in tqdm(cases, desc="bench_kernel", unit="case"):
        layers = {option: filled_layer(option, task, ctx, batch, device, dtype, g) for option in task.formats}
        for heads in task.heads:
            q = torch.randn(batch, heads, task.d_c, generator=g, device=device, dtype=dtype)
            qr = torch.randn(batch, heads, task.d_r, generator=g, device=device, dtype=dtype)
            segs = {option: layer.segments() for option, layer in layers.items()}
            for option, segments in segs.items():
                if (heads, option) not in tuned:
                    tuned[heads, option] = _tune(task, fixed, option, q, qr, scale, segments, time_it)
                launch = tuned[heads, option]
                kernel_s = time_it(lambda: latent_decode(q, qr, scale, segments, **launch))
                out = latent_decode(q, qr, scale, segments, **launch)
                row = dict(mode=mode, heads=heads, batch=batch, context=ctx, format=option, kernel_us=kernel_s * 1e6,
                           bytes_read=bytes_read(q, qr, segments), cache_bytes=layers[option].nbytes())
                row["GBps"] = row["bytes_read"] / kernel_s / 1e9
                row["peak_share"] = row["bytes_read"] / kernel_s / task.peak_bandwidth
                if task.torch_reference and batch * ctx <= task.torch_max_tokens:
                    row["torch_us"] = time_torch(lambda: segment_attention(q, qr, scale, segments, torch_keys),
                                                 graph=False) * 1e6
                ref = latent_decode_reference(q, qr, scale, segments)
                row["max_rel_err"] = ((out - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()
                if option == BASELINE and task.flashinfer:
                    peer, why = flashinfer_peer(layers[option], q, qr, scale)
                    if peer is None:
                        skipped["flashinfer"] = why
                    else:
                        row["flashinfer_us"] = time_it(peer) * 1e6
                        peer_ref = peer().float()
                        row["flashinfer_max_rel_err"] = ((peer_ref - ref).abs().max()
                                                         / ref.abs().max().clamp(min=1e-30)).item()
                rows.append({**row, **launch_config(heads, task.d_c, **launch)})
            del q, qr, segs
        del layers
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    df = _with_speedups(pd.DataFrame(rows))
    return _report(df, task, device, run_dir, skipped)


def _tune(task, fixed: dict, option: str, q, qr, scale, segments, time_it) -> dict:
    """The fastest of task.tune's launch configurations (each completed by task.launch) on this case."""
    candidates = [{**fixed, **{k: v for k, v in dict(c).items() if v is not None}} for c in (task.tune or [])]
    if len(candidates) < 2:
        return fixed
    times = []
    for launch in candidates:
        times.append(time_it(lambda: latent_decode(q, qr, scale, segments, **launch)))
        print(f"tune {option}, {q.shape[1]} heads, batch {q.shape[0]}: "
              f"{launch_config(q.shape[1], task.d_c, **launch)} {times[-1] * 1e6:.1f} us")
    return candidates[min(range(len(times)), key=times.__getitem__)]


def _with_speedups(df: pd.DataFrame) -> pd.DataFrame:
    keys = ["mode", "heads", "context"]
    if BASELINE in set(df.format):
        bf16 = df[df.format == BASELINE].set_index(keys)["kernel_us"]
        df["speedup_vs_bf16_kernel"] = [bf16.get(tuple(r), math.nan) for r in df[keys].itertuples(index=False)]
        df["speedup_vs_bf16_kernel"] = df["speedup_vs_bf16_kernel"] / df.kernel_us
    if "torch_us" in df:
        df["speedup_vs_torch"] = df.torch_us / df.kernel_us
    if "flashinfer_us" in df:  # every format of a case against FlashInfer's BF16 decode of that case
        peer = df[df.format == BASELINE].set_index(keys)["flashinfer_us"]
        df["speedup_vs_flashinfer"] = [peer.get(tuple(r), math.nan) for r in df[keys].itertuples(index=False)]
        df["speedup_vs_flashinfer"] = df["speedup_vs_flashinfer"] / df.kernel_us
    return df


def _report(df: pd.DataFrame, task, device: str, run_dir: Path, skipped: dict | None = None) -> StageResult:
    metrics = {f"bench_kernel/{peer}": f"not run: {why}" for peer, why in (skipped or {}).items()}
    for row in df.to_dict("records"):
        name = f"bench_kernel/{row['mode']}/h{row['heads']}/ctx{row['context']}/{row['format']}"
        for key in ("kernel_us", "bytes_read", "GBps", "peak_share", "speedup_vs_bf16_kernel", "torch_us",
                    "speedup_vs_torch", "max_rel_err", "flashinfer_us", "speedup_vs_flashinfer",
                    "flashinfer_max_rel_err"):
            if key in row and not pd.isna(row[key]):
                metrics[f"{name}/{key}"] = float(row[key])
    df.to_csv(run_dir / "bench_kernel.csv", index=False)
    table = df.to_markdown(index=False, floatfmt=".4g")
    note = "" if device.startswith("cuda") else "\n(CPU interpreter: times are not kernel figures)\n"
    note += "".join(f"\n{peer}: not run: {why}\n" for peer, why in (skipped or {}).items())
    write_text_atomic(run_dir / "bench_kernel.md", f"# Triton decode kernel, {device}, {task.dtype}, peak "
                                                   f"{task.peak_bandwidth:.3g} B/s\n\n{table}\n{note}")
    _plot(df, task, run_dir / "bench_kernel.png")
    print(table + note)
    return StageResult(metrics=metrics)


def _plot(df: pd.DataFrame, task, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(dict.fromkeys(df["mode"]))
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4.5), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        part = df[df["mode"] == mode]
        for (fmt, heads), sub in part.groupby(["format", "heads"], sort=False):
            ax.plot(sub.context, sub.GBps, marker="o", label=f"{fmt}, {heads} heads")
        ax.axhline(task.peak_bandwidth / 1e9, color="gray", linestyle="--", label="peak")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens per sequence)")
        ax.set_ylabel("GB/s read")
        ax.set_title(f"{mode} (batch {', '.join(str(b) for b in dict.fromkeys(part.batch))})")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
