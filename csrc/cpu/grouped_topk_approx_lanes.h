// The candidate pass of the CPU routing kernel with rows in lanes (AVX-512). Part of
// cpu/grouped_topk.cpp's translation unit, compiled once per ISA (see there).
#pragma once

#include <cstdint>
#include <type_traits>

#include "cpu/grouped_topk_approx.h"
#include "cpu/grouped_topk_lanes.h"

namespace moeext::cpu::MOEEXT_CPU_ISA {
namespace {

// The candidate pass with rows in lanes (sqrt-softplus, every group kept, topk <=
// kApproxLaneMaxTopk): W rows at a time. Each row is ranked on b~ as the row pass ranks it
// (approx_score_row, the floor F from its lanes), into lane_rows in the tiled layout of
// route_lane_block, and the experts of b~ >= F - margin in any row are marked. After the
// transpose, only the marked experts are offered to kApproxLaneSlots sorted slots per lane,
// in index order. A lane's slots then hold its candidates whenever the last slot is below
// its topk-th slot by more than the margin: every expert outside the slots is either
// unmarked (b~ < F - margin) or not above the last slot. The slots' experts are scored
// exactly, ranked lane by lane, and the best topk written as write_row_outputs writes them:
// the outputs are the row pass's bit for bit. A row the lanes cannot settle (not covered by
// the pieces, or too close to call within the slots) is routed by the row pass.
// Two slots more than topk: a row then fails to settle only where its topk-th and
// (topk + 2)-th b~ lie within the margin, a small fraction of rows.
constexpr int kApproxLaneSlots = int(kApproxLaneMaxTopk) + 2;
static_assert(!kApproxRowsInLanes || kApproxLaneMaxTopk <= kLaneMaxK,
              "the floor comes from the lane maxima");

template <ScoringFunc kScore, typename LogitT, typename BiasT, typename V = Vec>
void route_approx_lane_block(const BiasedGroupedTopkParams& p, const BiasT* bias, int64_t t0,
                             int64_t row_end, float margin, const GroupedTopkWorkspace& ws) {
  constexpr int K = kApproxLaneSlots;
  constexpr bool has_bias = !std::is_same_v<BiasT, no_bias_t>;
  const int64_t num_experts = p.num_experts;
  const int64_t topk = p.topk;
  const int64_t num_vecs = (num_experts + W - 1) / W;
  const ScorePieces& pieces = *ws.score_pieces;
  const LogitT* logits = static_cast<const LogitT*>(p.gating_output) + t0 * p.gating_row_stride;
  float* const lanes = ws.lane_rows;

  // marked[e / 64] bit e % 64: expert e is a candidate of some row.
  uint64_t marked[kApproxLaneMaxExperts / 64] = {};
  static_assert(V::kWidth == 16, "four vectors of 16 lanes to a 64-bit word");
  const int64_t whole_words = num_experts / 64;
  typename Vec::Mask covered = 0;
  for (int64_t r = 0; r < W; ++r) {
    const LogitT* row = logits + r * p.gating_row_stride;
    if (t0 + r + kPrefetchRows < row_end) {
      prefetch_row(row + kPrefetchRows * p.gating_row_stride, num_experts);
    }
    float* approx_b = lanes + r * W;
    LaneTop2 top;
    if (!approx_score_row<1, W * W>(row, bias, num_experts, pieces, approx_b, top)) continue;
    covered |= typename Vec::Mask(1u << r);
    const Vec lower = Vec::set1(floor_from_lanes(top, topk) - margin);
    for (int64_t word = 0; word < whole_words; ++word) {
      marked[word] |= V::cmp_ge_four(approx_b + word * 4 * W * W, W * W, lower);
    }
    for (int64_t i = whole_words * 4; i < num_vecs; ++i) {
      const auto in_range = Vec::tail_mask(num_experts - i * W);
      const auto m = in_range & Vec::cmp_ge(Vec::load(approx_b + i * W * W), lower);
      marked[i / 4] |= uint64_t(m) << (i % 4 * W);
    }
  }
  for (int64_t i = 0; i < num_vecs; ++i) {
    float* const tile = lanes + i * W * W;
    Vec rows[W];
    for (int64_t r = 0; r < W; ++r) rows[r] = Vec::load(tile + r * W);
    V::transpose(rows);
    for (int64_t l = 0; l < W; ++l) rows[l].store(tile + l * W);
  }

  LaneSlots<K> slots;
  for (int64_t word = 0; word * 64 < num_experts; ++word) {
    for (uint64_t bits = marked[word]; bits != 0; bits &= bits - 1) {
      const int64_t e = word * 64 + __builtin_ctzll(bits);
      slots.offer(Vec::load(lanes + e * W), Vec::set1(float(e)));
    }
  }
  const int filled = slots.offered < K ? slots.offered : K;
  // A covered row's topk lane maxima are at or above its floor: marked, so filled >= topk.
  typename Vec::Mask settled = covered;
  if (filled == K) {
    settled &= Vec::cmp_lt(slots.v[K - 1], slots.v[topk - 1] - Vec::set1(margin));
  }

  // The slots' exact scores s and biased scores b, as select_by_approx computes them.
  Vec s[K], b[K];
  {
    alignas(64) float ids[K][W];
    alignas(64) float x[K][W];
    alignas(64) float bias_of[K][W];
    for (int j = 0; j < filled; ++j) {
      slots.id[j].store(ids[j]);
      for (int64_t r = 0; r < W; ++r) {
        const int64_t e = int64_t(ids[j][r]);
        x[j][r] = to_float(logits[r * p.gating_row_stride + e]);
        bias_of[j][r] = bias_at(bias, e);
      }
    }
    for (int j = 0; j < K; ++j) {
      if (j < filled) {
        s[j] = score<kScore>(Vec::load(x[j]));
        b[j] = s[j];
        if constexpr (has_bias) b[j] = s[j] + Vec::load(bias_of[j]);
        b[j] = nan_to_neg_inf(b[j]);
      } else {
        s[j] = Vec::set1(0.0f);
        b[j] = Vec::set1(kNegInf);
        slots.id[j] = Vec::set1(float(kApproxLaneMaxExperts + j));  // ranks after every expert
      }
    }
  }
  // rank[j]: how many slots beat slot j on b, ties to the lower expert index.
  Vec rank[K];
  for (int j = 0; j < K; ++j) rank[j] = Vec::set1(0.0f);
  for (int i = 0; i < K; ++i) {
    for (int j = i + 1; j < K; ++j) {
      const auto i_beats_j =
          Vec::cmp_gt(b[i], b[j]) |
          (Vec::cmp_eq(b[i], b[j]) & Vec::cmp_lt(slots.id[i], slots.id[j]));
      rank[j] = Vec::count_true(rank[j], i_beats_j);
      rank[i] = Vec::count_true(rank[i], typename Vec::Mask(~i_beats_j));
    }
  }
  // Steps 6 and 7 (the scores of covered rows are finite).
  Vec w[kApproxLaneMaxTopk], id[kApproxLaneMaxTopk];
  for (int64_t j = 0; j < topk; ++j) {
    w[j] = Vec::set1(0.0f);
    id[j] = Vec::set1(0.0f);
    for (int i = 0; i < K; ++i) {
      const auto at = Vec::cmp_eq(rank[i], Vec::set1(float(j)));
      w[j] = Vec::select(at, s[i], w[j]);
      id[j] = Vec::select(at, slots.id[i], id[j]);
    }
  }
  write_lane_outputs<kApproxLaneMaxTopk>(p, t0, topk, w, id, settled);
  for (int64_t r = 0; r < W; ++r) {
    if (!((settled >> r) & 1)) {
      route_rows_by_approx<kScore, LogitT, BiasT>(p, bias, t0 + r, t0 + r + 1, margin, ws);
    }
  }
}

}  // namespace
}  // namespace moeext::cpu::MOEEXT_CPU_ISA
