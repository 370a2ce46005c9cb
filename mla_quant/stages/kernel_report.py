"""Kernel report: every Triton kernel specialization the product launches, compiled ahead of time for real GPU
targets on any machine (no GPU needed), with each one's registers, stack frame (where spills land), shared memory
and occupancy.

    python run.py experiment=kernel_report                                   # sm_80 and sm_90, every format
    python run.py experiment=kernel_report 'task.archs=[90]' 'task.formats=[int4_joint]'

For each target (task.archs), cache format (task.formats, at task.d_c / task.d_r), activation dtype (task.dtypes) and
launch configuration (the kernel's defaults for each of task.heads, plus task.launches) one decode call is made on CPU
tensors inside `kernels.aot.ahead_of_time`: stage 1 and the merge compile for the target and nothing launches; the
store kernel compiles for every int path a format writes through it. Head counts that give the same tile sizes share
one compiled kernel (listed once, with the head counts it serves). A specialization that fails to compile is a row
with its error, and the stage fails after writing the table. kernel_report.md / .csv in the run dir.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from mla_quant.cache.bytes import load_quant_option
from mla_quant.cache.factory import layer_factory
from mla_quant.calibration.codebooks import fitted_on
from mla_quant.kernels.layout import FLOAT_DTYPES
from mla_quant.quant.formats import cache_format
from mla_quant.quant.peers import refuse_peer
from mla_quant.record import write_text_atomic
from mla_quant.stages import StageResult

DTYPES = {str(d).removeprefix("torch."): d for d in FLOAT_DTYPES}  # the activation dtypes the kernel reads


def check(cfg: DictConfig) -> None:
    from mla_quant.kernels.aot import ARCHS

    task = cfg.task
    for arch in task.archs:
        if arch not in ARCHS:
            raise ValueError(f"task.archs: {arch!r}; allowed: {sorted(ARCHS)}")
    for name in task.dtypes:
        if name not in DTYPES:
            raise ValueError(f"task.dtypes: {name!r}; allowed: {list(DTYPES)}")
    for option in task.formats:
        refuse_peer(load_quant_option(option), "experiment=kernel_report (the Triton kernels)")
        why = cache_format(_quant(option, task), task.d_c, task.d_r, context=4096).kernel_unsupported()
        if why is not None:
            raise ValueError(f"task.formats: {option} ({why}) is not read by the Triton decode kernel, so nothing of "
                             f"it compiles; allowed: the options the kernel reads (`quant.backend=triton`)")
    allowed = {"block_h", "block_n", "num_warps"}
    for launch in task.launches or []:
        extra = set(launch) - allowed
        if extra:
            raise ValueError(f"task.launches: {sorted(extra)}; allowed keys: {sorted(allowed)}")


def _quant(option: str, task) -> DictConfig:
    return OmegaConf.merge(load_quant_option(option), {"backend": "torch"}, task.quant_overrides or {})


def _layer(option: str, task, g: torch.Generator):
    """A layer of `option` on the CPU holding task.tokens random latents (the paged store, the sinks and the recent
    window filled), stored by the PyTorch encoder: the segments a decode step hands the kernel."""
    quant = _quant(option, task)
    tokens = max(task.tokens, 160)
    content = torch.randn(1, tokens, task.d_c, generator=g)
    rope = torch.randn(1, tokens, task.d_r, generator=g)
    fmt = fitted_on(cache_format(quant, task.d_c, task.d_r, context=4096), content, rope)
    layer = layer_factory(fmt)()
    layer.append(content, rope)
    return layer


def _store_calls(layer, task, g: torch.Generator) -> int:
    """Store-kernel compilations for the layer's int paths (written into a scratch store), counted."""
    from mla_quant.cache.kernel import store_quantized, store_unsupported
    from mla_quant.cache.paged import PagedStore

    n = 0
    for path, d in (("content", task.d_c), ("rope", task.d_r)):
        fmt = layer.path_format(path)
        if not fmt.quantized or store_unsupported(fmt, d) is not None:
            continue
        store = PagedStore(1, 16, "cpu")
        rows = torch.zeros(4, dtype=torch.long)
        store_quantized(store, rows, store.reserve(rows), store.block_table(), path, fmt, d,
                        torch.randn(4, d, generator=g))
        n += 1
    return n


