#!/usr/bin/env bash
# GPU check for a machine with one NVIDIA GPU (written for an H200, sm_90), a few minutes end to
# end: build the extension for the local GPU, run the whole test suite on the cuda backend, then
# the CUDA attention benchmark, the CUDA-core and tensor-core kernels side by side
# (bench.bench_attention_tc: chunked prefill TFLOPS and fraction of the dense bf16 peak, GQA-8
# decode GB/s and fraction of the copy bandwidth), the cost of sinks and of head 512
# (bench.bench_features), the MLA kernel's decode, MTP and prefill rows (bench.bench_attention_mla:
# TFLOPS and latent GB/s), the quantized caches' decode beside bf16's (bench.bench_attention_quant),
# cascade beside plain attention and the engine's tokens/s both ways (bench.bench_cascade --engine),
# the SASS model's estimate of each measured
# decode row (bench_gpu_model --join: the model's calibration) and, where ncu is installed and may
# read the counters, the instructions and DRAM bytes of one decode launch (docs/gpu_model.md).
# Every step is logged under LOGDIR and bounded by a timeout.
#
#   scripts/gpu_check.sh LOGDIR [STEP...]
#
# STEPs, in order: env build tests bench model sanitize ncu (default: all). The device tool runs
# one command for at most 10 minutes, so a first call can run `env build tests` and a second, on
# the warm machine (the in-place build is kept), `bench model sanitize ncu`; the steps after
# `build` use the modules built in place by an earlier call.
# sanitize: compute-sanitizer memcheck over the cache-op tests and a short attention selection
# (decode, GQA, split-K, varlen, fp8) plus the MLA kernel's (decode, MTP, prefill, split-K) and
# the quantized caches' write and read (int8, int4, fp8 per row; the tensor-core kernel's tile
# shapes over them), and racecheck (shared memory) over the attention, MLA and quantized
# tensor-core selections.
#
# Environment: PYTHON (default: python3; a Python with torch), ARCH (default 9.0),
# MAX_JOBS (default 16), BUILD_TIMEOUT / TEST_TIMEOUT / BENCH_TIMEOUT in seconds (defaults 420,
# 420, 240), MODEL_TIMEOUT (default 300), SANITIZE_TIMEOUT (default 240 per tool).
# Exit status: the number of failed steps (0: all passed).
set -euo pipefail

LOGDIR=${1:?usage: scripts/gpu_check.sh LOGDIR}
mkdir -p "$LOGDIR"
LOGDIR=$(cd "$LOGDIR" && pwd)
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export TORCH_CUDA_ARCH_LIST=${ARCH:-9.0}
export MAX_JOBS=${MAX_JOBS:-16}
export PAGEDKV_SIMT=${PAGEDKV_SIMT:-0}  # the emulator is not needed where a GPU is
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"

log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$LOGDIR/summary.log"; }

# step NAME TIMEOUT_S CMD...: runs CMD with its output in LOGDIR/NAME.log; records the status.
failed=0
step() {
  local name=$1 limit=$2
  shift 2
  log "start $name (timeout ${limit}s): $*"
  local start=$SECONDS rc=0
  timeout --kill-after=10 "$limit" "$@" >"$LOGDIR/$name.log" 2>&1 || rc=$?
  log "end   $name: rc=$rc in $((SECONDS - start))s (log: $name.log)"
  tail -n 5 "$LOGDIR/$name.log" | sed 's/^/    /' | tee -a "$LOGDIR/summary.log"
  [ "$rc" -eq 0 ] || failed=$((failed + 1))
  return "$rc"
}

STEPS=${*:2}
STEPS=${STEPS:-env build tests bench model sanitize ncu}
wants() { [[ " $STEPS " == *" $1 "* ]]; }

CUDA_TESTS=(env PAGEDKV_TEST_BACKENDS=cuda "$PYTHON" -m pytest -q -p no:cacheprovider)
ATTENTION_SELECTION=(tests/ops/test_paged_attention.py -k
  "block_sizes_and_gqa or long_context or varlen_long or fp8_caches or strided_cache")
MLA_SELECTION=(tests/ops/test_mla_attention.py -k "block_sizes or split_k or fp8")
# The per-(token, head) quantized caches (int8, int4, fp8): their write, their CUDA-core read and
# the tensor-core kernel's (its tile shapes; shared memory holds the rows' scales too).
QUANT_SELECTION=(tests/ops/test_quantized_kv.py -k "write or decode or split_keys or tensor_core_tiles")

if wants env; then
  step env 60 bash -c "nvidia-smi; nvcc --version; $PYTHON -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))'" || true
