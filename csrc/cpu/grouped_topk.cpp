// Biased grouped top-k routing on the CPU (SPEC.md section 1). Compiled once per ISA; see
// cpu/vec.h. One token (row) at a time, everything in fp32, in four steps:
//   1. scores s and biased scores b of the row, into the workspace (NaN in b becomes -inf);
//   2. a score per expert group (top-2 sum with a bias, max without);
//   3. the kept groups: top topk_group group keys;
//   4. the top topk expert keys among the kept groups, with a vector pre-filter that skips
//      every lane below the current k-th value.
// A key packs a value and an index into one integer, so that "larger value, then lower
// index" is a single unsigned compare: the tie rule costs nothing and can't be got wrong.
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "cpu/grouped_topk_isa.h"
#include "cpu/vec.h"

namespace moeext::cpu::MOEEXT_CPU_ISA {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int W = Vec::kWidth;

// Value in the high word as an order-preserving unsigned integer (with -0 folded onto +0, so
// they tie as the float compare says), inverted index in the low word.
inline uint64_t make_key(float value, int64_t index) {
  const uint32_t bits = float_to_bits(value + 0.0f);
  const uint32_t ordered = bits ^ ((bits >> 31) ? 0xffffffffu : 0x80000000u);
  return (uint64_t(ordered) << 32) | uint32_t(~uint32_t(index));
}
inline int64_t key_index(uint64_t key) { return int64_t(~uint32_t(key)); }

// keys[0, count) holds the best keys seen so far, descending; capacity is k.
inline void topk_insert(uint64_t* keys, int64_t& count, int64_t k, uint64_t key) {
  int64_t pos;
  if (count == k) {
    if (key <= keys[k - 1]) return;
    pos = k - 1;
  } else {
    pos = count++;
  }
  while (pos > 0 && keys[pos - 1] < key) {
    keys[pos] = keys[pos - 1];
    --pos;
  }
  keys[pos] = key;
}

template <ScoringFunc kScore>
inline Vec score(Vec x) {
  if constexpr (kScore == ScoringFunc::kSigmoid) {
    return Vec::set1(1.0f) / (Vec::set1(1.0f) + vexp(Vec::set1(0.0f) - x));
  } else {
    static_assert(kScore == ScoringFunc::kSqrtSoftplus, "softmax is computed row-wide");
    // softplus with torch's threshold: x itself above 20.
    const Vec softplus = vlog1p(vexp(x));
    return Vec::sqrt(Vec::select(Vec::cmp_gt(x, Vec::set1(20.0f)), x, softplus));
  }
}

template <typename BiasT>
inline void store_biased(Vec s, const BiasT* bias, int64_t e, typename Vec::Mask m,
                         float* biased) {
  Vec b = s;
  if constexpr (!std::is_same_v<BiasT, no_bias_t>) {
    b = s + Vec::load(bias + e, m, 0.0f);
  }
  Vec::select(Vec::is_nan(b), Vec::set1(kNegInf), b).store(biased + e, m);
}

// Step 1 for one row of contiguous logits.
template <ScoringFunc kScore, typename LogitT, typename BiasT>
void score_row(const LogitT* logits, const BiasT* bias, int64_t num_experts, float* scores,
               float* biased) {
  if constexpr (kScore == ScoringFunc::kSoftmax) {
    Vec row_max = Vec::set1(kNegInf);
    typename Vec::Mask has_nan = 0;
    for (int64_t e = 0; e < num_experts; e += W) {
      const auto m = Vec::tail_mask(num_experts - e);
      const Vec x = Vec::load(logits + e, m, kNegInf);
      has_nan |= Vec::is_nan(x);
      row_max = Vec::max(row_max, x);
      x.store(scores + e, m);
    }
    // max-subtracted softmax; a NaN anywhere makes the whole row NaN, as in the reference.
    const float max_value = has_nan ? std::numeric_limits<float>::quiet_NaN()
                                    : Vec::reduce_max(row_max);
    Vec sum = Vec::set1(0.0f);
    for (int64_t e = 0; e < num_experts; e += W) {
      const auto m = Vec::tail_mask(num_experts - e);
      const Vec x = Vec::load(scores + e, m, kNegInf);
      const Vec ex = Vec::select(m, vexp(x - Vec::set1(max_value)), Vec::set1(0.0f));
      sum = sum + ex;
      ex.store(scores + e, m);
    }
    const Vec total = Vec::set1(Vec::reduce_add(sum));
    for (int64_t e = 0; e < num_experts; e += W) {
      const auto m = Vec::tail_mask(num_experts - e);
      const Vec s = Vec::load(scores + e, m, 0.0f) / total;
      s.store(scores + e, m);
      store_biased(s, bias, e, m, biased);
    }
  } else {
    for (int64_t e = 0; e < num_experts; e += W) {
      const auto m = Vec::tail_mask(num_experts - e);
      const Vec s = score<kScore>(Vec::load(logits + e, m, 0.0f));
      s.store(scores + e, m);
      store_biased(s, bias, e, m, biased);
    }
  }
}

// Step 2: a group of `size` experts starting at `b`. With a bias, the sum of the two
// largest values (a repeated maximum counts twice); without, the maximum.
inline float group_score(const float* b, int64_t size, bool top2_sum) {
  Vec first = Vec::set1(kNegInf);
  Vec second = Vec::set1(kNegInf);
  for (int64_t i = 0; i < size; i += W) {
    const auto m = Vec::tail_mask(size - i);
    const Vec x = Vec::load(b + i, m, kNegInf);
    second = Vec::max(second, Vec::min(first, x));
    first = Vec::max(first, x);
  }
  const float top1 = Vec::reduce_max(first);
  if (!top2_sum || size == 1) return top1;
  const auto at_top = Vec::cmp_eq(first, Vec::set1(top1));
  float top2;
  if (popcount(at_top) >= 2) {
    top2 = top1;
  } else {
    const float rest = Vec::reduce_max(Vec::select(at_top, Vec::set1(kNegInf), first));
    const float runner_up = Vec::reduce_max(second);
    top2 = runner_up > rest ? runner_up : rest;
  }
  const float sum = top1 + top2;  // +inf + -inf is NaN: it ranks as -inf like NaN in b
  return std::isnan(sum) ? kNegInf : sum;
}

// Step 4. A first pass keeps, lane by lane, the two largest values over the candidate
// ranges; those are distinct experts, so the k-th largest of them bounds the k-th largest
// candidate from below. The second pass offers only lanes at or above that bound (and, once k
// keys are held, at or above the current k-th) to the branchy insertion: about k + a few
// insertions per row instead of k * ln(E / k).
inline float candidate_floor(const float* b, const ExpertRange* ranges, int64_t num_ranges,
                             int64_t k) {
  if (k > 2 * W) return kNegInf;
  Vec first = Vec::set1(kNegInf);
  Vec second = Vec::set1(kNegInf);
  for (int64_t r = 0; r < num_ranges; ++r) {
    for (int64_t e = ranges[r].begin; e < ranges[r].end; e += W) {
      const Vec x = Vec::load(b + e, Vec::tail_mask(ranges[r].end - e), kNegInf);
      second = Vec::max(second, Vec::min(first, x));
      first = Vec::max(first, x);
    }
  }
  if (k <= W) return Vec::kth_largest(first, int(k));
  // All W lanes of `first` are >= their minimum: with the (k - W) best of `second`, that
  // makes k distinct experts at or above the smaller of the two.
  const float rest = Vec::kth_largest(second, int(k - W));
  const float lowest_first = Vec::reduce_min(first);
  return rest < lowest_first ? rest : lowest_first;
}

inline void select_experts(const float* b, const ExpertRange* ranges, int64_t num_ranges,
                           uint64_t* keys, int64_t k) {
  const float floor = candidate_floor(b, ranges, num_ranges, k);
  int64_t count = 0;
  for (int64_t r = 0; r < num_ranges; ++r) {
    for (int64_t e = ranges[r].begin; e < ranges[r].end; e += W) {
      const Vec x = Vec::load(b + e, Vec::tail_mask(ranges[r].end - e), kNegInf);
      float bound = floor;
      if (count == k) {
        const float kth = b[key_index(keys[k - 1])];
        bound = kth > bound ? kth : bound;
      }
      // >= : a value equal to the bound may still win on a lower index.
      auto m = Vec::tail_mask(ranges[r].end - e) & Vec::cmp_ge(x, Vec::set1(bound));
      for (uint32_t bits = m; bits != 0; bits &= bits - 1) {
        const int64_t expert = e + __builtin_ctz(bits);
        topk_insert(keys, count, k, make_key(b[expert], expert));
      }
    }
  }
}

template <ScoringFunc kScore, typename LogitT, typename BiasT>
void route_rows(const BiasedGroupedTopkParams& p, const BiasT* bias, int64_t row_begin,
                int64_t row_end, const GroupedTopkWorkspace& ws) {
  const int64_t num_experts = p.num_experts;
  const int64_t num_groups = p.num_expert_group;
  const int64_t group_size = num_experts / num_groups;
  const int64_t topk = p.topk;
  const bool all_groups_kept = p.topk_group == num_groups;
  const bool has_bias = !std::is_same_v<BiasT, no_bias_t>;
  const LogitT* logits_base = static_cast<const LogitT*>(p.gating_output);

  for (int64_t t = row_begin; t < row_end; ++t) {
    const LogitT* row = logits_base + t * p.gating_row_stride;
    if (p.gating_col_stride != 1) {
      // Column-strided logits: widen this row into the workspace, then read it contiguously.
      for (int64_t e = 0; e < num_experts; ++e) {
        ws.row[e] = to_float(row[e * p.gating_col_stride]);
      }
      score_row<kScore, float, BiasT>(ws.row, bias, num_experts, ws.scores, ws.biased);
    } else {
      score_row<kScore, LogitT, BiasT>(row, bias, num_experts, ws.scores, ws.biased);
    }

    if (all_groups_kept) {
      const ExpertRange all{0, num_experts};
      select_experts(ws.biased, &all, 1, ws.expert_keys, topk);
    } else {
      int64_t kept = 0;
      for (int64_t g = 0; g < num_groups; ++g) {
        const float gs = group_score(ws.biased + g * group_size, group_size, has_bias);
        topk_insert(ws.group_keys, kept, p.topk_group, make_key(gs, g));
      }
      for (int64_t i = 0; i < kept; ++i) {
        const int64_t g = key_index(ws.group_keys[i]);
        ws.ranges[i] = ExpertRange{g * group_size, (g + 1) * group_size};
      }
      select_experts(ws.biased, ws.ranges, kept, ws.expert_keys, topk);
    }

    float* weights = p.topk_weights + t * p.weights_row_stride;
    int32_t* ids = p.topk_ids + t * p.ids_row_stride;
    float sum = 0.0f;
    for (int64_t j = 0; j < topk; ++j) {
      const int64_t expert = key_index(ws.expert_keys[j]);
      const float w = ws.scores[expert];
      weights[j] = std::isnan(w) ? 0.0f : w;  // weights come from s, never from b - bias
      ids[j] = int32_t(expert);
      sum += weights[j];
    }
    const float scale = p.routed_scaling_factor;
    if (p.renormalize) {
      const float denom = sum + 1e-20f;
      for (int64_t j = 0; j < topk; ++j) weights[j] = weights[j] / denom * scale;
    } else {
      for (int64_t j = 0; j < topk; ++j) weights[j] *= scale;
    }
  }
}

template <ScoringFunc kScore, typename LogitT>
void route_rows_for_bias(const BiasedGroupedTopkParams& p, int64_t row_begin, int64_t row_end,
                         const GroupedTopkWorkspace& ws) {
  if (p.correction_bias == nullptr) {
    route_rows<kScore, LogitT, no_bias_t>(p, nullptr, row_begin, row_end, ws);
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
    route_rows<kScore, LogitT, float>(p, ws.bias, row_begin, row_end, ws);
    return;
  }
  switch (p.bias_dtype) {
    case DType::kFloat32:
      route_rows<kScore, LogitT, float>(p, static_cast<const float*>(p.correction_bias),
                                        row_begin, row_end, ws);
      break;
    case DType::kBFloat16:
      route_rows<kScore, LogitT, bf16_t>(p, static_cast<const bf16_t*>(p.correction_bias),
                                         row_begin, row_end, ws);
      break;
    case DType::kFloat16:
      route_rows<kScore, LogitT, fp16_t>(p, static_cast<const fp16_t*>(p.correction_bias),
                                         row_begin, row_end, ws);
      break;
  }
}

template <ScoringFunc kScore>
void route_rows_for_logits(const BiasedGroupedTopkParams& p, int64_t row_begin,
                           int64_t row_end, const GroupedTopkWorkspace& ws) {
  switch (p.gating_dtype) {
    case DType::kFloat32:
      route_rows_for_bias<kScore, float>(p, row_begin, row_end, ws);
      break;
    case DType::kBFloat16:
      route_rows_for_bias<kScore, bf16_t>(p, row_begin, row_end, ws);
      break;
    case DType::kFloat16:
      route_rows_for_bias<kScore, fp16_t>(p, row_begin, row_end, ws);
      break;
  }
}

}  // namespace

void biased_grouped_topk(const BiasedGroupedTopkParams& p, int64_t row_begin, int64_t row_end,
                         const GroupedTopkWorkspace& ws) {
  switch (p.scoring_func) {
    case ScoringFunc::kSigmoid:
      route_rows_for_logits<ScoringFunc::kSigmoid>(p, row_begin, row_end, ws);
      break;
    case ScoringFunc::kSqrtSoftplus:
      route_rows_for_logits<ScoringFunc::kSqrtSoftplus>(p, row_begin, row_end, ws);
      break;
    case ScoringFunc::kSoftmax:
      route_rows_for_logits<ScoringFunc::kSoftmax>(p, row_begin, row_end, ws);
      break;
  }
}

}  // namespace moeext::cpu::MOEEXT_CPU_ISA
