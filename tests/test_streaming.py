"""Streamed models (model.streaming=true): one decoder layer resident at a time, read from the checkpoint's shards;
the streamed stages give what the in-memory stages give."""

from pathlib import Path

import pytest
import torch
from conftest import compose, options

from mla_quant.models.streaming import StreamedModel, layer_arguments
from mla_quant.models.absorbed import decoder_layers, new_cache
from mla_quant.prepare import build_model, preflight
from mla_quant.stages import quality, sensitivity

# What differs between families for a stream: fused experts converted on load (V3), a top-k handed from layer to
# layer (GLM-5), a hybrid stack's per-type masks and recurrent states (Kimi-Linear), two MLA blocks per decoder layer
# (LongCat), an LM head tied to the embedding (MiniCPM3), a multimodal wrapper's text decoder (Hunyuan V4 VL).
FAMILIES = ["tiny_deepseek_v3", "tiny_glm_moe_dsa", "tiny_kimi_linear", "tiny_longcat_flash", "tiny_minicpm3",
            "tiny_hy_v4_vl"]


def _real_option(tiny: str) -> str:
    family = compose([f"model={tiny}"]).model.family
    return next(o for o in options("model") if not o.startswith(("tiny_", "spec_"))
                and compose([f"model={o}"]).model.get("family") == family
                and compose([f"model={o}"]).model._target_.endswith("pretrained_model"))


def _checkpoint(tiny: str, folder: Path, dtype: torch.dtype = torch.float32, **config) -> Path:
    overrides = [f"model={tiny}"] + [f"model.config.{k}={v}" for k, v in config.items()]
    model = build_model(compose(overrides).model, absorbed=False).to(dtype)
    model.save_pretrained(folder, max_shard_size="100KB")
    return folder


def _quality_cfg(tiny: str, folder: Path, *extra: str):
    return compose([f"model={_real_option(tiny)}", f"model.path={folder}", "model.dtype=float32",
                    "model.device_map=null", "model.tokenizer=null", "model.quant_group_size.wide=16",
                    "model.quant_group_size.narrow=16", "experiment=quality", "quant=int4_joint",
                    "quant.protected.n_sink=0", "quant.protected.recent=0", "task.data.source=random",
                    "task.data.samples=3", "task.data.seq_len=40", "task.batch_size=2", "device=cpu", "logger=none",
                    *extra])


QUALITY = ("quality/ppl", "quality/ppl_unquantized", "quality/kl", "quality/kl_p99", "quality/kl_stderr",
           "quality/top1_agree", "quality/tokens", "cache/bytes_per_token_per_layer")


@pytest.mark.parametrize("tiny,stored", [(f, torch.float32) for f in FAMILIES]
                         + [("tiny_deepseek_v3", torch.bfloat16)])
def test_streamed_quality_equals_in_memory(tiny, stored, tmp_path):
    """float32 compute over a float32 checkpoint, and over a BF16 one (read as stored, cast after)."""
    folder = _checkpoint(tiny, tmp_path / "checkpoint", stored)
    runs = {}
    for streaming in (False, True):
        (tmp_path / str(streaming)).mkdir()
        runs[streaming] = quality.run(_quality_cfg(tiny, folder, f"model.streaming={streaming}"),
                                      tmp_path / str(streaming)).metrics
    assert runs[False]["quality/kl"] > 0  # the quantized cache changes the output: the comparison means something
    for key in QUALITY:
        a, b = runs[False][key], runs[True][key]
        assert b == pytest.approx(a, rel=1e-5, abs=1e-9), f"{tiny}: {key} in memory {a}, streamed {b}"
    shards = runs[True]
    assert shards["streaming/layers"] == len(decoder_layers(build_model(compose([f"model={tiny}"]).model)))
    # every tensor read once, the outer ones but the embedding twice (before the layers and for the logits)
    assert 1.0 <= shards["streaming/read_ratio"] <= 1.5


@pytest.mark.parametrize("tiny", ["tiny_deepseek_v3", "tiny_glm_moe_dsa", "tiny_longcat_flash"])
def test_streamed_sensitivity_equals_in_memory(tiny, tmp_path):
    """Every metric of the study (amplification over seeds, per layer, predicted, mechanism split, per RoPE pair),
    with every injection's stream beside the clean one through each resident layer."""
    folder = _checkpoint(tiny, tmp_path / "checkpoint")
    runs = {}
    for streaming in (False, True):
        cfg = compose([f"model={_real_option(tiny)}", f"model.path={folder}", "model.dtype=float32",
                       "model.device_map=null", "model.tokenizer=null", "experiment=sensitivity",
                       "task.probe.source=random", "task.probe.num_sequences=2", "task.probe.seq_len=32",
                       "task.seeds=2", "task.sweep_nmse=[0.01]", "device=cpu", "logger=none",
                       f"model.streaming={streaming}"])
        (tmp_path / str(streaming)).mkdir()
        runs[streaming] = sensitivity.run(cfg, tmp_path / str(streaming)).metrics
    compared = [k for k, v in runs[False].items() if isinstance(v, float) and not k.startswith("plan/")]
    assert any("/layer1/amplification" in k for k in compared) and any("rope_pair" in k for k in compared)
    for key in compared:
        assert runs[True][key] == pytest.approx(runs[False][key], rel=1e-5, abs=1e-12), key
    assert runs[True]["streaming/layers"] >= 2


