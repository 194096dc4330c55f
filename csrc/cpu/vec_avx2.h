// 8 x fp32 lanes of AVX2 (with FMA and F16C), for the CPUs without AVX-512: AMD Zen 1-3 and
// most Intel client parts. Only compiled into the avx2 copy of each kernel; dispatch.cpp calls
// that copy only on a CPU that reports AVX2, FMA and F16C.
//
// AVX2 has no mask registers. Masks are bit sets (bit i = lane i) as on the portable layer, so
// the kernels keep their integer mask logic unchanged; the operations that need a lane mask
// widen the bits with a broadcast, an AND and a compare.
#pragma once

#include <immintrin.h>

#include <array>
#include <cstdint>

#include "cpu/score_pieces.h"
#include "cpu/types.h"

namespace moeext::cpu::MOEEXT_CPU_ISA {

namespace avx2_detail {

// kCompress[m]: the lanes set in m, in order, as byte indices (unused bytes 0); a permute by
// them packs those lanes to the front. The AVX-512 compress instruction, done by table.
constexpr std::array<uint64_t, 256> make_compress_table() {
  std::array<uint64_t, 256> table{};
  for (unsigned m = 0; m < 256; ++m) {
    uint64_t packed = 0;
    int slot = 0;
    for (unsigned lane = 0; lane < 8; ++lane) {
      if (m & (1u << lane)) packed |= uint64_t(lane) << (8 * slot++);
    }
    table[m] = packed;
  }
  return table;
}
inline constexpr std::array<uint64_t, 256> kCompress = make_compress_table();

inline __m256i compress_indices(uint32_t m) {
  return _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(kCompress[m & 0xffu])));
}

// acc + 1 in the lanes set in `lanes` (compare results, all ones or zero): the rank counters'
// step, shared by Vec's count_* functions.
inline __m256 add_one_where(__m256 acc, __m256 lanes) {
  return _mm256_add_ps(acc, _mm256_and_ps(lanes, _mm256_set1_ps(1.0f)));
}

}  // namespace avx2_detail

struct Vec {
  static constexpr int kWidth = 8;
  using Mask = uint32_t;
  __m256 v;

