#!/usr/bin/env bash
# The CPU kernels under AddressSanitizer and UndefinedBehaviorSanitizer, with libstdc++'s
# assertions: builds a scratch clone of this checkout's HEAD in place with them (CPU kernels,
# every x86-64 path), then runs the demo and the whole suite with their runtimes preloaded into
# Python. torch is not instrumented, but its CPU tensors are heap blocks of their exact size,
# so a kernel's read or write past one lands in ASan's redzone. Any report fails the run, and
# the reports are printed. Not part of .ci/run: the build takes about 10 minutes on two cores.
#
#   bash .ci/cpu_sanitize.sh    # the whole suite, whose routing tests run every CPU path
#   PYTEST_ARGS="-k zero_tail" bash .ci/cpu_sanitize.sh
set -euo pipefail
src="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
git clone -q "$src" "$work/m"
san="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
# -O1 last on every command line, after the targets' own -O3 and -O2: instrumented at -O3 the
# routing kernels alone take over half an hour to compile on two cores, at -O1 a few minutes.
printf '#!/bin/sh\nexec %s "$@" -O1\n' "$(command -v "${CXX:-g++}")" > "$work/cxx"
chmod +x "$work/cxx"
echo "== building $(git -C "$work/m" rev-parse --short HEAD) in $work/m (log: $work/build.log)"
(cd "$work/m" && CXX="$work/cxx" CXXFLAGS="$san -D_GLIBCXX_ASSERTIONS" \
  LDFLAGS="-fsanitize=address,undefined" MOEEXT_FORCE_CUDA=0 MAX_JOBS="${MAX_JOBS:-2}" \
  python setup.py build_ext --inplace > "$work/build.log" 2>&1) \
  || { tail -30 "$work/build.log"; exit 1; }

mkdir -p "$work/cwd" "$work/logs"
cd "$work/cwd"  # empty: the tests import the scratch build, not an installed moeext
export LD_PRELOAD="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)"
export ASAN_OPTIONS="detect_leaks=0:log_path=$work/logs/asan"
export UBSAN_OPTIONS="print_stacktrace=1:log_path=$work/logs/ubsan"
export PYTHONPATH="$work/m/python"
status=0
python -m moeext || status=$?
# shellcheck disable=SC2086  # PYTEST_ARGS is a list of arguments
python -m pytest "$work/m/tests" -q -p no:cacheprovider ${PYTEST_ARGS:-} || status=$?
if compgen -G "$work/logs/*" > /dev/null; then
  echo "== sanitizer reports ($work/logs):"
  head -60 "$work"/logs/*
  status=1
fi
exit "$status"
