"""Fault injection: runs and sweeps that are terminated, rerun, resumed; corrupted checkpoints; unreachable trackers."""

import json
import shutil
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from conftest import REPO, compose, run_cli

from mla_quant import runner
from mla_quant.runner import Interrupted, StageResult
from mla_quant.record import RunProgress, active_progress, progress, run_identity

SENSITIVITY = ["experiment=sensitivity", "model=tiny_deepseek_v2", "task.seeds=2", "task.sweep_nmse=[0.005,0.02]",
               "task.probe.num_sequences=2", "logger=none"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _units(run_dir: Path) -> int:
    return len((_read(run_dir / "progress.json") or {}).get("units", {}))


def _kill_when(run_dir: Path, units: int, proc: subprocess.Popen, timeout: float = 240) -> int:
    """SIGTERM the process working in `run_dir` once its progress holds `units` finished units."""
    deadline = time.time() + timeout
    while time.time() < deadline and _units(run_dir) < units:
        assert proc.poll() is None, f"the run ended before {units} units: {proc.communicate()}"
        time.sleep(0.1)
    pid = _read(run_dir / "progress.json")["pid"]
    os.kill(pid, signal.SIGTERM)
    return pid


@pytest.mark.slow
def test_sigterm_leaves_an_interrupted_record_and_the_rerun_resumes_to_the_same_metrics(tmp_path):
    root = tmp_path / "outputs"
    proc = subprocess.Popen([sys.executable, "run.py", *SENSITIVITY, f"hydra.run.dir={root}/a"], cwd=REPO, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _kill_when(root / "a", 6, proc)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0
    rec = _read(root / "a" / "record.json")
    assert rec is not None, out[-2000:]
    assert rec["status"] == "interrupted" and rec["signal"] == "SIGTERM", (rec["status"], rec.get("error"))
    done = rec["metrics"]["sensitivity/injections_done"]
    assert done >= 6 and rec["resume"]["units_done"] == done

    resumed = run_cli(*SENSITIVITY, f"hydra.run.dir={root}/b")  # the rest in this process: no signal to send
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "continuing" in resumed.stdout
    rec_b = _read(root / "b" / "record.json")
    assert rec_b["status"] == "ok" and rec_b["resume"]["attempt"] == 2
    assert rec_b["resume"]["units_reused"] >= done and rec_b["resume"]["resumed_from"] == str(root / "a")

    fresh = run_cli(*SENSITIVITY, f"hydra.run.dir={root}/c", "force=true")  # uninterrupted, from zero
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    rec_c = _read(root / "c" / "record.json")
    assert rec_c["resume"]["units_reused"] == 0
    diff = {k: (v, rec_c["metrics"].get(k)) for k, v in rec_b["metrics"].items() if rec_c["metrics"].get(k) != v}
    assert not diff and set(rec_b["metrics"]) == set(rec_c["metrics"]), diff
    assert (root / "b" / "sensitivity_rows.csv").read_text() == (root / "c" / "sensitivity_rows.csv").read_text()

    skipped = run_cli(*SENSITIVITY, f"hydra.run.dir={root}/d")  # complete now: skipped, nothing recomputed
    assert skipped.returncode == 0 and "skipped, this configuration" in skipped.stdout and not (root / "d" / "record.json").exists()


@pytest.mark.slow
def test_local_sweep_with_one_job_killed_reruns_only_that_job(tmp_path):
    root = tmp_path / "multirun"
    sweep = ["--multirun", "hydra/launcher=local", "experiment=sensitivity", "task.seeds=2", "logger=none",
             "task.sweep_nmse=[0.005,0.02]", "task.probe.num_sequences=2", "model=tiny_deepseek_v2,tiny_deepseek_v3"]
    proc = subprocess.Popen([sys.executable, "run.py", *sweep, f"hydra.sweep.dir={root}/first"], cwd=REPO, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _kill_when(root / "first" / "1", 4, proc)
    out, _ = proc.communicate(timeout=300)
    records = {i: _read(root / "first" / str(i) / "record.json") for i in range(2)}
    assert records[1]["status"] == "interrupted", out[-3000:]
    assert records[0]["status"] == "ok"

    again = run_cli(*sweep, f"hydra.sweep.dir={root}/second")  # its launcher in this process, the jobs in theirs
    logs = "".join(p.read_text() for p in (root / "second" / ".submitit").rglob("*.out"))
    assert logs.count("skipped, this configuration") == 1, logs[-3000:]
    assert [i for i in range(2) if (root / "second" / str(i) / "record.json").exists()] == [1]
    rec = _read(root / "second" / "1" / "record.json")
    assert again.returncode == 0 and rec["status"] == "ok", again.stderr[-3000:]
    assert rec["resume"]["units_reused"] >= 4 and rec["resume"]["resumed_from"] == str(root / "first" / "1")


EVALUATE = ["experiment=evaluate", "model=toy_mla", "logger=none", "eval.limit=2", "eval.data.niah_lengths=[256]",
            "eval.control_no_rope.enabled=false"]


@pytest.mark.slow
def test_evaluate_keeps_each_finished_task_and_resumes_from_it(tmp_path, monkeypatch):
    from mla_quant.stages import evaluate

    real, calls = evaluate.evaluate_tasks, []

    def sigterm_at_third_task(lm, tasks, *args, **kwargs):
        calls.append(list(tasks))
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises before this returns
        return real(lm, tasks, *args, **kwargs)

    monkeypatch.setattr(evaluate, "evaluate_tasks", sigterm_at_third_task)
    dirs = iter(["a", "a", "b"])
    monkeypatch.setattr(runner, "run_dir_of", lambda cfg: tmp_path / next(dirs))
    with pytest.raises(Interrupted):
        runner.main(compose(EVALUATE))
    rec = json.loads((tmp_path / "a" / "record.json").read_text())
    finished = sorted({k.split("/")[1] for k in rec["metrics"] if k.startswith("eval/toy_")})
    assert rec["status"] == "interrupted" and finished == sorted(t for [t] in calls[:2]), (finished, calls)

    runner.main(compose(EVALUATE))  # requeued into the same run dir: the first two tasks are not evaluated again
    resumed = json.loads((tmp_path / "a" / "record.json").read_text())
    assert resumed["status"] == "ok" and resumed["resume"]["units_reused"] == 2 and len(calls) == 3 + 3
    runner.main(compose([*EVALUATE, "force=true"]))  # uninterrupted, in a fresh dir
    fresh = json.loads((tmp_path / "b" / "record.json").read_text())
    scores = [{k: v for k, v in r["metrics"].items() if not k.endswith(("seconds", "cache_calls"))}
              for r in (resumed, fresh)]
    assert scores[0] == scores[1] and len(scores[0]) > 10


# --- in-process: signals, skip and force, identity, trackers -------------------------------------------------------

def stage_with_units(cfg, run_dir):
    """Five units; sends the signal named by STOP_SIGNAL to itself after the third (when set)."""
    for i in range(5):
        progress().unit(f"demo/{i}", lambda i=i: i * i, metrics=lambda v, i=i: {f"demo/square/{i}": v})
        if i == 2 and os.environ.get("STOP_SIGNAL"):
            os.kill(os.getpid(), getattr(signal, os.environ["STOP_SIGNAL"]))
            time.sleep(5)  # the handler raises before this returns
    return StageResult(metrics={"demo/sum": sum(progress().units[f"demo/{i}"] for i in range(5))})


def _demo_cfg(overrides=()):
    cfg = compose(["logger=none", "experiment=equivalence", *overrides])
    cfg.task._target_ = f"{__name__}.stage_with_units"
    return cfg


@pytest.fixture
def in_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "run_dir_of", lambda cfg: tmp_path)
    return tmp_path


@pytest.mark.parametrize("name,status", [("SIGTERM", "interrupted"), ("SIGUSR2", "timeout")])
def test_signals_end_in_a_record_with_the_finished_metrics(in_dir, monkeypatch, name, status):
    monkeypatch.setenv("STOP_SIGNAL", name)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Interrupted):
        runner.main(_demo_cfg())
    rec = json.loads((in_dir / "record.json").read_text())
    assert rec["status"] == status and rec["signal"] == name
    assert rec["metrics"] == {"demo/square/0": 0, "demo/square/1": 1, "demo/square/2": 4}
    assert signal.getsignal(signal.SIGTERM) is before, "the runner left its handler installed"

    monkeypatch.delenv("STOP_SIGNAL")
    result = runner.main(_demo_cfg())  # requeued in the same run dir: continues at unit 3
    rec = json.loads((in_dir / "record.json").read_text())
    assert rec["status"] == "ok" and result.metrics["demo/sum"] == 30
    assert rec["resume"]["units_reused"] == 3 and rec["resume"]["attempt"] == 2
    assert rec["resume"]["reused"] == {"demo": 3}


def stage_with_threads(cfg, run_dir):
    torch.set_num_threads(3)  # as experiment=evaluate sets eval.threads
    if os.environ.get("STAGE_FAILS"):
        raise RuntimeError("the stage failed")
    return StageResult(metrics={"demo/threads": torch.get_num_threads()})


@pytest.mark.parametrize("fails", [False, True])
def test_a_stages_thread_count_lasts_for_its_run(in_dir, monkeypatch, fails):
    """A stage that sets its own thread count (eval.threads, task.threads) has it while it runs; the caller (a
    pipeline's next step, or a test) gets its own back, also when the stage fails."""
    cfg = _demo_cfg()
    cfg.task._target_ = f"{__name__}.stage_with_threads"
    if fails:
        monkeypatch.setenv("STAGE_FAILS", "1")
    torch.set_num_threads(1)
    if fails:
        with pytest.raises(RuntimeError, match="the stage failed"):
            runner.main(cfg)
    else:
        assert runner.main(cfg).metrics["demo/threads"] == 3
    assert torch.get_num_threads() == 1


def test_timeout_signal_runs_submitits_handler_first(in_dir, monkeypatch):
    """Under submitit the timeout signal's own handler (checkpoint + requeue, then exit) runs; the record says
    timeout."""
    calls = []

    def submitit_handler(signum, frame):
        calls.append(signum)
        sys.exit(-1)

    previous = signal.signal(signal.SIGUSR2, submitit_handler)
    monkeypatch.setenv("STOP_SIGNAL", "SIGUSR2")
    try:
        with pytest.raises(SystemExit):
            runner.main(_demo_cfg())
        assert signal.getsignal(signal.SIGUSR2) is submitit_handler
    finally:
        signal.signal(signal.SIGUSR2, previous)
    rec = json.loads((in_dir / "record.json").read_text())
    assert calls == [signal.SIGUSR2] and rec["status"] == "timeout" and rec["error"].startswith("SIGUSR2")
    assert len(rec["metrics"]) == 3


def test_complete_runs_are_skipped_and_force_reruns(in_dir, capsys):
    runner.main(_demo_cfg())
    first = (in_dir / "record.json").read_text()
    assert runner.main(_demo_cfg(["logger=wandb", "logger.mode=disabled"])).metrics["demo/sum"] == 30
    assert "skipped, this configuration" in capsys.readouterr().out
    assert (in_dir / "record.json").read_text() == first
    runner.main(_demo_cfg(["force=true"]))
    assert json.loads((in_dir / "record.json").read_text())["status"] == "ok"
    assert "skipped, this configuration" not in capsys.readouterr().out
    with pytest.raises(ValueError, match="force='yes'; allowed: true"):
        runner.main(_demo_cfg(["force=yes"]))


def test_a_skipped_rerun_writes_nothing_even_beside_an_unfinished_attempt(tmp_path, monkeypatch):
    """A complete record and an unfinished attempt of the same configuration under the output root: the rerun is
    skipped for the complete one and writes nothing (no progress.json continued into its own new folder)."""
    root = tmp_path / "outputs"
    dirs = iter([root / "done", root / "killed", root / "again"])
    monkeypatch.setattr(runner, "run_dir_of", lambda cfg: next(dirs))
    monkeypatch.setattr(runner, "output_root", lambda run_dir: root)
    runner.main(_demo_cfg())
    monkeypatch.setenv("STOP_SIGNAL", "SIGTERM")
    with pytest.raises(Interrupted):
        runner.main(_demo_cfg(["force=true"]))  # a forced rerun, killed after three units
    monkeypatch.delenv("STOP_SIGNAL")
    assert (root / "killed" / "progress.json").is_file()
    assert runner.main(_demo_cfg()).reused == str(root / "done" / "record.json")
    assert not (root / "again").exists()


def test_identity_ignores_outputs_and_trackers_only():
    from omegaconf import OmegaConf

    def identity(*overrides):
        return run_identity(OmegaConf.to_container(compose(["model=tiny_deepseek_v2", "transform=quantmla",
                                                            *overrides]), resolve=True))

    base = identity()
    assert identity("logger=none", "force=true", "transform.fit.cache_dir=/elsewhere", "model.resources.gpus=4") == base
    assert identity("quant=int4_joint") != base and identity("seed=1") != base


class BrokenLogger:
    def __getattr__(self, name):
        def fail(*args, **kwargs):
            raise ConnectionError(f"tracker down ({name})")
        return fail


def test_a_failing_tracker_costs_neither_the_record_nor_the_run(in_dir):
    cfg = _demo_cfg()
    cfg.logger = {"_target_": f"{__name__}.BrokenLogger"}
    with pytest.warns(UserWarning, match="tracker start failed"):
        runner.main(cfg)
    assert json.loads((in_dir / "record.json").read_text())["status"] == "ok"


def _silent_server():
    """A port that accepts connections and never answers."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    return srv


@pytest.mark.parametrize("server", ["closed", "silent"])
def test_unreachable_online_tracker_falls_back_to_offline_within_its_bound(tmp_path, monkeypatch, server):
    from mla_quant.tracking import WandbLogger

    srv = _silent_server()
    port = srv.getsockname()[1]
    if server == "closed":
        srv.close()
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    bound = 3.0
    logger = WandbLogger(mode="online", init_timeout=bound)
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logger.start({"a": 1}, tmp_path, name="t", group="g", tags=["model:x"])
    seconds = time.perf_counter() - start
    try:
        assert any("tracking offline instead" in str(w.message) for w in caught), [str(w.message) for w in caught]
        assert logger.run is not None and logger.run.settings.mode == "offline"
        assert logger.run.group == "g" and "model:x" in logger.run.tags
        # the online attempt is bounded by init_timeout; the rest is W&B's own start-up, offline
        assert seconds < bound + 30, f"{seconds:.1f} s"
    finally:
        logger.finish("ok")
        srv.close()


# --- checkpoint integrity ------------------------------------------------------------------------------------------

def _fake_hub_cache(root: Path, repo: str) -> Path:
    """A tiny model saved with save_pretrained into the Hugging Face cache layout: snapshot files are links to
    blobs named by their content's SHA-256. -> the weights blob."""
    import hashlib

    from mla_quant.prepare import build_model

    saved = root / "saved"
    build_model(compose(["model=tiny_deepseek_v2"]).model, absorbed=False).save_pretrained(saved)
    base = root / "hub" / f"models--{repo.replace('/', '--')}"
    commit = "0" * 40
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(commit)
    snap = base / "snapshots" / commit
    snap.mkdir(parents=True)
    (base / "blobs").mkdir()
    weights = None
    for f in saved.iterdir():
        blob = base / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        blob.write_bytes(f.read_bytes())
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
        if f.suffix == ".safetensors":
            weights = blob
    return weights


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside the tensor data, past the safetensors header
    path.chmod(0o644)
    path.write_bytes(bytes(data))


def test_hub_cache_weights_are_checked_against_their_blob_hashes(tmp_path, monkeypatch):
    import huggingface_hub.constants as hub

    from mla_quant.models.build import pretrained_model

    weights = _fake_hub_cache(tmp_path, "test/tiny-v2")
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    prog = RunProgress()
    with active_progress(prog):
        pretrained_model("deepseek_v2", hf_id="test/tiny-v2", dtype="float32", absorbed=False)
    assert prog.fields["weights"] == {"model.safetensors": weights.name}
    _flip_byte(weights)
    with pytest.raises(ValueError, match="corrupted"):
        pretrained_model("deepseek_v2", hf_id="test/tiny-v2", dtype="float32", absorbed=False)


def test_model_sha256_map_and_nan_weights_are_checked(tmp_path):
    from safetensors.torch import load_file, save_file

    from mla_quant.models.build import pretrained_model
    from mla_quant.prepare import build_model

    build_model(compose(["model=tiny_deepseek_v2"]).model, absorbed=False).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="model.sha256 says"):
        pretrained_model("deepseek_v2", hf_id="x", path=str(tmp_path), sha256={"model.safetensors": "0" * 64})
    with pytest.raises(ValueError, match="not weight files"):
        pretrained_model("deepseek_v2", hf_id="x", path=str(tmp_path), sha256={"other.safetensors": "0" * 64})
    tensors = load_file(tmp_path / "model.safetensors")
    name = next(k for k in tensors if k.endswith("kv_a_proj_with_mqa.weight"))
    tensors[name][0, 0] = float("nan")
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="NaN or inf"):
        pretrained_model("deepseek_v2", hf_id="x", path=str(tmp_path), dtype="float32")


