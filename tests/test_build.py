"""The build itself: what it reports, the run-time ISA switch, the registered ops."""

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile

import pytest
import torch

import moeext

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_build_info():
    info = moeext.build_info()
    assert info["torch_version"] == torch.__version__.split("+")[0]
    assert re.fullmatch(r"\S+ \d+(\.\d+)*", info["compiler"]), info["compiler"]  # "GNU 12.2.0"
    assert "cpu" in info["backends"]
    assert "portable" in info["cpu_isas_compiled"]
    assert info["cpu_isa_best"] in info["cpu_isas_compiled"]
    assert "portable" in info["cpu_isas_available"]
    assert set(info["cpu_isas_available"]) <= set(info["cpu_isas_compiled"])
    assert info["cpu_isa_best"] == info["cpu_isas_available"][-1]  # best last


def test_set_cpu_isa_round_trip():
    best = moeext.build_info()["cpu_isa_best"]
    for name in ("portable", "scalar"):  # "scalar": its name before 2026-11-28
        moeext.set_cpu_isa(name)
        try:
            assert moeext.cpu_isa() == "portable"
            assert moeext.build_info()["cpu_isa_active"] == "portable"
        finally:
            moeext.set_cpu_isa("auto")
        assert moeext.cpu_isa() == best
    with pytest.raises(ValueError,
                       match="isa must be 'auto', 'portable', 'avx2', 'avx512' or 'avx512bf16'"):
        moeext.set_cpu_isa("sse9")


OPS = ("biased_grouped_topk", "biased_grouped_topk_out", "routing_weights", "router_gemm",
       "fused_router", "fused_router_out", "zero_tail_", "zero_tail_tracked_", "shuffle_weight", "unshuffle_weight",
       "e8m0_shuffle", "e8m0_unshuffle")


def _registrations():
    """{dispatch key: {op: binding file}} from csrc/torch/ops/*.cpp's TORCH_LIBRARY_IMPL blocks."""
    found = {}
    for source in sorted((ROOT / "csrc" / "torch" / "ops").glob("*.cpp")):
        text = source.read_text()
        for key, body in re.findall(r"TORCH_LIBRARY_IMPL\(moeext, (\w+), m\) \{(.*?)\n\}", text,
                                    re.DOTALL):
            for name in re.findall(r'm\.impl\(\s*"(\w+)"', body):
                assert name not in found.setdefault(key, {}), (key, name)
                found[key][name] = source.name
    return found


# The developers' A/B switches of the GPU kernels (moeext/common.h) and how many variants each
# has, the current kernel (0) included.
VARIANT_SWITCHES = {"_set_gpu_routing_variant": 9, "_set_gpu_router_gemm_variant": 4,
                    "_set_gpu_fused_router_variant": 4}


@pytest.mark.parametrize("name", VARIANT_SWITCHES)
def test_variant_switches_return_the_previous_one_and_refuse_others(name):
    setter, last = getattr(moeext._C, name), VARIANT_SWITCHES[name] - 1
    previous = setter(last)
    try:
        assert setter(0) == last
        for bad in (-1, last + 1):
            with pytest.raises(ValueError, match=f"{name}: variant must be 0 \\(the current "
                               f"kernel\\) to {last}, got {bad}"):
                setter(bad)
        assert setter(0) == 0  # a refused value changes nothing
    finally:
        setter(previous)


def test_every_op_has_one_schema_a_fake_and_one_binding_file():
    """One schema line, one fake, and every kernel of an op (CPU, CUDA, Autograd) registered
    in one binding file of csrc/torch/ops."""
    schema = (ROOT / "csrc" / "torch" / "schema.cpp").read_text()
    fakes = (ROOT / "python" / "moeext" / "_fake.py").read_text()
    registered = _registrations()
    for name in OPS:
        assert schema.count(f'"{name}(') == 1
        assert f'"moeext::{name}"' in fakes
        keys = ["CPU", "CUDA", "Autograd"] + (["ADInplaceOrView"] if name in
                                              registered.get("ADInplaceOrView", {}) else [])
        files = {registered[key][name] for key in keys}
        assert len(files) == 1, (name, files)
        assert hasattr(torch.ops.moeext, name)