def run(cfg: DictConfig, run_dir: Path) -> StageResult:
    from mla_quant.kernels import aot
    from mla_quant.kernels.decode_plan import launch_config
    from mla_quant.kernels.latent_decode import latent_decode

    check(cfg)
    task = cfg.task
    g = torch.Generator().manual_seed(cfg.seed)
    scale = (task.d_c + task.d_r) ** -0.5
    rows, failures = [], []
    launches = [{}] + [{k: v for k, v in dict(c).items() if v is not None} for c in (task.launches or [])]
    cases = [(arch, option) for arch in task.archs for option in task.formats]
    for arch, option in tqdm(cases, desc="kernel_report", unit="format"):
        layer = _layer(option, task, g)
        segments = layer.segments()
        seen: dict[tuple, list[dict]] = {}  # (dtype, tiles) -> the rows of that specialization
        for dtype_name in task.dtypes:
            dtype = DTYPES[dtype_name]
            for launch in launches:
                for heads in task.heads:
                    tiles = launch_config(heads, task.d_c, **launch)
                    key = (dtype_name, tuple(sorted(tiles.items())))
                    if key in seen:
                        for r in seen[key]:
                            r["heads"] += f",{heads}"
                        continue
                    before = {id(k) for _, k in aot.compiled(arch)}
                    row = {"arch": f"sm_{arch}", "format": option, "dtype": dtype_name, "heads": str(heads),
                           **tiles}
                    try:
                        with aot.ahead_of_time(arch):
                            latent_decode(torch.randn(1, heads, task.d_c, generator=g).to(dtype),
                                          torch.randn(1, heads, task.d_r, generator=g).to(dtype), scale, segments,
                                          **launch)
                    except Exception as err:  # noqa: BLE001 - the failure is the report's row
                        failures.append(f"sm_{arch} {option} {dtype_name} {tiles}: {type(err).__name__}: {err}")
                        rows.append({**row, "kernel": "decode_stage1", "error": f"{type(err).__name__}"})
                        seen[key] = [rows[-1]]
                        continue
                    new = [{**row, "kernel": name, **aot.kernel_row(kernel, arch)}
                           for name, kernel in aot.compiled(arch) if id(kernel) not in before]
                    rows += new  # none: compiled before for another configuration with the same tiles
                    seen[key] = new
        with aot.ahead_of_time(arch):
            before = {id(k) for _, k in aot.compiled(arch)}
            try:
                _store_calls(layer, task, g)
            except Exception as err:  # noqa: BLE001
                failures.append(f"sm_{arch} {option} store: {type(err).__name__}: {err}")
            for kernel_name, kernel in [(n, k) for n, k in aot.compiled(arch) if id(k) not in before]:
                rows.append({"arch": f"sm_{arch}", "format": option, "dtype": "float32 (stored latents)", "heads": "",
                             "kernel": kernel_name, **aot.kernel_row(kernel, arch)})
    df = pd.DataFrame(rows)
    return _report(df, failures, run_dir)


def _report(df: pd.DataFrame, failures: list[str], run_dir: Path) -> StageResult:
    import triton

    metrics = {"kernel_report/compiled": int(df["regs"].notna().sum()) if "regs" in df else 0,
               "kernel_report/failed": len(failures), "kernel_report/triton": triton.__version__}
    if "regs" in df:
        for (arch, kernel), part in df.dropna(subset=["regs"]).groupby(["arch", "kernel"]):
            metrics[f"kernel_report/{arch}/{kernel}/max_regs"] = int(part["regs"].max())
            metrics[f"kernel_report/{arch}/{kernel}/max_stack_B"] = int(part["stack_B"].max())
            metrics[f"kernel_report/{arch}/{kernel}/with_stack"] = int((part["stack_B"] > 0).sum())
            metrics[f"kernel_report/{arch}/{kernel}/min_blocks_per_sm"] = int(part["blocks_per_sm"].min())
            metrics[f"kernel_report/{arch}/{kernel}/shared_over_limit"] = int((~part["shared_ok"].astype(bool)).sum())
    df.to_csv(run_dir / "kernel_report.csv", index=False)
    table = df.to_markdown(index=False)
    note = "".join(f"\nfailed: {f}" for f in failures)
    write_text_atomic(run_dir / "kernel_report.md", f"# Triton {triton.__version__} kernels compiled ahead of time"
                      "\n\nstack_B: the "
                      "stack frame per thread (register spills land there); blocks_per_sm: by registers and shared "
                      "memory; mma_ops: tensor-core instructions in the PTX (0: the products on FMA units)"
                      f"\n\n{table}\n{note}\n")
    print(table + note)
    return StageResult(metrics=metrics, ok=not failures,
                       message=f"{len(failures)} specialization(s) failed to compile" if failures else "")
