"""Calibration benchmark: decoder-layer forwards and seconds against the number of layers, for the one-sweep capture
and for one forward stopped at each block (the reference), side by side in one run.

    python run.py experiment=bench_calibration
    python run.py experiment=bench_calibration 'task.layers=[2,4,8,16,32]' transform=quantmla transform.fit.steps=10

For each layer count of `task.layers`: the model of `task.model` with that many decoder layers (random weights),
`task.samples` random sequences of `task.seq_len` tokens, and each capture mode: every block's capture alone (the
decoder-layer forwards counted by hooks, seconds), then the whole calibration of the run's `transform` and
`objective` (fit_all: capture + fitting; default smoothquant, closed form), each the fastest of `task.repeats`
measurements with the modes interleaved. Writes bench_calibration.csv and a figure of forwards and seconds against layers
(bench_calibration.png/.pdf).
"""

from __future__ import annotations

import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402
from omegaconf import DictConfig, OmegaConf, open_dict  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from mla_quant.calibration import fit_all  # noqa: E402
from mla_quant.calibration.capture import CAPTURES  # noqa: E402
from mla_quant.cache.bytes import load_quant_option  # noqa: E402
from mla_quant.checks import int_setting  # noqa: E402
from mla_quant.models.absorbed import attention_modules, decoder_layers  # noqa: E402
from mla_quant.models.families import text_config  # noqa: E402
from mla_quant.prepare import build_model  # noqa: E402
from mla_quant.quant.formats import cache_format  # noqa: E402
from mla_quant.record import write_text_atomic  # noqa: E402
from mla_quant.stages import StageResult  # noqa: E402


def run(cfg: DictConfig, run_dir: Path) -> StageResult:
    task = cfg.task
    modes = list(task.modes)
    unknown = sorted(set(modes) - set(CAPTURES))
    if unknown:
        raise ValueError(f"task.modes has {unknown}; allowed: {sorted(CAPTURES)}")
    layer_counts = sorted(int(n) for n in task.layers)
    if not layer_counts or layer_counts[0] < 1:
        raise ValueError(f"task.layers={list(task.layers)}: positive layer counts")
    transform, objective = cfg.transform, cfg.objective
    repeats = task.repeats
    int_setting(repeats, "task.repeats", allowed="a number of measurements per mode >= 1")
    rows, metrics = [], {}
    for n_layers in tqdm(layer_counts, desc="bench_calibration", unit="model"):
        model_cfg = task.model.copy()
        with open_dict(model_cfg):
            model_cfg.config.num_hidden_layers = n_layers
        model = build_model(model_cfg, absorbed=False, dtype="float32").eval()
        attn = attention_modules(model)[0]
        fmt = cache_format(load_quant_option(task.quant, groups=OmegaConf.to_container(task.model.quant_group_size)),
                           attn.kv_lora_rank, attn.qk_rope_head_dim)
        g = torch.Generator().manual_seed(int(cfg.seed))
        vocab = text_config(model.config).vocab_size
        ids = torch.randint(3, vocab, (int(task.samples), int(task.seq_len)), generator=g)
        batches = -(-int(task.samples) // int(task.batch_size))
        counts = [0]
        hooks = [layer.register_forward_hook(lambda *a: counts.__setitem__(0, counts[0] + 1))
                 for layer in decoder_layers(model)]
        warm = ids[: int(task.batch_size)]
        for mode in modes:  # warm-up (lazy initialisation, allocator) outside the measurements
            for _ in CAPTURES[mode](model, warm, int(task.batch_size)):
                pass
            fit_all(model, warm, transform, objective, fmt, int(cfg.seed), int(task.batch_size), capture=mode)
        try:
            best = {mode: {"capture_s": float("inf"), "calibration_s": float("inf")} for mode in modes}
            for _ in range(repeats):  # the modes interleaved, the fastest of each kept (the machine's noise is additive)
                for mode in modes:
                    counts[0] = 0
                    start = time.perf_counter()
                    for _ in CAPTURES[mode](model, ids, int(task.batch_size)):
                        pass
                    best[mode]["capture_s"] = min(best[mode]["capture_s"], time.perf_counter() - start)
                    forwards = counts[0] / batches  # decoder-layer forwards per batch of sequences
                    start = time.perf_counter()
                    fit_all(model, ids, transform, objective, fmt, int(cfg.seed), int(task.batch_size), capture=mode)
                    best[mode]["calibration_s"] = min(best[mode]["calibration_s"], time.perf_counter() - start)
                    best[mode]["layer_forwards"] = forwards
            for mode in modes:
                forwards, capture_s, calib_s = (best[mode][k] for k in ("layer_forwards", "capture_s", "calibration_s"))
                rows.append({"layers": n_layers, "mode": mode, "layer_forwards": forwards, "capture_s": capture_s,
                             "calibration_s": calib_s})
                for key, value in (("layer_forwards", forwards), ("capture_s", capture_s),
                                   ("calibration_s", calib_s)):
                    metrics[f"bench/calibration/layers{n_layers}/{mode}/{key}"] = value
        finally:
            for h in hooks:
                h.remove()
        if {"sweep", "stopped"} <= set(modes):
            mine = {r["mode"]: r for r in rows if r["layers"] == n_layers}
            for key in ("capture_s", "calibration_s"):
                metrics[f"bench/calibration/layers{n_layers}/{key}_ratio_sweep_vs_stopped"] = (
                    mine["sweep"][key] / mine["stopped"][key])
        del model

    table = pd.DataFrame(rows)
    write_text_atomic(run_dir / "bench_calibration.csv", table.to_csv(index=False))
    write_text_atomic(run_dir / "bench_calibration.md",
                      f"model {task.model.family}, transform {transform.name}, "
                      f"{task.samples} x {task.seq_len} tokens, batch {task.batch_size}\n\n"
                      f"{table.to_markdown(index=False, floatfmt='.3g')}\n")
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    for mode, part in table.groupby("mode"):
        for ax, key in zip(axes, ("layer_forwards", "capture_s", "calibration_s")):
            ax.plot(part["layers"], part[key], marker="o", label=mode)
    for ax, label in zip(axes, ("decoder-layer forwards per batch", "capture seconds", "calibration seconds")):
        ax.set_xlabel("decoder layers")
        ax.set_ylabel(label)
        ax.legend()
    fig.tight_layout()
    for ext in ("png", "pdf"):
        fig.savefig(run_dir / f"bench_calibration.{ext}")
    plt.close(fig)
    print(table.to_string(index=False, float_format=lambda x: f"{x:.3g}"))
    for key, value in metrics.items():
        if "ratio" in key:
            print(f"{key}: {value:.3g}")
    return StageResult(metrics=metrics, tables={"bench_calibration": table},
                       images={"bench_calibration": run_dir / "bench_calibration.png"})
