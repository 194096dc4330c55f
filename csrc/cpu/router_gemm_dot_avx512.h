// Part of cpu/router_gemm.cpp (see cpu/router_gemm_dot.h): AVX-512 without the bf16 dot
// product, bf16 widened by shifting, 32 elements per step in two FMAs.
#pragma once

#include <immintrin.h>

#include "cpu/router_gemm_dot_avx512_common.h"
#include "cpu/types.h"

namespace moeext::cpu::MOEEXT_CPU_ISA {
namespace {

template <>
struct Dot<bf16_t> {
  static constexpr int kStep = 32;
  using Acc = __m512;
  struct Operand {
    __m512 even, odd;
  };
  static Acc zero() { return _mm512_setzero_ps(); }
  static Operand split(__m512i v) {
    return {_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)),
            _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int32_t(0xffff0000u))))};
  }
  static Operand load(const bf16_t* p) { return split(_mm512_loadu_si512(p)); }
  static Operand load_tail(const bf16_t* p, int64_t n) {
    return split(_mm512_maskz_loadu_epi16(mask32(n), p));
  }
  static void madd(Acc& acc, const Operand& x, const Operand& w) {
    acc = _mm512_fmadd_ps(x.odd, w.odd, _mm512_fmadd_ps(x.even, w.even, acc));
  }
  static float reduce(Acc acc) { return _mm512_reduce_add_ps(acc); }
};

namespace packed {

// Widened by shifting; a weight vector is two registers: 4 x 4 accumulators, 8 + 2 operands.
struct PairDot : PairDotAvx512 {
  static constexpr int kVectors = 4, kTokens = 4, kAccumulators = 16;
  static constexpr int kRegisters = 32, kPairRegisters = 2;
  struct Pair {
    __m512 even, odd;
  };
  template <typename... Lanes>
  static Pair load_weight(const bf16_t* p, Lanes... lanes) {
    const __m512i v = load_pairs(p, lanes...);
    return {_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)),
            _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int32_t(0xffff0000u))))};
  }
  static Pair broadcast(const bf16_t* pair) {
    return {_mm512_set1_ps(to_float(pair[0])), _mm512_set1_ps(to_float(pair[1]))};
  }
  static void madd(Acc& acc, const Pair& x, const Pair& w) {
    acc = _mm512_fmadd_ps(x.odd, w.odd, _mm512_fmadd_ps(x.even, w.even, acc));
  }
};

}  // namespace packed

}  // namespace
}  // namespace moeext::cpu::MOEEXT_CPU_ISA
