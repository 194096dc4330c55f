// Part of cpu/router_gemm.cpp (see cpu/router_gemm_dot.h): AVX-512 with vdpbf16ps, 32 bf16
// pairs per instruction. It reads bf16 denormals as zero and flushes denormal results, which
// moves a logit by < 2^-126.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "cpu/router_gemm_dot_avx512_common.h"
#include "cpu/types.h"

namespace moeext::cpu::MOEEXT_CPU_ISA {
namespace {

template <>
struct Dot<bf16_t> {
  static constexpr int kStep = 32;
  using Acc = __m512;
  using Operand = __m512bh;
  static Acc zero() { return _mm512_setzero_ps(); }
  static Operand load(const bf16_t* p) {
    __m512i v = _mm512_loadu_si512(p);
    // Without this GCC 12 reloads each weight vector for every token of the tile (as a
    // memory operand of vdpbf16ps): one load per dot product, and the loads become the
    // bottleneck (docs/notes/cpu-router-gemm.md, "Weight vectors held in registers").
    asm("" : "+v"(v));
    return Operand(v);
  }
  static Operand load_tail(const bf16_t* p, int64_t n) {
    return Operand(_mm512_maskz_loadu_epi16(mask32(n), p));
  }
  static void madd(Acc& acc, Operand x, Operand w) { acc = _mm512_dpbf16_ps(acc, x, w); }
  static float reduce(Acc acc) { return _mm512_reduce_add_ps(acc); }
};

namespace packed {

// One vdpbf16ps per vector of experts and token: 4 x 4 accumulators. 4 x 6 was no faster,
// 2 x 8 slower from DRAM (each register tile streams half of every pair row), and 1 x 16
// needs 16 token row pointers, more than the general registers.
struct PairDot : PairDotAvx512 {
  static constexpr int kVectors = 4, kTokens = 4, kAccumulators = 16;
  static constexpr int kRegisters = 32, kPairRegisters = 1;
  using Pair = __m512bh;
  template <typename... Lanes>
  static Pair load_weight(const bf16_t* p, Lanes... lanes) {
    __m512i v = load_pairs(p, lanes...);
    asm("" : "+v"(v));  // kept in a register across the tokens (see Dot<bf16_t>::load)
    return Pair(v);
  }
  static Pair broadcast(const bf16_t* pair) {
    int32_t bits;
    std::memcpy(&bits, pair, sizeof(bits));
    return Pair(_mm512_set1_epi32(bits));
  }
  static void madd(Acc& acc, Pair x, Pair w) { acc = _mm512_dpbf16_ps(acc, x, w); }
};

}  // namespace packed

}  // namespace
}  // namespace moeext::cpu::MOEEXT_CPU_ISA
