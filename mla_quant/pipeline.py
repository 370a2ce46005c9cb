"""The run: resolve the config, seed, run the experiment's stage, write record.json, mirror to the tracker.

`run.py` calls `main(cfg)`. The experiment (conf/experiment/*.yaml) names its stage in `task._target_`; a stage is

    def run(cfg: DictConfig, run_dir: Path) -> StageResult

and reads its own options from `cfg.task`. Stages write their artifacts (tables, figures) into `run_dir` with the
atomic writers of `mla_quant.record`, and return flat metrics. The record is written whatever happens: a failed or
interrupted run leaves a record with `status` "failed"/"interrupted" and keeps every file written before.
"""

from __future__ import annotations

import random
import time
import traceback
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import get_method, instantiate
from omegaconf import DictConfig, OmegaConf

from mla_quant.models.build import resolve_device
from mla_quant.record import write_record
from mla_quant.calibration import fitted_paths, needs_data
from mla_quant.stages import StageFailed, StageResult, refuse_overrides, refuse_unused_groups, user_overrides

__all__ = ["StageFailed", "StageResult", "main"]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # pragma: no cover
        pass


def device_description(device: str) -> str:
    if device.startswith("cuda"):
        return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    return "cpu"


def run_dir_of(cfg: DictConfig) -> Path:
    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    return Path(cfg.get("run_dir") or "outputs/adhoc")


def config_choices() -> dict[str, str]:
    """The option picked in each config group (model=tiny_kimi_k2, quant=int4_joint, ...), for analysis."""
    if not HydraConfig.initialized():
        return {}
    choices = HydraConfig.get().runtime.choices
    return {k: v for k, v in choices.items() if not k.startswith("hydra") and v is not None}


def refuse_idle_calibration(cfg: DictConfig) -> None:
    """objective.* without a fitted transform, calib.* without a transform that reads data: refused by name."""
    if "transform" not in (cfg.task.get("uses") or []) or cfg.task.name == "calibrate":
        return  # experiment=calibrate reports every transform's objectives on calibration data
    name = cfg.transform.get("name")
    idle_fit = []  # transform.fit.* keys this transform does not read
    if not fitted_paths(cfg.transform):
        refuse_overrides(["objective"], f"transform={name} fits nothing, so objective settings would do nothing")
        idle_fit += ["steps", "lr", "batch", "eval_every"]
    if not needs_data(cfg.transform):
        refuse_overrides(["calib"], f"transform={name} reads no calibration data, so calib settings would do nothing")
        idle_fit += ["alpha", "format"]
    bad = [o for o in user_overrides() if o.lstrip("+~").split("=", 1)[0] in {f"transform.fit.{k}" for k in idle_fit}]
    if bad:
        raise ValueError(f"{bad}: transform={name} does not read these transform.fit settings, so they would do "
                         f"nothing; drop them")


def main(cfg: DictConfig) -> StageResult:
    run_dir = run_dir_of(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    device = resolve_device(cfg.device)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    stage = get_method(cfg.task._target_)  # fails early, naming the target, if it does not exist
    refuse_unused_groups(cfg.task)  # an override of a group this experiment does not read is refused by name
    refuse_idle_calibration(cfg)
    seed_everything(cfg.seed)

    tracker = instantiate(cfg.logger)
    tracker.start(resolved, run_dir, name=f"{cfg.task.name}-{run_dir.name}")
    start = time.perf_counter()
    result, status, error = StageResult(), "failed", None
    try:
        result = stage(cfg, run_dir)
        status = "ok" if result.ok else "failed"
        error = None if result.ok else result.message
    except KeyboardInterrupt:
        status, error = "interrupted", "KeyboardInterrupt"
        raise
    except BaseException as exc:
        error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        raise
    finally:
        path = write_record(
            run_dir,
            config=resolved,
            metrics=result.metrics,
            seed=cfg.seed,
            seconds=time.perf_counter() - start,
            device=device_description(device),
            status=status,
            error=error,
            choices=config_choices(),
        )
        tracker.log_metrics(result.metrics)
        tracker.log_file(path)
        tracker.finish(status)
        print(f"[mla-quant] {cfg.task.name}: {status}; record: {path}")
    if not result.ok:
        raise StageFailed(result.message)
    return result
