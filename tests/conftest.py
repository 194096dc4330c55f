import pytest
import torch

import moeext


def _devices():
    devices = ["cpu"]
    if torch.cuda.is_available() and "cuda" in moeext.build_info()["backends"]:
        devices.append("cuda")
    return devices


DEVICES = _devices()


@pytest.fixture(params=moeext.build_info()["cpu_isas_compiled"])
def cpu_isa(request):
    """Runs a test once per CPU instruction-set path this build has (and this CPU runs)."""
    isa = request.param
    if isa not in moeext.build_info()["cpu_isas_available"]:
        pytest.skip(f"this CPU cannot run the {isa} path")
    previous = moeext.cpu_isa()
    moeext.set_cpu_isa(isa)
    try:
        yield isa
    finally:
        moeext.set_cpu_isa(previous)
