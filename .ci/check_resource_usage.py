"""Fails when a moeext GPU kernel uses local memory (a spill, or a stack frame).

Usage: check_resource_usage.py CUOBJDUMP BINARY...

Reads `cuobjdump --dump-resource-usage` of each binary (an object, a static library or the
extension module), prints one line per kernel and architecture (registers, stack, local and
shared bytes), and exits 1 if any kernel in the moeext namespace has STACK or LOCAL > 0:
every moeext kernel is on a hot path, and local memory there is a spill to DRAM-backed memory.
"""

import re
import shutil
import subprocess
import sys

FUNCTION = re.compile(r"^\s*Function (\S+):\s*$")
ARCH = re.compile(r"^arch = (\S+)")
USAGE = re.compile(r"(\w+(?:\[\d+\])?):(\d+)")


def demangle(names):
    if not names or shutil.which("c++filt") is None:
        return {n: n for n in names}
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True,
                         check=True).stdout.splitlines()
    return dict(zip(names, out))


def kernels(cuobjdump, binary):
    """(arch, mangled name, {field: value}) for every function in binary."""
    text = subprocess.run([cuobjdump, "--dump-resource-usage", binary], capture_output=True,
                          text=True, check=True).stdout
    arch, name, found = None, None, []
    for line in text.splitlines():
        if m := ARCH.match(line):
            arch = m.group(1)
        elif m := FUNCTION.match(line):
            name = m.group(1)
        elif name is not None and "REG:" in line:
            found.append((arch, name, {k: int(v) for k, v in USAGE.findall(line)}))
            name = None
    return found


def main(argv):
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    cuobjdump, binaries = argv[1], argv[2:]
    rows = [row for binary in binaries for row in kernels(cuobjdump, binary)]
    names = demangle(sorted({name for _, name, _ in rows}))
    ours = [(arch, names[name], usage) for arch, name, usage in rows if "moeext" in names[name]]
    if not ours:
        print("check_resource_usage: no moeext kernels found in " + ", ".join(binaries))
        return 1
    bad = 0
    for arch, name, usage in sorted(ours, key=lambda r: (r[1], r[0])):
        spills = usage.get("STACK", 0) > 0 or usage.get("LOCAL", 0) > 0
        bad += spills
        short = name if len(name) <= 110 else name[:107] + "..."
        print(f"{'SPILL' if spills else 'ok   '} {arch:8} REG:{usage.get('REG', 0):3} "
              f"STACK:{usage.get('STACK', 0):5} LOCAL:{usage.get('LOCAL', 0):5} "
              f"SHARED:{usage.get('SHARED', 0):6}  {short}")
    print(f"check_resource_usage: {len(ours)} kernel builds, {bad} with local memory")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
