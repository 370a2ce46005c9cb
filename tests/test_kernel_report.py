"""experiment=kernel_report: the Triton kernels compiled ahead of time for Ampere and Hopper on this CPU-only machine
(Triton's own ptxas; nothing launches). It runs in a subprocess because the test session imports the kernels under
the interpreter (conftest.py sets TRITON_INTERPRET=1), which compiles nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[1]


def test_kernels_compile_for_ampere_and_hopper(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(WANDB_MODE="disabled", HF_HUB_OFFLINE="1")
    # a format of each kind the stage-1 kernel reads: int codes with zeros and bits per group of RoPE pairs; an
    # engine's floating-point byte codes (e2m1 with e4m3 scales, an unscaled e4m3 RoPE key)
    runs = {"int2_content_int4_rope": ["+task.quant_overrides.rope.bits=[8,4,4,16]"], "nvfp4_ds_mla": []}
    frames = []
    for option, extra in runs.items():
        run_dir = tmp_path / option
        cmd = [sys.executable, "run.py", "experiment=kernel_report", "logger=none", "task.archs=[80,90]",
               f"task.formats=[{option}]", "task.dtypes=[bfloat16]", "task.launches=[]", "task.heads=[16,128]",
               *extra, f"hydra.run.dir={run_dir}"]
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        metrics = json.loads((run_dir / "record.json").read_text())["metrics"]
        assert metrics["kernel_report/failed"] == 0
        frames.append(pd.read_csv(run_dir / "kernel_report.csv"))
    df = pd.concat(frames)
    for arch in ("sm_80", "sm_90"):
        kernels = set(df[(df.arch == arch) & (df.format == "int2_content_int4_rope")].kernel)
        assert kernels == {"decode_stage1", "decode_merge", "quant_store"}, (arch, kernels)
    stage1 = df[df.kernel == "decode_stage1"]
    assert sorted(stage1.format) == ["int2_content_int4_rope"] * 2 + ["nvfp4_ds_mla"] * 2
    assert list(stage1.heads) == ["16,128"] * 4  # 16 and 128 heads: the same tiles at d_c 512, one kernel
    assert (df.regs <= 255).all() and (df.regs > 0).all()
    assert df.shared_ok.all() and (df.blocks_per_sm >= 1).all()
    assert (df[df.kernel != "decode_stage1"].stack_B == 0).all()  # the merge and the store keep to registers
    assert (stage1.mma_ops > 0).all()  # bfloat16 activations: the products a GPU launch runs on tensor cores


def test_a_format_the_kernel_does_not_read_is_refused_by_name():
    """kivi_int2 (its content per channel over blocks of tokens) has no kernel specialization to compile: refused
    before anything compiles, naming the option and why."""
    import pytest
    from conftest import compose

    from mla_quant.stages import kernel_report

    kernel_report.check(compose(["experiment=kernel_report"]))  # the default list: every option the kernel reads
    with pytest.raises(ValueError, match=r"task.formats: kivi_int2 \(quant.content.format=channel_block\) is not "
                                         r"read by the Triton decode kernel"):
        kernel_report.check(compose(["experiment=kernel_report", "task.formats=[int4_joint,kivi_int2]"]))
