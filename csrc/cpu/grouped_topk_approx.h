// The candidate-pass strategy of the CPU routing kernel (sqrt-softplus rows, every group
// kept): rows ranked on cheap approximate scores, only the candidates scored exactly. Part of
// cpu/grouped_topk.cpp's translation unit, compiled once per ISA (see there).
#pragma once

#include <cstdint>
#include <type_traits>

#include "cpu/grouped_topk_rows.h"
#include "cpu/score_pieces.h"

namespace moeext::cpu::MOEEXT_CPU_ISA {
namespace {

// The candidate pass: sqrt-softplus rows (DeepSeek-V4) with every group kept.
//
// An exact sqrt-softplus score (exp, log1p and sqrt) costs several times what the cubic
// pieces of cpu/score_pieces.h cost, and all but the few chosen experts' are thrown away.
// The pieces are within eps = kScoreApproxError of the exact score s. So
// the row is first ranked on b~ = s~ + bias: with |s~ - s| <= eps, |b~ - b| <= delta = eps +
// the rounding of the two bias additions. The floor F of b~ (k distinct experts at or above
// it, from the lanes as in step 4a) has k experts with b >= F - delta, so every expert the
// exact algorithm chooses has b >= F - delta and b~ >= F - 2 delta. The experts with
// b~ >= F - 2 delta are scored exactly, with the very operations of the exact path, and
// ranked as step 4 ranks: the result is the exact path's bit for bit. Rows the pieces do not
// cover (a logit outside [-16, 16), NaN or inf) and rows with more than kMaxCandidates
// candidates (near-ties) take the exact path. Sigmoid rows stay exact: their exact score is
// cheaper, and the pass gained nothing clear on them.

// Step 1 on the pieces: b~ into approx_b, the lanes tracked as score_row tracks them.
// Returns false when a logit lies outside the pieces.
// Vector i of b~ goes to approx_b + i * kVectorStride (W: a contiguous row).
template <int kTrack, int64_t kVectorStride = W, typename LogitT, typename BiasT>
MOEEXT_ALWAYS_INLINE bool approx_score_row(const LogitT* logits, const BiasT* bias,
                                           int64_t num_experts, const ScorePieces& pieces,
                                           float* approx_b, LaneTop2& top) {
  typename Vec::PiecesSeen pieces_seen = Vec::no_pieces_seen();
  // b~ of the experts e.. (the lanes of m) from their approximate scores s~.
  auto store_biased_approx = [&](int64_t e, typename Vec::Mask m, Vec b) {
    if constexpr (!std::is_same_v<BiasT, no_bias_t>) b = b + Vec::load(bias + e, m, 0.0f);
    b.store(approx_b + e / W * kVectorStride);  // whole vectors: the rows are padded to 16
    track_lanes<kTrack>(top, Vec::select(m, b, Vec::set1(kNegInf)));
  };
  int64_t paired_end = 0;
  // bf16 logits two vectors at a time, widened by shifts and scored in even / odd order, the
  // approximations put back in index order by two permutes: cheaper than widening each
  // vector across its lanes (Vec::load_pair).
  if constexpr (std::is_same_v<LogitT, bf16_t> && Vec::kHasBf16Pairs) {
    const auto all = Vec::tail_mask(W);
    for (int64_t e = 0; e + 2 * W <= num_experts; e += 2 * W, paired_end = e) {
      Vec even, odd, low, high;
      Vec::load_pair(logits + e, even, odd);
      Vec::interleave_pair(Vec::piecewise_cubic(even, pieces, pieces_seen),
                           Vec::piecewise_cubic(odd, pieces, pieces_seen), low, high);
      store_biased_approx(e, all, low);
      store_biased_approx(e + W, all, high);
    }
  }
  for_each_vector(paired_end, num_experts, [&](int64_t e, typename Vec::Mask m) {
    // The lanes past the row's end load 0, inside the pieces.
    store_biased_approx(e, m, Vec::piecewise_cubic(Vec::load(logits + e, m, 0.0f), pieces,
                                                   pieces_seen));
  });
  return Vec::all_pieces_inside(pieces_seen);
}

// Steps 4b and 4c on the candidates of approx_b at or above floor - margin (margin = 2 delta):
// ws.chosen[0, k) gets the k best experts, best first, and scores[e] the exact score of each
// candidate e. Returns false, having chosen nothing, when there are too many candidates.
template <ScoringFunc kScore, typename LogitT, typename BiasT>
bool select_by_approx(const LogitT* logits, const BiasT* bias, int64_t num_experts, int64_t k,
                      const float* approx_b, float floor, float margin, float* scores,
                      const GroupedTopkWorkspace& ws) {
  const ExpertRange all{0, num_experts};
  Vec packed;  // the first W of them
  // The candidates' logits, widened, in index order.
  const int64_t count = gather_candidates<true>(
      approx_b, &all, 1, floor - margin, ws, packed,
      [logits](int64_t e, typename Vec::Mask in_range, Vec /*b*/) {
        return Vec::load(logits + e, in_range, 0.0f);
      });
  if (count < 0) return false;
  for (int64_t i = 0; i < count; ++i) ws.candidate_bias[i] = bias_at(bias, ws.candidate_ids[i]);
  Vec first = Vec::set1(kNegInf);
  for (int64_t i = 0; i < count; i += W) {
    const auto m = Vec::tail_mask(count - i);
    // score() and the bias sum as score_row and store_biased compute them, lane by lane.
    // The first W from the register: loaded back, they would span several of the packing's
    // stores and wait for them to reach the cache.
    const Vec x = i == 0 ? Vec::select(m, packed, Vec::set1(0.0f))
                         : Vec::load(ws.candidates + i, m, 0.0f);
    const Vec s = score<kScore>(x);
    Vec b = s;
    if constexpr (!std::is_same_v<BiasT, no_bias_t>) {
      b = s + Vec::load(ws.candidate_bias + i, m, 0.0f);
    }
    b = nan_to_neg_inf(b);
    s.store(ws.candidate_scores + i);  // whole vectors: the arrays have slack
    b.store(ws.candidates + i);
    if (i == 0) first = Vec::select(m, b, Vec::set1(kNegInf));
  }
  for (int64_t i = 0; i < count; ++i) scores[ws.candidate_ids[i]] = ws.candidate_scores[i];
  with_rank_vecs<ChooseRanked>(count, ws, count, k, count <= W ? &first : nullptr);
  return true;
}

// 2 delta for a call, or -1 where the bias is not finite: |b~ - b| <= eps plus half an ulp
// of each rounded sum, at most 2^-23 * (largest |bias| + largest score) for the two.
template <typename BiasT>
float approx_margin(const BiasT* bias, int64_t num_experts) {
  float largest = 0.0f;
  if constexpr (!std::is_same_v<BiasT, no_bias_t>) {
    Vec magnitude = Vec::set1(0.0f);
    typename Vec::Mask not_finite = 0;
    for (int64_t e = 0; e < num_experts; e += W) {
      const Vec x = Vec::load(bias + e, Vec::tail_mask(num_experts - e), 0.0f);
      not_finite |= Vec::is_nan(x - x);  // inf - inf and NaN - NaN are NaN
      magnitude = Vec::max(magnitude, Vec::max(x, Vec::set1(0.0f) - x));
    }
    if (not_finite) return -1.0f;
    largest = Vec::reduce_max(magnitude);
  }
  // sqrt-softplus over the pieces' range stays below sqrt(16 + 1).
  const float delta = kScoreApproxError + (largest + 4.125f) * 0x1p-22f;
  return 2.0f * delta;
}

// Rows of a large T come from L3 or DRAM. The exact path's rows are long enough for the
// hardware prefetcher to keep up; the candidate pass's are not. A software prefetch
// kPrefetchRows rows ahead of the row being scored hides the latency.
constexpr int64_t kPrefetchRows = 4;
template <typename LogitT>
MOEEXT_ALWAYS_INLINE void prefetch_row(const LogitT* row, int64_t num_experts) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t at = 0; at < num_experts * int64_t(sizeof(LogitT)); at += 64) {
    __builtin_prefetch(bytes + at);
  }
}

