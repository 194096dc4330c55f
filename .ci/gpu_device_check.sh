#!/usr/bin/env bash
# On a machine WITH an NVIDIA GPU and a CUDA torch (CI has none and does not run this):
#   1. builds moeext in place for this GPU's architecture and the portable CPU path only;
#   2. runs every test that runs on the GPU (pytest -k cuda: the `cuda`/`cuda:1` parameters
#      and tests/test_cuda_graphs.py), without the torch.compile ones, then those;
#   3. runs the GPU benchmark (benchmarks/python/bench_cuda.py);
#   4. runs .ci/gpu_sanitize.py (every kernel once, checked) under compute-sanitizer's
#      memcheck and racecheck.
# Logs go to $OUT (default ./build-gpu-check). Steps are time-boxed by the variables below,
# so that one call on a lent machine returns with what it got.
#
#   bash .ci/gpu_device_check.sh [build] [tests] [bench] [sanitize] | all
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/build-gpu-check}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# The device's own tests only: the emulated GPU kernels' ids (gpu-emulation-cuda) match -k cuda.
export MOEEXT_TEST_GPU_EMULATION=0
PY="${PYTHON:-python3}"
STEPS="${*:-all}"
want() { [[ " $STEPS " == *" $1 "* || " $STEPS " == *" all "* ]]; }

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm \
  --format=csv,noheader
"$PY" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, \
torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))"

if want build; then
  arch="$("$PY" -c "import torch; m, n = torch.cuda.get_device_capability(); \
print(f'{m}{n}' + ('a' if m >= 9 else ''))")"
  start=$(date +%s)
  # Only the portable CPU path: the GPU tests compare with moeext.reference, not the CPU ops.
  MOEEXT_CPU_ISAS="${MOEEXT_CPU_ISAS-}" \
  MOEEXT_CUDA_ARCHS="${MOEEXT_CUDA_ARCHS:-$arch}" MAX_JOBS="${MAX_JOBS:-$(nproc)}" \
    "$PY" setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || {
      tail -60 "$OUT/build.log"; echo "BUILD FAILED"; exit 1; }
  grep -E "warning|spill|lmem" "$OUT/build.log" | grep -v "^ninja" | head -20
  echo "build ($arch): $(( $(date +%s) - start )) s"
fi
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import moeext; print(moeext.build_info())" || exit 1

if want tests; then
  workers="${PYTEST_WORKERS:-8}"
  xdist=()
  "$PY" -c "import xdist" 2> /dev/null && xdist=(-n "$workers")
  per_test=()
  "$PY" -c "import pytest_timeout" 2> /dev/null && per_test=(--timeout 90)
  # -v: one line per test in the log, so a step cut short by its time box still says what ran.
  run_tests() {  # log name, time box (s), -k expression
    local start=$(date +%s)
    timeout "$2" "$PY" -m pytest tests -v -p no:cacheprovider -rfE "${xdist[@]}" \
      "${per_test[@]}" -k "$3" ${PYTEST_ARGS:-} > "$OUT/$1.log" 2>&1
    echo "== $1: exit $?, $(( $(date +%s) - start )) s"
    if grep -q "short test summary" "$OUT/$1.log"; then
      sed -n '/short test summary/,$p' "$OUT/$1.log" | cut -c1-300 | head -45
    else  # cut short: the per-test lines
      grep -cE " (PASSED|FAILED|SKIPPED|ERROR) " "$OUT/$1.log" | sed 's/^/tests reported: /'
      grep -E " (FAILED|ERROR) " "$OUT/$1.log" | head -40
    fi
    tail -1 "$OUT/$1.log"
  }
  run_tests pytest-gpu "${TESTS_TIMEOUT:-150}" "cuda and not compile and not export"
  run_tests pytest-gpu-compile "${COMPILE_TESTS_TIMEOUT:-120}" "cuda and (compile or export)"
fi

if want bench; then
  timeout "${BENCH_TIMEOUT:-150}" "$PY" benchmarks/python/bench_cuda.py --markdown \
    ${BENCH_ARGS:-} > "$OUT/bench-cuda.log" 2>&1
  echo "bench exit $?"
  grep -q "^| op" "$OUT/bench-cuda.log" && sed -n '/^| op/,$p' "$OUT/bench-cuda.log" \
    || tail -30 "$OUT/bench-cuda.log"
fi

if want sanitize; then
  if command -v compute-sanitizer > /dev/null; then
    for tool in memcheck racecheck; do
      timeout "${SANITIZE_TIMEOUT:-60}" compute-sanitizer --tool "$tool" --error-exitcode 1 \
        "$PY" .ci/gpu_sanitize.py > "$OUT/sanitize-$tool.log" 2>&1
      echo "== compute-sanitizer $tool: exit $?"
      grep -E "ERROR SUMMARY|MISMATCH|all ok|Error" "$OUT/sanitize-$tool.log" | tail -4
    done
  else
    echo "no compute-sanitizer on PATH"
  fi
fi
