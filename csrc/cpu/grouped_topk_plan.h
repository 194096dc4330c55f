// Which strategy the CPU routing kernel takes for a chunk of rows, and the workspace that
// strategy needs: decided once per call, here, from the call's shape and what the ISA's copy
// of the kernel has. dispatch.cpp sizes and lays out the workspace by the plan; the kernel
// runs the plan's strategy and decides only what depends on the data. No ISA-specific code
// (dispatch.cpp's baseline flags compile it, and tests/cpp/test_grouped_topk_plan.cpp).
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
// Slack after each candidate array: compress_store writes whole 16-lane vectors.
constexpr int64_t kCandidateSlack = 16;

// Rows in lanes (route_lane_block): the most rows per block (the widest vector's lanes; AVX2
// blocks take 8), and the largest router, topk, and group count it takes. The router's size
// keeps a block's scores in the stack workspace; topk and the groups are its registers' and
// its kept-group masks' counts.
constexpr int64_t kLaneRows = 16;
constexpr int64_t kLaneMaxExperts = 256;
constexpr int64_t kLaneMaxTopk = 8;
constexpr int64_t kLaneMaxGroups = 16;
// Where every group is kept, every expert is offered to the topk slots. A block of 8 rows
// shares each offer between half the rows a block of 16 does, and AVX2's 16 registers barely
// hold 8 slots and their ids: past this many offers x slots per row, rows one at a time are
// faster on 8 lanes (docs/notes/cpu-routing.md). With groups dropped only the kept groups'
// experts are offered, and the lanes stay the faster.
constexpr int64_t kLaneMaxOffersAllKept = 768;
// The candidate pass in lanes (route_approx_lane_block): routers of up to this many experts
// (its marks are a fixed array of bits), and topk up to its slots less two.
constexpr int64_t kApproxLaneMaxExperts = 1024;
constexpr int64_t kApproxLaneMaxTopk = 6;

// What an ISA's copy of the kernel offers the plan: its vector lanes (rows per block in
// lanes), and which block strategies it compiles. Rows in lanes run on AVX-512 (16 rows a
// block) and AVX2 (8; its insertion holds its masks as whole lanes, see Vec::LaneMask), not
// on the portable layer, which serves aarch64: untimed there. The candidate pass in lanes
// marks experts in 64-bit words of four 16-lane vectors: AVX-512 only.
struct GroupedTopkIsa {
  int64_t lanes;
  bool rows_in_lanes;
  bool approx_rows_in_lanes;
};
constexpr GroupedTopkIsa kGroupedTopkPortable{8, false, false};
constexpr GroupedTopkIsa kGroupedTopkAvx2{8, true, false};
constexpr GroupedTopkIsa kGroupedTopkAvx512{16, true, true};
constexpr bool lanes_are_a_power_of_two(const GroupedTopkIsa& isa) {
  return isa.lanes > 0 && (isa.lanes & (isa.lanes - 1)) == 0;
}
static_assert(lanes_are_a_power_of_two(kGroupedTopkPortable) &&
                  lanes_are_a_power_of_two(kGroupedTopkAvx2) &&
                  lanes_are_a_power_of_two(kGroupedTopkAvx512),
              "plan_grouped_topk counts whole blocks of lanes by a mask");

enum class GroupedTopkStrategy : int8_t {
  // route_rows: one row at a time, exact scores. What every other strategy falls back to.
  kRows,
  // route_lane_block for whole blocks of rows in lanes, route_rows for the rest.
  kLaneBlocks,
  // route_rows_by_approx: the sqrt-softplus candidate pass, row by row.
  kApproxRows,
  // route_approx_lane_block for whole blocks of rows in lanes, route_rows_by_approx for the rest.
  kApproxLaneBlocks,
};

constexpr bool is_candidate_pass(GroupedTopkStrategy strategy) {
  return strategy == GroupedTopkStrategy::kApproxRows ||
         strategy == GroupedTopkStrategy::kApproxLaneBlocks;
}

struct GroupedTopkPlan {
  GroupedTopkStrategy strategy = GroupedTopkStrategy::kRows;
  // Rows taken in blocks of lanes from the chunk's first row: whole blocks, 0 without.
  int64_t lane_block_rows = 0;
  // The workspace (GroupedTopkWorkspace): its arrays' lengths, and its size in bytes, with
  // room to start the lane rows on a cache line.
  int64_t row_floats = 0;       // each row array, num_experts padded to whole 16-lane vectors
  int64_t group_floats = 0;     // each group array
  int64_t candidate_slots = 0;  // each candidate array
  int64_t chosen_slots = 0;
  int64_t group_keys = 0;       // also the kept groups' ranges
  int64_t expert_keys = 0;
  int64_t lane_floats = 0;      // the rows in lanes, 0 without
  int64_t workspace_bytes = 0;
};

// Per-thread scratch, laid out by lay_out_grouped_topk_workspace; the kernel allocates nothing.
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
  // The approximate sqrt-softplus scores, for the candidate pass (else nullptr).
  const ScorePieces* score_pieces;
  int32_t* chosen;         // [topk] the chosen experts, best first
  uint64_t* group_keys;    // [topk_group]
  uint64_t* expert_keys;   // [topk]
  ExpertRange* ranges;     // [topk_group]
  // [lanes * num_experts padded to 16] the scores of a block of rows in lanes, for the
  // strategies of blocks (else nullptr).
  float* lane_rows;
};

