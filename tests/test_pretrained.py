"""Real checkpoints load through from_pretrained with the family's own classes (here: saved tiny models)."""

import json

import pytest
import torch
from conftest import compose, options, real_option

from mla_quant.prepare import build_model

from mla_quant.models.absorbed import is_absorbed
from mla_quant.models.families import text_config

TINY = [o for o in options("model") if o.startswith("tiny_") and "dims" not in o]


@pytest.mark.every_family("name")
@pytest.mark.parametrize("name", TINY)
def test_saved_checkpoint_loads_from_model_path(name, tmp_path):
    original = build_model(compose([f"model={name}"]).model, absorbed=False)
    original.save_pretrained(tmp_path)
    real = real_option(name)
    cfg = compose([f"model={real}", f"model.path={tmp_path}", "model.dtype=float32", "model.device_map=null"])
    loaded = build_model(cfg.model)
    assert is_absorbed(loaded)
    ids = torch.randint(3, text_config(original.config).vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (original(ids).logits - loaded(ids).logits).abs().max().item()
    assert diff <= 1e-4, f"{name} via {real}: loaded checkpoint differs by {diff:.3g}"


def test_kimi_k2_config_loads_as_deepseek_v3(tmp_path):
    """Kimi-K2's config.json says model_type kimi_k2 (remote code); the V3 classes load it natively."""
    original = build_model(compose(["model=tiny_kimi_k2"]).model, absorbed=False)
    original.save_pretrained(tmp_path)
    cfg_path = tmp_path / "config.json"
    raw = json.loads(cfg_path.read_text())
    raw["model_type"] = "kimi_k2"
    raw["architectures"] = ["DeepseekV3ForCausalLM"]
    cfg_path.write_text(json.dumps(raw))
    loaded = build_model(compose(["model=kimi_k2", f"model.path={tmp_path}", "model.dtype=float32",
                                  "model.device_map=null"]).model)
    ids = torch.randint(3, text_config(original.config).vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (original(ids).logits - loaded(ids).logits).abs().max().item() <= 1e-4


def test_checkpoint_that_does_not_fit_is_refused(tmp_path):
    """Weights the checkpoint lacks would be random: refused, naming the missing weights."""
    build_model(compose(["model=tiny_deepseek_v2"]).model, absorbed=False).save_pretrained(tmp_path)
    cfg = compose(["model=deepseek_v2_lite", f"model.path={tmp_path}", "model.dtype=float32", "model.device_map=null",
                   "+model.config.q_lora_rank=16"])
    with pytest.raises(Exception, match="weights missing.*q_a_proj"):
        build_model(cfg.model)
