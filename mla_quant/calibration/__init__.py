"""Calibration of the per-path transforms (docs/method.md section 4): capture, objectives, fitting, storage.

    tset, metrics, report = calibrated_transforms(model, cfg, tokenizer, run_format)   # fit, or reuse a stored set
    apply_transforms(model, tset)                                                      # mla_quant.transforms

`mla_quant.prepare.prepare_model` calls this for every stage, so any stage sees the transformed model.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from mla_quant.calibration import capture as capture_module
from mla_quant.calibration.data import calibration_ids, check_calib, ids_sha256, resolve_source
from mla_quant.calibration.fit import DATA_FREE, FITTED, FitOptions, fit_content, fit_rope
from mla_quant.calibration.objectives import (CONTENT_OBJECTIVES, ROPE_OBJECTIVES, rope_output_bound,
                                              ste_quantizer)
from mla_quant.calibration.store import config_sha256, load_transforms, save_transforms, transform_path
from mla_quant.models.absorbed import absorbed_view, attention_modules
from mla_quant.models.build import _plain
from mla_quant.models.families import family_for_config
from mla_quant.models.fp8 import weight_of
from mla_quant.quant.formats import CacheFormat, cache_format
from mla_quant.record import progress
from mla_quant.transforms import KINDS, LayerTransform, TransformSet, random_hadamard

OBJECTIVES = {"content": CONTENT_OBJECTIVES, "rope": ROPE_OBJECTIVES}
TRANSFORM_KEYS = ("name", "content", "rope", "fit")
FIT_KEYS = ("format", "steps", "lr", "alpha", "batch", "eval_every", "cache_dir", "reuse")
DEFAULT_FIT_FORMAT = "int4_joint"  # fit.format=auto when the run stores no quantized cache
CONTENT_CODECS = (None, "codebook")  # transform.content.codec: store the content path with TurboQuant's codebook


def kinds(transform_cfg) -> dict[str, str]:
    t = _plain(transform_cfg)
    return {p: (t.get(p) or {}).get("kind", "none") for p in ("content", "rope")}


def fitted_paths(transform_cfg) -> list[str]:
    k = kinds(transform_cfg)
    return [p for p in ("content", "rope") if k[p] in FITTED[p]]


def needs_data(transform_cfg) -> bool:
    k = kinds(transform_cfg)
    return any(k[p] not in DATA_FREE[p] for p in ("content", "rope"))


def check_transform(transform_cfg, objective_cfg=None) -> None:
    """transform.* and objective.*: unknown keys or kinds refused by name, before any model work (overrides that
    would do nothing are refused by the pipeline, `refuse_idle_calibration`)."""
    t = _plain(transform_cfg)
    unknown = sorted(set(t) - set(TRANSFORM_KEYS))
    if unknown:
        raise ValueError(f"transform: unknown key(s) {unknown}; allowed: {list(TRANSFORM_KEYS)}")
    for path in ("content", "rope"):
        node = t.get(path) or {}
        allowed = ["kind", "codec"] if path == "content" else ["kind"]
        extra = sorted(set(node) - set(allowed))
        if extra:
            raise ValueError(f"transform.{path}: unknown key(s) {extra}; allowed: {allowed}")
        if path == "content" and node.get("codec") not in CONTENT_CODECS:
            raise ValueError(f"transform.content.codec={node.get('codec')!r}; allowed: {list(CONTENT_CODECS)}")
        kind = node.get("kind", "none")
        if kind not in KINDS[path]:
            raise ValueError(f"transform.{path}.kind={kind!r}; allowed: {list(KINDS[path])}")
    extra = sorted(set(t.get("fit") or {}) - set(FIT_KEYS))
    if extra:
        raise ValueError(f"transform.fit: unknown key(s) {extra}; allowed: {list(FIT_KEYS)}")
    if needs_data(transform_cfg) and not t.get("fit"):
        raise ValueError(f"transform={t.get('name')!r} uses calibration data and needs a transform.fit block")
    o = _plain(objective_cfg)
    extra = sorted(set(o) - {"name", "content", "rope"})
    if extra:
        raise ValueError(f"objective: unknown key(s) {extra}; allowed: ['name', 'content', 'rope']")
    for path in ("content", "rope"):
        kind = (o.get(path) or {}).get("kind")
        if kind is not None and kind not in OBJECTIVES[path]:
            raise ValueError(f"objective.{path}.kind={kind!r}; allowed: {list(OBJECTIVES[path])}")


def transformed_format(transform_cfg, fmt: CacheFormat | None) -> CacheFormat | None:
    """The cache format with the transform's content codec (transform=turboquant: the quant option's content bits
    stored as TurboQuant's codebook with one norm per token instead of per-group scales)."""
    codec = (_plain(transform_cfg).get("content") or {}).get("codec")
    if codec is None or fmt is None or not fmt.content.quantized:
        return fmt
    import dataclasses

    from mla_quant.quant.formats import PathFormat

    if fmt.content.format != "int":
        raise ValueError(f"transform.content.codec={codec} re-encodes an integer content path at its bit width; "
                         f"quant={fmt.name} stores content as {fmt.content.format} (use an int option, e.g. "
                         f"int4_joint)")
    content = PathFormat(format=codec, bits=fmt.content.bits, group_size=None, scale_dtype=fmt.content.scale_dtype)
    content.check(fmt.d_c, "quant.content")
    if fmt.backend == "triton":
        raise ValueError(f"transform.content.codec={codec}: quant.backend=triton cannot read format={codec}; use "
                         f"quant.backend=torch")
    return dataclasses.replace(fmt, name=f"{fmt.name}_{codec}", content=content)


