// Loads and stores of 16, 8, 4, 2 or 1 bytes as one access, for kernels that pick the width
// at launch from the alignment of their operands (access_width.h).
#pragma once

#include <cstdint>

#include "gpu/compat.h"

namespace moeext::gpu {

template <int kWidth>
struct AccessUnit;
template <>
struct AccessUnit<16> {
  using Type = uint4;
  __device__ __forceinline__ static Type zero() { return make_uint4(0, 0, 0, 0); }
};
template <>
struct AccessUnit<8> {
  using Type = uint2;
  __device__ __forceinline__ static Type zero() { return make_uint2(0, 0); }
};
template <>
struct AccessUnit<4> {
  using Type = uint32_t;
  __device__ __forceinline__ static Type zero() { return 0; }
};
template <>
struct AccessUnit<2> {
  using Type = uint16_t;
  __device__ __forceinline__ static Type zero() { return 0; }
};
template <>
struct AccessUnit<1> {
  using Type = uint8_t;
  __device__ __forceinline__ static Type zero() { return 0; }
};

// Copies kBytes from src to dst in kWidth-byte accesses (both aligned to kWidth).
template <int kWidth, int kBytes>
__device__ __forceinline__ void copy_bytes(unsigned char* dst, const unsigned char* src) {
  static_assert(kBytes % kWidth == 0, "whole accesses");
  using Type = typename AccessUnit<kWidth>::Type;
  Type parts[kBytes / kWidth];
#pragma unroll
  for (int i = 0; i < kBytes / kWidth; ++i) parts[i] = reinterpret_cast<const Type*>(src)[i];
#pragma unroll
  for (int i = 0; i < kBytes / kWidth; ++i) reinterpret_cast<Type*>(dst)[i] = parts[i];
}

}  // namespace moeext::gpu