# --- calibration: per-layer checkpoints ----------------------------------------------------------------------------

def test_interrupted_calibration_continues_at_the_next_layer(tmp_path, monkeypatch):
    from mla_quant.calibration import LayerCheckpoints, calibrated_transforms
    from mla_quant.prepare import build_model

    over = ["model=tiny_minicpm3", "quant=int4_joint", "transform=quantmla", "calib.samples=4", "calib.seq_len=32",
            "transform.fit.steps=3"]
    clean_cfg = compose([*over, f"transform.fit.cache_dir={tmp_path}/clean"])
    clean, _, clean_rows = calibrated_transforms(build_model(clean_cfg.model, absorbed=False), clean_cfg, None, None)

    cfg = compose([*over, f"transform.fit.cache_dir={tmp_path}/store"])
    save = LayerCheckpoints.save

    def save_then_stop(self, i, lt, rows):
        save(self, i, lt, rows)
        raise KeyboardInterrupt  # killed right after the first layer is on disk

    monkeypatch.setattr(LayerCheckpoints, "save", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        calibrated_transforms(build_model(cfg.model, absorbed=False), cfg, None, None)
    monkeypatch.setattr(LayerCheckpoints, "save", save)
    prog = RunProgress()
    with active_progress(prog):
        again, metrics, rows = calibrated_transforms(build_model(cfg.model, absorbed=False), cfg, None, None)
    assert prog.reused == ["calibrate/layer0"] and metrics["calib/reused"] == 0
    timeless = [[{k: v for k, v in r.items() if k != "seconds"} for r in rs] for rs in (rows, clean_rows)]
    assert timeless[0] == timeless[1]
    for a, b in zip(again.layers, clean.layers):
        assert torch.equal(a.rotation, b.rotation) and torch.equal(a.angle, b.angle)
    assert not list((tmp_path / "store").glob("*.partial")), "per-layer files left after the set was stored"


def test_jobs_needing_the_same_calibration_share_its_layers(tmp_path):
    import threading

    from mla_quant.calibration import LayerCheckpoints
    from mla_quant.transforms import LayerTransform

    first, second = LayerCheckpoints(tmp_path, "sha"), LayerCheckpoints(tmp_path, "sha")
    assert first.load(0) is None  # the first job fits layer 0, holding its lock
    got = []
    waiter = threading.Thread(target=lambda: got.append(second.load(0)))
    waiter.start()
    time.sleep(0.5)
    assert waiter.is_alive() and not got, "the second job did not wait for the layer being fitted"
    lt = LayerTransform(rotation=torch.eye(4, dtype=torch.float64))
    first.save(0, lt, [{"layer": 0, "path": "content", "error": 1.0, "error_none": 2.0}])
    waiter.join(10)
    assert torch.equal(got[0][0].rotation, lt.rotation) and got[0][1][0]["error"] == 1.0
    assert second.load(1) is None and first.load(0) is not None  # a layer nobody fitted: the caller fits it


# --- resources per model -------------------------------------------------------------------------------------------

def test_every_model_asks_for_resources_by_size():
    from conftest import options

    from hydra_plugins.mla_quant_launcher.launcher import RESOURCE_PARAMS, job_resources, launcher_overrides

    asked = {m: job_resources(compose([f"model={m}"]).model.resources, set()) for m in options("model")}
    assert all(set(r) == set(RESOURCE_PARAMS.values()) for r in asked.values())
    assert asked["toy_mla"]["gpus_per_node"] == 0 and asked["deepseek_v2_lite"]["gpus_per_node"] == 1
    assert asked["kimi_k2"]["gpus_per_node"] == 8 and asked["kimi_k2"]["mem_gb"] > asked["deepseek_v2_lite"]["mem_gb"]
    fixed = launcher_overrides(["hydra.launcher.gpus_per_node=2", "hydra/launcher=slurm"])
    assert fixed == {"gpus_per_node"} and "gpus_per_node" not in job_resources({"gpus": 8}, fixed)
    with pytest.raises(ValueError, match="unknown key"):
        job_resources({"gpu": 1}, set())


@pytest.mark.parametrize("model,expect", [
    ("kimi_k2", ["--gpus-per-node=8", "--mem=1900GB", "--time=2880", "--signal=USR2@120"]),
    ("toy_mla", ["--mem=8GB", "--time=60", "--cpus-per-task=2"]),
    ("deepseek_v2_lite", ["--gpus-per-node=1", "--mem=128GB", "--time=240"]),
])
def test_slurm_job_script_takes_the_models_resources(tmp_path, monkeypatch, model, expect):
    """The sbatch script submitit would submit for one job of `model` (an `srun` stand-in on PATH: no cluster)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from hydra_plugins.mla_quant_launcher.launcher import job_resources, make_executor

    (tmp_path / "srun").write_text("#!/bin/sh\n")
    (tmp_path / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = hydra_compose("config", overrides=["hydra/launcher=slurm", f"model={model}"], return_hydra_config=True)
    params = {k: v for k, v in OmegaConf.to_container(cfg.hydra.launcher, resolve=False).items()
              if k not in ("_target_", "name")}
    params["submitit_folder"] = str(tmp_path / "jobs")
    params.update(job_resources(OmegaConf.to_container(cfg.model.resources), set()))
    script = make_executor("slurm", params)._executor._make_submission_file_text("python job.py", "0")
    missing = [e for e in expect if e not in script]
    assert not missing, (missing, script)


def test_resources_override_outside_a_sweep_is_refused():
    out = run_cli(*SENSITIVITY, "model.resources.gpus=2", "hydra.run.dir=/tmp/unused-resources-run")
    assert out.returncode != 0 and "model.resources" in out.stderr and "--multirun" in out.stderr


def test_a_complete_run_whose_product_is_gone_runs_again(tmp_path, monkeypatch, capsys):
    """experiment=write_checkpoint writes its folder outside its run dir (task.out): with that folder deleted, the
    same configuration is not skipped for its complete record but writes the folder again."""
    root = tmp_path / "outputs"
    monkeypatch.setattr(runner, "output_root", lambda run_dir: root)
    out = tmp_path / "ckpt"
    cfg = compose(["experiment=write_checkpoint", "task.like=small_deepseek_v3", f"task.out={out}",
                   "task.gsm8k_problems=1", "logger=none"])
    runner.main(cfg, root / "a")
    assert runner.main(cfg, root / "b").reused == str(root / "a" / "record.json")  # the folder is there: skipped
    shutil.rmtree(out)
    again = runner.main(cfg, root / "c")
    assert again.reused is None and (out / "config.json").is_file()
    assert f"its product {out} is gone: running it again" in capsys.readouterr().out
