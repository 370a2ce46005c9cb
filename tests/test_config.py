"""Every config group composes, every option of every group composes and instantiates (or fails clearly)."""

import subprocess
import sys

import pytest
from conftest import CONF, REPO, compose, options
from hydra.errors import ConfigCompositionException, MissingConfigException
from hydra.utils import instantiate

from mla_quant.prepare import build_model
from omegaconf import OmegaConf

GROUPS = ["model", "quant", "transform", "objective", "calib", "eval", "attention", "experiment", "logger"]


def test_groups_exist_with_options():
    for group in GROUPS + ["hydra/launcher"]:
        assert options(group), f"conf/{group}/ has no options"


@pytest.mark.parametrize("group", GROUPS)
def test_every_option_composes(group):
    for option in options(group):
        cfg = compose([f"{group}={option}"])
        OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves


@pytest.mark.parametrize("option", [o for o in options("model") if o.startswith("tiny_")])
def test_tiny_models_instantiate_with_cli_overrides(option):
    text = "text_config." if "text_config" in compose([f"model={option}"]).model.config else ""  # multimodal
    cfg = compose([f"model={option}", f"model.config.{text}kv_lora_rank=40"])
    model = build_model(cfg.model)
    attn = model.mla_family.attention_modules(model)[0]
    assert attn.kv_lora_rank == 40
    assert type(attn).__name__.startswith("Absorbed")


def _pretrained_options():
    return [o for o in options("model") if "pretrained_model" in (CONF / "model" / f"{o}.yaml").read_text()]


@pytest.mark.parametrize("option", _pretrained_options())
def test_real_checkpoints_fail_offline_naming_id_and_path(option, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty cache: nothing to find offline
    cfg = compose([f"model={option}"])
    with pytest.raises(Exception) as err:  # hydra wraps the OSError in an InstantiationException
        build_model(cfg.model)
    msg = str(err.value)
    assert cfg.model.hf_id in msg and "model.path" in msg, msg


def test_quant_options_share_one_shape():
    """The project's formats share bf16.yaml's keys; a peer option (transformers' cache) has name and peer only;
    quant=mixed has bf16.yaml's keys (its paths without format and bits) and its allocation's."""
    shape = None
    for option in options("quant"):
        q = compose([f"quant={option}"]).quant
        if "peer" in q:
            assert sorted(q) == ["name", "peer"] and sorted(q.peer) == ["bits", "group_size", "library",
                                                                       "residual_length"], option
            continue
        if "budget" in q:
            bf16 = compose(["quant=bf16"]).quant
            assert sorted(q) == sorted([*bf16, "budget", "choices", "allocation"]), option
            assert sorted(q.content) == sorted(set(bf16.content) - {"format", "bits"}), option
            assert sorted(q.rope) == sorted(q.content) and sorted(q.choices) == ["content", "rope"], option
            continue
        keys = (sorted(q), sorted(q.content), sorted(q.rope), sorted(q.protected))
        shape = shape or keys
        assert keys == shape, f"quant={option} has keys {keys}, expected {shape}"


def test_loggers_instantiate():
    for option in options("logger"):
        logger = instantiate(compose([f"logger={option}"]).logger)
        assert hasattr(logger, "log_metrics")


def test_unknown_option_lists_the_choices():
    with pytest.raises((ConfigCompositionException, MissingConfigException)) as err:
        compose(["model=tiny_gpt2"])
    assert "tiny_deepseek_v3" in str(err.value)


def test_help_lists_groups_and_options():
    out = subprocess.run([sys.executable, "run.py", "--help"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for text in ["model:", "quant:", "experiment:", "tiny_deepseek_v3", "deepseek_v2_lite", "equivalence"]:
        assert text in out.stdout, f"{text!r} missing from --help"
