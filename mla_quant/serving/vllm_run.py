"""One vLLM engine run in its own process: a checkpoint folder, prompts as token ids, greedy decoding, a KV memory
budget; what the engine did, as JSON. `experiment=serve` starts one per cache (vLLM's own BF16 cache, then the
exported format through `mla_quant.serving.vllm_backend`), so no engine state outlives its run.

    python -m mla_quant.serving.vllm_run request.json result.json

request: {"model": folder, "prompts": [[ids], ...], "max_tokens": n, "dtype": "float32", "kv_cache_memory_bytes": b,
          "max_model_len": n, "max_num_seqs": n}
result:  {"tokens": [[ids], ...], "num_blocks": n, "block_size": n, "page_bytes_per_block": n (one layer),
          "preemptions": n, "seconds": s, "output_tokens": n, "format": name or null, "decode_backend": ...}
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def run_engine(request: dict) -> dict:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # share the machine's cores with the caller
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import LLM, SamplingParams

    from mla_quant.serving.vllm_backend import EnginePages, read_description, served_format

    # vLLM's C++ rotary op gives wrong query RoPE values for some heads at small head dims on the CPU; its PyTorch
    # rotary is exact.
    llm = LLM(model=request["model"], runner="generate", enforce_eager=True, dtype=request.get("dtype", "float32"),
              compilation_config={"custom_ops": ["-rotary_embedding"]}, max_model_len=int(request["max_model_len"]),
              kv_cache_memory_bytes=int(request["kv_cache_memory_bytes"]), disable_log_stats=False,
              max_num_seqs=int(request.get("max_num_seqs", 256)), seed=0)
    config = llm.llm_engine.vllm_config
    params = SamplingParams(max_tokens=int(request["max_tokens"]), temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in request["prompts"]], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    preemptions = sum(int(getattr(m, "value", 0)) for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    description = read_description(request["model"])
    fmt = None if description is None else served_format(description)
    block_size = int(config.cache_config.block_size)
    if fmt is None:
        text = config.model_config.hf_text_config
        page = block_size * (int(text.kv_lora_rank) + int(text.qk_rope_head_dim)) * config.model_config.dtype.itemsize
    else:
        page = EnginePages(fmt, block_size, config.model_config.dtype).token_bytes * block_size
    return {"tokens": tokens, "num_blocks": int(config.cache_config.num_gpu_blocks), "block_size": block_size,
            "page_bytes_per_block": page, "preemptions": preemptions, "seconds": seconds,
            "output_tokens": sum(len(t) for t in tokens), "format": None if fmt is None else fmt.name,
            "decode_backend": "vllm" if fmt is None else fmt.step_backends("cpu")["decode"]}


def main(argv: list[str]) -> None:
    request, result = Path(argv[0]), Path(argv[1])
    from mla_quant.record import write_json_atomic

    write_json_atomic(result, run_engine(json.loads(request.read_text())))


if __name__ == "__main__":
    main(sys.argv[1:])