def fit_format(transform_cfg, run_format: CacheFormat | None, d_c: int, d_r: int, groups: dict | None) -> CacheFormat:
    """The cache format the transforms are fitted for: transform.fit.format, `auto` = the run's quantized format,
    else int4_joint."""
    from mla_quant.cache.bytes import load_quant_option

    name = (_plain(transform_cfg).get("fit") or {}).get("format", "auto")
    if name == "auto":
        if run_format is not None and run_format.quantized:
            return run_format
        name = DEFAULT_FIT_FORMAT
    fmt = transformed_format(transform_cfg, cache_format(load_quant_option(name, groups=groups), d_c, d_r))
    if not fmt.quantized:
        raise ValueError(f"transform.fit.format={name!r} stores both paths unquantized: nothing to fit against; "
                         f"name a quantized option (e.g. int4_joint)")
    return fmt


def fit_options(transform_cfg, seed: int) -> FitOptions:
    fit = _plain(transform_cfg).get("fit") or {}
    keys = ("steps", "lr", "alpha", "batch", "eval_every")
    return FitOptions(**{k: fit[k] for k in keys if k in fit}, seed=seed)


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


class LayerCheckpoints:
    """Each fitted layer on disk as soon as it is done (`<folder>/layer<i>.safetensors`, tagged with the
    configuration's SHA-256), so a killed or requeued calibration continues at the next layer, and jobs that need
    the same calibration share the layers: a job holds a lock on the layer it fits (released when it saves it, or
    by the OS when the job dies), and a job that wants the same layer waits for it and reads it."""

    def __init__(self, folder: Path, config_sha: str):
        self.folder, self.config_sha = Path(folder), config_sha
        self._held = None  # the open lock file of the layer being fitted

    def _claim(self, i: int) -> None:
        import fcntl

        self._release()
        self.folder.mkdir(parents=True, exist_ok=True)
        self._held = open(self.folder / f"layer{i}.lock", "a")
        fcntl.flock(self._held, fcntl.LOCK_EX)  # blocks while another job fits this layer

    def _release(self) -> None:
        if self._held is not None:
            self._held.close()  # closing drops the lock
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


