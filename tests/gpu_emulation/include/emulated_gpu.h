// The device side of csrc/gpu/'s runtime headers on the host (tests/gpu_emulation/runtime.h),
// shared by the CUDA and HIP stand-ins (cuda_runtime.h, hip/hip_runtime.h): keywords, thread
// indices, vector types, barriers, atomics and the launch that prepare.py rewrites
// kernel<<<...>>>(args) into. Blocks and threads run one at a time (runtime.h).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "../runtime.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
// Blocks run one after another on one host thread: a static is the block's shared memory.
#define __shared__ static


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

// host_device/float_bits.h's device path (__CUDA_ARCH__ or __HIP_DEVICE_COMPILE__ defined).
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

// Relaxed atomics, as CUDA's atomicAdd and the like: ordering nothing, which a race build
// (runtime.cpp's MOEEXT_EMU_RACES) then sees; fetch_add_acq_rel is the acquire-release count.
template <typename T, typename U>
T atomicAdd(T* address, U value) {
  static_assert(std::is_integral_v<T>, "the emulation has integer atomics only");
  return __atomic_fetch_add(address, T(value), __ATOMIC_RELAXED);
}
template <typename T, typename U>
T atomicOr(T* address, U value) {
  static_assert(std::is_integral_v<T>, "the emulation has integer atomics only");
  return __atomic_fetch_or(address, T(value), __ATOMIC_RELAXED);
}
template <typename T, typename U>
T atomicExch(T* address, U value) {
  static_assert(std::is_integral_v<T>, "the emulation has integer atomics only");
  return __atomic_exchange_n(address, T(value), __ATOMIC_RELAXED);
}
namespace moeext_emu {
template <typename T, typename U>
T fetch_add_acq_rel(T* address, U value) {
  static_assert(std::is_integral_v<T>, "the emulation has integer atomics only");
  return __atomic_fetch_add(address, T(value), __ATOMIC_ACQ_REL);
}
}  // namespace moeext_emu

namespace moeext_emu {

// Every lane's `value`, in lane order, into out[0, warp size).
template <typename T>
void warp_values(T value, T* out) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>);
  uint64_t bits = 0, all[64];
  std::memcpy(&bits, &value, sizeof(T));
  warp_all(bits, all);
  const int width = settings().warp_size;
  for (int i = 0; i < width; ++i) std::memcpy(&out[i], &all[i], sizeof(T));
}

template <typename T>
T shuffle_from(T value, int source) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>);
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  bits = warp_exchange(bits, source);
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}

inline int lane_id() {
  return int(threadIdx.x) % settings().warp_size;
}

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
  Configured(dim3 g, dim3 b, size_t s = 0, const void* /*stream*/ = nullptr)
      : grid{g.x, g.y, g.z}, block{b.x, b.y, b.z}, shared(s) {}
  template <typename... Params>
  Bound<void(Params...)> kernel(void (*k)(Params...)) const {
    return {grid, block, shared, k};
  }
};

}  // namespace moeext_emu
