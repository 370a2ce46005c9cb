"""A bad setting fails in seconds, before any weight is read: every refusal here is checked on a checkpoint folder
whose weight files are garbage, so an error that came after loading weights would be a safetensors error instead."""

import json
import re
import shutil

import pytest
from conftest import compose, run_cli

from mla_quant.eval.suites import check_eval


def run_py(*args):
    return run_cli(*args, "logger=none")


@pytest.fixture(scope="module")
def garbage(tmp_path_factory):
    """A V2-Lite-shaped folder (small dims) whose every weight file is garbage: nothing may read it."""
    root = tmp_path_factory.mktemp("garbage")
    out = run_py("experiment=write_checkpoint", "task.like=small_deepseek_v2", f"task.out={root / 'ckpt'}",
                 f"hydra.run.dir={root / 'run'}")
    assert out.returncode == 0, out.stderr[-2000:]
    for shard in (root / "ckpt").glob("*.safetensors"):
        shard.write_bytes(b"\x00garbage" * 64)
    return root / "ckpt"


REAL = ["model=deepseek_v2_lite", "model.dtype=float32", "model.device_map=null", "model.quant_group_size.wide=16",
        "model.quant_group_size.narrow=8"]


def _stage_check(args: list[str]):
    """The stage's own check of `python run.py <args>` (what its run does before any weight), in this process."""
    import importlib

    from mla_quant.stages import nested_overrides

    cfg = compose(args)
    module = importlib.import_module(cfg.task._target_.rsplit(".", 1)[0])
    with nested_overrides(args):
        return module.check(cfg)


@pytest.mark.parametrize("value", [0, -1, 1.5, "all"])
def test_eval_limit_is_refused_by_name(value):
    with pytest.raises(ValueError, match=r"eval.limit=.*allowed: null .* integer >= 1 .* fraction in \(0, 1\]"):
        check_eval(compose(["experiment=evaluate", f"eval.limit={value}"]).eval)


@pytest.mark.parametrize("setting,named", [
    ("eval.batch_size=0", "eval.batch_size=0"), ("eval.threads=-2", "eval.threads=-2"),
    ("eval.num_fewshot=-1", "eval.num_fewshot=-1"), ("eval.gen_kwargs={max_gen_toks:0}", "eval.gen_kwargs.max_gen_toks=0"),
    ("eval.gen_kwargs=5", "eval.gen_kwargs=5"), ("eval.log_samples=maybe", "eval.log_samples='maybe'"),
    ("eval.data.niah_per_length=0", "eval.data.niah_per_length=0"), ("eval.data.niah_lengths=[]", "eval.data.niah_lengths=[]"),
    ("eval.control_no_rope.enabled=2", "eval.control_no_rope.enabled=2"), ("eval.tasks=[]", "eval.tasks=[]")])
def test_every_eval_value_is_checked(setting, named):
    with pytest.raises(ValueError, match=re.escape(named) + ".*; allowed: "):
        check_eval(compose(["experiment=evaluate", setting]).eval)


def test_the_release_eval_options_pass_their_own_check():
    for option in ("toy", "gsm8k", "humaneval", "ruler", "paper"):
        check_eval(compose(["experiment=evaluate", f"eval={option}"]).eval)
    check_eval(compose(["experiment=evaluate", "eval.limit=0.5", "eval.num_fewshot=0"]).eval)


