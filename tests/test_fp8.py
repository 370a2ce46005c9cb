"""Block-FP8 checkpoints: a tiny DeepSeek-V3 whose MLA linears are transformers' own FP8Linear (hand-quantized codes
and block scales) runs the absorbed path with the logits of the dequantized model, prefill and decode; folds leave
it invariant and rewrite only the projections they change, in the compute dtype; bad block sizes are refused."""

import copy

import pytest
import torch
from conftest import compose
from transformers.integrations.finegrained_fp8 import FP8Linear

from mla_quant.models import fp8
from mla_quant.models.absorbed import absorb, cache_kwargs, new_cache
from mla_quant.prepare import build_model
from mla_quant.transforms import TransformSet, apply_transforms, sample_layer_transform

BLOCK = (16, 16)  # kv_a_proj_with_mqa has 40 rows: a partial last block, as on DeepSeek-V3
LINEARS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


def to_fp8(model, size=BLOCK):
    """Every MLA linear -> FP8Linear with block-quantized codes; returns the model whose weights are exactly the
    dequantized codes (the reference) and the FP8 one."""
    fp8_model = copy.deepcopy(model)
    for ref_layer, layer in zip(model.model.layers, fp8_model.model.layers):
        for name in LINEARS:
            dense = getattr(layer.self_attn, name)
            codes, scale = fp8.quantize_blocks(dense.weight.detach(), size)
            q = FP8Linear(dense.in_features, dense.out_features, block_size=size)
            with torch.no_grad():
                q.weight.copy_(codes)
                q.weight_scale_inv.copy_(scale)
            setattr(layer.self_attn, name, q)
            with torch.no_grad():
                getattr(ref_layer.self_attn, name).weight.copy_(fp8.dequantize(q, torch.float32))
    return model, fp8_model


@pytest.fixture(scope="module")
def models():
    model = build_model(compose(["model=tiny_deepseek_v3"]).model, absorbed=False, dtype="float32").eval()
    return to_fp8(model)


def batch(vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (2, 21), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    return ids, mask


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max()) if a.requires_grad is False else rel(a.detach(), b.detach())


def test_dequantize_inverts_block_quantization():
    w = torch.randn(24, 16)
    codes, scale = fp8.quantize_blocks(w, (8, 8))
    assert codes.dtype in fp8.FP8_DTYPES and scale.shape == (3, 2)
    q = FP8Linear(16, 24, block_size=(8, 8))
    with torch.no_grad():
        q.weight.copy_(codes)
        q.weight_scale_inv.copy_(scale)
    err = rel(fp8.dequantize(q), w)
    assert err <= 0.07, f"e4m3 block dequantization error {err:.3g} (3 mantissa bits: <= 1/16 relative per element)"
    assert fp8.is_fp8(q) and not fp8.is_fp8(torch.nn.Linear(2, 2))


@torch.no_grad()
def test_absorbed_fp8_model_equals_the_dequantized_model(models):
    reference, fp8_model = models
    ids, mask = batch(reference.config.vocab_size)
    want = reference(ids, attention_mask=mask).logits  # transformers' own forward, dequantized weights
    absorbed = absorb(copy.deepcopy(fp8_model))
    attn = absorbed.model.layers[0].self_attn
    assert isinstance(attn.kv_b_proj, FP8Linear) and attn.mla_kv_b is not None
    assert "mla_kv_b" not in absorbed.state_dict().keys().__str__()
    got = absorbed(ids, attention_mask=mask, **cache_kwargs(new_cache(absorbed))).logits
    valid = mask.bool()
    err = rel(got[valid], want[valid])
    assert err <= 1e-5, f"absorbed FP8 model vs dequantized transformers model: max relative error {err:.3g}"
    gen = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, attention_mask=mask)
    a = absorbed.generate(ids, **cache_kwargs(new_cache(absorbed)), **gen)
    b = reference.generate(ids, **gen)
    assert torch.equal(a, b)


