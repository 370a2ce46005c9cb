"""vLLM plugin entry point (`vllm.general_plugins` in pyproject.toml): vLLM calls `register` in every engine
process. It points vLLM's CPU MLA backend at `mla_quant.serving.vllm_backend.LatentMLABackend`, which serves an
exported checkpoint's latent cache in its format and leaves every other model to vLLM's own CPU MLA code, and makes
vLLM's platform pick that backend for an exported checkpoint, or refuse one where none serves it
(`serve_exported`)."""

from __future__ import annotations

import logging
from pathlib import Path

from mla_quant.serving import CACHE_FILE


def register() -> None:
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_MLA, "mla_quant.serving.vllm_backend.LatentMLABackend")
    serve_exported(type(current_platform), current_platform.is_cpu())


def off_cpu(platform: str) -> str:
    """Why an exported checkpoint is not served on a platform other than vLLM's CPU one, and what is allowed."""
    return (f"its cache format is served on vLLM's CPU platform only, and on {platform} vLLM would store its own "
            f"cache instead; allowed: vLLM's CPU build, or the folder without {CACHE_FILE} (the weights with vLLM's "
            "own cache)")


def serve_exported(platform: type, cpu: bool) -> None:
    """The platform's config check, wrapped (once per process) for a model folder holding the cache description:
    - on the CPU platform, CPU_MLA (the member this plugin overrides) is asked for it: on a CPU with AMX, vLLM would
      give an MLA model AMX_MLA (its own BF16 cache, 128-token blocks, chunked prefill) and serve the checkpoint
      without its format; another backend asked for one is refused by name. The platform turns chunked prefill off
      for every MLA model on the CPU MLA backends; this backend reads a prompt's cached context in the format
      (`LatentMLAImpl._compute_prefill_context`), so the engine's own setting (`enable_chunked_prefill`, with its
      `max_num_batched_tokens`) is kept, and so is its prefix caching (`enable_prefix_caching`) where the format's
      blocks can be shared (`vllm_backend.shared_blocks_refused`; otherwise it stays off, and the log says why);
    - on any other platform no backend serves the format yet (vLLM's own would store its own cache and the format
      would do nothing): refused by name, with the way to serve the weights alone.
    Every other model is left as vLLM sets it."""
    check = platform.__dict__["check_and_update_config"].__func__
    if getattr(check, "serves_latent_formats", False):
        return

    def check_and_update_config(cls, vllm_config) -> None:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        model = getattr(vllm_config.model_config, "model", None)
        if model is not None and (Path(str(model)) / CACHE_FILE).is_file():
            if not cpu:
                raise ValueError(f"{model} is an exported checkpoint ({CACHE_FILE}): {off_cpu(cls.__name__)}")
            attention = vllm_config.attention_config
            if attention.backend is None:
                attention.backend = AttentionBackendEnum.CPU_MLA
            elif attention.backend != AttentionBackendEnum.CPU_MLA:
                raise ValueError(f"attention_config backend={attention.backend.name}: {model} is an exported "
                                 f"checkpoint ({CACHE_FILE}), whose cache format the CPU_MLA backend serves; allowed: "
                                 "CPU_MLA, or none (chosen for it)")
            scheduler, cache = vllm_config.scheduler_config, vllm_config.cache_config
            chunked, tokens, prefix = (scheduler.enable_chunked_prefill, scheduler.max_num_batched_tokens,
                                       cache.enable_prefix_caching)
            check(cls, vllm_config)
            if chunked:  # the backend reads a prompt's cached context: chunked prefill as the engine was asked
                scheduler.enable_chunked_prefill, scheduler.max_num_batched_tokens = True, tokens
            if prefix:
                from mla_quant.serving.vllm_backend import served, shared_blocks_refused

                why = shared_blocks_refused(served(str(model)))
                if why is None:
                    cache.enable_prefix_caching = True
                else:  # in vLLM's log (its handler is on the `vllm` logger)
                    logging.getLogger("vllm.plugins.mla_quant").info("%s: prefix caching stays off: %s", model, why)
            return None
        return check(cls, vllm_config)

    check_and_update_config.serves_latent_formats = True
    platform.check_and_update_config = classmethod(check_and_update_config)
