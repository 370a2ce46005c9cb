"""Every `python run.py ...` line of README.md and experiments/README.md composes as written, reads only config
groups its experiment uses, and validates against its model; the cheap ones run."""

import re
import json
import shlex
from pathlib import Path

import pytest
from conftest import compose, run_cli

from mla_quant.prepare import model_dims, validate
from mla_quant.stages import refuse_unused_groups

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", REPO / "experiments" / "README.md"]
REAL = {"deepseek_v2_lite", "deepseek_v2_lite_chat", "deepseek_v3", "kimi_k2", "deepseek_v32", "glm4_7_flash",
        "longcat_flash", "minicpm3_4b", "axk1", "sarvam_105b", "youtu_llm_2b", "mistral_small4", "glm5", "axk2",
        "hy4_preview", "hy4", "kimi_linear_48b", "ling3"}


def documented_commands() -> list[str]:
    cmds = []
    for doc in DOCS:
        for m in re.finditer(r"python run\.py[^`\n#]*", doc.read_text()):
            cmd = m.group(0).strip()
            if "<" not in cmd:  # placeholders like model=<model> are templates, not commands
                cmds.append(cmd)
    return sorted(set(cmds))


def overrides_of(cmd: str) -> list[list[str]]:
    """The override lists one command runs: a --multirun sweep expands its comma lists (first and last value)."""
    args = [a for a in shlex.split(cmd)[2:] if a not in ("--multirun", "-m", "--help")]
    args = [a for a in args if not a.startswith("hydra")]
    runs = [[]]
    for a in args:
        key, _, value = a.partition("=")
        if "," in value and not value.startswith("["):
            values = value.split(",")
            runs = [r + [f"{key}={v}"] for r in runs for v in (values[0], values[-1])]
        else:
            runs = [r + [a] for r in runs]
    return runs


COMMANDS = documented_commands()


def test_the_docs_have_commands():
    assert len(COMMANDS) >= 15, COMMANDS


@pytest.mark.parametrize("cmd", COMMANDS)
def test_documented_command_composes_and_validates(cmd):
    if cmd.endswith("--help"):
        return
    for overrides in overrides_of(cmd):
        cfg = compose(overrides)
        refuse_unused_groups(cfg.task, overrides)
        model = next((o.split("=", 1)[1] for o in overrides if o.startswith("model=")), None)
        uses = set(cfg.task.get("uses") or [])
        if "model" in uses and model not in REAL:
            validate(cfg, model_dims(cfg.model), quant="quant" in uses)


@pytest.mark.parametrize("cmd", ["python run.py experiment=cache_bytes",
                                 "python run.py experiment=evaluate quant=int4_joint",
                                 "python run.py experiment=evaluate quant=int2_content_int4_rope transform=quantmla"])
def test_cheap_documented_commands_run(cmd, tmp_path):
    assert cmd in COMMANDS or any(c.startswith(cmd + " ") for c in COMMANDS), f"{cmd!r} is not documented"
    extra = ["logger=none", f"hydra.run.dir={tmp_path}"]
    if "quant=" in cmd:  # the evaluation, kept small
        extra += ["eval.limit=2", "eval.control_no_rope.enabled=false", "eval.data.niah_lengths=[256]"]
    else:
        extra += ["task.contexts=[4096]"]
    if "transform=quantmla" in cmd:  # calibration, kept small
        extra += ["transform.fit.steps=3", "calib.samples=4", "calib.seq_len=64",
                  f"transform.fit.cache_dir={tmp_path}/calibration"]
    run = run_cli(*shlex.split(cmd)[2:], *extra)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert (tmp_path / "record.json").is_file()
    if "transform=quantmla" in cmd:  # calibrated, stored, and recorded with the evaluation
        metrics = json.loads((tmp_path / "record.json").read_text())["metrics"]
        assert metrics["calib/transform"] == "quantmla" and metrics["calib/format"] == "int2_content_int4_rope"
        assert list((tmp_path / "calibration").glob("deepseek_v2-quantmla-*.safetensors"))
        assert "eval/toy_niah_single_1/exact_match_stderr" in metrics  # lm-eval's standard error, recorded
