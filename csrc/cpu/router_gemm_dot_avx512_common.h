// Part of cpu/router_gemm.cpp (see cpu/router_gemm_dot.h): what the avx512 and avx512bf16
// copies share, 16 fp32 lanes in 32 zmm registers, masked loads for the last partial step,
// fp32 and fp16 (widened by vcvtph2ps). Their bf16 types are in router_gemm_dot_avx512.h and
// router_gemm_dot_avx512bf16.h.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "cpu/types.h"

namespace moeext::cpu::MOEEXT_CPU_ISA {
namespace {

inline __mmask16 mask16(int64_t n) {
  return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1u);
}
inline __mmask32 mask32(int64_t n) {
  return n >= 32 ? __mmask32(0xffffffffu) : __mmask32((uint32_t(1) << n) - 1u);
}

template <typename T>
struct Dot;

template <>
struct Dot<float> {
  static constexpr int kStep = 16;
  using Acc = __m512;
  using Operand = __m512;
  static Acc zero() { return _mm512_setzero_ps(); }
  static Operand load(const float* p) { return _mm512_loadu_ps(p); }
  static Operand load_tail(const float* p, int64_t n) {
    return _mm512_maskz_loadu_ps(mask16(n), p);
  }
  static void madd(Acc& acc, Operand x, Operand w) { acc = _mm512_fmadd_ps(x, w, acc); }
  static float reduce(Acc acc) { return _mm512_reduce_add_ps(acc); }
};

template <>
struct Dot<fp16_t> : Dot<float> {
  static Operand load(const fp16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static Operand load_tail(const fp16_t* p, int64_t n) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask16(n), p));
  }
};

constexpr int kVectorRegisters = 32;

// The x86 copies leave the register tiles' loops to GCC: the pragma of the portable copy
// would change the code their tuning measured (GCC keeps some of those loops rolled).
#define MOEEXT_TILE_UNROLL

namespace packed {

struct PairDotAvx512 {
  static constexpr int kLanes = 16;
  using Acc = __m512;
  static Acc zero() { return _mm512_setzero_ps(); }
  static Acc load_acc(const float* p) { return _mm512_loadu_ps(p); }
  static void store_acc(Acc a, float* p) { _mm512_storeu_ps(p, a); }
  using Lanes = __mmask16;
  static Lanes lanes_mask(int n) { return mask16(n); }
  static __m512i load_pairs(const bf16_t* p) { return _mm512_loadu_si512(p); }
  static __m512i load_pairs(const bf16_t* p, Lanes lanes) {
    return _mm512_maskz_loadu_epi32(lanes, p);
  }
};

}  // namespace packed

}  // namespace
}  // namespace moeext::cpu::MOEEXT_CPU_ISA
