"""Host unit tests of the logic the CPU and GPU kernels share (csrc/host_device/*.h), of the
kernels' plans (csrc/gpu/grouped_topk_plan.h, csrc/cpu/grouped_topk_plan.h), and of the CPU
kernels' portable pieces (csrc/cpu/score_pieces.h, vec_math.h).

Each tests/cpp/test_*.cpp is one program that includes a header, checks it, and exits
non-zero on a failure. They need only a C++ compiler, so they run here on every machine, GPU
or not, against the very functions the kernels call.
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = sorted((ROOT / "tests" / "cpp").glob("test_*.cpp"))


def _compiler():
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


@pytest.mark.parametrize("source", PROGRAMS, ids=[p.stem for p in PROGRAMS])
def test_host_logic(source, tmp_path):
    cxx = _compiler()
    if cxx is None:
        pytest.skip("no C++ compiler on PATH")
    binary = tmp_path / source.stem
    build = subprocess.run(
        [cxx, "-std=c++17", "-O2", "-Wall", "-Wextra", "-Werror",
         f"-I{ROOT / 'csrc' / 'include'}", f"-I{ROOT / 'csrc'}", str(source), "-o", str(binary)],
        capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
