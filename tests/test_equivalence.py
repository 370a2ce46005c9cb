"""The absorbed latent-cache path equals transformers' own eager forward on every MLA family (float32)."""

import copy
import re

import pytest
import torch
from conftest import compose, options

from mla_quant.prepare import build_model

from mla_quant.models.absorbed import absorb, cache_kwargs, new_cache
from mla_quant.models.families import FAMILIES
from mla_quant.stages.equivalence import check_model, make_batch

TINY = [name for name in options("model") if name.startswith("tiny_") and "dims" not in name]
TOL = 1e-4


def test_every_family_has_a_tiny_model():
    families = {compose([f"model={name}"]).model.family for name in TINY}
    assert families == set(FAMILIES), f"families without a tiny_ model: {set(FAMILIES) - families}"


def test_every_model_type_runs_from_the_registry_and_the_readme_lists_every_family():
    """experiment=equivalence and verify task.families=all take every registered model type (its tiny model) from
    the family registry; the README's family table names every family; a registry entry without its tiny model is
    refused by name."""
    from pathlib import Path

    from mla_quant.stages import registry_models

    types = {t for f in FAMILIES.values() for t in f.model_types if not t.endswith("_text")}
    for overrides in (["experiment=equivalence"], ["experiment=verify", "task.families=all"]):
        models = registry_models(compose(overrides))
        assert set(models) == types
        assert all(FAMILIES[m.family].tiny_options.get(t) for t, m in models.items())
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    listed = set(re.findall(r"^\| `([a-z0-9_]+)` \| [A-Z]", readme, flags=re.M))
    assert set(FAMILIES) <= listed, f"families missing from the README table: {set(FAMILIES) - listed}"


def test_an_mla_model_type_without_an_adapter_is_refused_with_the_recipe():
    from transformers import DeepseekV3Config

    from mla_quant.models.families import family_for_config

    config = DeepseekV3Config()
    config.model_type = "deepseek_v9"
    with pytest.raises(ValueError, match=r"'deepseek_v9' has no adapter; supported model types: \[.*'kimi_linear'.*"
                                         r"MLAFamily subclass.*tiny_deepseek_v9.yaml"):
        family_for_config(config)


def test_a_registered_model_type_without_a_tiny_model_is_refused(monkeypatch):
    from mla_quant.models.families import YoutuFamily
    from mla_quant.stages import registry_models

    monkeypatch.setattr(YoutuFamily, "model_types", ("youtu", "youtu_next"))
    with pytest.raises(FileNotFoundError, match="'youtu_next' .*youtu.* has no tiny model option.*tiny_youtu_next"):
        registry_models(compose(["experiment=equivalence"]))


@pytest.mark.parametrize("name", TINY)
def test_absorbed_matches_transformers(name):
    model_cfg = compose([f"model={name}"]).model
    results = check_model(model_cfg, prefill_tokens=64, decode_steps=16, batch_size=2, left_pad=16, seed=0)
    assert any("left_padding" in v for v in results)
    for variant, m in results.items():
        assert m["prefill_max_abs_logit_diff"] <= TOL, f"{name} {variant}: prefill diff {m['prefill_max_abs_logit_diff']:.3g}"
        assert m["decode_max_abs_logit_diff"] <= TOL, f"{name} {variant}: decode diff {m['decode_max_abs_logit_diff']:.3g}"
        assert m["greedy_tokens_match"] == 1.0, f"{name} {variant}: greedy tokens differ"
        # The cache holds exactly d_c + d_r values per token per layer (float32 here).
        assert m["cache_bytes_per_token_per_layer"] == 4 * m["latent_values_per_token_per_layer"]


def _reference_and_absorbed(name):
    reference = build_model(compose([f"model={name}"]).model, absorbed=False)
    return reference, absorb(copy.deepcopy(reference))


@pytest.mark.parametrize("name", ["tiny_deepseek_v3", "tiny_minicpm3"])
def test_wrong_rope_layout_is_detected(name, monkeypatch):
    """Negative control: the equivalence check is sharp enough to see a RoPE pair-layout mistake."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3

    reference, absorbed = _reference_and_absorbed(name)
    family = absorbed.mla_family
    right = family.rope_layout(absorbed.config)
    wrong_fn = v3.apply_rotary_pos_emb if right == "interleaved" else v3.apply_rotary_pos_emb_interleave

    def wrong_rotate(self, attn, q_rope, k_rope, position_embeddings):
        q_rope, k_rope = wrong_fn(q_rope, k_rope.unsqueeze(1), *position_embeddings)
        return q_rope, k_rope[:, 0]

    monkeypatch.setattr(type(family), "rotate", wrong_rotate)
    ids, _ = make_batch(reference.config.vocab_size, 1, 64, 0, seed=0)
    with torch.no_grad():
        diff = (reference(ids).logits - absorbed(ids).logits).abs().max().item()
    assert diff > 100 * TOL, f"a wrong RoPE layout changed logits by only {diff:.3g}"


def test_mistral4_query_factor_is_applied():
    """Negative control: without Mistral 4's position factor on the query (1 + 0.1 ln 2 from position 32 in the tiny
    model) the absorbed path leaves transformers' logits."""
    reference, absorbed = _reference_and_absorbed("tiny_mistral4")
    ids, _ = make_batch(reference.config.vocab_size, 1, 64, 0, seed=0)
    with torch.no_grad():
        expected = reference(ids).logits
        assert (expected - absorbed(ids).logits).abs().max().item() <= TOL
        family = absorbed.mla_family
        family.query_scale = lambda attn, position_ids: None  # this instance only
        try:
            diff = (expected - absorbed(ids).logits).abs().max().item()
        finally:
            del family.query_scale
    assert diff > 100 * TOL, f"dropping the query factor changed logits by only {diff:.3g}"


