"""experiment=pipeline (the default run): every step a run with its own record, then the tables and figures."""

import json

import pytest
from conftest import REPO, compose, options, run_cli

from mla_quant.pipeline import selection

SMALL = ["experiment=pipeline", "logger=none", "task.methods=[none,quarot]", "task.formats=[int4_joint]",
         "task.peers=[hf_hqq_int2]",
         'task.cache_bytes=["task.contexts=[4096]"]',
         'task.sensitivity=["task.seeds=1","task.sweep_nmse=[0.01,0.04]","task.probe.num_sequences=2"]',
         'task.evaluate=["eval.control_no_rope.enabled=false","eval.tasks=[toy_niah_single_1,toy_niah_multikey_1]",'
         '"eval.data.niah_lengths=[256,512]","eval.data.niah_per_length=2"]']


def _run(args):
    return run_cli(*args)


def test_the_default_run_is_the_pipeline():
    cfg = compose([])
    assert cfg.task.name == "pipeline" and cfg.model._target_.endswith("load_toy_model")


@pytest.mark.slow
def test_pipeline_runs_every_step_then_reuses_them(tmp_path):
    root = tmp_path / "outputs"
    first = _run([*SMALL, f"hydra.run.dir={root}/first"])
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    steps = ["01_sensitivity", "02_cache_bytes", "03_calibrate-none-int4_joint", "04_calibrate-quarot-int4_joint",
             "05_evaluate-bf16", "06_evaluate-hf_hqq_int2", "07_evaluate-none-int4_joint",
             "08_evaluate-quarot-int4_joint"]
    for step in steps:
        rec = json.loads((root / "first" / step / "record.json").read_text())
        assert rec["status"] == "ok", step
    ev = json.loads((root / "first" / "07_evaluate-none-int4_joint" / "record.json").read_text())
    peer = json.loads((root / "first" / "06_evaluate-hf_hqq_int2" / "record.json").read_text())
    assert peer["choices"]["quant"] == "hf_hqq_int2" and peer["choices"]["transform"] == "none"
    assert ev["choices"]["quant"] == "int4_joint" and ev["choices"]["transform"] == "none"
    assert ev["choices"]["model"] == "toy_mla"
    top = json.loads((root / "first" / "record.json").read_text())
    scores = [ev["metrics"][f"eval/{t}/exact_match"] for t in ("toy_niah_single_1", "toy_niah_multikey_1")]
    assert top["metrics"]["pipeline/accuracy/none/int4_joint"] == pytest.approx(sum(scores) / 2)
    index = (root / "first" / "analysis" / "index.md").read_text()
    for artifact in ("amplification", "accuracy", "paired", "peers", "calibration", "ruler", "memory", "output_vs_injected_nmse",
                     "accuracy_vs_bytes", "memory_bytes_vs_context"):
        assert f"`{artifact}" in index, index
    assert "Accuracy, mean over tasks" in first.stdout and "analysis/index.md" in first.stdout
    vs_rtn = next(line for line in first.stdout.splitlines() if line.startswith("vs RTN on the same examples"))
    assert "quarot int4_joint" in vs_rtn and "none int4_joint" not in vs_rtn  # pooled over both tasks, one cell
    vs_peer = next(line for line in first.stdout.splitlines() if line.startswith("vs transformers' QuantizedCache"))
    assert vs_peer.count("vs hf_hqq_int2") == 2  # RTN and QuaRot at INT4, each paired with the peer
    assert "pipeline/accuracy/hf_hqq_int2" in top["metrics"]
    # a second run of the same configuration reuses every finished step and still builds every table
    second = _run([*SMALL, f"hydra.run.dir={root}/second"])
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert second.stdout.count(": reused (") == len(steps)  # one console line per step, the summary after
    assert "skipped, this configuration" in (root / "second" / steps[0] / "step.log").read_text()
    again = json.loads((root / "second" / "record.json").read_text())["metrics"]
    assert again["pipeline/accuracy/none/int4_joint"] == top["metrics"]["pipeline/accuracy/none/int4_joint"]
    assert again["pipeline/sensitivity/status"] == "reused"
    assert (root / "second" / "analysis" / "accuracy.md").read_text().count("int4_joint") >= 2


def test_pipeline_selection_and_idle_settings_are_refused(tmp_path):
    t = compose([]).task
    assert selection(t, ["quant=int2_joint"]) == (list(t.methods), ["int2_joint"])
    assert selection(t, ["transform=quantmla"]) == (["quantmla"], list(t.formats))
    with pytest.raises(ValueError, match="quant=int2_joint and task.formats"):
        selection(t, ["quant=int2_joint", "task.formats=[int4_joint]"])
    # calibration data settings where only RTN is evaluated (no calibrate step): no step would use them
    run = _run(["logger=none", "task.methods=[none]", "task.calibrate=null", "calib.samples=4",
                f"hydra.run.dir={tmp_path}"])
    assert run.returncode != 0 and "calib.samples=4" in run.stderr and "no step" in run.stderr, run.stderr[-2000:]
    assert not (tmp_path / "01_sensitivity").exists()  # refused before any step ran


