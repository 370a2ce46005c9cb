"""What the decode kernels really use on this GPU, and whether a decode call can be captured in a CUDA graph.

    PYTHONPATH=. python benchmarks/kernel_facts.py [OUT_DIR]      # step of benchmarks/gpu_check.sh

1. The copy bandwidth of this GPU (a device-to-device copy of 2 GiB, bytes read + written): the ceiling the kernel's
   GB/s are read against.
2. Per cache format (bf16, int4_joint, int2_content_int4_rope) at DeepSeek's dims (d_c 512, d_r 64), 16 and 128 heads,
   one sequence of FACTS_TOKENS tokens: the host reads one `latent_decode` call makes (device values read on the host;
   each one is a stream sync), then the call captured in a CUDA graph, replayed, checked equal to the eager call, and
   timed both ways (microseconds per call, CUDA events, median of 50).
3. Every compiled Triton kernel that was loaded (decode stage 1, merge, quantized store): registers per thread,
   spilled bytes, shared memory, warps: the figures an ahead-of-time report is held to. Written to
   OUT_DIR/kernel_facts.csv beside the printed tables.
4. The same decode calls compiled ahead of time for sm_90 (`mla_quant.kernels.aot`, no launch) with the resources
   cuobjdump reads from their cubins, to set beside part 3 (OUT_DIR/kernel_facts_aot.csv).
On the CPU (TRITON_INTERPRET=1) it runs parts 2 and 3 only as far as the interpreter allows: host reads, no graph.
"""

import os
import statistics
import sys
from pathlib import Path

import pandas as pd
import torch
from omegaconf import OmegaConf

from mla_quant.audit import HostReads
from mla_quant.cache.bytes import load_quant_option
from mla_quant.cache.factory import cache_layer_factory
from mla_quant.kernels import latent_decode as kernel_module
from mla_quant.kernels import quant_store
from mla_quant.kernels.latent_decode import latent_decode

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
TOKENS = int(os.environ.get("FACTS_TOKENS", "32768" if CUDA else "300"))
D_C, D_R = (512, 64) if CUDA else (128, 64)
OUT = Path(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "outputs/kernel_facts"))


def timed_us(fn, iters: int = 50) -> float:
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def copy_bandwidth() -> float:
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    us = timed_us(lambda: dst.copy_(src), iters=20)
    return 2 * src.numel() / (us * 1e-6)


def decode_cases() -> list[dict]:
    rows = []
    for option in ("bf16", "int4_joint", "int2_content_int4_rope"):
        quant = OmegaConf.merge(load_quant_option(option),
                                {"backend": "triton", "protected": {"n_sink": 4, "recent": 128}})
        layer = cache_layer_factory(quant, D_C, D_R)()
        g = torch.Generator(device=DEVICE).manual_seed(0)
        layer.append(torch.randn(1, TOKENS, D_C, device=DEVICE, generator=g).bfloat16(),
                     torch.randn(1, TOKENS, D_R, device=DEVICE, generator=g).bfloat16())
        segments = layer.segments()
        for heads in (16, 128):
            q = torch.randn(1, heads, D_C, device=DEVICE, generator=g).bfloat16()
            qr = torch.randn(1, heads, D_R, device=DEVICE, generator=g).bfloat16()
            scale = (D_C + D_R) ** -0.5
            eager = latent_decode(q, qr, scale, segments)
            with HostReads() as counter:
                latent_decode(q, qr, scale, segments)
            row = {"format": option, "heads": heads, "tokens": TOKENS, "host_reads": counter.count,
                   "host_read_sites": ",".join(sorted(site for _, site in counter.sites))}
            if CUDA:
                try:
                    stream = torch.cuda.Stream()
                    stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(stream):
                        for _ in range(2):
                            latent_decode(q, qr, scale, segments)
                    torch.cuda.current_stream().wait_stream(stream)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        captured = latent_decode(q, qr, scale, segments)
                    graph.replay()
                    torch.cuda.synchronize()
                    row["graph_equal"] = bool(torch.equal(captured, eager))
                    row["eager_us"] = round(timed_us(lambda: latent_decode(q, qr, scale, segments)), 2)
                    row["graph_us"] = round(timed_us(graph.replay), 2)
                    row["eager/graph"] = round(row["eager_us"] / row["graph_us"], 3)
                except Exception as exc:  # noqa: BLE001 - the failure is the figure
                    row["graph_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            rows.append(row)
            print(row, flush=True)
    return rows


def ahead_of_time_kernels() -> list[dict]:
    from mla_quant.kernels.aot import ahead_of_time, compiled_kernels

    for option in ("bf16", "int4_joint", "int2_content_int4_rope"):
        quant = OmegaConf.merge(load_quant_option(option),
                                {"backend": "torch", "protected": {"n_sink": 4, "recent": 128}})
        layer = cache_layer_factory(quant, D_C, D_R)()
        layer.append(torch.randn(1, 300, D_C).bfloat16(), torch.randn(1, 300, D_R).bfloat16())
        with ahead_of_time(90):
            latent_decode(torch.randn(1, 16, D_C).bfloat16(), torch.randn(1, 16, D_R).bfloat16(), 0.1,
                          layer.segments(), dot="bf16")
    return compiled_kernels(90)


def loaded_kernels() -> list[dict]:
    """Every compiled kernel in the Triton JIT caches of the decode and store kernels."""
    rows = []
    jits = {"stage1": kernel_module._stage1_kernel, "merge": kernel_module._merge_kernel,
            "store": quant_store._quantize_append_kernel}
    for name, fn in jits.items():
        for caches in getattr(fn, "device_caches", {}).values():
            cache = caches[0] if isinstance(caches, tuple) else caches
            for compiled in cache.values():
                meta = compiled.metadata
                rows.append({"kernel": name, "regs": getattr(compiled, "n_regs", None),
                             "spills": getattr(compiled, "n_spills", None), "shared_B": getattr(meta, "shared", None),
                             "warps": getattr(meta, "num_warps", None), "stages": getattr(meta, "num_stages", None),
                             "target": str(getattr(meta, "target", ""))})
    return rows


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    if CUDA:
        print(f"device-to-device copy: {copy_bandwidth() / 1e12:.2f} TB/s (read + write)", flush=True)
    cases = pd.DataFrame(decode_cases())
    print(cases.to_markdown(index=False))
    kernels = pd.DataFrame(loaded_kernels())
    if len(kernels):
        kernels = kernels.drop_duplicates()
        print(kernels.to_markdown(index=False))
    cases.to_csv(OUT / "kernel_facts_decode.csv", index=False)
    kernels.to_csv(OUT / "kernel_facts.csv", index=False)
    if CUDA:
        aot = pd.DataFrame(ahead_of_time_kernels())
        print(aot.to_markdown(index=False))
        aot.to_csv(OUT / "kernel_facts_aot.csv", index=False)


if __name__ == "__main__":
    main()