def test_check_messages_are_filled_in_by_both_languages():
    """Every message the fakes share with the kernels has a key of its op family and fields
    in braces only; the keys the fakes ask for all exist."""
    messages = moeext._C.check_messages()
    assert messages and all(re.fullmatch(r"\w+\.\w+", key) for key in messages)
    for text in messages.values():
        assert text.count("{") == text.count("}") and "{op}" in text
    asked = set(re.findall(r'_message\("([\w.]+)"', (ROOT / "python" / "moeext" / "_fake.py")
                           .read_text()))
    assert asked <= set(messages), asked - set(messages)


def test_registered_backends_match_build_info():
    """A CUDA build (MOEEXT_FORCE_CUDA=1 included, on a CPU-only torch) registers every op for
    the CUDA key; a CPU build registers none. Either way the CPU kernels are there."""
    has_cuda = "cuda" in moeext.build_info()["backends"]
    for name in OPS:
        qualified = f"moeext::{name}"
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CPU")
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CUDA") == has_cuda


def test_every_gpu_source_is_built():
    cmake = (ROOT / "CMakeLists.txt").read_text()
    sources = sorted((ROOT / "csrc" / "gpu").glob("*.cu"))
    assert sources  # the folder exists: a renamed one made this test check nothing
    for source in sources:
        assert f"csrc/gpu/{source.name}" in cmake, f"{source.name} is not in MOEEXT_GPU_KERNELS"


def test_build_files_do_not_tune_for_the_build_machine():
    for name in ("CMakeLists.txt", "setup.py", "pyproject.toml"):
        assert "march=native" not in (ROOT / name).read_text()


def test_the_sdist_holds_every_file_the_build_and_tests_need(tmp_path):
    """`python -m build` compiles the wheel from the sdist, and so does `pip install` of one:
    without MANIFEST.in the sdist held neither csrc/ nor CMakeLists.txt and could not build."""
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    needed = [f for f in listed.stdout.split() if f.startswith(("csrc/", "python/", "tests/",
                                                                "benchmarks/cpp/"))]
    needed += ["CMakeLists.txt", "setup.py", "pyproject.toml", "README.md",
               "requirements-test.txt"]
    tree = tmp_path / "tree"
    for name in listed.stdout.split():  # a copy: sdist writes egg-info beside the sources
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tree / name)
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "--dist-dir", str(tmp_path)],
                   cwd=tree, check=True, capture_output=True, timeout=300)
    (archive,) = tmp_path.glob("*.tar.gz")
    with tarfile.open(archive) as sdist:
        held = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    assert sorted(set(needed) - held) == []


def test_an_error_is_raised_not_a_crash():
    """A build that carried a private, static libstdc++ (its compiler linked one) died with
    SIGSEGV formatting its first error message, where the two copies' stream facets met.
    Run in a child process, so that such a build fails this test instead of the whole run."""
    code = ("import torch, moeext\n"
            "try:\n"
            "    torch.ops.moeext.zero_tail_(torch.zeros(8), -1, 2)\n"
            "except RuntimeError as e:\n"
            "    print(e)\n")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=300)
    assert child.returncode == 0, f"exit {child.returncode}: {child.stderr[-3000:]}"
    assert "new_extent must be >= 0, got -1" in child.stdout


@pytest.mark.parametrize("forced",
                         moeext.build_info()["cpu_isas_available"] + ["auto", "", "scaler", "scalar"])
def test_the_environment_forces_a_path_or_warns(forced):
    """MOEEXT_CPU_ISA picks any path this CPU runs (the portable one by its old name "scalar"
    too); auto and empty leave the best one silently, and a name of no path here leaves it
    with a warning."""
    out = subprocess.run(
        [sys.executable, "-W", "always", "-c", "import moeext; print(moeext.cpu_isa())"],
        env={**os.environ, "MOEEXT_CPU_ISA": forced},
        capture_output=True, text=True, check=True,
    )
    info = moeext.build_info()
    warning = f"MOEEXT_CPU_ISA={forced!r} is not a CPU path"
    assert (warning in out.stderr) == (forced == "scaler"), out.stderr
    expected = ("portable" if forced == "scalar" else forced if forced in info["cpu_isas_available"]
                else info["cpu_isa_best"])
    assert out.stdout.strip() == expected