def test_wandb_offline_gets_one_run_per_step_and_the_pipeline_tables_and_figures(tmp_path):
    run = _run(["experiment=pipeline", "logger=wandb", "task.methods=[none]", "task.formats=[int4_joint]",
                "task.sensitivity=null", "task.calibrate=null", 'task.cache_bytes=["task.contexts=[4096]"]',
                'task.evaluate=["eval.control_no_rope.enabled=false","eval.tasks=[toy_niah_single_1]",'
                '"eval.data.niah_lengths=[256]","eval.data.niah_per_length=2"]', f"hydra.run.dir={tmp_path}"])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for step in ("01_cache_bytes", "02_evaluate-bf16", "03_evaluate-none-int4_joint"):
        assert len(list((tmp_path / step / "wandb").glob("offline-run-*"))) == 1, step
    (top,) = (tmp_path / "wandb").glob("offline-run-*")
    media = top / "files" / "media"
    assert {p.name.split("_")[0] for p in (media / "table").glob("*.table.json")} >= {"accuracy", "memory"}
    assert any(p.name.startswith("memory_bytes_vs_context") for p in (media / "images").glob("*.png"))
    assert (top / "files" / "record.json").is_file()


def test_pipeline_mixed_steps_compose_per_method_and_budget():
    """task.mixed: one quant=mixed evaluation per method and budget, after the uniform formats, each composing as the
    evaluate experiment with that budget (the `mixed` table then pairs it with the uniform option of those bytes)."""
    from mla_quant.pipeline import step_config, steps

    t = compose(["task.mixed=[int2_content_int4_rope,int2_joint]"]).task
    names = [name for name, _ in steps(["none", "quantmla"], ["int2_content_int4_rope"], t)]
    assert names[-4:] == ["evaluate-none-mixed-int2_content_int4_rope", "evaluate-none-mixed-int2_joint",
                          "evaluate-quantmla-mixed-int2_content_int4_rope", "evaluate-quantmla-mixed-int2_joint"]
    from hydra import initialize_config_dir

    overrides = dict(steps(["quantmla"], ["int2_joint"], t))["evaluate-quantmla-mixed-int2_joint"]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg, choices, _ = step_config(overrides, ["quant.protected.recent=0"], reference=False)
    assert choices["quant"] == "mixed" and choices["transform"] == "quantmla" and cfg.task.name == "evaluate"
    assert cfg.quant.budget == "int2_joint" and cfg.quant.protected.recent == 0


@pytest.mark.every_family("model")
@pytest.mark.parametrize("model", [m for m in options("model") if not m.startswith("spec_")])
def test_the_headline_command_composes_every_step_for_every_model(model):
    """`python run.py model=<option> quant=int4_joint`: every step composes (nothing runs), each evaluation step with
    the model's own eval option and the pipeline's settings for it only (the toy's smaller suite on eval=toy)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from mla_quant.pipeline import compose_steps

    given = [f"model={model}", "quant=int4_joint"]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        top = hydra_compose("config", overrides=given)
        configs = compose_steps(top.task, given)
    names = [name for _, name, *_ in configs]
    assert names[0] == "sensitivity" and names[-1] == "evaluate-quantmla-int4_joint", names
    evals = [(cfg, choices) for _, name, cfg, choices, _ in configs if name.startswith("evaluate")]
    assert len(evals) == 4  # the BF16 reference and three methods at int4_joint
    for cfg, choices in evals:
        assert choices["model"] == model and choices["eval"] == top.eval.name
        if top.eval.name == "toy":
            assert cfg.eval.data.niah_per_length == 8 and not cfg.eval.control_no_rope.enabled
        else:
            assert "data" not in cfg.eval and cfg.eval == top.eval  # the model's eval option as configured
    quantized = [c for c, ch in evals if ch["quant"] == "int4_joint"]
    assert len(quantized) == 3 and all(c.quant.name == "int4_joint" for c in quantized)


def test_settings_per_eval_option_are_checked_and_the_command_line_wins():
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from mla_quant.pipeline import compose_steps

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        given = ["quant=int4_joint", "eval.data.niah_per_length=3"]
        configs = compose_steps(hydra_compose("config", overrides=given).task, given)
        assert all(cfg.eval.data.niah_per_length == 3 for _, n, cfg, *_ in configs if n.startswith("evaluate"))
        bad = ['+task.evaluate_per_eval.tpy=["eval.limit=2"]']
        with pytest.raises(ValueError, match=r"evaluate_per_eval.*\['tpy'\].*allowed.*'toy'"):
            compose_steps(hydra_compose("config", overrides=bad).task, bad)
