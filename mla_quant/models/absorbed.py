"""Absorbed MLA attention, swapped into transformers' own attention modules.

`absorb(model)` changes the class of every MLA module to a subclass whose forward is the absorbed form
(docs/method.md section 1): q_latent = W_UK^T q_nope, scores on the latent plus the RoPE part, output W_UV (P c), never
expanding per-head K/V. Parameters, state-dict keys and isinstance checks stay as they were; the family adapter
supplies the few pieces that differ between families.

    model = absorb(DeepseekV3ForCausalLM(config))
    cache = new_cache(model)
    model.generate(ids, past_key_values=cache, max_new_tokens=8)
"""

from __future__ import annotations

import functools

import transformers
from packaging.version import Version
from torch import nn

import torch

from mla_quant.cache import LatentCache, layer_factory
from mla_quant.kernels.attention import latent_attention, visible
from mla_quant.models.families import MLAFamily, family_for_config
from mla_quant.quant.formats import cache_format


def key_validity(mask: torch.Tensor | None, t: int) -> torch.Tensor | None:
    """(B, T) bool: which of the T new slots hold real tokens (False = padding), read off the attention mask
    transformers builds (B, 1, T, S): the last query sees every real key at or before it and no padding, for left
    and right padding alike. None: no mask, every slot is real."""
    if mask is None:
        return None
    return visible(mask[:, 0, -1, mask.shape[-1] - t :])


class AbsorbedMLA:
    """Mixin placed before the family's attention class; `mla_family` is set per instance by `absorb`."""

    mla_family: MLAFamily

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        # transformers 5.23 passes past_key_values=, 5.24 passes cache=.
        cache = cache if cache is not None else kwargs.pop("past_key_values", None)
        family = self.mla_family
        b, t, _ = hidden_states.shape

        q_nope, q_rope, q_resid = family.query(self, hidden_states)  # (B, H, T, d_nope), (B, H, T, d_r)
        content, k_rope = family.latent(self, hidden_states)  # (B, T, d_c), (B, T, d_r)
        q_rope, k_rope = family.rotate(self, q_rope, k_rope, position_embeddings)
        valid = key_validity(attention_mask, t)  # before a family narrows the mask (V3.2's sparse indexer)
        attention_mask = family.attention_mask(
            self,
            attention_mask,
            hidden_states=hidden_states,
            q_resid=q_resid,
            position_embeddings=position_embeddings,
            cache=cache,
            position_ids=kwargs.get("position_ids"),
        )

        w = self.kv_b_proj.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        w_uk, w_uv = w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim :]  # (H, d_nope, d_c), (H, d_v, d_c)
        q_latent = q_nope @ w_uk  # (B, H, T, d_c)

        if isinstance(cache, LatentCache):
            o_latent = cache.attend(self.layer_idx, q_latent, q_rope, content, k_rope, self.scaling, attention_mask,
                                    valid)
        else:
            if cache is not None:  # any other transformers Cache (e.g. the default DynamicCache) holds the same latents
                content, k_rope = cache.update(content.unsqueeze(1), k_rope.unsqueeze(1), self.layer_idx)
                content, k_rope = content[:, 0], k_rope[:, 0]
            o_latent = latent_attention(q_latent, q_rope, content, k_rope, self.scaling, attention_mask)

        out = o_latent @ w_uv.transpose(-1, -2)  # (B, H, T, d_v)
        out = out.transpose(1, 2).reshape(b, t, self.num_heads * self.v_head_dim)
        return self.o_proj(out), None


@functools.cache
def _absorbed_class(cls: type) -> type:
    return type(f"Absorbed{cls.__name__}", (AbsorbedMLA, cls), {"__module__": __name__})


def absorb(model: nn.Module) -> nn.Module:
    """Switch every MLA module of `model` to the absorbed latent forward, in place. Returns the model."""
    family = family_for_config(model.config)
    modules = family.attention_modules(model)
    for idx, attn in enumerate(modules):
        if attn.layer_idx != idx:
            raise RuntimeError(f"{family.name}: attention module {idx} has layer_idx {attn.layer_idx}")
        if not isinstance(attn, AbsorbedMLA):
            attn.__class__ = _absorbed_class(type(attn))
        attn.mla_family = family
    model.mla_family = family
    return model


def is_absorbed(model: nn.Module) -> bool:
    return any(isinstance(m, AbsorbedMLA) for m in model.modules())


def num_cache_layers(model: nn.Module) -> int:
    # LongCat has two MLA blocks per decoder layer: its config's num_hidden_layers is 2 * num_layers.
    return model.config.get_text_config(decoder=True).num_hidden_layers


def new_cache(model: nn.Module, factory=None) -> LatentCache:
    """An empty latent cache sized for `model`, with layers from `factory` (default: unquantized)."""
    return LatentCache(num_cache_layers(model), factory or layer_factory(None))


def model_layer_factory(model: nn.Module, quant_cfg):
    """The cache layer constructor of `quant_cfg` validated for `model`: (d_c, d_r) from its MLA modules, the
    context from its config."""
    dims = latent_dims(model)
    context = getattr(model.config, "max_position_embeddings", None)
    return layer_factory(cache_format(quant_cfg, dims["d_c"], dims["d_r"], context))


def quantized_cache(model: nn.Module, quant_cfg) -> LatentCache:
    """An empty cache for `model` in the format of `quant_cfg` (the `quant` config group)."""
    return new_cache(model, model_layer_factory(model, quant_cfg))


def attention_modules(model: nn.Module) -> list[nn.Module]:
    return family_for_config(model.config).attention_modules(model)


# transformers 5.24 renamed the cache keyword of forward/generate from past_key_values to cache.
CACHE_KEYWORD = "cache" if Version(transformers.__version__).release >= (5, 24) else "past_key_values"


def cache_kwargs(cache) -> dict:
    """{keyword: cache} for model(...) / model.generate(...) on the installed transformers."""
    return {CACHE_KEYWORD: cache}


def latent_dims(model: nn.Module) -> dict[str, int]:
    """d_c, d_r and the number of MLA (cache) layers of a model."""
    modules = attention_modules(model)
    return {"d_c": modules[0].kv_lora_rank, "d_r": modules[0].qk_rope_head_dim, "layers": len(modules)}
