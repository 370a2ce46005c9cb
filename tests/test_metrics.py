"""The metric names' one schema: what the stages write (`eval_key`, `bytes_key`, `layer_key`, `sweep_key`) reads
back through the same module (`parse_eval`, `parse_bytes`, `parse_sensitivity`), and names it does not own are not
misread."""

import pytest

from mla_quant.metrics import (EvalKey, bytes_key, eval_key, layer_key, parse_bytes, parse_eval, parse_sensitivity,
                               sweep_key)


@pytest.mark.parametrize("task,metric,setting,region", [
    ("toy_gsm8k", "exact_match", "model", None),
    ("toy_gsm8k", "exact_match_stderr", "model", None),
    ("toy_niah_single_1", "em_1024", "model", None),
    ("niah_single_1", "4096", "model", None),
    ("toy_niah_single_1", "exact_match", "rope=0", None),
    ("toy_niah_single_1", "examples", "model", "protected"),
    ("toy_niah_single_1", "exact_match", "rope=0", "quantized"),
])
def test_eval_names_read_back(task, metric, setting, region):
    assert parse_eval(eval_key(task, metric, setting, region)) == EvalKey(task, metric, setting, region)


def test_eval_key_reading():
    assert parse_eval("eval/toy_gsm8k/exact_match").headline
    assert not parse_eval("eval/toy_gsm8k/exact_match_stderr").score
    assert parse_eval("eval/toy_gsm8k/exact_match").stderr_key() == "eval/toy_gsm8k/exact_match_stderr"
    assert parse_eval("eval/control_no_rope/toy_niah_single_1/em_512").length == 512
    assert parse_eval("eval/niah_single_1/4096").length == 4096
    assert parse_eval("eval/toy_niah_single_1/needle_protected/exact_match").length is None
    assert not parse_eval("eval/toy_niah_single_1/needle_protected/exact_match").headline
    for other in ("eval/seconds", "eval/cache_calls", "eval/control_no_rope/seconds", "cache/held_bytes",
                  "eval/toy_gsm8k/cache/held_bytes_per_token_per_layer", "sensitivity/layer0/x"):
        assert parse_eval(other) is None, other
    with pytest.raises(ValueError, match="setting='rope=1'; allowed"):
        eval_key("t", "exact_match", "rope=1")


def test_bytes_and_sensitivity_names_read_back():
    assert parse_bytes(bytes_key("int4_joint", 4096, "pct_of_bf16")) == ("int4_joint", 4096, "pct_of_bf16")
    assert parse_bytes("bytes/int4_joint/4096/pct_of_bf16") is None
    assert parse_sensitivity(layer_key(3, "amplification/attn_output")) == {"layer": 3,
                                                                          "rest": "amplification/attn_output"}
    assert parse_sensitivity(sweep_key(0.01, "rope", "logits")) == {"nmse": 0.01, "path": "rope", "site": "logits"}
    assert parse_sensitivity("sensitivity/amplification/logits") is None
    assert parse_sensitivity("eval/x/y") is None