def fit_all(model, ids: torch.Tensor | None, transform_cfg, objective_cfg, fmt: CacheFormat, seed: int,
            batch_size: int = 8, checkpoints: LayerCheckpoints | None = None,
            query_tokens: int | None = None, capture: str = "sweep") -> tuple[TransformSet, list[dict]]:
    """Fit (or compute) every block's transforms; the per-layer report rows (objective error before and after).
    `checkpoints`: keep each fitted layer on disk and continue from the layers found there. `query_tokens`: the
    per-head query tensors at that many positions per sequence (None: all). `capture`: "sweep" (one pass over the
    decoder layers) or "stopped" (one forward stopped at each block; the reference)."""
    if capture not in capture_module.CAPTURES:
        raise ValueError(f"capture={capture!r}; allowed: {sorted(capture_module.CAPTURES)}")
    k = kinds(transform_cfg)
    objectives = {p: (_plain(objective_cfg).get(p) or {}).get("kind") or OBJECTIVES[p][0] for p in ("content", "rope")}
    opts = fit_options(transform_cfg, seed)
    quant = {p: ste_quantizer(fmt.path(p), fmt.dim(p)) for p in ("content", "rope")}
    modules = attention_modules(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    model.requires_grad_(False)  # end-to-end objectives backpropagate through the model, never into its weights
    try:
        with absorbed_view(model):  # the capture's forwards through the blocked absorbed attention: linear memory
            return _fit_layers(model, ids, k, objectives, opts, quant, fmt, modules, batch_size, seed, checkpoints,
                               query_tokens, capture_module.CAPTURES[capture])
    finally:
        for p in trainable:
            p.requires_grad_(True)


def _fit_layers(model, ids, k, objectives, opts, quant, fmt, modules, batch_size, seed, checkpoints, query_tokens,
                captures):
    layers, report = [], []
    sweep = None  # one pass over the decoder layers, started at the first layer that is not fitted yet
    for i in tqdm(range(len(modules)), desc="calibrate", unit="layer"):
        g = torch.Generator().manual_seed(seed * 1_000_003 + i)
        lt = LayerTransform()
        if ids is None:  # data-free kinds only
            if k["content"] == "hadamard":
                lt.rotation = random_hadamard(modules[i].kv_lora_rank, g)
            layers.append(lt)
            continue
        done = checkpoints.load(i) if checkpoints is not None else None
        if sweep is not None and done is not None:
            next(sweep)  # keep the sweep at layer i: its outputs are the next layers' inputs
        if done is not None:  # fitted by an earlier, interrupted attempt of this configuration
            layers.append(done[0])
            report.extend(done[1])
            continue
        if sweep is None:
            sweep = captures(model, ids, batch_size, start=i, query_tokens=query_tokens)
        cap = next(sweep)
        start = time.perf_counter()
        content_kind = k["content"] if fmt.content.quantized else "none"
        lt.rotation, lt.scale, c_err = fit_content(cap, content_kind, objectives["content"], quant["content"], opts, g)
        c_sec = time.perf_counter() - start
        rope_kind = k["rope"] if fmt.rope.quantized else "none"
        start = time.perf_counter()
        lt.angle, lt.pair_scale, r_err = fit_rope(cap, rope_kind, objectives["rope"], quant["rope"], opts)
        r_sec = time.perf_counter() - start
        n = modules[i].qk_rope_head_dim // 2
        phi = torch.zeros(n) if lt.angle is None else lt.angle
        t = torch.ones(n) if lt.pair_scale is None else lt.pair_scale
        bound = rope_output_bound(cap, phi.to(cap.k_rope.device), t.to(cap.k_rope.device), quant["rope"])
        report.append({"layer": i, "path": "content", "kind": content_kind, "objective": objectives["content"],
                       "error_none": c_err["none"], "error": c_err["fitted"], "seconds": c_sec})
        report.append({"layer": i, "path": "rope", "kind": rope_kind, "objective": objectives["rope"],
                       "error_none": r_err["none"], "error": r_err["fitted"], "seconds": r_sec,
                       "output_error": bound["measured"], "output_bound": bound["bound"]})
        layers.append(LayerTransform(*(None if v is None else v.detach().double().cpu()
                                       for v in (lt.rotation, lt.scale, lt.angle, lt.pair_scale))))
        if checkpoints is not None:
            checkpoints.save(i, layers[-1], report[-2:])
        del cap
    return TransformSet(layers), report


def report_metrics(report: list[dict]) -> dict[str, float]:
    out: dict[str, float] = {}
    for row in report:
        out[f"calib/layer{row['layer']}/{row['path']}/error"] = row["error"]
        out[f"calib/layer{row['layer']}/{row['path']}/error_none"] = row["error_none"]
    for path, keys in (("content", ("error", "error_none")),
                       ("rope", ("error", "error_none", "output_error", "output_bound"))):
        rows = [r for r in report if r["path"] == path]
        for key in keys if rows else ():
            out[f"calib/{path}/{key}"] = sum(r[key] for r in rows) / len(rows)
    return out


def calibrated_transforms(model, cfg, tokenizer, run_format: CacheFormat | None, report: bool = False
                          ) -> tuple[TransformSet | None, dict, list[dict]]:
    """The configured transforms for `model` (unabsorbed or absorbed, unquantized): loaded from the store when the
    same configuration was fitted before, else computed (and stored). report=True: compute the per-layer objective
    report even for data-free kinds. -> (set or None for `none`, metrics, report rows)."""
    tcfg = cfg.get("transform")
    k = kinds(tcfg)
    name = _plain(tcfg).get("name", "none")
    if k == {"content": "none", "rope": "none"} and not report:
        return None, {"calib/transform": name}, []
    modules = attention_modules(model)
    d_c, d_r = modules[0].kv_lora_rank, modules[0].qk_rope_head_dim
    groups = _plain(cfg.model.get("quant_group_size")) or None
    fmt = fit_format(tcfg, run_format, d_c, d_r, groups)
    calib = cfg.get("calib")
    use_data = needs_data(tcfg) or report
    source = resolve_source(calib, cfg.model.get("_target_")) if use_data else None
    if use_data:
        check_calib(calib, source)
    fit = _plain(tcfg).get("fit") or {}
    payload = {"model": {k2: v for k2, v in _plain(cfg.model).items() if k2 not in ("device", "tokenizer", "resources")},
               "weights": weights_sha256(model), "transform": {k2: v for k2, v in _plain(tcfg).items() if k2 != "fit"},
               "fit": {k2: v for k2, v in fit.items() if k2 not in ("cache_dir", "reuse")},
               "objective": _plain(cfg.get("objective")) if fitted_paths(tcfg) else None,
               "calib": {**_plain(calib), "source": source} if use_data else None,
               # the paths' formats only: calibration quantizes every token, whatever the protected region or backend
               "format": [repr(fmt.content), repr(fmt.rope)] if fitted_paths(tcfg) or use_data else None,
               "seed": int(cfg.seed),
               # a fitted transform computes its report while fitting: experiment=calibrate and every other stage
               # share it; a data-free one computes a report only when asked (experiment=calibrate)
               "report": bool(report) and not fitted_paths(tcfg)}
    config_sha = config_sha256(payload)
    family = family_for_config(model.config).name
    path = transform_path(fit.get("cache_dir", "outputs/calibration"), f"{family}-{name}-{config_sha[:16]}")
    metrics = {"calib/transform": name, "calib/format": fmt.name, "calib/file": str(path)}
    if fit.get("reuse", True):
        tset = load_transforms(path, len(modules), config_sha)
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
                         (calib or {}).get("query_tokens") if calib is not None else None)
    seconds = time.perf_counter() - start
    import transformers

    provenance = {"config_sha256": config_sha, "seed": int(cfg.seed), "transform": name,
                  "data_sha256": ids_sha256(ids) if ids is not None else "none", "data_source": source or "none",
                  "format": fmt.name, "seconds": f"{seconds:.3f}", "report": json.dumps(rows),
                  "torch": torch.__version__, "transformers": transformers.__version__}
    save_transforms(Path(path), tset, provenance)
    checkpoints.clear()  # the whole set is stored: the per-layer files are no longer needed
    tset.meta.update({k2: str(v) for k2, v in provenance.items()})
    print(f"[calibrate] {name}: {len(modules)} layers in {seconds:.1f} s -> {path}")
    return tset, {**metrics, "calib/reused": 0, "calib/seconds": seconds, **report_metrics(rows)}, rows
