"""Synthetic task generators (needle retrieval, arithmetic word problems, tiny code) for the toy MLA model.

Each generator is deterministic from a seed and splits train from held-out test data by a hash of the example's
key (`mla_quant.tasks.split`). Each example also has a `prompt`/`answer` pair: exactly the text lm-eval builds
for it and the completion the model must produce, which is what the toy model is trained on.
"""
