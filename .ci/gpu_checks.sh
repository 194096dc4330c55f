#!/usr/bin/env bash
# The GPU kernels, checked on a machine without a GPU (called by .ci/run):
#   1. every csrc/gpu/*.cu compiles as HIP device code for gfx90a and gfx942 (clang-19, the
#      HIP headers that ship in the triton wheel, a dummy ROCm directory), warnings as errors,
#      and no kernel spills to scratch (AMD's local memory; .ci/check_hip_scratch.py);
#   2. the extension builds and links with MOEEXT_FORCE_CUDA=1 for the default architectures
#      (sm_80, sm_90a, sm_100a) against this CPU-only torch, no kernel spills to local
#      memory (cuobjdump --dump-resource-usage), and the kernels that may be launched with
#      programmatic dependent launch wait before touching memory (cuobjdump -sass);
#   3. the whole test suite passes against that build: import works, the CPU ops work, and
#      the CUDA registrations are present (tests/test_build.py).
#
#   bash .ci/gpu_checks.sh [hip] [cuda]      (default both; .ci/run runs them apart)
#   MOEEXT_CUDA_ARCHS="90a" bash .ci/gpu_checks.sh cuda     (one architecture: a third of the
#                                            time; .ci/run builds this one)
set -euo pipefail
cd "$(dirname "$0")/.."
parts=" ${*:-hip cuda} "
TOOLS="$PWD/build-ci-tools"
mkdir -p "$TOOLS"

# ---- 1. HIP, device-only --------------------------------------------------------------
if [[ $parts == *" hip "* ]]; then
if ! command -v clang++-19 > /dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang-19 > /dev/null
fi
ROCM="$TOOLS/rocm"
if [ ! -f "$ROCM/include/hip/hip_runtime.h" ]; then
  pip download --no-deps -q triton==3.9.0 -d "$TOOLS/wheels"
  python - "$TOOLS/wheels" "$ROCM" <<'PY'
import pathlib, sys, zipfile
wheel = next(pathlib.Path(sys.argv[1]).glob("triton-*.whl"))
prefix = "triton/backends/amd/include/"
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.startswith(prefix) and not name.endswith("/"):
            target = pathlib.Path(sys.argv[2]) / "include" / name[len(prefix):]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(z.read(name))
PY
fi
mkdir -p "$TOOLS/hip"
for src in csrc/gpu/*.cu; do
  for arch in gfx90a gfx942; do
    out="$TOOLS/hip/$(basename "$src" .cu).$arch.s"
    # --hip-version: the dummy ROCm has no version file, and clang then skips its HIP
    # wrapper headers; -nogpulib: no device bitcode libraries are needed to emit assembly.
    clang++-19 -x hip --offload-arch="$arch" --offload-device-only -S -nogpulib \
      --rocm-path="$ROCM" --hip-version=6.4 -std=c++17 -O3 -Wall -Wextra -Werror \
      -Icsrc/include -Icsrc "$src" -o "$out"
    python .ci/check_hip_scratch.py "$out"
  done
  echo "HIP gfx90a, gfx942: $src ok"
done
fi
[[ $parts == *" cuda "* ]] || exit 0

# ---- 2. CUDA, forced on a CPU-only torch ------------------------------------------------
# The warp operations' benchmark (a standalone CUDA program, run on a GPU by
# .ci/gpu_peers_session.sh) builds against the kernels' headers as they are now.
NVCC="$(command -v nvcc || echo "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc")"
"$NVCC" -O3 -std=c++17 -arch=sm_90a -Icsrc/include -Icsrc benchmarks/cuda/warp_ops.cu \
  -o "$TOOLS/warp_ops"
echo "CUDA sm_90a: benchmarks/cuda/warp_ops.cu ok"

MOEEXT_FORCE_CUDA=1 pip install --no-build-isolation -v . > "$TOOLS/cuda-build.log" 2>&1 || {
  tail -50 "$TOOLS/cuda-build.log"; exit 1; }
python - <<'PY'
import moeext, torch
info = moeext.build_info()
assert info["backends"] == ["cpu", "cuda"], info
ops = ["biased_grouped_topk", "biased_grouped_topk_out", "routing_weights", "router_gemm",
       "fused_router", "zero_tail_", "zero_tail_tracked_", "shuffle_weight", "unshuffle_weight",
       "e8m0_shuffle", "e8m0_unshuffle"]
missing = [op for op in ops
           if not torch._C._dispatch_has_kernel_for_dispatch_key(f"moeext::{op}", "CUDA")]
assert not missing, f"no CUDA kernel registered for {missing}"
print(f"CUDA build: {info['gpu_architectures']}, {len(ops)} ops registered for CUDA")
PY
CUOBJDUMP="$(command -v cuobjdump || true)"
if [ -z "$CUOBJDUMP" ]; then
  pip install --no-deps -q --target "$TOOLS/cuobjdump" nvidia-cuda-cuobjdump==13.5.37
  CUOBJDUMP="$(find "$TOOLS/cuobjdump" -name cuobjdump -type f | head -1)"
  chmod +x "$CUOBJDUMP"
fi
SO="$(python -c 'import moeext._C as c; print(c.__file__)')"
python .ci/check_resource_usage.py "$CUOBJDUMP" "$SO"
# The SASS of the kernels launched with programmatic dependent launch: griddepcontrol.wait
# before any global memory access on sm_90+, nothing of it on sm_80 (cuobjdump -sass runs
# nvdisasm).
if ! command -v nvdisasm > /dev/null; then
  if [ ! -x "$TOOLS/nvdisasm/nvidia/cu13/bin/nvdisasm" ]; then
    pip install --no-deps -q --target "$TOOLS/nvdisasm" nvidia-cuda-nvdisasm==13.5.37
    chmod +x "$(find "$TOOLS/nvdisasm" -name nvdisasm -type f | head -1)"
  fi
  export PATH="$(dirname "$(find "$TOOLS/nvdisasm" -name nvdisasm -type f | head -1)"):$PATH"
fi
python .ci/check_grid_dependency.py --all "$CUOBJDUMP" "$SO"

# ---- 3. The suite against the CUDA build ------------------------------------------------
# (Without the emulated GPU kernels, which the first suite ran: this build adds nothing to them.)
MOEEXT_TEST_GPU_EMULATION=0 python -m pytest tests -q
