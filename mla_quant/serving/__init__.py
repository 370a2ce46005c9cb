"""Serving capacity of each cache format on vLLM's own scheduler (experiment=serving, docs/serving.md).

    shape.py     a model's serving shape from its config alone: cache dims, layers, parameters and stored bytes
    capacity.py  a deployment's KV block budget per format, and the roofline time of one engine step
    engine.py    vLLM's v1 scheduler and block manager driven over a request trace, without a model
"""
