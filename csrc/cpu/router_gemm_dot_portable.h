// Part of cpu/router_gemm.cpp (see cpu/router_gemm_dot.h): the portable path (aarch64, x86-64
// without AVX2), four fp32 lanes in the compiler's generic vectors (cpu/vec_portable.h); bf16
// split by shifting at 8 elements per step, fp16 widened by fp16_to_f4; the multiply-adds
// fused where the target has them (madd4).
#pragma once

#include <cstdint>
#include <cstring>

#include "cpu/types.h"
#include "cpu/vec_portable.h"

namespace moeext::cpu::MOEEXT_CPU_ISA {
namespace {

using portable_detail::F4;
using portable_detail::U4;

inline F4 load4(const float* p) {
  F4 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
// The product is fused where the target has a fused multiply-add (aarch64: one fmla per
// vector). On x86-64 without FMA, std::fma would be a library call per lane, so the product
// rounds before the add there.
MOEEXT_ALWAYS_INLINE F4 madd4(F4 acc, F4 x, F4 w) {
#if defined(__FP_FAST_FMAF)
  return portable_detail::fma4(x, w, acc);
#else
  return acc + x * w;
#endif
}
inline float reduce4(F4 a) { return (a[0] + a[1]) + (a[2] + a[3]); }
template <typename T>
struct Dot;

template <>
struct Dot<float> {
  static constexpr int kStep = 4;
  using Acc = F4;
  using Operand = F4;
  static Acc zero() { return F4{}; }
  static Operand load(const float* p) { return load4(p); }
  static Operand load_tail(const float* p, int64_t n) {
    float buffer[kStep];
    return load(zero_padded(p, n, buffer));
  }
  static void madd(Acc& acc, Operand x, Operand w) { acc = madd4(acc, x, w); }
  static float reduce(Acc acc) { return reduce4(acc); }
};

template <>
struct Dot<fp16_t> : Dot<float> {
  static Operand load(const fp16_t* p) { return portable_detail::load_fp16_4(p); }
  static Operand load_tail(const fp16_t* p, int64_t n) {
    fp16_t buffer[kStep];
    return load(zero_padded(p, n, buffer));
  }
};

// bf16 widened by shifting, as on the x86 paths, 8 elements per step.
template <>
struct Dot<bf16_t> {
  static constexpr int kStep = 8;
  using Acc = F4;
  struct Operand {
    F4 even, odd;
  };
  static Acc zero() { return F4{}; }
  static Operand split(U4 words) {
    return {portable_detail::bf16_even(words), portable_detail::bf16_odd(words)};
  }
  static Operand load(const bf16_t* p) {
    U4 v;
    std::memcpy(&v, p, sizeof(v));
    return split(v);
  }
  static Operand load_tail(const bf16_t* p, int64_t n) {
    bf16_t buffer[kStep];
    return load(zero_padded(p, n, buffer));
  }
  static void madd(Acc& acc, const Operand& x, const Operand& w) {
    acc = madd4(madd4(acc, x.even, w.even), x.odd, w.odd);
  }
  static float reduce(Acc acc) { return reduce4(acc); }
};

// 16 xmm registers on x86-64, 32 on aarch64.
#if defined(__x86_64__)
constexpr int kVectorRegisters = 16;
#else
constexpr int kVectorRegisters = 32;
#endif

// The loops over a register tile's tokens and experts are unrolled by pragma here: left to
// GCC 12, the aarch64 build kept its accumulators in memory, loaded and stored around every
// token's dot products.
#define MOEEXT_TILE_UNROLL _Pragma("GCC unroll 16")

namespace packed {

// Four experts a vector, widened and multiplied as Dot<bf16_t> does. 32 vector registers on
// aarch64: 16 accumulators, 4 + 2 operands; 16 on x86-64: 8, 2 + 2. As on AVX2, the
// register tile is as wide as the accumulators allow for the tokens it takes (x86-64's SSE2
// code at T = 1: 8 x 1 instead of 2 x 1).
struct PairDot {
  using Bf16 = Dot<bf16_t>;
  static constexpr int kLanes = 4;
#if defined(__x86_64__)
  static constexpr int kVectors = 8, kTokens = 4, kAccumulators = 8, kRegisters = 16;
#else
  static constexpr int kVectors = 16, kTokens = 4, kAccumulators = 16, kRegisters = 32;
#endif
  static constexpr int kPairRegisters = 2;
  using Acc = Bf16::Acc;
  using Pair = Bf16::Operand;
  static Acc zero() { return Bf16::zero(); }
  static Acc load_acc(const float* p) { return load4(p); }
  static void store_acc(Acc a, float* p) { std::memcpy(p, &a, sizeof(a)); }
  using Lanes = int;  // the experts to load, 1..4
  static Lanes lanes_mask(int n) { return n; }
  static Pair load_weight(const bf16_t* p) { return Bf16::load(p); }
  // Called for the last vector of every pair row. A copy of `lanes` pairs is a library call
  // (every live vector register saved around it), so a whole vector takes a plain load; only
  // a narrow tile's partial last vector pays for the call.
  static Pair load_weight(const bf16_t* p, Lanes lanes) {
    if (lanes == kLanes) return Bf16::load(p);
    U4 v{};
    std::memcpy(&v, p, size_t(lanes) * 2 * sizeof(bf16_t));
    return Bf16::split(v);
  }
  // The pair's 32 bits in every lane, split like a weight vector: one load-and-replicate and
  // two lane operations instead of widening each element and replicating it.
  static Pair broadcast(const bf16_t* pair) {
    uint32_t bits;
    std::memcpy(&bits, pair, sizeof(bits));
    return Bf16::split(U4{} + bits);
  }
  static void madd(Acc& acc, const Pair& x, const Pair& w) { Bf16::madd(acc, x, w); }
};

}  // namespace packed

}  // namespace
}  // namespace moeext::cpu::MOEEXT_CPU_ISA
