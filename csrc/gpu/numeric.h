// Bit-level float helpers shared by the GPU kernels and their host unit tests
// (tests/cpp/). No GPU runtime header here, so the host compiler alone builds the tests.
#pragma once

#include <cstdint>

#include "moeext/common.h"

namespace moeext::gpu {

// Storage-only 16-bit floats, read by widening. bf16 is the top half of an fp32, so widening
// is a shift; fp16 widens with the hardware conversion.
struct alignas(2) bf16 {
  uint16_t bits;
};
struct alignas(2) fp16 {
  uint16_t bits;
};

MOEEXT_HOST_DEVICE inline uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
  return __float_as_uint(x);
#else
  uint32_t u;
  __builtin_memcpy(&u, &x, sizeof(u));
  return u;
#endif
}

MOEEXT_HOST_DEVICE inline float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
  return __uint_as_float(u);
#else
  float x;
  __builtin_memcpy(&x, &u, sizeof(x));
  return x;
#endif
}

MOEEXT_HOST_DEVICE inline float to_float(float x) { return x; }
MOEEXT_HOST_DEVICE inline float to_float(bf16 x) { return bits_float(uint32_t(x.bits) << 16); }

// Round to nearest even, NaN kept NaN (quiet): the one rounding a bf16 output gets.
MOEEXT_HOST_DEVICE inline bf16 to_bf16(float x) {
  const uint32_t u = float_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{uint16_t((u >> 16) | 0x0040u)};
  return bf16{uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}

}  // namespace moeext::gpu
