#!/usr/bin/env bash
# One call on a lent GPU machine (an H200 has about 15 minutes a task), at most about 10 minutes:
#   1. .gpu-peers/device_run.sh: moeext built in place for this GPU, the engines' kernels
#      built from .peer/, their comparison (bench_peers.py, --quick unless BENCH_ARGS says
#      otherwise), moeext's GPU tests;
#   2. benchmarks/python/bench_fused_router_peers.py: fused_router against every peer
#      router GEMM + routing pair, with issue #53's verdicts;
#   3. benchmarks/python/bench_cuda.py --quick: the routing warp kernel's, the router GEMM's
#      and the fused router's completion count's variants against the current kernels (bit
#      for bit first, a box of their own, the last two in both launch modes), then the
#      routing options' overhead, the fused router's out= form and routing, moeext with PDL
#      off and on (rows print as timed);
#   3b. benchmarks/cuda/warp_ops.cu, built for this GPU: the latency and throughput of the warp
#      operations the routing kernel's argmax rounds are made of, and of a round itself;
#   4. the decode ops' GPU tests again with programmatic dependent launch on
#      (MOEEXT_ENABLE_PDL=1; device_run.sh ran them with it off);
#   5. the AOTInductor package test's child (tests/test_compile.py) run alone under gdb, for
#      the native stack of the SIGSEGV its loader died with on an H200 (python -X faulthandler
#      where gdb is missing or may not trace);
#   6. Nsight Compute on the decode kernels (benchmarks/python/profile_cuda.py): instructions
#      per warp, issue-slot use, stall reasons, occupancy; the report (.ncu-rep) and its raw
#      page (CSV) go to $OUT, where ncu can read the hardware counters (not on gVisor).
# It copies nothing: .gpu-peers/ (a copy of ../shared/gpu-peers) and .peer/ (the engines'
# files, PEERS.md) must be in the checkout root, carried to the machine. Every step is
# time-boxed so the call returns with what it got; logs and tables go to $OUT.
#
#   DEVICE_RUN_S=265 FUSED_S=65 VARIANT_S=60 CUDA_BENCH_S=30 WARP_OPS_S=25 PDL_S=55 AOTI_S=45
#   PROFILE_S=40         the boxes, seconds (585 in all, and 12 s to read the profile back)
#   SKIP_DEVICE_RUN=1   steps 2-5 only, on a machine still warm from a first call (the
#                       in-place build and build-peers/ stay there between calls)
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
OUT="${OUT:-$root/gpu-session-out}"
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1
# The device's own tests only: the emulated GPU kernels' ids (gpu-emulation-cuda) match -k cuda.
export MOEEXT_TEST_GPU_EMULATION=0
PY="${PYTHON:-python3}"
t0=$(date +%s)
el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }

if [ ! -f .gpu-peers/device_run.sh ]; then
  echo "no .gpu-peers/ in $root: copy ../shared/gpu-peers there and carry it (docs/DEVELOPING.md)"
  exit 2
fi
[ -d .peer ] || echo "no .peer/ in $root: no peer will build (see .gpu-peers/PEERS.md)"

if [ "${SKIP_DEVICE_RUN:-0}" = 0 ]; then
  # The baseline's full peer table exists (shared/gpu-peers/results); this run's pairs are
  # timed in step 2, so the harness's own comparison runs its quick cases to leave time.
  BENCH_ARGS="${BENCH_ARGS---quick}" BENCH_S="${BENCH_S:-120}" TESTS_S="${TESTS_S:-110}" \
  COMPILE_S="${COMPILE_S:-50}" timeout -k 10 "${DEVICE_RUN_S:-265}" \
    bash .gpu-peers/device_run.sh > "$OUT/device-run.log" 2>&1
  el "device_run.sh: exit $? (log device-run.log)"
  grep -E "^\[[0-9]+ s\]|^== |^build \(|BUILD FAILED|FAILED|ERROR|passed|failed" \
    "$OUT/device-run.log" | cut -c1-200 | head -40
fi
export PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}"

timeout -k 10 "${FUSED_S:-65}" "$PY" benchmarks/python/bench_fused_router_peers.py \
  --peers .gpu-peers --moeext python --out "$OUT" > "$OUT/fused-router-peers.log" 2>&1
el "bench_fused_router_peers.py: exit $? (fused_router_peers.md, .json)"
if [ -f "$OUT/fused_router_peers.md" ]; then
  sed -n '/^## Verdicts/,/^## Every pair/p' "$OUT/fused_router_peers.md" | head -30
else
  tail -25 "$OUT/fused-router-peers.log"
fi

# The kernels' variants against the current ones first, in a box of their own: which ones
# land is decided by these rows.
timeout -k 10 "${VARIANT_S:-60}" "$PY" benchmarks/python/bench_cuda.py --quick --no-engines \
  --only routing_variant,router_gemm_variant,fused_router_variant \
  > "$OUT/routing-variants.log" 2>&1
el "bench_cuda.py --only *_variant: exit $? (routing-variants.log)"
if grep -qE "^(routing|router_gemm|fused_router) .*variant" "$OUT/routing-variants.log"; then
  grep -E "^(routing|router_gemm|fused_router) .*variant" "$OUT/routing-variants.log" \
    | cut -c1-170 | head -88
else
  tail -10 "$OUT/routing-variants.log"
fi

timeout -k 10 "${CUDA_BENCH_S:-30}" "$PY" benchmarks/python/bench_cuda.py --quick --markdown \
  --only routing_options,fused_router,grouped_topk \
  > "$OUT/bench-cuda-quick.log" 2>&1
