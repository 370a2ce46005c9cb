"""The real-checkpoint path on a written folder: experiment=write_checkpoint writes a family-shaped Hugging Face folder
(config.json, safetensors shards, tokenizer), and `model=<real> model.path=<folder>` loads it through
from_pretrained and runs a stage end to end, its record holding seconds and peak memory; bad shapes are refused."""

import json
import subprocess
import sys

import pytest
from conftest import REPO


def run_py(*args, cwd=REPO, timeout=600):
    out = subprocess.run([sys.executable, "run.py", *args, "logger=none"], cwd=cwd, capture_output=True, text=True,
                         timeout=timeout)
    return out


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
    assert record["memory"]["peak_gb"] > 0 and record["memory"]["measured"] == "cpu_resident"
    assert record["seconds"] > 0


def test_unknown_shape_is_refused_by_name(tmp_path):
    out = run_py("experiment=write_checkpoint", "task.like=deepseek_v9", f"hydra.run.dir={tmp_path}")
    assert out.returncode != 0
    assert "task.like='deepseek_v9'" in out.stderr and "deepseek_v2_lite" in out.stderr, out.stderr[-2000:]