// Rows [row_begin, row_end) by the candidate pass (see select_by_approx), pipelined as
// route_rows is; a row the pass cannot take is routed by route_rows alone. Kept out of
// route_rows, which then compiles as without it: inlined into it, the pass slowed exact rows
// even where it never ran.
template <ScoringFunc kScore, typename LogitT, typename BiasT>
[[gnu::noinline]] void route_rows_by_approx(const BiasedGroupedTopkParams& p, const BiasT* bias,
                                            int64_t row_begin, int64_t row_end, float margin,
                                            const GroupedTopkWorkspace& ws) {
  const int64_t num_experts = p.num_experts;
  const int64_t topk = p.topk;
  const ScorePieces& pieces = *ws.score_pieces;
  const LogitT* logits_base = static_cast<const LogitT*>(p.gating_output);

  struct ApproxRow {
    LaneTop2 top;
    bool covered = false;
  };
  auto score_token = [&](int64_t t) {
    const LogitT* row = logits_base + t * p.gating_row_stride;
    if (t + kPrefetchRows < row_end) {
      prefetch_row(row + kPrefetchRows * p.gating_row_stride, num_experts);
    }
    float* approx_b = ws.biased[t & 1];
    ApproxRow r;
    r.covered = topk <= kLaneMaxK
                    ? approx_score_row<1>(row, bias, num_experts, pieces, approx_b, r.top)
                    : approx_score_row<2>(row, bias, num_experts, pieces, approx_b, r.top);
    return r;
  };
  auto select_token = [&](int64_t t, const ApproxRow& r) {
    float* scores = ws.scores[t & 1];
    if (r.covered &&
        select_by_approx<kScore>(logits_base + t * p.gating_row_stride, bias, num_experts,
                                 topk, ws.biased[t & 1], floor_from_lanes(r.top, topk),
                                 margin, scores, ws)) {
      write_row_outputs(p, t, scores, ws);
      return;
    }
    route_rows<kScore, LogitT, BiasT>(p, bias, t, t + 1, ws);
  };

  pipeline_rows(row_begin, row_end, score_token, select_token);
}

}  // namespace
}  // namespace moeext::cpu::MOEEXT_CPU_ISA
