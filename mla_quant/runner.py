"""The run: resolve the config, seed, run the experiment's stage, write record.json, mirror to the tracker.

`run.py` calls `main(cfg)`. The experiment (conf/experiment/*.yaml) names its stage in `task._target_`; a stage is

    def run(cfg: DictConfig, run_dir: Path) -> StageResult

and reads its own options from `cfg.task`. Stages write their artifacts (tables, figures) into `run_dir` with the
atomic writers of `mla_quant.record`, and return flat metrics. The record is written whatever happens: a failed or
interrupted run leaves a record with `status` "failed"/"interrupted" and keeps every file written before.

Fault tolerance (README "Interruption, resume and determinism"): SIGTERM (SLURM's time limit, preemption,
`scancel`), SIGINT and submitit's timeout/preemption signal (SIGUSR2 by default) end the run through its
finally-block, so the record says `interrupted` or `timeout` and keeps every metric finished so far. Stages keep
their finished units in `<run_dir>/progress.json` (`mla_quant.record.progress()`); a rerun of the same identity
(`mla_quant.record.run_identity`) under the same output root skips a complete run (`force=true` reruns it) and
continues an unfinished one from its progress.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
import traceback
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import get_method, instantiate
from omegaconf import DictConfig, OmegaConf

from mla_quant.memory import LayerProfile, PeakMemory
from mla_quant.models.build import resolve_device
from mla_quant.record import (PROGRESS_NAME, RunProgress, active_progress, prior_runs, read_json, run_identity,
                              write_record)
from mla_quant.calibration import fitted_paths, needs_data
from mla_quant.sensitivity.allocation import is_mixed
from mla_quant.stages import (StageFailed, StageResult, nested_overrides, refuse_overrides, refuse_unused_groups,
                              user_overrides)

__all__ = ["Interrupted", "StageFailed", "StageResult", "main"]


class Interrupted(BaseException):
    """A termination signal, raised where the run is so its finally-block writes the record (a BaseException, so
    no stage's `except Exception` swallows it)."""

    def __init__(self, signum: int, status: str):
        super().__init__(f"{signal.Signals(signum).name}: run {status}")
        self.signum, self.status = signum, status


def timeout_signal() -> signal.Signals:
    """submitit's time-limit / preemption signal (env SUBMITIT_PREEMPT_SIGNAL, USR2 unless set)."""
    name = os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2")
    return getattr(signal, f"SIG{name}", signal.SIGUSR2)


class _Signals:
    """SIGTERM -> Interrupted("interrupted"); the timeout signal -> submitit's own handler first (it checkpoints and
    requeues the job, then exits), else Interrupted("timeout"). SIGINT stays Python's KeyboardInterrupt."""

    def __init__(self):
        self.signum: int | None = None
        self.finishing = False  # while the record is written a second signal is noted, not raised
        self.previous: dict[int, object] = {}

    def status(self) -> str | None:
        if self.signum is None:
            return None
        return "timeout" if self.signum == timeout_signal() else "interrupted"

    def handle(self, signum, frame):
        first = self.signum is None
        self.signum = self.signum or signum
        if self.finishing or not first:
            return
        previous = self.previous.get(signum)
        if signum == timeout_signal() and callable(previous):
            previous(signum, frame)  # submitit: checkpoint (DelayedSubmission of the same job) + requeue + exit
        raise Interrupted(signum, self.status())


@contextmanager
def signals_as_exceptions():
    state = _Signals()
    if threading.current_thread() is not threading.main_thread():
        yield state  # handlers can only be installed from the main thread
        return
    for sig in (signal.SIGTERM, timeout_signal()):
        state.previous[sig] = signal.signal(sig, state.handle)
    try:
        yield state
    finally:
        for sig, handler in state.previous.items():
            signal.signal(sig, handler)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # pragma: no cover
        pass


def device_description(device: str) -> str:
    if device.startswith("cuda"):
        return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    return "cpu"


def run_dir_of(cfg: DictConfig) -> Path:
    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    return Path(cfg.get("run_dir") or "outputs/adhoc")


def output_root(run_dir: Path) -> Path:
    """Where earlier runs of this configuration are looked for: the folder holding this run's dir (single runs,
    outputs/<experiment>/) or this sweep's dir (multirun/<experiment>/), so a rerun of a sweep finds its first try."""
    if HydraConfig.initialized():
        hc = HydraConfig.get()
        from hydra.types import RunMode

        base = hc.sweep.dir if hc.mode == RunMode.MULTIRUN else hc.run.dir
        return Path(base).parent
    return run_dir


def determinism() -> dict:
    """What bit-reproducibility depends on: thread counts and the deterministic-algorithms setting."""
    return {"torch_threads": torch.get_num_threads(), "torch_interop_threads": torch.get_num_interop_threads(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "MKL_NUM_THREADS": os.environ.get("MKL_NUM_THREADS"),
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "cudnn_deterministic": torch.backends.cudnn.deterministic,
            "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}


def run_name(cfg: DictConfig, choices: dict[str, str], run_dir: Path) -> str:
    """<experiment>:<model>/<quant>/<transform> (the groups the experiment reads), e.g. evaluate:toy_mla/int4_joint/none."""
    uses = set(cfg.task.get("uses") or [])
    parts = [choices[g] for g in ("model", "quant", "transform") if g in uses and choices.get(g)]
    return f"{cfg.task.name}:{'/'.join(parts)}" if parts else f"{cfg.task.name}-{run_dir.name}"


def sweep_group() -> str | None:
    """The sweep a multirun job belongs to (its sweep dir), the W&B group of its runs."""
    if HydraConfig.initialized():
        from hydra.types import RunMode

        hc = HydraConfig.get()
        if hc.mode == RunMode.MULTIRUN:
            return str(hc.sweep.dir)
    return None


def config_choices() -> dict[str, str]:
    """The option picked in each config group (model=tiny_kimi_k2, quant=int4_joint, ...), for analysis."""
    if not HydraConfig.initialized():
        return {}
    choices = HydraConfig.get().runtime.choices
    return {k: v for k, v in choices.items() if not k.startswith("hydra") and v is not None}


def refuse_idle_calibration(cfg: DictConfig, overrides: list[str] | None = None) -> None:
    """objective.* without a fitted transform, calib.* without a transform that reads data: refused by name."""
    if "transform" not in (cfg.task.get("uses") or []) or cfg.task.name in ("calibrate", "pipeline"):
        return  # calibrate reports every transform's objectives; pipeline passes each setting to the steps reading it
    name = cfg.transform.get("name")
    idle_fit = []  # transform.fit.* keys this transform does not read
    if not fitted_paths(cfg.transform):
        refuse_overrides(["objective"], f"transform={name} fits nothing, so objective settings would do nothing",
                         overrides)
        idle_fit += ["steps", "lr", "batch", "eval_every"]
    mixed = "quant" in (cfg.task.get("uses") or []) and is_mixed(cfg.get("quant"))  # allocated on calib latents
    if not needs_data(cfg.transform) and not mixed:
        refuse_overrides(["calib"], f"transform={name} reads no calibration data, so calib settings would do nothing",
                         overrides)
        idle_fit += ["alpha", "format"]
    given = user_overrides() if overrides is None else overrides
    bad = [o for o in given if o.lstrip("+~").split("=", 1)[0] in {f"transform.fit.{k}" for k in idle_fit}]
    if bad:
        raise ValueError(f"{bad}: transform={name} does not read these transform.fit settings, so they would do "
                         f"nothing; drop them")


def refuse_idle_plan(cfg: DictConfig) -> None:
    """memory_plan=... where the experiment has no memory plan (only quality, evaluate, sensitivity, calibrate and the
    pipeline running them have one)."""
    from mla_quant.plan import PLANNED

    bad = [o for o in user_overrides() if o.lstrip("+~").split("=", 1)[0] == "memory_plan"]
    if bad and cfg.task.name not in (*PLANNED, "pipeline"):
        raise ValueError(f"{bad}: experiment={cfg.task.name} has no memory plan (the stages that have one: "
                         f"{list(PLANNED)}), so it would do nothing; drop it")


def refuse_idle_streaming(cfg: DictConfig) -> None:
    """model.streaming=true where the experiment does not stream (mla_quant.models.streaming.STREAMED_STAGES)."""
    model = cfg.get("model") or {}
    if model.get("streaming"):
        from mla_quant.models.streaming import check_streaming

        check_streaming(model, cfg.task.name)


def refuse_idle_resources() -> None:
    """model.resources.* only reaches a submitit launcher (hydra/launcher=slurm|local in a --multirun sweep)."""
    bad = [o for o in user_overrides() if o.lstrip("+~").split("=", 1)[0].startswith("model.resources")]
    if not bad or not HydraConfig.initialized():
        return
    from hydra.types import RunMode

    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN or hc.runtime.choices.get("hydra/launcher") not in ("slurm", "local"):
        raise ValueError(f"{bad}: model.resources is what a sweep job asks its launcher for; it takes effect only "
                         f"with --multirun hydra/launcher=slurm or hydra/launcher=local, so drop it here")


def _quietly(what: str, fn, *args, **kwargs):
    """Call a tracker method; any error is a warning, never a failed run (the record is the source of truth)."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - whatever the tracker raises
        warnings.warn(f"tracker {what} failed, the run goes on ({type(exc).__name__}: {exc})", stacklevel=2)
        return None


def resume_state(cfg: DictConfig, run_dir: Path, identity: str) -> tuple[Path | None, RunProgress]:
    """(a complete record of this identity unless force=true, the progress this run starts from)."""
    force = cfg.get("force", False)
    if not isinstance(force, bool):
        raise ValueError(f"force={force!r}; allowed: true (rerun a configuration that has a complete record), false")
    complete, partial = prior_runs(output_root(run_dir), identity, run_dir)
    prog = RunProgress(run_dir / PROGRESS_NAME, identity)
    if complete is not None and not force:
        return complete, prog  # skipped: an unfinished attempt beside the complete one is not continued (nor written)
    own = partial is not None and partial.parent.resolve() == run_dir.resolve()
    if partial is not None and (own or not force):  # force recomputes, but a requeued job keeps its own progress
        prog.restore(read_json(partial) or {}, partial.parent)
        print(f"[mla-quant] {cfg.task.name}: continuing attempt {prog.attempt - 1} of this configuration from "
              f"{partial} ({len(prog.units)} finished units)")
    return (None if force else complete), prog


def main(cfg: DictConfig, run_dir: Path | None = None, choices: dict[str, str] | None = None,
         overrides: list[str] | None = None) -> StageResult:
    """Run `cfg`'s experiment. A run nested in another (experiment=pipeline's steps) passes its own run dir, the
    options chosen for it and its overrides; a top-level run takes them from Hydra."""
    with nested_overrides(overrides):  # user_overrides() is the nested run's own while it works
        return _main(cfg, run_dir, choices)


def _main(cfg: DictConfig, run_dir: Path | None, choices: dict[str, str] | None) -> StageResult:
    run_dir = Path(run_dir) if run_dir is not None else run_dir_of(cfg)
    device = resolve_device(cfg.device)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    stage = get_method(cfg.task._target_)  # fails early, naming the target, if it does not exist
    refuse_unused_groups(cfg.task)  # an override of a group this experiment does not read is refused by name
    refuse_idle_calibration(cfg)
    refuse_idle_resources()
    refuse_idle_plan(cfg)
    refuse_idle_streaming(cfg)
    identity = run_identity(resolved)
    complete, prog = resume_state(cfg, run_dir, identity)
    if complete is not None and cfg.task.get("skip_complete", True):  # experiment=pipeline reruns (its steps skip)
        print(f"[mla-quant] {cfg.task.name}: skipped, this configuration (identity {identity}) already has a "
              f"complete record: {complete}; force=true reruns it")
        return StageResult(metrics=dict((read_json(complete) or {}).get("metrics") or {}), reused=str(complete))
    run_dir.mkdir(parents=True, exist_ok=True)
    seed_everything(cfg.seed)
    choices = config_choices() if choices is None else dict(choices)
    start = time.perf_counter()

    def record(status: str, error: str | None, metrics: dict, signum: int | None = None) -> Path:
        return write_record(run_dir, config=resolved, metrics=metrics, seed=cfg.seed,
                            seconds=time.perf_counter() - start, device=device_description(device), status=status,
                            error=error, choices=choices, identity=identity, resume=prog.summary(),
                            determinism=determinism(), signal=signal.Signals(signum).name if signum else None,
                            memory={**memory.summary(), **({"layers": layers.summary()} if layers.enabled else {})},
                            **prog.fields)

    memory = PeakMemory(device, interval=5e-3)  # the stage's peak memory, in its record (`memory`)
    layers = LayerProfile(memory, enabled=bool(cfg.get("profile_layers", False)))  # and per decoder layer
    record("running", None, prog.metrics)  # on disk before any tracker starts: a tracker never costs the record
    tracker = instantiate(cfg.logger)
    tags = [f"{g}:{choices[g]}" for g in ("model", "quant", "transform") if choices.get(g)]
    _quietly("start", tracker.start, resolved, run_dir, name=run_name(cfg, choices, run_dir), group=sweep_group(),
             tags=tags)
    result, status, error = StageResult(), "failed", None
    threads = torch.get_num_threads()  # a stage's own thread count (eval.threads, task.threads) lasts for its run
    with signals_as_exceptions() as signals, active_progress(prog):
        try:
            with memory, layers:
                result = stage(cfg, run_dir)
            status = "ok" if result.ok else "failed"
            error = None if result.ok else result.message
        except KeyboardInterrupt:
            status, error = "interrupted", "KeyboardInterrupt"
            raise
        except BaseException as exc:  # Interrupted, or submitit's exit after it requeued the job on its signal
            if isinstance(exc, Interrupted) and signals.signum is None:  # caught by a run nested in this one
                signals.signum = exc.signum
            status = signals.status() or "failed"
            error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            if signals.signum is not None and not isinstance(exc, Interrupted):
                error = f"{signal.Signals(signals.signum).name}: {error}"
            raise
        finally:
            torch.set_num_threads(threads)
            signals.finishing = True
            try:  # a signal may have cut a unit's save short: progress.json then holds what the record counts
                prog.save()
            except OSError as exc:
                warnings.warn(f"could not save {run_dir / PROGRESS_NAME} ({exc})", stacklevel=2)
            metrics = {**prog.metrics, **result.metrics}  # every metric finished so far
            path = record(status, error, metrics, signals.signum)
            _quietly("log_metrics", tracker.log_metrics, metrics)
            for name, table in result.tables.items():
                _quietly("log_table", tracker.log_table, name, table)
            for name, image in result.images.items():
                _quietly("log_image", tracker.log_image, name, image)
            _quietly("log_file", tracker.log_file, path)
            _quietly("finish", tracker.finish, status)
            reused = f", {len(prog.reused)} units reused" if prog.reused else ""
            print(f"[mla-quant] {cfg.task.name}: {status}{reused}; record: {path}")
    if not result.ok:
        raise StageFailed(result.message)
    return result
