"""The build itself: what it reports, the run-time ISA switch, the registered ops."""

import pathlib

import pytest
import torch

import moeext

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_build_info():
    info = moeext.build_info()
    assert info["torch_version"] == torch.__version__.split("+")[0]
    assert "cpu" in info["backends"]
    assert "scalar" in info["cpu_isas_compiled"]
    assert info["cpu_isa_best"] in info["cpu_isas_compiled"]
    assert "scalar" in info["cpu_isas_available"]
    assert set(info["cpu_isas_available"]) <= set(info["cpu_isas_compiled"])
    assert info["cpu_isa_best"] == info["cpu_isas_available"][-1]  # best last


def test_set_cpu_isa_round_trip():
    best = moeext.build_info()["cpu_isa_best"]
    moeext.set_cpu_isa("scalar")
    try:
        assert moeext.cpu_isa() == "scalar"
        assert moeext.build_info()["cpu_isa_active"] == "scalar"
    finally:
        moeext.set_cpu_isa("auto")
    assert moeext.cpu_isa() == best
    with pytest.raises(ValueError,
                       match="isa must be 'auto', 'scalar', 'avx2', 'avx512' or 'avx512bf16'"):
        moeext.set_cpu_isa("sse9")


def test_environment_forces_the_portable_path():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", "import moeext; print(moeext.cpu_isa())"],
        env={**__import__("os").environ, "MOEEXT_CPU_ISA": "scalar"},
        capture_output=True, text=True, check=True,
    )
    assert out.stdout.strip() == "scalar"


def test_every_op_has_one_schema_and_a_fake():
    schema = (ROOT / "csrc" / "torch" / "schema.cpp").read_text()
    fakes = (ROOT / "python" / "moeext" / "_fake.py").read_text()
    for name in ("biased_grouped_topk", "biased_grouped_topk_out", "router_gemm", "zero_tail_",
                 "zero_tail_tracked_", "shuffle_weight", "unshuffle_weight", "e8m0_shuffle",
                 "e8m0_unshuffle"):
        assert f'"{name}(' in schema
        assert f'"moeext::{name}"' in fakes
        assert hasattr(torch.ops.moeext, name)


def test_build_files_do_not_tune_for_the_build_machine():
    for name in ("CMakeLists.txt", "setup.py", "pyproject.toml"):
        assert "march=native" not in (ROOT / name).read_text()
