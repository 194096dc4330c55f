#!/usr/bin/env bash
# The portable CPU path on aarch64 (Graviton, Grace, Ampere), checked on an x86-64 machine
# (called by .ci/run). There it is the only routing path, and it is built from generic vector
# types whose lowering differs between architectures. Cross-compiled with the Debian aarch64
# toolchain and run under qemu-user:
#   1. the host unit tests of the vector layer's exp, fp16 widening and score pieces
#      (tests/cpp) pass;
#   2. the routing kernel gives the same ids and the same weight bits as the x86-64 build of
#      the same sources over 4000 cases (.ci/aarch64_route_dump.cpp), and that x86-64 build
#      is the portable path the test suite checks against the reference;
#   3. the router GEMM is within the fp64 tolerance of the test suite on every case of
#      .ci/aarch64_router_gemm_check.cpp (its bits differ: aarch64 fuses the multiply-adds).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="$PWD/build-ci-tools/aarch64"
mkdir -p "$OUT"

if ! command -v aarch64-linux-gnu-g++ > /dev/null || ! command -v qemu-aarch64 > /dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++-aarch64-linux-gnu qemu-user > /dev/null
fi

# The flags CMakeLists.txt gives the kernels and the dispatch code; no x86 path is compiled
# in, so the dump runs the portable copy on both machines.
COMMON=(-std=c++17 -Icsrc/include -Icsrc -Wall -Wextra -Werror)
KERNEL=(-O3 -fno-math-errno -DMOEEXT_CPU_ISA=portable)
HOST_TESTS="test_vec_exp test_portable_fp16 test_score_pieces"
build() {  # compiler, output directory
  local cxx=$1 dir=$2
  mkdir -p "$dir"
  "$cxx" "${COMMON[@]}" "${KERNEL[@]}" -c csrc/cpu/grouped_topk.cpp -o "$dir/grouped_topk.o" &
  "$cxx" "${COMMON[@]}" "${KERNEL[@]}" -c csrc/cpu/router_gemm.cpp -o "$dir/router_gemm.o" &
  "$cxx" "${COMMON[@]}" "${KERNEL[@]}" -c csrc/cpu/routing_weights.cpp -o "$dir/routing_weights.o" &
  "$cxx" "${COMMON[@]}" -O2 -c csrc/cpu/dispatch.cpp -o "$dir/dispatch.o" &
  "$cxx" "${COMMON[@]}" -O2 -c csrc/cpu/routing_options.cpp -o "$dir/routing_options.o" &
  "$cxx" "${COMMON[@]}" -O2 -c .ci/aarch64_route_dump.cpp -o "$dir/route_dump.o" &
  "$cxx" "${COMMON[@]}" -O2 -c .ci/aarch64_router_gemm_check.cpp -o "$dir/gemm_check.o" &
  wait
  local kernels=("$dir/grouped_topk.o" "$dir/router_gemm.o" "$dir/routing_weights.o"
                 "$dir/dispatch.o" "$dir/routing_options.o")
  "$cxx" -static -o "$dir/route_dump" "${kernels[@]}" "$dir/route_dump.o"
  "$cxx" -static -o "$dir/gemm_check" "${kernels[@]}" "$dir/gemm_check.o"
  for test in $HOST_TESTS; do
    "$cxx" "${COMMON[@]}" -O2 -static tests/cpp/$test.cpp -o "$dir/$test"
  done
}
build g++ "$OUT/x86_64"
build aarch64-linux-gnu-g++ "$OUT/aarch64"

for test in $HOST_TESTS; do
  qemu-aarch64 "$OUT/aarch64/$test"
done
"$OUT/x86_64/gemm_check"
qemu-aarch64 "$OUT/aarch64/gemm_check"

CASES=4000
"$OUT/x86_64/route_dump" "$OUT/x86_64.txt" "$CASES"
qemu-aarch64 "$OUT/aarch64/route_dump" "$OUT/aarch64.txt" "$CASES"
if ! cmp -s "$OUT/x86_64.txt" "$OUT/aarch64.txt"; then
  echo "aarch64 routing differs from x86-64 (first differences below)" >&2
  diff "$OUT/x86_64.txt" "$OUT/aarch64.txt" | head -20 >&2
  exit 1
fi
ROWS=$(grep -vc '^case' "$OUT/x86_64.txt")
echo "aarch64 portable routing: $CASES cases, $ROWS rows, identical to x86-64"
