"""The real-checkpoint path on a written folder: experiment=write_checkpoint writes a family-shaped Hugging Face folder
(config.json, safetensors shards, tokenizer, GSM8K-format data files), and `model=<real> model.path=<folder>` loads it
through from_pretrained and runs every stage of the rehearsal end to end (quality, sensitivity, calibration, lm-eval's
own gsm8k task on the local files and RULER's niah_single_1), each record holding seconds and peak memory, per stage
and per decoder layer; bad shapes are refused."""

import json

import pytest
from conftest import run_cli


def run_py(*args):
    return run_cli(*args, "logger=none")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("rehearsal")
    out = run_py("experiment=write_checkpoint", "task.like=small_deepseek_v2", f"task.out={root / 'ckpt'}",
                 "task.shard_mb=0.3", f"hydra.run.dir={root / 'run'}")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return root / "ckpt"


def test_the_folder_is_a_checkpoint(folder):
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "tokenizer.json", "mla_quant_rehearsal.json"} <= names
    assert len([n for n in names if n.endswith(".safetensors")]) > 1, names  # 0.3 MB shards: several
    config = json.loads((folder / "config.json").read_text())
    meta = json.loads((folder / "mla_quant_rehearsal.json").read_text())
    assert config["model_type"] == "deepseek_v2" and config["vocab_size"] == 1024
    assert meta["run_as"] == "deepseek_v2_lite" and meta["attention"]["kv_lora_rank"] == config["kv_lora_rank"]
    rows = [json.loads(line) for line in (folder / "data" / "gsm8k" / "test.jsonl").read_text().splitlines()]
    assert len(rows) == 64 and all(set(r) == {"question", "answer"} and "\n#### " in r["answer"] for r in rows)
    assert meta["data_files"]["gsm8k"]["train"].endswith("data/gsm8k/train.jsonl")
    text = [json.loads(line) for line in (folder / "data" / "text" / "train.jsonl").read_text().splitlines()]
    assert len(text) == 400 and all(set(r) == {"text"} and r["text"] for r in text)
    assert meta["data_files"]["text"]["test"].endswith("data/text/test.jsonl")


@pytest.mark.slow
def test_the_headline_pipeline_runs_on_it_to_its_summary(folder, tmp_path):
    """`python run.py model=deepseek_v2_lite quant=int4_joint` on the folder, with its local data files: every step
    (sensitivity, cache bytes, calibration, the BF16 reference and the evaluation with the model's eval=paper, here
    lm-eval's own gsm8k task with its regex filters; RULER's stock haystack, which lm-eval builds 500 samples long
    whatever the limit, runs in test_eval_suites) runs as on a real checkpoint (seconds and memory per decoder layer in
    each record), then the tables and the summary."""
    run_dir = tmp_path / "run"
    out = run_py("model=deepseek_v2_lite", f"model.path={folder}", "model.dtype=float32", "model.device_map=null",
                 "model.quant_group_size.wide=16", "model.quant_group_size.narrow=8", "quant=int4_joint",
                 "profile_layers=true", "transform=quantmla",
                 f"calib.data_files={{train:{folder}/data/text/train.jsonl}}", "calib.samples=2", "calib.seq_len=64", "calib.batch_size=2", "calib.query_tokens=16",
                 "transform.fit.steps=2", f"transform.fit.cache_dir={tmp_path / 'calibration'}",
                 "eval.tasks=[gsm8k]", f"eval.data_files={{gsm8k:{{train:{folder}/data/gsm8k/train.jsonl,"
                 f"test:{folder}/data/gsm8k/test.jsonl}}}}", "eval.limit=2",
                 "eval.num_fewshot=1", "eval.gen_kwargs={max_gen_toks:4}",
                 'task.sensitivity=["task.seeds=1","task.sweep_nmse=[]","task.probe.num_sequences=1",'
                 '"task.rope_pairs=false","task.per_layer=false"]',
                 f"hydra.run.dir={run_dir}")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    steps = sorted(p.name for p in run_dir.glob("0*_*"))
    assert steps == ["01_sensitivity", "02_cache_bytes", "03_calibrate-quantmla-int4_joint", "04_evaluate-bf16",
                     "05_evaluate-quantmla-int4_joint"], steps
    sens, _, calib, _, ev = (_stage_record(run_dir / step) for step in steps)
    assert any(k.startswith("sensitivity/") for k in sens["metrics"]), sens["metrics"]
    m = calib["metrics"]
    assert m["calib/reused"] == 0 and m["calib/content/error"] <= m["calib/content/error_none"], m
    assert ev["choices"]["eval"] == "paper"
    m = ev["metrics"]
    assert "eval/gsm8k/exact_match" in m and "eval/gsm8k/exact_match@flexible-extract" in m, m
    assert "pipeline/accuracy/quantmla/int4_joint" in json.loads((run_dir / "record.json").read_text())["metrics"]
    assert (run_dir / "summary.md").is_file() and (run_dir / "analysis" / "index.md").is_file()


