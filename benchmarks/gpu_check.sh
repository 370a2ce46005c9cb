#!/usr/bin/env bash
# One GPU check of the decode kernel, from the repository root (nothing installed: PYTHONPATH=.):
#   OUT=outputs/gpu_check bash benchmarks/gpu_check.sh
# (a) the GPU and the versions; (b) experiment=bench_kernel (16 and 128 heads, 4K/32K/128K, throughput and latency);
# (c) the kernel tests on CUDA (TRITON_INTERPRET=0; tests marked `gpu` run only there); (d) a small
# experiment=bench_decode (tiny model with DeepSeek-V2-Lite's attention, bf16, the INT4 cache through the kernel).
# Each step has its own time limit (T_KERNEL, T_TESTS, T_DECODE seconds) and copies what it produced into $OUT
# as flat files: log.txt, bench_kernel.{csv,md,png}, kernel_tests.txt, bench_decode_<context>.csv, bench_prefill.md;
# (e) a 32K prefill at V2-Lite dims and (f) one layer's calibration, both with peak memory (T_PREFILL, T_CALIB).
# A CPU dry run of the same steps (the interpreter, tiny settings): DEVICE=cpu TRITON_INTERPRET=1
# BENCH_KERNEL_ARGS="..." DECODE_CONTEXTS=256 bash benchmarks/gpu_check.sh
set -o pipefail
OUT=${OUT:-outputs/gpu_check}
RUNS=${RUNS:-/tmp/mla_quant_gpu_runs}
T_KERNEL=${T_KERNEL:-200}
T_TESTS=${T_TESTS:-150}
T_DECODE=${T_DECODE:-50}
DEVICE=${DEVICE:-cuda}
DECODE_CONTEXTS=${DECODE_CONTEXTS:-4096 16384}
T_PREFILL=${T_PREFILL:-120}
T_CALIB=${T_CALIB:-120}
PREFILL_CONTEXTS=${PREFILL_CONTEXTS:-8192,32768}
mkdir -p "$OUT" "$RUNS"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=${TRITON_INTERPRET:-0} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"

step() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }

{
  step "environment"
  nvidia-smi
  python3 -c "import torch, triton, transformers, hydra, omegaconf; print('torch', torch.__version__, 'cuda',
torch.version.cuda, '| triton', triton.__version__, '| transformers', transformers.__version__, '| hydra',
hydra.__version__, '| omegaconf', omegaconf.__version__); print(torch.cuda.get_device_name(0),
torch.cuda.get_device_properties(0).multi_processor_count, 'SMs') if torch.cuda.is_available() else 0"

  step "smoke: one call per format on $DEVICE against the reference (stops here on failure)"
  timeout 120 python3 benchmarks/smoke.py || exit 1

  step "bench_kernel"
  timeout "$T_KERNEL" python3 run.py experiment=bench_kernel logger=none device=$DEVICE \
    hydra.run.dir="$RUNS/bench_kernel" ${BENCH_KERNEL_ARGS:-}
  echo "bench_kernel rc=$?"
  for f in csv md png; do cp "$RUNS/bench_kernel/bench_kernel.$f" "$OUT/" 2>/dev/null; done

  step "kernel tests on $DEVICE: the gpu-marked ones first, then the rest (each compiles its own kernels)"
  timeout 90 python3 -m pytest -q -rfEs -p no:cacheprovider -m gpu tests/test_kernel.py tests/test_kernel_launch.py \
    tests/test_attention_blocks.py \
    2>&1 | tee "$OUT/kernel_tests.txt"
  echo "gpu-marked kernel tests rc=$?"
  timeout "$T_TESTS" python3 -m pytest -q -rfEs -p no:cacheprovider --durations=5 -m "not gpu" tests/test_kernel.py \
    tests/test_kernel_launch.py 2>&1 | tee -a "$OUT/kernel_tests.txt"
  echo "kernel tests rc=$?"

  for ctx in $DECODE_CONTEXTS; do
    step "bench_decode context $ctx"
    timeout "$T_DECODE" python3 run.py experiment=bench_decode logger=none device=$DEVICE model.dtype=bfloat16 \
      quant=int4_joint quant.backend=triton "task.contexts=[$ctx]" task.decode_steps=16 task.warmup_steps=3 \
      hydra.run.dir="$RUNS/bench_decode_$ctx"
    echo "bench_decode $ctx rc=$?"
    cp "$RUNS/bench_decode_$ctx/bench_decode.csv" "$OUT/bench_decode_$ctx.csv" 2>/dev/null
  done
  step "prefill at V2-Lite dims, bf16: blocked (latent, expanded) vs unblocked attention, up to RULER 32K, peak memory"
  timeout "$T_PREFILL" python3 run.py experiment=bench_prefill logger=none device=$DEVICE task.dtype=bfloat16 \
    "task.only=[v2_lite]" "task.contexts.v2_lite=[$PREFILL_CONTEXTS]" task.reference_budget_gb=40 \
    hydra.run.dir="$RUNS/bench_prefill" ${BENCH_PREFILL_ARGS:-}
  echo "bench_prefill rc=$?"
  cp "$RUNS/bench_prefill/bench_prefill.md" "$OUT/" 2>/dev/null

  step "one layer's calibration at V2-Lite dims (a written V2-Lite-shaped checkpoint), with peak memory"
  timeout "$T_CALIB" python3 run.py experiment=write_checkpoint logger=none task.like=deepseek_v2_lite task.layers=1 \
    task.out="$RUNS/v2l_1layer" hydra.run.dir="$RUNS/write_checkpoint" && \
  timeout "$T_CALIB" python3 run.py experiment=calibrate logger=none device=$DEVICE model=deepseek_v2_lite \
    model.path="$RUNS/v2l_1layer" model.dtype=bfloat16 transform=quantmla quant=int4_joint calib.source=random \
    calib.samples=${CALIB_SAMPLES:-16} calib.seq_len=${CALIB_SEQ_LEN:-2048} calib.query_tokens=256 \
    transform.fit.cache_dir="$RUNS/calibration" hydra.run.dir="$RUNS/calibrate" ${CALIB_ARGS:-}
  echo "calibrate rc=$?"
  python3 -c "import json; r = json.load(open('$RUNS/calibrate/record.json')); print('calibrate', r['status'], \
round(r['seconds'], 1), 's', r.get('memory'))" 2>/dev/null

  step "done"
} 2>&1 | tee "$OUT/log.txt"
