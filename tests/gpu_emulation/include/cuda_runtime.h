// What csrc/gpu/ uses of the CUDA runtime header, on the host (tests/gpu_emulation/): the
// kernels build as CUDA for sm_90 (prepare.py defines __CUDA_ARCH__ 900 and rewrites the inline
// PTX) with emulated_gpu.h's device side, the CUDA names of its intrinsics and the host calls
// below (cuda_host.cpp). Programmatic dependent launch runs as a plain launch: one grid at a
// time, its wait has nothing to wait for.
#pragma once

#include <cstdio>
#include <cstdlib>

#include "emulated_gpu.h"

namespace moeext_emu {

// The sync intrinsics' masks: every kernel here passes the full warp.
inline void full_mask(unsigned mask, const char* intrinsic) {
  if (mask != 0xffffffffu) record_error(std::string(intrinsic) + " with a partial lane mask");
}

// fp16 bits to float, as cvt.f32.f16 (exact).
inline float half_bits_to_float(uint16_t bits) {
  return float(__builtin_bit_cast(_Float16, bits));
}

// rcp.approx.ftz.f32: the correctly rounded reciprocal (within the instruction's error), a
// subnormal input or result flushed to a zero of its sign as .ftz does; so the Newton step
// after it (reciprocal_in_range) gives 0 or NaN where the IEEE division gives a subnormal or 0,
// as on the GPU.
inline float rcp_approx_ftz(float x) {
  if (std::fpclassify(x) == FP_SUBNORMAL) x = std::copysign(0.0f, x);
  const float r = 1.0f / x;
  return std::fpclassify(r) == FP_SUBNORMAL ? std::copysign(0.0f, r) : r;
}

}  // namespace moeext_emu

template <typename T>
T __shfl_xor_sync(unsigned mask, T value, int lane_mask) {
  ::moeext_emu::full_mask(mask, "__shfl_xor_sync");
  return ::moeext_emu::shuffle_from(value, ::moeext_emu::lane_id() ^ lane_mask);
}

template <typename T>
T __shfl_sync(unsigned mask, T value, int source) {
  ::moeext_emu::full_mask(mask, "__shfl_sync");
  return ::moeext_emu::shuffle_from(value, source);
}

inline unsigned __ballot_sync(unsigned mask, int predicate) {
  ::moeext_emu::full_mask(mask, "__ballot_sync");
  return unsigned(::moeext_emu::warp_ballot(predicate != 0));
}

inline void __syncwarp(unsigned mask = 0xffffffffu) {
  ::moeext_emu::full_mask(mask, "__syncwarp");
  ::moeext_emu::sync_warp();
}

inline unsigned __reduce_max_sync(unsigned mask, unsigned value) {
  ::moeext_emu::full_mask(mask, "__reduce_max_sync");
  unsigned all[64];
  ::moeext_emu::warp_values(value, all);
  return *std::max_element(all, all + ::moeext_emu::settings().warp_size);
}

inline unsigned __reduce_min_sync(unsigned mask, unsigned value) {
  ::moeext_emu::full_mask(mask, "__reduce_min_sync");
  unsigned all[64];
  ::moeext_emu::warp_values(value, all);
  return *std::min_element(all, all + ::moeext_emu::settings().warp_size);
}

template <typename T>
T __ldg(const T* p) {
  return *p;
}

// ---- host API -------------------------------------------------------------------------------

using cudaStream_t = struct CUstream_st*;
enum cudaError { cudaSuccess = 0, cudaErrorLaunchFailure = 719 };
using cudaError_t = cudaError;
enum cudaDeviceAttr {
  cudaDevAttrWarpSize,
  cudaDevAttrMultiProcessorCount,
  cudaDevAttrComputeCapabilityMajor,
};
enum cudaStreamCaptureStatus { cudaStreamCaptureStatusNone = 0, cudaStreamCaptureStatusActive };

struct cudaFuncAttributes {
  int ptxVersion = 0;
};

enum cudaLaunchAttributeID { cudaLaunchAttributeProgrammaticStreamSerialization = 6 };
struct cudaLaunchAttribute {
  cudaLaunchAttributeID id;
  struct {
    unsigned programmaticStreamSerializationAllowed;
  } val;
};
struct cudaLaunchConfig_t {
  dim3 gridDim;
  dim3 blockDim;
  size_t dynamicSmemBytes;
  cudaStream_t stream;
  cudaLaunchAttribute* attrs;
  unsigned numAttrs;
};

cudaError_t cudaGetLastError();
const char* cudaGetErrorString(cudaError_t error);
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attribute, int device);
cudaError_t cudaMemsetAsync(void* dst, int value, size_t bytes, cudaStream_t stream);
cudaError_t cudaMalloc(void** ptr, size_t bytes);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaStreamGetCaptureInfo(cudaStream_t stream, cudaStreamCaptureStatus* status,
                                     unsigned long long* id);

// The code this build runs is sm_90's (prepare.py's __CUDA_ARCH__).
template <typename Kernel>
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attributes, Kernel /*kernel*/) {
  attributes->ptxVersion = 90;
  return cudaSuccess;
}

// Counts the launches made with the programmatic-serialization attribute.
extern long moeext_emu_programmatic_launches;

template <typename... Params, typename... Args>
cudaError_t cudaLaunchKernelEx(const cudaLaunchConfig_t* config, void (*kernel)(Params...),
                               Args... args) {
  for (unsigned i = 0; i < config->numAttrs; ++i) {
    if (config->attrs[i].id == cudaLaunchAttributeProgrammaticStreamSerialization &&
        config->attrs[i].val.programmaticStreamSerializationAllowed) {
      ++moeext_emu_programmatic_launches;
    }
  }
  ::moeext_emu::Configured(config->gridDim, config->blockDim, config->dynamicSmemBytes)
      .kernel(kernel)(args...);
  return cudaSuccess;
}
