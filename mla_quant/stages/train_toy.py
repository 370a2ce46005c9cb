"""Stage: train the embedded toy MLA model on the synthetic task mix and (optionally) ship it into the package.

    python run.py experiment=train_toy logger=none                      # train; weights in <run_dir>/model/
    python run.py experiment=train_toy logger=none task.ship=true       # ... and copy them to mla_quant/toy/assets/
    python run.py experiment=train_toy task.resume=outputs/train_toy/<run>   # resume an interrupted run

Options live in `cfg.task` (conf/experiment/train_toy.yaml): the TrainOptions fields of mla_quant.toy.train,
`model_config` (overrides of mla_quant.toy.model.TOY_CONFIG), `resume`, `ship`. The run dir gets checkpoint.pt
every `checkpoint_every` steps, model/ (safetensors, config, tokenizer, TRAINING.json) and training.md.
"""

from __future__ import annotations

import platform
import shutil
from pathlib import Path

import torch
import transformers
from omegaconf import DictConfig, OmegaConf

from mla_quant.stages import StageResult
from mla_quant.record import write_text_atomic
from mla_quant.toy.model import ASSETS, new_toy_model, save_toy_checkpoint, toy_config
from mla_quant.toy.tokenizer import build_tokenizer
from mla_quant.toy.train import TrainOptions, train

SHIPPED_FILES = ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "TRAINING.json")


def train_options(task: DictConfig, seed: int) -> TrainOptions:
    plain = OmegaConf.to_container(task, resolve=True)
    known = TrainOptions.__dataclass_fields__
    return TrainOptions(**{k: v for k, v in plain.items() if k in known}, seed=seed)


def ship(folder: Path, assets: Path = ASSETS) -> Path:
    """Copy a trained model folder's files into the package assets."""
    assets.mkdir(parents=True, exist_ok=True)
    for name in SHIPPED_FILES:
        shutil.copyfile(folder / name, assets / name)
        (assets / name).chmod(0o644)  # the atomic writers create 0600 temp files; shipped files are world-readable
    return assets


def run(cfg: DictConfig, run_dir: Path) -> StageResult:
    task = cfg.task
    opts = train_options(task, cfg.seed)
    torch.set_num_threads(opts.threads)
    tok = build_tokenizer()
    config = toy_config({"vocab_size": len(tok), **OmegaConf.to_container(task.model_config, resolve=True)})
    model = new_toy_model(config, seed=cfg.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[train_toy] {n_params / 1e6:.2f}M parameters, {opts.steps} steps, curriculum {opts.curriculum}")

    summary = train(model, tok, opts, run_dir, resume=task.resume, progress=task.progress)
    final = summary["final_heldout"]
    record = {
        "recipe": "python run.py experiment=train_toy logger=none task.ship=true",
        "seed": cfg.seed,
        "steps": summary["steps"],
        "train_seconds": round(summary["train_seconds"], 1),
        "parameters": n_params,
        "final_loss": summary["final_loss"],
        "final_heldout_teacher_forced": final,
        "options": OmegaConf.to_container(task, resolve=True),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu": platform.processor() or platform.machine(),
        "threads": opts.threads,
        "resumed_from": task.resume,
        "history": summary["history"],
    }
    folder = save_toy_checkpoint(model, run_dir / "model", record)
    shipped = ship(folder) if task.ship else None

    lines = ["| step | seconds | loss | " + " | ".join(k for k in final if k not in ("step", "seconds", "loss")) + " |"]
    lines.append("|" + "---|" * (len(final)) )
    for h in summary["history"]:
        lines.append("| " + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in h.values()) + " |")
    write_text_atomic(run_dir / "training.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    if shipped:
        print(f"[train_toy] shipped to {shipped}")

    metrics = {"train/steps": summary["steps"], "train/seconds": summary["train_seconds"],
               "train/final_loss": summary["final_loss"], "train/parameters": n_params}
    metrics.update({f"train/heldout/{k}": v for k, v in final.items() if k not in ("step", "seconds", "loss")})
    return StageResult(metrics=metrics)
