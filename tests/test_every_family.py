"""Stages on every family's tiny model that the family suites do not run: an lm-eval toy suite through the latent
cache HFLM with a quantized cache (the evaluate stage's code path, on a random model given the toy tokenizer's
vocabulary: the score is not the point, the path is), and the serving study's shape (parameters counted on the meta
device from the config alone equal to the built model's)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import warnings  # noqa: E402

import pytest  # noqa: E402
from conftest import compose, options  # noqa: E402
from test_quant_cache import TINY as QUANT_TINY  # noqa: E402
from test_quant_cache import quant_cfg  # noqa: E402

from mla_quant.eval.harness import LatentCacheHFLM, evaluate_tasks  # noqa: E402
from mla_quant.eval.task_files import write_task_files  # noqa: E402
from mla_quant.models.absorbed import model_layer_factory  # noqa: E402
from mla_quant.plan import parameter_count  # noqa: E402
from mla_quant.prepare import build_model, model_config  # noqa: E402
from mla_quant.toy.model import load_toy_tokenizer  # noqa: E402

TINY = [o for o in options("model") if o.startswith("tiny_") and "dims" not in o]


@pytest.fixture(scope="module")
def tok():
    return load_toy_tokenizer()


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory, tok):
    return write_task_files(tmp_path_factory.mktemp("tasks"), tok, niah_lengths=(256,), niah_per_length=2,
                            arithmetic_n=2, code_n=1)


def _with_vocab(option: str, vocab: int):
    """The tiny option with the toy tokenizer's vocabulary (its text config's, for a multimodal wrapper)."""
    cfg = compose([f"model={option}"]).model
    key = "text_config.vocab_size" if "text_config" in cfg.config else "vocab_size"
    return compose([f"model={option}", f"model.config.{key}={vocab}"]).model


@pytest.mark.every_family("option")
@pytest.mark.parametrize("option", TINY)
def test_every_family_evaluates_a_toy_suite_with_a_quantized_cache(option, tok, task_dir):
    model = build_model(_with_vocab(option, len(tok)))
    with warnings.catch_warnings():  # a model without a RoPE key in some layer says so once
        warnings.simplefilter("ignore", UserWarning)
        factory = model_layer_factory(model, quant_cfg("int4_joint", *QUANT_TINY))
    lm = LatentCacheHFLM(model, tok, layer_factory=factory, batch_size=1)
    res = evaluate_tasks(lm, ["toy_gsm8k"], task_dir, limit=1)
    assert 0.0 <= res["results"]["toy_gsm8k"]["exact_match,strict-match"] <= 1.0
    assert lm.cache_calls >= 1  # generated over a fresh quantized latent cache


@pytest.mark.parametrize("option", TINY)
def test_the_serving_shape_counts_every_familys_parameters_on_the_meta_device(option):
    cfg = compose([f"model={option}"])
    built = build_model(cfg.model, absorbed=False)
    assert parameter_count(model_config(cfg.model)) == sum(p.numel() for p in built.parameters())