  static Vec set1(float x) { return {_mm256_set1_ps(x)}; }
  static Mask tail_mask(int64_t n) {
    return n >= 8 ? Mask(0xff) : n <= 0 ? Mask(0) : Mask((1u << n) - 1u);
  }
  // All ones in the lanes of m.
  static __m256i lanes(Mask m) {
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(int(m)), bit), bit);
  }

  static Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }  // a whole vector
  // Masked loads touch no memory outside m (maskload does not fault there); a full mask takes
  // the plain load.
  static Vec load(const float* p, Mask m, float fill) {
    if (m == 0xff) return {_mm256_loadu_ps(p)};
    const __m256i in = lanes(m);
    return {_mm256_blendv_ps(_mm256_set1_ps(fill), _mm256_maskload_ps(p, in),
                             _mm256_castsi256_ps(in))};
  }
  static Vec load(const bf16_t* p, Mask m, float fill) {
    const __m256i h = _mm256_cvtepu16_epi32(load_halves(p, m));
    return {blend_fill(m, _mm256_castsi256_ps(_mm256_slli_epi32(h, 16)), fill)};
  }
  // vec_avx512.h's pair loads on 8 lanes.
  static constexpr bool kHasBf16Pairs = true;
  static void load_pair(const bf16_t* p, Vec& even, Vec& odd) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    even = {_mm256_castsi256_ps(_mm256_slli_epi32(w, 16))};
    odd = {_mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(int(0xffff0000u))))};
  }
  static void interleave_pair(Vec even, Vec odd, Vec& low, Vec& high) {
    // Within each 128-bit half: values 0-3 | 8-11 in a, 4-7 | 12-15 in b.
    const __m256 a = _mm256_unpacklo_ps(even.v, odd.v);
    const __m256 b = _mm256_unpackhi_ps(even.v, odd.v);
    low = {_mm256_permute2f128_ps(a, b, 0x20)};
    high = {_mm256_permute2f128_ps(a, b, 0x31)};
  }
  static Vec load(const fp16_t* p, Mask m, float fill) {
    return {blend_fill(m, _mm256_cvtph_ps(load_halves(p, m)), fill)};
  }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  void store(float* p, Mask m) const {
    if (m == 0xff) {
      store(p);
    } else {
      _mm256_maskstore_ps(p, lanes(m), v);
    }
  }

  friend Vec operator+(Vec a, Vec b) { return {_mm256_add_ps(a.v, b.v)}; }
  friend Vec operator-(Vec a, Vec b) { return {_mm256_sub_ps(a.v, b.v)}; }
  friend Vec operator*(Vec a, Vec b) { return {_mm256_mul_ps(a.v, b.v)}; }
  friend Vec operator/(Vec a, Vec b) { return {_mm256_div_ps(a.v, b.v)}; }
  static Vec fmadd(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  static Vec fnmsub(Vec a, Vec b, Vec c) { return {_mm256_fnmsub_ps(a.v, b.v, c.v)}; }
  // The second operand is returned when either is NaN (the instruction's own rule).
  static Vec max(Vec a, Vec b) { return {_mm256_max_ps(a.v, b.v)}; }
  static Vec min(Vec a, Vec b) { return {_mm256_min_ps(a.v, b.v)}; }
  static Vec sqrt(Vec a) { return {_mm256_sqrt_ps(a.v)}; }
  // Exact, as on the portable layer: AVX2's estimate has 12 bits, and one Newton step from it
  // leaves about 2^-22, not far enough below the rounding vlog1p_unit relies on.
  static Vec reciprocal(Vec d) { return {_mm256_div_ps(_mm256_set1_ps(1.0f), d.v)}; }
  static Vec round(Vec a) {
    return {_mm256_round_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
  }
  // a * 2^n for integral n with |n| <= 252 (vexp's range is [-150, 129]); NaN n gives NaN.
  // AVX2 has no scalef: two exact powers of two, 2^(n/2) and the rest, each a normal
  // number, so the product rounds once, where it lands below the normal range, as scalef does.
  static Vec scalef(Vec a, Vec n) {
    const __m256i total = _mm256_cvtps_epi32(n.v);
    const __m256i half = _mm256_srai_epi32(total, 1);
    const __m256 r = _mm256_mul_ps(_mm256_mul_ps(a.v, pow2(half)),
                                   pow2(_mm256_sub_epi32(total, half)));
    return {_mm256_blendv_ps(r, n.v, _mm256_cmp_ps(n.v, n.v, _CMP_UNORD_Q))};
  }
  // For integral n in [-126, 127] 2^n is one normal number: one power of two and one product,
  // the same single rounding as scalef's. vec_math.h takes it where every lane allows.
  static constexpr bool kHasScalef = false;
  static Vec scalef_normal(Vec a, Vec n) {
    return {_mm256_mul_ps(a.v, pow2(_mm256_cvtps_epi32(n.v)))};
  }
  // Whether |a| <= bound in every lane (a NaN lane: no).
  static bool all_abs_le(Vec a, float bound) {
    const __m256 abs = _mm256_and_ps(a.v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)));
    return _mm256_movemask_ps(_mm256_cmp_ps(abs, _mm256_set1_ps(bound), _CMP_LE_OQ)) == 0xff;
  }

  static Mask cmp_gt(Vec a, Vec b) { return bits(_mm256_cmp_ps(a.v, b.v, _CMP_GT_OQ)); }
  static Mask cmp_ge(Vec a, Vec b) { return bits(_mm256_cmp_ps(a.v, b.v, _CMP_GE_OQ)); }
  static Mask cmp_lt(Vec a, Vec b) { return bits(_mm256_cmp_ps(a.v, b.v, _CMP_LT_OQ)); }
  static Mask cmp_eq(Vec a, Vec b) { return bits(_mm256_cmp_ps(a.v, b.v, _CMP_EQ_OQ)); }
  static Mask is_nan(Vec a) { return bits(_mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q)); }
  static Vec select(Mask m, Vec a, Vec b) {
    if (m == 0xff) return a;  // folds away for the constant full masks of whole vectors
    return {_mm256_blendv_ps(b.v, a.v, _mm256_castsi256_ps(lanes(m)))};
  }
  // Masks as whole lanes, for selects in a loop (the rows in lanes' insertion): a bit set
  // costs a movemask per compare and three instructions per select to widen it back.
  using LaneMask = __m256;
  static LaneMask lane_mask(Mask m) { return _mm256_castsi256_ps(lanes(m)); }
  static LaneMask lanes_gt(Vec a, Vec b) { return _mm256_cmp_ps(a.v, b.v, _CMP_GT_OQ); }
  static Vec blend(LaneMask m, Vec a, Vec b) { return {_mm256_blendv_ps(b.v, a.v, m)}; }

  // The approximate score of cpu/score_pieces.h (see vec_avx512.h); a 16-entry lookup is two
  // 8-lane permutes and a blend.
  using PiecesSeen = __m256i;
  static PiecesSeen no_pieces_seen() { return _mm256_setzero_si256(); }
  static bool all_pieces_inside(PiecesSeen seen) {
    return _mm256_testz_si256(seen, _mm256_set1_epi32(~(kScorePieces - 1))) != 0;
  }
  static Vec piecewise_cubic(Vec x, const ScorePieces& pieces, PiecesSeen& pieces_seen) {
    const __m256 t =
        _mm256_fmadd_ps(x.v, _mm256_set1_ps(kPieceScale), _mm256_set1_ps(kPieceOffset));
    const __m256 whole = _mm256_floor_ps(t);
    // NaN, inf and huge t give 0x80000000: like every piece past 15 or below 0, a bit above
    // the low four set.
    const __m256i piece = _mm256_cvttps_epi32(whole);
    pieces_seen = _mm256_or_si256(pieces_seen, piece);
    const __m256 u = _mm256_sub_ps(t, whole);
    const __m256 upper = _mm256_castsi256_ps(_mm256_cmpgt_epi32(piece, _mm256_set1_epi32(7)));
    auto lookup = [&](const float* coef) {
      return _mm256_blendv_ps(_mm256_permutevar8x32_ps(_mm256_load_ps(coef), piece),
                              _mm256_permutevar8x32_ps(_mm256_load_ps(coef + 8), piece), upper);
    };
    __m256 p = lookup(pieces.coef[3]);
    p = _mm256_fmadd_ps(p, u, lookup(pieces.coef[2]));
    p = _mm256_fmadd_ps(p, u, lookup(pieces.coef[1]));
    return {_mm256_fmadd_ps(p, u, lookup(pieces.coef[0]))};
  }

  static float reduce_max(Vec a) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
  }
  static float reduce_min(Vec a) {
    __m128 x = _mm_min_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
    x = _mm_min_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_min_ss(x, _mm_movehdup_ps(x)));
  }
  // Lane j of a in every lane (a permute: no round trip through memory).
  static Vec broadcast_lane(Vec a, int64_t j) {
    return {_mm256_permutevar8x32_ps(a.v, _mm256_set1_epi32(int(j)))};
  }
  static float reduce_add(Vec a) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
  }
  // reduce_add lane by lane: lane r of the result is reduce_add of the vector whose lane j is
  // lane r of a[j], in reduce_add's order of additions.
  static Vec reduce_add_lanewise(const Vec* a) {
    return (a[0] + a[4] + (a[2] + a[6])) + (a[1] + a[5] + (a[3] + a[7]));
  }

  // acc + 1 in the lanes of m: a rank counter held in fp32 lanes.
  static Vec count_true(Vec acc, Mask m) {
    return {avx2_detail::add_one_where(acc.v, _mm256_castsi256_ps(lanes(m)))};
  }
  // acc + 1 in the lanes where a > b (count_gt) or a >= b (count_ge), from the compare's lanes:
  // through count_true's bit set, a count took 7 instructions instead of 3.
  static Vec count_gt(Vec acc, Vec a, Vec b) {
    return {avx2_detail::add_one_where(acc.v, _mm256_cmp_ps(a.v, b.v, _CMP_GT_OQ))};
  }
  static Vec count_ge(Vec acc, Vec a, Vec b) {
    return {avx2_detail::add_one_where(acc.v, _mm256_cmp_ps(a.v, b.v, _CMP_GE_OQ))};
  }

  // acc + 1 in the lanes that vj beats: larger than v, or equal and after vj's position
  // (the lanes of `later`, which are lanes later_from.. of this vector; a layer uses
  // whichever form it computes faster). Here all in vector
  // compares: the bit-set masks' round trips through integer registers cost twice the
  // instructions.
  static Vec count_beaten(Vec acc, Vec vj, Vec v, Mask /*later*/, int64_t later_from) {
    const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 later = _mm256_cmp_ps(lane, _mm256_set1_ps(float(later_from)), _CMP_GE_OQ);
    const __m256 beaten = _mm256_or_ps(
        _mm256_cmp_ps(vj.v, v.v, _CMP_GT_OQ),
        _mm256_and_ps(_mm256_cmp_ps(vj.v, v.v, _CMP_EQ_OQ), later));
    return {avx2_detail::add_one_where(acc.v, beaten)};
  }

  // The lanes of m, packed in lane order, to values[0..) and their indices first_index + lane
  // to indices[0..). Always writes all 8 slots of both; returns the number packed.
  static int compress_store(Vec x, Mask m, int32_t first_index, float* values,
                            int32_t* indices) {
    const __m256i from = avx2_detail::compress_indices(m);
    _mm256_storeu_ps(values, _mm256_permutevar8x32_ps(x.v, from));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(indices),
                        _mm256_add_epi32(_mm256_set1_epi32(first_index), from));
    return __builtin_popcount(m);
  }

  // acc with the lanes of m of x, packed in lane order, placed from lane `count` (< 8) on;
  // lanes past 7 are dropped.
  static Vec append_compressed(Vec acc, Vec x, Mask m, int count) {
    const __m256 packed = _mm256_permutevar8x32_ps(x.v, avx2_detail::compress_indices(m));
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    // Lane i takes packed lane i - count (the permute uses the index's low three bits).
    const __m256 moved =
        _mm256_permutevar8x32_ps(packed, _mm256_sub_epi32(lane, _mm256_set1_epi32(count)));
    const Mask place = Mask(((1u << __builtin_popcount(m)) - 1u) << count) & 0xffu;
    return {_mm256_blendv_ps(acc.v, moved, _mm256_castsi256_ps(lanes(place)))};
  }

  // Horizontal top-2 of kGroups (4 or 8) groups at once, as on AVX-512: in, first[g] /
  // second[g] hold lane by lane the largest and second largest value group g has seen in that
  // lane; out, lane g of first[0] / second[0] holds group g's over all its lanes (a repeated
  // maximum counts twice), lanes >= kGroups -inf. Three levels of a transposing merge tree.
  // Forced inline: GCC kept it out of line here (the AVX-512 copy it inlines), so the 2 x 8
  // running vectors went through memory.
  template <int kGroups>
  MOEEXT_ALWAYS_INLINE static void reduce_groups_top2(Vec* first, Vec* second) {
    static_assert(kGroups == 4 || kGroups == 8, "one merge tree of 8 lanes");
    const __m256 neg_inf = _mm256_set1_ps(-__builtin_inff());
    int n = kGroups;
#pragma GCC unroll 3
    for (int level = 0; level < 3; ++level) {
      const int merged = (n + 1) / 2;
#pragma GCC unroll 4
      for (int i = 0; i < merged; ++i) {
        const bool paired = 2 * i + 1 < n;
        const __m256 fa = first[2 * i].v, fb = paired ? first[2 * i + 1].v : neg_inf;
        const __m256 f_lo = fold_lo(level, fa, fb), f_hi = fold_hi(level, fa, fb);
        first[i].v = _mm256_max_ps(f_lo, f_hi);
        const __m256 sa = second[2 * i].v, sb = paired ? second[2 * i + 1].v : neg_inf;
        const __m256 s_max = _mm256_max_ps(fold_lo(level, sa, sb), fold_hi(level, sa, sb));
        second[i].v = _mm256_max_ps(_mm256_min_ps(f_lo, f_hi), s_max);
      }
      n = merged;
    }
    // The tree leaves groups 0, 2, 4, 6, 1, 3, 5, 7 in lanes 0..7.
    const __m256i to_group = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    first[0].v = _mm256_permutevar8x32_ps(first[0].v, to_group);
    second[0].v = _mm256_permutevar8x32_ps(second[0].v, to_group);
  }

  // rows[0, 8) transposed in place: lane j of rows[i] becomes lane i of rows[j]. Pairs of
  // rows interleaved, then pairs of pairs, then the 128-bit halves: 24 shuffles.
  static void transpose(Vec* rows) {
    __m256 a[8], b[8];
    for (int i = 0; i < 8; i += 2) {
      a[i] = _mm256_unpacklo_ps(rows[i].v, rows[i + 1].v);
      a[i + 1] = _mm256_unpackhi_ps(rows[i].v, rows[i + 1].v);
    }
    // b[4q + k], half L: rows 4q..4q+3 of column 4L + k.
    for (int q = 0; q < 2; ++q) {
      b[4 * q + 0] = _mm256_shuffle_ps(a[4 * q], a[4 * q + 2], 0x44);
      b[4 * q + 1] = _mm256_shuffle_ps(a[4 * q], a[4 * q + 2], 0xee);
      b[4 * q + 2] = _mm256_shuffle_ps(a[4 * q + 1], a[4 * q + 3], 0x44);
      b[4 * q + 3] = _mm256_shuffle_ps(a[4 * q + 1], a[4 * q + 3], 0xee);
    }
    for (int k = 0; k < 4; ++k) {
      rows[k].v = _mm256_permute2f128_ps(b[k], b[4 + k], 0x20);
      rows[4 + k].v = _mm256_permute2f128_ps(b[k], b[4 + k], 0x31);
    }
  }

  // The k-th largest (1 <= k <= 8 * n) of the 8 * n values of v[0, n), n = 1, 2 or 4, none
  // NaN: a bitonic sort in registers, as on AVX-512. Four vectors, because 8 lanes' top-2
  // bound only k <= 16 and routers choose up to 22 (see floor_from_alternate_lanes).
  static constexpr int kMaxKthVecs = 4;
  static float kth_largest(const Vec* v, int n, int64_t k) {
    if (n == 1) return pick(sort_desc(v[0].v), k);
    __m256 hi, lo;  // the 16 largest of v[0], v[1], sorted: hi then lo
    merge_sorted(sort_desc(v[0].v), sort_desc(v[1].v), hi, lo);
    if (n == 4) {
      __m256 hi2, lo2;
      merge_sorted(sort_desc(v[2].v), sort_desc(v[3].v), hi2, lo2);
      // Two sorted 16s: against the other reversed, the lane-wise max holds the 16 largest
      // of all 32 as a bitonic sequence, the min the 16 smallest.
      const __m256 rev_lo2 = reverse(lo2), rev_hi2 = reverse(hi2);
      if (k > 16) {
        k -= 16;
        hi = _mm256_min_ps(hi, rev_lo2);
        lo = _mm256_min_ps(lo, rev_hi2);
      } else {
        hi = _mm256_max_ps(hi, rev_lo2);
        lo = _mm256_max_ps(lo, rev_hi2);
      }
      // Sort the bitonic 16: its first half-cleaning step spans the two vectors.
      const __m256 top = _mm256_max_ps(hi, lo), bottom = _mm256_min_ps(hi, lo);
      hi = merge_desc(top);
      lo = merge_desc(bottom);
    }
    return k > 8 ? pick(lo, k - 8) : pick(hi, k);
  }

 private:
  static __m256 reverse(__m256 x) {
    return _mm256_permutevar8x32_ps(x, _mm256_setr_epi32(7, 6, 5, 4, 3, 2, 1, 0));
  }
  // Lane k - 1 of x.
  static float pick(__m256 x, int64_t k) {
    return _mm256_cvtss_f32(_mm256_permutevar8x32_ps(x, _mm256_set1_epi32(int(k - 1))));
  }
  // Two vectors sorted descending merged into one sorted 16: hi then lo.
  static void merge_sorted(__m256 a, __m256 b, __m256& hi, __m256& lo) {
    const __m256 rev_b = reverse(b);
    hi = merge_desc(_mm256_max_ps(a, rev_b));
    lo = merge_desc(_mm256_min_ps(a, rev_b));
  }

  static Mask bits(__m256 lane_mask) { return Mask(_mm256_movemask_ps(lane_mask)); }

  // 2^k for k in [-126, 127], built from its exponent field.
  static __m256 pow2(__m256i k) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(127)), 23));
  }

  // Eight 16-bit values, the lanes outside m zero, reading nothing outside m.
  template <typename T>
  static __m128i load_halves(const T* p, Mask m) {
    if (m == 0xff) return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    alignas(16) uint16_t part[8] = {};
    for (uint32_t rest = m; rest != 0; rest &= rest - 1) {
      const int lane = __builtin_ctz(rest);
      part[lane] = p[lane].bits;
    }
    return _mm_load_si128(reinterpret_cast<const __m128i*>(part));
  }
  static __m256 blend_fill(Mask m, __m256 x, float fill) {
    if (m == 0xff) return x;
    return _mm256_blendv_ps(_mm256_set1_ps(fill), x, _mm256_castsi256_ps(lanes(m)));
  }

  // Lane i against lane i ^ kD, keeping the larger in the lanes of kTakeMax.
  template <int kD, int kTakeMax>
  static __m256 exchange(__m256 x) {
    __m256 partner;
    if constexpr (kD == 1) {
      partner = _mm256_permute_ps(x, _MM_SHUFFLE(2, 3, 0, 1));
    } else if constexpr (kD == 2) {
      partner = _mm256_permute_ps(x, _MM_SHUFFLE(1, 0, 3, 2));
    } else {
      partner = _mm256_permute2f128_ps(x, x, 0x01);
    }
    return _mm256_blend_ps(_mm256_min_ps(x, partner), _mm256_max_ps(x, partner), kTakeMax);
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
  static __m256 sort_desc(__m256 x) {
    x = exchange<1, take_max(1, 2)>(x);
    x = exchange<2, take_max(2, 4)>(x);
    x = exchange<1, take_max(1, 4)>(x);
    return merge_desc(x);
  }
  // A bitonic 8-lane sequence sorted descending.
  static __m256 merge_desc(__m256 x) {
    x = exchange<4, take_max(4, 8)>(x);
    x = exchange<2, take_max(2, 8)>(x);
    return exchange<1, take_max(1, 8)>(x);
  }

  // One level of the merge tree: two vectors whose groups each span 8 >> level lanes become
  // two vectors (lo, hi) whose lane-wise max holds the groups of both, each in half the lanes.
  static __m256 fold_lo(int level, __m256 a, __m256 b) {
    switch (level) {
      case 0: return _mm256_permute2f128_ps(a, b, 0x20);
      case 1: return _mm256_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0));
      default: return _mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0));
    }
  }
  static __m256 fold_hi(int level, __m256 a, __m256 b) {
    switch (level) {
      case 0: return _mm256_permute2f128_ps(a, b, 0x31);
      case 1: return _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2));
      default: return _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1));
    }
  }
};

}  // namespace moeext::cpu::MOEEXT_CPU_ISA
