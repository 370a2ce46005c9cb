#!/usr/bin/env bash
# One GPU check of the kernels, prefill and calibration, from the repository root (nothing installed: PYTHONPATH=.):
#   OUT=outputs/gpu_check bash benchmarks/gpu_check.sh
# Steps, most wanted first; each has its own time limit and the whole check a deadline (DEADLINE seconds: a step
# that would not end before it is skipped and says so), and a failed step does not stop the next:
#  (a) the GPU and the versions;
#  (b) smoke: one decode call per format on the GPU against the PyTorch reference (benchmarks/smoke.py);
#  (c) kernel facts: the copy bandwidth, host reads per decode call, a decode call captured in a CUDA graph (replayed,
#      equal, timed against eager), every loaded kernel's registers, spills and shared memory, and the same calls
#      compiled ahead of time for sm_90 beside them (benchmarks/kernel_facts.py);
#  (d) the `gpu`-marked tests, then the kernel test files on the GPU (every specialization they launch compiled);
#  (e) experiment=bench_kernel (16 and 128 heads, 4K/32K/128K, throughput and latency, every format);
#  (f) experiment=bench_decode through quant.backend=auto (a tiny model with DeepSeek-V2-Lite's attention, bf16);
#  (g) where a padded 8K prefill's time goes (benchmarks/prefill_profile.py);
#  (h) one layer's calibration at V2-Lite dims and (i) the 8K/32K prefill at V2-Lite dims, both with peak memory;
#  (j) where vLLM's CUDA build is installed: experiment=serve on the GPU (the exported toy in the GPU backend).
# Python packages the GPU machine lacks (hydra-core, omegaconf, a transformers the project supports) go along as
# wheels installed with --target into a folder on PYTHONPATH.
# What comes back in $OUT: log.txt (everything printed), bench_kernel.md, bench_decode.csv, bench_prefill.md,
# kernel_facts.csv, kernel_facts_decode.csv, kernel_facts_aot.csv, serve.md and runs.tar.gz (each run's folder: records,
# tables, figures).
# A CPU dry run of the same steps (the interpreter, tiny settings): DEVICE=cpu TRITON_INTERPRET=1
# BENCH_KERNEL_ARGS="..." DECODE_CONTEXTS=256 bash benchmarks/gpu_check.sh
set -o pipefail
OUT=${OUT:-outputs/gpu_check}
RUNS=${RUNS:-/tmp/mla_quant_gpu_runs}
DEADLINE=${DEADLINE:-460}
T_SMOKE=${T_SMOKE:-90}
T_FACTS=${T_FACTS:-60}
T_KERNEL=${T_KERNEL:-170}
T_GPU_TESTS=${T_GPU_TESTS:-60}
T_DECODE=${T_DECODE:-45}
T_PREFILL=${T_PREFILL:-80}
T_CALIB=${T_CALIB:-90}
T_PROFILE=${T_PROFILE:-45}
T_TESTS=${T_TESTS:-120}
T_SERVE=${T_SERVE:-150}
DEVICE=${DEVICE:-cuda}
DECODE_CONTEXTS=${DECODE_CONTEXTS:-4096 32768}
PREFILL_CONTEXTS=${PREFILL_CONTEXTS:-8192,32768}
TEST_WORKERS=${TEST_WORKERS:-8}
mkdir -p "$OUT" "$RUNS"
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=${TQDM_MININTERVAL:-30} TRITON_INTERPRET=${TRITON_INTERPRET:-0} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"

step() { echo; echo "=== $* ($(date -u +%H:%M:%S), ${SECONDS}s)"; }
# fits LIMIT: true when a step of LIMIT seconds ends before the deadline (the step's limit is cut to what is left)
fits() {
  local left=$((DEADLINE - SECONDS))
  if [ "$left" -lt 20 ]; then echo "skipped: ${left}s left before the deadline"; return 1; fi
  LIMIT=$(( $1 < left ? $1 : left ))
}

