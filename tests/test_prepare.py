"""The one preparation step: settings are validated against the model's dims before any weight is read (real
checkpoints too), a family that does not fit the checkpoint is refused, and no setting does nothing."""

import json

import pytest
from conftest import compose

from mla_quant.prepare import build_model, model_dims, prepare_model
from mla_quant.stages import refuse_unused_groups


@pytest.fixture
def config_only_checkpoint(tmp_path):
    """A folder with a DeepSeek-V2 config.json and no weights at all."""
    model = build_model(compose(["model=tiny_deepseek_v2"]).model, absorbed=False)
    config = model.config.to_dict()
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_dims_come_from_config_json_without_weights(config_only_checkpoint):
    cfg = compose(["model=deepseek_v2_lite", f"model.path={config_only_checkpoint}"])
    assert model_dims(cfg.model) == {"d_c": 32, "d_r": 8, "layers": 2, "layer_dims": [(32, 8), (32, 8)],
                                     "context": 512}


@pytest.mark.parametrize("override, match", [
    ("quant.content.bits=5", r"quant.content.bits=5 is not a width of format=int"),
    ("quant.content.group_size=48", r"quant.content.group_size=48 does not divide the path dimension 32"),
    ("transform.content.kind=givens", r"transform.content.kind='givens'; allowed: \['none', 'hadamard'"),
    ("objective.rope.kind=logits", r"objective.rope.kind='logits'; allowed: \['positional_qk', 'cache_mse', 'next_token_kl'\]"),
    ("transform=quantmla calib.samples=0", r"calib.samples=0: need at least one calibration sequence"),
    ("transform=quantmla calib.seq_len=4", r"calib.seq_len=4 is too short"),
    ("transform=quantmla calib.split=test", r"calib.split='test' is the evaluation split"),
    ("transform=smoothquant calib.source=text calib.dataset=null", r"calib.source=text needs calib.dataset"),
])
def test_bad_settings_fail_before_any_weight_is_read(config_only_checkpoint, override, match):
    cfg = compose(["model=deepseek_v2_lite", f"model.path={config_only_checkpoint}", "quant=int4_joint",
                   *override.split()])
    with pytest.raises(ValueError, match=match):
        prepare_model(cfg)  # the folder has no weights: reaching the load would raise OSError instead


def test_good_settings_reach_the_weights(config_only_checkpoint):
    cfg = compose(["model=deepseek_v2_lite", f"model.path={config_only_checkpoint}", "quant=int4_joint",
                   "quant.content.group_size=16"])
    with pytest.raises(OSError):
        prepare_model(cfg)


def test_family_that_does_not_fit_the_checkpoint_is_refused(config_only_checkpoint):
    cfg = compose(["model=deepseek_v3", f"model.path={config_only_checkpoint}"])
    with pytest.raises(ValueError, match=r"model.family='deepseek_v3' but the checkpoint .* model_type 'deepseek_v2'"):
        model_dims(cfg.model)
    with pytest.raises(ValueError, match=r"model.family='minicpm3' but the model's model_type"):
        model_dims(compose(["model=toy_mla", "model.family=minicpm3"]).model)


def test_unknown_model_builder_argument_is_named():
    with pytest.raises((ValueError, TypeError), match="colour"):
        build_model(compose(["model=tiny_deepseek_v3", "+model.colour=red"]).model)


@pytest.mark.parametrize("experiment, overrides", [
    ("cache_bytes", ["quant=int4_joint"]),
    ("equivalence", ["model=tiny_minicpm3"]),
    ("bench_kernel", ["quant.content.bits=2"]),
    ("train_toy", ["eval=none"]),
])
def test_overrides_of_unused_groups_are_refused(experiment, overrides):
    cfg = compose([f"experiment={experiment}"])
    with pytest.raises(ValueError, match=rf"experiment={experiment} does not read"):
        refuse_unused_groups(cfg.task, overrides)
    refuse_unused_groups(cfg.task, ["seed=1", "logger=none", "task.name=x"])  # fine


def test_gaussian_sensitivity_refuses_quant_settings(tmp_path, monkeypatch):
    from mla_quant import stages
    from mla_quant.stages import sensitivity

    monkeypatch.setattr(stages, "user_overrides", lambda: ["quant=int4_joint"])
    cfg = compose(["experiment=sensitivity", "model=tiny_deepseek_v3", "quant=int4_joint"])
    with pytest.raises(ValueError, match=r"task.noise=gaussian .* reads no quant setting"):
        sensitivity.run(cfg, tmp_path)


def test_prepared_toy_names_the_stored_dtype():
    prep = prepare_model(compose(["quant=int4_joint"]))
    metrics = prep.cache_metrics()
    assert metrics["cache/content"] == "int4 g=32 asym fp16" and "float32" in metrics["cache/protected"]
    assert prepare_model(compose([])).cache_metrics()["cache/content"] == "float32 values"
