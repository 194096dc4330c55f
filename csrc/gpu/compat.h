// The one place where CUDA and HIP differ for moeext's kernels. Every .cu under csrc/gpu/
// includes this instead of a runtime header, and the same sources build with nvcc or as HIP
// (hipcc, or clang -x hip).
#pragma once

#include <cstdint>

#include "moeext/common.h"

// Only the runtime header: the 16-bit float types are moeext's own below, so the sources
// need neither cuda_bf16.h nor hip_bf16.h (the HIP headers that ship with triton, used for
// the device-only compile check, have no hip_bf16.h).
#if defined(__HIPCC__) || defined(__HIP_PLATFORM_AMD__)
#define MOEEXT_HIP 1
#include <hip/hip_runtime.h>
#else
#include <cuda_runtime.h>
#endif

#include "gpu/numeric.h"

namespace moeext::gpu {

#if defined(MOEEXT_HIP)
using Stream = hipStream_t;
using Error = hipError_t;
constexpr Error kSuccess = hipSuccess;
inline Error last_error() { return hipGetLastError(); }
inline const char* error_string(Error e) { return hipGetErrorString(e); }
inline Error current_device(int* device) { return hipGetDevice(device); }
inline Error device_attribute(int* value, hipDeviceAttribute_t attr, int device) {
  return hipDeviceGetAttribute(value, attr, device);
}
constexpr hipDeviceAttribute_t kAttrWarpSize = hipDeviceAttributeWarpSize;
constexpr hipDeviceAttribute_t kAttrMultiprocessorCount = hipDeviceAttributeMultiprocessorCount;
inline Error memset_async(void* dst, int value, size_t bytes, Stream stream) {
  return hipMemsetAsync(dst, value, bytes, stream);
}
inline Error device_malloc(void** ptr, size_t bytes) { return hipMalloc(ptr, bytes); }
inline Error stream_synchronize(Stream stream) { return hipStreamSynchronize(stream); }
// Whether `stream` is capturing a graph (an invalidated capture counts), and the capture's id.
inline Error stream_capture(Stream stream, bool* capturing, unsigned long long* id) {
  hipStreamCaptureStatus status = hipStreamCaptureStatusNone;
  const Error e = hipStreamGetCaptureInfo(stream, &status, id);
  *capturing = status != hipStreamCaptureStatusNone;
  return e;
}
#else
using Stream = cudaStream_t;
using Error = cudaError_t;
constexpr Error kSuccess = cudaSuccess;
inline Error last_error() { return cudaGetLastError(); }
inline const char* error_string(Error e) { return cudaGetErrorString(e); }
inline Error current_device(int* device) { return cudaGetDevice(device); }
inline Error device_attribute(int* value, cudaDeviceAttr attr, int device) {
  return cudaDeviceGetAttribute(value, attr, device);
}
constexpr cudaDeviceAttr kAttrWarpSize = cudaDevAttrWarpSize;
constexpr cudaDeviceAttr kAttrMultiprocessorCount = cudaDevAttrMultiProcessorCount;
inline Error memset_async(void* dst, int value, size_t bytes, Stream stream) {
  return cudaMemsetAsync(dst, value, bytes, stream);
}
inline Error device_malloc(void** ptr, size_t bytes) { return cudaMalloc(ptr, bytes); }
inline Error stream_synchronize(Stream stream) { return cudaStreamSynchronize(stream); }
inline Error stream_capture(Stream stream, bool* capturing, unsigned long long* id) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const Error e = cudaStreamGetCaptureInfo(stream, &status, id);
  *capturing = status != cudaStreamCaptureStatusNone;
  return e;
}
#endif

// The launcher API passes streams as void* so that it needs no GPU header.
inline Stream as_stream(void* stream) { return static_cast<Stream>(stream); }

// nullptr after a good launch, else the runtime's message (the launcher API's GpuError).
inline GpuError launch_status() {
  const Error e = last_error();
  return e == kSuccess ? nullptr : error_string(e);
}

// Warp (wavefront) width. On the device it is a compile-time constant of the target: 32 on
// NVIDIA and on RDNA, 64 on CDNA (gfx90a, gfx942). The host must never assume one: it asks
// the device (warp_size_of_current_device) and picks the kernel instance for that width.
#if defined(MOEEXT_HIP) && defined(__HIP_DEVICE_COMPILE__)
#if defined(__GFX9__)
#define MOEEXT_DEVICE_WARP_SIZE 64
#else
#define MOEEXT_DEVICE_WARP_SIZE 32
#endif
#else
#define MOEEXT_DEVICE_WARP_SIZE 32
#endif

// Lane masks are 64-bit on HIP (wave64) and 32-bit on CUDA.
#if defined(MOEEXT_HIP)
using LaneMask = uint64_t;
#else
using LaneMask = uint32_t;
#endif

