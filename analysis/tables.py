"""Tables from run records only: python -m analysis.tables [outputs/ multirun/ ...] [--out analysis/out]

Reads every record.json under the given folders (mla_quant.record.load_records) and writes markdown tables:
  amplification.md   RoPE/content amplification per model (sensitivity runs), mean ± std over seeds, per layer
  equivalence.md     absorbed vs transformers max |logit diff| per model (equivalence runs)
  cache_bytes.md     bytes per token per layer per quant option and context (cache_bytes runs)
  calibration.md     mean objective error per path, without (RTN) and with each transform (calibrate runs)
  accuracy.md        lm-eval score per task, per model and cache format (evaluate runs; `rope=0` rows: the
                     positional control)
The latest successful run of each configuration wins. Nothing is typed in by hand: every number is a record's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from mla_quant.record import load_records, write_text_atomic


def latest_ok(records: list[dict], task: str) -> list[dict]:
    """Successful records of one experiment, the newest per config hash."""
    runs = [r for r in records if r.get("status") == "ok" and r["config"]["task"]["name"] == task]
    by_hash = {r["config_hash"]: r for r in sorted(runs, key=lambda r: r["run_dir"])}
    return sorted(by_hash.values(), key=lambda r: r["run_dir"])


def amplification_table(records: list[dict]) -> pd.DataFrame:
    rows = []
    for r in latest_ok(records, "sensitivity"):
        m, model = r["metrics"], r["config"]["model"]
        layers = sorted(int(k.split("/")[1][5:]) for k in m if k.endswith("/predicted_amplification"))
        rows.append({
            "model": r.get("choices", {}).get("model") or model.get("hf_id") or model["family"],
            "family": model["family"],
            "noise": r["config"]["task"]["noise"],
            "cache NMSE": r["config"]["task"]["nmse"],
            "seeds": r["config"]["task"]["seeds"],
            "A logits": f"{m['sensitivity/amplification/logits']:.2f} ± {m['sensitivity/amplification/logits_std']:.2f}",
            "A KL": f"{m['sensitivity/amplification/kl']:.2f}",
            "A attn output per layer": " ".join(f"{m[f'sensitivity/layer{i}/amplification/attn_output']:.2f}" for i in layers),
            "predicted per layer": " ".join(f"{m[f'sensitivity/layer{i}/predicted_amplification']:.2f}" for i in layers),
            "run": Path(r["run_dir"]).name,
        })
    return _newest(rows, ["model", "noise", "cache NMSE"])


def _newest(rows: list[dict], key: list[str]) -> pd.DataFrame:
    """One row per key: the newest run (rows arrive oldest first)."""
    df = pd.DataFrame(rows)
    return df if df.empty else df.drop_duplicates(subset=key, keep="last").reset_index(drop=True)


def equivalence_table(records: list[dict]) -> pd.DataFrame:
    rows = []
    for r in latest_ok(records, "equivalence"):
        m = r["metrics"]
        for name in r["config"]["task"]["models"]:
            key = f"equivalence/{name}/max_abs_logit_diff"
            if key in m:
                rows.append({"model": name, "max |logit diff|": f"{m[key]:.2g}",
                             "passed": m[f"equivalence/{name}/passed"], "run": Path(r["run_dir"]).name})
    return _newest(rows, ["model"])


def bytes_table(records: list[dict]) -> pd.DataFrame:
    rows = []
    for r in latest_ok(records, "cache_bytes"):
        for key, value in r["metrics"].items():
            _, option, ctx, name = key.split("/")
            rows.append({"option": option, "context": int(ctx[3:]), name: value})
    if not rows:
        return pd.DataFrame()
    df = pd.DataFrame(rows).groupby(["option", "context"], sort=False).first().reset_index()
    return df


HEADLINE_METRICS = ("exact_match", "pass@1", "acc")  # the first a task reports is its column in accuracy.md


def path_format(path: dict) -> str:
    """One cache path of a quant config in a few characters: bf16, fp8, int4 g32, int2 tok (per token)."""
    if path["format"] != "int":
        return path["format"]
    return f"int{path['bits']} " + (f"g{path['group_size']}" if path.get("group_size") else "tok")


def accuracy_table(records: list[dict]) -> pd.DataFrame:
    rows = []
    for r in latest_ok(records, "evaluate"):
        quant, m = r["config"]["quant"], r["metrics"]
        for prefix, label in (("eval/", "model"), ("eval/control_no_rope/", "rope=0")):
            scores = {}
            for key, value in m.items():
                rest = key[len(prefix):] if key.startswith(prefix) else ""
                if rest.count("/") == 1:
                    task, metric = rest.split("/")
                    if task not in scores and metric in HEADLINE_METRICS:
                        scores[task] = value
            if scores:
                protected = quant.get("protected") or {}
                rows.append({"model": r.get("choices", {}).get("model", "?"),
                             "method": (r["config"].get("transform") or {}).get("name", "none"), "cache": quant["name"],
                             "content": path_format(quant["content"]), "rope": path_format(quant["rope"]),
                             "protected": f"{protected.get('n_sink', 0)}+{protected.get('recent', 0)}",
                             "run as": label, **scores, "run": Path(r["run_dir"]).name})
    return _newest(rows, ["model", "method", "cache", "content", "rope", "protected", "run as"])


def calibration_table(records: list[dict]) -> pd.DataFrame:
    """Mean objective error over layers per path, without and with the transform (calibrate runs)."""
    rows = []
    for r in latest_ok(records, "calibrate"):
        m = r["metrics"]
        for path in ("content", "rope"):
            if f"calib/{path}/error" in m:
                rows.append({"model": r.get("choices", {}).get("model", "?"), "method": m.get("calib/transform", "?"),
                             "format": m.get("calib/format", "?"), "path": path,
                             "error_rtn": m[f"calib/{path}/error_none"], "error": m[f"calib/{path}/error"],
                             "run": Path(r["run_dir"]).name})
    return _newest(rows, ["model", "method", "format", "path"])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("roots", nargs="*", default=["outputs", "multirun"])
    parser.add_argument("--out", default="analysis/out")
    args = parser.parse_args(argv)
    records = [r for root in args.roots if Path(root).exists() for r in load_records(root)]
    out = Path(args.out)
    for name, table in (("amplification", amplification_table(records)), ("equivalence", equivalence_table(records)),
                        ("cache_bytes", bytes_table(records)), ("accuracy", accuracy_table(records)),
                        ("calibration", calibration_table(records))):
        if table.empty:
            print(f"{name}: no successful runs found under {args.roots}")
            continue
        text = table.to_markdown(index=False, floatfmt=".4g")
        write_text_atomic(out / f"{name}.md", text + "\n")
        print(f"## {name}\n\n{text}\n")


if __name__ == "__main__":
    main()
