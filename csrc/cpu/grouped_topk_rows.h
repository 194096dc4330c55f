// The row strategy of the CPU routing kernel: one row at a time, exact scores, the next row
// scored under the current one's selection. Every other strategy falls back to it. Part of
// cpu/grouped_topk.cpp's translation unit, compiled once per ISA (see there).
#pragma once

#include <cmath>
#include <cstdint>

#include "cpu/grouped_topk_select.h"
#include "host_device/routing.h"

namespace moeext::cpu::MOEEXT_CPU_ISA {
namespace {

// Steps 6 and 7 as the GPU kernels compute them.
using host_device::finalize_weight;
using host_device::weight_of_score;

// score_row with the lane tracking picked per call (the same for every row, so the branch
// predicts); track is 0, 1 or 2 as for kTrack.
template <ScoringFunc kScore, typename LogitT, typename BiasT>
inline const float* score_row_tracked(const LogitT* logits, const BiasT* bias,
                                      int64_t num_experts, int track, float* scores,
                                      float* biased, LaneTop2& top) {
  switch (track) {
    case 1:
      return score_row<kScore, 1>(logits, bias, num_experts, scores, biased, top);
    case 2:
      return score_row<kScore, 2>(logits, bias, num_experts, scores, biased, top);
    default:
      return score_row<kScore, 0>(logits, bias, num_experts, scores, biased, top);
  }
}

// A scored row: its scores s, its biased scores b (s itself where b = s) and, with every
// group kept, its lanes' top-2 of b.
struct ScoredRow {
  const float* s;
  const float* b;
  LaneTop2 top;
};

// The outputs of row t from its chosen experts (ws.chosen) and their scores s.
MOEEXT_ALWAYS_INLINE void write_row_outputs(const BiasedGroupedTopkParams& p, int64_t t,
                                            const float* s, const GroupedTopkWorkspace& ws) {
  float* weights = p.topk_weights + t * p.weights_row_stride;
  int32_t* ids = p.topk_ids + t * p.ids_row_stride;
  float sum = 0.0f;
  for (int64_t j = 0; j < p.topk; ++j) {
    const int64_t expert = ws.chosen[j];
    // std::isnan: weight_of_score's bit test moves w through an integer register, 2% slower.
    const float w = s[expert];
    weights[j] = std::isnan(w) ? 0.0f : w;  // weights come from s, never from b - bias
    ids[j] = int32_t(expert);
    sum += weights[j];
  }
  // The sum above stays sequential (its rounding is part of the result); the divides and
  // scalings are lane-wise, so a vector does them with the scalar loop's exact results.
  const Vec total = Vec::set1(sum);
  const Vec scale = Vec::set1(p.routed_scaling_factor);
  for (int64_t j = 0; j < p.topk; j += W) {
    const auto m = Vec::tail_mask(p.topk - j);
    finalize_weight(Vec::load(weights + j, m, 0.0f), total, p.renormalize, scale)
        .store(weights + j, m);
  }
}

// Rows [row_begin, row_end), software-pipelined: row t + 1 is scored before row t is
// selected. Scoring is long independent vector work; selection is a chain of short dependent
// steps ending in data-dependent branches. In this order the next row's scoring is older
// than the selection in the out-of-order window, so it runs underneath the selection's chain
// and survives its mispredicts (which flush only younger work).
template <typename ScoreToken, typename SelectToken>
MOEEXT_ALWAYS_INLINE void pipeline_rows(int64_t row_begin, int64_t row_end,
                                        ScoreToken& score_token, SelectToken& select_token) {
  auto current = score_token(row_begin);
  for (int64_t t = row_begin; t < row_end; ++t) {
    decltype(current) next;
    if (t + 1 < row_end) next = score_token(t + 1);
    select_token(t, current);
    current = next;
  }
}

// Rows [row_begin, row_end) with exact scores throughout.
template <ScoringFunc kScore, typename LogitT, typename BiasT>
void route_rows(const BiasedGroupedTopkParams& p, const BiasT* bias, int64_t row_begin,
                int64_t row_end, const GroupedTopkWorkspace& ws) {
  const int64_t num_experts = p.num_experts;
  const int64_t num_groups = p.num_expert_group;
  const int64_t group_size = num_experts / num_groups;
  const int64_t topk = p.topk;
  const bool all_groups_kept = p.topk_group == num_groups;
  constexpr bool has_bias = !std::is_same_v<BiasT, no_bias_t>;
  const LogitT* logits_base = static_cast<const LogitT*>(p.gating_output);

  // With every group kept the floor comes from lanes tracked while scoring.
  const int track = !all_groups_kept || topk > 2 * W ? 0 : topk <= kLaneMaxK ? 1 : 2;

  // Step 1 of row t, into workspace slot t % 2.
  auto score_token = [&](int64_t t) {
    const int slot = int(t & 1);
    ScoredRow r;
    r.s = ws.scores[slot];
    const LogitT* row = logits_base + t * p.gating_row_stride;
    if (p.gating_col_stride != 1) {
      // Column-strided logits: widen this row into the workspace, then read it contiguously.
      for (int64_t e = 0; e < num_experts; ++e) {
        ws.row[e] = to_float(row[e * p.gating_col_stride]);
      }
      r.b = score_row_tracked<kScore, float, BiasT>(ws.row, bias, num_experts, track,
                                                    ws.scores[slot], ws.biased[slot], r.top);
    } else {
      r.b = score_row_tracked<kScore, LogitT, BiasT>(row, bias, num_experts, track,
                                                     ws.scores[slot], ws.biased[slot], r.top);
    }
    return r;
  };

  // Steps 2 to 4 and the outputs of row t.
  auto select_token = [&](int64_t t, const ScoredRow& r) {
    const float* b = r.b;
    const ExpertRange all{0, num_experts};
    const ExpertRange* ranges = &all;
    int64_t num_ranges = 1;
    float floor;
    if (!all_groups_kept) {
      const bool second_floor = topk <= 2 * p.topk_group;
      num_ranges = keep_groups<has_bias>(b, num_groups, group_size, p.topk_group, second_floor,
                                         ws, floor);
      ranges = ws.ranges;
      if (!second_floor) floor = candidate_floor(b, ranges, num_ranges, topk);
    } else if (topk <= 2 * W) {
      floor = floor_from_lanes(r.top, topk);
    } else {
      floor = candidate_floor(b, ranges, num_ranges, topk);
    }
    select_experts(b, ranges, num_ranges, topk, floor, ws);
    write_row_outputs(p, t, r.s, ws);
  };

  pipeline_rows(row_begin, row_end, score_token, select_token);
}

}  // namespace
}  // namespace moeext::cpu::MOEEXT_CPU_ISA
