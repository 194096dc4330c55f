// Step 1 of the CPU routing kernel: the scores s and biased scores b of a row (sigmoid,
// sqrt-softplus, softmax), and the lanes' running top-2 of b. Part of cpu/grouped_topk.cpp's
// translation unit, compiled once per ISA (see there).
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>

#include "cpu/grouped_topk_isa.h"
#include "cpu/vec.h"
#include "host_device/routing.h"

namespace moeext::cpu::MOEEXT_CPU_ISA {
namespace {

using host_device::nan_to_neg_inf;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int W = Vec::kWidth;

// body(e, mask) for the vectors of experts [begin, end): the whole vectors first, with the
// full mask a constant (their loads, selects and stores then take no mask, and the loop
// computes none), then the partial last vector, if any.
template <typename Body>
MOEEXT_ALWAYS_INLINE void for_each_vector(int64_t begin, int64_t end, Body body) {
  int64_t e = begin;
  for (; e + W <= end; e += W) body(e, Vec::tail_mask(W));
  if (e < end) body(e, Vec::tail_mask(end - e));
}

// sqrt(softplus(x)) = sqrt(max(x, 0) + log1p(exp(-|x|))): the log1p argument stays in
// (0, 1], where it needs no divide (vlog1p_unit). Above x = 20 (torch's threshold for
// returning x) the log1p term is below half an ulp of x, so the sum rounds to x as torch's
// does. In two steps, so that a path may run them as separate passes: exp(-|x|), then the rest.
// Forced inline on the portable path, where GCC called both out of line, a call per vector
// with the live vectors spilled around it (aarch64 and x86-64 alike). The x86 paths inline
// them unasked; forcing it there would only move their register allocation.
#if MOEEXT_ISA_ID(MOEEXT_CPU_ISA) == MOEEXT_ISA_portable
#define MOEEXT_PORTABLE_INLINE MOEEXT_ALWAYS_INLINE
#else
#define MOEEXT_PORTABLE_INLINE inline
#endif
MOEEXT_PORTABLE_INLINE Vec softplus_exp(Vec x) {
  return vexp(Vec::min(x, Vec::set1(0.0f) - x));  // NaN x: min returns its second operand
}
MOEEXT_PORTABLE_INLINE Vec sqrt_softplus(Vec x, Vec exp_neg_abs) {
  return Vec::sqrt(Vec::max(x, Vec::set1(0.0f)) + vlog1p_unit(exp_neg_abs));
}
#undef MOEEXT_PORTABLE_INLINE

// Forced inline: on the portable layer GCC called the sigmoid out of line from the scoring
// loop, a call per vector with the other live vectors spilled around it.
template <ScoringFunc kScore>
MOEEXT_ALWAYS_INLINE Vec score(Vec x) {
  if constexpr (kScore == ScoringFunc::kSigmoid) {
    return Vec::set1(1.0f) / (Vec::set1(1.0f) + vexp_neg(x));
  } else {
    static_assert(kScore == ScoringFunc::kSqrtSoftplus, "softmax is computed row-wide");
    return sqrt_softplus(x, softplus_exp(x));
  }
}

// Lane by lane, the two largest biased scores of the row, kept as it is scored when every
// group is kept (kTrack = 1: the largest only, 2: both), so that step 4a need not read b again.
struct LaneTop2 {
  Vec first = Vec::set1(kNegInf);
  Vec second = Vec::set1(kNegInf);
};

template <int kTrack>
inline void track_lanes(LaneTop2& top, Vec b) {
  if constexpr (kTrack >= 2) top.second = Vec::max(top.second, Vec::min(top.first, b));
  if constexpr (kTrack >= 1) top.first = Vec::max(top.first, b);
}

template <int kTrack, typename BiasT>
inline void store_biased(Vec s, const BiasT* bias, int64_t e, typename Vec::Mask m,
                         float* biased, LaneTop2& top) {
  Vec b = s;
  if constexpr (!std::is_same_v<BiasT, no_bias_t>) {
    b = s + Vec::load(bias + e, m, 0.0f);
  }
  b = nan_to_neg_inf(b);
  b.store(biased + e, m);
  if constexpr (kTrack > 0) {
    track_lanes<kTrack>(top, Vec::select(m, b, Vec::set1(kNegInf)));
  }
}

// Softmax of a row of kVecs vectors, held in registers from load to store (whole vectors to
// scores, whose rows are padded to them). A row is one chain of dependent steps (maximum,
// exps, sum, scaling) that the next row cannot overlap, so its length is the row's cost: the
// registers save it two store-and-reload passes, and one divide for the row followed by
// products (as torch's softmax computes it) saves it the vector divides, which queue on the
// divider.
// Returns whether the row is free of NaN (no NaN logit, and a finite maximum: +inf - +inf and
// -inf - -inf are NaN). Vector i of the scores goes to scores + i * vector_stride.
template <int kVecs, typename LogitT>
bool softmax_in_registers(const LogitT* logits, int64_t num_experts, float* scores,
                          int64_t vector_stride) {
  // The last vector's lanes in the row, 1..W of them; a shift, not tail_mask's branches
  // (along which GCC copies the whole function).
  const auto last = typename Vec::Mask((uint32_t(1) << (num_experts - (kVecs - 1) * W)) - 1u);
  Vec x[kVecs];
  for (int i = 0; i < kVecs; ++i) {
    x[i] = Vec::load(logits + i * W, i + 1 < kVecs ? Vec::tail_mask(W) : last, kNegInf);
  }
  Vec row_max = x[0];
  for (int i = 1; i < kVecs; ++i) row_max = Vec::max(row_max, x[i]);
  // The maximum may miss a NaN (max returns its second operand), but the sum cannot: a NaN
  // logit's exp is NaN, and so is that of +inf - +inf or -inf - -inf. A NaN sum makes the
  // whole row NaN, as in the reference.
  const Vec shift = Vec::set1(Vec::reduce_max(row_max));
  Vec sum = Vec::set1(0.0f);
  for (int i = 0; i < kVecs; ++i) {
    x[i] = vexp_nonpositive(x[i] - shift);
    if (i + 1 == kVecs) x[i] = Vec::select(last, x[i], Vec::set1(0.0f));
    sum = sum + x[i];
  }
  const float total = Vec::reduce_add(sum);
  const Vec inverse = Vec::set1(1.0f / total);
  for (int i = 0; i < kVecs; ++i) (x[i] * inverse).store(scores + i * vector_stride);
  return !std::isnan(total);
}

// Rows of up to 16 vectors (256 experts on AVX-512) take softmax_in_registers; the row and
// the exps' temporaries still fit the 32 vector registers. AVX2 has 16: rows of up to 8
// vectors (64 experts).
constexpr int kMaxSoftmaxVecs = W == 16 ? 16 : W == 8 ? 8 : 0;

template <typename LogitT>
using SoftmaxFn = bool (*)(const LogitT*, int64_t, float*, int64_t);

template <typename LogitT, int... I>
constexpr std::array<SoftmaxFn<LogitT>, sizeof...(I)> softmax_table(
    std::integer_sequence<int, I...>) {
  return {&softmax_in_registers<I + 1, LogitT>...};
}

// kSoftmaxRows<LogitT>[n - 1] handles a row of n vectors.
template <typename LogitT>
inline constexpr auto kSoftmaxRows =
    softmax_table<LogitT>(std::make_integer_sequence<int, kMaxSoftmaxVecs>{});

// Step 1 for one row of contiguous logits. Returns the array that holds b for this row:
// biased, or scores itself where b = s (a softmax row without bias or NaN), which saves
// writing a copy.
template <ScoringFunc kScore, int kTrack, typename LogitT, typename BiasT>
const float* score_row(const LogitT* logits, const BiasT* bias, int64_t num_experts,
                       float* scores, float* biased, LaneTop2& top) {
  if constexpr (kScore == ScoringFunc::kSoftmax) {
    if constexpr (kMaxSoftmaxVecs > 0) {
      if (num_experts <= kMaxSoftmaxVecs * W) {
        const bool no_nan =
            kSoftmaxRows<LogitT>[(num_experts + W - 1) / W - 1](logits, num_experts, scores, W);
        if (std::is_same_v<BiasT, no_bias_t> && no_nan) {
          if constexpr (kTrack > 0) {
            for (int64_t e = 0; e < num_experts; e += W) {
              const auto m = Vec::tail_mask(num_experts - e);
              track_lanes<kTrack>(top, Vec::load(scores + e, m, kNegInf));
            }
          }
          return scores;
        }
        for (int64_t e = 0; e < num_experts; e += W) {
          const auto m = Vec::tail_mask(num_experts - e);
          store_biased<kTrack>(Vec::load(scores + e, m, 0.0f), bias, e, m, biased, top);
        }
        return biased;
      }
    }
    // Longer rows: the same steps in three passes over scores.
    // A NaN the maximum misses still makes the sum NaN (see softmax_in_registers).
    Vec row_max = Vec::set1(kNegInf);
    for (int64_t e = 0; e < num_experts; e += W) {
      const auto m = Vec::tail_mask(num_experts - e);
      const Vec x = Vec::load(logits + e, m, kNegInf);
      row_max = Vec::max(row_max, x);
      x.store(scores + e, m);
    }
    const Vec shift = Vec::set1(Vec::reduce_max(row_max));
    Vec sum = Vec::set1(0.0f);
    for (int64_t e = 0; e < num_experts; e += W) {
      const auto m = Vec::tail_mask(num_experts - e);
      const Vec x = Vec::load(scores + e, m, kNegInf);
      const Vec ex = Vec::select(m, vexp_nonpositive(x - shift), Vec::set1(0.0f));
      sum = sum + ex;
      ex.store(scores + e, m);
    }
    const Vec inverse = Vec::set1(1.0f / Vec::reduce_add(sum));
    for (int64_t e = 0; e < num_experts; e += W) {
      const auto m = Vec::tail_mask(num_experts - e);
      const Vec s = Vec::load(scores + e, m, 0.0f) * inverse;
      s.store(scores + e, m);
      store_biased<kTrack>(s, bias, e, m, biased, top);
    }
    return biased;
  } else {
    if constexpr (kScore == ScoringFunc::kSqrtSoftplus) {
      // In two passes, exp first, then log1p and sqrt: one vector's chain through all three
      // is longer than the out-of-order window overlaps; in passes each chain is short.
      for (int64_t e = 0; e < num_experts; e += W) {
        const Vec x = Vec::load(logits + e, Vec::tail_mask(num_experts - e), 0.0f);
        softplus_exp(x).store(scores + e);  // whole vectors: the rows are padded to 16
      }
      for (int64_t e = 0; e < num_experts; e += W) {
        const auto m = Vec::tail_mask(num_experts - e);
        const Vec exp_neg_abs = Vec::load(scores + e, Vec::tail_mask(W), 0.0f);
        const Vec s = sqrt_softplus(Vec::load(logits + e, m, 0.0f), exp_neg_abs);
        s.store(scores + e, m);
        store_biased<kTrack>(s, bias, e, m, biased, top);
      }
      return biased;
    }
    // Four vectors per step: each score is a long dependency chain, and interleaving four
    // gives the out-of-order window independent work to overlap.
    constexpr int64_t kUnroll = 4;
    const auto all = Vec::tail_mask(W);
    int64_t e = 0;
    for (; e + kUnroll * W <= num_experts; e += kUnroll * W) {
      Vec s[kUnroll];
      for (int64_t u = 0; u < kUnroll; ++u) {
        s[u] = score<kScore>(Vec::load(logits + e + u * W, all, 0.0f));
      }
      for (int64_t u = 0; u < kUnroll; ++u) {
        s[u].store(scores + e + u * W, all);
        store_biased<kTrack>(s[u], bias, e + u * W, all, biased, top);
      }
    }
    for (; e < num_experts; e += W) {
      const auto m = Vec::tail_mask(num_experts - e);
      const Vec s = score<kScore>(Vec::load(logits + e, m, 0.0f));
      s.store(scores + e, m);
      store_biased<kTrack>(s, bias, e, m, biased, top);
    }
    return biased;
  }
}

inline float bias_at(const no_bias_t* /*bias*/, int64_t /*e*/) { return 0.0f; }
template <typename BiasT>
inline float bias_at(const BiasT* bias, int64_t e) { return to_float(bias[e]); }

}  // namespace
}  // namespace moeext::cpu::MOEEXT_CPU_ISA
