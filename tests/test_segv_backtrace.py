"""The native-stack helper of the GPU session script (.ci/segv_backtrace.c): preloaded into a
process that then dies of SIGSEGV, it prints the faulting thread's native frames after Python's
faulthandler has printed the Python ones, and the process still dies of the signal."""

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("cc") is None,
                    reason="needs Linux and a C compiler (cc)")
def test_a_segfault_prints_its_native_stack(tmp_path):
    library = tmp_path / "segv_backtrace.so"
    subprocess.run(["cc", "-O1", "-g", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC",
                    str(ROOT / ".ci" / "segv_backtrace.c"), "-o", str(library)], check=True)
    env = dict(os.environ, LD_PRELOAD=str(library))
    # ctypes.string_at(0) reads address 0 inside _ctypes: a native frame under Python's.
    done = subprocess.run([sys.executable, "-X", "faulthandler", "-c",
                           "import ctypes; print('before', flush=True); ctypes.string_at(0)"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGSEGV, (done.returncode, done.stderr[-2000:])
    assert done.stdout == "before\n"
    err = done.stderr
    assert "Fatal Python error: Segmentation fault" in err
    begin = err.index("*** native stack (.ci/segv_backtrace.c) ***")
    end = err.index("*** end of native stack ***")
    assert err.index("Fatal Python error") < begin < end  # after faulthandler's stacks
    frames = err[begin:end].splitlines()[1:]
    assert any("_ctypes" in frame for frame in frames), frames
    assert any("libpython" in frame or "python" in frame for frame in frames), frames
