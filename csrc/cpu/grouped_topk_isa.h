// What dispatch.cpp needs to call the per-ISA copies of cpu/grouped_topk.cpp.
#pragma once

#include <cstdint>

#include "cpu/score_pieces.h"
#include "moeext/grouped_topk.h"

namespace moeext::cpu {

// Experts [begin, end) of one kept group.
struct ExpertRange {
  int64_t begin, end;
};

// Candidates the sorting path of the expert selection ranks at most; rows with more (ties,
// or topk beyond 32) take the insertion path.
constexpr int64_t kMaxCandidates = 64;
// Rows in lanes (cpu/grouped_topk.cpp): the most rows per block (the widest vector's lanes;
// AVX2 blocks take 8), and the largest router it takes (the rows' scores then stay in the
// stack workspace).
constexpr int64_t kLaneRows = 16;
constexpr int64_t kLaneMaxExperts = 256;
// The candidate pass (sqrt-softplus) takes rows in lanes for routers of up to this many experts.
constexpr int64_t kApproxLaneMaxExperts = 1024;
// Slack after each candidate array: compress_store writes whole 16-lane vectors.
constexpr int64_t kCandidateSlack = 16;

// Per-thread scratch, allocated by dispatch.cpp; the kernel allocates nothing.
struct GroupedTopkWorkspace {
  float* scores[2];        // [num_experts] unbiased scores s of rows t and t + 1 (slot t % 2)
  float* biased[2];        // [num_experts] s + bias, NaN replaced by -inf, the same two rows
  float* row;              // [num_experts] the row widened to fp32, for column-strided logits
  float* bias;             // [num_experts] the bias widened to fp32, for a strided bias
  float* group_scores;     // [num_expert_group + kCandidateSlack]
  float* group_seconds;    // [num_expert_group + kCandidateSlack] each group's second largest b
  float* candidates;       // [kMaxCandidates + kCandidateSlack] values b of the candidates
  int32_t* candidate_ids;  // [kMaxCandidates + kCandidateSlack] their expert indices
  float* candidate_scores; // [kMaxCandidates + kCandidateSlack] their exact scores s
  float* candidate_bias;   // [kMaxCandidates + kCandidateSlack] their biases, widened
  // The approximate sqrt-softplus scores, for calls of that scoring function (else nullptr).
  const ScorePieces* score_pieces;
  int32_t* chosen;         // [topk] the chosen experts, best first
  uint64_t* group_keys;    // [topk_group]
  uint64_t* expert_keys;   // [topk]
  ExpertRange* ranges;     // [topk_group]
  // [kLaneRows * num_experts padded to 16] the scores of kLaneRows rows, for routing rows in
  // lanes (routers of up to kLaneMaxExperts, sqrt-softplus ones of up to
  // kApproxLaneMaxExperts given kLaneRows rows; else nullptr).
  float* lane_rows;
};

#define MOEEXT_DECLARE_GROUPED_TOPK(isa)                                                  \
  namespace isa {                                                                         \
  void biased_grouped_topk(const BiasedGroupedTopkParams& p, int64_t row_begin,           \
                           int64_t row_end, const GroupedTopkWorkspace& ws);              \
  }
MOEEXT_DECLARE_GROUPED_TOPK(portable)
MOEEXT_DECLARE_GROUPED_TOPK(avx2)
MOEEXT_DECLARE_GROUPED_TOPK(avx512)
#undef MOEEXT_DECLARE_GROUPED_TOPK

}  // namespace moeext::cpu
