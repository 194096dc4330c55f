// Part of cpu/router_gemm.cpp (see cpu/router_gemm_dot.h): AVX2 + FMA + F16C, 8 fp32 lanes
// in 16 ymm registers (smaller register tiles than AVX-512's); bf16 split by shifting at 16
// elements per step, fp16 widened by vcvtph2ps.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "cpu/types.h"

namespace moeext::cpu::MOEEXT_CPU_ISA {
namespace {

inline float reduce256(__m256 a) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

template <typename T>
struct Dot;

template <>
struct Dot<float> {
  static constexpr int kStep = 8;
  using Acc = __m256;
  using Operand = __m256;
  static Acc zero() { return _mm256_setzero_ps(); }
  static Operand load(const float* p) { return _mm256_loadu_ps(p); }
  static Operand load_tail(const float* p, int64_t n) {
    float buffer[kStep];
    return load(zero_padded(p, n, buffer));
  }
  static void madd(Acc& acc, Operand x, Operand w) { acc = _mm256_fmadd_ps(x, w, acc); }
  static float reduce(Acc acc) { return reduce256(acc); }
};

template <>
struct Dot<fp16_t> : Dot<float> {
  static Operand load(const fp16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static Operand load_tail(const fp16_t* p, int64_t n) {
    fp16_t buffer[kStep];
    return load(zero_padded(p, n, buffer));
  }
};

// bf16 widened by shifting, as on the avx512 path, 16 elements per step.
template <>
struct Dot<bf16_t> {
  static constexpr int kStep = 16;
  using Acc = __m256;
  struct Operand {
    __m256 even, odd;
  };
  static Acc zero() { return _mm256_setzero_ps(); }
  static Operand load(const bf16_t* p) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)),
            _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(int32_t(0xffff0000u))))};
  }
  static Operand load_tail(const bf16_t* p, int64_t n) {
    bf16_t buffer[kStep];
    return load(zero_padded(p, n, buffer));
  }
  static void madd(Acc& acc, const Operand& x, const Operand& w) {
    acc = _mm256_fmadd_ps(x.odd, w.odd, _mm256_fmadd_ps(x.even, w.even, acc));
  }
  static float reduce(Acc acc) { return reduce256(acc); }
};

constexpr int kVectorRegisters = 16;

// The x86 copies leave the register tiles' loops to GCC: the pragma of the portable copy
// would change the code their tuning measured (GCC keeps some of those loops rolled).
#define MOEEXT_TILE_UNROLL

namespace packed {

// Pairs widened by shifting, as Dot<bf16_t> does: the even element of a 32-bit pair is its
// low half shifted up, the odd one the pair with the low half cleared.
struct PairDot {
  static constexpr int kLanes = 8;
  // 16 ymm registers: 8 accumulators, a widened weight vector, a widened token pair. Each
  // accumulator takes a chain of two dependent FMAs per pair, so a tile needs all 8 to keep
  // both FMA pipes busy: 8 vectors x 1 token, 4 x 2, 2 x 4 (one token in a 2 x 1 tile was
  // far slower than the nn.Linear layout).
  static constexpr int kVectors = 8, kTokens = 4, kAccumulators = 8;
  static constexpr int kRegisters = 16, kPairRegisters = 2;
  using Acc = __m256;
  struct Pair {
    __m256 even, odd;
  };
  static Acc zero() { return _mm256_setzero_ps(); }
  static Acc load_acc(const float* p) { return _mm256_loadu_ps(p); }
  static void store_acc(Acc a, float* p) { _mm256_storeu_ps(p, a); }
  static Pair split(__m256i v) {
    return {_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)),
            _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(int32_t(0xffff0000u))))};
  }
  using Lanes = __m256i;  // all ones in the lanes to load
  static Lanes lanes_mask(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static Pair load_weight(const bf16_t* p) {
    return split(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static Pair load_weight(const bf16_t* p, Lanes lanes) {
    return split(_mm256_maskload_epi32(reinterpret_cast<const int*>(p), lanes));
  }
  // The pair's 32 bits in every lane, split like a weight vector: one load-and-replicate and
  // two lane operations, where a scalar widening of each element took four.
  static Pair broadcast(const bf16_t* pair) {
    int32_t bits;
    std::memcpy(&bits, pair, sizeof(bits));
    return split(_mm256_set1_epi32(bits));
  }
  static void madd(Acc& acc, const Pair& x, const Pair& w) {
    acc = _mm256_fmadd_ps(x.odd, w.odd, _mm256_fmadd_ps(x.even, w.even, acc));
  }
};

}  // namespace packed

}  // namespace
}  // namespace moeext::cpu::MOEEXT_CPU_ISA
