"""What serving needs to know of a model, from its config alone (no weights): the MLA cache dims, the layers that
cache, and the parameters and their stored bytes, split into routed experts and the rest.

    shape = serving_shape(config)      # a transformers config (a checkpoint's config.json, or a tiny model's)

Parameters are counted exactly by building the model on the meta device (no memory, no weights). Stored bytes: the
config's dtype per element, or for block-FP8 checkpoints (`quantization_config.quant_method: fp8`) one byte per
element of every matrix except the embeddings, the LM head and the MoE router, plus one float32 scale per
`weight_block_size` block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
UNQUANTIZED = ("embed_tokens", "lm_head", "mlp.gate.weight", "norm")  # kept in the activation dtype in FP8 checkpoints


@dataclass(frozen=True)
class ServingShape:
    name: str
    layers: int  # decoder layers, each caching the latent
    heads: int
    d_c: int
    d_r: int
    d_nope: int
    d_v: int
    max_positions: int
    params: int  # every parameter
    expert_params: int  # routed experts, all of them
    lm_head_params: int
    embedding_params: int
    weight_bytes: int  # stored bytes of every parameter
    expert_bytes: int
    lm_head_bytes: int
    embedding_bytes: int
    experts: int  # routed experts per MoE layer (0: dense)
    experts_per_token: int
    fp8: bool

    @property
    def dense_bytes(self) -> int:
        """Bytes every forward reads whatever the routing: attention, dense MLPs, shared experts, norms, router."""
        return self.weight_bytes - self.expert_bytes - self.lm_head_bytes - self.embedding_bytes

    @property
    def dense_params(self) -> int:
        return self.params - self.expert_params - self.lm_head_params - self.embedding_params

    def active_params(self) -> float:
        """Matmul parameters per token (the LM head apart): the dense ones and the routed experts' share."""
        share = self.experts_per_token / self.experts if self.experts else 0.0
        return self.dense_params + self.expert_params * share

    def expert_fraction_read(self, tokens: int) -> float:
        """The expected share of routed experts a step of `tokens` tokens activates (uniform routing):
        1 - (1 - k/E)^tokens; it reads those experts' weights once."""
        if not self.experts or tokens <= 0:
            return 0.0
        return 1.0 - (1.0 - self.experts_per_token / self.experts) ** tokens


def _stored_bytes(name: str, p: torch.Tensor, element: int, fp8_block: tuple[int, int] | None) -> int:
    if fp8_block is None or p.dim() < 2 or any(k in name for k in UNQUANTIZED):
        return p.numel() * element
    rows, cols = p.shape[-2:]
    scales = math.ceil(rows / fp8_block[0]) * math.ceil(cols / fp8_block[1]) * (p.numel() // (rows * cols))
    return p.numel() + 4 * scales


def serving_shape(config, name: str = "model") -> ServingShape:
    """The serving shape of an MLA model config (see the module docstring)."""
    from mla_quant.models.families import family_for_config, mla_setting

    family = family_for_config(config)
    text = config.get_text_config(decoder=True)
    cls = getattr(family.modeling, family.model_class_name)
    with torch.device("meta"):
        model = cls(config)
    q = getattr(config, "quantization_config", None) or {}
    q = q if isinstance(q, dict) else q.to_dict()
    fp8 = q.get("quant_method") == "fp8"
    block = tuple(q.get("weight_block_size") or (128, 128)) if fp8 else None
    dtype = str(getattr(text, "dtype", None) or getattr(text, "torch_dtype", None) or "bfloat16").replace("torch.", "")
    element = DTYPE_BYTES.get(dtype, 2)
    totals = {k: [0, 0] for k in ("all", "experts", "lm_head", "embedding")}
    for pname, p in model.named_parameters():
        size = _stored_bytes(pname, p, element, block)
        kinds = ["all"] + (["experts"] if ".experts." in pname else []) + (["lm_head"] if "lm_head" in pname else []) \
            + (["embedding"] if "embed_tokens" in pname else [])
        for k in kinds:
            totals[k][0] += p.numel()
            totals[k][1] += size
    experts = int(getattr(text, "n_routed_experts", None) or 0)
    return ServingShape(
        # where the layers' MLA dims differ, the largest layer's: an engine's one page size per KV group
        name=name, layers=len(family.mla_slots(config)), heads=int(mla_setting(text, "num_attention_heads")),
        d_c=int(mla_setting(text, "kv_lora_rank")), d_r=int(mla_setting(text, "qk_rope_head_dim")),
        d_nope=int(mla_setting(text, "qk_nope_head_dim")), d_v=int(mla_setting(text, "v_head_dim")),
        max_positions=int(text.max_position_embeddings), params=totals["all"][0], expert_params=totals["experts"][0],
        lm_head_params=totals["lm_head"][0], embedding_params=totals["embedding"][0], weight_bytes=totals["all"][1],
        expert_bytes=totals["experts"][1], lm_head_bytes=totals["lm_head"][1], embedding_bytes=totals["embedding"][1],
        experts=experts, experts_per_token=int(getattr(text, "num_experts_per_tok", None) or 0) if experts else 0,
        fp8=fp8)
