// The lanes strategy of the CPU routing kernel: a block of rows side by side, row r in lane
// r of every vector, steps 2 to 4 lane-wise. Part of cpu/grouped_topk.cpp's translation unit,
// compiled once per ISA (see there).
#pragma once

#include <cstdint>
#include <type_traits>

#include "cpu/grouped_topk_rows.h"

namespace moeext::cpu::MOEEXT_CPU_ISA {
namespace {

// Rows in lanes: kLaneRows rows at a time, row r in lane r of every vector, so that steps 2
// to 4 are lane-wise: a group score is a running maximum, the kept groups come from comparing
// group scores pairwise, and the topk experts from an insertion into topk sorted slots that
// each row's experts pass through in index order, all without a horizontal step, a gather of
// candidates or a branch on the data. For softmax and sigmoid rows, without a bias
// (DeepSeek-V2) or with every group kept (GLM-4.5); with a bias and groups to drop, the group
// scores are top-2 sums, left to route_rows. Each row is scored by the functions route_rows
// uses, b and the weights are computed with store_biased's and write_row_outputs' operations
// in their order, so the outputs are route_rows' bit for bit.
// Which ISAs have it, and which calls take it, is the plan's (cpu/grouped_topk_plan.h).
#if MOEEXT_ISA_ID(MOEEXT_CPU_ISA) == MOEEXT_ISA_avx512
constexpr GroupedTopkIsa kIsa = kGroupedTopkAvx512;
#elif MOEEXT_ISA_ID(MOEEXT_CPU_ISA) == MOEEXT_ISA_avx2
constexpr GroupedTopkIsa kIsa = kGroupedTopkAvx2;
#elif MOEEXT_ISA_ID(MOEEXT_CPU_ISA) == MOEEXT_ISA_portable
constexpr GroupedTopkIsa kIsa = kGroupedTopkPortable;
#else
#error "the routing kernel has no plan for this MOEEXT_CPU_ISA"
#endif
static_assert(kIsa.lanes == W, "a block of rows in lanes is a vector's lanes");
constexpr bool kRowsInLanes = kIsa.rows_in_lanes;
constexpr bool kApproxRowsInLanes = kIsa.approx_rows_in_lanes;

// The lanes' best K values v so far, best first, and their experts' ids (as floats, exact far
// past kLaneMaxExperts); slots filled..K-1 are empty. x, of expert x_id, goes after every
// filled slot it does not beat: experts arrive in index order, so a slot holding an equal
// value holds a lower index, which wins. (Empty slots rather than -inf ones: b may be -inf.)
template <int K>
MOEEXT_ALWAYS_INLINE void insert_in_lanes(Vec* v, Vec* id, Vec x, Vec x_id, int filled = K) {
  typename Vec::LaneMask beats[K];
  for (int j = 0; j < K; ++j) {
    beats[j] = j < filled ? Vec::lanes_gt(x, v[j]) : Vec::lane_mask(Vec::tail_mask(W));
  }
  // The slots are sorted, so a lane where x beats slot j - 1 beats slot j too: there slot
  // j takes slot j - 1's value, where x beats slot j only, x.
  for (int j = K - 1; j > 0; --j) {
    v[j] = Vec::blend(beats[j - 1], v[j - 1], Vec::blend(beats[j], x, v[j]));
    id[j] = Vec::blend(beats[j - 1], id[j - 1], Vec::blend(beats[j], x_id, id[j]));
  }
  v[0] = Vec::blend(beats[0], x, v[0]);
  id[0] = Vec::blend(beats[0], x_id, id[0]);
}

// The experts offered to the slots, counted so that the first K fill them.
template <int K>
struct LaneSlots {
  Vec v[K], id[K];
  int offered = 0;
  // The first offers blend x over the empty slots, and the blends read them (a blendv even by
  // a constant mask): zeros there, not uninitialised registers.
  LaneSlots() {
    for (int j = 0; j < K; ++j) v[j] = id[j] = Vec::set1(0.0f);
  }
  MOEEXT_ALWAYS_INLINE void offer(Vec x, Vec x_id) {
    if (offered < K) {
      insert_in_lanes<K>(v, id, x, x_id, offered++);
    } else {
      insert_in_lanes<K>(v, id, x, x_id);
    }
  }
};

// Step 7 and the outputs of rows t0 + r for the lanes r of `rows`, in write_row_outputs'
// order: w[j] and id[j] hold each lane's j-th weight (before renormalising) and expert id
// (as a float), for j < k <= kMaxK.
template <int kMaxK>
MOEEXT_ALWAYS_INLINE void write_lane_outputs(const BiasedGroupedTopkParams& p, int64_t t0,
                                             int64_t k, const Vec* w, const Vec* id,
                                             typename Vec::Mask rows) {
  Vec sum = Vec::set1(0.0f);
  for (int64_t j = 0; j < k; ++j) sum = sum + w[j];
  const Vec scale = Vec::set1(p.routed_scaling_factor);
  alignas(64) float out_weights[kMaxK][W];
  alignas(64) float out_ids[kMaxK][W];
  for (int64_t j = 0; j < k; ++j) {
    finalize_weight(w[j], sum, p.renormalize, scale).store(out_weights[j]);
    id[j].store(out_ids[j]);
  }
  for (int64_t r = 0; r < W; ++r) {
    if (!((rows >> r) & 1)) continue;
    float* weights = p.topk_weights + (t0 + r) * p.weights_row_stride;
    int32_t* ids = p.topk_ids + (t0 + r) * p.ids_row_stride;
    for (int64_t j = 0; j < k; ++j) {
      weights[j] = out_weights[j][r];
      ids[j] = int32_t(out_ids[j][r]);
    }
  }
}

// Step 4 where not every group is kept (no bias): lane by lane, expert i of the q-th kept
// group (in group order) is picked from the groups' expert i by selects, for q and then i in
// order, so that each lane meets its kept experts in index order. (A gather per expert
// instead is slower than the selects.) kGroups is num_groups where it is a compile-time
// count, else 0.
template <int kGroups, int K>
MOEEXT_ALWAYS_INLINE void offer_kept_groups(
    const float* b, int64_t num_groups_at_run_time, int64_t group_size, int64_t topk_group,
    const typename Vec::LaneMask (*keeps)[kLaneMaxGroups], LaneSlots<K>& slots) {
  const int64_t num_groups = kGroups > 0 ? kGroups : num_groups_at_run_time;
  for (int64_t q = 0; q < topk_group; ++q) {
    Vec x_id = Vec::set1(0.0f);  // the group's first expert
    for (int64_t g = 1; g < num_groups; ++g) {
      x_id = Vec::blend(keeps[q][g], Vec::set1(float(g * group_size)), x_id);
    }
    for (int64_t i = 0; i < group_size; ++i) {
      Vec x = Vec::load(b + i * W);
      for (int64_t g = 1; g < num_groups; ++g) {
        x = Vec::blend(keeps[q][g], Vec::load(b + (g * group_size + i) * W), x);
      }
      slots.offer(x, x_id);
      x_id = x_id + Vec::set1(1.0f);
    }
  }
}

// Step 1 for the rows in lanes: a row's scores as score_row computes them, vector i to
// scores + i * vector_stride.
template <ScoringFunc kScore, typename LogitT>
MOEEXT_ALWAYS_INLINE void score_row_strided(const LogitT* logits, int64_t num_experts,
                                            float* scores, int64_t vector_stride) {
  if constexpr (kScore == ScoringFunc::kSoftmax) {
    // AVX-512's registers hold rows of all kLaneMaxExperts; AVX2 scores softmax rows in lanes.
    static_assert(kScore != ScoringFunc::kSoftmax || kMaxSoftmaxVecs * W >= kLaneMaxExperts,
                  "see kSoftmaxInLanes");
    kSoftmaxRows<LogitT>[(num_experts + W - 1) / W - 1](logits, num_experts, scores,
                                                         vector_stride);
  } else {
    for_each_vector(0, num_experts, [&](int64_t e, typename Vec::Mask m) {
      score<kScore>(Vec::load(logits + e, m, 0.0f)).store(scores + e / W * vector_stride);
    });
  }
}

// Softmax rows are scored in lanes on AVX2, the W rows side by side after the tiles'
// transpose. Row by row, each row was one chain of passes joined by horizontal steps (its
// maximum; its sum and one divide), which the next row could not overlap; in lanes the W
// chains run as one (softmax_lanewise says why the outputs stay the row path's). AVX-512
// keeps the row functions: not measured in lanes.
template <ScoringFunc kScore>
constexpr bool kSoftmaxInLanes = kRowsInLanes && W < kLaneRows && kScore == ScoringFunc::kSoftmax;

// The softmax of each lane's row, over the logits x at lanes + e * W for e < num_experts, in
// place: s, or b = max(s, -inf) without a bias, as route_lane_block stores them. The
// operations are softmax_in_registers' and score_row's, in their order: lane j of the
// row pass's vector sum adds the exps of experts e = j mod W in index order, as sum[j] does
// here, and reduce_add_lanewise adds those W sums as reduce_add adds a vector's lanes. Only
// the maximum may come out differently, where the row holds a NaN that makes its sum, and
// so every score, NaN on either path. V is Vec, a parameter as in route_lane_block: only the
// layer this runs on (AVX2) has reduce_add_lanewise.
template <typename V, bool kHasBias>
MOEEXT_ALWAYS_INLINE void softmax_lanewise(float* lanes, int64_t num_experts) {
  Vec row_max = Vec::set1(kNegInf);
  for (int64_t e = 0; e < num_experts; ++e) {
    row_max = Vec::max(row_max, Vec::load(lanes + e * W));
  }
  Vec sum[W];
  for (int j = 0; j < W; ++j) sum[j] = Vec::set1(0.0f);
  // Expert e's exp, added to sum[j] (j = e mod W, a constant in the unrolled loops below).
  // Forced inline: as a plain lambda it moved GCC's inlining elsewhere in the AVX2 copy.
  auto add_exp = [&](int64_t e, int j) __attribute__((always_inline)) {
    const Vec ex = vexp_nonpositive(Vec::load(lanes + e * W) - row_max);
    sum[j] = sum[j] + ex;
    ex.store(lanes + e * W);
  };
  int64_t e = 0;
  for (; e + W <= num_experts; e += W) {
#pragma GCC unroll 16
    for (int j = 0; j < W; ++j) add_exp(e + j, j);
  }
#pragma GCC unroll 16
  for (int j = 0; j < W; ++j) {
    if (e + j < num_experts) add_exp(e + j, j);
  }
  const Vec inverse = Vec::set1(1.0f) / V::reduce_add_lanewise(sum);
  for (int64_t e = 0; e < num_experts; ++e) {
    Vec s = Vec::load(lanes + e * W) * inverse;
    if constexpr (!kHasBias) s = nan_to_neg_inf(s);
    s.store(lanes + e * W);
  }
}

// Rows [t0, t0 + W), K = topk. V is Vec, a parameter so that the layer this path does not
// run on (scalar) needs no transpose.
template <ScoringFunc kScore, int K, typename LogitT, typename BiasT, typename V = Vec>
void route_lane_block(const BiasedGroupedTopkParams& p, const BiasT* bias, int64_t t0,
                      const GroupedTopkWorkspace& ws) {
  constexpr bool has_bias = !std::is_same_v<BiasT, no_bias_t>;
  const int64_t num_experts = p.num_experts;
  const int64_t num_groups = p.num_expert_group;
  const int64_t topk_group = p.topk_group;
  const int64_t group_size = num_experts / num_groups;
  const int64_t num_vecs = (num_experts + W - 1) / W;
  const LogitT* logits = static_cast<const LogitT*>(p.gating_output) + t0 * p.gating_row_stride;
  float* const lanes = ws.lane_rows;

  // Step 1: vector i of row r's scores to lanes + (i * W + r) * W, so that each W x W tile,
  // transposed in place, leaves expert e's scores of the W rows at lanes + e * W. Without a
  // bias, b (s with NaN as -inf) takes their place: only the weights need s, and there a NaN
  // score (b = -inf) weighs 0.
  // Softmax rows on AVX2 are scored after the transpose, in lanes.
  constexpr bool scored = !kSoftmaxInLanes<kScore>;
  if constexpr (!scored) {
    for (int64_t r = 0; r < W; ++r) {
      for_each_vector(0, num_experts, [&](int64_t e, typename Vec::Mask m) {
        Vec::load(logits + r * p.gating_row_stride + e, m, kNegInf).store(lanes + (e + r) * W);
      });
    }
  } else {
    for (int64_t r = 0; r < W; ++r) {
      score_row_strided<kScore>(logits + r * p.gating_row_stride, num_experts, lanes + r * W,
                                W * W);
    }
  }
  for (int64_t i = 0; i < num_vecs; ++i) {
    float* const tile = lanes + i * W * W;
    Vec rows[W];
    for (int64_t r = 0; r < W; ++r) rows[r] = Vec::load(tile + r * W);
    V::transpose(rows);
    for (int64_t l = 0; l < W; ++l) {
      if (!has_bias && scored) rows[l] = nan_to_neg_inf(rows[l]);
      rows[l].store(tile + l * W);
    }
  }
  if constexpr (!scored) softmax_lanewise<V, has_bias>(lanes, num_experts);

  LaneSlots<K> slots;
  if (topk_group == num_groups) {
    // Step 4 over every expert, b = s + bias as store_biased computes it.
    Vec x_id = Vec::set1(0.0f);
    for (int64_t e = 0; e < num_experts; ++e) {
      Vec x = Vec::load(lanes + e * W);
      if constexpr (has_bias) {
        x = nan_to_neg_inf(x + Vec::set1(bias_at(bias, e)));
      }
      slots.offer(x, x_id);
      x_id = x_id + Vec::set1(1.0f);
    }
  } else {
    // Steps 2 and 3 (no bias): group maxima; a group is kept where fewer than topk_group
    // groups beat it (ties to the lower group index).
    Vec group_score[kLaneMaxGroups];
    for (int64_t g = 0; g < num_groups; ++g) {
      const float* x = lanes + g * group_size * W;
      Vec m = Vec::load(x);
#pragma GCC unroll 4
      for (int64_t i = 1; i < group_size; ++i) m = Vec::max(m, Vec::load(x + i * W));
      group_score[g] = m;
    }
    // keeps[q][g]: the lanes whose q-th kept group (in group order) is g.
    typename Vec::LaneMask keeps[kLaneMaxGroups][kLaneMaxGroups];
    Vec kept_before = Vec::set1(0.0f);
    for (int64_t g = 0; g < num_groups; ++g) {
      Vec beaten_by = Vec::set1(0.0f);
      for (int64_t h = 0; h < num_groups; ++h) {
        if (h == g) continue;
        beaten_by = Vec::count_true(
            beaten_by, h < g ? Vec::cmp_ge(group_score[h], group_score[g])
                             : Vec::cmp_gt(group_score[h], group_score[g]));
      }
      const auto kept = Vec::cmp_lt(beaten_by, Vec::set1(float(topk_group)));
      for (int64_t q = 0; q < topk_group; ++q) {
        keeps[q][g] = Vec::lane_mask(kept & Vec::cmp_eq(kept_before, Vec::set1(float(q))));
      }
      kept_before = Vec::count_true(kept_before, kept);
    }
    // Step 4: the kept groups hold at least K experts, so every slot fills.
    if (num_groups == 8) {  // DeepSeek-V2 and V3's count: the selects unrolled
      offer_kept_groups<8, K>(lanes, num_groups, group_size, topk_group, keeps, slots);
    } else {
      offer_kept_groups<0, K>(lanes, num_groups, group_size, topk_group, keeps, slots);
    }
  }

  // Steps 6 and 7.
  Vec w[K];
  for (int j = 0; j < K; ++j) {
    if constexpr (has_bias) {
      // Each lane's chosen expert's s, from where step 1 left it.
      alignas(64) float ids[W];
      slots.id[j].store(ids);
      alignas(64) float s[W];
      for (int64_t r = 0; r < W; ++r) s[r] = lanes[int64_t(ids[r]) * W + r];
      w[j] = weight_of_score(Vec::load(s));
    } else {
      w[j] = Vec::max(slots.v[j], Vec::set1(0.0f));  // b = -inf (a NaN score) weighs 0
    }
  }
  write_lane_outputs<K>(p, t0, K, w, slots.id, Vec::tail_mask(W));
}

template <ScoringFunc kScore, int K, typename LogitT, typename BiasT>
void route_lane_blocks(const BiasedGroupedTopkParams& p, const BiasT* bias, int64_t row_begin,
                       int64_t row_end, const GroupedTopkWorkspace& ws) {
  for (int64_t t = row_begin; t < row_end; t += W) {
    route_lane_block<kScore, K, LogitT, BiasT>(p, bias, t, ws);
  }
}

}  // namespace
}  // namespace moeext::cpu::MOEEXT_CPU_ISA
