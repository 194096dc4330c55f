"""Copies csrc/gpu/ for the host build of the GPU kernels (tests/gpu_emulation/), rewriting the
two constructs that include/hip/hip_runtime.h cannot define as macros:

- ``kernel<<<grid, block, shared, stream>>>(args)`` becomes
  ``::moeext_emu::Configured(grid, block, shared, stream).kernel(kernel)(args)``;
- ``extern __shared__ T name[];`` becomes a pointer to the launch's dynamic shared memory.

Nothing else changes: the kernels compile as they are, as HIP (compat.h's MOEEXT_HIP paths).
``load`` then builds them, the fiber runtime and harness.cpp into one torch extension.
"""

import os
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

LAUNCH = re.compile(r"([A-Za-z_][\w:]*(?:<[^<>;()]*>)?)<<<(.*?)>>>\(")
DYNAMIC_SHARED = re.compile(r"extern\s+__shared__\s+(\w+)\s+(\w+)\s*\[\s*\]\s*;")


def rewrite(text):
    text = LAUNCH.sub(r"::moeext_emu::Configured(\2).kernel(\1)(", text)
    return DYNAMIC_SHARED.sub(
        r"\1* const \2 = static_cast<\1*>(::moeext_emu::dynamic_shared());", text)


def prepare(source_root, build_root, defines=()):
    """Writes the rewritten copy of source_root/csrc/gpu under build_root/csrc/gpu, and a C++
    unit for each .cu file that defines `defines` (names, or name=value) and includes it;
    returns the units' paths."""
    source = Path(source_root) / "csrc" / "gpu"
    target = Path(build_root) / "csrc" / "gpu"
    target.mkdir(parents=True, exist_ok=True)
    units = []
    for path in sorted(source.iterdir()):
        if path.suffix not in (".cu", ".h"):
            continue
        out = target / path.name
        text = rewrite(path.read_text())
        if not out.exists() or out.read_text() != text:
            out.write_text(text)
        if path.suffix == ".cu":
            # A C++ unit of its own (torch's builder would hand a .cu to nvcc).
            unit = target.parent.parent / f"{path.stem}_cu.cpp"
            lines = [f"#define {d.replace('=', ' ')}" for d in ("__HIP_PLATFORM_AMD__=1", *defines)]
            text = "\n".join(lines + [f'#include "gpu/{path.name}"', ""])
            if not unit.exists() or unit.read_text() != text:
                unit.write_text(text)
            units.append(unit)
    return units


def load(build_root, warp_size=32, verbose=False):
    """The emulation's extension module for `warp_size` (32, or 64 as on CDNA), built under
    build_root (kept between runs: only what changed is compiled again)."""
    from torch.utils import cpp_extension

    build_root = Path(build_root) / f"wave{warp_size}"
    # The kernels' units only: torch's headers, in harness.cpp, must not see a device compile.
    # compat.h takes its device warp width of 64 from these (gfx9).
    units = prepare(ROOT, build_root,
                    ["__HIP_DEVICE_COMPILE__=1", "__GFX9__=1"] if warp_size == 64 else [])
    defines = [f"-DMOEEXT_EMU_WARP_SIZE={warp_size}"]
    objects = build_root / "objects"
    objects.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MAX_JOBS", "2")
    return cpp_extension.load(
        name=f"moeext_gpu_emulation_wave{warp_size}",
        sources=[str(HERE / "harness.cpp"), str(HERE / "runtime.cpp"),
                 str(HERE / "hip_host.cpp")] + [str(u) for u in units],
        extra_cflags=["-O2", "-std=c++17", *defines, f"-I{HERE / 'include'}",
                      f"-I{build_root / 'csrc'}", f"-I{ROOT / 'csrc'}",
                      f"-I{ROOT / 'csrc' / 'include'}"],
        build_directory=str(objects),
        verbose=verbose)


if __name__ == "__main__":
    print(load(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 32, verbose=True))
