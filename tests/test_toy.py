"""The embedded toy model: tokenizer, the shipped checkpoint (and its errors), configs, and the training loop."""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import pytest
import torch

from mla_quant.models.absorbed import is_absorbed
from mla_quant.tasks import arithmetic, code, niah
from mla_quant.toy.model import (ASSETS, TOY_CONFIG, ToyCheckpointError, load_toy_model, load_toy_tokenizer,
                                 new_toy_model, sha256_of, toy_config)
from mla_quant.toy.tokenizer import build_tokenizer
from mla_quant.toy.train import CHECKPOINT, TrainOptions, encode_doc, make_batch, sample_doc, train

CONF = Path(__file__).resolve().parents[1] / "conf"


@pytest.fixture(scope="module")
def shipped_tokenizer():
    return load_toy_tokenizer()


def sample_texts():
    rng = random.Random(0)
    return ["".join(niah.train_example(rng, "single_3", 600)), "".join(arithmetic.train_example(rng)),
            "".join(code.train_example(rng)), "unicode ok: é ü 数字 \t tabs  and  spaces\n"]


def test_tokenizer_round_trip_and_offline_autotokenizer(shipped_tokenizer, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ASSETS))
    assert tok.eos_token == "</s>" and tok.eos_token_id == 1 and tok.pad_token_id == 0
    for text in sample_texts():
        ids = tok(text).input_ids
        assert tok.decode(ids) == text
        assert tok.eos_token_id not in ids and tok.pad_token_id not in ids  # no special tokens added
    assert tok("1234567").input_ids == [tok.convert_tokens_to_ids(c) for c in "1234567"]  # digits one by one


def test_uuid_value_starts_like_a_number(shipped_tokenizer):
    """A UUID-like value never merges with the space before it: both kinds of answer start with the token " "."""
    tok = shipped_tokenizer
    space = tok(" ").input_ids
    for value in ("ce5b6b62-ca10-893a-5749-c38314770eab", "4817263", "ab7b2174-8c9b-753e-011d-c1f2a06159e0"):
        assert tok(" " + value).input_ids[:1] == space, value
        assert tok(f"is: {value}.").input_ids[2:3] == space, value


def test_training_needle_docs_ask_every_needle(shipped_tokenizer):
    opts = TrainOptions(mix={"niah": 1.0}, niah_variants={"multikey_1": 1.0})
    segments = sample_doc(random.Random(0), shipped_tokenizer, opts, 512)
    prompt = segments[0][0]
    needles = dict(re.findall(r"magic numbers for (\S+) is: (\d+)\.", prompt))
    assert len(segments) == len(needles) == 4
    asked = {}
    for text, answer in segments:
        key = re.findall(r"The special magic number for (\S+) mentioned in the provided text is$", text)
        assert len(key) == 1, text[-120:]
        asked[key[0]] = answer.strip()
    assert asked == needles  # each needle asked once, with its own value
    ids, labels = encode_doc(shipped_tokenizer, *segments)
    assert len(ids) <= 512
    supervised = [t for t, lab in zip(ids, labels) if lab != -100]
    assert supervised.count(shipped_tokenizer.eos_token_id) == 4


def test_tokenizer_recipe_reproduces_shipped(shipped_tokenizer):
    assert build_tokenizer().get_vocab() == shipped_tokenizer.get_vocab()


def test_shipped_checkpoint_matches_config_and_record():
    model = load_toy_model()
    assert is_absorbed(model)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank", "qk_rope_head_dim",
                "qk_nope_head_dim", "v_head_dim", "max_position_embeddings", "vocab_size"):
        assert getattr(model.config, key) == TOY_CONFIG[key], key
    assert model.config.kv_lora_rank > model.config.qk_nope_head_dim  # latent wider than one head
    record = json.loads((ASSETS / "TRAINING.json").read_text())
    assert record["weights_sha256"] == sha256_of(ASSETS / "model.safetensors")
    assert record["parameters"] == sum(p.numel() for p in model.parameters())
    from omegaconf import OmegaConf

    recipe = OmegaConf.load(CONF / "experiment" / "train_toy.yaml").task
    assert record["steps"] == recipe.steps and record["seed"] == 0
    for key in ("lr", "warmup_steps", "grad_clip"):
        assert record["options"][key] == recipe[key], key
    assert (ASSETS / "model.safetensors").stat().st_size < 15e6


def test_shipped_model_generates_a_needle(shipped_tokenizer):
    """A smoke check that the weights are trained, not random: it retrieves a held-out needle."""
    from mla_quant.models.absorbed import cache_kwargs, new_cache

    model = load_toy_model()
    count = lambda s: len(shipped_tokenizer(s).input_ids)  # noqa: E731
    docs = niah.test_set("single_1", [256], 4, seed=99, count_tokens=count)
    hits = 0
    for doc in docs:
        ids = shipped_tokenizer(doc["prompt"], return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=10, do_sample=False, **cache_kwargs(new_cache(model)))
        hits += doc["outputs"][0] in shipped_tokenizer.decode(out[0, ids.shape[1]:])
    assert hits >= 2, f"retrieved {hits}/4 needles"


