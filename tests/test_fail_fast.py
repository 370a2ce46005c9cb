"""A bad setting fails in seconds, before any weight is read: every refusal here is checked on a checkpoint folder
whose weight files are garbage, so an error that came after loading weights would be a safetensors error instead."""

import json
import re
import shutil
import subprocess
import sys

import pytest
from conftest import REPO, compose

from mla_quant.eval.suites import check_eval


def run_py(*args, timeout=300):
    return subprocess.run([sys.executable, "run.py", *args, "logger=none"], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


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
                         f"task.data.data_files={{test:{text}}}"]) == "text"
    with pytest.raises(ValueError, match="task.data.data_files is set but task.data.source resolves to 'random'"):
        _stage_check(["experiment=quality", *REAL, f"model.path={garbage}", "task.data.source=random",
                      f"task.data.data_files={{test:{text}}}"])


def test_the_pipeline_checks_every_step_before_the_first_runs(garbage, tmp_path):
    """A setting only the evaluation steps read (eval.limit=0) stops the pipeline before its sensitivity step: no
    step folder is written, the error names the step and the setting, in seconds."""
    text = tmp_path / "train.jsonl"
    text.write_text("".join(json.dumps({"text": f"line {i} of local text"}) + "\n" for i in range(20)))
    out = run_py(*REAL, f"model.path={garbage}", "quant=int4_joint", f"calib.data_files={{train:{text}}}",
                 "eval=gsm8k", "eval.limit=0", f"hydra.run.dir={tmp_path / 'run'}")
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
