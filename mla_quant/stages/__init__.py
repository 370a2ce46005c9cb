"""Stages: one per experiment (conf/experiment/*.yaml names its stage in `task._target_`).

A stage is `run(cfg, run_dir) -> StageResult`; it prepares its model with `mla_quant.prepare.prepare_model`
and reads its options from `cfg.task`. `task.uses` lists the config groups the stage reads; an override of any
other group on the command line is refused by name (no setting does nothing).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

GROUPS = ("model", "quant", "transform", "objective", "calib", "eval", "attention")


@dataclass
class StageResult:
    metrics: dict[str, Any] = field(default_factory=dict)
    ok: bool = True
    message: str = ""
    tables: dict[str, Any] = field(default_factory=dict)  # name -> pandas DataFrame, logged to the tracker as tables
    images: dict[str, Any] = field(default_factory=dict)  # name -> image file, logged to the tracker as images
    reused: str | None = None  # the complete record of the same configuration this run was skipped for


class StageFailed(RuntimeError):
    """A stage ran to the end but its checks failed (the record is written first)."""


_NESTED: list[list[str]] = []  # the overrides of runs nested in another (experiment=pipeline's steps), innermost last


@contextmanager
def nested_overrides(overrides: list[str] | None):
    """While a nested run works, `user_overrides()` is its own overrides, not the top-level command line's."""
    if overrides is None:
        yield
        return
    _NESTED.append(list(overrides))
    try:
        yield
    finally:
        _NESTED.pop()


def user_overrides() -> list[str]:
    """The command line's overrides of this run (a nested run's own; empty outside a Hydra run)."""
    from hydra.core.hydra_config import HydraConfig

    if _NESTED:
        return list(_NESTED[-1])
    if not HydraConfig.initialized():
        return []
    return list(HydraConfig.get().overrides.task)


def override_group(override: str) -> str:
    """'quant.content.bits=3' -> 'quant'; '+model.config.x=1' -> 'model'; 'hydra/launcher=slurm' -> 'hydra'."""
    key = override.split("=", 1)[0].lstrip("+~")
    return key.split(".", 1)[0].split("/", 1)[0].split("@", 1)[0]


def refuse_overrides(groups, why: str, overrides: list[str] | None = None) -> None:
    """Raise ValueError naming every override of one of `groups` (they would do nothing in this run)."""
    overrides = user_overrides() if overrides is None else overrides
    bad = [o for o in overrides if override_group(o) in groups]
    if bad:
        raise ValueError(f"{bad}: {why}; drop {'it' if len(bad) == 1 else 'them'}")


def selected_models(task_cfg, models=None) -> list[str]:
    """The keys of `models` (default `task.models`) a stage over several models runs: `task.only`, or all of them;
    unknown keys refused."""
    models = task_cfg.models if models is None else models
    names = list(models) if task_cfg.get("only") is None else list(task_cfg.only)
    unknown = sorted(set(names) - set(models))
    if unknown:
        raise ValueError(f"task.only has unknown models {unknown}; known: {sorted(models)}")
    return names


def registry_models(cfg) -> dict[str, Any]:
    """{model type: its tiny random model's config} for every model type of the family registry
    (`MLAFamily.tiny_options`: conf/model/tiny_<model type>.yaml), resolved against the run's seed and device: the
    models of `task.models: registry`. A registered model type without its tiny option is refused by name."""
    from pathlib import Path

    from omegaconf import OmegaConf

    from mla_quant.models.families import FAMILIES

    conf = Path(__file__).resolve().parents[1] / "conf" / "model"
    out = {}
    for family in FAMILIES.values():
        for model_type, option in family.tiny_options.items():
            path = conf / f"{option}.yaml"
            if not path.is_file():
                raise FileNotFoundError(f"model type {model_type!r} (family {family.name!r}) has no tiny model option: "
                                        f"add {path.relative_to(conf.parents[1])}")
            root = OmegaConf.create({"seed": cfg.get("seed"), "device": cfg.get("device", "auto"),
                                     "model": OmegaConf.load(path)})
            out[model_type] = root.model
    return out


def stage_models(cfg) -> dict[str, Any]:
    """`task.models`: a mapping of model configs, or `registry` (every registered model type, `registry_models`)."""
    models = cfg.task.models
    if isinstance(models, str):
        if models != "registry":
            raise ValueError(f"task.models={models!r}; allowed: registry, or a mapping of model configs")
        return registry_models(cfg)
    return dict(models)


def refuse_unused_groups(task_cfg, overrides: list[str] | None = None) -> None:
    """Refuse overrides of config groups the experiment does not read (its `task.uses`)."""
    uses = list(task_cfg.get("uses") or [])
    unknown = sorted(set(uses) - set(GROUPS))
    if unknown:
        raise ValueError(f"task.uses has unknown groups {unknown}; allowed: {list(GROUPS)}")
    unused = [g for g in GROUPS if g not in uses]
    refuse_overrides(unused, f"experiment={task_cfg.name} does not read the config group(s) {unused} (it reads "
                             f"{uses or 'none of them'}), so these settings would do nothing", overrides)
