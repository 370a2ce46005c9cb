"""lm-eval glue: the generated toy task files, the latent-cache HFLM on the shipped model, the code-execution
opt-in, the context-length error and the no-RoPE control."""

from __future__ import annotations

import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from mla_quant.eval import task_utils  # noqa: E402
from mla_quant.eval.harness import ContextTooLong, LatentCacheHFLM, evaluate_tasks, rope_zeroed  # noqa: E402
from mla_quant.models.absorbed import model_layer_factory  # noqa: E402
from mla_quant.eval.task_files import CODE_TASKS, NIAH_TASKS, TOY_TASKS, write_task_files  # noqa: E402
from mla_quant.cache import LatentCacheLayer  # noqa: E402
from mla_quant.toy.model import load_toy_model, load_toy_tokenizer  # noqa: E402

CONF = Path(__file__).resolve().parents[1] / "conf"


@pytest.fixture(scope="module")
def tok():
    return load_toy_tokenizer()


@pytest.fixture(scope="module")
def model():
    return load_toy_model()


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory, tok):
    return write_task_files(tmp_path_factory.mktemp("tasks"), tok, niah_lengths=(256, 512), niah_per_length=3,
                            arithmetic_n=4, code_n=4)


def test_task_files_load_through_task_manager(task_dir, tok):
    from lm_eval.tasks import TaskManager

    loaded = TaskManager(include_path=[str(task_dir)], include_defaults=False).load(TOY_TASKS)
    tasks = {t.config.task: t for t in loaded["tasks"].values()} if isinstance(loaded, dict) else {}
    assert set(tasks) >= set(TOY_TASKS), sorted(tasks)
    niah_task = tasks["toy_niah_single_1"]
    niah_task.build_all_requests(limit=2, rank=0, world_size=1)
    inst = niah_task.instances[0]
    # the context lm-eval builds is exactly the training prompt format, and fits its length
    assert inst.args[0] == f"{inst.doc['input']} {inst.doc['gen_prefix']}"
    assert len(tok(inst.args[0]).input_ids) <= inst.doc["max_length"]
    gsm = tasks["toy_gsm8k"]
    names = [f["name"] if isinstance(f, dict) else getattr(f, "name", None) for f in gsm.config.filter_list]
    assert "strict-match" in names, names  # the stock gsm8k filters came along with the include
    assert gsm.config.num_fewshot == 0


def test_tiny_simple_evaluate_on_shipped_model(model, tok, task_dir):
    lm = LatentCacheHFLM(model, tok, batch_size=2)
    res = evaluate_tasks(lm, ["toy_gsm8k", "toy_niah_single_2"], task_dir, limit=2)
    scores = res["results"]
    assert 0.0 <= scores["toy_gsm8k"]["exact_match,strict-match"] <= 1.0
    assert 0.0 <= scores["toy_niah_single_2"]["exact_match,none"] <= 1.0
    assert lm.cache_calls >= 2  # every generate ran over a fresh latent cache


def test_the_environment_is_described_once_per_process(model, tok, task_dir, monkeypatch):
    """lm-eval describes the environment in every result (torch's collect_env, about 1 s of subprocesses): an
    evaluation of one task per call takes that description once and every result still carries it."""
    from torch.utils import collect_env

    calls = []

    def describe():
        calls.append(1)
        return f"the environment ({len(calls)})"

    monkeypatch.setattr(collect_env, "get_pretty_env_info", describe)
    lm = LatentCacheHFLM(model, tok, batch_size=2)
    results = [evaluate_tasks(lm, [task], task_dir, limit=1) for task in ("toy_gsm8k", "toy_niah_single_2")]
    assert len(calls) == 1 and [r["pretty_env_info"] for r in results] == ["the environment (1)"] * 2
    assert collect_env.get_pretty_env_info is describe  # restored after each evaluation


def test_code_execution_refused_without_opt_in(monkeypatch, task_dir, model, tok):
    from mla_quant.stages.evaluate import code_tasks_allowed

    monkeypatch.delenv(task_utils.ALLOW_ENV, raising=False)
    assert code_tasks_allowed(TOY_TASKS, allow=False) == [t for t in TOY_TASKS if t not in CODE_TASKS]
    with pytest.raises(task_utils.CodeExecutionRefused, match="allow_code_execution=true"):
        task_utils.run_program("print('hi')\n")
    # lm-eval itself also refuses the unsafe task without confirm_run_unsafe_code
    lm = LatentCacheHFLM(model, tok, batch_size=2)
    with pytest.raises(ValueError, match="(?i)unsafe"):
        evaluate_tasks(lm, ["toy_humaneval"], task_dir, limit=1, allow_code_execution=False)