@torch.no_grad()
def test_folds_keep_the_fp8_model_invariant_and_rewrite_only_what_they_change(models):
    reference, fp8_model = models
    ids, mask = batch(reference.config.vocab_size, seed=1)
    g = torch.Generator().manual_seed(0)
    attn = fp8_model.model.layers[0].self_attn
    d_c, d_r = attn.kv_lora_rank, attn.qk_rope_head_dim
    layers = len(fp8_model.model.layers)
    for content, rope, changed in (("rotation_scaling", "none", {"kv_a_proj_with_mqa", "kv_b_proj"}),
                                   ("none", "pairwise", {"kv_a_proj_with_mqa", "q_b_proj"})):
        model = copy.deepcopy(fp8_model)
        tset = TransformSet([sample_layer_transform(content, rope, d_c, d_r, g) for _ in range(layers)])
        apply_transforms(model, tset)
        for i, layer in enumerate(model.model.layers):
            for name in LINEARS:
                module = getattr(layer.self_attn, name)
                if name in changed:
                    assert type(module) is torch.nn.Linear and module.weight.dtype == torch.float32, (i, name)
                else:
                    assert isinstance(module, FP8Linear), (i, name)
        assert sorted(model.mla_dequantized) == sorted(f"model.layers.{i}.self_attn.{n}" for i in range(layers)
                                                       for n in changed)
        absorb(model)
        want = reference(ids, attention_mask=mask).logits
        got = model(ids, attention_mask=mask, **cache_kwargs(new_cache(model))).logits
        err = rel(got[mask.bool()], want[mask.bool()])
        assert err <= 1e-4, f"{content}/{rope} folded into the FP8 model: max relative error {err:.3g}"


def test_partial_blocks_keep_their_own_scale():
    """DeepSeek-V3's kv_a_proj_with_mqa has 576 rows in blocks of 128: the last block is partial (ceil grid)."""
    w = torch.randn(20, 12)
    codes, scale = fp8.quantize_blocks(w, (8, 8))
    assert scale.shape == (3, 2)
    q = FP8Linear(12, 20, block_size=(8, 8))
    with torch.no_grad():
        q.weight.copy_(codes)
        q.weight_scale_inv.copy_(scale)
    assert rel(fp8.dequantize(q), w) <= 0.07


@pytest.mark.parametrize("bad", [[128], [128, 0], [128, 12.5], "128x128"])
def test_bad_block_sizes_are_refused_by_value(bad):
    config = type("Config", (), {"quantization_config": {"quant_method": "fp8", "weight_block_size": bad}})()
    with pytest.raises(ValueError, match="weight_block_size"):
        fp8.check_fp8_config(config)


def test_scales_of_the_wrong_grid_are_refused():
    q = FP8Linear(16, 24, block_size=(8, 8))
    q.weight_scale_inv = torch.nn.Parameter(torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"weight_scale_inv has shape \[2, 2\], expected \[3, 2\]"):
        fp8.dequantize(q)


def test_export_writes_an_fp8_checkpoint_transformers_loads(models, tmp_path):
    """The folded FP8 model saved with the rewritten projections listed as not quantized: transformers reloads it
    (dequantizing FP8 on the CPU, as it does without a GPU) with the original model's logits; the untouched
    projections are stored as FP8 codes and scales, the rewritten ones in full precision."""
    from safetensors import safe_open

    from mla_quant.stages.export import write_checkpoint

    reference, fp8_model = models
    model = copy.deepcopy(fp8_model)
    skip = ["lm_head", r"model\.layers\.\d+\.mlp"]  # what the tiny model keeps in full precision besides attention
    model.config.quantization_config = {"quant_method": "fp8", "weight_block_size": list(BLOCK),
                                        "activation_scheme": "dynamic", "modules_to_not_convert": skip}
    attn = model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(2)
    tset = TransformSet([sample_layer_transform("rotation_scaling", "pairwise", attn.kv_lora_rank,
                                                attn.qk_rope_head_dim, g) for _ in model.model.layers])
    apply_transforms(model, tset)
    written = write_checkpoint(model, tmp_path)
    assert written == sorted(model.mla_dequantized) and written
    with safe_open(str(next(tmp_path.glob("*.safetensors"))), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.layers.0.self_attn.o_proj.weight").dtype in fp8.FP8_DTYPES
        assert "model.layers.0.self_attn.o_proj.weight_scale_inv" in keys
        assert f.get_tensor("model.layers.0.self_attn.kv_b_proj.weight").dtype == torch.float32
        assert "model.layers.0.self_attn.kv_b_proj.weight_scale_inv" not in keys
    reloaded = type(reference).from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    ids, mask = batch(reference.config.vocab_size, seed=3)
    with torch.no_grad():
        want = reference(ids, attention_mask=mask).logits
        got = reloaded(ids, attention_mask=mask).logits
    err = rel(got[mask.bool()], want[mask.bool()])
    assert err <= 1e-4, f"reloaded FP8 export vs the original model: max relative error {err:.3g}"
