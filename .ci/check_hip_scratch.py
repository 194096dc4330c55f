"""Fails when a moeext kernel in AMDGPU assembly uses scratch (AMD's local memory).

Usage: check_hip_scratch.py FILE.s...

The device-only compile check builds without ROCm's device libraries (-nogpulib), so a call
into them (log1pf -> __ocml_log1p_f32) stays an unresolved call, and the compiler reserves a
call stack for it that a real ROCm build, which inlines the library, does not. A call frame's
worth of scratch (up to 64 bytes) in a kernel that makes such a call is reported but not
failed; anything more, or any scratch in a kernel without calls, is a spill or a local array,
and fails.
"""

import re
import sys

CALL_FRAME_BYTES = 64

LABEL = re.compile(r"^(_Z\S+):\s*(?:;.*)?$")
SCRATCH = re.compile(r"^; ScratchSize: (\d+)")


def functions(path):
    """(name, scratch bytes, makes calls) for every function in one assembly file."""
    name, body, done = None, [], []
    for line in open(path, encoding="utf-8", errors="replace"):
        if m := LABEL.match(line):
            name, body = m.group(1), []
        elif name is not None and (m := SCRATCH.match(line)):
            done.append((name, int(m.group(1)), any("s_swappc_b64" in b for b in body)))
            name = None
        elif name is not None:
            body.append(line)
    return done


def main(paths):
    failed = 0
    for path in paths:
        found = functions(path)
        for name, scratch, calls in found:
            if scratch == 0 or "moeext" not in name:
                continue
            if calls and scratch <= CALL_FRAME_BYTES:
                print(f"note: {path}: {name} reserves {scratch} B of call stack for an "
                      f"unresolved device-library call (-nogpulib)")
            else:
                print(f"SCRATCH: {path}: {name} uses {scratch} B of scratch memory")
                failed += 1
        kernels = open(path, encoding="utf-8", errors="replace").read().count(".amdhsa_kernel ")
        if kernels and not found:  # the parser no longer understands the assembly
            print(f"check_hip_scratch: {kernels} kernels in {path} but no ScratchSize read")
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