el "bench_cuda.py --quick: exit $? (bench-cuda-quick.log)"
grep -q "^| op" "$OUT/bench-cuda-quick.log" && sed -n '/^| op/,$p' "$OUT/bench-cuda-quick.log" \
  | cut -c1-160 | head -30 || tail -15 "$OUT/bench-cuda-quick.log"

# The warp operations' own costs, in the multiprocessor's cycles (nvcc for this GPU's
# architecture, as torch reports it; nvcc's own detection where torch cannot say).
if command -v nvcc > /dev/null; then
  arch="$("$PY" -c 'import torch; print("sm_%d%d" % torch.cuda.get_device_capability())' \
    2>/dev/null || echo native)"
  timeout -k 5 "${WARP_OPS_S:-25}" bash -c "nvcc -O3 -std=c++17 -arch=$arch -Icsrc/include \
    -Icsrc benchmarks/cuda/warp_ops.cu -o '$OUT/warp_ops' && '$OUT/warp_ops'" \
    > "$OUT/warp-ops.md" 2>&1
  el "warp_ops: exit $? (warp-ops.md)"
  cut -c1-120 "$OUT/warp-ops.md" | head -20
  rm -f "$OUT/warp_ops"
else
  el "no nvcc: warp_ops not built"
fi

# PDL on: the same bits, eagerly, in graphs captured with it and under torch.compile
# (test_programmatic_launch.py says whether it took effect on this device).
MOEEXT_ENABLE_PDL=1 timeout -k 10 "${PDL_S:-55}" "$PY" -m pytest -q -p no:cacheprovider -x \
  tests/test_programmatic_launch.py tests/test_fused_router.py tests/test_grouped_topk.py \
  tests/test_router_gemm.py tests/test_routing_options.py tests/test_cuda_graphs.py \
  -k "(cuda or programmatic) and not variant" \
  > "$OUT/pdl-tests.log" 2>&1
el "GPU tests with MOEEXT_ENABLE_PDL=1: exit $? (pdl-tests.log)"
tail -5 "$OUT/pdl-tests.log" | cut -c1-200

# The test's child process, standalone: the same function on the same device, with a compile
# cache of its own so that no graph from another build is served to it. gdb prints the native
# stack where the signal stops it; `continue` then hands the signal to faulthandler, which
# prints the Python one.
aoti="$(mktemp -d)"
export TORCHINDUCTOR_CACHE_DIR="$aoti/inductor-cache"
child="import sys; sys.path[:0] = ['$root/python', '$root/tests']; import test_compile; \
test_compile._aot_inductor_package_check('cuda', '$aoti/step.pt2'); print('AOTI child: ok')"
traced=0
if command -v gdb > /dev/null; then
  timeout -k 10 "${AOTI_S:-45}" gdb -q -batch -ex "set pagination off" \
    -ex "handle SIGPIPE nostop noprint pass" -ex run -ex bt -ex continue \
    --args "$("$PY" -c 'import sys; print(sys.executable)')" -X faulthandler -c "$child" \
    > "$OUT/aoti-gdb.log" 2>&1
  el "AOTInductor child under gdb: exit $? (aoti-gdb.log)"
  # gdb starts nothing where the container denies ptrace (or it was handed a wrapper script,
  # as a pyenv shim is, hence sys.executable above).
  grep -qE "ptrace|Operation not permitted|During startup program exited|No executable file" \
    "$OUT/aoti-gdb.log" || traced=1
  grep -E "AOTI child: ok|received signal|^#[0-9]+ |exited (normally|with code)|rror|^  File " \
    "$OUT/aoti-gdb.log" | cut -c1-220 | head -50
fi
if [ "$traced" = 0 ]; then
  timeout -k 10 "${AOTI_S:-45}" "$PY" -X faulthandler -c "$child" \
    > "$OUT/aoti-faulthandler.log" 2>&1
  el "AOTInductor child with faulthandler: exit $? (aoti-faulthandler.log)"
  tail -40 "$OUT/aoti-faulthandler.log" | cut -c1-220
fi
rm -rf "$aoti"

# Nsight Compute: ncu on the PATH, or where the image installs it. The calls inside the
# script's NVTX ranges only; the clocks are left alone (--clock-control none).
NCU="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)"
if [ -n "$NCU" ]; then
  timeout -k 10 "${PROFILE_S:-40}" "$NCU" --clock-control none --nvtx \
    --nvtx-include moeext-profile/ --section SpeedOfLight --section LaunchStats \
    --section Occupancy --section SchedulerStats --section WarpStateStats \
    --section InstructionStats --export "$OUT/decode-kernels" --force-overwrite \
    "$PY" benchmarks/python/profile_cuda.py > "$OUT/ncu.log" 2>&1
  el "ncu on the decode kernels: exit $? (ncu.log, decode-kernels.ncu-rep)"
  if [ -f "$OUT/decode-kernels.ncu-rep" ]; then
    timeout 6 "$NCU" --import "$OUT/decode-kernels.ncu-rep" --page raw --csv > "$OUT/ncu-raw.csv" 2>&1
    timeout 6 "$NCU" --import "$OUT/decode-kernels.ncu-rep" --page details > "$OUT/ncu-details.txt" 2>&1
    grep -E "^  [a-z_].*\(|Duration|Executed Instructions  |Issue Slots Busy|Warp Cycles Per Issued|Achieved Occupancy|Registers Per Thread|Block Size|Grid Size" \
      "$OUT/ncu-details.txt" | cut -c1-160 | head -60
  else
    grep -E "^profiled|==ERROR==|==WARNING==|rror" "$OUT/ncu.log" | cut -c1-200 | head -20
  fi
else
  el "no ncu on this machine: no kernel profile"
fi
el "done; in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
