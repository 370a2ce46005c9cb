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

import contextlib
import functools

import torch
import transformers
from packaging.version import Version
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, prepare_padding_mask, sdpa_mask

from mla_quant.cache import LatentCache, layer_factory
from mla_quant.cache.contract import remember_host
from mla_quant.kernels.attention import DEFAULT_BLOCKS, AttentionBlocks, CausalMask, key_validity, latent_attention
from mla_quant.kernels.backends import DECODE_BACKENDS
from mla_quant.models import fp8
from mla_quant.models.families import MLAFamily, dims_of, family_for_config, mla_layer_count, text_config
from mla_quant.quant.formats import model_format

# The attention implementation an absorbed model runs under: transformers builds its mask through `latent_mask`
# (a `CausalMask`: (B, S) key validity instead of a (B, 1, T, S) tensor), and no module calls the attention function.
ATTN_IMPLEMENTATION = "mla_absorbed"


def latent_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=causal_mask_function,
                attention_mask=None, allow_is_causal_skip=True, device="cpu", **kwargs):
    """transformers' mask hook for absorbed models: None (causal, no attention mask given), or a `CausalMask` holding
    each sequence's real slots; masks that are not plain causal (packed sequences, overlays) as transformers' own
    boolean (B, 1, T, S) mask. A multi-token step whose mask hides nothing runs as if none were given (one host read
    per forward buys the unmasked prefill: one fused causal call); a one-token step keeps its mask as given, padded
    or not (the decode step reads nothing on the host, and its mask costs nothing there)."""
    q_offset = int(q_offset)
    if mask_function is not causal_mask_function or kv_offset != 0 or q_offset + q_length != kv_length:
        return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                         kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                         allow_is_causal_skip=False, device=device, **kwargs)
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)  # (B, S) bool or None
    if padding is None:
        if allow_is_causal_skip:
            return None
        padding = torch.ones(batch_size, kv_length, dtype=torch.bool, device=device)
    elif q_length > 1:  # read once per forward: whether anything is padded, and the layers' bookkeeping
        host = padding.cpu().numpy().astype(bool)
        if allow_is_causal_skip and host.all():
            return None
        mask = CausalMask(padding.to(device=device, dtype=torch.bool))
        remember_host(mask.validity(q_length), host[:, host.shape[1] - q_length:])
        return mask
    return CausalMask(padding.to(device=device, dtype=torch.bool))


def _not_absorbed(module, *args, **kwargs):
    raise RuntimeError(f"{type(module).__name__} runs under attn_implementation={ATTN_IMPLEMENTATION!r}, which only "
                       "absorbed MLA modules (mla_quant.models.absorbed.absorb) can run")


AttentionInterface.register(ATTN_IMPLEMENTATION, _not_absorbed)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, latent_mask)


class AbsorbedMLA:
    """Mixin placed before the family's attention class; `mla_family` is set per instance by `absorb`."""

    mla_family: MLAFamily

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        # transformers 5.23 passes past_key_values=, 5.24 passes cache=.
        cache = cache if cache is not None else kwargs.pop("past_key_values", None)
        family = self.mla_family
        b, t, _ = hidden_states.shape

        q_nope, q_rope, q_resid, gate = family.query(self, hidden_states)  # (B, H, T, d_nope), (B, H, T, d_r)
        content, k_rope = family.latent(self, hidden_states)  # (B, T, d_c), (B, T, d_r)
        q_rope, k_rope = family.rotate(self, q_rope, k_rope, position_embeddings)
        factor = family.query_scale(self, kwargs.get("position_ids"))
        if factor is not None:
            q_nope, q_rope = q_nope * factor.to(q_nope.dtype), q_rope * factor.to(q_rope.dtype)
        valid = key_validity(attention_mask, t)  # before a family narrows the mask (V3.2's sparse indexer)
        attention_mask, extra = family.attention_mask(
            self,
            attention_mask,
            hidden_states=hidden_states,
            q_resid=q_resid,
            position_embeddings=position_embeddings,
            cache=cache,
            position_ids=kwargs.get("position_ids"),
            prev_topk_indices=kwargs.get("prev_topk_indices"),
        )

        kv_b = self.mla_kv_b if getattr(self, "mla_kv_b", None) is not None else self.kv_b_proj.weight
        w = kv_b.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        w_uk, w_uv = w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim :]  # (H, d_nope, d_c), (H, d_v, d_c)
        # q_latent = q_nope @ w_uk and out = o_latent @ w_uv^T are formed one query block at a time inside the
        # attention, so no (B, H, T, d_c) tensor exists for a long prefill.
        absorbed = dict(blocks=getattr(self, "mla_blocks", None), w_uk=w_uk, w_uv=w_uv, sinks=family.sinks(self))
        if isinstance(cache, LatentCache):
            out = cache.attend(self.layer_idx, q_nope, q_rope, content, k_rope, self.scaling, attention_mask, valid,
                               **absorbed)
        else:
            if cache is not None:  # any other transformers Cache (e.g. the default DynamicCache) holds the same latents
                content, k_rope = cache.update(content.unsqueeze(1), k_rope.unsqueeze(1), self.layer_idx)
                content, k_rope = content[:, 0], k_rope[:, 0]
            out = latent_attention(q_nope, q_rope, content, k_rope, self.scaling, attention_mask, **absorbed)

        out = family.gated(self, out.transpose(1, 2).reshape(b, t, self.num_heads * self.v_head_dim), gate)
        return fp8.linear(self.o_proj, out), None, *extra