def test_code_execution_scores_with_opt_in(monkeypatch):
    monkeypatch.setenv(task_utils.ALLOW_ENV, "1")
    doc = {"prompt": "def f(n: int) -> int:\n    \"\"\"Return n plus 2.\"\"\"\n",
           "test": "def check(candidate):\n    assert candidate(1) == 3\n", "entry_point": "f"}
    assert task_utils.humaneval_process_results(doc, ["    return n + 2\n"]) == {"pass@1": 1.0}
    assert task_utils.humaneval_process_results(doc, ["    return n + 3\n"]) == {"pass@1": 0.0}
    assert task_utils.humaneval_process_results(doc, ["    return n + 2\ndef g():\n    raise\n"]) == {"pass@1": 1.0}
    passed, reason = task_utils.run_program("while True:\n    pass\n", timeout=0.5)
    assert not passed and reason == "timeout"


def test_niah_scoring():
    doc = {"outputs": ["1234567"], "max_length": 512}
    assert task_utils.niah_process_results(doc, [" 1234567"])["exact_match"] == 1.0
    scores = task_utils.niah_process_results(doc, [" 1234567 and more"])
    assert scores["em_512"] == 1.0 and scores["em_256"] == -1.0
    assert task_utils.niah_process_results(doc, [" 123456"])["exact_match"] == 0.0
    assert task_utils.mean_ignoring_missing([1.0, -1.0, 0.0]) == 0.5


def test_context_too_long_names_the_limit(model, tok):
    lm = LatentCacheHFLM(model, tok, batch_size=1)
    with pytest.raises(ContextTooLong, match="1024"):
        lm.tok_batch_encode(["word " * 2000], left_truncate_len=1024 - 48)
    with pytest.raises(ContextTooLong, match="1024"):
        lm._model_call(torch.zeros(1, 1100, dtype=torch.long))


def test_rope_zeroed_changes_logits_and_restores(model, tok):
    ids = tok("The grass is green. One of the special magic numbers for x is: 12.", return_tensors="pt").input_ids
    inv = model.model.rotary_emb.inv_freq.clone()
    with torch.no_grad():
        ref = model(ids).logits
        with rope_zeroed(model):
            assert model.model.rotary_emb.inv_freq.abs().max() == 0
            zeroed = model(ids).logits
        again = model(ids).logits
    assert torch.equal(model.model.rotary_emb.inv_freq, inv)
    assert (ref - zeroed).abs().max() > 1e-3 and torch.allclose(ref, again)


def test_model_layer_factory_hook(model):
    import hydra

    with hydra.initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = hydra.compose("config", overrides=["experiment=evaluate", "logger=none"])
        layer = model_layer_factory(model, cfg.quant)()
        assert cfg.quant.name == "bf16" and isinstance(layer, LatentCacheLayer) and not layer.quantized  # exact
        # the release option as written: its content groups come from the toy's quant_group_size (32 | d_c = 96)
        cfg = hydra.compose("config", overrides=["experiment=evaluate", "logger=none", "quant=int4_joint"])
        factory = model_layer_factory(model, cfg.quant)
        assert factory is not None and callable(factory)
        from mla_quant.models.absorbed import cache_kwargs, new_cache

        ids = torch.arange(3, 200).unsqueeze(0)
        with torch.no_grad():
            exact = model(ids, **cache_kwargs(new_cache(model))).logits
            quant = model(ids, **cache_kwargs(new_cache(model, factory))).logits
        assert torch.isfinite(quant).all() and not torch.equal(exact, quant)


def test_names_of_tasks():
    assert set(NIAH_TASKS) == {"toy_niah_single_1", "toy_niah_single_2", "toy_niah_single_3", "toy_niah_multikey_1"}


def test_evaluate_stage_rejects_lengths_beyond_the_model(tmp_path):
    import hydra

    from mla_quant.stages.evaluate import run

    with hydra.initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = hydra.compose("config", overrides=["experiment=evaluate", "logger=none",
                                                 "eval.data.niah_lengths=[512,2048]"])
    with pytest.raises(ContextTooLong, match=r"\[2048\].*limit of 1024"):
        run(cfg, tmp_path)
