"""Copies csrc/gpu/ for the host build of the GPU kernels (tests/gpu_emulation/), rewriting what
the stand-in runtime headers (include/) cannot define as macros:

- ``kernel<<<grid, block, shared, stream>>>(args)`` becomes
  ``::moeext_emu::Configured(grid, block, shared, stream).kernel(kernel)(args)``;
- ``extern __shared__ T name[];`` becomes a pointer to the launch's dynamic shared memory;
- each inline PTX statement becomes what it does on the host (a new one fails the build here,
  naming it, until it is taught).

Nothing else changes. Two flavours:

- ``cuda``: CUDA for sm_90 (``__CUDA_ARCH__`` 900: redux.sync, the PDL waits, the acquire-release
  count, the L2 prefetches), 32-lane warps: the code an H100 or H200 runs;
- ``hip64``: HIP for gfx9 (CDNA: MI200, MI300), 64-lane wavefronts.

``load`` builds one flavour, with the fiber runtime and harness.cpp, into a torch extension;
optionally instrumented for ThreadSanitizer (races.py).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

FLAVOURS = {
    # name: (warp size, defines of the kernels' units, defines of every unit)
    "cuda": (32, ["__CUDA_ARCH__=900"], ["MOEEXT_EMU_CUDA=1"]),
    "hip64": (64, ["__HIP_PLATFORM_AMD__=1", "__HIP_DEVICE_COMPILE__=1", "__GFX9__=1"], []),
}

LAUNCH = re.compile(r"([A-Za-z_][\w:]*(?:<[^<>;()]*>)?)<<<(.*?)>>>\(")
DYNAMIC_SHARED = re.compile(r"extern\s+__shared__\s+(\w+)\s+(\w+)\s*\[\s*\]\s*;")
INLINE_PTX = re.compile(r"\basm\s*(?:volatile\s*)?\((.*?)\);", re.S)


def _host_form(match):
    body = match.group(1)
    instruction = re.match(r'\s*"([^"]*)"', body).group(1)
    if instruction.startswith("cvt.f32.f16 "):
        out, bits = re.search(r'"=f"\((\w+)\)\s*:\s*"h"\((.*)\)\s*$', body, re.S).groups()
        return f"{out} = ::moeext_emu::half_bits_to_float({bits});"
    if instruction.startswith("atom.acq_rel.gpu.global.add.u32 "):
        out, address, value = re.search(
            r'"=r"\((\w+)\)\s*:\s*"l"\(__cvta_generic_to_global\((\w+)\)\),\s*"r"\((\w+)\)',
            body).groups()
        return f"{out} = ::moeext_emu::fetch_add_acq_rel({address}, {value});"
    if instruction.startswith("rcp.approx.ftz.f32 "):
        out, value = re.search(r'"=f"\((\w+)\)\s*:\s*"f"\((.*)\)\s*$', body, re.S).groups()
        return f"{out} = ::moeext_emu::rcp_approx_ftz({value});"
    if instruction == ("{ .reg .pred p; setp.gt.u64 p, %2, %3; selp.b64 %0, %2, %3, p; "
                       "selp.b64 %1, %3, %2, p; }"):
        larger, smaller, x, y = re.search(
            r'"=l"\((\w+)\),\s*"=l"\((\w+)\)\s*:\s*"l"\((\w+)\),\s*"l"\((\w+)\)\s*$', body,
            re.S).groups()
        return (f"{{ const bool p_ = {x} > {y}; const uint64_t x_ = {x}, y_ = {y}; "
                f"{larger} = p_ ? x_ : y_; {smaller} = p_ ? y_ : x_; }}")
    if instruction in ("griddepcontrol.wait;", "griddepcontrol.launch_dependents;"):
        return "(void)0;"  # one grid at a time: nothing to wait for, nothing to let start
    if instruction.startswith("prefetch.global.L2 "):
        address = re.search(r'"l"\((.*)\)\s*$', body, re.S).group(1)
        return f"(void)({address});"  # a hint: the address is formed, nothing is read
    raise SystemExit(f"tests/gpu_emulation/prepare.py: no host form for the inline PTX "
                     f"{instruction!r}; teach _host_form what it does")


def rewrite(text):
    text = LAUNCH.sub(r"::moeext_emu::Configured(\2).kernel(\1)(", text)
    text = DYNAMIC_SHARED.sub(
        r"\1* const \2 = static_cast<\1*>(::moeext_emu::dynamic_shared());", text)
    return INLINE_PTX.sub(_host_form, text)


def _write_if_changed(path, text):
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def prepare(source_root, build_root, defines=()):
    """Writes the rewritten copy of source_root/csrc/gpu under build_root/csrc/gpu, and a C++
    unit for each .cu file that defines `defines` (name=value) and includes it; returns the
    units' paths."""
    source = Path(source_root) / "csrc" / "gpu"
    target = Path(build_root) / "csrc" / "gpu"
    target.mkdir(parents=True, exist_ok=True)
    units = []
    for path in sorted(source.iterdir()):
        if path.suffix not in (".cu", ".h"):
            continue
        _write_if_changed(target / path.name, rewrite(path.read_text()))
        if path.suffix == ".cu":
            # A C++ unit of its own (torch's builder would hand a .cu to nvcc).
            unit = target.parent.parent / f"{path.stem}_cu.cpp"
            lines = [f"#define {d.replace('=', ' ')}" for d in defines]
            _write_if_changed(unit, "\n".join(lines + [f'#include "gpu/{path.name}"', ""]))
            units.append(unit)
    return units


