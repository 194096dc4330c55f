"""Runs a test's work in a fresh Python process, so that a crash there (a segfault in a library
the test drives) fails that test instead of ending the whole run.

The child gets this process's ``sys.path``, so it imports moeext from wherever the tests do
(the in-place build through PYTHONPATH, or an installed wheel), and its environment, so the
per-build compile cache conftest.py chose is shared. ``-X faulthandler`` makes a crashing child
print its Python stack, which the failure message ends with.
"""

import signal
import subprocess
import sys

import pytest

_CHILD = """\
import importlib.util, sys
sys.path[:] = {path!r}
spec = importlib.util.spec_from_file_location({module!r}, {file!r})
module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
module.{function}(*{args!r})
"""


def _signal_name(number):
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def run_in_child_process(what, function, *args, timeout=600):
    """Calls ``function(*args)`` (a module-level function; its arguments plain literals) in a
    child Python, and fails the test naming ``what`` if the child crashes or raises."""
    module = sys.modules[function.__module__]
    code = _CHILD.format(path=sys.path, module=module.__name__, file=module.__file__,
                         function=function.__name__, args=args)
    child = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code],
                           capture_output=True, text=True, timeout=timeout)
    stderr = child.stderr[-4000:]
    if child.returncode < 0:
        pytest.fail(f"{what} crashed the child process with {_signal_name(-child.returncode)};"
                    f" the end of its stderr:\n{stderr}", pytrace=False)
    if child.returncode != 0:
        pytest.fail(f"{what} failed in the child process (exit {child.returncode}); the end of"
                    f" its stderr:\n{stderr}", pytrace=False)