// Butterfly shuffle across the whole warp. HIP's __shfl_xor takes no mask (every lane of the
// wavefront takes part); CUDA's needs the full 32-lane mask.
template <typename T>
__device__ __forceinline__ T shfl_xor(T value, int lane_mask) {
#if defined(MOEEXT_HIP)
  return __shfl_xor(value, lane_mask);
#else
  return __shfl_xor_sync(0xffffffffu, value, lane_mask);
#endif
}

template <typename T>
__device__ __forceinline__ T shfl(T value, int src_lane) {
#if defined(MOEEXT_HIP)
  return __shfl(value, src_lane);
#else
  return __shfl_sync(0xffffffffu, value, src_lane);
#endif
}

// CUDA sm_80 and later reduce a 32-bit integer over the warp in one instruction (redux.sync);
// a butterfly of shuffles is five dependent round trips. Defined only where it exists.
#if !defined(MOEEXT_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define MOEEXT_HAS_WARP_REDUX 1
__device__ __forceinline__ uint32_t warp_reduce_max(uint32_t value) {
  return __reduce_max_sync(0xffffffffu, value);
}
__device__ __forceinline__ uint32_t warp_reduce_min(uint32_t value) {
  return __reduce_min_sync(0xffffffffu, value);
}
#endif

// Bit i set for each lane i whose predicate holds (LaneMask wide).
__device__ __forceinline__ LaneMask ballot(bool predicate) {
#if defined(MOEEXT_HIP)
  return __ballot(predicate);
#else
  return __ballot_sync(0xffffffffu, predicate);
#endif
}

__device__ __forceinline__ float to_float(fp16 x) {
#if defined(MOEEXT_HIP)
  return float(__builtin_bit_cast(_Float16, x.bits));
#else
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
  return f;
#endif
}

// Host-side warp width of the current device, asked once per device and cached; 0 where the
// device cannot be asked (the launchers then refuse).
int warp_size_of_current_device();
int multiprocessor_count_of_current_device();

// *counter += value at device scope with acquire-release order; returns the old value. A
// release is cumulative: stores of the block's other threads that a __syncthreads() ordered
// before it are published with it, and a __syncthreads() after the acquire orders the other
// threads' loads after it (what cooperative groups' grid sync relies on).
__device__ __forceinline__ unsigned fetch_add_acq_rel(unsigned* counter, unsigned value) {
#if defined(MOEEXT_HIP)
  return __hip_atomic_fetch_add(counter, value, __ATOMIC_ACQ_REL, __HIP_MEMORY_SCOPE_AGENT);
#elif defined(__CUDA_ARCH__)
  unsigned old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;"
               : "=r"(old)
               : "l"(__cvta_generic_to_global(counter)), "r"(value)
               : "memory");
  return old;
#else
  __threadfence();
  const unsigned old = atomicAdd(counter, value);
  __threadfence();
  return old;
#endif
}

// ---- Programmatic dependent launch (moeext/common.h) --------------------------------------
// A kernel launched with launch_dependent() may start while the grid before it on the stream
// is still running, so it calls wait_for_prior_grids() before its first global memory access
// of any kind: a read of what that grid writes, and a write over what it reads or writes too.
// Both device functions are CUDA sm_90+ instructions; on older targets and on HIP they compile
// to nothing, and without the launch attribute they return at once, so one kernel instance
// serves both modes.
__device__ __forceinline__ void wait_for_prior_grids() {
#if !defined(MOEEXT_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the next grid on the stream be scheduled once every block of this one has called it
// (or exited). Called first thing: the next grid's own wait_for_prior_grids() still waits for
// this whole grid to finish and its writes to be visible, so an early call only lets its
// launch and prologue overlap this grid's work.
__device__ __forceinline__ void allow_dependent_grids() {
#if !defined(MOEEXT_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// Whether launch_dependent launches with programmatic stream serialization now: the setting
// is on and gpu_programmatic_dependent_launch_supported(); never on HIP.
inline bool launches_programmatic() {
#if !defined(MOEEXT_HIP)
  return gpu_programmatic_dependent_launch() && gpu_programmatic_dependent_launch_supported();
#else
  return false;
#endif
}

// Launches kernel<<<grid, block, smem_bytes, stream>>>(args...), with programmatic stream
// serialization where launches_programmatic().
// Only for kernels that call wait_for_prior_grids() before touching global memory.
template <typename... Params, typename... Args>
GpuError launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes,
                          Stream stream, Args... args) {
#if !defined(MOEEXT_HIP)
  if (launches_programmatic()) {
    cudaLaunchAttribute attribute[1];
    attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config = {};
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = smem_bytes;
    config.stream = stream;
    config.attrs = attribute;
    config.numAttrs = 1;
    const Error e = cudaLaunchKernelEx(&config, kernel, args...);
    if (e != kSuccess) {
      (void)last_error();  // reported here, not again by the next launch
      return error_string(e);
    }
    return launch_status();
  }
#endif
  kernel<<<grid, block, smem_bytes, stream>>>(args...);
  return launch_status();
}

}  // namespace moeext::gpu
