// 8 x fp32 lanes over the compiler's generic vector types, for the CPUs with neither AVX2 nor
// AVX-512: aarch64 (where the baseline has NEON and FMA) and old x86-64 (SSE2). The copy of a
// kernel compiled with the baseline flags only (MOEEXT_CPU_ISA portable) uses it.
//
// Eight lanes, the width of vec_avx2.h, because every width-dependent choice of the kernels
// (registers per softmax row, the floor's vectors, the groups' merge tree) is tuned and
// tested at 8 on AVX2. Held as two halves of four: GCC 12 splits a 32-byte compare or select
// into single lanes on aarch64, and a 16-byte one is one NEON instruction. Masks are bit sets
// (bit i = lane i), as on AVX2. Products are fused (std::fma per lane: one fmla on aarch64, a
// call on x86-64 without FMA), so that every path gives the same bits.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu/score_pieces.h"
#include "cpu/types.h"

namespace moeext::cpu::MOEEXT_CPU_ISA {

namespace portable_detail {

typedef float F4 __attribute__((vector_size(16)));
typedef int32_t I4 __attribute__((vector_size(16)));
typedef uint32_t U4 __attribute__((vector_size(16)));  // for shifts into the top bit

// Lanes i0..i3 of the eight lanes of a then b.
template <int i0, int i1, int i2, int i3>
MOEEXT_ALWAYS_INLINE F4 shuffle(F4 a, F4 b) {
#if defined(__clang__)
  return __builtin_shufflevector(a, b, i0, i1, i2, i3);
#else
  return __builtin_shuffle(a, b, I4{i0, i1, i2, i3});  // GCC before 12 lacks shufflevector
#endif
}

MOEEXT_ALWAYS_INLINE F4 splat(float x) { return F4{x, x, x, x}; }
// The second operand where either is NaN, as x86's max and min.
MOEEXT_ALWAYS_INLINE F4 max4(F4 a, F4 b) { return a > b ? a : b; }
MOEEXT_ALWAYS_INLINE F4 min4(F4 a, F4 b) { return a < b ? a : b; }
MOEEXT_ALWAYS_INLINE F4 fma4(F4 a, F4 b, F4 c) {
  F4 r;
  for (int i = 0; i < 4; ++i) r[i] = std::fma(a[i], b[i], c[i]);
  return r;
}
// All ones in lane i where bit shift + i of m is set.
MOEEXT_ALWAYS_INLINE I4 lanes4(uint32_t m, int shift) {
  const I4 bit{1, 2, 4, 8};
  return (bit & int32_t(m >> shift)) != 0;
}
// 1.0 in the lanes of a lane mask, else 0.
MOEEXT_ALWAYS_INLINE F4 ones4(I4 lane_mask) { return lane_mask ? splat(1.0f) : splat(0.0f); }
// The same four 32-bit lanes read as another vector type (float <-> integer bits).
template <typename To, typename From>
MOEEXT_ALWAYS_INLINE To lane_bits(From x) {
  static_assert(sizeof(To) == sizeof(From), "four 32-bit lanes");
  To to;
  std::memcpy(&to, &x, sizeof(to));
  return to;
}
// Eight bf16 values read as four 32-bit words: the even ones are the words shifted left by
// 16, the odd ones the words with the low half cleared.
MOEEXT_ALWAYS_INLINE F4 bf16_even(U4 words) { return lane_bits<F4>(words << 16); }
MOEEXT_ALWAYS_INLINE F4 bf16_odd(U4 words) { return lane_bits<F4>(words & 0xffff0000u); }
// fp16 values (each in the low half of a lane) widened exactly, to to_float(fp16_t)'s bits,
// in a handful of lane operations instead of a branch per value. Subnormals come out of a
// subtraction whose operands and result are normal, so the floating-point environment
// (flush-to-zero, denormals-are-zero) cannot change them. NaNs keep their bits, signalling
// ones too (x86's vcvtph2ps quiets those; nothing downstream depends on a NaN's payload).
MOEEXT_ALWAYS_INLINE F4 fp16_to_f4(U4 h) {
  const U4 sign = (h & 0x8000u) << 16;
  const U4 magnitude = (h & 0x7fffu) << 13;  // exponent and mantissa at their fp32 places
  const U4 exponent = magnitude & 0x0f800000u;
  // Exponent 31 (inf, NaN) becomes 255, the others are rebiased from 15 to 127.
  const U4 rebias = exponent == 0x0f800000u ? U4{} + (224u << 23) : U4{} + (112u << 23);
  const U4 normal = magnitude + rebias;
  // Zero and subnormals, m * 2^-24: 2^-14 * (1 + m / 1024) - 2^-14, exact.
  const U4 two_m14 = U4{} + (113u << 23);
  const U4 small = lane_bits<U4>(lane_bits<F4>(magnitude + two_m14) - lane_bits<F4>(two_m14));
  return lane_bits<F4>((exponent == 0u ? small : normal) | sign);
}
MOEEXT_ALWAYS_INLINE F4 load_fp16_4(const fp16_t* p) {
  uint16_t h[4];
  std::memcpy(h, p, sizeof(h));
  return fp16_to_f4(U4{h[0], h[1], h[2], h[3]});
}

}  // namespace portable_detail

// Every operation is forced inline: GCC's inliner weighs the lane loops (before it vectorizes
// them) as large, and left even fmadd out of line in the exp, a call per vector.
struct Vec {
  using F4 = portable_detail::F4;
  using I4 = portable_detail::I4;

