// The GPU kernels' 16-bit float storage types and their conversions, shared with the host
// unit tests (tests/cpp/). No GPU runtime header here, so the host compiler alone builds the
// tests. The fp32 bit helpers are host_device/float_bits.h's.
#pragma once

#include <cstdint>

#include "host_device/float_bits.h"
#include "moeext/common.h"

namespace moeext::gpu {

using host_device::bits_float;
using host_device::float_bits;

// Storage-only 16-bit floats, read by widening. bf16 is the top half of an fp32, so widening
// is a shift; fp16 widens with the hardware conversion (compat.h).
struct alignas(2) bf16 {
  uint16_t bits;
};
struct alignas(2) fp16 {
  uint16_t bits;
};

MOEEXT_HOST_DEVICE inline float to_float(float x) { return x; }
MOEEXT_HOST_DEVICE inline float to_float(bf16 x) { return bits_float(uint32_t(x.bits) << 16); }

// Round to nearest even, NaN kept NaN (quiet): the one rounding a bf16 output gets.
MOEEXT_HOST_DEVICE inline bf16 to_bf16(float x) {
  const uint32_t u = float_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{uint16_t((u >> 16) | 0x0040u)};
  return bf16{uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}

}  // namespace moeext::gpu