def test_the_demo_fails_on_a_wrong_result(monkeypatch, capsys):
    import moeext.__main__ as demo

    monkeypatch.setattr(demo, "_median_us", lambda fn, iters: 1.0)  # the check, not the timing
    demo.main()
    assert "check: every row matches the reference" in capsys.readouterr().out
    route = moeext.biased_grouped_topk

    def off_by_a_percent(*args, **kwargs):
        weights, ids = route(*args, **kwargs)
        return weights * 1.01, ids

    monkeypatch.setattr(moeext, "biased_grouped_topk", off_by_a_percent)
    with pytest.raises(SystemExit, match="FAILED: the batches of \\[1, 4096\\] tokens differ"):
        demo.main()


# Run in a fresh interpreter, where no moeext kernel has run yet: each op in turn, called
# for a quarter of a second on inputs large enough for every thread to get a chunk. Prints,
# per op, the threads that appeared and the CPU time the calling thread and the others
# spent meanwhile (/proc's schedstat).
_THREAD_PROBE = r"""
import json, os, threading, time
import torch, moeext

def cpu_ns():
    times = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                times[int(tid)] = int(f.read().split()[0])
        except OSError:  # the thread ended meanwhile
            pass
    return times

g = torch.Generator().manual_seed(0)
logits, bias = torch.randn(65536, 256, generator=g), torch.randn(256, generator=g)
hidden = torch.randn(512, 7168, generator=g).bfloat16()
gate = torch.randn(256, 7168, generator=g).bfloat16()
w = torch.randint(0, 256, (64, 1024, 1024), dtype=torch.uint8, generator=g)
s = torch.randint(0, 256, (131072, 64), dtype=torch.uint8, generator=g)
buf = torch.ones(16384, 4096)
ops = {
    "biased_grouped_topk": lambda: moeext.biased_grouped_topk(logits, bias, 8, 4, 8),
    "router_gemm": lambda: moeext.router_gemm(hidden, gate),
    "shuffle_weight": lambda: moeext.shuffle_weight(w, (16, 16)),
    "e8m0_shuffle": lambda: moeext.e8m0_shuffle(s),
    "zero_tail_": lambda: moeext.zero_tail_(buf, 0, buf.shape[0]),
}
torch.set_num_threads(2)
torch.ones(1 << 24).add_(1)  # torch's own pool, started by one of its ops
main = threading.get_native_id()
report = {}
for name, op in ops.items():
    time.sleep(0.2)  # the pool's threads stop spinning and sleep
    before = cpu_ns()
    start = time.perf_counter()
    while time.perf_counter() - start < 0.25:  # schedstat lags by up to a scheduler tick
        op()
    after = cpu_ns()
    report[name] = {
        "new_threads": len(after.keys() - before.keys()),
        "caller_ns": after[main] - before[main],
        "others_ns": sum(after[t] - before[t] for t in before.keys() & after.keys() if t != main),
    }
print(json.dumps(report))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or
                    not pathlib.Path("/proc/self/task/%d/schedstat" % os.getpid()).exists(),
                    reason="needs two CPUs, and Linux's per-thread schedstat")
def test_the_kernels_split_their_work_over_torchs_threads():
    """The CPU ops run their parallel loops on the OpenMP threads torch's own ops use, sized
    by torch.set_num_threads. A clang build once ran them on libomp's pool, a second set of
    threads beside torch's libgomp ones; a build whose loops went serial would pass every
    other test."""
    child = subprocess.run([sys.executable, "-c", _THREAD_PROBE], capture_output=True,
                           text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    report = json.loads(child.stdout.splitlines()[-1])
    for name, seen in report.items():
        assert seen["new_threads"] == 0, (name, seen)
        # Two threads, an even split: the other thread's share is about the caller's.
        assert seen["others_ns"] >= 0.25 * seen["caller_ns"], (name, seen)