  static constexpr int kWidth = 8;
  using Mask = uint32_t;
  F4 lo, hi;  // lanes 0-3 and 4-7

  MOEEXT_ALWAYS_INLINE static Vec set1(float x) {
    return {portable_detail::splat(x), portable_detail::splat(x)};
  }
  MOEEXT_ALWAYS_INLINE static Mask tail_mask(int64_t n) {
    return n >= 8 ? Mask(0xff) : n <= 0 ? Mask(0) : Mask((1u << n) - 1u);
  }

  MOEEXT_ALWAYS_INLINE static Vec load(const float* p) {  // a whole vector
    Vec r;
    std::memcpy(&r.lo, p, sizeof(F4));
    std::memcpy(&r.hi, p + 4, sizeof(F4));
    return r;
  }
  // Reads nothing outside m; a full mask takes whole-vector code.
  template <typename T>
  MOEEXT_ALWAYS_INLINE static Vec load(const T* p, Mask m, float fill) {
    if (m == 0xff) return widen(p);
    float lanes[8];
    for (int i = 0; i < 8; ++i) lanes[i] = (m >> i) & 1u ? to_float(p[i]) : fill;
    return load(lanes);
  }
  // vec_avx512.h's pair loads on 8 lanes: 16 bf16 values as 8 32-bit words.
  static constexpr bool kHasBf16Pairs = true;
  MOEEXT_ALWAYS_INLINE static void load_pair(const bf16_t* p, Vec& even, Vec& odd) {
    portable_detail::U4 w[2];
    std::memcpy(w, p, sizeof(w));
    even = {portable_detail::bf16_even(w[0]), portable_detail::bf16_even(w[1])};
    odd = {portable_detail::bf16_odd(w[0]), portable_detail::bf16_odd(w[1])};
  }
  MOEEXT_ALWAYS_INLINE static void interleave_pair(Vec even, Vec odd, Vec& low, Vec& high) {
    using portable_detail::shuffle;
    low = {shuffle<0, 4, 1, 5>(even.lo, odd.lo), shuffle<2, 6, 3, 7>(even.lo, odd.lo)};
    high = {shuffle<0, 4, 1, 5>(even.hi, odd.hi), shuffle<2, 6, 3, 7>(even.hi, odd.hi)};
  }
  MOEEXT_ALWAYS_INLINE void store(float* p) const {
    std::memcpy(p, &lo, sizeof(F4));
    std::memcpy(p + 4, &hi, sizeof(F4));
  }
  MOEEXT_ALWAYS_INLINE void store(float* p, Mask m) const {
    if (m == 0xff) {
      store(p);
      return;
    }
    float lanes[8];
    store(lanes);
    for (int i = 0; i < 8; ++i) {
      if ((m >> i) & 1u) p[i] = lanes[i];
    }
  }

