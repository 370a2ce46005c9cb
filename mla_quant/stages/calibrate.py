"""Stage: fit (or reuse) the configured transforms and report each layer's objective error with and without them.

    python run.py experiment=calibrate transform=quantmla quant=int2_content_int4_rope
    python run.py -m experiment=calibrate transform=none,quarot,smoothquant,quantmla quant=int4_joint,int2_content_int4_rope
    python run.py experiment=calibrate model=deepseek_v2_lite model.path=<folder> model.streaming=true \
        transform=quantmla quant=int4_joint      # one decoder layer in memory at a time

Writes calibration.md / calibration.csv (layer x path: kind, objective, error without transform, error with it,
reduction; for the RoPE key also the attention-output error it causes and the positional-score bound on it) and
records calib/... metrics. The fitted transforms go to transform.fit.cache_dir, where every later stage with the
same configuration finds them.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from omegaconf import DictConfig

from mla_quant.prepare import preflight, prepare_model, prepare_streamed
from mla_quant.record import atomic_path, write_text_atomic
from mla_quant.stages import StageResult


def check(cfg: DictConfig) -> None:
    """Everything this stage refuses, before any weight is read (`preflight`: settings, calibration data)."""
    preflight(cfg, tokenizer=False, calib_report=True)


def run(cfg: DictConfig, run_dir: Path) -> StageResult:
    if cfg.model.get("streaming"):  # the sweep reads one decoder layer at a time (mla_quant.models.streaming)
        check(cfg)
        stream, prep = prepare_streamed(cfg, tokenizer=False, calib_report=True)
        stream.close()
        prep.transform_metrics = {**(prep.transform_metrics or {}), **stream.figures()}
    else:
        prep = prepare_model(cfg, absorbed=False, tokenizer=False, calib_report=True)
    df = pd.DataFrame(prep.calib_report or [])
    metrics = dict(prep.metrics())
    if len(df):
        df["reduction"] = df["error_none"] / df["error"].where(df["error"] > 0)
        with atomic_path(run_dir / "calibration.csv") as tmp:
            df.to_csv(tmp, index=False)
        text = df.to_markdown(index=False, floatfmt=".4g")
    else:
        text = "(no report)"
    head = (f"transform={metrics.get('calib/transform')} fitted for {metrics.get('calib/format')}; "
            f"{metrics.get('calib/seconds', 0.0):.1f} s ({'reused' if metrics.get('calib/reused') else 'fitted'})")
    write_text_atomic(run_dir / "calibration.md", f"{head}\n\n{text}\n")
    print(head)
    print(text)
    return StageResult(metrics=metrics)
