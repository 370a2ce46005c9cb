"""experiment=pipeline (the default run): the whole study on one model as a sequence of runs, each with its own run
dir and record, then every table and figure from those records and a one-screen summary.

    python run.py                                   # toy: sensitivity, calibration, evaluation, tables and figures
    python run.py model=deepseek_v2_lite quant=int4_joint    # a real checkpoint: its eval=paper

Steps (conf/experiment/pipeline.yaml): sensitivity -> calibrate (method x format) -> evaluate (the reference, the
peers, then method x format, then method x quant=mixed at each of task.mixed's budgets) -> analysis. A step is `mla_quant.runner.main` on the step's experiment composed with the run's
overrides that the step reads, so a step that finished in an earlier pipeline run of the same configuration is reused
(force=true reruns). A failed step is recorded and the others still run; the pipeline's record lists every step.
"""

from __future__ import annotations

import importlib
import inspect
import json
import time
import traceback
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pandas as pd
from hydra import compose
from hydra.errors import ConfigCompositionException
from omegaconf import DictConfig, OmegaConf, open_dict

from mla_quant.metrics import parse_eval
from mla_quant import runner
from mla_quant.record import write_text_atomic
from mla_quant.stages import (GROUPS, StageResult, nested_overrides, override_group, refuse_unused_groups,
                              user_overrides)

# top-level settings every step takes as given (memory_plan: the steps whose stage has a plan, `reads`)
ALWAYS = ("seed", "device", "logger", "force", "profile_layers", "memory_plan")
SELECTS = ("quant", "transform")  # `quant=X` / `transform=Y` on the command line pick the pipeline's formats / methods
STEP_LOG = "step.log"  # each step's own output (the console shows one line per step and the summary)


def steps(methods: list[str], formats: list[str], t: DictConfig) -> list[tuple[str, list[str]]]:
    """(step name, overrides) in order."""
    out: list[tuple[str, list[str]]] = []
    if t.sensitivity is not None:
        out.append(("sensitivity", ["experiment=sensitivity", *t.sensitivity]))
    if t.cache_bytes is not None:
        options = list(dict.fromkeys([*([t.reference] if t.reference else []), *formats]))
        out.append(("cache_bytes", ["experiment=cache_bytes", f"task.options=[{','.join(options)}]", *t.cache_bytes]))
    if t.calibrate is not None:
        out += [(f"calibrate-{m}-{f}", ["experiment=calibrate", f"transform={m}", f"quant={f}", *t.calibrate])
                for m in methods for f in formats]
    if t.evaluate is not None:
        if t.reference:
            out.append((f"evaluate-{t.reference}", ["experiment=evaluate", f"quant={t.reference}", *t.evaluate]))
        out += [(f"evaluate-{p}", ["experiment=evaluate", f"quant={p}", *t.evaluate]) for p in t.peers]
        out += [(f"evaluate-{m}-{f}", ["experiment=evaluate", f"transform={m}", f"quant={f}", *t.evaluate])
                for m in methods for f in formats]
        out += [(f"evaluate-{m}-mixed-{b}", ["experiment=evaluate", f"transform={m}", "quant=mixed",
                                            f"quant.budget={b}", *t.evaluate]) for m in methods for b in t.mixed]
    return out


def reads(cfg: DictConfig, override: str) -> bool:
    """Whether the step composed as `cfg` reads the command-line override (else it would do nothing there)."""
    group = override_group(override)
    if group == "memory_plan":
        from mla_quant.plan import PLANNED

        return cfg.task.name in PLANNED
    if group in ALWAYS:
        return True
    if group == "quant" and cfg.task.name == "sensitivity" and cfg.task.get("noise") == "gaussian":
        return False  # Gaussian injection reads no quant setting (the stage refuses them)
    try:
        refuse_unused_groups(cfg.task, [override])
        runner.refuse_idle_calibration(cfg, [override])
    except ValueError:
        return False
    return True


