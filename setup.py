"""Builds moeext._C with CMake + Ninja against the torch installed in this environment.

Environment:
  MAX_JOBS            parallel compile jobs (default: all cores)
  MOEEXT_BUILD_TYPE   CMake build type (default Release)
  MOEEXT_FORCE_CUDA   1: build the CUDA kernels even on a CPU-only torch (needs nvcc); the
                      extension links the static CUDA runtime and still imports without a GPU.
                      0: never build GPU kernels. Unset: build them when torch has CUDA (and
                      nvcc is found) or ROCm.
  MOEEXT_CUDA_ARCHS   CUDA architectures, CMake syntax (default "80;90a;100a")
  MOEEXT_HIP_ARCHS    AMD architectures (default "gfx90a;gfx942")
  MOEEXT_CPU_ISAS     x86-64 CPU paths built besides the portable one (default "avx2;avx512;avx512bf16";
                      "" builds the portable path only, for a quicker build that runs no CPU
                      kernel, such as the GPU checks)
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent.resolve()

try:
    import torch
except ImportError as exc:  # pragma: no cover - exercised only by a broken install command
    raise SystemExit(
        "moeext builds against the torch already installed, and none is importable here.\n"
        "Install torch first (CPU build: pip install torch==2.13.0), then build without\n"
        "isolation so pip does not fetch a different torch: pip install --no-build-isolation ."
    ) from exc


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


def _nvcc():
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and (Path(cuda_home) / "bin" / "nvcc").exists():
        return str(Path(cuda_home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def gpu_cmake_args():
    """The CMake switches for the GPU kernels this torch and machine call for. Every switch
    is passed explicitly, so a reused build directory never keeps a previous choice."""
    cpu_only = ["-DMOEEXT_BUILD_CUDA=OFF", "-DMOEEXT_BUILD_HIP=OFF"]
    force = os.environ.get("MOEEXT_FORCE_CUDA", "")
    if force == "0":
        return cpu_only
    if getattr(torch.version, "hip", None) and force != "1":
        archs = os.environ.get("MOEEXT_HIP_ARCHS", "gfx90a;gfx942")
        return ["-DMOEEXT_BUILD_CUDA=OFF", "-DMOEEXT_BUILD_HIP=ON",
                f"-DCMAKE_HIP_ARCHITECTURES={archs}"]
    nvcc = _nvcc()
    if force == "1" and nvcc is None:
        raise SystemExit("MOEEXT_FORCE_CUDA=1 but no nvcc: put it on PATH or set CUDA_HOME")
    if force != "1" and not torch.version.cuda:
        return cpu_only
    if nvcc is None:
        print("moeext: torch has CUDA but no nvcc was found; building the CPU kernels only "
              "(torch's CMake config still looks for a CUDA toolkit)", file=sys.stderr)
        return cpu_only
    archs = os.environ.get("MOEEXT_CUDA_ARCHS", "80;90a;100a")
    return ["-DMOEEXT_BUILD_CUDA=ON", "-DMOEEXT_BUILD_HIP=OFF", f"-DCMAKE_CUDA_COMPILER={nvcc}",
            f"-DCMAKE_CUDA_ARCHITECTURES={archs}"]


def cpu_isa_cmake_args():
    """MOEEXT_CPU_ISAS as given, else unset, so that a reused build directory falls back to
    CMakeLists.txt's default rather than keeping a previous choice."""
    isas = os.environ.get("MOEEXT_CPU_ISAS")
    if isas is None:
        return ["-UMOEEXT_CPU_ISAS"]
    return ["-DMOEEXT_CPU_ISAS=" + isas.replace(",", ";")]


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        import pybind11

        out_dir = Path(self.get_ext_fullpath(ext.name)).parent.resolve()
        build_dir = Path(self.build_temp).resolve() / ext.name
        build_dir.mkdir(parents=True, exist_ok=True)
        build_type = os.environ.get("MOEEXT_BUILD_TYPE", "Release")
        cmake_args = [
            "-G", "Ninja",
            f"-DCMAKE_BUILD_TYPE={build_type}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path};{pybind11.get_cmake_dir()}",
            f"-DMOEEXT_TORCH_HAS_CUDA={'ON' if torch.version.cuda else 'OFF'}",
            *gpu_cmake_args(),
            *cpu_isa_cmake_args(),
        ]
        try:
            import ninja

            cmake_args.append(f"-DCMAKE_MAKE_PROGRAM={Path(ninja.BIN_DIR) / 'ninja'}")
        except ImportError:
            pass
        jobs = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 1)
        subprocess.run(["cmake", str(ROOT), *cmake_args], cwd=build_dir, check=True)
        subprocess.run(
            ["cmake", "--build", ".", "--target", "_C", "-j", jobs], cwd=build_dir, check=True
        )


torch_version = torch.__version__.split("+")[0]


def version() -> str:
    """0.1.0 with, for anything compiled, the torch it compiles against as a PEP 440 local
    label: "0.1.0+torch2.13.cpu", "0.1.0+torch2.11.cu130", "0.1.0+torch2.9.rocm6.4", so that a
    wheel's name says which torch it needs (that release's C++ ABI, that CUDA or ROCm runtime).
    An sdist is source for any torch and keeps the plain version."""
    if "sdist" in sys.argv[1:]:  # `python setup.py sdist` and PEP 517's build_sdist alike
        return "0.1.0"
    major_minor = ".".join(torch_version.split(".")[:2])
    if torch.version.cuda:
        build = "cu" + torch.version.cuda.replace(".", "")
    elif getattr(torch.version, "hip", None):
        build = "rocm" + ".".join(torch.version.hip.split(".")[:2])
    else:
        build = "cpu"
    return f"0.1.0+torch{major_minor}.{build}"


setup(
    name="moeext",
    version=version(),
    description="Routing and weight-preparation kernels for Mixture-of-Experts models",
    long_description=(ROOT / "README.md").read_text() if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    # Every torch moeext has been built against (2.9.1 to 2.15.0) needs Python 3.10 or newer.
    python_requires=">=3.10",
    package_dir={"": "python"},
    packages=find_packages("python"),
    ext_modules=[CMakeExtension("moeext._C")],
    cmdclass={"build_ext": CMakeBuild},
    # The binary is built against this torch's C++ ABI; the installed torch (whatever its
    # local build tag, +cpu or +cuXXX) already satisfies the pin, so nothing is downloaded.
    install_requires=[f"torch=={torch_version}"],
    extras_require={"test": ["pytest", "hypothesis", "numpy"]},
    zip_safe=False,
)
