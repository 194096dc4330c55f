// Storage-only element types the CPU kernels read, and their exact widening to fp32.
#pragma once

#include <cstdint>
#include <cstring>

// For the kernels' small hot helpers. GCC's inliner works to a budget for the whole file,
// so code added anywhere in it can move a helper out of line in an unrelated hot loop, its
// values then passing through memory (adding the candidate pass of grouped_topk.cpp once
// moved rank_values out of line). Where that matters, inlining is not left to the budget.
#define MOEEXT_ALWAYS_INLINE [[gnu::always_inline]] inline

namespace moeext::cpu {

struct bf16_t {
  uint16_t bits;
};
struct fp16_t {
  uint16_t bits;
};
// Stands in for the bias type when a call has no correction bias.
struct no_bias_t {};

inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}

inline float to_float(float x) { return x; }
inline float to_float(bf16_t x) { return bits_to_float(uint32_t(x.bits) << 16); }
inline float to_float(fp16_t x) {
  const uint32_t sign = uint32_t(x.bits & 0x8000u) << 16;
  const uint32_t exponent = (x.bits >> 10) & 0x1fu;
  const uint32_t mantissa = x.bits & 0x3ffu;
  if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-24 is exact in fp32.
    const float magnitude = float(mantissa) * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 31) {
    return bits_to_float(sign | 0x7f800000u | (mantissa << 13));
  }
  return bits_to_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

// Round to nearest even, as torch rounds fp32 to bf16; NaN stays a (quiet) NaN.
inline uint16_t float_to_bf16_bits(float f) {
  const uint32_t bits = float_to_bits(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x40u);
  return uint16_t((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

}  // namespace moeext::cpu