def step_config(overrides: list[str], passed: list[str], reference: bool,
                per_eval: dict | None = None) -> tuple[DictConfig, dict, list[str]]:
    """The step's config (composed as `python run.py <overrides>` would, with the command-line overrides it reads),
    its chosen options, and those overrides. The reference run takes no quant/transform settings. per_eval: settings
    per eval option (task.evaluate_per_eval), put before the step's own for the eval option it composes with."""
    candidates = [o for o in passed if not (reference and override_group(o) in SELECTS)]
    cfg = None
    if all("." not in o.split("=", 1)[0] for o in candidates):
        # option choices alone (model=, eval=, logger=): they leave the step's task as it is, so whether the step
        # reads them is seen on the config they compose, and when it reads them all that config is the step's
        try:
            cfg = compose("config", overrides=[*overrides, *candidates], return_hydra_config=True)
        except ConfigCompositionException:
            pass
        if cfg is not None and not all(reads(cfg, o) for o in candidates):
            cfg = None
        mine = candidates
    if cfg is None:
        probe = compose("config", overrides=overrides)
        mine = [o for o in candidates if reads(probe, o)]
        try:
            cfg = compose("config", overrides=[*overrides, *mine], return_hydra_config=True)
        except ConfigCompositionException:  # a setting of an option this step does not take (transform.fit.* on none)
            mine = [o for o in mine if _composes([*overrides, o])]
            cfg = compose("config", overrides=[*overrides, *mine], return_hydra_config=True)
    suite = list((per_eval or {}).get(cfg.hydra.runtime.choices.get("eval")) or [])
    if suite and "eval" in (cfg.task.get("uses") or []):
        overrides = [*suite, *overrides]  # the step's own settings and the command line's come after, and win
        cfg = compose("config", overrides=[*overrides, *mine], return_hydra_config=True)
    choices = {k: v for k, v in cfg.hydra.runtime.choices.items() if not k.startswith("hydra") and v is not None}
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg, choices, [*mine, *[o for o in overrides if not o.startswith("experiment=")]]


def _composes(overrides: list[str]) -> bool:
    try:
        compose("config", overrides=overrides)
    except ConfigCompositionException:
        return False
    return True


def eval_options() -> list[str]:
    """The options of the eval config group (conf/eval/*.yaml)."""
    from hydra.core.global_hydra import GlobalHydra

    return sorted(GlobalHydra.instance().config_loader().get_group_options("eval"))


def compose_steps(t: DictConfig, given: list[str]) -> list[tuple[str, str, DictConfig, dict, list[str]]]:
    """Every step of the pipeline composed, none run: (folder, name, config, choices, overrides) in order. A step that
    does not compose, or a command-line setting that no step reads, is refused here, before any step runs."""
    methods, formats = selection(t, given)
    per_eval = OmegaConf.to_container(t.get("evaluate_per_eval") or {}, resolve=True)
    unknown = sorted(set(per_eval) - set(eval_options()))
    if unknown:
        raise ValueError(f"task.evaluate_per_eval has settings for {unknown}, which are not eval options; allowed: "
                         f"{eval_options()}")
    passed = [o for o in given if override_group(o) in (*GROUPS, *ALWAYS) and o.split("=", 1)[0] not in SELECTS]
    configs, used = [], set()
    for i, (name, overrides) in enumerate(steps(methods, formats, t), 1):
        try:
            fixed = name in [f"evaluate-{o}" for o in (t.reference, *t.peers) if o]  # no quant/transform settings
            step_cfg, choices, step_overrides = step_config(overrides, passed, reference=fixed, per_eval=per_eval)
        except Exception as exc:
            raise ValueError(f"step {name} ({' '.join(overrides)}): {exc}") from exc
        used.update(o for o in step_overrides if o in passed)
        configs.append((f"{i:02d}_{name}", name, step_cfg, choices, step_overrides))
    idle = [o for o in passed if o not in used]
    if idle:
        raise ValueError(f"{idle}: no step of this pipeline reads these settings, so they would do nothing; drop them")
    return configs


def selection(t: DictConfig, given: list[str]) -> tuple[list[str], list[str]]:
    """The methods and formats to compare: task.methods / task.formats, or the one `transform=` / `quant=` names."""
    picked = {o.split("=", 1)[0]: o.split("=", 1)[1] for o in given if o.split("=", 1)[0] in SELECTS}
    for group, key in (("quant", "task.formats"), ("transform", "task.methods")):
        if group in picked and any(o.lstrip("+~").startswith(key) for o in given):
            raise ValueError(f"both {group}={picked[group]} and {key} choose what the pipeline compares; give one")
    methods = [picked["transform"]] if "transform" in picked else list(t.methods)
    formats = [picked["quant"]] if "quant" in picked else list(t.formats)
    if not methods or not formats:
        raise ValueError(f"task.methods={methods} and task.formats={formats} must name at least one transform and "
                         f"one quant option")
    return methods, formats


