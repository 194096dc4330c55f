#!/usr/bin/env bash
# A lent GPU machine (an H200: 15 minutes of device time a task, start-up and idle time
# counted, at most 10 minutes a call) in two calls, each step time-boxed so that a call
# returns with what it got. STEPS names the steps a part runs (its default in brackets):
#   PART=1 (default), about 8 minutes:
#     .gpu-peers/device_run.sh without its tests, always: moeext built in place for this GPU
#       (175 s on an H200's 16 cores), the engines' kernels built from .peer/ beside it, their
#       comparison (bench_peers.py, --quick unless BENCH_ARGS says otherwise);
#     [variants] benchmarks/python/bench_cuda.py --quick: the kernels' variants against the
#       current kernels, bit for bit first (VARIANT_SUITES: routing_variant and routing_anatomy
#       unless it names others, e.g. router_gemm_variant,fused_router_variant);
#     [tests] moeext's GPU tests but the compile and export ones, 14 workers (about 150 s);
#     peerspdl: the engines' comparison (bench_peers.py, the peers built above) again with
#       moeext under PDL (MOEEXT_ENABLE_PDL=1), mode for mode against the engines' PDL launches;
#     fused: benchmarks/python/bench_fused_router_peers.py, fused_router (the two kernels and
#       the one launch, fused router variant 3) against every peer router GEMM + routing pair,
#       with issue #53's verdicts;
#     bench: bench_cuda.py --quick, the routing options' overhead, the fused router's two
#       forms, routing, moeext with PDL off and on.
#   PART=2, on the machine still warm from part 1 (its build stays there; a fresh machine
#   builds again, 3 minutes of the call), about 5 minutes:
#     [pdl] the GPU tests with programmatic dependent launch on (MOEEXT_ENABLE_PDL=1):
#       test_programmatic_launch.py, or the PDL_FILES named;
#     [compile] the compile and export GPU tests;
#     warpops: benchmarks/cuda/warp_ops.cu, built for this GPU: the latency and throughput of
#       the warp operations the routing kernel's argmax rounds are made of, and of a round;
#     [aoti] the AOTInductor package test's child (tests/test_compile.py) alone under gdb, for
#       the native stack of the SIGSEGV its loader died with on an H200 in 2026-11-28 (where
#       gdb is missing or may not trace, python -X faulthandler with .ci/segv_backtrace.c
#       preloaded);
#     [ncu] Nsight Compute on the decode kernels (benchmarks/python/profile_cuda.py, the
#       PROFILE_CASES named or all): instructions per warp, issue-slot use, stall reasons,
#       occupancy.
# $OUT brings back at most 8 files, so every log and table is packed into one archive,
# session-part<N>.tgz (the Nsight Compute report itself is too large to come back; its pages
# are in the archive), and the tables that decide things are printed as well.
# It copies nothing: .gpu-peers/ (a copy of ../shared/gpu-peers) and .peer/ (the engines'
# files, PEERS.md) must be in the checkout root and carried to the machine, on every call.
#
#   DEVICE_RUN_S=230 VARIANT_S=90 TESTS_S=160 PEERS_PDL_S=60 FUSED_S=60 CUDA_BENCH_S=30  part 1
#   PDL_S=45 COMPILE_S=120 WARP_OPS_S=25 AOTI_S=90 PROFILE_S=40                       part 2
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
PART="${PART:-1}"
export PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}"

# pytest on the GPU tests of -k "$3", 14 workers, into $OUT/$1.log; its summary printed.
gpu_tests() {  # log name, time box (s), -k expression, [test files...]
  local name=$1 box=$2 expr=$3
  shift 3
  timeout -k 10 "$box" "$PY" -m pytest "${@:-tests}" -q -p no:cacheprovider -rfE -n 14 \
    -k "$expr" > "$OUT/$name.log" 2>&1
  el "pytest $name: exit $? ($name.log)"
  grep -E "^(FAILED|ERROR)" "$OUT/$name.log" | cut -c1-200 | head -20
  tail -1 "$OUT/$name.log" | cut -c1-200
}

