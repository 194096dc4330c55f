// What csrc/gpu/ uses of the HIP runtime header, on the host (tests/gpu_emulation/runtime.h):
// the kernels build as HIP (compat.h's MOEEXT_HIP paths) with the keywords, intrinsics and
// host calls below. tests/gpu_emulation/prepare.py rewrites the two constructs a macro
// cannot: kernel<<<...>>>(args) and extern __shared__ arrays.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../../runtime.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
// Blocks run one after another on one host thread: a static is the block's shared memory.
#define __shared__ static

#define __HIP_MEMORY_SCOPE_AGENT 3

#define __builtin_amdgcn_workitem_id_x() (::moeext_emu::thread_idx().x)
#define __builtin_amdgcn_workgroup_id_x() (::moeext_emu::block_idx().x)
#define __builtin_amdgcn_fence(order, scope) ((void)0)
#define __builtin_amdgcn_wave_barrier() ::moeext_emu::sync_warp()

#define threadIdx (::moeext_emu::thread_idx())
#define blockIdx (::moeext_emu::block_idx())
#define blockDim (::moeext_emu::block_dim())
#define gridDim (::moeext_emu::grid_dim())

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
};

struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }

using std::max;
using std::min;
inline int64_t min(int64_t a, int b) { return a < b ? a : b; }
inline int64_t min(int a, int64_t b) { return a < b ? a : b; }
inline int64_t max(int64_t a, int b) { return a > b ? a : b; }
inline int64_t max(int a, int64_t b) { return a > b ? a : b; }

inline void __syncthreads() { ::moeext_emu::sync_block(); }
inline void __threadfence() {}

// host_device/float_bits.h's device path (the wave64 build defines __HIP_DEVICE_COMPILE__).
inline unsigned __float_as_uint(float x) {
  unsigned u;
  std::memcpy(&u, &x, 4);
  return u;
}
inline float __uint_as_float(unsigned u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}
inline int __ffs(unsigned x) { return __builtin_ffs(int(x)); }

template <typename T>
T __shfl_xor(T value, int lane_mask) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>);
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  const int lane = int(::moeext_emu::thread_idx().x) % ::moeext_emu::settings().warp_size;
  bits = ::moeext_emu::warp_exchange(bits, lane ^ lane_mask);
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}

template <typename T>
T __shfl(T value, int source) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>);
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  bits = ::moeext_emu::warp_exchange(bits, source);
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}

inline unsigned long long __ballot(int predicate) {
  return ::moeext_emu::warp_ballot(predicate != 0);
}

// Blocks and threads run one at a time, so every atomic is a plain read-modify-write.
template <typename T, typename Op>
T read_modify_write(T* address, Op op) {
  const T old = *address;
  *address = op(old);
  return old;
}
template <typename T, typename U>
T atomicAdd(T* address, U value) {
  return read_modify_write(address, [&](T old) { return T(old + T(value)); });
}
template <typename T, typename U>
T atomicOr(T* address, U value) {
  return read_modify_write(address, [&](T old) { return T(old | T(value)); });
}
template <typename T, typename U>
T atomicExch(T* address, U value) {
  return read_modify_write(address, [&](T) { return T(value); });
}
template <typename T, typename U>
T __hip_atomic_fetch_add(T* address, U value, int /*order*/, int /*scope*/) {
  return atomicAdd(address, value);
}

// ---- host API -------------------------------------------------------------------------------

using hipStream_t = struct ihipStream_t*;
enum hipError_t { hipSuccess = 0, hipErrorLaunchFailure = 719 };
enum hipDeviceAttribute_t {
  hipDeviceAttributeWarpSize,
  hipDeviceAttributeMultiprocessorCount,
};
enum hipStreamCaptureStatus { hipStreamCaptureStatusNone = 0, hipStreamCaptureStatusActive };

hipError_t hipGetLastError();
const char* hipGetErrorString(hipError_t error);
hipError_t hipGetDevice(int* device);
hipError_t hipDeviceGetAttribute(int* value, hipDeviceAttribute_t attribute, int device);
hipError_t hipMemsetAsync(void* dst, int value, size_t bytes, hipStream_t stream);
hipError_t hipMalloc(void** ptr, size_t bytes);
hipError_t hipStreamSynchronize(hipStream_t stream);
hipError_t hipStreamGetCaptureInfo(hipStream_t stream, hipStreamCaptureStatus* status,
                                   unsigned long long* id);

namespace moeext_emu {

// kernel<<<grid, block, shared, stream>>>(args...) becomes
// moeext_emu::Configured(grid, block, shared, stream).kernel(kernel)(args...).
template <typename Kernel>
struct Bound {
  Dim3 grid, block;
  size_t shared;
  Kernel* kernel;
  template <typename... Args>
  void operator()(Args... args) const {
    Kernel* k = kernel;
    const std::string error = launch(grid, block, shared, [&] { k(args...); });
    if (!error.empty()) record_error(error);
  }
};

struct Configured {
  Dim3 grid, block;
  size_t shared;
  Configured(dim3 g, dim3 b, size_t s = 0, hipStream_t = nullptr)
      : grid{g.x, g.y, g.z}, block{b.x, b.y, b.z}, shared(s) {}
  template <typename... Params>
  Bound<void(Params...)> kernel(void (*k)(Params...)) const {
    return {grid, block, shared, k};
  }
};

}  // namespace moeext_emu