fi
if wants build; then
  step build "${BUILD_TIMEOUT:-420}" "$PYTHON" setup.py build_ext --inplace || {
    log "build failed: nothing else can run"
    exit 1
  }
fi
if wants tests; then
  step tests "${TEST_TIMEOUT:-420}" "${CUDA_TESTS[@]}" tests --junitxml="$LOGDIR/tests.xml" || true
fi
if wants bench; then
  rm -f bench/results/attention_cuda.json  # the model joins this run's rows only
  step bench "${BENCH_TIMEOUT:-240}" "$PYTHON" -m bench.bench_attention_cuda || true
  cp bench/results/attention_cuda.json "$LOGDIR/" 2>/dev/null || true
  step bench_tc "${BENCH_TIMEOUT:-240}" "$PYTHON" -m bench.bench_attention_tc || true
  cp bench/results/attention_tc.json "$LOGDIR/" 2>/dev/null || true
  step bench_features "${BENCH_TIMEOUT:-240}" "$PYTHON" -m bench.bench_features --device cuda || true
  cp bench/results/features.json "$LOGDIR/" 2>/dev/null || true
  step bench_mla "${BENCH_TIMEOUT:-240}" "$PYTHON" -m bench.bench_attention_mla --device cuda || true
  cp bench/results/attention_mla.json "$LOGDIR/" 2>/dev/null || true
  step bench_quant "${BENCH_TIMEOUT:-240}" "$PYTHON" -m bench.bench_attention_quant --device cuda \
    || true
  cp bench/results/attention_quant.json "$LOGDIR/" 2>/dev/null || true
  step bench_cascade "${BENCH_TIMEOUT:-240}" "$PYTHON" -m bench.bench_cascade --device cuda \
    --engine || true
  cp bench/results/cascade.json "$LOGDIR/" 2>/dev/null || true
fi
if wants model && [ -f bench/results/attention_cuda.json ]; then
  step model "${MODEL_TIMEOUT:-300}" "$PYTHON" -m bench.bench_gpu_model --devices a100-80gb,h100,h200 \
    --join bench/results/attention_cuda.json || true
  cp bench/results/bench_gpu_model.json "$LOGDIR/" 2>/dev/null || true
fi
if wants sanitize && command -v compute-sanitizer >/dev/null; then
  SANITIZER=(compute-sanitizer --error-exitcode 1 --target-processes all --print-limit 20)
  step memcheck "${SANITIZE_TIMEOUT:-240}" "${SANITIZER[@]}" --tool memcheck "${CUDA_TESTS[@]}" -x \
    tests/ops/test_reshape_and_cache.py tests/ops/test_copy_blocks.py \
    tests/ops/test_swap_blocks.py tests/ops/test_merge_attn_states.py || true
  step memcheck_attention "${SANITIZE_TIMEOUT:-240}" "${SANITIZER[@]}" --tool memcheck \
    "${CUDA_TESTS[@]}" -x "${ATTENTION_SELECTION[@]}" || true
  step racecheck "${SANITIZE_TIMEOUT:-240}" "${SANITIZER[@]}" --tool racecheck \
    --racecheck-report hazard "${CUDA_TESTS[@]}" -x "${ATTENTION_SELECTION[@]}" || true
  step memcheck_mla "${SANITIZE_TIMEOUT:-240}" "${SANITIZER[@]}" --tool memcheck \
    "${CUDA_TESTS[@]}" -x "${MLA_SELECTION[@]}" || true
  step racecheck_mla "${SANITIZE_TIMEOUT:-240}" "${SANITIZER[@]}" --tool racecheck \
    --racecheck-report hazard "${CUDA_TESTS[@]}" -x "${MLA_SELECTION[@]}" || true
  step memcheck_quant "${SANITIZE_TIMEOUT:-240}" "${SANITIZER[@]}" --tool memcheck \
    "${CUDA_TESTS[@]}" -x "${QUANT_SELECTION[@]}" || true
  step racecheck_quant "${SANITIZE_TIMEOUT:-240}" "${SANITIZER[@]}" --tool racecheck \
    --racecheck-report hazard "${CUDA_TESTS[@]}" -x tests/ops/test_quantized_kv.py \
    -k tensor_core_tiles || true
fi
if wants ncu && command -v ncu >/dev/null; then
  step ncu "${MODEL_TIMEOUT:-300}" ncu --kernel-name regex:paged_attention_kernel --launch-skip 2 \
    --launch-count 1 --csv --metrics smsp__inst_executed.sum,dram__bytes_read.sum,\
gpu__time_duration.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,\
sm__cycles_elapsed.avg.per_second "$PYTHON" -m bench.ncu_decode || true
fi
log "done: $failed step(s) failed; logs in $LOGDIR"
exit "$failed"