def test_a_stage_runs_on_it_as_a_real_checkpoint(folder, tmp_path):
    out = run_py("experiment=quality", "model=deepseek_v2_lite", f"model.path={folder}", "model.dtype=float32",
                 "model.device_map=null", "quant=int4_joint", "model.quant_group_size.wide=16",
                 "model.quant_group_size.narrow=16", "quant.protected.recent=8", "task.data.source=random",
                 "task.data.samples=2", "task.data.seq_len=64", f"hydra.run.dir={tmp_path}")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    record = json.loads((tmp_path / "record.json").read_text())
    m = record["metrics"]
    assert record["status"] == "ok" and record["choices"]["model"] == "deepseek_v2_lite"
    assert m["quality/kl"] > 0, m  # tokens past the protected region were read back quantized
    assert m["plan/peak_gb"] > m["plan/weights_gb"] > 0 and "memory plan (quality, cpu)" in out.stdout  # predicted
    assert record["memory"]["peak_gb"] > 0 and record["memory"]["measured"] == "cpu_resident"
    assert record["seconds"] > 0


REAL = ["model=deepseek_v2_lite", "model.dtype=float32", "model.device_map=null", "model.quant_group_size.wide=16",
        "model.quant_group_size.narrow=8", "profile_layers=true"]


def _stage_record(run_dir, layers=2):
    """A step's record on the folder: finished, with profile_layers=true's seconds and peak added memory per decoder
    layer (cache_bytes runs no model: only its status)."""
    record = json.loads((run_dir / "record.json").read_text())
    assert record["status"] == "ok", record.get("error")
    if record["choices"]["experiment"] != "cache_bytes":
        per_layer = record["memory"]["layers"]
        assert [r["layer"] for r in per_layer] == list(range(layers)), per_layer
        assert all(r["calls"] > 0 and r["seconds"] > 0 for r in per_layer), per_layer
    return record


def _ran(out, run_dir):
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return _stage_record(run_dir)


def test_mixed_precision_from_the_checkpoints_sensitivity_record(folder, tmp_path):
    """quant=mixed on the real-checkpoint path: the weights come from a sensitivity run on the same folder (no new
    injection, no evaluation to choose), the cache NMSE of each width from calibration latents; each layer's format
    and bytes land in the record."""
    sens = tmp_path / "sens"
    _ran(run_py("experiment=sensitivity", "task.probe.source=random", "task.probe.num_sequences=1",
                "task.probe.seq_len=64", "task.sweep_nmse=[]", "task.seeds=1", "task.mechanism=false",
                "task.rope_pairs=false", *REAL, f"model.path={folder}", f"hydra.run.dir={sens}"), sens)
    run_dir = tmp_path / "run"
    record = _ran(run_py("experiment=quality", "quant=mixed", "quant.budget=int2_content_int4_rope",
                         f"quant.allocation.sensitivity={sens}", f"quant.allocation.cache_dir={tmp_path}",
                         "quant.protected.recent=8", "calib.source=random", "calib.samples=2", "calib.seq_len=64",
                         "task.data.source=random", "task.data.samples=2", "task.data.seq_len=64", *REAL,
                         f"model.path={folder}", f"hydra.run.dir={run_dir}"), run_dir)
    m = record["metrics"]
    assert m["alloc/weights_from"] == str(sens) and m["alloc/reused"] == 0
    assert m["alloc/bytes_per_token_per_layer"] <= m["alloc/budget"] and "cache/layer1/rope" in m
    assert m["quality/kl"] > 0


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_corrupt_weight_file_is_named(folder, tmp_path, damage):
    """A local folder whose safetensors shard is cut short or overwritten: one line naming the file and what is
    wrong, before transformers reads it (not safetensors' traceback without the file's name)."""
    import shutil

    copy = tmp_path / "ckpt"
    shutil.copytree(folder, copy)
    shard = sorted(copy.glob("*.safetensors"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 1000] if damage == "truncated" else b"\x10\x00" + data[2:])
    out = run_py("experiment=quality", *REAL, f"model.path={copy}", "task.data.source=random", "task.data.samples=1",
                 "task.data.seq_len=32", f"hydra.run.dir={tmp_path / 'run'}")
    assert out.returncode != 0
    line = [x for x in out.stderr.splitlines() if "is not a valid safetensors file" in x]
    assert line and str(shard) in line[-1], out.stderr[-3000:]
    assert ("the file has" in line[-1]) if damage == "truncated" else ("header" in line[-1]), line[-1]


def test_unknown_shape_is_refused_by_name(tmp_path):
    out = run_py("experiment=write_checkpoint", "task.like=deepseek_v9", f"hydra.run.dir={tmp_path}")
    assert out.returncode != 0
    assert "task.like='deepseek_v9'" in out.stderr and "deepseek_v2_lite" in out.stderr, out.stderr[-2000:]
