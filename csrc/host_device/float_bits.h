// fp32 bit helpers for code compiled for the host and the GPU alike (csrc/host_device/): no
// GPU runtime header here, so the host compiler alone builds the kernels' shared logic and
// its unit tests (tests/cpp/).
#pragma once

#include <cstdint>

#include "moeext/common.h"

namespace moeext::host_device {

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

constexpr uint32_t kNegInfBits = 0xff800000u;

MOEEXT_HOST_DEVICE inline float neg_inf() { return bits_float(kNegInfBits); }

// By its bits, so that no compiler flag can turn the test into "never NaN".
MOEEXT_HOST_DEVICE inline bool is_nan(float x) { return (float_bits(x) & 0x7fffffffu) > 0x7f800000u; }

}  // namespace moeext::host_device
