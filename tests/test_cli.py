"""`python run.py ...` end to end, as a user runs it: the record, the W&B offline run, failures exit non-zero."""

import json
import os
import subprocess
import sys

import pytest

from conftest import CPU_DECODE, HAS_CXX, REPO
from conftest import run_cli as run_in_process  # run.py's entry point in this process (what no process shows)


def run_cli(*args, timeout=300):
    """`python run.py <args>` in a process of its own, as a user starts it (W&B as configured: WANDB_MODE unset)."""
    env = {k: v for k, v in os.environ.items() if k != "WANDB_MODE"}
    return subprocess.run([sys.executable, "run.py", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_equivalence_run_writes_record_and_wandb_offline(tmp_path):
    out = run_cli("experiment=equivalence", "task.only=[deepseek_v3,longcat_flash]", f"hydra.run.dir={tmp_path}")
    assert out.returncode == 0, out.stderr[-3000:]
    rec = json.loads((tmp_path / "record.json").read_text())
    assert rec["status"] == "ok"
    assert rec["metrics"]["equivalence/all_passed"] is True
    assert rec["metrics"]["equivalence/longcat_flash/max_abs_logit_diff"] <= 1e-4
    assert (tmp_path / "equivalence.md").exists()
    assert list((tmp_path / "wandb").glob("offline-run-*")), "no offline W&B run was written"


def test_failed_check_exits_non_zero_and_keeps_the_record(tmp_path):
    out = run_in_process("experiment=equivalence", "task.only=[deepseek_v2]", "task.tolerance=1e-12", "logger=none",
                         f"hydra.run.dir={tmp_path}")
    assert out.returncode != 0
    rec = json.loads((tmp_path / "record.json").read_text())
    assert rec["status"] == "failed" and "not equivalent" in rec["error"]


def test_unknown_experiment_lists_choices():
    out = run_in_process("experiment=nope", "logger=none")
    assert out.returncode != 0
    assert "equivalence" in out.stderr, out.stderr[-2000:]


def test_bench_decode_prints_ratios(tmp_path):
    out = run_in_process("experiment=bench_decode", "logger=none", "task.contexts=[64]", "task.decode_steps=2",
                         "task.repeats=2", "model.config.hidden_size=256", "model.config.num_attention_heads=4",
                         "model.config.num_key_value_heads=4", f"hydra.run.dir={tmp_path}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "absorbed latent decode" in out.stdout
    rec = json.loads((tmp_path / "record.json").read_text())
    # The latent cache holds exactly d_c + d_r values per token per layer (float32: 4 B each).
    assert rec["metrics"]["bench/decode/ctx64/absorbed_latent/cache_bytes_per_token_per_layer"] == 4 * 576
    assert rec["metrics"]["bench/decode/ctx64/speedup_absorbed_vs_transformers"] > 0
    # quant=bf16 (the default) read by the C++ kernel on the CPU: its own path beside the PyTorch one (none where no
    # compiler builds the kernel: bf16 then decodes as the PyTorch path does)
    if HAS_CXX:
        assert rec["metrics"]["bench/decode/ctx64/absorbed_bf16/backend/decode"] == "cpu"
        assert rec["metrics"]["bench/decode/ctx64/speed_bf16_vs_absorbed"] > 0
        assert "bf16 cache (cpu decode): decode speed" in out.stdout
    else:
        assert "bench/decode/ctx64/speed_bf16_vs_absorbed" not in rec["metrics"]


@pytest.mark.slow
def test_multirun_through_the_submitit_launcher(tmp_path):
    """--multirun with hydra/launcher=local runs each job through submitit (the SLURM launcher's local twin)."""
    out = run_cli("--multirun", "hydra/launcher=local", "hydra.launcher.timeout_min=10", "experiment=equivalence",
                  "task.only=[deepseek_v2],[minicpm3]", "task.decode_steps=2", "logger=none",
                  f"hydra.sweep.dir={tmp_path}")
    assert out.returncode == 0, out.stderr[-3000:]
    records = sorted(tmp_path.glob("*/record.json"))
    assert len(records) == 2, list(tmp_path.iterdir())
    passed = [json.loads(r.read_text())["metrics"]["equivalence/all_passed"] for r in records]
    assert passed == [True, True]


@pytest.mark.parametrize("experiment", ["bench_decode", "bench_calibration"])
@pytest.mark.parametrize("bad", [0, "true"])
def test_bench_repeats_are_refused_by_name(experiment, bad, tmp_path):
    from conftest import compose

    from mla_quant.stages import bench_calibration, bench_decode

    stage = {"bench_decode": bench_decode, "bench_calibration": bench_calibration}[experiment]
    with pytest.raises(ValueError, match=rf"task.repeats={'True' if bad == 'true' else bad}; allowed: a number"):
        stage.run(compose([f"experiment={experiment}", f"task.repeats={bad}", "logger=none"]), tmp_path)


def test_bench_decode_without_the_transformers_model(tmp_path):
    """task.transformers=false times the absorbed paths only (at 16K the untouched model's prefill does not fit a
    24 GB machine); the quantized cache runs the C++ CPU kernel and its ratio is still reported. A value that is
    not a boolean is refused by name."""
    import pandas as pd
    from conftest import compose

    from mla_quant.stages import bench_decode

    overrides = ["experiment=bench_decode", "logger=none", "task.contexts=[64]", "task.decode_steps=2",
                 "task.repeats=1", "quant=int4_joint", "quant.protected.recent=8", "model.config.hidden_size=256",
                 "model.config.num_attention_heads=4", "model.config.num_key_value_heads=4"]
    metrics = bench_decode.run(compose(overrides + ["task.transformers=false"]), tmp_path).metrics
    assert "bench/decode/ctx64/speedup_absorbed_vs_transformers" not in metrics
    assert metrics["bench/decode/ctx64/speed_int4_joint_vs_absorbed"] > 0
    assert metrics["bench/decode/ctx64/absorbed_int4_joint/backend/decode"] == CPU_DECODE
    table = pd.read_csv(tmp_path / "bench_decode.csv")
    assert list(table.path) == ["absorbed_latent", "absorbed_int4_joint"]
    with pytest.raises(ValueError, match=r"task.transformers='no'; allowed: true"):
        bench_decode.run(compose(overrides + ["task.transformers=no"]), tmp_path)