  MOEEXT_ALWAYS_INLINE friend Vec operator+(Vec a, Vec b) { return {a.lo + b.lo, a.hi + b.hi}; }
  MOEEXT_ALWAYS_INLINE friend Vec operator-(Vec a, Vec b) { return {a.lo - b.lo, a.hi - b.hi}; }
  MOEEXT_ALWAYS_INLINE friend Vec operator*(Vec a, Vec b) { return {a.lo * b.lo, a.hi * b.hi}; }
  MOEEXT_ALWAYS_INLINE friend Vec operator/(Vec a, Vec b) { return {a.lo / b.lo, a.hi / b.hi}; }
  MOEEXT_ALWAYS_INLINE static Vec fmadd(Vec a, Vec b, Vec c) {
    return {portable_detail::fma4(a.lo, b.lo, c.lo), portable_detail::fma4(a.hi, b.hi, c.hi)};
  }
  // -(a * b) - c, fused.
  MOEEXT_ALWAYS_INLINE static Vec fnmsub(Vec a, Vec b, Vec c) {
    return {portable_detail::fma4(-a.lo, b.lo, -c.lo), portable_detail::fma4(-a.hi, b.hi, -c.hi)};
  }
  // x86 max/min semantics: the second operand is returned when either is NaN.
  MOEEXT_ALWAYS_INLINE static Vec max(Vec a, Vec b) {
    return {portable_detail::max4(a.lo, b.lo), portable_detail::max4(a.hi, b.hi)};
  }
  MOEEXT_ALWAYS_INLINE static Vec min(Vec a, Vec b) {
    return {portable_detail::min4(a.lo, b.lo), portable_detail::min4(a.hi, b.hi)};
  }
  MOEEXT_ALWAYS_INLINE static Vec sqrt(Vec a) {
    for (int i = 0; i < 4; ++i) {
      a.lo[i] = __builtin_sqrtf(a.lo[i]);
      a.hi[i] = __builtin_sqrtf(a.hi[i]);
    }
    return a;
  }
  MOEEXT_ALWAYS_INLINE static Vec reciprocal(Vec d) { return set1(1.0f) / d; }
  MOEEXT_ALWAYS_INLINE static Vec round(Vec a) {
    for (int i = 0; i < 4; ++i) {
      a.lo[i] = __builtin_nearbyintf(a.lo[i]);
      a.hi[i] = __builtin_nearbyintf(a.hi[i]);
    }
    return a;
  }
  // a * 2^n for integral n with |n| <= 252 (vexp's range is [-150, 129]); NaN n gives NaN.
  // As on AVX2: two exact powers of two, 2^(n/2) and the rest, each a normal number, so the
  // product rounds once, where it lands below the normal range, as AVX-512's scalef does.
  MOEEXT_ALWAYS_INLINE static Vec scalef(Vec a, Vec n) {
    return {scalef4(a.lo, n.lo), scalef4(a.hi, n.hi)};
  }
  // vec_avx2.h's shortcut for n in [-126, 127]: one power of two, the same single rounding.
  static constexpr bool kHasScalef = false;
  MOEEXT_ALWAYS_INLINE static Vec scalef_normal(Vec a, Vec n) {
    return {a.lo * pow2_4(__builtin_convertvector(n.lo, I4)),
            a.hi * pow2_4(__builtin_convertvector(n.hi, I4))};
  }
  MOEEXT_ALWAYS_INLINE static bool all_abs_le(Vec a, float bound) {
    const F4 hi = portable_detail::splat(bound);
    const F4 lo = portable_detail::splat(-bound);
    return bits((a.lo <= hi) & (a.lo >= lo), (a.hi <= hi) & (a.hi >= lo)) == 0xff;
  }

