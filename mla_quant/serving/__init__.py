"""Serving: each cache format's capacity on vLLM's own scheduler (experiment=serving, docs/serving.md), and an
exported checkpoint served by vLLM itself with its latent cache in its format (experiment=serve).

    shape.py     a model's serving shape from its config alone: cache dims, layers, parameters and stored bytes
    capacity.py  a deployment's KV block budget per format, and the roofline time of one engine step
    engine.py    vLLM's v1 scheduler and block manager driven over a request trace, without a model
    vllm_backend.py  vLLM's MLA attention backends storing the exported format in its blocks, on vLLM's CPU
                 platform and on a CUDA GPU (vllm_plugin.py registers them); vllm_run.py one engine run in its own
                 process
"""

CACHE_FILE = "mla_quant_cache.json"  # an exported checkpoint's cache description, beside its weights
