"""Calibration of the per-path transforms (docs/method.md section 4): capture, objectives, fitting, storage.

    tset, metrics, report = calibrated_transforms(model, cfg, tokenizer, run_format)   # fit, or reuse a stored set
    apply_transforms(model, tset)                                                      # mla_quant.transforms

`mla_quant.prepare.prepare_model` calls this for every stage, so any stage sees the transformed model.
    options.py      transform.* / objective.* options and their checks
    capture.py      one block's activations, in one sweep over the decoder layers
    fit.py          one layer's fit per path (the kinds: mla_quant.transforms.kinds)
    sweep.py        the fit loop over the layers (fit_all)
    checkpoints.py  fitted layers on disk, resumable and shared between jobs
    store.py        fitted sets on disk with provenance
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from mla_quant.artifacts import artifact, model_identity
from mla_quant.artifacts import provenance as artifact_provenance
from mla_quant.calibration.checkpoints import LayerCheckpoints
from mla_quant.calibration.data import calibration_ids, check_calib, ids_sha256, resolve_source
from mla_quant.calibration.options import (CONTENT_CODECS, DEFAULT_FIT_FORMAT, FIT_KEYS, OBJECTIVES, TRANSFORM_KEYS,
                                           check_transform, fit_format, fit_options, fitted_paths, kinds, needs_data,
                                           transformed_format)
from mla_quant.calibration.store import load_transforms, save_transforms
from mla_quant.calibration.sweep import fit_all, report_metrics
from mla_quant.models.absorbed import attention_modules, latent_dims
from mla_quant.models.build import _plain
from mla_quant.models.families import family_for_config
from mla_quant.models.fp8 import weight_of
from mla_quant.quant.formats import CacheFormat, CacheSpec, as_spec
from mla_quant.transforms import TransformSet

__all__ = ["CONTENT_CODECS", "DEFAULT_FIT_FORMAT", "FIT_KEYS", "OBJECTIVES", "TRANSFORM_KEYS", "LayerCheckpoints",
           "calibrated_transforms", "check_transform", "fit_all", "fit_format", "fit_options", "fitted_paths", "kinds",
           "needs_data", "report_metrics", "transformed_format", "weights_sha256"]


# Raised whenever a change to the capture, the objectives or the fit changes what a configuration fits, so sets stored
# before it are fitted again rather than reused (3: clip and lloyd fitted through their own searched grids).
FIT_REVISION = 3


def weights_sha256(model) -> str:
    """Fingerprint of the MLA weights a transform depends on (every block's kv_a, norm, kv_b and query rows)."""
    import hashlib

    family = family_for_config(model.config)
    h = hashlib.sha256()
    for attn in attention_modules(model):
        w = family.mla_weights(attn)
        for t in (weight_of(w.kv_a), w.kv_norm, weight_of(w.kv_b), weight_of(w.q_out)):  # FP8: codes x scales
            h.update(t.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def fit_identity(fmt: CacheSpec | CacheFormat) -> list[str]:
    """What identifies the format transforms are fitted for: its paths (calibration quantizes every token, whatever
    the protected region or backend), per layer where the layers' dims differ."""
    return [repr(part) for f in as_spec(fmt).identity_layers for part in (f.content, f.rope)]


def calibrated_transforms(model, cfg, tokenizer, run_format: CacheSpec | None, report: bool = False,
                          stream=None) -> tuple[TransformSet | None, dict, list[dict]]:
    """The configured transforms for `model` (unabsorbed or absorbed, unquantized): loaded from the store when the
    same configuration was fitted before, else computed (and stored). report=True: compute the per-layer objective
    report even for data-free kinds. `stream`: `model` is the skeleton of a model streamed layer by layer
    (mla_quant.models.streaming): its fingerprint and the fit read the layers one at a time, and the same
    configuration finds the same stored transforms streamed or not. -> (set or None for `none`, metrics, report
    rows)."""
    tcfg = cfg.get("transform")
    k = kinds(tcfg)
    name = _plain(tcfg).get("name", "none")
    if k == {"content": "none", "rope": "none"} and not report:
        return None, {"calib/transform": name}, []
    groups = _plain(cfg.model.get("quant_group_size")) or None
    fmt = fit_format(tcfg, run_format, latent_dims(model)["layer_dims"], groups)
    calib = cfg.get("calib")
    use_data = needs_data(tcfg) or report
    source = resolve_source(calib, cfg.model.get("_target_")) if use_data else None
    if use_data:
        check_calib(calib, source)
    fit = _plain(tcfg).get("fit") or {}
    payload = {"model": model_identity(_plain(cfg.model)),
               "weights": stream.weights_sha256() if stream is not None else weights_sha256(model), "transform": {k2: v for k2, v in _plain(tcfg).items() if k2 != "fit"},
               "fit": {k2: v for k2, v in fit.items() if k2 not in ("cache_dir", "reuse")}, "revision": FIT_REVISION,
               "objective": _plain(cfg.get("objective")) if fitted_paths(tcfg) else None,
               "calib": {**_plain(calib), "source": source} if use_data else None,
               # the paths' formats only: calibration quantizes every token, whatever the protected region or backend
               "format": fit_identity(fmt) if fitted_paths(tcfg) or use_data else None,
               "seed": int(cfg.seed),
               # a fitted transform computes its report while fitting: experiment=calibrate and every other stage
               # share it; a data-free one computes a report only when asked (experiment=calibrate)
               "report": bool(report) and not fitted_paths(tcfg)}
    family = family_for_config(model.config).name
    art = artifact(fit.get("cache_dir", "outputs/calibration"), f"{family}-{name}", payload, ".safetensors")
    config_sha, path = art.sha, art.path
    metrics = {"calib/transform": name, "calib/format": fmt.name, "calib/file": str(path)}
    if fit.get("reuse", True):
        tset = load_transforms(path, len(attention_modules(model)), config_sha)
        if tset is not None:
            rows = json.loads(tset.meta.get("report", "[]"))
            print(f"[calibrate] reusing {path}")
            return tset, {**metrics, "calib/reused": 1, "calib/seconds": float(tset.meta.get("seconds", 0.0)),
                          **report_metrics(rows)}, rows
    start = time.perf_counter()
    ids = None
    if use_data:
        vocab = model.config.get_text_config(decoder=True).vocab_size
        ids = calibration_ids(calib, source, tokenizer, vocab)
    checkpoints = LayerCheckpoints(path.with_name(f"{path.stem}.partial"), config_sha)
    tset, rows = fit_all(model, ids, tcfg, cfg.get("objective"), fmt, int(cfg.seed),
                         int((calib or {}).get("batch_size", 8)) if calib is not None else 8, checkpoints,
                         (calib or {}).get("query_tokens") if calib is not None else None, stream=stream)
    seconds = time.perf_counter() - start
    provenance = {**artifact_provenance(config_sha), "seed": int(cfg.seed), "transform": name,
                  "data_sha256": ids_sha256(ids) if ids is not None else "none", "data_source": source or "none",
                  "format": fmt.name, "seconds": f"{seconds:.3f}", "report": json.dumps(rows)}
    save_transforms(Path(path), tset, provenance)
    checkpoints.clear()  # the whole set is stored: the per-layer files are no longer needed
    tset.meta.update({k2: str(v) for k2, v in provenance.items()})
    print(f"[calibrate] {name}: {len(tset.layers)} layers in {seconds:.1f} s -> {path}")
    return tset, {**metrics, "calib/reused": 0, "calib/seconds": seconds, **report_metrics(rows)}, rows
