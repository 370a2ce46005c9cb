"""Hydra launchers (submitit, SLURM or local) that give each sweep job the resources of its own model.

    python run.py --multirun hydra/launcher=slurm experiment=sensitivity model=deepseek_v2_lite,kimi_k2

Every model YAML has a `resources` block (nodes, gpus, cpus, mem_gb, timeout_min; presets by size: tiny/toy on
the CPU, 16B-class on one GPU, 671B-1T class on a full 8-GPU node). The stock launcher resolves its parameters once
for the whole sweep, so every job would get the first model's resources; these launchers read each job's own
config, group the jobs by resources and submit one job array per group, keeping Hydra's job numbers (and so the
run dirs). A `hydra.launcher.<key>=...` override on the command line wins over every model's value.

A job killed by its time limit or preempted is checkpointed by submitit (the launcher's `checkpoint` resubmits the
same job) and requeued up to `max_num_timeout` times; the requeued job finds its run dir's progress.json and
continues from it (mla_quant.runner).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hydra_plugins.hydra_submitit_launcher import submitit_launcher as stock

# model.resources key -> submitit launcher parameter
RESOURCE_PARAMS = {"nodes": "nodes", "gpus": "gpus_per_node", "cpus": "cpus_per_task", "mem_gb": "mem_gb",
                   "timeout_min": "timeout_min"}


def launcher_overrides(hydra_overrides: Sequence[str]) -> set[str]:
    """Launcher parameters set on the command line (hydra.launcher.gpus_per_node=2 -> {"gpus_per_node"})."""
    out = set()
    for o in hydra_overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if key.startswith("hydra.launcher."):
            out.add(key[len("hydra.launcher."):])
    return out


def job_resources(resources: Mapping | None, fixed: set[str]) -> dict[str, Any]:
    """The launcher parameters a model's `resources` block asks for, less those fixed on the command line."""
    resources = dict(resources or {})
    unknown = sorted(set(resources) - set(RESOURCE_PARAMS))
    if unknown:
        raise ValueError(f"model.resources has unknown key(s) {unknown}; allowed: {list(RESOURCE_PARAMS)}")
    return {RESOURCE_PARAMS[k]: v for k, v in resources.items() if RESOURCE_PARAMS[k] not in fixed}


def make_executor(cluster: str, params: Mapping[str, Any]):
    """A submitit executor for `cluster` (slurm | local) with the launcher's parameters, named as Hydra's
    submitit plugin names them (generic ones as they are, cluster-specific ones prefixed)."""
    import submitit
    from omegaconf import OmegaConf

    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

    init_keys = {"submitit_folder", "max_num_timeout"}
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    executor = submitit.AutoExecutor(cluster=cluster, folder=params["submitit_folder"],
                                     **({f"{cluster}_max_num_timeout": params["max_num_timeout"]}
                                        if "max_num_timeout" in params else {}))
    executor.update_parameters(**{k if k in base else f"{cluster}_{k}": v for k, v in params.items()
                                  if k not in init_keys})
    return executor


class _PerModelResources(stock.BaseSubmititLauncher):
    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int):
        from hydra.core.singleton import Singleton
        from hydra.core.utils import filter_overrides
        from omegaconf import OmegaConf

        assert self.config is not None and self.hydra_context is not None
        fixed = launcher_overrides(list(self.config.hydra.overrides.hydra))
        groups: dict[tuple, list[int]] = {}
        for i, overrides in enumerate(job_overrides):
            job_cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            res = job_resources(OmegaConf.to_container(job_cfg.model.get("resources") or {}, resolve=True), fixed)
            groups.setdefault(tuple(sorted(res.items())), []).append(i)

        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        results: list[Any] = [None] * len(job_overrides)
        for res, idxs in groups.items():
            executor = make_executor(self._EXECUTOR, {**self.params, **dict(res)})
            print(f"[launcher] {len(idxs)} job(s) with {dict(res) or 'the launcher defaults'}")
            job_params = []
            for i in idxs:
                idx = initial_job_idx + i
                print(f"\t#{idx} : {' '.join(filter_overrides(job_overrides[i]))}")
                job_params.append((list(job_overrides[i]), "hydra.sweep.dir", idx, f"job_id_for_{idx}",
                                   Singleton.get_state()))
            jobs = executor.map_array(self, *zip(*job_params))
            for i, job in zip(idxs, jobs):
                results[i] = job
        return [job.results()[0] for job in results]


class LocalLauncher(_PerModelResources, stock.LocalLauncher):
    """submitit's local launcher with per-model resources (`hydra/launcher=local`)."""


class SlurmLauncher(_PerModelResources, stock.SlurmLauncher):
    """submitit's SLURM launcher with per-model resources (`hydra/launcher=slurm`)."""
