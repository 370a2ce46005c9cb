"""vLLM plugin entry point (`vllm.general_plugins` in pyproject.toml): vLLM calls `register` in every engine
process. It points vLLM's CPU MLA backend at `mla_quant.serving.vllm_backend.LatentMLABackend`, which serves an
exported checkpoint's latent cache in its format and leaves every other model to vLLM's own CPU MLA code."""

from __future__ import annotations


def register() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_MLA, "mla_quant.serving.vllm_backend.LatentMLABackend")
