"""Transforms folded into the weights leave the model's function unchanged (quantization off), for every family and
transform space, odd dimensions included; the RoPE pair transform commutes with each family's RoPE (default, YaRN,
LongRoPE); a wrong pair layout or a bad shape is caught."""

import copy

import pytest
import torch
from conftest import compose, options

from mla_quant.models.absorbed import attention_modules
from mla_quant.models.families import family_for_config
from mla_quant.prepare import build_model
from mla_quant.stages.verify import check_model, random_transform_set, transform_kinds
from mla_quant.transforms import (LayerTransform, TransformSet, apply_transforms, pair_matrix, random_hadamard,
                                  sample_layer_transform)

# (tiny_deepseek_v3_dims, the 128-head prefill benchmark's model, is deepseek_v3 at 190M parameters: its family is
# covered by tiny_deepseek_v3)
TINY = [o for o in options("model") if o.startswith("tiny_") and o != "tiny_deepseek_v3_dims"]
TRANSFORMS = ["quarot", "smoothquant", "turboquant", "quantmla"]


class Task(dict):
    __getattr__ = dict.__getitem__


TASK = Task(seed=0, prompt_tokens=24, decode_steps=6)


@pytest.mark.parametrize("option", TINY)
def test_every_transform_leaves_every_family_unchanged(option):
    """Every transform a family can fold leaves its function unchanged; the one it cannot (a rotation within the
    pairs of dots.3 Note's RMS-normed RoPE key: QuantMLA's pairwise kind) is refused by name, its pair scales run."""
    rows = check_model(compose([f"model={option}"]).model, TRANSFORMS, TASK)
    refused = {row["transform"] for row in rows if row.get("refused")}
    assert refused == ({"quantmla"} if option == "tiny_dots3_note" else set())
    for row in rows:
        if row.get("refused"):
            assert "RMS-normed before RoPE" in row["refused"] and "pair_scale or none" in row["refused"], row
            continue
        assert row["logits_rel_err"] <= 1e-5, row
        assert row["greedy_equal"], row


@pytest.mark.parametrize("option", ["tiny_deepseek_v3", "tiny_minicpm3", "tiny_longcat_flash"])
def test_odd_dimensions(option):
    cfg = compose([f"model={option}", "model.config.kv_lora_rank=37", "model.config.qk_nope_head_dim=11",
                   "model.config.v_head_dim=13"])
    for row in check_model(cfg.model, TRANSFORMS, TASK):
        assert row["logits_rel_err"] <= 1e-5 and row["greedy_equal"], row


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