  MOEEXT_ALWAYS_INLINE static Mask cmp_gt(Vec a, Vec b) { return bits(a.lo > b.lo, a.hi > b.hi); }
  MOEEXT_ALWAYS_INLINE static Mask cmp_ge(Vec a, Vec b) { return bits(a.lo >= b.lo, a.hi >= b.hi); }
  MOEEXT_ALWAYS_INLINE static Mask cmp_lt(Vec a, Vec b) { return bits(a.lo < b.lo, a.hi < b.hi); }
  MOEEXT_ALWAYS_INLINE static Mask cmp_eq(Vec a, Vec b) { return bits(a.lo == b.lo, a.hi == b.hi); }
  MOEEXT_ALWAYS_INLINE static Mask is_nan(Vec a) { return bits(a.lo != a.lo, a.hi != a.hi); }
  // m ? a : b, lane by lane.
  MOEEXT_ALWAYS_INLINE static Vec select(Mask m, Vec a, Vec b) {
    if (m == 0xff) return a;  // folds away for the constant full masks of whole vectors
    return {portable_detail::lanes4(m, 0) ? a.lo : b.lo,
            portable_detail::lanes4(m, 4) ? a.hi : b.hi};
  }
  // Masks as selects take them (vec_avx2.h widens its bit sets into lanes): here bit sets.
  using LaneMask = Mask;
  MOEEXT_ALWAYS_INLINE static LaneMask lane_mask(Mask m) { return m; }
  MOEEXT_ALWAYS_INLINE static LaneMask lanes_gt(Vec a, Vec b) { return cmp_gt(a, b); }
  MOEEXT_ALWAYS_INLINE static Vec blend(LaneMask m, Vec a, Vec b) { return select(m, a, b); }

  // The approximate score of cpu/score_pieces.h. The pieces are looked up lane by lane: a
  // generic vector type has no variable permute that compiles well on both NEON and SSE2.
  using PiecesSeen = I4;  // all ones in a lane once a value there fell outside the pieces
  MOEEXT_ALWAYS_INLINE static PiecesSeen no_pieces_seen() { return I4{}; }
  MOEEXT_ALWAYS_INLINE static bool all_pieces_inside(PiecesSeen seen) {
    return (seen[0] | seen[1] | seen[2] | seen[3]) == 0;
  }
  MOEEXT_ALWAYS_INLINE static Vec piecewise_cubic(Vec x, const ScorePieces& pieces,
                                                  PiecesSeen& pieces_seen) {
    return {piecewise_cubic4(x.lo, pieces, pieces_seen),
            piecewise_cubic4(x.hi, pieces, pieces_seen)};
  }

  // The reductions in vec_avx2.h's order (halves, then pairs), so that both give the same bits.
  MOEEXT_ALWAYS_INLINE static float reduce_max(Vec a) {
    const F4 x = portable_detail::max4(a.lo, a.hi);
    const float x0 = x[0] > x[2] ? x[0] : x[2], x1 = x[1] > x[3] ? x[1] : x[3];
    return x0 > x1 ? x0 : x1;
  }
  MOEEXT_ALWAYS_INLINE static float reduce_min(Vec a) {
    const F4 x = portable_detail::min4(a.lo, a.hi);
    const float x0 = x[0] < x[2] ? x[0] : x[2], x1 = x[1] < x[3] ? x[1] : x[3];
    return x0 < x1 ? x0 : x1;
  }
  MOEEXT_ALWAYS_INLINE static Vec broadcast_lane(Vec a, int64_t j) { return set1(lane(a, j)); }
  MOEEXT_ALWAYS_INLINE static float reduce_add(Vec a) {
    const F4 x = a.lo + a.hi;
    return (x[0] + x[2]) + (x[1] + x[3]);
  }

  // acc + 1 in the lanes of m: a rank counter held in fp32 lanes.
  MOEEXT_ALWAYS_INLINE static Vec count_true(Vec acc, Mask m) {
    using portable_detail::lanes4;
    using portable_detail::ones4;
    return {acc.lo + ones4(lanes4(m, 0)), acc.hi + ones4(lanes4(m, 4))};
  }
  // acc + 1 in the lanes where a > b (count_gt) or a >= b (count_ge).
  MOEEXT_ALWAYS_INLINE static Vec count_gt(Vec acc, Vec a, Vec b) {
    return count_true(acc, cmp_gt(a, b));
  }
  MOEEXT_ALWAYS_INLINE static Vec count_ge(Vec acc, Vec a, Vec b) {
    return count_true(acc, cmp_ge(a, b));
  }
  // acc + 1 in the lanes that vj beats: larger than v, or equal and after vj's position
  // (the lanes of `later`, which are lanes later_from.. of this vector; a layer uses
  // whichever form it computes faster). All in vector compares, as on AVX2.
  MOEEXT_ALWAYS_INLINE static Vec count_beaten(Vec acc, Vec vj, Vec v, Mask /*later*/,
                                               int64_t later_from) {
    using portable_detail::ones4;
    const I4 from = I4{} + int32_t(later_from);
    const I4 beaten_lo = (vj.lo > v.lo) | ((vj.lo == v.lo) & (I4{0, 1, 2, 3} >= from));
    const I4 beaten_hi = (vj.hi > v.hi) | ((vj.hi == v.hi) & (I4{4, 5, 6, 7} >= from));
    return {acc.lo + ones4(beaten_lo), acc.hi + ones4(beaten_hi)};
  }

