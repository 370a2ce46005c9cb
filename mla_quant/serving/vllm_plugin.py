"""vLLM plugin entry point (`vllm.general_plugins` in pyproject.toml): vLLM calls `register` in every engine
process. It points vLLM's CPU MLA backend at `mla_quant.serving.vllm_backend.LatentMLABackend` and, on a CUDA GPU,
registers `LatentTritonMLABackend` as vLLM's CUSTOM backend: each serves an exported checkpoint's latent cache in its
format and leaves every other model to vLLM's own code. It makes vLLM's platform pick that backend for an exported
checkpoint, or refuse one where none serves it (`serve_exported`)."""

from __future__ import annotations

import logging
from pathlib import Path

from mla_quant.serving import CACHE_FILE

SERVED_ON = {"cpu": "CPU_MLA", "cuda": "CUSTOM"}  # the platforms a backend serves the formats on, and its member


def register() -> None:
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_MLA, "mla_quant.serving.vllm_backend.LatentMLABackend")
    if current_platform.is_cuda():
        register_backend(AttentionBackendEnum.CUSTOM, "mla_quant.serving.vllm_backend.LatentTritonMLABackend")
    serve_exported(type(current_platform), platform_kind(current_platform))


def platform_kind(platform) -> str:
    """"cpu" (vLLM's CPU platform), "cuda" (an NVIDIA GPU's), or the platform's class name (no backend of ours)."""
    return "cpu" if platform.is_cpu() else "cuda" if platform.is_cuda() else type(platform).__name__


def unserved(platform: str) -> str:
    """Why an exported checkpoint is not served on a platform without a backend of ours, and what is allowed."""
    return (f"its cache format is served on vLLM's CPU platform and on CUDA GPUs only, and on {platform} vLLM would "
            f"store its own cache instead; allowed: vLLM's CPU build, a CUDA GPU, or the folder without {CACHE_FILE} "
            "(the weights with vLLM's own cache)")


def serve_exported(platform: type, kind: str) -> None:
    """The platform's config check, wrapped (once per process) for a model folder holding the cache description:
    - the backend that serves the format on the platform (`SERVED_ON`) is asked for it: CPU_MLA on vLLM's CPU
      platform (on a CPU with AMX, vLLM would give an MLA model AMX_MLA, its own BF16 cache, and serve the
      checkpoint without its format), CUSTOM on a CUDA GPU; another backend asked for one is refused by name;
    - chunked prefill: vLLM's CPU platform turns it off for every MLA model on its CPU MLA backends; this backend
      reads a prompt's cached context in the format (`LatentFormatImpl._compute_prefill_context`), so the engine's
      own setting (`enable_chunked_prefill`, with its `max_num_batched_tokens`) is kept;
    - prefix caching (`enable_prefix_caching`) is kept where the format's blocks can be shared
      (`vllm_backend.shared_blocks_refused`); otherwise it is turned off, and the log says why;
    - vLLM's compile pass fusing RoPE with the MLA cache write (`fuse_rope_kvcache_cat_mla`), which would write
      vLLM's own layout instead of the format, is turned off;
    - on any other platform no backend serves the format (vLLM's own would store its own cache and the format
      would do nothing): refused by name, with the way to serve the weights alone.
    Every other model is left as vLLM sets it."""
    check = platform.__dict__["check_and_update_config"].__func__
    if getattr(check, "serves_latent_formats", False):
        return

    def check_and_update_config(cls, vllm_config) -> None:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        model = getattr(vllm_config.model_config, "model", None)
        if model is not None and (Path(str(model)) / CACHE_FILE).is_file():
            if kind not in SERVED_ON:
                raise ValueError(f"{model} is an exported checkpoint ({CACHE_FILE}): {unserved(cls.__name__)}")
            ours = AttentionBackendEnum[SERVED_ON[kind]]
            attention = vllm_config.attention_config
            if attention.backend is None:
                attention.backend = ours
            elif attention.backend != ours:
                raise ValueError(f"attention_config backend={attention.backend.name}: {model} is an exported "
                                 f"checkpoint ({CACHE_FILE}), whose cache format the {ours.name} backend serves "
                                 f"on this platform; allowed: {ours.name}, or none (chosen for it)")
            scheduler, cache = vllm_config.scheduler_config, vllm_config.cache_config
            chunked, tokens, prefix = (scheduler.enable_chunked_prefill, scheduler.max_num_batched_tokens,
                                       cache.enable_prefix_caching)
            check(cls, vllm_config)
            # vLLM's RoPE + MLA cache-write fusion (a compile pass, on when the cache update is compiled into the
            # graph) writes vLLM's own layout in place of the backend's cache update: off, so the format is written
            vllm_config.compilation_config.pass_config.fuse_rope_kvcache_cat_mla = False
            if chunked:  # the backend reads a prompt's cached context: chunked prefill as the engine was asked
                scheduler.enable_chunked_prefill, scheduler.max_num_batched_tokens = True, tokens
            if prefix:
                from mla_quant.serving.vllm_backend import served, shared_blocks_refused

                why = shared_blocks_refused(served(str(model)))
                cache.enable_prefix_caching = why is None
                if why is not None:  # in vLLM's log (its handler is on the `vllm` logger)
                    logging.getLogger("vllm.plugins.mla_quant").info("%s: prefix caching stays off: %s", model, why)
            return None
        return check(cls, vllm_config)

    check_and_update_config.serves_latent_formats = True
    platform.check_and_update_config = classmethod(check_and_update_config)
