// One TU per ISA from headers, not one per file: GCC inlines to a per-file budget (cpu/types.h).
// Biased grouped top-k routing on the CPU (SPEC.md section 1). Compiled once per ISA; see
// cpu/vec.h. One token (row) at a time, everything in fp32, in four steps:
//   1. scores s and biased scores b of the row, into the workspace (NaN in b becomes -inf);
//   2. a score per expert group (top-2 sum with a bias, max without), W groups at a time;
//   3. the kept groups: the topk_group best group scores;
//   4. the topk best experts among the kept groups: a floor under the topk-th value, the
//      experts at or above it packed into a short candidate list, and the list ranked.
// Ties everywhere go to the lower index. Where candidates are compared by position (ranking),
// they are laid out in index order so position and index agree; where they are compared as
// keys (the insertion fallback), a key packs a value and an index into one integer, so that
// "larger value, then lower index" is a single unsigned compare. The keys, the group score,
// the NaN policy and the weights are the GPU kernels' too, from host_device/routing.h.
// The headers below hold step 1, steps 2 to 4, and the strategies over them; this file the
// switches from a call's dtypes, bias and scoring function to their template instances. The
// measurements behind the code's choices are in docs/notes/cpu-routing.md.
#include <cstdint>

#include "cpu/grouped_topk_isa.h"
#include "cpu/grouped_topk_score.h"
#include "cpu/grouped_topk_select.h"
#include "cpu/grouped_topk_rows.h"
#include "cpu/grouped_topk_approx.h"
#include "cpu/grouped_topk_lanes.h"
#include "cpu/grouped_topk_approx_lanes.h"
#include "cpu/vec.h"

