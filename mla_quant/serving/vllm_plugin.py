"""vLLM plugin entry point (`vllm.general_plugins` in pyproject.toml): vLLM calls `register` in every engine
process. It points vLLM's CPU MLA backend at `mla_quant.serving.vllm_backend.LatentMLABackend`, which serves an
exported checkpoint's latent cache in its format and leaves every other model to vLLM's own CPU MLA code, and makes
vLLM's CPU platform pick that backend for an exported checkpoint (`serve_on_cpu_mla`)."""

from __future__ import annotations

from pathlib import Path

from mla_quant.serving import CACHE_FILE


def register() -> None:
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_MLA, "mla_quant.serving.vllm_backend.LatentMLABackend")
    if current_platform.is_cpu():
        serve_on_cpu_mla(type(current_platform))


def serve_on_cpu_mla(platform: type) -> None:
    """On a CPU with AMX, vLLM's CPU platform gives an MLA model its AMX_MLA backend (vLLM's own BF16 cache, 128-token
    blocks, chunked prefill) unless CPU_MLA is asked for, so an exported checkpoint would be served without its
    format. The platform's config check is wrapped to ask for CPU_MLA (the member this plugin overrides) for a model
    folder holding the cache description, and to refuse by name another backend asked for one; every other model is
    left as vLLM sets it. Wrapped once per process."""
    check = platform.__dict__["check_and_update_config"].__func__
    if getattr(check, "serves_latent_formats", False):
        return

    def check_and_update_config(cls, vllm_config) -> None:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        model = getattr(vllm_config.model_config, "model", None)
        if model is not None and (Path(str(model)) / CACHE_FILE).is_file():
            attention = vllm_config.attention_config
            if attention.backend is None:
                attention.backend = AttentionBackendEnum.CPU_MLA
            elif attention.backend != AttentionBackendEnum.CPU_MLA:
                raise ValueError(f"attention_config backend={attention.backend.name}: {model} is an exported "
                                 f"checkpoint ({CACHE_FILE}), whose cache format the CPU_MLA backend serves; allowed: "
                                 "CPU_MLA, or none (chosen for it)")
        return check(cls, vllm_config)

    check_and_update_config.serves_latent_formats = True
    platform.check_and_update_config = classmethod(check_and_update_config)
