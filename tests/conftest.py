"""Devices and CPU instruction-set paths the tests run on.

``DEVICES`` is ``["cpu"]``, plus ``"cuda"`` when torch sees a GPU (ROCm's HIP devices included:
torch calls them ``cuda`` too) and this build of moeext has the cuda backend, plus ``"cuda:1"``
when there is a second GPU, so that ops are seen to run on the device of their inputs rather
than on the current one.

Fixtures:
  ``device``      one run per entry of DEVICES (the device string to put inputs on).
  ``device_isa``  ``(device, isa)``: one run per CPU instruction-set path on the cpu (the path
                  is forced for the test), one run per GPU with ``isa`` None, and one run per
                  emulated GPU (``isa`` "gpu-emulation-cuda", sm_90's code, or
                  "gpu-emulation-hip64", CDNA's): the GPU kernels built for the host and run
                  there (tests/gpu_emulation/), on cpu tensors, with moeext's routing ops
                  replaced for the test by ones that launch them. GPU runs are not multiplied
                  by the number of CPU paths.
  ``cpu_isa``     one run per CPU path, cpu only: for tests about the CPU paths themselves.

Test ids name what runs the kernel: ``avx512``, ``portable``, ... for the cpu paths, ``cpu`` for
cpu tests that do not force a path, ``cuda`` and ``cuda:1`` for the GPUs, ``gpu-emulation-cuda``
and ``-hip64`` for the GPU kernels run on the host. ``MOEEXT_TEST_GPU_EMULATION=0`` leaves the
emulated runs out.

Property-based tests run 300 examples each (hypothesis profile ``moeext``). The ``fuzz``
profile runs 20,000, for a long search on demand:
``python -m pytest tests -q -k property --hypothesis-profile=fuzz``.
"""

import contextlib
import functools
import os
import platform
import shutil
import tempfile
import zlib
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

import moeext

settings.register_profile("moeext", max_examples=300, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("fuzz", settings.get_profile("moeext"), max_examples=20_000)
settings.load_profile("moeext")


def _compile_cache_per_build():
    """torch.compile's on-disk caches key a graph by its code and torch's configuration, not by
    moeext's library: after a rebuild, a compile test could be served a graph (backward
    included) traced through the previous build's kernels, and pass or fail for it. So each
    build of moeext._C gets its own cache directory, unless one is set explicitly."""
    if "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        return
    library = os.stat(moeext._C.__file__)
    build = f"{library.st_size:x}-{library.st_mtime_ns:x}"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(),
                                                         f"torchinductor-moeext-{build}")


_compile_cache_per_build()


def _devices():
    devices = ["cpu"]
    if torch.cuda.is_available() and "cuda" in moeext.build_info()["backends"]:
        devices.append("cuda")
        if torch.cuda.device_count() > 1:
            devices.append("cuda:1")
    return devices


DEVICES = _devices()
GPU_DEVICES = [d for d in DEVICES if d != "cpu"]
CPU_ISAS = moeext.build_info()["cpu_isas_compiled"]


@contextlib.contextmanager
def switched(setter, value):
    """The block run with a process-wide setting that ``setter`` sets and whose previous value
    it returns (moeext.set_programmatic_dependent_launch, moeext._C's A/B switches)."""
    previous = setter(value)
    try:
        yield
    finally:
        setter(previous)


@contextlib.contextmanager
def forced_cpu_isa(isa):
    """Runs the block on one CPU path; skips the test if this CPU cannot run it."""
    if isa not in moeext.build_info()["cpu_isas_available"]:
        pytest.skip(f"this CPU cannot run the {isa} path")
    previous = moeext.cpu_isa()
    moeext.set_cpu_isa(isa)
    try:
        yield isa
    finally:
        moeext.set_cpu_isa(previous)


@pytest.fixture(params=DEVICES)
def device(request):
    """Runs a test once per device in DEVICES."""
    return request.param


EMULATED_GPUS = [] if os.environ.get("MOEEXT_TEST_GPU_EMULATION") == "0" else ["cuda", "hip64"]
_EMULATION_PREFIX = "gpu-emulation-"
_DEVICE_ISA_PARAMS = ([pytest.param(("cpu", isa), id=isa) for isa in CPU_ISAS]
                      + [pytest.param((d, None), id=d) for d in GPU_DEVICES]
                      + [pytest.param(("cpu", f"{_EMULATION_PREFIX}{f}"), id=f"{_EMULATION_PREFIX}{f}")
                         for f in EMULATED_GPUS])

_EMULATION_DIR = Path(__file__).resolve().parent / "gpu_emulation"
_emulation_modules = {}