{
  step "environment"
  nvidia-smi
  python3 -c "import torch, triton, transformers, hydra, omegaconf; print('torch', torch.__version__, 'cuda',
torch.version.cuda, '| triton', triton.__version__, '| transformers', transformers.__version__, '| hydra',
hydra.__version__, '| omegaconf', omegaconf.__version__); print(torch.cuda.get_device_name(0),
torch.cuda.get_device_properties(0).multi_processor_count, 'SMs') if torch.cuda.is_available() else 0"

  step "smoke: one call per format on $DEVICE against the reference"
  fits "$T_SMOKE" && { timeout "$LIMIT" python3 benchmarks/smoke.py; echo "smoke rc=$?"; }

  step "kernel facts: bandwidth, host reads, a decode call in a CUDA graph, loaded kernels' registers and spills"
  fits "$T_FACTS" && { timeout "$LIMIT" python3 benchmarks/kernel_facts.py "$RUNS/kernel_facts"; echo "facts rc=$?"; }
  cp "$RUNS"/kernel_facts/*.csv "$OUT/" 2>/dev/null

  step "the gpu-marked tests"
  fits "$T_GPU_TESTS" && { timeout "$LIMIT" python3 -m pytest -q -rfEs -p no:cacheprovider -m gpu \
    tests/test_kernel_launch.py tests/test_attention_blocks.py; echo "gpu-marked tests rc=$?"; }

  step "kernel test files on $DEVICE (each compiles its own kernels; $TEST_WORKERS workers)"
  fits "$T_TESTS" && { timeout "$LIMIT" python3 -m pytest -q -rfEs -p no:cacheprovider -n "$TEST_WORKERS" \
    --durations=5 tests/test_kernel.py tests/test_kernel_launch.py tests/test_kernel_store.py \
    tests/test_kernel_read_view.py; echo "kernel tests rc=$?"; }

  step "bench_kernel"
  fits "$T_KERNEL" && { timeout "$LIMIT" python3 run.py experiment=bench_kernel logger=none device=$DEVICE \
    hydra.run.dir="$RUNS/bench_kernel" ${BENCH_KERNEL_ARGS:-}; echo "bench_kernel rc=$?"; }
  cp "$RUNS/bench_kernel/bench_kernel.md" "$OUT/" 2>/dev/null

  for ctx in $DECODE_CONTEXTS; do
    step "bench_decode context $ctx, quant.backend=auto"
    fits "$T_DECODE" && { timeout "$LIMIT" python3 run.py experiment=bench_decode logger=none device=$DEVICE \
      model.dtype=bfloat16 quant=int4_joint quant.backend=auto "task.contexts=[$ctx]" task.decode_steps=16 \
      task.warmup_steps=3 hydra.run.dir="$RUNS/bench_decode_$ctx"; echo "bench_decode $ctx rc=$?"; }
    [ -f "$RUNS/bench_decode_$ctx/bench_decode.csv" ] && { [ -f "$OUT/bench_decode.csv" ] \
      && tail -n +2 "$RUNS/bench_decode_$ctx/bench_decode.csv" >> "$OUT/bench_decode.csv" \
      || cp "$RUNS/bench_decode_$ctx/bench_decode.csv" "$OUT/bench_decode.csv"; }
  done

  step "where the padded 8K prefill's time goes (each form warm, then the expanded form profiled)"
  fits "$T_PROFILE" && { timeout "$LIMIT" python3 benchmarks/prefill_profile.py; echo "prefill profile rc=$?"; }

  step "one layer's calibration at V2-Lite dims (a written V2-Lite-shaped checkpoint), with peak memory"
  fits "$T_CALIB" && { timeout "$LIMIT" python3 run.py experiment=write_checkpoint logger=none \
    task.like=deepseek_v2_lite task.layers=1 task.out="$RUNS/v2l_1layer" hydra.run.dir="$RUNS/write_checkpoint" \
    ${WRITE_ARGS:-}; echo "write_checkpoint rc=$?"; }
  fits "$T_CALIB" && { timeout "$LIMIT" python3 run.py experiment=calibrate logger=none device=$DEVICE \
    model=deepseek_v2_lite model.path="$RUNS/v2l_1layer" model.dtype=bfloat16 transform=quantmla quant=int4_joint \
    calib.source=random calib.samples=${CALIB_SAMPLES:-16} calib.seq_len=${CALIB_SEQ_LEN:-2048} \
    calib.query_tokens=256 transform.fit.cache_dir="$RUNS/calibration" hydra.run.dir="$RUNS/calibrate" \
    ${CALIB_ARGS:-}; echo "calibrate rc=$?"; }
  python3 -c "import json; r = json.load(open('$RUNS/calibrate/record.json')); print('calibrate', r['status'], \
round(r['seconds'], 1), 's', r.get('memory'))" 2>/dev/null

  step "prefill at V2-Lite dims, bf16: blocked (latent, expanded) vs unblocked attention, up to RULER 32K, peak memory"
  fits "$T_PREFILL" && { timeout "$LIMIT" python3 run.py experiment=bench_prefill logger=none device=$DEVICE \
    task.dtype=bfloat16 "task.only=[v2_lite]" "task.contexts.v2_lite=[$PREFILL_CONTEXTS]" task.reference_budget_gb=40 task.repeats=2 \
    hydra.run.dir="$RUNS/bench_prefill" ${BENCH_PREFILL_ARGS:-}; echo "bench_prefill rc=$?"; }
  cp "$RUNS/bench_prefill/bench_prefill.md" "$OUT/" 2>/dev/null

  step "the exported toy served by vLLM on the GPU (LatentTritonMLABackend), int4_joint against vLLM's own cache, bf16"
  if python3 -c "import torch, vllm; assert torch.cuda.is_available()" 2>/dev/null; then
    fits "$T_SERVE" && { timeout "$LIMIT" python3 run.py experiment=serve logger=none quant=int4_joint \
      task.dtype=bfloat16 task.require_equal=false hydra.run.dir="$RUNS/serve" ${SERVE_ARGS:-}; echo "serve rc=$?"; }
    cp "$RUNS/serve/serve.md" "$OUT/" 2>/dev/null
  else
    echo "skipped: vLLM's CUDA build is not installed here"
  fi

  step "done"
} 2>&1 | tee "$OUT/log.txt"
tar czf "$OUT/runs.tar.gz" -C "$RUNS" --exclude='*.safetensors' --exclude='*.bin' --exclude='*.pt' . 2>/dev/null
ls -la "$OUT"
