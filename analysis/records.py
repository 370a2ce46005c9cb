"""Run records -> one pandas DataFrame (one row per record), the only input of every table and figure.

    df = load_frame(["outputs", "multirun"])            # record.json files found under the roots
    df = load_frame([], wandb_exports=["runs.csv"])     # an exported W&B project (CSV or JSON) read the same way
    latest = newest_complete(df)                        # status ok, the newest record per configuration, by time

Columns: experiment, status, finished (time the record was written; the file's time for records older than that
field), identity (the configuration's hash), model, quant, transform, eval (the options chosen), source (the file),
metrics (dict), config (dict). W&B's own copies of records (under a `wandb/` folder) are not records; a record that
cannot be read or lacks its fields is skipped with a warning that names the file.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable
from pathlib import Path

import pandas as pd

from mla_quant.record import RECORD_NAME, run_identity

REQUIRED = ("config", "metrics", "status")
CHOICES = ("model", "quant", "transform", "eval")


def model_name(model: dict) -> str:
    """A model's name for records without the chosen option (runs composed outside `run.py`)."""
    target = str(model.get("_target_", ""))
    if target.endswith("load_toy_model"):
        return "toy_mla"
    if target.endswith("tiny_model"):
        return f"tiny_{model.get('family')}"
    return str(model.get("hf_id") or model.get("family") or "?")


def _row(rec: dict, source: str, mtime: float | None) -> dict:
    cfg = rec["config"]
    choices = dict(rec.get("choices") or {})
    task = (cfg.get("task") or {}).get("name") or choices.get("experiment") or "?"
    quant_name = (cfg.get("quant") or {}).get("name")
    finished = rec.get("finished")
    when = pd.Timestamp(finished) if finished else pd.Timestamp(mtime, unit="s", tz="UTC")
    if when.tzinfo is None:
        when = when.tz_localize("UTC")
    row = {"experiment": task, "status": rec["status"], "finished": when.tz_convert("UTC"),
           "identity": rec.get("identity") or run_identity(cfg), "source": source,
           "metrics": dict(rec["metrics"]), "config": cfg}
    fallback = {"model": model_name(cfg.get("model") or {}),
                "quant": quant_name, "transform": (cfg.get("transform") or {}).get("name", "none"),
                "eval": (cfg.get("eval") or {}).get("name")}
    for key in CHOICES:
        row[key] = choices.get(key) or fallback[key]
    return row


def read_record(path: Path) -> dict | None:
    """A record's row, or None (with a warning naming the file) when it is unreadable or incomplete."""
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        warnings.warn(f"skipping {path}: not a readable JSON record ({type(err).__name__}: {err})", stacklevel=2)
        return None
    missing = [k for k in REQUIRED if not isinstance(rec, dict) or k not in rec]
    if missing or not isinstance(rec.get("metrics"), dict) or not isinstance(rec.get("config"), dict):
        warnings.warn(f"skipping {path}: a partial record (missing or malformed {missing or ['metrics/config']})",
                      stacklevel=2)
        return None
    return _row(rec, str(path), path.stat().st_mtime)


def record_files(root: str | Path) -> list[Path]:
    """record.json files under `root`, not W&B's copies of them (anything inside a `wandb` folder)."""
    return sorted(p for p in Path(root).rglob(RECORD_NAME) if "wandb" not in p.relative_to(root).parts[:-1])


def _unflatten(flat: dict) -> dict:
    out: dict = {}
    for key, value in flat.items():
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                break
        else:
            node[parts[-1]] = value
    return out


def read_wandb_export(path: str | Path) -> list[dict]:
    """Rows of an exported W&B project: the runs table as CSV (the UI's export: `Name`, `State`, config columns as
    dotted keys such as `quant.name`, summary metrics by name) or JSON (a list of {"name", "state", "config",
    "summary", "created_at"} as `wandb.Api().runs()` gives them)."""
    path = Path(path)
    if path.suffix == ".json":
        runs = json.loads(path.read_text())
        items = [(r.get("name", "?"), r.get("state"), r.get("config") or {}, r.get("summary") or {},
                  r.get("created_at")) for r in runs]
    else:
        table = pd.read_csv(path)
        items = []
        for _, r in table.iterrows():
            values = {k: v for k, v in r.items() if not (isinstance(v, float) and pd.isna(v))}
            summary = {k: v for k, v in values.items() if "/" in k}
            config = _unflatten({k: v for k, v in values.items() if "." in k and "/" not in k})
            items.append((values.get("Name", "?"), values.get("State"), config, summary, values.get("Created")))
    rows = []
    for name, state, config, summary, created in items:
        if not isinstance(config.get("task"), dict) or "name" not in config["task"]:
            warnings.warn(f"skipping W&B run {name!r} in {path}: its config has no task.name", stacklevel=2)
            continue
        status = "ok" if str(state).lower() in ("finished", "ok") else str(state).lower()
        rec = {"config": config, "metrics": summary, "status": status, "finished": created,
               "choices": config.get("choices") or {}}
        rows.append(_row(rec, f"{path}#{name}", path.stat().st_mtime))
    return rows


def load_frame(roots: Iterable[str | Path], wandb_exports: Iterable[str | Path] = ()) -> pd.DataFrame:
    rows = [row for root in roots if Path(root).exists() for p in record_files(root)
            if (row := read_record(p)) is not None]
    for export in wandb_exports:
        rows += read_wandb_export(export)
    columns = ["experiment", "status", "finished", "identity", "source", *CHOICES, "metrics", "config"]
    return pd.DataFrame(rows, columns=columns).sort_values("finished", kind="stable").reset_index(drop=True)


def newest_complete(df: pd.DataFrame, experiment: str | None = None) -> pd.DataFrame:
    """Records with status ok, the newest (by `finished`) per configuration identity, oldest first."""
    ok = df[df["status"] == "ok"]
    if experiment is not None:
        ok = ok[ok["experiment"] == experiment]
    return ok.sort_values("finished", kind="stable").drop_duplicates("identity", keep="last")
