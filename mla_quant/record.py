"""The run record: one self-describing `record.json` per run, written atomically next to the run's outputs.

    {"config": {...resolved...}, "config_hash": "...", "metrics": {"equivalence/deepseek_v3/max_abs_logit_diff": 1e-6},
     "versions": {...}, "git_sha": "...", "device": "cpu", "seed": 0, "seconds": 12.3, "status": "ok"}

Analysis reads only these files (`load_records`). Metric names are flat, `/`-separated, and say what they measure.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import tempfile
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

RECORD_NAME = "record.json"
_VERSIONED = ("torch", "transformers", "triton", "lm_eval", "hydra", "wandb")


def write_json_atomic(path: str | Path, obj: Any) -> Path:
    return write_text_atomic(path, json.dumps(obj, indent=2, default=_json_default) + "\n")


@contextmanager
def atomic_path(path: str | Path):
    """Yield a temp path beside `path`; on success it is renamed over `path`, on failure removed.

    Readers never see half a file, and a failed write leaves the previous file as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | Path, text: str) -> Path:
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    return Path(path)


def _json_default(x):
    if hasattr(x, "item"):  # numpy / torch scalars
        return x.item()
    if isinstance(x, (set, tuple)):
        return list(x)
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def versions() -> dict[str, str | None]:
    import importlib.metadata as md

    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in _VERSIONED:
        dist = {"hydra": "hydra-core", "lm_eval": "lm_eval"}.get(name, name)
        try:
            out[name] = md.version(dist)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def git_sha(start: str | Path | None = None) -> str | None:
    """HEAD of the repository holding this package (with '-dirty' if tracked files changed), or None."""
    where = Path(start or Path(__file__).resolve().parent)
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=where, capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{sha}-dirty" if dirty else sha


def config_hash(config: Mapping) -> str:
    """A stable hash of a resolved config (keys sorted), used to key runs for resumable sweeps."""
    blob = json.dumps(config, sort_keys=True, default=_json_default).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def check_metrics(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """Metrics are a flat dict: str names with '/' separators, scalar values."""
    out = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or not key or key.startswith("/") or key.endswith("/"):
            raise ValueError(f"bad metric name {key!r}: use a non-empty '/'-separated string")
        if hasattr(value, "item"):
            value = value.item()
        if not isinstance(value, (int, float, bool, str)) and value is not None:
            raise ValueError(f"metric {key!r} has a non-scalar value of type {type(value).__name__}")
        out[key] = value
    return out


def write_record(
    run_dir: str | Path,
    *,
    config: Mapping,
    metrics: Mapping[str, Any],
    seed: int,
    seconds: float,
    device: str,
    status: str = "ok",
    error: str | None = None,
    choices: Mapping[str, str] | None = None,
) -> Path:
    record = {
        "config": dict(config),
        "choices": dict(choices or {}),
        "config_hash": config_hash(config),
        "metrics": check_metrics(metrics),
        "versions": versions(),
        "git_sha": git_sha(),
        "device": device,
        "seed": seed,
        "seconds": round(float(seconds), 3),
        "status": status,
    }
    if error is not None:
        record["error"] = error
    return write_json_atomic(Path(run_dir) / RECORD_NAME, record)


def load_records(root: str | Path) -> list[dict]:
    """Every record.json under `root` (recursively), each with its `run_dir`."""
    records = []
    for path in sorted(Path(root).rglob(RECORD_NAME)):
        with open(path) as f:
            rec = json.load(f)
        rec["run_dir"] = str(path.parent)
        records.append(rec)
    return records
