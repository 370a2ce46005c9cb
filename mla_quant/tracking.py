"""Experiment tracking: W&B (offline unless told otherwise) or nothing. Targets of `conf/logger/*.yaml`.

The run record (record.py) is the source of truth; the tracker mirrors its metrics and artifacts to W&B so sweeps
can be browsed there. `wandb sync <run_dir>/wandb/offline-run-*` uploads an offline run later.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


class NullLogger:
    """Logs nothing (tests, quick runs): `logger=none`."""

    def start(self, config: Mapping, run_dir: Path, name: str) -> None:
        pass

    def log_metrics(self, metrics: Mapping[str, Any]) -> None:
        pass

    def log_file(self, path: Path) -> None:
        pass

    def finish(self, status: str) -> None:
        pass


class WandbLogger(NullLogger):
    """Weights & Biases, `mode=offline` by default: no network, files under <run_dir>/wandb."""

    def __init__(self, project: str = "mla-quant", entity: str | None = None, mode: str = "offline",
                 group: str | None = None, tags: list[str] | None = None):
        allowed = ("online", "offline", "disabled")
        if mode not in allowed:
            raise ValueError(f"logger.mode={mode!r}; allowed: {allowed}")
        self.kwargs = dict(project=project, entity=entity, mode=mode, group=group, tags=list(tags or []))
        self.run = None

    def start(self, config: Mapping, run_dir: Path, name: str) -> None:
        import wandb

        self.run = wandb.init(config=dict(config), dir=str(run_dir), name=name, reinit="finish_previous",
                              **self.kwargs)

    def log_metrics(self, metrics: Mapping[str, Any]) -> None:
        if self.run is None:
            return
        numeric = {k: v for k, v in metrics.items() if isinstance(v, (int, float, bool))}
        self.run.log(numeric)
        for key, value in metrics.items():
            self.run.summary[key] = value

    def log_file(self, path: Path) -> None:
        if self.run is not None:
            self.run.save(str(path), base_path=str(Path(path).parent), policy="now")

    def finish(self, status: str) -> None:
        if self.run is not None:
            self.run.finish(exit_code=0 if status == "ok" else 1)
            self.run = None