# The build, and in part 2 on a fresh machine the build again (device_run.sh's first step).
if [ "$PART" = 1 ] || ! "$PY" -c "import moeext, sys; \
sys.exit('cuda' not in moeext.build_info()['backends'])" 2> /dev/null; then
  # The baseline's full peer table exists (shared/gpu-peers/results); this run's pairs are
  # timed in step 3, so the harness's own comparison runs its quick cases to leave time.
  SKIP_TESTS=1 BENCH_ARGS="${BENCH_ARGS---quick}" BENCH_S="${BENCH_S:-60}" \
    timeout -k 10 "${DEVICE_RUN_S:-230}" bash .gpu-peers/device_run.sh \
    > "$OUT/device-run.log" 2>&1
  el "device_run.sh: exit $? (device-run.log)"
  grep -E "^\[[0-9]+ s\]|^build \(|BUILD FAILED|FAILED|ERROR" "$OUT/device-run.log" \
    | cut -c1-200 | head -20
  sed -n '/^| case/,/^$/p' "$OUT/device-run.log" | cut -c1-150 | head -40
fi

# Whether step $1 is in this part's STEPS (each part's default below).
wants() {
  case " $STEPS " in *" $1 "*) return 0 ;; esac
  return 1
}

if [ "$PART" = 1 ]; then
  STEPS="${STEPS-variants tests}"
  # The kernels' variants against the current ones first, in a box of their own: which ones
  # land is decided by these rows. Then where a decode token's routing time goes.
  if wants variants; then
    timeout -k 10 "${VARIANT_S:-90}" "$PY" benchmarks/python/bench_cuda.py --quick \
      --no-engines --only "${VARIANT_SUITES:-routing_variant,routing_anatomy}" \
      > "$OUT/routing-variants.log" 2>&1
    el "bench_cuda.py --only ${VARIANT_SUITES:-routing_variant,routing_anatomy}: exit $? \
(routing-variants.log)"
    grep -E "^(routing|router_gemm|fused_router) .*(variant|anatomy)" \
      "$OUT/routing-variants.log" | cut -c1-170 | head -88 || tail -10 "$OUT/routing-variants.log"
  fi

  wants tests && gpu_tests pytest-gpu "${TESTS_S:-160}" "cuda and not compile and not export"

  # The engines' comparison again with moeext launching under PDL, as vLLM's and FlashInfer's
  # kernels launch (issue #51 compares mode for mode): its tables go to $OUT/pdl/.
  if wants peerspdl; then
    MOEEXT_ENABLE_PDL=1 timeout -k 10 "${PEERS_PDL_S:-60}" "$PY" .gpu-peers/bench_peers.py \
      --moeext "$root/python" --out "$OUT/pdl" ${BENCH_ARGS---quick} > "$OUT/peers-pdl.log" 2>&1
    el "bench_peers.py with MOEEXT_ENABLE_PDL=1: exit $? (peers-pdl.log, pdl/peers.md)"
    sed -n '/^### /,/^Checks/p' "$OUT/pdl/peers.md" 2>/dev/null | cut -c1-150 | head -40
  fi

  if wants fused; then
    timeout -k 10 "${FUSED_S:-60}" "$PY" benchmarks/python/bench_fused_router_peers.py \
      --peers .gpu-peers --moeext python --out "$OUT" > "$OUT/fused-router-peers.log" 2>&1
    el "bench_fused_router_peers.py: exit $? (fused_router_peers.md, .json)"
    if [ -f "$OUT/fused_router_peers.md" ]; then
      sed -n '/^## Verdicts/,/^## Every pair/p' "$OUT/fused_router_peers.md" | head -30
    else
      tail -25 "$OUT/fused-router-peers.log"
    fi
  fi

  if wants bench; then
    timeout -k 10 "${CUDA_BENCH_S:-30}" "$PY" benchmarks/python/bench_cuda.py --quick \
      --markdown --only routing_options,fused_router,grouped_topk \
      > "$OUT/bench-cuda-quick.log" 2>&1
    el "bench_cuda.py --quick: exit $? (bench-cuda-quick.log)"
    grep -q "^| op" "$OUT/bench-cuda-quick.log" && sed -n '/^| op/,$p' \
      "$OUT/bench-cuda-quick.log" | cut -c1-160 | head -60 || tail -15 "$OUT/bench-cuda-quick.log"
  fi