def test_glm5_shared_layer_takes_the_top_k_before_it(monkeypatch):
    """Negative control: GLM-5's shared layer (layer 2 of the tiny model) masks with layer 1's top-k; attending to
    every key there instead leaves transformers' logits, so the equivalence test sees the shared selection."""
    from mla_quant.models.families import GlmMoeDsaFamily

    reference, absorbed = _reference_and_absorbed("tiny_glm_moe_dsa")
    assert [a.indexer is None for a in absorbed.mla_family.attention_modules(absorbed)] == [False, False, True]
    ids, _ = make_batch(reference.config.vocab_size, 1, 64, 0, seed=0)
    with torch.no_grad():
        expected = reference(ids).logits
        assert (expected - absorbed(ids).logits).abs().max().item() <= TOL
        own = GlmMoeDsaFamily.top_k

        def every_key(self, attn, mask, **context):
            if attn.indexer is not None:
                return own(self, attn, mask, **context)
            b, t, s = mask.shape[0], mask.shape[-2], mask.shape[-1]
            return torch.arange(s).expand(b, t, s)

        monkeypatch.setattr(GlmMoeDsaFamily, "top_k", every_key)
        diff = (expected - absorbed(ids).logits).abs().max().item()
    assert diff > 100 * TOL, f"ignoring the shared top-k changed logits by only {diff:.3g}"


@pytest.mark.parametrize("option, family, dropped", [("tiny_axk2", "AXK2Family", "gated"),
                                                     ("tiny_hy_v4", "HYV4Family", "gated"),
                                                     ("tiny_hy_v4", "HYV4Family", "sinks"),
                                                     ("tiny_bailing_hybrid", "BailingHybridFamily", "gated")])
def test_output_gate_and_sinks_are_applied(monkeypatch, option, family, dropped):
    """Negative controls: without A.X K2's, Hunyuan V4's or Ling 3's sigmoid gate on the attention output, or without
    Hunyuan V4's attention sinks, the absorbed path leaves transformers' logits."""
    from mla_quant.models import families

    reference, absorbed = _reference_and_absorbed(option)
    ids, _ = make_batch(reference.config.vocab_size, 1, 32, 0, seed=0)
    with torch.no_grad():
        expected = reference(ids).logits
        assert (expected - absorbed(ids).logits).abs().max().item() <= TOL
        monkeypatch.setattr(getattr(families, family), dropped, lambda self, attn, *args: args[0] if args else None)
        diff = (expected - absorbed(ids).logits).abs().max().item()
    assert diff > 100 * TOL, f"{option}: dropping {dropped} changed logits by only {diff:.3g}"


def test_absorbed_path_never_expands_per_head_kv():
    """kv_b_proj is never called as a layer: its weight is split into W_UK / W_UV and absorbed."""
    _, absorbed = _reference_and_absorbed("tiny_deepseek_v3")
    calls = []
    for attn in absorbed.mla_family.attention_modules(absorbed):
        attn.kv_b_proj.register_forward_hook(lambda *a: calls.append(1))
    ids, _ = make_batch(absorbed.config.vocab_size, 1, 32, 0, seed=0)
    with torch.no_grad():
        absorbed.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0, **cache_kwargs(new_cache(absorbed)))
    assert not calls, f"kv_b_proj ran {len(calls)} times"


@pytest.mark.parametrize("name", ["tiny_deepseek_v2", "tiny_longcat_flash", "tiny_deepseek_v32"])
def test_absorbed_with_transformers_default_cache(name):
    """Without a LatentCache (transformers creates its DynamicCache), decoding is still the same function."""
    reference, absorbed = _reference_and_absorbed(name)
    ids, mask = make_batch(reference.config.vocab_size, 2, 40, 8, seed=1)
    gen = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, output_logits=True,
               return_dict_in_generate=True, pad_token_id=0, attention_mask=mask)
    a, b = reference.generate(ids, **gen), absorbed.generate(ids, **gen)
    assert torch.equal(a.sequences, b.sequences)
    diff = max((x - y).abs().max().item() for x, y in zip(a.logits, b.logits))
    assert diff <= TOL, f"decode diff {diff:.3g}"


def test_chunked_prefill_equals_one_shot():
    """Prefill in two chunks through the latent cache equals one prefill (the cache serves incremental reads)."""
    reference, absorbed = _reference_and_absorbed("tiny_deepseek_v3")
    ids, _ = make_batch(reference.config.vocab_size, 1, 48, 0, seed=2)
    with torch.no_grad():
        full = reference(ids).logits
        cache = new_cache(absorbed)
        first = absorbed(ids[:, :30], **cache_kwargs(cache)).logits
        second = absorbed(ids[:, 30:], **cache_kwargs(cache)).logits
    diff = (torch.cat([first, second], dim=1) - full).abs().max().item()
    assert diff <= TOL, f"chunked prefill diff {diff:.3g}"
    assert cache.get_seq_length() == 48


def test_beam_search_reorders_the_latent_cache():
    reference, absorbed = _reference_and_absorbed("tiny_deepseek_v3")
    ids, _ = make_batch(reference.config.vocab_size, 1, 24, 0, seed=3)
    gen = dict(max_new_tokens=6, min_new_tokens=6, num_beams=3, do_sample=False, pad_token_id=0)
    a = reference.generate(ids, **gen)
    b = absorbed.generate(ids, **gen, **cache_kwargs(new_cache(absorbed)))
    assert torch.equal(a, b), f"{a.tolist()} != {b.tolist()}"
