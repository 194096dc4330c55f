// moeext._C: importing it loads the TORCH_LIBRARY registrations of this shared library. The
// functions here are about the build, the CPU paths and the GPU launch mode, the check
// messages the fakes share with the kernels, and the direct calls of the per-step ops'
// wrappers (ops/*.cpp).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "moeext/common.h"
#include "torch/check_messages.h"
#include "torch/direct_call.h"

namespace py = pybind11;

namespace {

moeext::CpuIsa parse_isa(const std::string& name) {
  if (name == "auto") return moeext::CpuIsa::kAuto;
  // "scalar": the portable path's name before 2026-11-28.
  if (name == "portable" || name == "scalar") return moeext::CpuIsa::kPortable;
  if (name == "avx2") return moeext::CpuIsa::kAvx2;
  if (name == "avx512") return moeext::CpuIsa::kAvx512;
  if (name == "avx512bf16") return moeext::CpuIsa::kAvx512Bf16;
  throw py::value_error(
      "set_cpu_isa: isa must be 'auto', 'portable', 'avx2', 'avx512' or 'avx512bf16', got '" + name +
      "'");
}

std::vector<std::string> compiled_isas() {
  std::vector<std::string> isas{"portable"};  // best last
#if defined(MOEEXT_HAVE_AVX2)
  isas.emplace_back("avx2");
#endif
#if defined(MOEEXT_HAVE_AVX512)
  isas.emplace_back("avx512");
#endif
#if defined(MOEEXT_HAVE_AVX512BF16)
  isas.emplace_back("avx512bf16");
#endif
  return isas;
}

std::vector<std::string> available_isas() {
  std::vector<std::string> isas;
  for (const std::string& name : compiled_isas()) {
    if (moeext::cpu_isa_supported(parse_isa(name))) isas.push_back(name);
  }
  return isas;
}

// A developers' A/B switch (moeext/common.h): refuses a variant outside [0, count), naming it.
int checked_variant(const char* setter, int variant, int count) {
  if (variant < 0 || variant >= count) {
    throw py::value_error(std::string(setter) + ": variant must be 0 (the current kernel) to " +
                          std::to_string(count - 1) + ", got " + std::to_string(variant));
  }
  return variant;
}

// Binds one such switch as `name`: set(variant) once it is checked, returning the previous one.
void def_variant_switch(py::module_& m, const char* name, int (*set)(int), int count,
                        const char* doc) {
  m.def(
      name, [name, set, count](int variant) { return set(checked_variant(name, variant, count)); },
      py::arg("variant"), doc);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "moeext native library: registers torch.ops.moeext.* on import";
  m.def("build_info", [] {
    py::dict info;
    info["torch_version"] = MOEEXT_TORCH_VERSION;
    info["compiler"] = MOEEXT_CXX_COMPILER;  // CMake's id and version: "GNU 12.2.0"
#if defined(MOEEXT_GPU_BACKEND)
    // "cuda" for both CUDA and HIP builds: torch calls HIP devices "cuda" as well.
    info["backends"] = std::vector<std::string>{"cpu", "cuda"};
    info["gpu_backend"] = MOEEXT_GPU_BACKEND;
    info["gpu_architectures"] = MOEEXT_GPU_ARCHS;
#else
    info["backends"] = std::vector<std::string>{"cpu"};
    info["gpu_backend"] = py::none();
    info["gpu_architectures"] = "";
#endif
    info["cpu_isas_compiled"] = compiled_isas();
    info["cpu_isas_available"] = available_isas();
    info["cpu_isa_best"] = moeext::cpu_isa_name(moeext::cpu_isa_best());
    info["cpu_isa_active"] = moeext::cpu_isa_name(moeext::cpu_isa_active());
    return info;
  }, "What this build of moeext contains: backends, CPU instruction-set paths, torch version,\n"
     "compiler.");
  m.def("cpu_isa", [] { return std::string(moeext::cpu_isa_name(moeext::cpu_isa_active())); },
        "The instruction-set path the CPU kernels use now.");
  m.def(
      "set_cpu_isa",
      [](const std::string& name) {
        const moeext::CpuIsa isa = parse_isa(name);
        if (!moeext::set_cpu_isa(isa)) {
          throw py::value_error("set_cpu_isa: '" + name +
                                "' is not available in this build or on this CPU");
        }
      },
      py::arg("isa"),
      "Forces the CPU kernels onto one instruction-set path ('portable', 'avx2', 'avx512', 'avx512bf16') "
      "or back to the best available ('auto').");
  m.def("programmatic_dependent_launch",
        [] { return moeext::gpu_programmatic_dependent_launch(); },
        "Whether the decode-path GPU kernels launch with programmatic dependent launch.");
  m.def("set_programmatic_dependent_launch",
        [](bool enabled) { return moeext::set_gpu_programmatic_dependent_launch(enabled); },
        py::arg("enabled"), "Sets whether the decode-path GPU kernels launch with programmatic\n"
        "dependent launch; returns the previous setting.");
  def_variant_switch(
      m, "_set_gpu_routing_variant", &moeext::set_gpu_routing_variant,
      moeext::kGpuRoutingVariants,
      "Developers' A/B switch: which warp kernel the GPU routing calls run, 0 (the\n"
      "current one) or a variant of the same bits; returns the previous one.");
  def_variant_switch(
      m, "_set_gpu_router_gemm_variant", &moeext::set_gpu_router_gemm_variant,
      moeext::kGpuRouterGemmVariants,
      "Developers' A/B switch: which small-T router GEMM kernel (and plain fused router\n"
      "kernel) GPU calls run, 0 (the current one) or a variant of the same bits; returns the\n"
      "previous one.");
  def_variant_switch(
      m, "_set_gpu_fused_router_variant", &moeext::set_gpu_fused_router_variant,
      moeext::kGpuFusedRouterVariants,
      "Developers' A/B switch: how GPU fused_router calls run, 0 (the current way: the two\n"
      "kernels) or the one launch, 1 (blocks counted after fences) or 2 (counted with one\n"
      "acquire-release atomic), the same bits; returns the previous one.");
  m.def("programmatic_dependent_launch_supported", [] {
#if defined(MOEEXT_GPU_BACKEND)
    return moeext::gpu_programmatic_dependent_launch_supported();
#else
    return false;
#endif
  }, "Whether kernels launched now on the current GPU would use programmatic dependent launch\n"
     "when it is on (a CUDA device of compute capability 9.0+ running this build's sm_90+ code).");
  m.def("check_messages", [] {
    py::dict messages;
    for (const auto* message : moeext::torch_glue::registered_check_messages()) {
      messages[message->key] = message->text;
    }
    return messages;
  }, "The texts of the errors an op's checks and its fake both raise, by key; fields in braces\n"
     "(str.format).");
  for (const PyMethodDef& def : moeext::torch_glue::direct_call_methods()) {
    PyObject* function =
        PyCFunction_NewEx(const_cast<PyMethodDef*>(&def), nullptr, m.attr("__name__").ptr());
    if (function == nullptr) throw py::error_already_set();
    m.add_object(def.ml_name, py::reinterpret_steal<py::object>(function));
  }
}