def headline(metrics: dict) -> float | None:
    """Mean over tasks of each task's headline score (exact_match or pass@1) of an evaluate record."""
    scores = {}
    for key, value in metrics.items():
        k = parse_eval(key)
        if k is not None and k.headline and k.setting == "model":
            scores.setdefault(k.task, value)
    return sum(scores.values()) / len(scores) if scores else None


def summary(t: DictConfig, methods: list[str], formats: list[str], results: dict, report,
            seconds: float) -> tuple[str, dict]:
    lines, metrics = [], {}
    sens = results.get("sensitivity")
    if sens and "sensitivity/amplification/logits" in sens:
        a = sens["sensitivity/amplification/logits"]
        metrics["pipeline/amplification/logits"] = a
        lines.append(f"RoPE/content amplification at the logits (equal cache NMSE): {a:.2f}")
    rows = []
    for m in methods:
        row = {"method": m}
        for f in formats:
            cal = results.get(f"calibrate-{m}-{f}") or {}
            acc = headline(results.get(f"evaluate-{m}-{f}") or {})
            err = cal.get("calib/content/error")
            cell = f"{acc:.3f}" if acc is not None else "-"
            if err is not None:
                cell += f" (obj. {err:.2g}/{cal.get('calib/rope/error', float('nan')):.2g})"
            row[f] = cell
            if acc is not None:
                metrics[f"pipeline/accuracy/{m}/{f}"] = acc
        rows.append(row)
    ref = headline(results.get(f"evaluate-{t.reference}") or {}) if t.reference else None
    if ref is not None:
        metrics[f"pipeline/accuracy/{t.reference}"] = ref
    peer_acc = {p: headline(results.get(f"evaluate-{p}") or {}) for p in t.peers}
    peer_acc = {p: a for p, a in peer_acc.items() if a is not None}
    metrics.update({f"pipeline/accuracy/{p}": a for p, a in peer_acc.items()})
    if any(len(r) > 1 for r in rows) and t.evaluate is not None:
        lines.append("Accuracy, mean over tasks (objective error content/rope, mean over layers)"
                     + (f"; {t.reference} reference {ref:.3f}" if ref is not None else "")
                     + "".join(f"; {p} {a:.3f}" for p, a in peer_acc.items()) + ":")
        lines.append(pd.DataFrame(rows).to_markdown(index=False, disable_numparse=True))
    paired = report.tables.get("paired") if report is not None else None
    if paired is not None and not paired.empty:
        p = paired.long
        pooled = set(zip(p[p["task"] == "all tasks"]["method"], p[p["task"] == "all tasks"]["cache"]))
        cells = [f"{r['method']} {r['cache']} {r['delta']:+.3f} ± {r['paired SE']:.3f}" for r in p.to_dict("records")
                 if r["method"] in methods and r["cache"] in formats
                 and (r["task"] == "all tasks" or (r["method"], r["cache"]) not in pooled)]
        if cells:  # every task's examples together (or the one task a run evaluated)
            lines.append("vs RTN on the same examples (difference ± paired standard error): " + "; ".join(cells))
    for m in methods:
        for b in t.mixed:
            acc = headline(results.get(f"evaluate-{m}-mixed-{b}") or {})
            if acc is not None:
                metrics[f"pipeline/accuracy/{m}/mixed-{b}"] = acc
    mixed = report.tables.get("mixed") if report is not None else None
    if mixed is not None and not mixed.empty:
        cells = [f"{r['method']} {r['cache']} {r['delta']:+.3f} ± {r['paired SE']:.3f}"
                 for r in mixed.long.to_dict("records") if r["method"] in methods and r["task"] == "all tasks"]
        if cells:
            lines.append("mixed precision vs the uniform option at its bytes, same examples: " + "; ".join(cells))
    against = report.tables.get("peers") if report is not None else None
    if against is not None and not against.empty:
        rows = [r for r in against.long.to_dict("records") if r["method"] in methods and r["cache"] in formats]
        for task, head in (("all tasks", "vs transformers' QuantizedCache on the same examples"),
                           ("needle tasks, needle quantized", "  the same, needles stored quantized by both")):
            cells = [f"{r['method']} {r['cache']} {r['delta']:+.3f} ± {r['paired SE']:.3f} ({r['examples']}) "
                     f"vs {r['peer']}" for r in rows if r["task"] == task]
            if cells:
                lines.append(f"{head}: " + "; ".join(cells))
    if report is not None:
        lines.append(f"Tables and figures ({len(report.tables)} tables, {len(report.figures)} figures): "
                     f"{report.out}/index.md")
    lines.append(f"{len(results)} steps in {seconds / 60:.1f} min")
    return "\n".join(lines), metrics