def test_one_layer_resident_and_hidden_states_spilled(tmp_path):
    """A deeper stack: while layer j runs no other decoder layer holds a weight, each tensor of the layers is read
    exactly once, and with no host budget every hidden state goes through the scratch folder, results unchanged."""
    folder = _checkpoint("tiny_deepseek_v3", tmp_path / "checkpoint", num_hidden_layers=6)
    cfg = _quality_cfg("tiny_deepseek_v3", folder, "model.streaming=true")
    stream = StreamedModel.from_config(cfg.model, "cpu")
    ids = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    stream.load_outer()
    hidden, arguments = layer_arguments(stream.model, ids, new_cache(stream.model))
    stream.release_outer()
    layers = decoder_layers(stream.model)
    seen = []
    for j, layer in stream.layers():
        resident = [i for i, other in enumerate(layers) if any(p.device.type != "meta" for p in other.parameters())]
        seen.append(resident)
        hidden = layer(hidden, **arguments[j])
    stream.close()
    assert seen == [[j] for j in range(6)]
    assert all(p.device.type == "meta" for layer in layers for p in layer.parameters())
    layer_bytes = sum(stream.shards.nbytes[k] for j in range(6) for k in stream.groups[j])
    outer_bytes = sum(stream.shards.nbytes[k] for k in stream.groups[None])
    assert stream.shards.bytes_read == layer_bytes + outer_bytes  # each read once (load_outer once here)
    figures = stream.figures()
    assert 0.0 <= figures["streaming/read_hidden_share"] <= 1.0 and figures["streaming/layers"] == 6

    runs = {}
    for budget in (8, 0):
        (tmp_path / f"b{budget}").mkdir()
        runs[budget] = quality.run(_quality_cfg("tiny_deepseek_v3", folder, "model.streaming=true",
                                                f"model.streaming_host_gb={budget}"), tmp_path / f"b{budget}").metrics
    assert runs[8]["streaming/spilled_gb"] == 0 and runs[0]["streaming/spilled_gb"] > 0
    assert runs[0]["streaming/host_peak_hidden_gb"] == 0
    assert runs[0]["quality/kl"] == runs[8]["quality/kl"] and runs[0]["quality/ppl"] == runs[8]["quality/ppl"]
    assert not any(p.name.startswith("mla_quant_stream_") for p in (tmp_path / "b0").iterdir())  # scratch removed


@pytest.mark.parametrize("extra,match", [
    (["transform=quarot"], "transform=quarot is not streamed yet"),
    (["task.chunk=8"], "task.chunk=8 is not streamed"),
    (["model.path=null"], "set model.path"),
    (["model.streaming_host_gb=-1"], "model.streaming_host_gb=-1"),
    (["model.device_map=cuda:0"], "model.device_map='cuda:0'"),
])
def test_streaming_refusals_name_the_setting(extra, match, tmp_path):
    folder = _checkpoint("tiny_deepseek_v3", tmp_path / "checkpoint")
    cfg = _quality_cfg("tiny_deepseek_v3", folder, "model.streaming=true", *extra)
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        quality.run(cfg, tmp_path)


@pytest.mark.parametrize("experiment", ["evaluate", "calibrate", "export", "verify"])
def test_stages_that_load_the_whole_model_refuse_streaming(experiment, tmp_path):
    cfg = compose([f"model={_real_option('tiny_deepseek_v3')}", f"model.path={tmp_path}", "model.streaming=true",
                   f"experiment={experiment}", "model.quant_group_size.wide=16", "model.quant_group_size.narrow=16"])
    with pytest.raises(ValueError, match=f"experiment={experiment} loads the whole model"):
        preflight(cfg)


def test_streamed_sensitivity_refuses_a_fitted_transform(tmp_path):
    cfg = compose([f"model={_real_option('tiny_deepseek_v3')}", f"model.path={tmp_path}", "model.streaming=true",
                   "experiment=sensitivity", "transform=quantmla", "model.quant_group_size.wide=16",
                   "model.quant_group_size.narrow=16"])
    with pytest.raises(ValueError, match="transform=quantmla is not streamed yet"):
        sensitivity.run(cfg, tmp_path)


def test_tiny_model_streaming_refused():
    cfg = compose(["model=tiny_deepseek_v3", "experiment=quality", "+model.streaming=true"])
    with pytest.raises(ValueError, match="streams a checkpoint's safetensors shards"):
        preflight(cfg)
