// routing_weights on the CPU (docs/SPEC.md section 6.6), compiled once per ISA as the routing
// kernel is (cpu/vec.h). The scores come from routing's own functions (grouped_topk_score.h):
// the elementwise ones of the given experts, softmax of the whole row as routing scores it;
// the weights' arithmetic is routing's write_row_outputs'. So a replay of the ids routing chose,
// in its order, gives routing's weights bit for bit on the same path.
// A TU of its own: inside the routing kernel's, it would change how GCC inlines that file.
#include <cstdint>

#include "cpu/grouped_topk_score.h"
#include "cpu/routing_weights_isa.h"

namespace moeext::cpu::MOEEXT_CPU_ISA {
namespace {

template <typename IdT>
int64_t id_at(const RoutingWeightsParams& p, int64_t t, int64_t j) {
  return int64_t(static_cast<const IdT*>(p.topk_ids)[t * p.ids_row_stride + j * p.ids_col_stride]);
}

// The scores s[0, k) of row t's given experts.
template <ScoringFunc kScore, typename LogitT, typename IdT>
void given_scores(const RoutingWeightsParams& p, int64_t t, const RoutingWeightsWorkspace& ws) {
  const LogitT* row = static_cast<const LogitT*>(p.gating_output) + t * p.gating_row_stride;
  if constexpr (kScore == ScoringFunc::kSoftmax) {
    LaneTop2 unused;
    const float* scores;
    if (p.gating_col_stride != 1) {
      // As routing reads column-strided logits: widened into a row first.
      for (int64_t e = 0; e < p.num_experts; ++e) ws.row[e] = to_float(row[e * p.gating_col_stride]);
      scores = ws.scores;
      score_row<kScore, 0, float, no_bias_t>(ws.row, nullptr, p.num_experts, ws.scores,
                                             ws.biased, unused);
    } else {
      scores = ws.scores;
      score_row<kScore, 0, LogitT, no_bias_t>(row, nullptr, p.num_experts, ws.scores, ws.biased,
                                              unused);
    }
    for (int64_t j = 0; j < p.k; ++j) ws.given[j] = scores[id_at<IdT>(p, t, j)];
  } else {
    for (int64_t j = 0; j < p.k; ++j) {
      ws.given[j] = to_float(row[id_at<IdT>(p, t, j) * p.gating_col_stride]);
    }
    for (int64_t j = 0; j < p.k; j += W) {
      const auto m = Vec::tail_mask(p.k - j);
      score<kScore>(Vec::load(ws.given + j, m, 0.0f)).store(ws.given + j, m);
    }
  }
}

// Steps 6 and 7 of routing (write_row_outputs' operations, in its order) on the given scores.
void write_weights(const RoutingWeightsParams& p, int64_t t, const RoutingWeightsWorkspace& ws) {
  float* weights = p.topk_weights + t * p.weights_row_stride;
  float sum = 0.0f;
  for (int64_t j = 0; j < p.k; ++j) {
    const float w = ws.given[j];
    weights[j] = std::isnan(w) ? 0.0f : w;
    sum += weights[j];
  }
  const Vec scale = Vec::set1(p.routed_scaling_factor);
  const Vec denom = Vec::set1(sum + 1e-20f);
  for (int64_t j = 0; j < p.k; j += W) {
    const auto m = Vec::tail_mask(p.k - j);
    Vec w = Vec::load(weights + j, m, 0.0f);
    if (p.renormalize) w = w / denom;
    (w * scale).store(weights + j, m);
  }
}

template <ScoringFunc kScore, typename LogitT, typename IdT>
void weigh(const RoutingWeightsParams& p, int64_t row_begin, int64_t row_end,
           const RoutingWeightsWorkspace& ws) {
  for (int64_t t = row_begin; t < row_end; ++t) {
    given_scores<kScore, LogitT, IdT>(p, t, ws);
    write_weights(p, t, ws);
  }
}

template <ScoringFunc kScore, typename LogitT>
void weigh_for_ids(const RoutingWeightsParams& p, int64_t row_begin, int64_t row_end,
                   const RoutingWeightsWorkspace& ws) {
  switch (p.ids_dtype) {
    case IntType::kInt16: weigh<kScore, LogitT, int16_t>(p, row_begin, row_end, ws); break;
    case IntType::kInt32: weigh<kScore, LogitT, int32_t>(p, row_begin, row_end, ws); break;
    case IntType::kInt64: weigh<kScore, LogitT, int64_t>(p, row_begin, row_end, ws); break;
  }
}

template <ScoringFunc kScore>
void weigh_for_logits(const RoutingWeightsParams& p, int64_t row_begin, int64_t row_end,
                      const RoutingWeightsWorkspace& ws) {
  switch (p.gating_dtype) {
    case DType::kFloat32: weigh_for_ids<kScore, float>(p, row_begin, row_end, ws); break;
    case DType::kBFloat16: weigh_for_ids<kScore, bf16_t>(p, row_begin, row_end, ws); break;
    case DType::kFloat16: weigh_for_ids<kScore, fp16_t>(p, row_begin, row_end, ws); break;
  }
}

}  // namespace

void routing_weights(const RoutingWeightsParams& p, int64_t row_begin, int64_t row_end,
                     const RoutingWeightsWorkspace& ws) {
  switch (p.scoring_func) {
    case ScoringFunc::kSigmoid:
      weigh_for_logits<ScoringFunc::kSigmoid>(p, row_begin, row_end, ws);
      break;
    case ScoringFunc::kSqrtSoftplus:
      weigh_for_logits<ScoringFunc::kSqrtSoftplus>(p, row_begin, row_end, ws);
      break;
    case ScoringFunc::kSoftmax:
      weigh_for_logits<ScoringFunc::kSoftmax>(p, row_begin, row_end, ws);
      break;
  }
}

}  // namespace moeext::cpu::MOEEXT_CPU_ISA