  // The lanes of m, packed in lane order, to values[0..) and their indices first_index + lane
  // to indices[0..). Writes slots up to the count (at most all 8); returns the count.
  MOEEXT_ALWAYS_INLINE static int compress_store(Vec x, Mask m, int32_t first_index,
                                                float* values, int32_t* indices) {
    float lanes[8];
    x.store(lanes);
    int count = 0;
    for (int i = 0; i < 8; ++i) {  // branch-free: slot `count` is overwritten until taken
      values[count] = lanes[i];
      indices[count] = first_index + i;
      count += int((m >> i) & 1u);
    }
    return count;
  }
  // acc with the lanes of m of x, packed in lane order, placed from lane `count` (< 8) on;
  // lanes past 7 are dropped.
  MOEEXT_ALWAYS_INLINE static Vec append_compressed(Vec acc, Vec x, Mask m, int count) {
    float out[8], lanes[8];
    acc.store(out);
    x.store(lanes);
    for (uint32_t rest = m; rest != 0 && count < 8; rest &= rest - 1) {
      out[count++] = lanes[__builtin_ctz(rest)];
    }
    return load(out);
  }

  // Horizontal top-2 of kGroups (4 or 8) groups at once, vec_avx2.h's merge tree with its
  // 256-bit permutes taken half by half: in, first[g] / second[g] hold lane by lane the
  // largest and second largest value group g has seen in that lane; out, lane g of first[0] /
  // second[0] holds group g's over all its lanes (a repeated maximum counts twice), lanes
  // >= kGroups -inf.
  template <int kGroups>
  MOEEXT_ALWAYS_INLINE static void reduce_groups_top2(Vec* first, Vec* second) {
    static_assert(kGroups == 4 || kGroups == 8, "one merge tree of 8 lanes");
    const Vec neg_inf = set1(-__builtin_inff());
    int n = kGroups;
#pragma GCC unroll 3
    for (int level = 0; level < 3; ++level) {
      const int merged = (n + 1) / 2;
#pragma GCC unroll 4
      for (int i = 0; i < merged; ++i) {
        const bool paired = 2 * i + 1 < n;
        const Vec fa = first[2 * i], fb = paired ? first[2 * i + 1] : neg_inf;
        const Vec f_lo = fold_lo(level, fa, fb), f_hi = fold_hi(level, fa, fb);
        const Vec sa = second[2 * i], sb = paired ? second[2 * i + 1] : neg_inf;
        const Vec s_max = max(fold_lo(level, sa, sb), fold_hi(level, sa, sb));
        first[i] = max(f_lo, f_hi);
        second[i] = max(min(f_lo, f_hi), s_max);
      }
      n = merged;
    }
    // The tree leaves groups 0, 2, 4, 6, 1, 3, 5, 7 in lanes 0..7.
    first[0] = to_group_order(first[0]);
    second[0] = to_group_order(second[0]);
  }

