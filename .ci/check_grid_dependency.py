"""Fails when a kernel that may be launched with programmatic dependent launch (PDL) can touch
global memory before it waits for the grid before it, or when sm_80 code holds the instructions.

Usage: check_grid_dependency.py [--all] CUOBJDUMP BINARY...

With PDL a kernel may start while the previous kernel on the stream still runs, so the kernels
csrc/gpu launches through launch_dependent() (compat.h) execute griddepcontrol.wait (SASS
ACQBULK) before anything else. Reads `cuobjdump -sass` of each binary (an object, a static
library or the extension module; cuobjdump needs nvdisasm on PATH) and checks, per
architecture:
  * sm_90 and newer: in every instance of those kernels that accesses memory outside shared
    memory, ACQBULK comes before its first such access and before its first branch, call or
    exit (so every path passes it first), and griddepcontrol.launch_dependents (PREEXIT) is
    there too; each kernel family in the binary (with --all: each of them, as the extension
    module holds them all, so that a renamed kernel fails here rather than escaping the
    check) has at least one such instance;
  * older architectures: no ACQBULK or PREEXIT at all.
Instances compiled empty (another target's warp width) touch nothing and need neither.
An L2 prefetch (CCTL.E.PF2, PTX prefetch.global.L2) may come before the wait: it returns
nothing to the thread and only brings lines into L2, where the grid before stores what it
writes, so what is loaded after the wait is as current as without it (the router GEMM's
variant 1 asks for its weight rows so). An L1 prefetch (PF1) counts as an access: L1 is not
kept coherent with other multiprocessors' stores.
"""

import re
import subprocess
import sys

# The kernels launched through launch_dependent(), by the name they have in the binary.
DEPENDENT_KERNELS = ("grouped_topk_warp_kernel", "grouped_topk_block_kernel",
                     "grouped_topk_thread_kernel", "grouped_topk_gate_block_kernel",
                     "router_gemm_kernel", "fused_router_kernel", "routing_weights_kernel")

ARCH = re.compile(r"^\s*arch = sm_(\d+)")
FUNCTION = re.compile(r"^\s*Function : (\S+)")
# "/*0040*/  @!P0 LDG.E.64 R2, desc[UR4][R2.64] ;": the offset, then the opcode after any guard,
# then its modifiers.
INSTRUCTION = re.compile(
    r"^\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Z0-9_]+)*)")
# Memory outside shared memory: global and generic loads, stores, atomics, reductions, copies.
MEMORY = {"LDG", "STG", "LD", "ST", "ATOM", "ATOMG", "RED", "REDG", "REDUX_G", "LDGSTS",
          "UBLKCP", "UTMALDG", "UTMASTG", "UBLKRED", "UTMAREDG", "CCTL"}
TRANSFER = {"BRA", "BRX", "JMP", "JMX", "CALL", "RET", "EXIT", "BREAK", "BPT"}
WAIT, TRIGGER = "ACQBULK", "PREEXIT"
PREFETCH = "PREFETCH"  # CCTL.E.PF2, into L2 only: neither a memory access here nor a transfer


def functions(cuobjdump, binary):
    """(arch number, mangled name, [(offset, opcode)]) for every function in binary; an L2
    prefetch's opcode is PREFETCH."""
    text = subprocess.run([cuobjdump, "-sass", binary], capture_output=True, text=True,
                          check=True).stdout
    found, arch, current = [], None, None
    for line in text.splitlines():
        if m := ARCH.match(line):
            arch = int(m.group(1).rstrip("a").rstrip("f"))
        elif m := FUNCTION.match(line):
            current = (arch, m.group(1), [])
            found.append(current)
        elif current is not None and (m := INSTRUCTION.match(line)):
            opcode = m.group(2)
            if opcode == "CCTL" and re.search(r"\.PF2\b", m.group(3)):
                opcode = PREFETCH
            current[2].append((int(m.group(1), 16), opcode))
    return found


def family(name):
    return next((k for k in DEPENDENT_KERNELS if k in name), None)


def problems(found, require_all):
    bad, checked = [], {k: 0 for k in DEPENDENT_KERNELS}
    present = {family(name) for _, name, _ in found} - {None}
    archs = {arch for arch, _, _ in found}
    for arch, name, code in found:
        opcodes = [op for _, op in code]
        if arch < 90:
            if WAIT in opcodes or TRIGGER in opcodes:
                bad.append(f"sm_{arch} {name}: holds {WAIT}/{TRIGGER}, an sm_90+ instruction")
            continue
        kernel = family(name)
        if kernel is None or not any(op in MEMORY for op in opcodes):
            continue
        checked[kernel] += 1
        first_access = next(i for i, op in enumerate(opcodes) if op in MEMORY)
        first_transfer = next((i for i, op in enumerate(opcodes) if op in TRANSFER), len(code))
        wait = opcodes.index(WAIT) if WAIT in opcodes else None
        if wait is None or wait > first_access or wait > first_transfer:
            what = opcodes[min(first_access, first_transfer)]
            bad.append(f"sm_{arch} {name}: {WAIT} "
                       + ("missing" if wait is None else f"at {code[wait][0]:#06x}")
                       + f", after {what} at {code[min(first_access, first_transfer)][0]:#06x}")
        if TRIGGER not in opcodes:
            bad.append(f"sm_{arch} {name}: no {TRIGGER} (griddepcontrol.launch_dependents)")
    if any(arch >= 90 for arch in archs):
        for kernel, count in checked.items():
            if count == 0 and (require_all or kernel in present):
                bad.append(f"no instance of {kernel} that touches memory found for sm_90+")
    return bad, checked, sorted(archs)


def main(argv):
    require_all = "--all" in argv
    argv = [a for a in argv if a != "--all"]
    if len(argv) < 3:
        sys.exit(__doc__)
    cuobjdump, binaries = argv[1], argv[2:]
    failed = False
    for binary in binaries:
        bad, checked, archs = problems(functions(cuobjdump, binary), require_all)
        summary = ", ".join(f"{k} {n}" for k, n in checked.items())
        print(f"{binary}: sm_{', sm_'.join(map(str, archs))}; waiting instances checked: "
              f"{summary}")
        for line in bad:
            print(f"  {line}")
        failed |= bool(bad)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main(sys.argv)
