// Inputs for the programs .ci/aarch64_check.sh runs on both x86-64 and aarch64 (qemu): the
// same pseudo-random values, and the same bf16 and fp16 roundings of them, on every machine.
#pragma once

#include <cstdint>

#include "cpu/types.h"

namespace ci_values {

inline uint64_t rng_state = 0x9e3779b97f4a7c15ull;
inline uint64_t next_random() {  // xorshift64
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return rng_state;
}
inline int64_t pick(int64_t n) { return int64_t(next_random() % uint64_t(n)); }
inline float uniform() { return float(next_random() >> 40) / float(1 << 24); }
inline float roughly_normal() {
  float sum = 0.0f;
  for (int i = 0; i < 6; ++i) sum += uniform();
  return (sum - 3.0f) * 1.4f;
}

using moeext::cpu::bits_to_float;
using moeext::cpu::float_to_bits;

inline uint16_t to_bf16(float f) {
  const uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
// Deterministic, not exactly rounded: the programs only need the same inputs on both
// machines, and their fp32 values (moeext::cpu::to_float widens them exactly).
inline uint16_t to_fp16(float f) {
  const uint32_t u = float_to_bits(f), sign = (u >> 16) & 0x8000u, magnitude = u & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return uint16_t(sign | 0x7e00u);
  if (magnitude >= 0x477ff000u) return uint16_t(sign | 0x7c00u);
  if (magnitude < 0x38800000u) {
    return uint16_t(sign | uint32_t(bits_to_float(magnitude) * 16777216.0f + 0.5f));
  }
  return uint16_t(sign | ((magnitude + 0xfffu + ((magnitude >> 13) & 1u) - 0x38000000u) >> 13));
}

}  // namespace ci_values