def check_steps(configs: list[tuple[str, str, DictConfig, dict, list[str]]]) -> None:
    """Each step's own checks (its stage's `check(cfg)`: settings, model config, tokenizer files, datasets), every
    step before the first runs: a setting one step refuses fails the pipeline in seconds, not after the steps before
    it ran for hours. A dataset is loaded once for the steps that share it."""
    loaded: set[str] = set()
    for _, name, step_cfg, _, overrides in configs:
        module = importlib.import_module(step_cfg.task._target_.rsplit(".", 1)[0])
        check = getattr(module, "check", None)
        if check is None:
            continue
        kwargs = {}
        if "data" in inspect.signature(check).parameters:  # evaluate: its tasks' datasets, once per model and eval
            plain = OmegaConf.to_container(step_cfg, resolve=True)
            key = json.dumps([plain.get("model"), plain.get("eval")], sort_keys=True, default=str)
            kwargs["data"] = key not in loaded
            loaded.add(key)
        try:
            with nested_overrides(overrides):
                check(step_cfg, **kwargs)
        except Exception as exc:
            raise ValueError(f"step {name} ({' '.join(overrides) or 'defaults'}), refused before any step ran: "
                             f"{type(exc).__name__}: {exc}") from exc


def run(cfg: DictConfig, run_dir: Path) -> StageResult:
    t = cfg.task
    methods, formats = selection(t, user_overrides())
    configs = compose_steps(t, user_overrides())  # all compose first: bad options fail now
    check_steps(configs)  # and every step's checks pass before the first one runs
    start = time.perf_counter()
    results: dict[str, dict] = {}
    metrics: dict = {"pipeline/steps": len(configs)}
    failed, roots = [], [run_dir]
    for folder, name, step_cfg, choices, overrides in configs:
        step_dir = run_dir / folder
        step_dir.mkdir(parents=True, exist_ok=True)
        print(f"[pipeline] {folder}: {' '.join(overrides) or '(defaults)'}", flush=True)
        began = time.perf_counter()
        try:
            with open(step_dir / STEP_LOG, "a") as log, redirect_stdout(log), redirect_stderr(log):
                res = runner.main(step_cfg, run_dir=step_dir, choices=choices, overrides=overrides)
            results[name] = res.metrics
            kind, detail = ("reused", f" ({res.reused})") if res.reused else ("ok", "")
            if res.reused:  # finished in an earlier run of the same configuration: its record counts
                roots.append(Path(res.reused).parent)
        except Exception as exc:  # a failed step is in its own record; the others still run
            failed.append(name)
            kind, detail = "failed", f": {''.join(traceback.format_exception_only(type(exc), exc)).strip()}"
        metrics[f"pipeline/{name}/status"] = kind
        print(f"[pipeline] {folder}: {kind}{detail}, {time.perf_counter() - began:.0f} s "
              f"(log: {step_dir / STEP_LOG})", flush=True)
    report = None
    result = StageResult()
    if t.analysis:
        from analysis.report import regenerate

        report = regenerate(roots, run_dir / "analysis")
        result.tables = {name: tab.rows for name, tab in report.tables.items()}
        result.images = {name: paths[0] for name, paths in report.figures.items()}
    text, extra = summary(t, methods, formats, results, report, time.perf_counter() - start)
    metrics.update(extra)
    print("\n" + text)
    write_text_atomic(run_dir / "summary.md", text + "\n")
    result.metrics = metrics
    if failed:
        result.ok, result.message = False, f"steps failed: {failed} (each has its record under {run_dir})"
    return result