@pytest.mark.parametrize("option", ["tiny_deepseek_v2", "tiny_deepseek_v3", "tiny_minicpm3"])
def test_wrong_pair_layout_changes_the_function(option):
    """The check can fail: the same pair transform folded with the other family's pair layout breaks the model."""
    model = build_model(compose([f"model={option}"]).model, absorbed=False)
    ids = torch.randint(3, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    ref = _logits(model, ids)
    family = family_for_config(model.config)
    g = torch.Generator().manual_seed(1)
    for attn in attention_modules(model):
        w = family.mla_weights(attn)
        w.rope_layout = "half" if w.rope_layout == "interleaved" else "interleaved"
        lt = sample_layer_transform("none", "pairwise", w.d_c, w.d_r, g)
        from mla_quant.transforms.fold import fold_rope

        fold_rope(w, lt.angle, lt.pair_scale)
    rel = float((_logits(model, ids) - ref).norm() / ref.norm())
    assert rel > 1e-3


@pytest.mark.parametrize("option, rope_type", [("tiny_deepseek_v2", "yarn"), ("tiny_deepseek_v3", "yarn"),
                                               ("tiny_glm4_moe_lite", "default"), ("tiny_minicpm3", "longrope"),
                                               ("tiny_longcat_flash", "default")])
def test_pair_transform_commutes_with_rope(option, rope_type):
    """RoPE(T r, pos) == T' RoPE(r, pos): T in the pre-RoPE pair layout, T' the same blocks in the cached layout."""
    cfg = compose([f"model={option}"])
    assert cfg.model.config.rope_parameters.rope_type == rope_type
    model = build_model(cfg.model, absorbed=False)
    family = family_for_config(model.config)
    attn = attention_modules(model)[0]
    d_r = attn.qk_rope_head_dim
    g = torch.Generator().manual_seed(0)
    lt = sample_layer_transform("none", "pairwise", attn.kv_lora_rank, d_r, g)
    pre = pair_matrix(lt.angle, lt.pair_scale, family.rope_layout(model.config), d_r).float()
    post = pair_matrix(lt.angle, lt.pair_scale, family.cached_rope_layout(model.config), d_r).float()
    positions = torch.tensor([[0, 1, 7, 100, 300, 500]])
    pe = model.model.rotary_emb(torch.zeros(1, 6, model.config.hidden_size), positions)
    r = torch.randn(1, 6, d_r, generator=g)
    q = torch.randn(1, attn.num_heads, 6, d_r, generator=g)
    _, k_then_t = family.rotate(attn, q, r, pe)
    _, t_then_k = family.rotate(attn, q, r @ pre.T, pe)
    torch.testing.assert_close(t_then_k, k_then_t @ post.T, rtol=1e-5, atol=1e-5)


def test_hadamard_is_orthogonal_for_any_size():
    for n in (1, 7, 16, 96, 512, 576):
        h = random_hadamard(n, torch.Generator().manual_seed(n))
        torch.testing.assert_close(h @ h.T, torch.eye(n, dtype=h.dtype), atol=1e-12, rtol=0)


def test_bad_transform_shapes_are_refused_before_any_weight_changes():
    model = build_model(compose(["model=tiny_deepseek_v3"]).model, absorbed=False)
    before = copy.deepcopy(model.state_dict())
    n = len(attention_modules(model))
    d_c = attention_modules(model)[0].kv_lora_rank
    layers = [LayerTransform(rotation=torch.eye(d_c, dtype=torch.float64)) for _ in range(n)]
    layers[-1] = LayerTransform(rotation=torch.eye(d_c + 1, dtype=torch.float64))
    with pytest.raises(ValueError, match=rf"layer {n - 1}: content rotation is \({d_c + 1}, {d_c + 1}\) but d_c={d_c}"):
        apply_transforms(model, TransformSet(layers))
    layers[-1] = LayerTransform(pair_scale=-torch.ones(attention_modules(model)[0].qk_rope_head_dim // 2))
    with pytest.raises(ValueError, match="RoPE pair scales must be positive"):
        apply_transforms(model, TransformSet(layers))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    with pytest.raises(ValueError, match="transform set has 1 layers but the model has"):
        apply_transforms(model, TransformSet(layers[:1]))
    with pytest.raises(ValueError, match="d_r=7 is odd"):
        sample_layer_transform("none", "pairwise", 8, 7, torch.Generator())


def test_verify_experiment_names_unknown_transforms():
    with pytest.raises(ValueError, match="unknown transform 'givens'"):
        transform_kinds("givens")
    assert transform_kinds("quantmla") == ("rotation_scaling", "pairwise")


def test_random_transform_set_covers_every_layer():
    model = build_model(compose(["model=tiny_longcat_flash"]).model, absorbed=False)
    tset = random_transform_set(model, "rotation_scaling", "pairwise", 0)
    assert len(tset.layers) == len(attention_modules(model)) == model.config.num_hidden_layers


def test_lloyd_max_codebook_matches_the_known_quantizer():
    from mla_quant.quant.codecs.codebook import codebook_dequantize, codebook_quantize, gaussian_codebook

    torch.testing.assert_close(gaussian_codebook(2), torch.tensor([-1.5104, -0.4528, 0.4528, 1.5104],
                                                                  dtype=torch.float64), atol=2e-4, rtol=0)
    x = torch.randn(4000, 64, generator=torch.Generator().manual_seed(0))
    codes, norms = codebook_quantize(x, 4, "fp32")
    nmse = float(((codebook_dequantize(codes, norms, 4) - x) ** 2).sum() / (x**2).sum())
    assert 0.0085 < nmse < 0.0105  # the 4-bit Lloyd-Max distortion of a unit Gaussian is 0.0095


def test_turboquant_stores_the_content_path_as_codebook():
    from mla_quant.prepare import model_dims, validate

    cfg = compose(["model=toy_mla", "quant=int4_joint", "transform=turboquant"])
    fmt = validate(cfg, model_dims(cfg.model)).uniform
    assert fmt.content.format == "codebook" and fmt.content.bits == 4 and fmt.rope == validate(
        compose(["model=toy_mla", "quant=int4_joint"]), model_dims(cfg.model)).uniform.rope
    assert fmt.content.bytes_per_token(96) == 96 * 4 / 8 + 2  # codes + one fp16 norm per token
    with pytest.raises(ValueError, match="quant.backend=triton cannot read format=codebook"):
        validate(compose(["model=toy_mla", "quant=int4_joint", "quant.backend=triton", "transform=turboquant"]),
                 model_dims(cfg.model))
    with pytest.raises(ValueError, match="stores content as fp8"):
        validate(compose(["model=toy_mla", "quant=fp8_ds_mla", "transform=turboquant"]), model_dims(cfg.model))
