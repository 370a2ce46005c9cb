"""MLA model families: one small adapter each, registered by name. No modeling code is copied.

A family says how to get, from transformers' own attention module of that family,
  - the query split into its no-RoPE and RoPE parts, before RoPE          `query(attn, h)`
  - the content latent c (after the norm) and the RoPE key, before RoPE    `latent(attn, h)`
  - RoPE, using the family's own transformers function                    `rotate(attn, q_rope, k_rope, pe)`
  - any per-position factor on the whole query after RoPE (Mistral 4)     `query_scale(attn, position_ids)`
  - any output gate (A.X K2, Hunyuan V4) and attention sinks (Hunyuan V4)  `gated(attn, out, gate)`, `sinks(attn)`
  - any mask the family adds (DeepSeek-V3.2's sparse indexer)             `attention_mask(attn, mask, ...)`
    and any output the family's module returns beside its own (GLM-5's top-k, for the next layer)
and where its MLA weights live (`mla_weights`, for transforms that fold into them). Everything else (the absorbed
attention, the cache) is shared. Families differ only through these accessors.

    get_family("deepseek_v3"), family_for_config(model.config), FAMILIES
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
from torch import nn

from mla_quant.kernels.attention import CausalMask
from mla_quant.models.fp8 import linear, weight_of


@dataclass
class MLAWeights:
    """Views of one MLA block's weights (no copies), named as in docs/method.md section 1.

    kv_a: rows [:d_c] make the content latent x, rows [d_c:] the pre-RoPE key r; kv_norm: gamma of RMSNorm(x);
    the cached latent is latent_scale * RMSNorm(x) (latent_scale = LongCat's mla_scale_kv_lora, 1 elsewhere);
    kv_b: per head [W_UK (d_nope rows) | W_UV (d_v rows)]; q_out: the projection whose per-head rows are
    [q_nope (d_nope) | q_rope (d_r)] (q_proj, or q_b_proj after the q LoRA).
    """

    kv_a: nn.Linear
    kv_norm: nn.Parameter
    kv_b: nn.Linear
    q_out: nn.Linear
    num_heads: int
    d_c: int
    d_r: int
    d_nope: int
    d_v: int
    rope_layout: str  # "interleaved": pairs (2i, 2i+1) in the pre-RoPE rows; "half": pairs (i, i + d_r/2)
    latent_scale: float = 1.0  # a fixed factor the family applies to the normed latent before caching (LongCat)
    norm_eps: float = 1e-6  # the latent RMSNorm's epsilon
    q_head_rows: int | None = None  # rows per head in q_out when more than d_nope + d_r (AXK2's gate: + d_v)
    rope_norm: nn.Parameter | None = None  # gamma of an RMSNorm on the RoPE key before RoPE (dots.3 Note), or None

    @property
    def q_rows(self) -> int:
        return self.q_head_rows or self.d_nope + self.d_r

    # Weights as full-precision matrices (`fp8.weight_of`): views of the parameters, or dequantized FP8 blocks.
    def w_uk(self) -> torch.Tensor:  # (H, d_nope, d_c)
        return weight_of(self.kv_b).view(self.num_heads, self.d_nope + self.d_v, self.d_c)[:, : self.d_nope]

    def w_uv(self) -> torch.Tensor:  # (H, d_v, d_c)
        return weight_of(self.kv_b).view(self.num_heads, self.d_nope + self.d_v, self.d_c)[:, self.d_nope :]

    def latent_rows(self) -> torch.Tensor:  # (d_c, hidden)
        return weight_of(self.kv_a)[: self.d_c]

    def rope_rows(self) -> torch.Tensor:  # (d_r, hidden)
        return weight_of(self.kv_a)[self.d_c :]

    def q_rope_rows(self) -> torch.Tensor:  # (H, d_r, q_in)
        w = weight_of(self.q_out).view(self.num_heads, self.q_rows, -1)
        return w[:, self.d_nope : self.d_nope + self.d_r]


class MLAFamily:
    """DeepSeek-V3-style MLA (also the default behaviour the other families override)."""

    name = "deepseek_v3"
    model_types: tuple[str, ...] = ("deepseek_v3", "kimi_k2")
    modeling_module = "transformers.models.deepseek_v3.modeling_deepseek_v3"
    config_class_name = "DeepseekV3Config"
    model_class_name = "DeepseekV3ForCausalLM"
    attention_class_name = "DeepseekV3Attention"
    plain_rope = True  # transformers' plain (rope_type "default") RoPE runs on this family's RoPE dims

    @property
    def tiny_options(self) -> dict[str, str]:
        """{model type: its tiny random model option (conf/model/<option>.yaml)}: one per model type, a multimodal
        wrapper's text config type (`*_text`) excepted (the wrapper's option covers it)."""
        return {t: f"tiny_{t}" for t in self.model_types if not t.endswith("_text")}

    # --- classes, imported lazily so that importing mla_quant stays cheap
    @property
    def modeling(self):
        return importlib.import_module(self.modeling_module)

    @property
    def config_class(self):
        return getattr(importlib.import_module("transformers"), self.config_class_name)

    @property
    def model_class(self):
        return getattr(importlib.import_module("transformers"), self.model_class_name)

    @property
    def attention_class(self):
        return getattr(self.modeling, self.attention_class_name)

    # --- structure
    multimodal = False  # True: the model is a conditional-generation wrapper whose text decoder is
    # model.model.language_model (the study runs on text)

    def text_model(self, model: nn.Module) -> nn.Module:
        """The decoder that holds the layers (`.layers`): the causal LM's `model`, or a multimodal model's text
        model."""
        return model.model.language_model if self.multimodal else model.model

    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        """The MLA modules in cache-layer order: the i-th is the model's MLA layer i (its `layer_idx` is its slot
        in transformers' cache, `mla_slots`)."""
        layers = self.text_model(model).layers
        return [layers[i].self_attn for i in self.mla_slots(text_config(model.config))]

    def mla_slots(self, config) -> list[int]:
        """The cache slots (decoder layers) whose attention is MLA, in order, from the config alone: every layer; a
        hybrid stack's full-attention layers only (its other layers keep transformers' own cache layers)."""
        return list(range(text_config(config).num_hidden_layers))

    def layer_dims(self, config) -> list[tuple[int, int]]:
        """(d_c, d_r) of each MLA layer in cache-layer order, from the config alone: the same in every layer unless
        the family's layers differ (Mistral Large 4's NoPE layers cache no RoPE key)."""
        text = text_config(config)
        return [(int(mla_setting(text, "kv_lora_rank", i)), int(mla_setting(text, "qk_rope_head_dim", i)))
                for i in self.mla_slots(config)]

    def unsupported(self, config) -> str | None:
        """Why the framework cannot run a model of this config (naming the setting and what is allowed), or None."""
        return None

    def cache_slots(self, config) -> int:
        """The number of slots transformers' cache of this model has (a decoder layer each)."""
        return text_config(config).num_hidden_layers

    rotary = True  # False: the second key path is shared but not rotated (NoPE MLA, Kimi Linear)

    def rope_layout(self, config) -> str:
        return "interleaved" if getattr(config, "rope_interleave", True) else "half"

    def cached_rope_layout(self, config) -> str:
        """Pair layout of the cached (post-RoPE) key: transformers' interleave RoPE outputs rotate-half order."""
        return "half"

    def q_out(self, attn: nn.Module) -> nn.Linear:
        """The projection whose per-head rows start [q_nope | q_rope]."""
        return attn.q_proj if attn.q_lora_rank is None else attn.q_b_proj

    def mla_weights(self, attn: nn.Module) -> MLAWeights:
        return MLAWeights(
            kv_a=attn.kv_a_proj_with_mqa,
            kv_norm=attn.kv_a_layernorm.weight,
            kv_b=attn.kv_b_proj,
            q_out=self.q_out(attn),
            num_heads=attn.num_heads,
            d_c=attn.kv_lora_rank,
            d_r=attn.qk_rope_head_dim,
            d_nope=attn.qk_nope_head_dim,
            d_v=attn.v_head_dim,
            rope_layout=self.rope_layout(attn.config),
            latent_scale=float(getattr(attn, "mla_scale_kv_lora", 1.0)),
            norm_eps=float(attn.kv_a_layernorm.variance_epsilon),
        )

    # --- the forward pieces
    def query(self, attn, hidden_states: torch.Tensor):
        """-> q_nope (B, H, T, d_nope), q_rope (B, H, T, d_r) before RoPE, the q LoRA residual (or None), and the
        output gate (B, H, T, d_v) of a family with one (`output_gate`; else None)."""
        b, t, _ = hidden_states.shape
        if attn.q_lora_rank is None:
            q_resid = None
            q = linear(attn.q_proj, hidden_states)
        else:
            q_resid = attn.q_a_layernorm(linear(attn.q_a_proj, hidden_states))
            q = linear(attn.q_b_proj, q_resid)
        q = q.view(b, t, -1, attn.qk_head_dim).transpose(1, 2)  # (B, H, T, d_nope + d_r)
        q_nope, q_rope = torch.split(q, [attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
        return q_nope, q_rope, q_resid, None

    def latent(self, attn, hidden_states: torch.Tensor):
        """-> content latent c (B, T, d_c) after its RMSNorm, RoPE key (B, T, d_r) before RoPE."""
        compressed = linear(attn.kv_a_proj_with_mqa, hidden_states)
        content, k_rope = torch.split(compressed, [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
        return attn.kv_a_layernorm(content), self.key_norm(attn, k_rope)

    rope_normed = False  # True: the RoPE key is RMS-normed before RoPE (`key_norm`), so a rotation of its pre-RoPE
    # rows does not fold through the norm's per-dim weight (only a scale per pair does: into that weight)

    def key_norm(self, attn, k_rope: torch.Tensor) -> torch.Tensor:
        """The RoPE key (B, T, d_r) from its rows of kv_a, before RoPE: as projected (a norm for dots.3 Note)."""
        return k_rope

    def rotate(self, attn, q_rope, k_rope, position_embeddings):
        """RoPE with the family's own function. q_rope (B, H, T, d_r), k_rope (B, T, d_r)."""
        cos, sin = position_embeddings
        if self.rope_layout(attn.config) == "interleaved":
            fn = self.modeling.apply_rotary_pos_emb_interleave
        else:
            fn = self.modeling.apply_rotary_pos_emb
        q_rope, k_rope = fn(q_rope, k_rope.unsqueeze(1), cos, sin)
        return q_rope, k_rope[:, 0]

    output_gate = False  # True: query() also gives a gate the attention output is multiplied by (gated())

    def gated(self, attn, out: torch.Tensor, gate) -> torch.Tensor:
        """The attention output (B, T, H * d_v) as it enters o_proj, given query()'s gate (B, H, T, d_v): multiplied
        by sigmoid(gate) (None: as it is)."""
        if gate is None:
            return out
        b, t, _ = out.shape
        gate = gate.transpose(1, 2).reshape(b, t, -1)  # (B, T, H * d_v), heads in o_proj's order
        return (out * torch.sigmoid(gate.float())).to(out.dtype)

    def sinks(self, attn) -> torch.Tensor | None:
        """Attention sinks (H,): a learned logit per head that joins every softmax with no value, or None (none)."""
        return None

    def query_scale(self, attn, position_ids: torch.Tensor | None) -> torch.Tensor | None:
        """A factor (B, 1, T, 1) the family multiplies the whole query by after RoPE, or None (none)."""
        return None

    def carried(self, layer_output) -> dict:
        """The keyword arguments a decoder layer's output hands the next decoder layer (as the family's model loop
        does), for code that runs the layers one by one: none."""
        return {}

    def attention_mask(self, attn, mask, **context):
        """-> (the mask, narrowed where the family selects keys, and what the attention module returns after its
        (output, weights): a tuple, empty unless the family's own module returns more)."""
        return mask, ()


class DeepseekV2Family(MLAFamily):
    """DeepSeek-V2 / V2-Lite: RoPE as complex multiplication on interleaved pairs; output stays interleaved."""

    name = "deepseek_v2"
    model_types = ("deepseek_v2",)
    modeling_module = "transformers.models.deepseek_v2.modeling_deepseek_v2"
    config_class_name = "DeepseekV2Config"
    model_class_name = "DeepseekV2ForCausalLM"
    attention_class_name = "DeepseekV2Attention"

    def rope_layout(self, config) -> str:
        return "interleaved"

    def cached_rope_layout(self, config) -> str:
        return "interleaved"  # complex RoPE keeps the pairs interleaved after rotation

    def rotate(self, attn, q_rope, k_rope, position_embeddings):
        q_rope, k_rope = self.modeling.apply_rotary_emb(
            q_rope, k_rope.unsqueeze(1), position_embeddings.to(q_rope.device)
        )
        return q_rope, k_rope[:, 0]


class Glm4MoeLiteFamily(MLAFamily):
    """GLM-4.7-Flash: DeepSeek-V3 MLA (rope_interleave switch), its own modeling file."""

    name = "glm4_moe_lite"
    model_types = ("glm4_moe_lite",)
    modeling_module = "transformers.models.glm4_moe_lite.modeling_glm4_moe_lite"
    config_class_name = "Glm4MoeLiteConfig"
    model_class_name = "Glm4MoeLiteForCausalLM"
    attention_class_name = "Glm4MoeLiteAttention"


class MiniCPM3Family(MLAFamily):
    """MiniCPM3: MLA with rotate-half RoPE (pairs (i, i + d_r/2))."""

    name = "minicpm3"
    model_types = ("minicpm3",)
    modeling_module = "transformers.models.minicpm3.modeling_minicpm3"
    config_class_name = "MiniCPM3Config"
    model_class_name = "MiniCPM3ForCausalLM"
    attention_class_name = "MiniCPM3Attention"

    def rope_layout(self, config) -> str:
        return "half"


class LongcatFlashFamily(MLAFamily):
    """LongCat-Flash: two MLA blocks per decoder layer (cache layer 2i+j) and LoRA scales on q and on c."""

    name = "longcat_flash"
    model_types = ("longcat_flash",)
    modeling_module = "transformers.models.longcat_flash.modeling_longcat_flash"
    config_class_name = "LongcatFlashConfig"
    model_class_name = "LongcatFlashForCausalLM"
    attention_class_name = "LongcatFlashMLA"

    def attention_modules(self, model):
        return [attn for layer in self.text_model(model).layers for attn in layer.self_attn]

    # config.num_hidden_layers is 2 * num_layers: a cache slot per MLA block (2i + j)

    def rope_layout(self, config) -> str:
        return "interleaved"

    def query(self, attn, hidden_states):
        q_nope, q_rope, q_resid, gate = super().query(attn, hidden_states)
        return q_nope * attn.mla_scale_q_lora, q_rope * attn.mla_scale_q_lora, q_resid, gate

    def latent(self, attn, hidden_states):
        # The scale is applied before caching in transformers, so the cached content latent includes it.
        content, k_rope = super().latent(attn, hidden_states)
        return content * attn.mla_scale_kv_lora, k_rope


class AXK1Family(MLAFamily):
    """A.X K1: DeepSeek-V3 MLA with the query LoRA always on, its own modeling file."""

    name = "axk1"
    model_types = ("axk1",)
    modeling_module = "transformers.models.axk1.modeling_axk1"
    config_class_name = "AXK1Config"
    model_class_name = "AXK1ForCausalLM"
    attention_class_name = "AXK1Attention"


class SarvamMLAFamily(MLAFamily):
    """Sarvam (sarvam_mla): its own config class; transformers runs it with the DeepSeek-V3 model classes."""

    name = "sarvam_mla"
    model_types = ("sarvam_mla",)
    config_class_name = "SarvamMLAConfig"


class YoutuFamily(MLAFamily):
    """Youtu-LLM: DeepSeek-V3 MLA in a Llama-style decoder, its own modeling file."""

    name = "youtu"
    model_types = ("youtu",)
    modeling_module = "transformers.models.youtu.modeling_youtu"
    config_class_name = "YoutuConfig"
    model_class_name = "YoutuForCausalLM"
    attention_class_name = "YoutuAttention"


class Mistral4Family(MLAFamily):
    """Mistral Small 4: DeepSeek-V3 MLA, and the whole query multiplied after RoPE by Llama 4's position factor
    1 + beta * log(1 + floor(position / original_max_position_embeddings)) (1 below that length)."""

    name = "mistral4"
    model_types = ("mistral4",)
    modeling_module = "transformers.models.mistral4.modeling_mistral4"
    config_class_name = "Mistral4Config"
    model_class_name = "Mistral4ForCausalLM"
    attention_class_name = "Mistral4Attention"
    plain_rope = False  # its plain RoPE rotates head_dim (d_nope + d_r) dims: only its YaRN fits the d_r-dim key

    def query_scale(self, attn, position_ids):
        rope = attn.config.rope_parameters
        if rope.get("llama_4_scaling_beta") is None:
            return None
        if position_ids is None:
            raise ValueError(f"{self.name}: the query's position factor needs position_ids; none were passed")
        return self.modeling.get_llama_4_attn_scale(position_ids, rope["llama_4_scaling_beta"],
                                                    rope.get("original_max_position_embeddings"))


class DeepseekV32Family(MLAFamily):
    """DeepSeek-V3.2: V3 MLA plus the DSA indexer, whose top-k selection is folded into the mask (left as is)."""

    name = "deepseek_v32"
    model_types = ("deepseek_v32",)
    modeling_module = "transformers.models.deepseek_v32.modeling_deepseek_v32"
    config_class_name = "DeepseekV32Config"
    model_class_name = "DeepseekV32ForCausalLM"
    attention_class_name = "DeepseekV32Attention"

    def rope_layout(self, config) -> str:
        return "interleaved"

    def top_k(self, attn, mask, *, hidden_states, q_resid, position_embeddings, cache, position_ids, **_):
        """The key positions each query attends to (B, T, k): the layer's own indexer on the dense mask."""
        return attn.indexer(hidden_states, q_resid, position_embeddings, mask[:, 0], position_ids, cache=cache)

    def extra_outputs(self, top_k: torch.Tensor) -> tuple:
        """What the attention module returns after (output, weights): nothing for V3.2."""
        return ()

    def attention_mask(self, attn, mask, *, hidden_states, **context):
        b, t, _ = hidden_states.shape
        if not isinstance(mask, torch.Tensor):  # the indexer scores every (query, key) pair: it needs the dense mask
            cache = context.get("cache")
            past = cache.get_seq_length(attn.layer_idx) if cache is not None else 0
            keys = mask.keys if mask is not None else torch.ones(b, past + t, dtype=torch.bool,
                                                                 device=hidden_states.device)
            mask = CausalMask(keys).dense(t, hidden_states.dtype)
        topk = self.top_k(attn, mask, hidden_states=hidden_states, **context)
        s = mask.shape[-1]
        not_selected = (
            topk.new_ones((b, t, s), dtype=torch.bool).scatter(-1, topk.long(), False).unsqueeze(1)
        )  # (B, 1, T, S), True = masked out
        if mask.dtype == torch.bool:
            return mask & ~not_selected, self.extra_outputs(topk)
        return mask.masked_fill(not_selected, torch.finfo(hidden_states.dtype).min), self.extra_outputs(topk)


class AXK2Family(DeepseekV32Family):
    """A.X K2 (axk2): V3.2's MLA and DSA indexer on every layer, interleaved RoPE, and an output gate: one fused
    projection q_gate_proj of [q_a_layernorm(q_a), q_a] gives each head's [q_nope | q_rope | gate (d_v)], and the
    attention output is multiplied by sigmoid(gate) before o_proj."""

    name = "axk2"
    model_types = ("axk2",)
    modeling_module = "transformers.models.axk2.modeling_axk2"
    config_class_name = "AXK2Config"
    model_class_name = "AXK2ForCausalLM"
    attention_class_name = "AXK2Attention"
    output_gate = True

    def mla_weights(self, attn):
        w = super().mla_weights(attn)
        w.q_head_rows = attn.qk_head_dim + attn.v_head_dim
        return w

    def q_out(self, attn):
        return attn.q_gate_proj

    def query(self, attn, hidden_states):
        b, t, _ = hidden_states.shape
        q_compressed = linear(attn.q_a_proj, hidden_states)
        q_resid = attn.q_a_layernorm(q_compressed)
        qg = linear(attn.q_gate_proj, torch.cat([q_resid, q_compressed], dim=-1))
        qg = qg.view(b, t, -1, attn.qk_head_dim + attn.v_head_dim).transpose(1, 2)  # (B, H, T, d_nope + d_r + d_v)
        q_nope, q_rope, gate = torch.split(qg, [attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim], -1)
        return q_nope, q_rope, q_resid, gate


class GlmMoeDsaFamily(DeepseekV32Family):
    """GLM-5 (glm_moe_dsa): V3.2's MLA and indexer (both with interleaved RoPE); a "shared" layer
    (`config.indexer_types`) has no indexer and reuses the top-k of the full layer before it, which every layer
    returns as its third output."""

    name = "glm_moe_dsa"
    model_types = ("glm_moe_dsa",)
    modeling_module = "transformers.models.glm_moe_dsa.modeling_glm_moe_dsa"
    config_class_name = "GlmMoeDsaConfig"
    model_class_name = "GlmMoeDsaForCausalLM"
    attention_class_name = "GlmMoeDsaAttention"

    def rotate(self, attn, q_rope, k_rope, position_embeddings):
        q_rope, k_rope = self.modeling.apply_rotary_pos_emb_interleave(q_rope, k_rope.unsqueeze(1),
                                                                       *position_embeddings)
        return q_rope, k_rope[:, 0]

    def top_k(self, attn, mask, *, prev_topk_indices=None, **context):
        if attn.indexer is not None:
            return super().top_k(attn, mask, **context)
        if prev_topk_indices is None:
            raise ValueError(f"{self.name}: layer {attn.layer_idx} shares the top-k of an earlier layer "
                             "(config.indexer_types) but none was passed")
        return prev_topk_indices

    def extra_outputs(self, top_k):
        return (top_k,)

    def carried(self, layer_output):
        return {"prev_topk_indices": layer_output[1]}  # GlmMoeDsaModel.forward: (hidden, top-k) per decoder layer


class HYV4Family(GlmMoeDsaFamily):
    """Hunyuan V4 (hy_v4): GLM-5's MLA, DSA indexer (its own, RoPE on the last dims of its keys) and shared top-k
    layers, plus an output gate from its own projection of the hidden states (sigmoid, per head and value dim) and a
    learned attention sink per head in every softmax; hyper-connections around each decoder layer (outside the
    attention). transformers runs it under eager attention only."""

    name = "hy_v4"
    model_types = ("hy_v4",)
    modeling_module = "transformers.models.hy_v4.modeling_hy_v4"
    config_class_name = "HYV4Config"
    model_class_name = "HYV4ForCausalLM"
    attention_class_name = "HYV4Attention"
    output_gate = True

    def query(self, attn, hidden_states):
        q_nope, q_rope, q_resid, _ = super().query(attn, hidden_states)
        b, t, _ = hidden_states.shape
        gate = linear(attn.gate_proj, hidden_states).view(b, t, -1, attn.gate_projection_size).transpose(1, 2)
        return q_nope, q_rope, q_resid, gate

    def sinks(self, attn):
        return attn.sinks


class HYV4VLFamily(HYV4Family):
    """Hunyuan V4 VL (hy_v4_vl): Hunyuan V4's text decoder (its own classes, multimodal RoPE whose three position axes
    coincide on text) inside a vision-language model; the study runs on text."""

    name = "hy_v4_vl"
    model_types = ("hy_v4_vl", "hy_v4_vl_text")  # the wrapper's config and its text config
    modeling_module = "transformers.models.hy_v4_vl.modeling_hy_v4_vl"
    config_class_name = "HYV4VLConfig"
    model_class_name = "HYV4VLForConditionalGeneration"
    attention_class_name = "HYV4VLAttention"
    multimodal = True


class KimiLinearFamily(MLAFamily):
    """Kimi Linear (kimi_linear): a hybrid stack of KDA (delta-rule linear attention) layers and MLA layers
    (`config.layer_types`: "linear_attention" | "full_attention"); its MLA has no RoPE: the 64-dim shared key is
    cached and scored as it is (a NoPE key path), with the softmax scale of the whole (d_nope + d_r) head. Only the
    MLA layers get latent cache layers; the KDA layers keep transformers' recurrent and convolution states."""

    name = "kimi_linear"
    model_types = ("kimi_linear",)
    modeling_module = "transformers.models.kimi_linear.modeling_kimi_linear"
    config_class_name = "KimiLinearConfig"
    model_class_name = "KimiLinearForCausalLM"
    attention_class_name = "KimiLinearAttention"
    rotary = False
    plain_rope = False  # nothing is rotated: a RoPE scaling setting has nothing to act on

    def mla_slots(self, config):
        return layer_type_slots(config)

    def rope_layout(self, config):
        return "half"  # no rotation: any pairing of the key's dims; a pair transform needs none

    def rotate(self, attn, q_rope, k_rope, position_embeddings):
        return q_rope, k_rope


class BailingHybridFamily(MLAFamily):
    """Ling 3 (bailing_hybrid): a hybrid stack as Kimi Linear's (KDA layers, and MLA in the "full_attention" layers of
    `config.layer_types`), whose MLA is DeepSeek-V3's with interleaved RoPE and a per-head sigmoid output gate from
    its own projection of the hidden states (g_proj: one value per head, for all of its value dims)."""

    name = "bailing_hybrid"
    model_types = ("bailing_hybrid",)
    modeling_module = "transformers.models.bailing_hybrid.modeling_bailing_hybrid"
    config_class_name = "BailingHybridConfig"
    model_class_name = "BailingHybridForCausalLM"
    attention_class_name = "BailingHybridAttention"
    output_gate = True

    def mla_slots(self, config):
        return layer_type_slots(config)

    def rope_layout(self, config):
        return "interleaved"

    def rotate(self, attn, q_rope, k_rope, position_embeddings):
        q_rope, k_rope = self.modeling.apply_rotary_pos_emb_interleave(q_rope, k_rope.unsqueeze(1),
                                                                       *position_embeddings)
        return q_rope, k_rope[:, 0]

    def query(self, attn, hidden_states):
        q_nope, q_rope, q_resid, _ = super().query(attn, hidden_states)
        b, t, _ = hidden_states.shape
        gate = linear(attn.g_proj, hidden_states).view(b, t, -1, 1).transpose(1, 2)  # (B, H, T, 1)
        return q_nope, q_rope, q_resid, gate.expand(-1, -1, -1, attn.v_head_dim)


class Glm5NextFamily(GlmMoeDsaFamily):
    """GLM-5.3 (glm5_next, text model glm5_next_text): a hybrid stack of KDA linear-attention layers and MLA layers
    (`config.layer_types`: "linear_attention" | "indexed_attention") inside a vision-language model; its MLA has no
    RoPE path at all (`qk_rope_head_dim` 0: the cache holds the content latent alone) and a DSA indexer that scores
    pools of `index_kpool` keys and selects whole pools plus the incomplete tail; a "shared" layer
    (`config.indexer_types`) reuses the top-k of the MLA layer before it. The model hands the attention a (B, T)
    padding mask of the new tokens: causality and padding come from the indexer's selection."""

    name = "glm5_next"
    model_types = ("glm5_next", "glm5_next_text")  # the wrapper's config and its text config
    modeling_module = "transformers.models.glm5_next.modeling_glm5_next"
    config_class_name = "Glm5NextConfig"
    model_class_name = "Glm5NextForConditionalGeneration"
    attention_class_name = "Glm5NextTextAttention"
    multimodal = True
    rotary = False
    plain_rope = False  # no RoPE dims: nothing for a RoPE setting to act on

    def mla_slots(self, config):
        return layer_type_slots(config, "indexed_attention")

    def rope_layout(self, config):
        return "half"  # no RoPE dims

    def rotate(self, attn, q_rope, k_rope, position_embeddings):
        return q_rope, k_rope

    def top_k(self, attn, mask, *, hidden_states=None, q_resid=None, cache=None, **context):
        if attn.indexer is None:  # a shared layer: GLM-5's rule
            return super().top_k(attn, mask, **context)
        view = None if cache is None else _IndexerView(cache, attn.layer_idx)
        return attn.indexer(hidden_states=hidden_states, q_resid=q_resid, attention_mask=mask, cache=view)

    def attention_mask(self, attn, mask, *, hidden_states, cache=None, **context):
        b, t, _ = hidden_states.shape
        mask = torch.ones(b, t, dtype=torch.bool, device=hidden_states.device) if mask is None else mask.bool()
        top_k = self.top_k(attn, mask, hidden_states=hidden_states, cache=cache, **context)
        past = cache.get_seq_length(attn.layer_idx) if cache is not None else 0
        dense = attn.build_attention_mask_from_topk(top_k, hidden_states, past + t)  # (B, 1, T, S), 0 or min
        return dense, (top_k if attn.next_skip_topk else None,)  # the top-k goes on only to a shared layer


class MistralLarge4Family(GlmMoeDsaFamily):
    """Mistral Large 4 (mistral_large4, text model mistral_large4_text): GLM-5's MLA with its DSA indexer and shared
    top-k layers inside a vision-language model, without a query LoRA (one q_proj); NoPE layers
    (`config.no_rope_layers`: 0 = no RoPE) whose latent has no RoPE key (d_r 0 in those layers only: the cache's
    dims differ by layer) and whose key head is all no-RoPE dims; interleaved RoPE with a learned scale of its
    frequencies (LeRoPE, in the model's rotary module); the whole query multiplied after RoPE by a learned per-head
    factor of log(position + 1); logits soft-capped in the LM head (outside the attention)."""

    name = "mistral_large4"
    model_types = ("mistral_large4", "mistral_large4_text")  # the wrapper's config and its text config
    modeling_module = "transformers.models.mistral_large4.modeling_mistral_large4"
    config_class_name = "MistralLarge4Config"
    model_class_name = "MistralLarge4ForConditionalGeneration"
    attention_class_name = "MistralLarge4TextAttention"
    multimodal = True
    plain_rope = False  # its rotary module scales the frequencies of any rope_type: a plain setting is not plain

    def unsupported(self, config) -> str | None:
        text = text_config(config)
        shared = [(i, s) for i, s in enumerate(text.kv_source_layers or []) if s != i]
        if shared:
            i, s = shared[0]
            return (f"config.kv_source_layers shares latents between layers (layer {i} attends to layer {s}'s cache "
                    f"and computes none): the latent cache holds one latent per MLA layer; allowed: every layer its "
                    f"own source (kv_source_layers[i] = i)")
        return None

    def layer_dims(self, config) -> list[tuple[int, int]]:
        text = text_config(config)
        return [(int(text.kv_lora_rank), int(text.qk_rope_head_dim) if text.no_rope_layers[i] else 0)
                for i in self.mla_slots(config)]

    def q_out(self, attn):
        return attn.q_proj

    def query(self, attn, hidden_states):
        b, t, _ = hidden_states.shape
        q = linear(attn.q_proj, hidden_states).view(b, t, -1, attn.qk_head_dim).transpose(1, 2)
        q_nope, q_rope = torch.split(q, [attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
        return q_nope, q_rope, None, None

    def rotate(self, attn, q_rope, k_rope, position_embeddings):
        if not attn.use_rope:  # a NoPE layer: its RoPE parts are empty
            return q_rope, k_rope
        return super().rotate(attn, q_rope, k_rope, position_embeddings)

    def query_scale(self, attn, position_ids):
        if position_ids is None:
            raise ValueError(f"{self.name}: the query's log-position factor needs position_ids; none were passed")
        scaling = attn.softmax_scaling  # transformers' own module, on ones: its factor (B, H, T, 1) in its dtype
        ones = position_ids.new_ones((position_ids.shape[0], scaling.scale.shape[0], position_ids.shape[-1], 1),
                                     dtype=scaling.scale.dtype)
        return scaling(ones, position_ids, head_dim_first=True)

    def top_k(self, attn, mask, *, prev_topk_indices=None, hidden_states=None, position_embeddings=None,
              position_ids=None, cache=None, **_):
        if attn.indexer is None:  # a shared layer: GLM-5's rule
            return super().top_k(attn, mask, prev_topk_indices=prev_topk_indices)
        return attn.indexer(hidden_states, position_embeddings, mask[:, 0], position_ids, cache=cache)


class Dots3NoteFamily(DeepseekV32Family):
    """dots.3 Note (dots3_note, text model dots3_note_text): V3.2's MLA and DSA indexer (GLM-5's, interleaved RoPE)
    in its `indexed_attention` layers and sliding-window MLA in its `sliding_attention` layers (`config.layer_types`),
    each layer type with its own MLA dims (`config.per_layer_config`: heads, LoRA ranks, d_c, d_r), inside a
    vision-and-audio model; the normed query LoRA and latent multiplied by sqrt(hidden / rank); the RoPE key
    RMS-normed before RoPE (`key_norm`); a per-head sigmoid output gate from its own projection of the hidden
    states. The latent cache keeps every token of a sliding-window layer and masks beyond the window."""

    name = "dots3_note"
    model_types = ("dots3_note", "dots3_note_text")  # the wrapper's config and its text config
    modeling_module = "transformers.models.dots3_note.modeling_dots3_note"
    config_class_name = "Dots3NoteConfig"
    model_class_name = "Dots3NoteForConditionalGeneration"
    attention_class_name = "Dots3NoteTextAttention"
    multimodal = True
    output_gate = True
    rope_normed = True
    plain_rope = False  # a RoPE setting per layer type (config.rope_parameters by layer type)

    def mla_weights(self, attn):
        w = super().mla_weights(attn)
        w.latent_scale = float(attn.kv_lora_scale)
        w.rope_norm = attn.k_rope_only_layernorm.weight
        return w

    def query(self, attn, hidden_states):
        b, t, _ = hidden_states.shape
        q_resid = attn.q_a_layernorm(linear(attn.q_a_proj, hidden_states)) * attn.q_lora_scale
        q = linear(attn.q_b_proj, q_resid).view(b, t, -1, attn.qk_head_dim).transpose(1, 2)
        q_nope, q_rope = torch.split(q, [attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
        gate = linear(attn.g_proj, hidden_states).view(b, t, -1, 1).transpose(1, 2)  # a scalar per head
        return q_nope, q_rope, q_resid, gate.expand(-1, -1, -1, attn.v_head_dim)

    def latent(self, attn, hidden_states):
        content, k_rope = super().latent(attn, hidden_states)
        return content * attn.kv_lora_scale, k_rope

    def key_norm(self, attn, k_rope):
        return attn.k_rope_only_layernorm(k_rope)

    def attention_mask(self, attn, mask, **context):
        if attn.indexer is None:  # a sliding-window layer: the window is in transformers' mask already
            return mask, ()
        return super().attention_mask(attn, mask, **context)


class _IndexerView:
    """What GLM-5.3's indexer reads of transformers' cache, over a latent cache: `update_indexer`, and the layer's
    length (`layers[i].keys.shape[-2]`, `get_seq_length()`) as its packed indexer states count it, this step's
    tokens included (transformers appends the latent before the indexer runs; the absorbed forward after)."""

    def __init__(self, cache, layer_idx: int):
        self.cache, self.layer_idx, self.keys = cache, layer_idx, None

    def update_indexer(self, states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        self.keys = self.cache.update_indexer(states, layer_idx)  # (B, S, d): keys.shape[-2] is S
        return self.keys

    @property
    def layers(self) -> dict:
        return {self.layer_idx: self}

    def get_seq_length(self) -> int:
        return self.keys.shape[1]


def layer_type_slots(config, kind: str = "full_attention") -> list[int]:
    """A hybrid stack's MLA layers: those `config.layer_types` calls `kind`."""
    return [i for i, layer_type in enumerate(text_config(config).layer_types) if layer_type == kind]


FAMILIES: dict[str, MLAFamily] = {
    f.name: f
    for f in (
        DeepseekV2Family(),
        MLAFamily(),
        Glm4MoeLiteFamily(),
        LongcatFlashFamily(),
        MiniCPM3Family(),
        DeepseekV32Family(),
        AXK1Family(),
        SarvamMLAFamily(),
        YoutuFamily(),
        Mistral4Family(),
        GlmMoeDsaFamily(),
        AXK2Family(),
        HYV4Family(),
        HYV4VLFamily(),
        KimiLinearFamily(),
        BailingHybridFamily(),
        Glm5NextFamily(),
        MistralLarge4Family(),
        Dots3NoteFamily(),
    )
}


def get_family(name: str) -> MLAFamily:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown MLA family {name!r}; known families: {sorted(FAMILIES)}") from None


def text_config(config):
    """The decoder's config: a multimodal model's text config, or the config itself."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def dims_of(layer_dims, **extra) -> dict:
    """The latent dims of a model whose MLA layers have (d_c, d_r) = `layer_dims` (in cache-layer order):
    {"layer_dims", "layers", "d_c", "d_r"} with d_c and d_r the largest of any layer (every layer's where they are
    the same), and `extra`."""
    layer_dims = [(int(c), int(r)) for c, r in layer_dims]
    return {"d_c": max(c for c, _ in layer_dims), "d_r": max(r for _, r in layer_dims), "layers": len(layer_dims),
            "layer_dims": layer_dims, **extra}


def mla_setting(config, key: str, layer: int | None = None):
    """A text config's MLA setting `key` (kv_lora_rank, qk_rope_head_dim, num_attention_heads, ...): of decoder layer
    `layer`, or where the config sets it per layer (transformers' per_layer_config: dots.3 Note) the largest over the
    layers; None where the config has no such setting."""
    per_layer = getattr(config, "per_layer_config", None)
    if per_layer is not None and getattr(config, "num_hidden_layers", None):
        layers = range(config.num_hidden_layers) if layer is None else [layer]
        values = [getattr(per_layer[i], key, None) for i in layers]
        values = [v for v in values if v is not None]
        return max(values) if values else None
    return getattr(config, key, None)


def mla_layer_count(config) -> int:
    """The model's MLA layers (latent cache layers), from its config alone."""
    return len(family_for_config(config).mla_slots(config))


def family_for_config(config) -> MLAFamily:
    """The family of a loaded model's config; a clear error for configs that are not MLA."""
    config = text_config(config)
    if mla_setting(config, "kv_lora_rank") is None:
        raise ValueError(
            f"not an MLA model: {type(config).__name__} (model_type={getattr(config, 'model_type', None)!r}) "
            "has no kv_lora_rank"
        )
    for family in FAMILIES.values():
        if config.model_type in family.model_types:
            why = family.unsupported(config)
            if why is not None:
                raise ValueError(f"{family.name}: {why}")
            return family
    known = sorted(t for f in FAMILIES.values() for t in f.model_types)
    raise ValueError(f"MLA model_type {config.model_type!r} has no adapter; supported model types: {known}. To add "
                     "it: one MLAFamily subclass in mla_quant/models/families.py naming its transformers classes (and "
                     "overriding the accessors where its attention differs), added to FAMILIES, and "
                     f"conf/model/tiny_{config.model_type}.yaml (README: Adding a family)")
