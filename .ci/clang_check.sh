#!/usr/bin/env bash
# moeext built by clang instead of GCC (called by .ci/run): a scratch clone of this checkout's
# HEAD, built in place with clang++-$CLANG_VERSION (default 14, Ubuntu 22.04's: the oldest
# tried) for the CPU, every x86-64 path, with no OpenMP headers or runtime of clang's
# installed; then the demo and the whole suite against that build. It caught a CPU feature
# name clang 14 does not know, and kernels that ran on a second thread pool (libomp's).
#
#   bash .ci/clang_check.sh
#   CLANG_VERSION=19 PYTEST_ARGS="-k grouped_topk" bash .ci/clang_check.sh
set -euo pipefail
src="$(cd "$(dirname "$0")/.." && pwd)"
version="${CLANG_VERSION:-14}"
if ! command -v "clang++-$version" > /dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    "clang-$version" > /dev/null
fi
work="$(mktemp -d)"
git clone -q "$src" "$work/m"
echo "== building $(git -C "$work/m" rev-parse --short HEAD) with clang++-$version in $work/m"
(cd "$work/m" && CC="clang-$version" CXX="clang++-$version" MOEEXT_FORCE_CUDA=0 \
  MAX_JOBS="${MAX_JOBS:-2}" python setup.py build_ext --inplace > "$work/build.log" 2>&1) \
  || { tail -30 "$work/build.log"; exit 1; }

mkdir -p "$work/cwd"
cd "$work/cwd"  # empty: the tests import the scratch build, not an installed moeext
export PYTHONPATH="$work/m/python"
python -c "import moeext, sys; c = moeext.build_info()['compiler']; print(c); \
sys.exit(0 if c.startswith('Clang $version.') else 'not built by clang $version')"
python -m moeext
# The emulated GPU kernels (tests/gpu_emulation/) do not depend on the compiler that built
# moeext: the first suite ran them.
# shellcheck disable=SC2086  # PYTEST_ARGS is a list of arguments
MOEEXT_TEST_GPU_EMULATION=0 python -m pytest "$work/m/tests" -q -p no:cacheprovider ${PYTEST_ARGS:-}
