// 16 x fp32 lanes of AVX-512 (F, BW, VL, DQ). Only compiled into the avx512 copy of each
// kernel; dispatch.cpp calls that copy only on a CPU that reports AVX-512.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "cpu/types.h"

namespace moeext::cpu::MOEEXT_CPU_ISA {

// Compare-exchange partners and "keep the minimum" lanes of the ten steps of a 16-lane
// bitonic sorting network (ascending), built at compile time.
struct BitonicTables {
  alignas(64) int partner[10][16];
  uint16_t take_min[10];
};
constexpr BitonicTables make_bitonic_tables() {
  BitonicTables t{};
  int step = 0;
  for (int block = 2; block <= 16; block *= 2) {
    for (int stride = block / 2; stride > 0; stride /= 2, ++step) {
      unsigned take_min = 0;
      for (int i = 0; i < 16; ++i) {
        t.partner[step][i] = i ^ stride;
        const bool lower = (i & stride) == 0;
        const bool ascending = (i & block) == 0;
        if (lower == ascending) take_min |= 1u << i;
      }
      t.take_min[step] = uint16_t(take_min);
    }
  }
  return t;
}
inline constexpr BitonicTables kBitonic = make_bitonic_tables();

struct Vec {
  static constexpr int kWidth = 16;
  using Mask = __mmask16;
  __m512 v;

  static Vec set1(float x) { return {_mm512_set1_ps(x)}; }
  static Mask tail_mask(int64_t n) {
    return n >= 16 ? Mask(0xffff) : n <= 0 ? Mask(0) : Mask((1u << n) - 1u);
  }

  static Vec load(const float* p, Mask m, float fill) {
    return {_mm512_mask_loadu_ps(_mm512_set1_ps(fill), m, p)};
  }
  static Vec load(const bf16_t* p, Mask m, float fill) {
    const __m256i h = _mm256_maskz_loadu_epi16(m, p);
    const __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return {_mm512_mask_blend_ps(m, _mm512_set1_ps(fill), x)};
  }
  static Vec load(const fp16_t* p, Mask m, float fill) {
    const __m256i h = _mm256_maskz_loadu_epi16(m, p);
    return {_mm512_mask_blend_ps(m, _mm512_set1_ps(fill), _mm512_cvtph_ps(h))};
  }
  void store(float* p, Mask m) const { _mm512_mask_storeu_ps(p, m, v); }

  friend Vec operator+(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
  friend Vec operator-(Vec a, Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
  friend Vec operator*(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
  friend Vec operator/(Vec a, Vec b) { return {_mm512_div_ps(a.v, b.v)}; }
  static Vec fmadd(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  // The second operand is returned when either is NaN (the instruction's own rule).
  static Vec max(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }
  static Vec min(Vec a, Vec b) { return {_mm512_min_ps(a.v, b.v)}; }
  static Vec sqrt(Vec a) { return {_mm512_sqrt_ps(a.v)}; }
  static Vec round(Vec a) {
    return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
  }
  static Vec scalef(Vec a, Vec n) { return {_mm512_scalef_ps(a.v, n.v)}; }
  static Vec frexp(Vec a, Vec* exp) {
    exp->v = _mm512_add_ps(_mm512_getexp_ps(a.v), _mm512_set1_ps(1.0f));
    return {_mm512_getmant_ps(a.v, _MM_MANT_NORM_p5_1, _MM_MANT_SIGN_src)};
  }

  static Mask cmp_gt(Vec a, Vec b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_GT_OQ); }
  static Mask cmp_ge(Vec a, Vec b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_GE_OQ); }
  static Mask cmp_lt(Vec a, Vec b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_LT_OQ); }
  static Mask cmp_eq(Vec a, Vec b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_EQ_OQ); }
  static Mask is_nan(Vec a) { return _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q); }
  static Vec select(Mask m, Vec a, Vec b) { return {_mm512_mask_blend_ps(m, b.v, a.v)}; }

  static float reduce_max(Vec a) { return _mm512_reduce_max_ps(a.v); }
  static float reduce_min(Vec a) { return _mm512_reduce_min_ps(a.v); }
  // The k-th largest lane (1 <= k <= 16) of a vector holding no NaN: the ten steps of a
  // bitonic sorting network in registers (ascending), then lane 16 - k.
  static float kth_largest(Vec a, int k) {
    __m512 x = a.v;
    for (int step = 0; step < 10; ++step) {
      const __m512 y = _mm512_permutexvar_ps(_mm512_load_si512(kBitonic.partner[step]), x);
      x = _mm512_mask_blend_ps(__mmask16(kBitonic.take_min[step]), _mm512_max_ps(x, y), _mm512_min_ps(x, y));
    }
    alignas(64) float sorted[16];
    _mm512_store_ps(sorted, x);
    return sorted[16 - k];
  }

  static float reduce_add(Vec a) { return _mm512_reduce_add_ps(a.v); }
};

inline int popcount(uint32_t m) { return __builtin_popcount(m); }

}  // namespace moeext::cpu::MOEEXT_CPU_ISA