  // The k-th largest (1 <= k <= 8 * n) of the 8 * n values of v[0, n), n = 1, 2 or 4, none
  // NaN: vec_avx2.h's bitonic sort in registers, step for step.
  static constexpr int kMaxKthVecs = 4;
  static float kth_largest(const Vec* v, int n, int64_t k) {
    if (n == 1) return lane(sort_desc(v[0]), k - 1);
    Vec hi, lo;  // the 16 largest of v[0], v[1], sorted: hi then lo
    merge_sorted(sort_desc(v[0]), sort_desc(v[1]), hi, lo);
    if (n == 4) {
      Vec hi2, lo2;
      merge_sorted(sort_desc(v[2]), sort_desc(v[3]), hi2, lo2);
      // Two sorted 16s: against the other reversed, the lane-wise max holds the 16 largest
      // of all 32 as a bitonic sequence, the min the 16 smallest.
      const Vec rev_lo2 = reverse(lo2), rev_hi2 = reverse(hi2);
      if (k > 16) {
        k -= 16;
        hi = min(hi, rev_lo2);
        lo = min(lo, rev_hi2);
      } else {
        hi = max(hi, rev_lo2);
        lo = max(lo, rev_hi2);
      }
      const Vec top = max(hi, lo), bottom = min(hi, lo);
      hi = merge_desc(top);
      lo = merge_desc(bottom);
    }
    return k > 8 ? lane(lo, k - 9) : lane(hi, k - 1);
  }

 private:
  // Through memory: GCC 12 miscompiles a subscript with a variable index into a vector
  // type at -O2 and above (lanes appended by append_compressed went missing).
  MOEEXT_ALWAYS_INLINE static float lane(Vec a, int64_t i) {
    float lanes[8];
    a.store(lanes);
    return lanes[i];
  }

  template <typename T>
  MOEEXT_ALWAYS_INLINE static Vec widen(const T* p) {
    return {F4{to_float(p[0]), to_float(p[1]), to_float(p[2]), to_float(p[3])},
            F4{to_float(p[4]), to_float(p[5]), to_float(p[6]), to_float(p[7])}};
  }
  MOEEXT_ALWAYS_INLINE static Vec widen(const float* p) { return load(p); }
  MOEEXT_ALWAYS_INLINE static Vec widen(const fp16_t* p) {
    return {portable_detail::load_fp16_4(p), portable_detail::load_fp16_4(p + 4)};
  }

  MOEEXT_ALWAYS_INLINE static Mask bits(I4 lo, I4 hi) {
    I4 x = (lo & I4{1, 2, 4, 8}) | (hi & I4{16, 32, 64, 128});
    return Mask(x[0] | x[1] | x[2] | x[3]);
  }

  // 2^k for k in [-126, 127], built from its exponent field.
  MOEEXT_ALWAYS_INLINE static F4 pow2_4(I4 k) {
    return portable_detail::lane_bits<F4>((k + 127) << 23);
  }
  MOEEXT_ALWAYS_INLINE static F4 scalef4(F4 a, F4 n) {
    const I4 is_nan = n != n;
    const I4 total = __builtin_convertvector(is_nan ? portable_detail::splat(0.0f) : n, I4);
    const I4 half = total >> 1;
    const F4 r = a * pow2_4(half) * pow2_4(total - half);
    return is_nan ? n : r;
  }

  MOEEXT_ALWAYS_INLINE static F4 piecewise_cubic4(F4 x, const ScorePieces& pieces,
                                                  I4& pieces_seen) {
    using portable_detail::fma4;
    using portable_detail::splat;
    const F4 t = fma4(x, splat(kPieceScale), splat(kPieceOffset));
    const I4 inside = (t >= splat(0.0f)) & (t < splat(float(kScorePieces)));  // NaN: outside
    pieces_seen |= ~inside;
    F4 whole;
    for (int i = 0; i < 4; ++i) whole[i] = __builtin_floorf(t[i]);
    const I4 piece = __builtin_convertvector(inside ? whole : splat(0.0f), I4);
    const F4 u = t - whole;
    auto lookup = [&](const float* coef) {
      return F4{coef[piece[0]], coef[piece[1]], coef[piece[2]], coef[piece[3]]};
    };
    F4 p = lookup(pieces.coef[3]);
    p = fma4(p, u, lookup(pieces.coef[2]));
    p = fma4(p, u, lookup(pieces.coef[1]));
    return fma4(p, u, lookup(pieces.coef[0]));
  }