namespace moeext::cpu::MOEEXT_CPU_ISA {
namespace {

// route_lane_blocks with the slots' count topk a compile-time one.
template <ScoringFunc kScore, typename LogitT, typename BiasT>
void route_lane_blocks_of_topk(const BiasedGroupedTopkParams& p, const BiasT* bias,
                               int64_t row_begin, int64_t row_end,
                               const GroupedTopkWorkspace& ws) {
  switch (p.topk) {
    case 1: route_lane_blocks<kScore, 1, LogitT>(p, bias, row_begin, row_end, ws); break;
    case 2: route_lane_blocks<kScore, 2, LogitT>(p, bias, row_begin, row_end, ws); break;
    case 3: route_lane_blocks<kScore, 3, LogitT>(p, bias, row_begin, row_end, ws); break;
    case 4: route_lane_blocks<kScore, 4, LogitT>(p, bias, row_begin, row_end, ws); break;
    case 5: route_lane_blocks<kScore, 5, LogitT>(p, bias, row_begin, row_end, ws); break;
    case 6: route_lane_blocks<kScore, 6, LogitT>(p, bias, row_begin, row_end, ws); break;
    case 7: route_lane_blocks<kScore, 7, LogitT>(p, bias, row_begin, row_end, ws); break;
    default: route_lane_blocks<kScore, 8, LogitT>(p, bias, row_begin, row_end, ws); break;
  }
}

// One call's rows by the plan's strategy (cpu/grouped_topk_plan.h). Only what depends on the
// data is decided here: a bias that is not finite sends the candidate pass to exact rows.
// Each strategy is compiled only for the scoring functions and ISAs the plan gives it to.
template <ScoringFunc kScore, typename LogitT, typename BiasT>
void route(const BiasedGroupedTopkParams& p, const BiasT* bias, int64_t row_begin,
           int64_t row_end, const GroupedTopkPlan& plan, const GroupedTopkWorkspace& ws) {
  const int64_t lane_blocks_end = row_begin + plan.lane_block_rows;
  switch (plan.strategy) {
    case GroupedTopkStrategy::kApproxRows:
    case GroupedTopkStrategy::kApproxLaneBlocks:
      if constexpr (kScore == ScoringFunc::kSqrtSoftplus) {
        const float margin = approx_margin(bias, p.num_experts);
        if (margin > 0.0f) {
          if constexpr (kApproxRowsInLanes) {
            for (; row_begin < lane_blocks_end; row_begin += W) {
              route_approx_lane_block<kScore, LogitT, BiasT>(p, bias, row_begin, row_end, margin,
                                                             ws);
            }
          }
          if (row_begin < row_end) {
            route_rows_by_approx<kScore, LogitT, BiasT>(p, bias, row_begin, row_end, margin, ws);
          }
          return;
        }
      }
      break;
    case GroupedTopkStrategy::kLaneBlocks:
      if constexpr (kRowsInLanes && kScore != ScoringFunc::kSqrtSoftplus) {
        route_lane_blocks_of_topk<kScore, LogitT, BiasT>(p, bias, row_begin, lane_blocks_end, ws);
        row_begin = lane_blocks_end;
      }
      break;
    case GroupedTopkStrategy::kRows:
      break;
  }
  if (row_begin < row_end) route_rows<kScore, LogitT, BiasT>(p, bias, row_begin, row_end, ws);
}

template <ScoringFunc kScore, typename LogitT>
void route_rows_for_bias(const BiasedGroupedTopkParams& p, int64_t row_begin, int64_t row_end,
                         const GroupedTopkPlan& plan, const GroupedTopkWorkspace& ws) {
  if (p.correction_bias == nullptr) {
    route<kScore, LogitT, no_bias_t>(p, nullptr, row_begin, row_end, plan, ws);
    return;
  }
  if (p.bias_stride != 1) {
    // A strided bias is widened once per call into the workspace; the rows then read it as
    // contiguous fp32. Contiguous biases are read in their own dtype, row by row.
    for (int64_t e = 0; e < p.num_experts; ++e) {
      const int64_t at = e * p.bias_stride;
      switch (p.bias_dtype) {
        case DType::kFloat32: ws.bias[e] = static_cast<const float*>(p.correction_bias)[at]; break;
        case DType::kBFloat16: ws.bias[e] = to_float(static_cast<const bf16_t*>(p.correction_bias)[at]); break;
        case DType::kFloat16: ws.bias[e] = to_float(static_cast<const fp16_t*>(p.correction_bias)[at]); break;
      }
    }
    route<kScore, LogitT, float>(p, ws.bias, row_begin, row_end, plan, ws);
    return;
  }
  switch (p.bias_dtype) {
    case DType::kFloat32:
      route<kScore, LogitT, float>(p, static_cast<const float*>(p.correction_bias), row_begin,
                                   row_end, plan, ws);
      break;
    case DType::kBFloat16:
      route<kScore, LogitT, bf16_t>(p, static_cast<const bf16_t*>(p.correction_bias),
                                    row_begin, row_end, plan, ws);
      break;
    case DType::kFloat16:
      route<kScore, LogitT, fp16_t>(p, static_cast<const fp16_t*>(p.correction_bias),
                                    row_begin, row_end, plan, ws);
      break;
  }
}

template <ScoringFunc kScore>
void route_rows_for_logits(const BiasedGroupedTopkParams& p, int64_t row_begin,
                           int64_t row_end, const GroupedTopkPlan& plan,
                           const GroupedTopkWorkspace& ws) {
  switch (p.gating_dtype) {
    case DType::kFloat32:
      route_rows_for_bias<kScore, float>(p, row_begin, row_end, plan, ws);
      break;
    case DType::kBFloat16:
      route_rows_for_bias<kScore, bf16_t>(p, row_begin, row_end, plan, ws);
      break;
    case DType::kFloat16:
      route_rows_for_bias<kScore, fp16_t>(p, row_begin, row_end, plan, ws);
      break;
  }
}

}  // namespace

void biased_grouped_topk(const BiasedGroupedTopkParams& p, int64_t row_begin, int64_t row_end,
                         const GroupedTopkPlan& plan, const GroupedTopkWorkspace& ws) {
  switch (p.scoring_func) {
    case ScoringFunc::kSigmoid:
      route_rows_for_logits<ScoringFunc::kSigmoid>(p, row_begin, row_end, plan, ws);
      break;
    case ScoringFunc::kSqrtSoftplus:
      route_rows_for_logits<ScoringFunc::kSqrtSoftplus>(p, row_begin, row_end, plan, ws);
      break;
    case ScoringFunc::kSoftmax:
      route_rows_for_logits<ScoringFunc::kSoftmax>(p, row_begin, row_end, plan, ws);
      break;
  }
}

}  // namespace moeext::cpu::MOEEXT_CPU_ISA