// The plan for `rows` rows of the call p on the ISA's copy of the kernel.
inline GroupedTopkPlan plan_grouped_topk(const BiasedGroupedTopkParams& p, int64_t rows,
                                         const GroupedTopkIsa& isa) {
  GroupedTopkPlan plan;
  const bool all_groups_kept = p.topk_group == p.num_expert_group;
  // A mask, not a divide (lanes is a power of two): the plan is made on every call.
  const int64_t whole_blocks = rows & -isa.lanes;
  if (p.scoring_func == ScoringFunc::kSqrtSoftplus) {
    // The candidate pass takes its floor from the lanes' top-2 of the whole row, and reads
    // the candidates' logits back by index.
    if (all_groups_kept && p.topk <= 2 * isa.lanes && p.gating_col_stride == 1) {
      plan.strategy = GroupedTopkStrategy::kApproxRows;
      if (isa.approx_rows_in_lanes && whole_blocks > 0 && p.topk <= kApproxLaneMaxTopk &&
          p.num_experts <= kApproxLaneMaxExperts) {
        plan.strategy = GroupedTopkStrategy::kApproxLaneBlocks;
        plan.lane_block_rows = whole_blocks;
      }
    }
  } else if (isa.rows_in_lanes && whole_blocks > 0) {
    // With a bias and groups to drop, the group scores are top-2 sums: left to the rows.
    const bool fits = p.num_experts <= kLaneMaxExperts && p.gating_col_stride == 1 &&
                      p.topk <= kLaneMaxTopk && p.num_expert_group <= kLaneMaxGroups &&
                      (p.correction_bias == nullptr || all_groups_kept);
    const bool too_many_offers = isa.lanes < kLaneRows && all_groups_kept &&
                                 p.num_experts * p.topk > kLaneMaxOffersAllKept;
    if (fits && !too_many_offers) {
      plan.strategy = GroupedTopkStrategy::kLaneBlocks;
      plan.lane_block_rows = whole_blocks;
    }
  }

  // Six float rows of num_experts, the groups' scores and second largest values, the
  // candidate buffers, the key arrays, the kept groups' expert ranges, and for blocks of rows
  // in lanes a block of scores. The float arrays are whole multiples of 16 lanes, so each
  // starts a cache line after the buffer's start.
  auto padded = [](int64_t n) { return (n + 15) / 16 * 16; };
  plan.row_floats = padded(p.num_experts);
  plan.group_floats = padded(p.num_expert_group + kCandidateSlack);
  plan.candidate_slots = padded(kMaxCandidates + kCandidateSlack);
  plan.chosen_slots = padded(p.topk);
  plan.group_keys = p.topk_group;
  plan.expert_keys = p.topk;
  if (plan.lane_block_rows > 0) {
    plan.lane_floats = isa.lanes * plan.row_floats + 16;  // + alignment
  }
  const int64_t words = 6 * plan.row_floats + 2 * plan.group_floats +
                        4 * plan.candidate_slots + plan.chosen_slots + plan.lane_floats;
  plan.workspace_bytes = words * 4 +
                         (plan.group_keys + plan.expert_keys) * int64_t(sizeof(uint64_t)) +
                         plan.group_keys * int64_t(sizeof(ExpertRange));
  return plan;
}

// The workspace of the plan in buffer[0, plan.workspace_bytes), which starts on a cache line
// or at least a 16-byte boundary; score_pieces is left to the caller.
inline GroupedTopkWorkspace lay_out_grouped_topk_workspace(const GroupedTopkPlan& plan,
                                                           unsigned char* buffer) {
  float* f = reinterpret_cast<float*>(buffer);
  GroupedTopkWorkspace ws;
  ws.scores[0] = f;
  ws.scores[1] = f += plan.row_floats;
  ws.biased[0] = f += plan.row_floats;
  ws.biased[1] = f += plan.row_floats;
  ws.row = f += plan.row_floats;
  ws.bias = f += plan.row_floats;
  ws.group_scores = f += plan.row_floats;
  ws.group_seconds = f += plan.group_floats;
  ws.candidates = f += plan.group_floats;
  ws.candidate_ids = reinterpret_cast<int32_t*>(f += plan.candidate_slots);
  ws.chosen = ws.candidate_ids + plan.candidate_slots;
  ws.score_pieces = nullptr;
  ws.group_keys = reinterpret_cast<uint64_t*>(ws.chosen + plan.chosen_slots);
  ws.expert_keys = ws.group_keys + plan.group_keys;
  ws.ranges = reinterpret_cast<ExpertRange*>(ws.expert_keys + plan.expert_keys);
  // Last, so the arrays every strategy uses keep their places.
  ws.candidate_scores = reinterpret_cast<float*>(ws.ranges + plan.group_keys);
  ws.candidate_bias = ws.candidate_scores + plan.candidate_slots;
  // Its rows start on cache lines: they are read and written back a whole vector at a time.
  ws.lane_rows = nullptr;
  if (plan.lane_floats > 0) {
    const auto end = reinterpret_cast<uintptr_t>(ws.candidate_bias + plan.candidate_slots);
    ws.lane_rows = reinterpret_cast<float*>((end + 63) / 64 * 64);
  }
  return ws;
}

}  // namespace moeext::cpu
