"""The Nsight Compute driver of the decode kernels (benchmarks/python/profile_cuda.py): its
case list and argument checks, which run anywhere; the cases themselves need a GPU."""

import importlib.util
import pathlib

import pytest
import torch

import moeext

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "python" / "profile_cuda.py"


def load():
    spec = importlib.util.spec_from_file_location("profile_cuda", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_lists_every_case_with_a_known_preset(capsys):
    from moeext.presets import PRESETS

    profile = load()
    assert profile.main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == list(profile.CASES)
    for op, preset, tokens, variant in profile.CASES.values():
        assert op in ("route", "counts", "gemm", "fused") and preset in PRESETS and tokens >= 1
        # A routing variant the build has, and only where routing runs.
        assert 0 <= variant and (op in ("route", "counts") or variant == 0)
        previous = moeext._C._set_gpu_routing_variant(variant)
        moeext._C._set_gpu_routing_variant(previous)


def test_an_unknown_case_is_refused_by_name():
    profile = load()
    with pytest.raises(SystemExit, match=r"--cases: unknown case\(s\) \['route-nope'\]"):
        profile.main(["--cases", "route-dsv3-bf16-t1,route-nope", "--list"])
    with pytest.raises(SystemExit, match="--cases"):
        profile.main(["--cases", ",", "--list"])


def test_without_a_gpu_it_says_so_and_exits_2(capsys):
    if torch.cuda.is_available() and "cuda" in moeext.build_info()["backends"]:
        pytest.skip("a CUDA GPU is here: the cases run (test_runs_every_case_once)")
    assert load().main(["--cases", "route-dsv3-bf16-t1"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_runs_every_case_once(capsys):
    if "cuda" not in moeext.build_info()["backends"]:
        pytest.skip("moeext was built without CUDA")
    profile = load()
    assert profile.main([]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed == [f"profiled: {name}" for name in profile.CASES]
