"""The paper's evaluation options: stock lm-eval tasks by name, offline errors before model work, local data."""

import datasets
import huggingface_hub
import pytest
from conftest import REPO, compose

from mla_quant import runner
from mla_quant.eval.suites import DatasetUnavailable, plan_tasks, registry, with_metadata
from mla_quant.eval.task_files import TOY_TASKS
from mla_quant.record import load_records
from mla_quant.stages import evaluate

FIXTURE = REPO / "tests" / "fixtures" / "gsm8k"


def test_real_checkpoints_default_to_the_paper_evaluation():
    assert compose(["model=deepseek_v2_lite"]).eval.name == "paper"
    assert compose(["model=kimi_k2", "experiment=evaluate"]).eval.name == "paper"
    assert compose(["model=deepseek_v2_lite", "eval=gsm8k"]).eval.name == "gsm8k"  # the command line wins
    assert compose([]).eval.name == "toy" and compose(["model=toy_mla"]).eval.name == "toy"
    assert compose(["model=deepseek_v2_lite", "experiment=export"]).eval.name == "none"  # export reads no eval


@pytest.mark.parametrize("option", ["gsm8k", "humaneval", "ruler", "paper"])
def test_stock_task_names_resolve_in_the_registry_without_downloading(option):
    ev = compose([f"eval={option}"]).eval
    plan = plan_tasks(ev, TOY_TASKS)
    assert plan.stock == list(ev.tasks) and not plan.toy
    assert set(plan.stock) <= set(registry().all_tasks)
    assert (option in ("ruler", "paper")) == bool(plan.ruler)


def test_tasks_with_metadata_are_built_from_the_registrys_yamls():
    """RULER's tasks, built with their lengths, come from the same YAMLs as in lm-eval's full index (the manager
    indexes only their folders), with the metadata set."""
    ruler = list(compose(["eval=ruler"]).eval.tasks)
    tm = with_metadata(ruler, {"max_seq_lengths": [512]})
    assert tm.metadata == {"max_seq_lengths": [512]} and len(tm.all_tasks) < len(registry().all_tasks) / 100
    for task in ruler:
        assert tm.task_index[task].yaml_path == registry().task_index[task].yaml_path, task


def test_bad_task_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="gsm9k"):
        plan_tasks(compose(["eval=gsm8k", "eval.tasks=[gsm9k]"]).eval, TOY_TASKS)
    with pytest.raises(ValueError, match="eval.ruler.lengths"):
        plan_tasks(compose(["eval.tasks=[niah_single_1]", "eval.ruler.lengths=[]"]).eval, TOY_TASKS)
    with pytest.raises(ValueError, match="humaneval"):  # local data for a task this run does not evaluate
        plan_tasks(compose(["eval=gsm8k", "eval.data_files={humaneval:{test:x.jsonl}}"]).eval, TOY_TASKS)
    with pytest.raises(ValueError, match="toy_gsm8k.*eval=toy"):
        plan_tasks(compose(["eval=gsm8k", "eval.tasks=[toy_gsm8k]"]).eval, TOY_TASKS)


def test_code_tasks_are_dropped_without_opt_in():
    assert evaluate.code_tasks_allowed(["gsm8k", "humaneval", "toy_humaneval", "toy_gsm8k"], False) == [
        "gsm8k", "toy_gsm8k"]
    assert evaluate.code_tasks_allowed(["gsm8k", "humaneval"], True) == ["gsm8k", "humaneval"]


def _refuse_model_work(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("the model was prepared before the task data was checked")

    monkeypatch.setattr(evaluate, "prepare_model", fail)


def test_offline_stock_task_fails_before_model_work_naming_the_dataset(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    _refuse_model_work(monkeypatch)
    cfg = compose(["experiment=evaluate", "logger=none", "eval=gsm8k"])
    with pytest.raises(DatasetUnavailable, match="'gsm8k'.*openai/gsm8k.*eval.data_files.gsm8k"):
        evaluate.run(cfg, tmp_path)
    bad = compose(["experiment=evaluate", "logger=none", "eval=gsm8k", f"eval.data_files={{gsm8k:{{test:{tmp_path}/missing.jsonl}}}}"])
    with pytest.raises(DatasetUnavailable, match="missing.jsonl"):
        evaluate.run(bad, tmp_path)


def test_ruler_lengths_beyond_the_model_are_refused_before_model_work(tmp_path, monkeypatch):
    _refuse_model_work(monkeypatch)
    cfg = compose(["experiment=evaluate", "logger=none", "eval=ruler", "eval.ruler.lengths=[512,4096]"])
    with pytest.raises(ValueError, match=r"eval.ruler.lengths: \[4096\] exceeds .*1024"):
        evaluate.run(cfg, tmp_path)


def test_local_gsm8k_runs_through_the_stock_task_with_the_quantized_cache(tmp_path, monkeypatch):
    """lm-eval's own gsm8k YAML (prompt, filters, metric) over local JSONL files, the toy model, an INT4 cache."""
    run_dir = tmp_path / "run"
    monkeypatch.setattr(runner, "run_dir_of", lambda cfg: run_dir)
    files = f"eval.data_files={{gsm8k:{{train:{FIXTURE}/train.jsonl,test:{FIXTURE}/test.jsonl}}}}"
    runner.main(compose(["experiment=evaluate", "logger=none", "eval=gsm8k", files, "eval.num_fewshot=1", "eval.limit=2",
                           "eval.gen_kwargs={max_gen_toks:24}", "quant=int4_joint", "quant.protected.recent=0"]))
    (rec,) = load_records(run_dir)
    m = rec["metrics"]
    assert rec["status"] == "ok" and rec["config"]["quant"]["name"] == "int4_joint"
    assert 0.0 <= m["eval/gsm8k/exact_match"] <= 1.0 and "eval/gsm8k/exact_match_stderr" in m
    assert "eval/gsm8k/exact_match@flexible-extract" in m
    assert m["eval/cache_calls"] >= 1  # generation ran over a fresh (quantized) latent cache
    local = (run_dir / "lm_eval_tasks" / "local" / "gsm8k.yaml").read_text()
    assert "gsm8k.yaml" in local and "dataset_path: json" in local and str(FIXTURE) in local


def test_stock_ruler_task_runs_at_the_configured_length(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    monkeypatch.setattr(runner, "run_dir_of", lambda cfg: run_dir)
    runner.main(compose(["experiment=evaluate", "logger=none", "eval=ruler", "eval.tasks=[niah_single_1]", "eval.ruler.lengths=[512]",
                           "eval.limit=2", "eval.batch_size=2", "eval.gen_kwargs={max_gen_toks:12}",
                           "quant=int2_content_int4_rope"]))
    (rec,) = load_records(run_dir)
    assert 0.0 <= rec["metrics"]["eval/niah_single_1/512"] <= 1.0
    assert not any(k.startswith("eval/niah_single_1/4096") for k in rec["metrics"])  # lengths not run: absent