else
  STEPS="${STEPS-pdl compile aoti ncu}"
  # PDL on: the same bits, eagerly, in graphs captured with it and under torch.compile
  # (test_programmatic_launch.py says whether it took effect on this device); PDL_FILES widens
  # it to the decode ops' own tests (about 6 minutes).
  # shellcheck disable=SC2086
  wants pdl && MOEEXT_ENABLE_PDL=1 gpu_tests pdl-tests "${PDL_S:-45}" \
    "(cuda or programmatic) and not variant" ${PDL_FILES:-tests/test_programmatic_launch.py}

  wants compile && gpu_tests pytest-gpu-compile "${COMPILE_S:-120}" \
    "cuda and (compile or export)"

  # The warp operations' own costs, in the multiprocessor's cycles (nvcc for this GPU's
  # architecture, as torch reports it; nvcc's own detection where torch cannot say).
  if ! wants warpops; then
    :
  elif command -v nvcc > /dev/null; then
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

  # The test's child process, standalone: the same function on the same device, with a compile
  # cache of its own so that no graph from another build is served to it. gdb prints the
  # native stack where the signal stops it; `continue` then hands the signal to faulthandler,
  # which prints the Python one.
  if wants aoti; then
    aoti="$(mktemp -d)"
    export TORCHINDUCTOR_CACHE_DIR="$aoti/inductor-cache"
    child="import sys; sys.path[:0] = ['$root/python', '$root/tests']; import test_compile; \
  test_compile._aot_inductor_package_check('cuda', '$aoti/step.pt2'); print('AOTI child: ok')"
    traced=0
    if command -v gdb > /dev/null; then
      timeout -k 10 "${AOTI_S:-90}" gdb -q -batch -ex "set pagination off" \
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
      # Without gdb, .ci/segv_backtrace.c preloaded prints the native stack after
      # faulthandler's Python ones.
      preload=""
      if cc -O1 -g -shared -fPIC .ci/segv_backtrace.c -o "$aoti/segv_backtrace.so" \
        > "$OUT/segv-backtrace-build.log" 2>&1; then
        preload="$aoti/segv_backtrace.so"
      fi
      LD_PRELOAD="$preload${LD_PRELOAD:+:$LD_PRELOAD}" timeout -k 10 "${AOTI_S:-90}" "$PY" \
        -X faulthandler -c "$child" > "$OUT/aoti-faulthandler.log" 2>&1
      el "AOTInductor child with faulthandler${preload:+ and the native stack}: exit $? \
(aoti-faulthandler.log)"
      grep -E "^  File |Fatal Python|^\*\*\*|\.so|AOTI child: ok" \
        "$OUT/aoti-faulthandler.log" | grep -v "threading.py\|tqdm\|subproc_pool" \
        | cut -c1-220 | head -70
    fi
    rm -rf "$aoti"
  fi

  # Nsight Compute: ncu on the PATH, or where the image installs it. The calls inside the
  # script's NVTX ranges only; the clocks are left alone (--clock-control none).
  if wants ncu; then
    NCU="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu \
      2>/dev/null | head -1)"
    if [ -n "$NCU" ]; then
      timeout -k 10 "${PROFILE_S:-40}" "$NCU" --clock-control none --nvtx \
        --nvtx-include moeext-profile/ --section SpeedOfLight --section LaunchStats \
        --section Occupancy --section SchedulerStats --section WarpStateStats \
        --section InstructionStats --export "$OUT/decode-kernels" --force-overwrite \
        "$PY" benchmarks/python/profile_cuda.py ${PROFILE_CASES:+--cases "$PROFILE_CASES"} \
        > "$OUT/ncu.log" 2>&1
      el "ncu on the decode kernels: exit $? (ncu.log, decode-kernels.ncu-rep)"
      if [ -f "$OUT/decode-kernels.ncu-rep" ]; then
        timeout 6 "$NCU" --import "$OUT/decode-kernels.ncu-rep" --page raw --csv \
          > "$OUT/ncu-raw.csv" 2>&1
        timeout 6 "$NCU" --import "$OUT/decode-kernels.ncu-rep" --page details \
          > "$OUT/ncu-details.txt" 2>&1
        grep -E "^  [a-z_].*\(|Duration|Executed Instructions  |Issue Slots Busy|Warp Cycles Per Issued|Achieved Occupancy|Registers Per Thread|Block Size|Grid Size" \
          "$OUT/ncu-details.txt" | cut -c1-160 | head -60
      else
        grep -E "^profiled|==ERROR==|==WARNING==|rror" "$OUT/ncu.log" | cut -c1-200 | head -20
      fi
    else
      el "no ncu on this machine: no kernel profile"
    fi
  fi
fi

# One archive of everything but the profile's report (over the size that comes back).
archive="session-part$PART.tgz"
(cd "$OUT" && find . -maxdepth 1 -type f ! -name "$archive" ! -name "*.ncu-rep" \
  -printf '%P\n' | tar czf "$archive" -T - && find . -maxdepth 1 -type f ! -name "$archive" \
  -delete)
el "done: $OUT/$archive ($(tar tzf "$OUT/$archive" | tr '\n' ' '))"
