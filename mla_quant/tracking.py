"""Experiment tracking: W&B (offline unless told otherwise) or nothing. Targets of `conf/logger/*.yaml`.

The run record (record.py) is the source of truth: the pipeline writes it before the tracker starts and again
after the run, whatever the tracker does. The tracker mirrors metrics, tables, figures and the record to W&B so
sweeps can be browsed there: one W&B run per job, grouped by sweep, named after the experiment and the options it
reads (`evaluate:toy_mla/int4_joint/quantmla`), tagged `model:...`, `quant:...`, `transform:...`.
`wandb sync <run_dir>/wandb/offline-run-*` uploads an offline run later.

`logger.mode=online` first checks that the W&B server answers within `logger.init_timeout` seconds; when it does
not (no network, a closed port), or `wandb.init` fails, the run is tracked offline with a warning instead.
"""

from __future__ import annotations

import shutil
import socket
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

DEFAULT_BASE_URL = "https://api.wandb.ai"


class NullLogger:
    """Logs nothing (tests, quick runs): `logger=none`."""

    def start(self, config: Mapping, run_dir: Path, name: str, group: str | None = None,
              tags: Sequence[str] = ()) -> None:
        pass

    def log_metrics(self, metrics: Mapping[str, Any]) -> None:
        pass

    def log_table(self, name: str, table) -> None:
        """A pandas DataFrame as a table named `name`."""

    def log_image(self, name: str, path: str | Path) -> None:
        """An image file (PNG) as a figure named `name`."""

    def log_file(self, path: Path) -> None:
        pass

    def finish(self, status: str) -> None:
        pass


def server_reachable(base_url: str, timeout: float) -> bool:
    """Whether a TCP connection to the W&B server opens within `timeout` seconds."""
    url = urlparse(base_url)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "localhost", port), timeout=timeout):
            return True
    except OSError:
        return False


class WandbLogger(NullLogger):
    """Weights & Biases, `mode=offline` by default: no network, files under <run_dir>/wandb."""

    def __init__(self, project: str = "mla-quant", entity: str | None = None, mode: str = "offline",
                 group: str | None = None, tags: list[str] | None = None, init_timeout: float = 30.0):
        allowed = ("online", "offline", "disabled")
        if mode not in allowed:
            raise ValueError(f"logger.mode={mode!r}; allowed: {allowed}")
        if not float(init_timeout) > 0:
            raise ValueError(f"logger.init_timeout={init_timeout!r}; need seconds > 0")
        self.project, self.entity, self.mode = project, entity, mode
        self.group, self.tags, self.init_timeout = group, list(tags or []), float(init_timeout)
        self.run = None

    def start(self, config: Mapping, run_dir: Path, name: str, group: str | None = None,
              tags: Sequence[str] = ()) -> None:
        """Start the job's W&B run. `logger.group` / `logger.tags` win over / add to the sweep group and tags."""
        import os

        import wandb

        # reinit="create_new": a run nested in another (experiment=pipeline's steps) gets its own W&B run
        kwargs = dict(project=self.project, entity=self.entity, config=dict(config), dir=str(run_dir), name=name,
                      group=self.group or group, tags=[*tags, *self.tags], reinit="create_new")
        mode = self.mode
        if mode == "online":
            base = os.environ.get("WANDB_BASE_URL", DEFAULT_BASE_URL)
            start = time.perf_counter()
            if not server_reachable(base, self.init_timeout):
                warnings.warn(f"logger.mode=online: the W&B server {base} did not answer within "
                              f"{self.init_timeout:g} s ({time.perf_counter() - start:.1f} s); tracking offline "
                              f"instead (upload later with `wandb sync`)", stacklevel=2)
                mode = "offline"
            else:
                try:
                    self.run = wandb.init(mode="online", settings=wandb.Settings(init_timeout=self.init_timeout),
                                          **kwargs)
                    return
                except Exception as exc:  # noqa: BLE001 - an unreachable or refusing server, bad credentials
                    warnings.warn(f"logger.mode=online: wandb.init failed ({type(exc).__name__}: {exc}); tracking "
                                  f"offline instead", stacklevel=2)
                    mode = "offline"
        self.run = wandb.init(mode=mode, **kwargs)

    def log_metrics(self, metrics: Mapping[str, Any]) -> None:
        if self.run is None:
            return
        numeric = {k: v for k, v in metrics.items() if isinstance(v, (int, float, bool))}
        self.run.log(numeric)
        for key, value in metrics.items():
            self.run.summary[key] = value

    def log_table(self, name: str, table) -> None:
        if self.run is not None:
            import wandb

            self.run.log({name: wandb.Table(dataframe=table)})

    def log_image(self, name: str, path: str | Path) -> None:
        if self.run is not None:
            import wandb

            self.run.log({name: wandb.Image(str(path))})

    def log_file(self, path: Path) -> None:
        """A copy of the file in the W&B run's files (W&B uploads that folder; a copy, not wandb.save's symlink,
        which warns that later changes need another save)."""
        if self.run is not None:
            shutil.copy2(path, Path(self.run.dir) / Path(path).name)

    def finish(self, status: str) -> None:
        if self.run is not None:
            self.run.finish(exit_code=0 if status == "ok" else 1)
            self.run = None