def test_a_folder_without_tokenizer_files_is_named_before_the_weights(garbage, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(garbage, folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
    with pytest.raises(OSError, match=r"model.tokenizer.path='.*ckpt' has no tokenizer files .*tokenizer.json.*"
                                      r"tokenizer_config.json is missing too"):
        _stage_check(["experiment=evaluate", *REAL, f"model.path={folder}", "eval=gsm8k"])


def test_offline_text_is_named_before_the_weights(garbage):
    """experiment=quality on a checkpoint reads WikiText-2's test split: offline, the setting and the local-file
    alternative are named, not a datasets error after every weight loaded."""
    with pytest.raises(OSError, match=r"task.data.dataset='wikitext'.*point task.data.data_files at local files"):
        _stage_check(["experiment=quality", *REAL, f"model.path={garbage}"])
    with pytest.raises(OSError, match=r"calib.dataset='wikitext'.*point calib.data_files at local files"):
        _stage_check(["experiment=calibrate", *REAL, f"model.path={garbage}", "transform=quantmla",
                      "quant=int4_joint"])


def test_local_text_files_pass_the_check(garbage, tmp_path):
    text = tmp_path / "train.jsonl"
    text.write_text("".join(json.dumps({"text": f"line {i} of local text"}) + "\n" for i in range(20)))
    assert _stage_check(["experiment=quality", *REAL, f"model.path={garbage}", "task.data.source=text",
                         f"task.data.data_files={{test:{text}}}", "task.data.samples=2", "task.data.seq_len=64"]) == "text"
    with pytest.raises(ValueError, match="task.data.data_files is set but task.data.source resolves to 'random'"):
        _stage_check(["experiment=quality", *REAL, f"model.path={garbage}", "task.data.source=random",
                      f"task.data.data_files={{test:{text}}}"])


def test_the_pipeline_checks_every_step_before_the_first_runs(garbage, tmp_path):
    """A setting only the evaluation steps read (eval.limit=0) stops the pipeline before its sensitivity step: no
    step folder is written, the error names the step and the setting, in seconds."""
    text = tmp_path / "train.jsonl"
    text.write_text("".join(json.dumps({"text": f"line {i} of local text"}) + "\n" for i in range(20)))
    out = run_py(*REAL, f"model.path={garbage}", "quant=int4_joint", f"calib.data_files={{train:{text}}}",
                 "calib.samples=2", "calib.seq_len=64", "eval=gsm8k", "eval.limit=0", f"hydra.run.dir={tmp_path / 'run'}")
    assert out.returncode != 0
    assert "step evaluate-bf16" in out.stderr and "refused before any step ran" in out.stderr, out.stderr[-2000:]
    assert "eval.limit=0" in out.stderr, out.stderr[-2000:]
    assert not list((tmp_path / "run").glob("0*_*")), sorted(p.name for p in (tmp_path / "run").iterdir())


@pytest.mark.parametrize("block", [
    {"format": "int", "bits": 4, "group_size": 16, "scale_dtype": "fp16"},
    {"format": "channel_block", "bits": 2, "token_block": 4, "granularity": "channel", "scale_dtype": "fp16"}])
def test_fake_quantizer_refuses_overflowing_scales_by_path(block):
    """What task.noise=quantizer, the mixed allocation and the calibration objectives quantize with: values whose
    zeros overflow an fp16 scale (|x| ~ 1e5) are refused naming the path, never read back as inf (then NaN)."""
    import torch

    from mla_quant.quant.formats import fake_quantizer

    q = fake_quantizer(block, 32, "content")
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(q(x)).all() and not torch.equal(q(x), x)
    with pytest.raises(ValueError, match=r"quant.content \(.*\): the stored (zeros|scales) \(float16\) overflow"):
        q(x * 1e5)
    fp32 = fake_quantizer({**block, "scale_dtype": "fp32"}, 32, "content")
    assert torch.isfinite(fp32(x * 1e5)).all()


def test_a_probe_too_short_for_its_needle_prompts_is_refused_before_the_weights(garbage):
    with pytest.raises(ValueError, match=r"task.probe.seq_len=64 \(task.probe.source=auto.*too short"):
        _stage_check(["experiment=sensitivity", *REAL, f"model.path={garbage}", "task.probe.seq_len=64"])


# --- the memory plan --------------------------------------------------------------------------------------------


def test_a_run_that_cannot_fit_is_refused_before_the_weights_naming_what_would(garbage, monkeypatch):
    """128 sequences of 64K tokens: the plan's peak (~70 GB of logits alone) exceeds a machine with 16 GB free; the
    refusal gives the numbers and a batch that fits, before the garbage weights are touched."""
    import mla_quant.plan

    monkeypatch.setattr(mla_quant.plan, "available_bytes", lambda device, spread=False: 16e9)
    available_bytes = mla_quant.plan.available_bytes

    args = ["experiment=quality", *REAL, f"model.path={garbage}", "+model.config.max_position_embeddings=65536",
            "task.data.source=random", "task.data.seq_len=65536", "task.batch_size=128", "task.data.samples=128"]
    with pytest.raises(MemoryError, match=r"quality needs about [\d.]+ GB on cpu .* GB are available \(forward "
                                          r"workspace .*task.batch_size=\d+ fits") as err:
        _stage_check(args)
    fits = int(re.search(r"task.batch_size=(\d+) fits", str(err.value)).group(1))
    from mla_quant.plan import memory_plan
    from mla_quant.prepare import model_config

    cfg = compose([*args[:-2], f"task.batch_size={fits}"])
    smaller = memory_plan(cfg, model_config(cfg.model))
    assert 1 <= fits < 128 and smaller.peak <= available_bytes("cpu")
    assert _stage_check([*args, "memory_plan=report"]) == "random"  # predicted, not refused


def test_the_plan_counts_the_parameters_the_model_has():
    """Counted on the meta device from the config alone, equal to the built model's parameters, for every family."""
    from mla_quant.plan import parameter_count
    from mla_quant.prepare import build_model, model_config

    for model in ("toy_mla", "tiny_deepseek_v2", "tiny_deepseek_v3", "tiny_minicpm3", "tiny_longcat_flash"):
        cfg = compose([f"model={model}"])
        built = build_model(cfg.model, absorbed=False)
        assert parameter_count(model_config(cfg.model)) == sum(p.numel() for p in built.parameters()), model


@pytest.mark.parametrize("queries", [None, 8])
def test_the_calibrate_plan_counts_the_capture_calibration_holds(queries):
    """The plan's capture bytes equal the tensors of a real capture (all queries, or calib.query_tokens of them),
    reference outputs included."""
    import torch

    from mla_quant.calibration.capture import capture_layers
    from mla_quant.calibration.objectives import reference_output
    from mla_quant.plan import capture_bytes
    from mla_quant.prepare import build_model

    model = build_model(compose(["model=tiny_deepseek_v2"]).model, absorbed=False, dtype="float32")
    ids = torch.randint(3, model.config.vocab_size, (3, 32), generator=torch.Generator().manual_seed(0))
    cap = next(iter(capture_layers(model, ids, batch_size=2, query_tokens=queries)))
    reference_output(cap)
    held = sum(t.numel() * t.element_size() for t in (cap.x_hat, cap.q_latent, cap.q_rope, cap.k_rope, cap.ref_out))
    assert held == capture_bytes(model.config, 3, 32, queries or 32)


def test_what_a_stage_holds_on_the_host_counts_on_the_cpu_only():
    """lm-eval's loaded tasks (measured before the weights) are part of a CPU run's peak, not of a GPU's."""
    from mla_quant.plan import memory_plan
    from mla_quant.prepare import model_config

    cfg = compose(["experiment=evaluate", "model=toy_mla"])
    config = model_config(cfg.model)
    cpu = memory_plan(cfg, config, host={"lm-eval tasks": 1e8})
    assert cpu.peak - memory_plan(cfg, config).peak == pytest.approx(1e8) and "| lm-eval tasks | 0.100 |" in cpu.table()
    assert cpu.metrics() == memory_plan(cfg, config).metrics()  # measured on this machine: not a run's metric
    assert memory_plan(cfg, config, device="cuda:0", host={"lm-eval tasks": 1e8}).peak == \
        pytest.approx(memory_plan(cfg, config, device="cuda:0").peak)


def test_memory_plan_is_refused_where_nothing_reads_it(tmp_path):
    out = run_py("experiment=cache_bytes", "memory_plan=report", f"hydra.run.dir={tmp_path}")
    assert out.returncode != 0 and "experiment=cache_bytes has no memory plan" in out.stderr, out.stderr[-2000:]
    with pytest.raises(ValueError, match=r"memory_plan='maybe'; allowed: \['check', 'report', 'off'\]"):
        from mla_quant.plan import mode_of

        mode_of(compose(["experiment=quality", "memory_plan=maybe"]))


def test_too_little_local_text_is_refused_before_the_weights(garbage, tmp_path):
    text = tmp_path / "train.jsonl"
    text.write_text("".join(json.dumps({"text": f"line {i} of local text"}) + "\n" for i in range(20)))
    with pytest.raises(ValueError, match=r"the calibration text from the local files calib.data_files has \d+ tokens "
                                         r"in all; calib.samples x calib.seq_len = 8 x 256 needs 2048"):
        _stage_check(["experiment=calibrate", *REAL, f"model.path={garbage}", "transform=quantmla", "quant=int4_joint",
                      f"calib.data_files={{train:{text}}}", "calib.samples=8", "calib.seq_len=256"])
