#!/usr/bin/env bash
# The CPU instruction-set paths this machine cannot run, on a lent machine that can: the H100
# machine lent on 2026-11-26 had an Intel Xeon with AVX-512 and AVX512-BF16, while the CPU VMs
# that build and test moeext have often been AVX2-only, where every avx512 and avx512bf16
# parametrisation of the tests skips. On a machine with a torch (CUDA or CPU build):
#   1. prints the CPU and the AVX-512 features it has, and stops if it has none;
#   2. builds moeext in place for the CPU only, with every instruction set;
#   3. runs the CPU tests that PYTEST_K selects (default: the avx512 and avx512bf16
#      parametrisations), with pytest-xdist.
# Logs go to $OUT (default ./build-cpu-check). Steps are time-boxed by the variables below, so
# that one call on a lent machine returns with what it got. The in-place build replaces any
# other in python/moeext (a GPU build of .ci/gpu_device_check.sh, say): run this after that.
#
#   bash .ci/cpu_device_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/build-cpu-check}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"

lscpu | grep -E "Model name|^CPU\(s\)"
features="$(grep -o -w -E "avx512f|avx512bw|avx512vl|avx512dq|avx512_bf16" /proc/cpuinfo \
  | sort -u | tr '\n' ' ')"
echo "AVX-512 features: ${features:-none}"
[[ -n "$features" ]] || { echo "this CPU has no AVX-512: nothing to run here"; exit 0; }

start=$(date +%s)
# Every x86-64 path (MOEEXT_CPU_ISAS unset), no CUDA.
env -u MOEEXT_CPU_ISAS MOEEXT_FORCE_CUDA=0 MAX_JOBS="${MAX_JOBS:-$(nproc)}" \
  timeout "${BUILD_TIMEOUT:-300}" "$PY" setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || {
    tail -40 "$OUT/build.log"; echo "BUILD FAILED"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import moeext; print(moeext.build_info())" || exit 1

start=$(date +%s)
xdist=()
"$PY" -c "import xdist" 2> /dev/null && xdist=(-n "$(nproc)")
# Two threads a worker: with torch's default (every core) in each of nproc workers the tests
# oversubscribed the cores and ran a quarter of the avx512 ones in 45 s, against all in 18 s.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
timeout "${TESTS_TIMEOUT:-240}" "$PY" -m pytest tests -q "${xdist[@]}" -p no:cacheprovider \
  -k "${PYTEST_K:-avx512 and not cuda}" > "$OUT/pytest-cpu.log" 2>&1
status=$?
echo "pytest exit $status in $(( $(date +%s) - start )) s"
tail -3 "$OUT/pytest-cpu.log"
exit $status