@functools.lru_cache(maxsize=None)
def emulation_file(name):
    """tests/gpu_emulation/<name>.py, imported (once) under a name of its own."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"moeext_gpu_emulation_{name}",
                                                  _EMULATION_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Per emulated test: how many GPU kernels it launched (the summary lists those with none).
EMULATED_LAUNCHES = {}


def emulation_build_root():
    """Where the emulation's builds are kept (skips where it cannot build)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the GPU emulation's fibers are written for x86-64")
    if shutil.which(os.environ.get("CXX", "c++")) is None or shutil.which("ninja") is None:
        pytest.skip("the GPU emulation needs a C++ compiler and ninja")
    return Path(os.environ.get("MOEEXT_GPU_EMULATION_BUILD",
                               Path(tempfile.gettempdir()) / "moeext-gpu-emulation"))


def emulated_gpu_module(flavour):
    """The GPU kernels built for the host as `flavour` (tests/gpu_emulation/prepare.py: "cuda"
    or "hip64"), built once per session (a build failure fails every emulated test with the
    compiler's message)."""
    root = emulation_build_root()
    if flavour not in _emulation_modules:
        prepare = emulation_file("prepare")
        try:
            _emulation_modules[flavour] = prepare.load(root, flavour)
        except Exception as e:  # noqa: BLE001 (kept, so the next test fails at once)
            _emulation_modules[flavour] = e
    module = _emulation_modules[flavour]
    if isinstance(module, Exception):
        pytest.fail(f"the GPU emulation did not build: {module}")
    return module


def emulated_ops_file():
    """tests/gpu_emulation/ops.py, the module."""
    return emulation_file("ops")


def emulated_ops(flavour):
    """tests/gpu_emulation/ops.py's EmulatedOps over the `flavour` build, configured plain."""
    ops = emulated_ops_file().EmulatedOps(emulated_gpu_module(flavour))
    ops.module.configure(0, 1, 132, 0, 0, 0, False)
    return ops


@contextlib.contextmanager
def emulated_gpu_ops(flavour, monkeypatch, nodeid):
    """moeext's routing ops replaced by ones that launch the GPU kernels on the host. The order
    in which a block's threads run between meeting points (forward, backward, shuffled), the
    shuffle's seed, whether kernels launch with programmatic dependent launch, the routing
    variant (0; 3, a call with options of a gate with its own warp kernel instance runs that
    instance; 4 to 8, a plain call of such a gate runs a token a thread, a token a block, its
    own instance scoring each lane's experts as a chunk, a token two threads, or its own
    instance finding the topk by a butterfly of list merges)
    and how a fused router call runs (moeext::gpu_fused_router_variant: the two kernels, or
    the one launch counting either way, or with the gate's own routing) come from the test's
    id, so that the emulated tests between them run each, and each test the same one every
    time."""
    ops = emulation_file("ops").EmulatedOps(emulated_gpu_module(flavour))
    key = zlib.crc32(nodeid.encode())
    ops.module.configure(key % 3, key, 132, (0, 3, 4, 5, 6, 7, 8)[(key >> 6) % 7], 0, (key >> 4) % 4,
                         bool(key & 8))
    for name in ops.NAMES:
        monkeypatch.setattr(moeext, name, getattr(ops, name))
    yield ops


@pytest.fixture(params=_DEVICE_ISA_PARAMS)
def device_isa(request, monkeypatch):
    """``(device, isa)``: every CPU path on the cpu (forced while the test runs), each GPU once,
    each emulated GPU once."""
    device, isa = request.param
    if isa is None:
        yield device, None
        return
    if isa.startswith(_EMULATION_PREFIX):
        if not getattr(request.module, "GPU_EMULATION", True):
            pytest.skip("this module's ops are not wired into the GPU emulation")
        flavour = isa[len(_EMULATION_PREFIX):]
        with emulated_gpu_ops(flavour, monkeypatch, request.node.nodeid) as ops:
            yield device, isa
        EMULATED_LAUNCHES[request.node.nodeid] = ops.launches
        return
    with forced_cpu_isa(isa):
        yield device, isa


@pytest.fixture(params=CPU_ISAS)
def cpu_isa(request):
    """Runs a cpu-only test once per CPU instruction-set path this build has (and this CPU runs)."""
    with forced_cpu_isa(request.param) as isa:
        yield isa


def pytest_terminal_summary(terminalreporter):
    """How much of the emulated runs reached a GPU kernel (a test whose every call was checked
    or routed on the CPU, e.g. zero tokens or a gradient, launches none), per test function."""
    if not EMULATED_LAUNCHES:
        return
    none = {}
    for nodeid, launches in EMULATED_LAUNCHES.items():
        if launches == 0:
            function = nodeid.split("[")[0]
            none[function] = none.get(function, 0) + 1
    terminalreporter.write_line(
        f"GPU emulation: {len(EMULATED_LAUNCHES)} tests, {sum(EMULATED_LAUNCHES.values())} kernel "
        f"launches; {sum(none.values())} tests launched none" + (":" if none else ""))
    for function, count in sorted(none.items()):
        terminalreporter.write_line(f"  {count:4d} x {function}")
