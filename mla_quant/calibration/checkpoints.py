"""Fitted layers on disk as they are done, so an interrupted calibration resumes and concurrent jobs share layers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from mla_quant.artifacts import lock_file
from mla_quant.calibration.store import load_transforms, save_transforms
from mla_quant.calibration.sweep import report_metrics
from mla_quant.record import progress
from mla_quant.transforms import LayerTransform, TransformSet

class LayerCheckpoints:
    """Each fitted layer on disk as soon as it is done (`<folder>/layer<i>.safetensors`, tagged with the
    configuration's SHA-256), so a killed or requeued calibration continues at the next layer, and jobs that need
    the same calibration share the layers: a job holds a lock on the layer it fits (released when it saves it, or
    by the OS when the job dies), and a job that wants the same layer waits for it and reads it."""

    def __init__(self, folder: Path, config_sha: str):
        self.folder, self.config_sha = Path(folder), config_sha
        self._held = None  # the lock of the layer being fitted (`artifacts.lock_file`)

    def _claim(self, i: int) -> None:
        self._release()
        self._held = lock_file(self.folder / f"layer{i}.lock", f"layer {i} of {self.folder}")
        self._held.__enter__()  # blocks while another job fits this layer

    def _release(self) -> None:
        if self._held is not None:
            self._held.__exit__(None, None, None)  # drops the lock
            self._held = None

    def load(self, i: int) -> tuple[LayerTransform, list[dict]] | None:
        """Layer i if fitted already (waiting for a job fitting it now); else None, holding layer i's lock."""
        self._claim(i)
        tset = load_transforms(self.folder / f"layer{i}.safetensors", 1, self.config_sha)
        if tset is None:
            return None
        self._release()
        progress().reuse(f"calibrate/layer{i}")
        return tset.layers[0], json.loads(tset.meta.get("report", "[]"))

    def save(self, i: int, lt: LayerTransform, rows: list[dict]) -> None:
        save_transforms(self.folder / f"layer{i}.safetensors", TransformSet([lt]),
                        {"config_sha256": self.config_sha, "report": json.dumps(rows)})
        self._release()
        progress().add_metrics({k: v for k, v in report_metrics(rows).items() if k.startswith("calib/layer")})

    def clear(self) -> None:
        self._release()
        shutil.rmtree(self.folder, ignore_errors=True)
