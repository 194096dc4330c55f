// One-lane "vector" with the interface of vec_avx512.h, so every kernel is written once and
// the portable build is the same algorithm at width 1. Masks are bit sets (bit i = lane i).
#pragma once

#include <cmath>
#include <cstdint>

#include "cpu/score_pieces.h"
#include "cpu/types.h"

namespace moeext::cpu::MOEEXT_CPU_ISA {

struct Vec {
  static constexpr int kWidth = 1;
  using Mask = uint32_t;
  float v;

  static Vec set1(float x) { return {x}; }
  static Mask tail_mask(int64_t n) { return n > 0 ? 1u : 0u; }

  static Vec load(const float* p) { return {*p}; }  // a whole vector
  // vec_avx512.h's pair loads with one lane (values 0 and 1). Off: one lane has no
  // lane-crossing widen to avoid.
  static constexpr bool kHasBf16Pairs = false;
  static void load_pair(const bf16_t* p, Vec& even, Vec& odd) {
    even = {to_float(p[0])};
    odd = {to_float(p[1])};
  }
  static void interleave_pair(Vec even, Vec odd, Vec& low, Vec& high) {
    low = even;
    high = odd;
  }
  template <typename T>
  static Vec load(const T* p, Mask m, float fill) {
    return {m ? to_float(*p) : fill};
  }
  void store(float* p) const { *p = v; }
  void store(float* p, Mask m) const {
    if (m) *p = v;
  }

  friend Vec operator+(Vec a, Vec b) { return {a.v + b.v}; }
  friend Vec operator-(Vec a, Vec b) { return {a.v - b.v}; }
  friend Vec operator*(Vec a, Vec b) { return {a.v * b.v}; }
  friend Vec operator/(Vec a, Vec b) { return {a.v / b.v}; }
  // a * b + c, fused like the vector paths so that both give the same bits.
  static Vec fmadd(Vec a, Vec b, Vec c) { return {std::fma(a.v, b.v, c.v)}; }
  // -(a * b) - c, fused.
  static Vec fnmsub(Vec a, Vec b, Vec c) { return {std::fma(-a.v, b.v, -c.v)}; }
  // x86 max/min semantics: the second operand is returned when either is NaN.
  static Vec max(Vec a, Vec b) { return {a.v > b.v ? a.v : b.v}; }
  static Vec min(Vec a, Vec b) { return {a.v < b.v ? a.v : b.v}; }
  static Vec sqrt(Vec a) { return {std::sqrt(a.v)}; }
  static Vec reciprocal(Vec d) { return {1.0f / d.v}; }
  static Vec round(Vec a) { return {std::nearbyint(a.v)}; }
  // a * 2^n for integral n (NaN n gives NaN).
  static Vec scalef(Vec a, Vec n) {
    return {std::isnan(n.v) ? n.v : std::ldexp(a.v, int(n.v))};
  }

  static Mask cmp_gt(Vec a, Vec b) { return a.v > b.v; }
  static Mask cmp_ge(Vec a, Vec b) { return a.v >= b.v; }
  static Mask cmp_lt(Vec a, Vec b) { return a.v < b.v; }
  static Mask cmp_eq(Vec a, Vec b) { return a.v == b.v; }
  static Mask is_nan(Vec a) { return std::isnan(a.v); }
  // m ? a : b, lane by lane.
  static Vec select(Mask m, Vec a, Vec b) { return m ? a : b; }

  // The approximate score of cpu/score_pieces.h, the same operations as the vector layers.
  using PiecesSeen = bool;  // true once a value fell outside the pieces
  static PiecesSeen no_pieces_seen() { return false; }
  static bool all_pieces_inside(PiecesSeen outside) { return !outside; }
  static Vec piecewise_cubic(Vec x, const ScorePieces& pieces, PiecesSeen& outside) {
    const float t = std::fma(x.v, kPieceScale, kPieceOffset);
    if (!(t >= 0.0f && t < float(kScorePieces))) {  // NaN fails too
      outside = true;
      return {0.0f};
    }
    const float whole = std::floor(t);
    const int piece = int(whole);
    const float u = t - whole;
    float p = pieces.coef[3][piece];
    p = std::fma(p, u, pieces.coef[2][piece]);
    p = std::fma(p, u, pieces.coef[1][piece]);
    return {std::fma(p, u, pieces.coef[0][piece])};
  }

  static float reduce_max(Vec a) { return a.v; }
  static float reduce_min(Vec a) { return a.v; }
  static Vec broadcast_lane(Vec a, int64_t /*j*/) { return a; }
  static float reduce_add(Vec a) { return a.v; }

  static Vec count_true(Vec acc, Mask m) { return {m ? acc.v + 1.0f : acc.v}; }
  // acc + 1 in the lanes that vj beats: larger than v, or equal and after vj's position
  // (the lanes of `later`, which are lanes later_from.. of this vector; a layer uses
  // whichever form it computes faster).
  static Vec count_beaten(Vec acc, Vec vj, Vec v, Mask later, int64_t /*later_from*/) {
    return count_true(acc, cmp_gt(vj, v) | (cmp_eq(vj, v) & later));
  }
  static int compress_store(Vec x, Mask m, int32_t first_index, float* values,
                            int32_t* indices) {
    values[0] = x.v;
    indices[0] = first_index;
    return m ? 1 : 0;
  }
  static Vec append_compressed(Vec acc, Vec x, Mask m, int count) {
    return m && count == 0 ? x : acc;
  }
  // The k-th largest of v[0, n), n = 1 or 2 (values, not NaN).
  static constexpr int kMaxKthVecs = 2;
  static float kth_largest(const Vec* v, int n, int64_t k) {
    if (n == 1) return v[0].v;
    const float hi = v[0].v > v[1].v ? v[0].v : v[1].v;
    const float lo = v[0].v > v[1].v ? v[1].v : v[0].v;
    return k == 1 ? hi : lo;
  }
  // One lane holds one group: its running top-2 is already the group's.
  template <int kGroups>
  static void reduce_groups_top2(Vec* /*first*/, Vec* /*second*/) {
    static_assert(kGroups == 1, "one group per lane");
  }
};

}  // namespace moeext::cpu::MOEEXT_CPU_ISA
