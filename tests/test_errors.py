"""Bad input gets a clear, early error naming the bad value and what is allowed."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from mla_quant.models.absorbed import absorb
from mla_quant.models.build import pretrained_model, tiny_model, torch_dtype
from mla_quant.models.families import get_family


def test_not_an_mla_model_names_the_class():
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2)
    with pytest.raises(ValueError, match="not an MLA model: LlamaConfig"):
        absorb(LlamaForCausalLM(cfg))


def test_local_folder_without_kv_lora_rank_is_not_mla(tmp_path):
    LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not an MLA model"):
        pretrained_model("deepseek_v3", hf_id="some/llama", path=str(tmp_path))


def test_missing_local_path_is_named():
    with pytest.raises(OSError, match="model.path='/nonexistent/ckpt'"):
        pretrained_model("deepseek_v2", hf_id="deepseek-ai/DeepSeek-V2-Lite", path="/nonexistent/ckpt")


def test_unknown_family_lists_known():
    with pytest.raises(ValueError, match=r"unknown MLA family 'llama'.*deepseek_v2"):
        get_family("llama")


def test_unknown_dtype_lists_allowed():
    with pytest.raises(ValueError, match=r"unknown dtype 'fp12'.*bfloat16"):
        torch_dtype("fp12")


def test_tiny_model_is_seeded():
    cfg = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=8,
               v_head_dim=8, n_routed_experts=2, num_experts_per_tok=1, first_k_dense_replace=1)
    a = tiny_model("deepseek_v3", cfg, seed=3)
    b = tiny_model("deepseek_v3", cfg, seed=3)
    c = tiny_model("deepseek_v3", cfg, seed=4)
    wa, wb, wc = (m.model.layers[0].self_attn.kv_b_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


def test_missing_tokenizer_names_id_and_path(tmp_path, monkeypatch):
    from mla_quant.models.build import pretrained_tokenizer

    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(OSError, match=r"'deepseek-ai/DeepSeek-V2-Lite'.*model.path"):
        pretrained_tokenizer("deepseek-ai/DeepSeek-V2-Lite", revision="main")