@functools.cache
def _absorbed_class(cls: type) -> type:
    return type(f"Absorbed{cls.__name__}", (AbsorbedMLA, cls), {"__module__": __name__})


def absorb(model: nn.Module, blocks: AttentionBlocks | None = None) -> nn.Module:
    """Switch every MLA module of `model` to the absorbed latent forward, in place, with attention in `blocks`
    (default `DEFAULT_BLOCKS`), and the model to the compact causal mask (`latent_mask`). Returns the model."""
    family = family_for_config(model.config)
    modules = family.attention_modules(model)
    for idx, (attn, slot) in enumerate(zip(modules, family.mla_slots(model.config), strict=True)):
        if attn.layer_idx != slot:
            raise RuntimeError(f"{family.name}: MLA layer {idx} has layer_idx {attn.layer_idx}; its cache slot is {slot}")
        if not isinstance(attn, AbsorbedMLA):
            attn.__class__ = _absorbed_class(type(attn))
        attn.mla_family = family
        attn.mla_blocks = DEFAULT_BLOCKS if blocks is None else blocks
        # An FP8 kv_b (block-FP8 checkpoints) is read as a matrix every step: dequantized once here (as serving
        # engines do when they absorb), a buffer outside the state dict.
        kv_b = fp8.dequantize(attn.kv_b_proj, fp8.compute_dtype(model)) if fp8.is_fp8(attn.kv_b_proj) else None
        attn.register_buffer("mla_kv_b", kv_b, persistent=False)
    model.mla_family = family
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model


def attention_blocks(cfg) -> AttentionBlocks:
    """The `attention` config group (query_block, key_block, expand_from) as `AttentionBlocks`; None: the defaults."""
    if cfg is None:
        return DEFAULT_BLOCKS
    unknown = sorted(set(cfg) - {"name", "query_block", "key_block", "expand_from"})
    if unknown:
        raise ValueError(f"attention: unknown settings {unknown}; allowed: query_block, key_block, expand_from")
    return AttentionBlocks(cfg.get("query_block"), cfg.get("key_block"), cfg.get("expand_from"))


@contextlib.contextmanager
def absorbed_view(model: nn.Module, blocks: AttentionBlocks | None = None):
    """The model absorbed (blocked attention, compact mask) inside the block, as it was after: for work that runs
    an unabsorbed model's forward at long contexts (calibration capture) without transformers' O(T^2) attention."""
    if is_absorbed(model):
        yield model
        return
    modules = family_for_config(model.config).attention_modules(model)
    classes = [type(m) for m in modules]
    implementation = model.config._attn_implementation
    absorb(model, blocks)
    try:
        yield model
    finally:
        for m, cls in zip(modules, classes):
            m.__class__ = cls
            for name in ("mla_family", "mla_blocks"):
                m.__dict__.pop(name, None)
            m._buffers.pop("mla_kv_b", None)
        model.__dict__.pop("mla_family", None)
        model.set_attn_implementation(implementation)