def test_shipped_model_works_a_sum(shipped_tokenizer):
    """...and works held-out arithmetic in columns to the right `#### N`."""
    model = load_toy_model(absorbed=False)
    hits = 0
    for problem in arithmetic.test_set(4, seed=99):
        ids = shipped_tokenizer(problem["prompt"], return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=110, do_sample=False)
        hits += shipped_tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True) == problem["completion"]
    assert hits >= 3, f"solved {hits}/4 problems"


@pytest.mark.parametrize("damage", ["missing", "truncated", "garbage_no_record", "missing_config"])
def test_damaged_checkpoint_names_the_file(tmp_path, damage):
    folder = tmp_path / "assets"
    shutil.copytree(ASSETS, folder)
    weights = folder / "model.safetensors"
    if damage == "missing":
        weights.unlink()
    elif damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "garbage_no_record":
        (folder / "TRAINING.json").unlink()
        weights.write_bytes(b"\x00garbage" * 100)
    elif damage == "missing_config":
        (folder / "config.json").unlink()
    name = "config.json" if damage == "missing_config" else "model.safetensors"
    with pytest.raises(ToyCheckpointError, match=name):
        load_toy_model(path=folder)


def test_checkpoint_config_mismatch_is_named(tmp_path):
    folder = tmp_path / "assets"
    shutil.copytree(ASSETS, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_hidden_layers"] = cfg["num_hidden_layers"] + 1
    cfg["first_k_dense_replace"] = cfg["num_hidden_layers"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ToyCheckpointError, match="does not match"):
        load_toy_model(path=folder)


def test_hydra_configs_compose_and_instantiate():
    import hydra
    from hydra.utils import instantiate

    from mla_quant.prepare import build_model

    with hydra.initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = hydra.compose("config", overrides=["experiment=evaluate", "logger=none"])
        assert cfg.model._target_ == "mla_quant.toy.model.load_toy_model" and cfg.eval.name == "toy"
        model = build_model(cfg.model)
        tok = instantiate(cfg.model.tokenizer)
        assert is_absorbed(model) and tok.eos_token_id == model.config.eos_token_id
        cfg = hydra.compose("config", overrides=["experiment=train_toy", "logger=none"])
        assert cfg.task._target_ == "mla_quant.stages.train_toy.run" and cfg.task.steps > 0


TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "first_k_dense_replace": 2,
        "num_attention_heads": 2, "num_key_value_heads": 2, "kv_lora_rank": 24, "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8, "v_head_dim": 8}


def test_training_smoke_checkpoint_and_resume(tmp_path, shipped_tokenizer):
    tok = shipped_tokenizer
    opts = dict(steps=4, warmup_steps=2, curriculum=[[0.0, 96, 2], [0.5, 192, 1]], checkpoint_every=1,
                eval_every=2, eval_docs=2, threads=1)
    ids, labels = make_batch(tok, TrainOptions(**opts), 0)
    assert ids.shape == (2, 96) and (labels != -100).any()
    assert torch.equal(make_batch(tok, TrainOptions(**opts), 3)[0], make_batch(tok, TrainOptions(**opts), 3)[0])

    def fresh():
        return new_toy_model(toy_config({"vocab_size": len(tok), **TINY}), seed=0)

    straight = fresh()
    summary = train(straight, tok, TrainOptions(**opts), tmp_path / "a", progress=False)
    assert summary["steps"] == 4 and torch.isfinite(torch.tensor(summary["final_loss"]))
    assert (tmp_path / "a" / CHECKPOINT).is_file()

    interrupted = fresh()
    train(interrupted, tok, TrainOptions(**opts, stop_at=2), tmp_path / "b", progress=False)
    assert torch.load(tmp_path / "b" / CHECKPOINT, weights_only=False)["step"] == 2
    resumed = fresh()
    summary = train(resumed, tok, TrainOptions(**opts), tmp_path / "c", resume=tmp_path / "b", progress=False)
    assert summary["steps"] == 4
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), f"{name}: max diff {(a - b).abs().max().item():.3g} after resume"


def test_resume_from_missing_dir_is_named(tmp_path, shipped_tokenizer):
    model = new_toy_model(toy_config({"vocab_size": len(shipped_tokenizer), **TINY}), seed=0)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        train(model, shipped_tokenizer, TrainOptions(steps=1), tmp_path, resume=tmp_path / "nowhere", progress=False)
