"""Devices and CPU instruction-set paths the tests run on.

``DEVICES`` is ``["cpu"]``, plus ``"cuda"`` when torch sees a GPU (ROCm's HIP devices included:
torch calls them ``cuda`` too) and this build of moeext has the cuda backend, plus ``"cuda:1"``
when there is a second GPU, so that ops are seen to run on the device of their inputs rather
than on the current one.

Fixtures:
  ``device``      one run per entry of DEVICES (the device string to put inputs on).
  ``device_isa``  ``(device, isa)``: one run per CPU instruction-set path on the cpu (the path
                  is forced for the test), and one run per GPU with ``isa`` None. GPU runs are
                  not multiplied by the number of CPU paths.
  ``cpu_isa``     one run per CPU path, cpu only: for tests about the CPU paths themselves.

Test ids name what runs the kernel: ``avx512``, ``portable``, ... for the cpu paths, ``cpu`` for
cpu tests that do not force a path, ``cuda`` and ``cuda:1`` for the GPUs.

Property-based tests run 300 examples each (hypothesis profile ``moeext``). The ``fuzz``
profile runs 20,000, for a long search on demand:
``python -m pytest tests -q -k property --hypothesis-profile=fuzz``.
"""

import contextlib
import os
import tempfile

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


_DEVICE_ISA_PARAMS = ([pytest.param(("cpu", isa), id=isa) for isa in CPU_ISAS]
                      + [pytest.param((d, None), id=d) for d in GPU_DEVICES])


@pytest.fixture(params=_DEVICE_ISA_PARAMS)
def device_isa(request):
    """``(device, isa)``: every CPU path on the cpu (forced while the test runs), each GPU once."""
    device, isa = request.param
    if isa is None:
        yield device, None
        return
    with forced_cpu_isa(isa):
        yield device, isa


@pytest.fixture(params=CPU_ISAS)
def cpu_isa(request):
    """Runs a cpu-only test once per CPU instruction-set path this build has (and this CPU runs)."""
    with forced_cpu_isa(request.param) as isa:
        yield isa