def load(build_root, flavour, races=False, verbose=False):
    """The emulation's extension module for `flavour` (FLAVOURS), built under build_root (kept
    between runs: only what changed is compiled again). With `races`, every unit but the
    runtime is built for ThreadSanitizer (races.py says how such a build runs)."""
    from torch.utils import cpp_extension

    warp_size, unit_defines, defines = FLAVOURS[flavour]
    name = flavour + ("-races" if races else "")
    build_root = Path(build_root) / name
    # The kernels' units only: torch's headers, in harness.cpp, must not see a device compile.
    units = prepare(ROOT, build_root, unit_defines)
    objects = build_root / "objects"
    objects.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MAX_JOBS", "2")
    flags = ["-std=c++17", f"-DMOEEXT_EMU_WARP_SIZE={warp_size}", *[f"-D{d}" for d in defines]]
    sources = [HERE / "harness.cpp", HERE / "host.cpp"] + units
    ldflags = []
    if races:
        flags.append("-DMOEEXT_EMU_RACES=1")
        # The runtime's own bookkeeping is shared by all fibers by design: not instrumented.
        ldflags = [str(runtime_object(objects, flags)), "-fsanitize=thread"]
        flags += ["-fsanitize=thread", "-g1"]
    else:
        sources.append(HERE / "runtime.cpp")
    return cpp_extension.load(
        name="moeext_gpu_emulation_" + name.replace("-", "_"),
        sources=[str(s) for s in sources],
        extra_cflags=["-O2", *flags, f"-I{HERE / 'include'}", f"-I{build_root / 'csrc'}",
                      f"-I{ROOT / 'csrc'}", f"-I{ROOT / 'csrc' / 'include'}"],
        extra_ldflags=ldflags,
        build_directory=str(objects),
        verbose=verbose)


def runtime_object(directory, flags):
    """runtime.cpp compiled on its own, without instrumentation, into `directory` (ninja does
    not see it: a library beside it is removed so that ninja links it again). Its loops stay
    loops: a memmove there would go through ThreadSanitizer's, checked as the fiber's access."""
    target = Path(directory) / "runtime_plain.o"
    inputs = [HERE / "runtime.cpp", HERE / "runtime.h"]
    if not target.exists() or target.stat().st_mtime < max(p.stat().st_mtime for p in inputs):
        subprocess.run([os.environ.get("CXX", "c++"), "-O2", "-fPIC",
                        "-fno-tree-loop-distribute-patterns", "-c", *flags,
                        str(HERE / "runtime.cpp"), "-o", str(target)], check=True)
        for library in Path(directory).glob("*.so"):
            library.unlink()
    return target


if __name__ == "__main__":
    print(load(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "cuda", verbose=True))
