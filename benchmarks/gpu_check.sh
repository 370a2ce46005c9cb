#!/usr/bin/env bash
# One GPU check of the decode kernel, from the repository root (nothing installed: PYTHONPATH=.):
#   OUT=outputs/gpu_check bash benchmarks/gpu_check.sh
# (a) the GPU and the versions; (b) experiment=bench_kernel (16 and 128 heads, 4K/32K/128K, throughput and latency);
# (c) the kernel tests on CUDA (TRITON_INTERPRET=0; tests marked `gpu` run only there); (d) a small
# experiment=bench_decode (tiny model with DeepSeek-V2-Lite's attention, bf16, the INT4 cache through the kernel).
# Each step has its own time limit (T_KERNEL, T_TESTS, T_DECODE seconds) and copies what it produced into $OUT
# as flat files: log.txt, bench_kernel.{csv,md,png}, kernel_tests.txt, bench_decode_<context>.csv.
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
  timeout 60 python3 -m pytest -q -rfEs -p no:cacheprovider -m gpu tests/test_kernel.py tests/test_kernel_launch.py \
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
  step "done"
} 2>&1 | tee "$OUT/log.txt"