  // One level of the merge tree (vec_avx2.h's fold_lo / fold_hi): two vectors whose groups
  // each span 8 >> level lanes become two whose lane-wise max holds the groups of both.
  MOEEXT_ALWAYS_INLINE static Vec fold_lo(int level, Vec a, Vec b) {
    using portable_detail::shuffle;
    switch (level) {
      case 0: return {a.lo, b.lo};
      case 1: return {shuffle<0, 1, 4, 5>(a.lo, b.lo), shuffle<0, 1, 4, 5>(a.hi, b.hi)};
      default: return {shuffle<0, 2, 4, 6>(a.lo, b.lo), shuffle<0, 2, 4, 6>(a.hi, b.hi)};
    }
  }
  MOEEXT_ALWAYS_INLINE static Vec fold_hi(int level, Vec a, Vec b) {
    using portable_detail::shuffle;
    switch (level) {
      case 0: return {a.hi, b.hi};
      case 1: return {shuffle<2, 3, 6, 7>(a.lo, b.lo), shuffle<2, 3, 6, 7>(a.hi, b.hi)};
      default: return {shuffle<1, 3, 5, 7>(a.lo, b.lo), shuffle<1, 3, 5, 7>(a.hi, b.hi)};
    }
  }
  MOEEXT_ALWAYS_INLINE static Vec to_group_order(Vec x) {
    using portable_detail::shuffle;
    return {shuffle<0, 4, 1, 5>(x.lo, x.hi), shuffle<2, 6, 3, 7>(x.lo, x.hi)};
  }

  MOEEXT_ALWAYS_INLINE static Vec reverse(Vec x) {
    using portable_detail::shuffle;
    return {shuffle<3, 2, 1, 0>(x.hi, x.hi), shuffle<3, 2, 1, 0>(x.lo, x.lo)};
  }
  // Two vectors sorted descending merged into one sorted 16: hi then lo.
  MOEEXT_ALWAYS_INLINE static void merge_sorted(Vec a, Vec b, Vec& hi, Vec& lo) {
    const Vec rev_b = reverse(b);
    hi = merge_desc(max(a, rev_b));
    lo = merge_desc(min(a, rev_b));
  }
  // Lane i against lane i ^ kD, keeping the larger in the lanes of kTakeMax.
  template <int kD, int kTakeMax>
  MOEEXT_ALWAYS_INLINE static Vec exchange(Vec x) {
    using portable_detail::shuffle;
    Vec partner;
    if constexpr (kD == 1) {
      partner = {shuffle<1, 0, 3, 2>(x.lo, x.lo), shuffle<1, 0, 3, 2>(x.hi, x.hi)};
    } else if constexpr (kD == 2) {
      partner = {shuffle<2, 3, 0, 1>(x.lo, x.lo), shuffle<2, 3, 0, 1>(x.hi, x.hi)};
    } else {
      partner = {x.hi, x.lo};
    }
    const Vec larger = max(x, partner), smaller = min(x, partner);
    constexpr Mask take = Mask(kTakeMax);
    return {portable_detail::lanes4(take, 0) ? larger.lo : smaller.lo,
            portable_detail::lanes4(take, 4) ? larger.hi : smaller.hi};
  }
  // Lanes i with (i & d) == 0 XOR (i & size) != 0 take the max: blocks of `size` sorted
  // descending and ascending in turn; the last stage (size 8) is all descending.
  static constexpr int take_max(int d, int size) {
    int m = 0;
    for (int i = 0; i < 8; ++i) {
      if (((i & d) == 0) != ((i & size) != 0)) m |= 1 << i;
    }
    return m;
  }
  MOEEXT_ALWAYS_INLINE static Vec sort_desc(Vec x) {
    x = exchange<1, take_max(1, 2)>(x);
    x = exchange<2, take_max(2, 4)>(x);
    x = exchange<1, take_max(1, 4)>(x);
    return merge_desc(x);
  }
  // A bitonic 8-lane sequence sorted descending.
  MOEEXT_ALWAYS_INLINE static Vec merge_desc(Vec x) {
    x = exchange<4, take_max(4, 8)>(x);
    x = exchange<2, take_max(2, 8)>(x);
    return exchange<1, take_max(1, 8)>(x);
  }
};

}  // namespace moeext::cpu::MOEEXT_CPU_ISA