def is_absorbed(model: nn.Module) -> bool:
    return any(isinstance(m, AbsorbedMLA) for m in model.modules())


def num_cache_layers(model: nn.Module) -> int:
    """The model's MLA layers, each a latent cache layer (LongCat: two per decoder layer; a hybrid stack: its
    full-attention layers only)."""
    return mla_layer_count(model.config)


def new_cache(model: nn.Module, factory=None) -> LatentCache:
    """An empty latent cache sized for `model`, with latent layers from `factory` (default: unquantized) in its MLA
    slots and, in a hybrid stack, transformers' own cache layers (recurrent states) in the others."""
    family = family_for_config(model.config)
    slots = family.mla_slots(model.config)
    others = {}
    if len(slots) < family.cache_slots(model.config):
        from transformers import DynamicCache

        own = DynamicCache(config=model.config).layers  # the layer types transformers gives this model's slots
        mla = set(slots)
        others = {i: layer for i, layer in enumerate(own) if i not in mla}
    return LatentCache(len(slots), factory or layer_factory(None), others)


def model_layer_factory(model: nn.Module, quant_cfg):
    """The cache layer constructor of `quant_cfg` validated for `model`: each layer's (d_c, d_r) from its MLA
    modules, the context from its config."""
    context = getattr(text_config(model.config), "max_position_embeddings", None)
    family = family_for_config(model.config)
    fmt = model_format(quant_cfg, latent_dims(model)["layer_dims"], context,
                       rope_layout=family.cached_rope_layout(model.config))
    backend = getattr(fmt, "backend", None)
    if backend in DECODE_BACKENDS and not DECODE_BACKENDS[backend].sinks and family.sinks(
            attention_modules(model)[0]) is not None:
        raise ValueError(f"quant.backend={backend}: the {backend} decode kernel has no attention sinks, which "
                         f"{family.name}'s attention has; use quant.backend=torch (or auto)")
    return layer_factory(fmt)


def quantized_cache(model: nn.Module, quant_cfg) -> LatentCache:
    """An empty cache for `model` in the format of `quant_cfg` (the `quant` config group)."""
    return new_cache(model, model_layer_factory(model, quant_cfg))


def attention_modules(model: nn.Module) -> list[nn.Module]:
    return family_for_config(model.config).attention_modules(model)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of the model's text decoder, in order."""
    return list(family_for_config(model.config).text_model(model).layers)


# transformers 5.24 renamed the cache keyword of forward/generate from past_key_values to cache.
CACHE_KEYWORD = "cache" if Version(transformers.__version__).release >= (5, 24) else "past_key_values"


def cache_kwargs(cache) -> dict:
    """{keyword: cache} for model(...) / model.generate(...) on the installed transformers."""
    return {CACHE_KEYWORD: cache}


@torch.no_grad()
def cached_latents(model: nn.Module, ids: torch.Tensor, batch: int = 8, desc: str = "cache latents", stream=None):
    """Each cache layer's latents over each batch of `batch` sequences of `ids`, written into an unquantized cache
    by the absorbed `model`: yields (cache layer i, (content (B, T, d_c), rope (B, T, d_r))). In memory, batch by
    batch (one forward each, every layer of it in turn); with `stream` (a `mla_quant.models.streaming.StreamedModel`
    whose skeleton is `model`), layer by layer (every batch through a decoder layer while it is resident). Either
    way a layer's batches come in batch order, so what is summed over them is summed alike."""
    from tqdm.auto import tqdm

    if stream is not None:
        yield from stream.cached_latents(ids, batch, desc)
        return
    for start in tqdm(range(0, ids.shape[0], batch), desc=desc, unit="batch"):
        cache = new_cache(model)
        model(ids[start:start + batch].to(model.device), use_cache=True, **cache_kwargs(cache))
        yield from enumerate(layer.read() for layer in cache.latent_layers)


def latent_dims(model: nn.Module) -> dict:
    """The latent dims of a model's MLA modules (`families.dims_of`: each layer's (d_c, d_r), the number of MLA
    (cache) layers, the largest d_c and d_r)."""
    return dims_of([(m.kv_lora_rank, m.qk_rope_head_dim) for m in attention_modules(model)])
