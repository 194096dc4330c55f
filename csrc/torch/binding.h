// What the binding files of the ops (csrc/torch/ops/*.cpp) share: the two devices an
// implementation is written for, output allocation, the dtype map, and typed dispatcher
// handles. Each op's implementation is one function template over the device, registered
// under torch's CPU key as <Cpu> and under its CUDA key (which ROCm torch uses for HIP tensors
// too) as <Gpu>; what differs between the two is the device's launch, an overload per device.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>

#include <string_view>

#include "moeext/common.h"
#include "torch/check_messages.h"
#include "torch/cpu_memory.h"

#if defined(MOEEXT_GPU_BACKEND)
#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#endif

namespace moeext::torch_glue {

// float32, bfloat16 or float16, or an error naming the argument.
inline DType to_moeext_dtype(const at::Tensor& t, const char* op, const char* arg) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kBFloat16:
      return DType::kBFloat16;
    case at::kHalf:
      return DType::kFloat16;
    default:
      TORCH_CHECK(false, kFloatDtype({{"op", op}, {"arg", arg}, {"dtype", t.scalar_type()}}));
  }
}

inline std::string_view as_std(c10::string_view s) { return {s.data(), s.size()}; }

// Both tensors on one device, or an error naming the first.
inline void check_same_device(const at::Tensor& t, const char* arg, const at::Tensor& other,
                              const char* other_name, const char* op) {
  TORCH_CHECK(t.device() == other.device(),
              kSameDevice({{"op", op}, {"arg", arg}, {"device", t.device()},
                           {"other", other_name}, {"other_device", other.device()}}));
}

// The op's typed handle; callers keep it in a function-local static (one lookup per program).
template <typename Signature>
c10::TypedOperatorHandle<Signature> typed_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// The CPU implementations.
struct Cpu {
  static void check_device(const at::Tensor& t, const char* op, const char* arg) {
    TORCH_CHECK(t.device().is_cpu(), op, ": ", arg, " must be a CPU tensor here, got ",
                t.device());
  }
  // Contiguous, without at::empty's trip through the dispatcher (about a tenth of a
  // decode-sized routing call, which allocates two outputs); cpu_memory.h says from where.
  static at::Tensor empty(at::IntArrayRef sizes, at::ScalarType dtype, const at::Tensor& /*like*/) {
    return empty_cpu_output(sizes, dtype);
  }
};

#if defined(MOEEXT_GPU_BACKEND)
// The GPU implementations. Host C++ only, no GPU runtime header: the stream and the device
// guard come through c10's device-generic interfaces, so this compiles against any torch,
// a CPU-only one included (MOEEXT_FORCE_CUDA=1), where it is registered but never reached.
struct Gpu {
  static void check_device(const at::Tensor& t, const char* op, const char* arg) {
    TORCH_CHECK(t.device().is_cuda(), op, ": ", arg, " must be a CUDA tensor here, got ",
                t.device());
  }
  static at::Tensor empty(at::IntArrayRef sizes, at::ScalarType dtype, const at::Tensor& like) {
    return at::empty(sizes, like.options().dtype(dtype));
  }
  // The stream torch would launch on for t's device (cudaStream_t / hipStream_t as void*).
  static void* stream(const at::Tensor& t) {
    const c10::Device device = t.device();
    return c10::impl::getDeviceGuardImpl(device.type())->getStream(device).native_handle();
  }
  static void check_launch(GpuError error, const char* op) {
    TORCH_CHECK(error == nullptr, op, ": CUDA kernel launch failed: ", error);
  }
};
#endif

}  // namespace moeext::torch_glue
