// 16 x fp32 lanes of AVX-512 (F, BW, VL, DQ). Only compiled into the avx512 copy of each
// kernel; dispatch.cpp calls that copy only on a CPU that reports AVX-512.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "cpu/score_pieces.h"
#include "cpu/types.h"

namespace moeext::cpu::MOEEXT_CPU_ISA {

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
  // A whole vector. Loop-carried local arrays stay in registers across this load; across
  // the masked load's builtin, even with the full mask, GCC stored them to memory again on
  // every iteration (in the rows-in-lanes insertion: 12 stores per expert).
  static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec load(const bf16_t* p, Mask m, float fill) {
    const __m256i h = _mm256_maskz_loadu_epi16(m, p);
    const __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return {_mm512_mask_blend_ps(m, _mm512_set1_ps(fill), x)};
  }
  // 2W bf16 values widened without a lane-crossing shuffle: the even-indexed ones into even,
  // the odd-indexed into odd (a shift and a mask of each 32-bit pair). interleave_pair puts
  // two such results back in index order, values 0..W-1 into low and W..2W-1 into high.
  // (vpmovzxwd shares the shuffle pipes with the permutes of piecewise_cubic.)
  static constexpr bool kHasBf16Pairs = true;
  static void load_pair(const bf16_t* p, Vec& even, Vec& odd) {
    const __m512i w = _mm512_loadu_si512(p);
    even = {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
    odd = {_mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(int(0xffff0000u))))};
  }
  static void interleave_pair(Vec even, Vec odd, Vec& low, Vec& high) {
    const __m512i to_low =
        _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i to_high =
        _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    low = {_mm512_permutex2var_ps(even.v, to_low, odd.v)};
    high = {_mm512_permutex2var_ps(even.v, to_high, odd.v)};
  }
  static Vec load(const fp16_t* p, Mask m, float fill) {
    const __m256i h = _mm256_maskz_loadu_epi16(m, p);
    return {_mm512_mask_blend_ps(m, _mm512_set1_ps(fill), _mm512_cvtph_ps(h))};
  }
  // Stores are unmasked wherever they can be: a load soon after a masked store waits for it
  // to reach the cache (masked stores do not forward to loads), so a full mask takes the
  // plain store.
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void store(float* p, Mask m) const {
    if (m == 0xffff) {
      store(p);
    } else {
      _mm512_mask_storeu_ps(p, m, v);
    }
  }

  friend Vec operator+(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
  friend Vec operator-(Vec a, Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
  friend Vec operator*(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
  friend Vec operator/(Vec a, Vec b) { return {_mm512_div_ps(a.v, b.v)}; }
  static Vec fmadd(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  static Vec fnmsub(Vec a, Vec b, Vec c) { return {_mm512_fnmsub_ps(a.v, b.v, c.v)}; }
  // The second operand is returned when either is NaN (the instruction's own rule).
  static Vec max(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }
  static Vec min(Vec a, Vec b) { return {_mm512_min_ps(a.v, b.v)}; }
  static Vec sqrt(Vec a) { return {_mm512_sqrt_ps(a.v)}; }
  // 1 / d to within about 2^-27 relative: the 14-bit estimate and one Newton step, without
  // the divider. Only for d in [2, 3] (vlog1p_unit): no fix-up of 0, inf or denormal results.
  static Vec reciprocal(Vec d) {
    const __m512 y0 = _mm512_rcp14_ps(d.v);
    return {_mm512_fmadd_ps(y0, _mm512_fnmadd_ps(d.v, y0, _mm512_set1_ps(1.0f)), y0)};
  }
  static Vec round(Vec a) {
    return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
  }
  static Vec scalef(Vec a, Vec n) { return {_mm512_scalef_ps(a.v, n.v)}; }
  static constexpr bool kHasScalef = true;

  static Mask cmp_gt(Vec a, Vec b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_GT_OQ); }
  static Mask cmp_ge(Vec a, Vec b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_GE_OQ); }
  static Mask cmp_lt(Vec a, Vec b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_LT_OQ); }
  static Mask cmp_eq(Vec a, Vec b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_EQ_OQ); }
  static Mask is_nan(Vec a) { return _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q); }
  static Vec select(Mask m, Vec a, Vec b) { return {_mm512_mask_blend_ps(m, b.v, a.v)}; }
  // Masks as selects take them (vec_avx2.h widens its bit sets into lanes): here the same.
  using LaneMask = Mask;
  static LaneMask lane_mask(Mask m) { return m; }
  static LaneMask lanes_gt(Vec a, Vec b) { return cmp_gt(a, b); }
  static Vec blend(LaneMask m, Vec a, Vec b) { return select(m, a, b); }

  // The approximate score of cpu/score_pieces.h: with t = x * kPieceScale + kPieceOffset, the
  // cubic of piece floor(t) at u = t - floor(t), each coefficient looked up by one permute.
  // The piece indices are OR-ed into pieces_seen; all_pieces_inside(pieces_seen) is false once
  // a lane's t was outside [0, 16) (NaN included), whose value is meaningless. (An OR per
  // vector instead of a compare into a mask and a kor: those two share the compare and permute
  // pipes with the lookups.)
  using PiecesSeen = __m512i;
  static PiecesSeen no_pieces_seen() { return _mm512_setzero_si512(); }
  static bool all_pieces_inside(PiecesSeen seen) {
    return _mm512_test_epi32_mask(seen, _mm512_set1_epi32(~(kScorePieces - 1))) == 0;
  }
  static Vec piecewise_cubic(Vec x, const ScorePieces& pieces, PiecesSeen& pieces_seen) {
    const __m512 t =
        _mm512_fmadd_ps(x.v, _mm512_set1_ps(kPieceScale), _mm512_set1_ps(kPieceOffset));
    // Rounded down, so t in (-1, 0) gives -1; NaN, inf and huge t give 0x80000000: every
    // index outside [0, 16) has a bit above the low four set.
    const __m512i piece = _mm512_cvt_roundps_epi32(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    pieces_seen = _mm512_or_si512(pieces_seen, piece);
    // t - floor(t) in one instruction (exact: the fraction bits of t).
    const __m512 u = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 p = _mm512_permutexvar_ps(piece, _mm512_load_ps(pieces.coef[3]));
    p = _mm512_fmadd_ps(p, u, _mm512_permutexvar_ps(piece, _mm512_load_ps(pieces.coef[2])));
    p = _mm512_fmadd_ps(p, u, _mm512_permutexvar_ps(piece, _mm512_load_ps(pieces.coef[1])));
    return {_mm512_fmadd_ps(p, u, _mm512_permutexvar_ps(piece, _mm512_load_ps(pieces.coef[0])))};
  }

  static float reduce_max(Vec a) { return _mm512_reduce_max_ps(a.v); }
  static float reduce_min(Vec a) { return _mm512_reduce_min_ps(a.v); }
  // Lane j of a in every lane (a permute: no round trip through memory).
  static Vec broadcast_lane(Vec a, int64_t j) {
    return {_mm512_permutexvar_ps(_mm512_set1_epi32(int(j)), a.v)};
  }

  static float reduce_add(Vec a) { return _mm512_reduce_add_ps(a.v); }

  // acc + 1 in the lanes of m: a rank counter held in fp32 lanes (exact far beyond 2^10).
  static Vec count_true(Vec acc, Mask m) {
    return {_mm512_mask_add_ps(acc.v, m, acc.v, _mm512_set1_ps(1.0f))};
  }
  // acc + 1 in the lanes where a > b (count_gt) or a >= b (count_ge): count_true's masked add,
  // written out (as count_true(acc, cmp_gt(a, b)) GCC inlined the copy differently).
  static Vec count_gt(Vec acc, Vec a, Vec b) {
    return {_mm512_mask_add_ps(acc.v, _mm512_cmp_ps_mask(a.v, b.v, _CMP_GT_OQ), acc.v,
                               _mm512_set1_ps(1.0f))};
  }
  static Vec count_ge(Vec acc, Vec a, Vec b) {
    return {_mm512_mask_add_ps(acc.v, _mm512_cmp_ps_mask(a.v, b.v, _CMP_GE_OQ), acc.v,
                               _mm512_set1_ps(1.0f))};
  }

  // acc + 1 in the lanes that vj beats: larger than v, or equal and after vj's position
  // (the lanes of `later`, which are lanes later_from.. of this vector; a layer uses
  // whichever form it computes faster).
  static Vec count_beaten(Vec acc, Vec vj, Vec v, Mask later, int64_t /*later_from*/) {
    return count_true(acc, cmp_gt(vj, v) | (cmp_eq(vj, v) & later));
  }

  // The lanes of m, packed in lane order, to values[0..) and their indices first_index + lane
  // to indices[0..). Always writes all 16 slots of both (room for them is the caller's);
  // returns the number packed. Compressing in a register and storing whole vectors, because
  // the compress-to-memory form is microcoded and slow on AMD.
  static int compress_store(Vec x, Mask m, int32_t first_index, float* values,
                            int32_t* indices) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    _mm512_storeu_ps(values, _mm512_maskz_compress_ps(m, x.v));
    _mm512_storeu_si512(indices, _mm512_maskz_compress_epi32(
                                     m, _mm512_add_epi32(_mm512_set1_epi32(first_index), lane)));
    return __builtin_popcount(m);
  }

  // The lanes >= f of four vectors, at p + q * stride for q = 0..3, vector q's in bits
  // [16 q, 16 q + 16): four compares joined in mask registers, where a mask per vector moved
  // out, shifted and OR-ed took three times the instructions.
  static uint64_t cmp_ge_four(const float* p, int64_t stride, Vec f) {
    const __mmask16 m0 = _mm512_cmp_ps_mask(_mm512_loadu_ps(p), f.v, _CMP_GE_OQ);
    const __mmask16 m1 = _mm512_cmp_ps_mask(_mm512_loadu_ps(p + stride), f.v, _CMP_GE_OQ);
    const __mmask16 m2 = _mm512_cmp_ps_mask(_mm512_loadu_ps(p + 2 * stride), f.v, _CMP_GE_OQ);
    const __mmask16 m3 = _mm512_cmp_ps_mask(_mm512_loadu_ps(p + 3 * stride), f.v, _CMP_GE_OQ);
    return _cvtmask64_u64(_mm512_kunpackd(_mm512_kunpackw(m3, m2), _mm512_kunpackw(m1, m0)));
  }

  // acc with the lanes of m of x, packed in lane order, placed from lane `count` (< 16) on;
  // lanes past 15 are dropped. compress_store's values kept in a register as well: a load
  // of the packed values would span several of its stores, and such a load waits for them to
  // reach the cache instead of being forwarded.
  static Vec append_compressed(Vec acc, Vec x, Mask m, int count) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i from = _mm512_sub_epi32(lane, _mm512_set1_epi32(count));
    const Mask place = Mask(((1u << __builtin_popcount(m)) - 1u) << count);
    return {_mm512_mask_permutexvar_ps(acc.v, place, from, _mm512_maskz_compress_ps(m, x.v))};
  }

  // rows[0, 16) transposed in place: lane j of rows[i] becomes lane i of rows[j]. Pairs of
  // rows interleaved, then pairs of pairs, then 128-bit lanes twice: 64 shuffles.
  static void transpose(Vec* rows) {
    __m512 a[16], b[16];
    for (int i = 0; i < 16; i += 2) {
      a[i] = _mm512_unpacklo_ps(rows[i].v, rows[i + 1].v);
      a[i + 1] = _mm512_unpackhi_ps(rows[i].v, rows[i + 1].v);
    }
    // b[4q + k], 128-bit lane L: rows 4q..4q+3 of column 4L + k.
    for (int q = 0; q < 4; ++q) {
      b[4 * q + 0] = _mm512_shuffle_ps(a[4 * q], a[4 * q + 2], 0x44);
      b[4 * q + 1] = _mm512_shuffle_ps(a[4 * q], a[4 * q + 2], 0xee);
      b[4 * q + 2] = _mm512_shuffle_ps(a[4 * q + 1], a[4 * q + 3], 0x44);
      b[4 * q + 3] = _mm512_shuffle_ps(a[4 * q + 1], a[4 * q + 3], 0xee);
    }
    for (int k = 0; k < 4; ++k) {
      a[k] = _mm512_shuffle_f32x4(b[k], b[4 + k], 0x88);
      a[4 + k] = _mm512_shuffle_f32x4(b[k], b[4 + k], 0xdd);
      a[8 + k] = _mm512_shuffle_f32x4(b[8 + k], b[12 + k], 0x88);
      a[12 + k] = _mm512_shuffle_f32x4(b[8 + k], b[12 + k], 0xdd);
    }
    for (int k = 0; k < 4; ++k) {
      rows[k].v = _mm512_shuffle_f32x4(a[k], a[8 + k], 0x88);
      rows[8 + k].v = _mm512_shuffle_f32x4(a[k], a[8 + k], 0xdd);
      rows[4 + k].v = _mm512_shuffle_f32x4(a[4 + k], a[12 + k], 0x88);
      rows[12 + k].v = _mm512_shuffle_f32x4(a[4 + k], a[12 + k], 0xdd);
    }
  }

  // Horizontal top-2 of kGroups (8 or 16) groups at once. In: first[g] / second[g] hold,
  // lane by lane, the largest and second largest value group g has seen in that lane. Out:
  // lane g of first[0] / second[0] holds group g's largest / second largest over all its
  // lanes (a repeated maximum counts twice); lanes >= kGroups hold -inf. Four levels of a
  // transposing merge tree (each halves the lanes per group and doubles the groups per
  // vector) replace 2 * kGroups separate horizontal reductions.
  template <int kGroups>
  static void reduce_groups_top2(Vec* first, Vec* second) {
    static_assert(kGroups == 8 || kGroups == 16, "one merge tree of 16 lanes");
    const __m512 neg_inf = _mm512_set1_ps(-__builtin_inff());
    int n = kGroups;
#pragma GCC unroll 4
    for (int level = 0; level < 4; ++level) {
      const int merged = (n + 1) / 2;
#pragma GCC unroll 8
      for (int i = 0; i < merged; ++i) {
        const bool paired = 2 * i + 1 < n;
        const __m512 fa = first[2 * i].v, fb = paired ? first[2 * i + 1].v : neg_inf;
        const __m512 f_lo = fold_lo(level, fa, fb), f_hi = fold_hi(level, fa, fb);
        first[i].v = _mm512_max_ps(f_lo, f_hi);
        const __m512 sa = second[2 * i].v, sb = paired ? second[2 * i + 1].v : neg_inf;
        const __m512 s_max = _mm512_max_ps(fold_lo(level, sa, sb), fold_hi(level, sa, sb));
        second[i].v = _mm512_max_ps(_mm512_min_ps(f_lo, f_hi), s_max);
      }
      n = merged;
    }
    // The tree leaves group g in lane 4 * (g % 4) + g / 4 (a 4 x 4 transpose, its own inverse).
    const __m512i to_group =
        _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    first[0].v = _mm512_permutexvar_ps(to_group, first[0].v);
    second[0].v = _mm512_permutexvar_ps(to_group, second[0].v);
  }

  // The k-th largest (1 <= k <= 16 * n) of the 16 * n values of v[0, n), n = 1 or 2, none
  // NaN. A bitonic sort in registers: ten compare-exchange steps of fixed shuffles and
  // min/max, where ranking all pairs costs a broadcast, two compares, mask logic and a
  // masked add per value, chained through the mask registers.
  static constexpr int kMaxKthVecs = 2;
  static float kth_largest(const Vec* v, int n, int64_t k) {
    __m512 hi = sort_desc(v[0].v);
    if (n == 2) {
      // sorted a and reversed sorted b: their lane-wise max holds the 16 largest of both
      // as a bitonic sequence, their min the 16 smallest.
      const __m512i reverse =
          _mm512_setr_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
      const __m512 b = _mm512_permutexvar_ps(reverse, sort_desc(v[1].v));
      if (k > 16) {
        k -= 16;
        hi = _mm512_min_ps(hi, b);
      } else {
        hi = _mm512_max_ps(hi, b);
      }
      hi = merge_desc(hi);
    }
    return _mm512_cvtss_f32(_mm512_permutexvar_ps(_mm512_set1_epi32(int(k - 1)), hi));
  }

 private:
  // Lane i against lane i ^ d, keeping the larger where `take_max` is set.
  template <int kD>
  static __m512 exchange(__m512 x, __mmask16 take_max) {
    __m512 partner;
    if constexpr (kD == 1) {
      partner = _mm512_permute_ps(x, _MM_SHUFFLE(2, 3, 0, 1));
    } else if constexpr (kD == 2) {
      partner = _mm512_permute_ps(x, _MM_SHUFFLE(1, 0, 3, 2));
    } else if constexpr (kD == 4) {
      partner = _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(2, 3, 0, 1));
    } else {
      partner = _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(1, 0, 3, 2));
    }
    return _mm512_mask_blend_ps(take_max, _mm512_min_ps(x, partner),
                                _mm512_max_ps(x, partner));
  }
  // Lanes i with (i & d) == 0 XOR (i & size) != 0 take the max: blocks of `size` sorted
  // descending and ascending in turn, so that pairs of them form the next stage's bitonic
  // blocks; the last stage (size 16) is all descending.
  static constexpr __mmask16 take_max(int d, int size) {
    unsigned m = 0;
    for (int i = 0; i < 16; ++i) {
      if (((i & d) == 0) != ((i & size) != 0)) m |= 1u << i;
    }
    return __mmask16(m);
  }
  static __m512 sort_desc(__m512 x) {
    x = exchange<1>(x, take_max(1, 2));
    x = exchange<2>(x, take_max(2, 4));
    x = exchange<1>(x, take_max(1, 4));
    x = exchange<4>(x, take_max(4, 8));
    x = exchange<2>(x, take_max(2, 8));
    x = exchange<1>(x, take_max(1, 8));
    return merge_desc(exchange<8>(x, take_max(8, 16)), true);
  }
  // A bitonic 16-lane sequence sorted descending (after_first_step: its d = 8 step is done).
  static __m512 merge_desc(__m512 x, bool after_first_step = false) {
    if (!after_first_step) x = exchange<8>(x, take_max(8, 16));
    x = exchange<4>(x, take_max(4, 16));
    x = exchange<2>(x, take_max(2, 16));
    return exchange<1>(x, take_max(1, 16));
  }

  // One level of the merge tree: two vectors whose groups each span 16 >> level lanes become
  // two vectors (lo, hi) whose lane-wise max holds the groups of both, each in half the lanes.
  static __m512 fold_lo(int level, __m512 a, __m512 b) {
    switch (level) {
      case 0: return _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0));
      case 1: return _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0));
      case 2: return _mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0));
      default: return _mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0));
    }
  }
  static __m512 fold_hi(int level, __m512 a, __m512 b) {
    switch (level) {
      case 0: return _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2));
      case 1: return _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1));
      case 2: return _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2));
      default: return _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1));
    }
  }
};

}  // namespace moeext::cpu::MOEEXT_CPU_ISA
