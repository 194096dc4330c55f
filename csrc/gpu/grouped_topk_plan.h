// The launch plan of the biased grouped top-k GPU kernels (grouped_topk.cu): which kernel and
// instance takes a topology, how the warp kernel lays out experts and groups over its lanes,
// and the shared memory of each kernel. The routing logic itself is host_device/routing.h.
// The kernels and the host unit test tests/cpp/test_grouped_topk_plan.cpp compile these very
// functions, so no GPU runtime header may come in here.
#pragma once

#include <cstdint>
#include <type_traits>

#include "moeext/common.h"
#include "moeext/grouped_topk.h"

namespace moeext::gpu::grouped_topk {

// Widest load (16, 8 or 4 bytes) that reads a lane's chunk of `count` elements of
// `element_size` bytes in whole loads: chunk starts are multiples of the chunk size, so an
// aligned row keeps every chunk aligned to it. The chunk must be whole 32-bit words.
MOEEXT_HOST_DEVICE constexpr int chunk_load_bytes(int count, int element_size) {
  return (count * element_size) % 16 == 0 ? 16 : ((count * element_size) % 8 == 0 ? 8 : 4);
}

MOEEXT_HOST_DEVICE inline bool is_pow2(int64_t x) { return x > 0 && (x & (x - 1)) == 0; }

MOEEXT_HOST_DEVICE inline int64_t pow2_floor(int64_t x) {
  int64_t p = 1;
  while (p * 2 <= x) p *= 2;
  return p;
}

// ---------------------------------------------------------------------------------------
// Launch plan.
//
// Fast path: one token per warp. Lane l owns the contiguous experts
// [l * experts_per_lane, (l + 1) * experts_per_lane), held in registers. experts_per_lane is a
// template argument of the kernel, a multiple of 4 up to 32 (up to 16 on 64-wide warps); the
// warp covers warp_size * experts_per_lane <= kFastMaxExperts experts.
//
// Group scores (needed only when topk_group < num_expert_group) sit in lanes_per_group
// consecutive lanes per group, group g's in lanes [g * lanes_per_group, ...), and are
// reduced there by a butterfly over those lanes. Either each lane's experts lie in one group
// and the group spans a power-of-two number of lanes (group_scores_in_registers: the lanes
// reduce what they hold), or the warp writes b to shared memory and lanes_per_group =
// pow2_floor(warp_size / num_expert_group) lanes read each group back.
//
// General path: one block of kGeneralThreads per token, b and the group scores in shared
// memory, block-wide argmax. Covers every topology up to kMaxExperts experts.
// ---------------------------------------------------------------------------------------

constexpr int64_t kFastMaxExperts = 1024;
constexpr int64_t kFastMaxTopk = 32;
constexpr int64_t kFastMaxGroups = 32;
// The experts_per_lane instances: multiples of 4, so that a lane's fp32 chunk is whole
// 16-byte loads (and a 16-bit chunk whole 8-byte ones).
constexpr int kFastExpertsPerLaneStep = 4;
constexpr int kFastMaxExpertsPerLane = 32;
// Lanes wider than a topology needs are taken for the group scores' sake only while the warp
// spans at most this many experts: the widths the plan chose from before the wider instances
// came (wider ones over narrower lanes are not yet timed).
constexpr int64_t kWidenedMaxExperts = 512;

// Whether the fast kernel for this warp width and experts_per_lane is instantiated.
MOEEXT_HOST_DEVICE constexpr bool fast_instance_exists(int warp_size, int experts_per_lane) {
  return experts_per_lane >= kFastExpertsPerLaneStep &&
         experts_per_lane <= kFastMaxExpertsPerLane &&
         experts_per_lane % kFastExpertsPerLaneStep == 0 &&
         int64_t(warp_size) * experts_per_lane <= kFastMaxExperts;
}

// What `pick(std::integral_constant<int, V>{})` returns for the instance V == experts_per_lane
// (host code: a kernel to launch), or `none` where no instance of this width has it.
template <int kWarpSize, typename R, typename Pick, int V = kFastExpertsPerLaneStep>
R pick_experts_per_lane(int experts_per_lane, R none, const Pick& pick) {
  if constexpr (!fast_instance_exists(kWarpSize, V)) {
    (void)experts_per_lane;
    (void)pick;
    return none;
  } else {
    if (experts_per_lane == V) return pick(std::integral_constant<int, V>{});
    return pick_experts_per_lane<kWarpSize, R, Pick, V + kFastExpertsPerLaneStep>(
        experts_per_lane, none, pick);
  }
}

struct FastPathPlan {
  int experts_per_lane;  // 0: the topology takes the general path
  int lanes_per_group;
  bool group_scores_in_registers;
};

MOEEXT_HOST_DEVICE inline FastPathPlan plan_fast_path(int warp_size, int64_t num_experts,
                                                      int64_t num_expert_group,
                                                      int64_t topk_group, int64_t topk) {
  FastPathPlan plan{0, 1, true};
  if ((warp_size != 32 && warp_size != 64) || num_experts < 1 ||
      num_experts > kFastMaxExperts || topk > kFastMaxTopk || topk > warp_size ||
      num_expert_group > kFastMaxGroups || num_expert_group < 1 ||
      num_experts % num_expert_group != 0) {
    return plan;
  }
  const bool select_groups = topk_group < num_expert_group;
  const int64_t group_size = num_experts / num_expert_group;
  int smallest = 0;
  for (int v = kFastExpertsPerLaneStep; v <= kFastMaxExpertsPerLane; v += kFastExpertsPerLaneStep) {
    if (!fast_instance_exists(warp_size, v) || int64_t(warp_size) * v < num_experts) continue;
    if (smallest == 0) smallest = v;
    // The smallest width whose lanes each hold one group's experts, a power-of-two number
    // of lanes per group, keeps the group scores in registers; wider than the smallest only
    // within kWidenedMaxExperts, as wider lanes lengthen every argmax round.
    if (!select_groups || (v > smallest && int64_t(warp_size) * v > kWidenedMaxExperts)) break;
    if (group_size % v == 0 && is_pow2(group_size / v)) {
      plan.experts_per_lane = v;
      plan.lanes_per_group = int(group_size / v);
      return plan;
    }
  }
  plan.experts_per_lane = smallest;
  if (select_groups) {
    plan.lanes_per_group = int(pow2_floor(warp_size / num_expert_group));
    plan.group_scores_in_registers = false;
  }
  return plan;
}

// A model gate's topology and scoring function, for which the warp kernel has an instance of
// its own with every count a constant (plain calls on 32-lane warps; fixed_topology_of). Each
// fills the warp exactly (num_experts a multiple of 32) and, with groups, keeps the group
// scores in registers at num_experts / 32 experts a lane (tests/cpp/test_grouped_topk_plan.cpp).
struct FixedTopology {
  int num_experts;
  int num_expert_group;
  int topk_group;
  int topk;
  ScoringFunc scoring_func;
};
// Ids 1 (DeepSeek-V3/R1) and 2 (Kimi-K2): the current kernel's. Ids 3 (DeepSeek-V4-Flash), 4
// (DeepSeek-V4-Pro) and 5 (a Nemotron-style 512 experts, top 22): routing variant 2's until a
// GPU has timed them. Id 0 is none: the call's own topology.
constexpr int kCurrentFixedTopologies = 3;
constexpr int kFixedTopologies = 6;
MOEEXT_HOST_DEVICE constexpr FixedTopology fixed_topology(int id) {
  return id == 1   ? FixedTopology{256, 8, 4, 8, ScoringFunc::kSigmoid}
         : id == 2 ? FixedTopology{384, 1, 1, 8, ScoringFunc::kSigmoid}
         : id == 3 ? FixedTopology{256, 1, 1, 6, ScoringFunc::kSqrtSoftplus}
         : id == 4 ? FixedTopology{384, 1, 1, 6, ScoringFunc::kSqrtSoftplus}
         : id == 5 ? FixedTopology{512, 1, 1, 22, ScoringFunc::kSigmoid}
                   : FixedTopology{0, 1, 0, 0, ScoringFunc::kSigmoid};
}

// The id below id_end of the call's FixedTopology on a warp of `warp_size` lanes, or 0.
inline int fixed_topology_of(int warp_size, int64_t num_experts, int64_t num_expert_group,
                             int64_t topk_group, int64_t topk, ScoringFunc scoring_func,
                             int id_end = kCurrentFixedTopologies) {
  if (warp_size != 32) return 0;
  for (int id = 1; id < id_end; ++id) {
    const FixedTopology t = fixed_topology(id);
    if (num_experts == t.num_experts && num_expert_group == t.num_expert_group &&
        topk_group == t.topk_group && topk == t.topk && scoring_func == t.scoring_func) {
      return id;
    }
  }
  return 0;
}

// The id below id_end of the FixedTopology of the call `p` on warps of `warp_size` lanes, or 0.
inline int fixed_topology_for(const BiasedGroupedTopkParams& p, int warp_size,
                              int id_end = kCurrentFixedTopologies) {
  return fixed_topology_of(warp_size, p.num_experts, p.num_expert_group, p.topk_group, p.topk,
                           p.scoring_func, id_end);
}

// Dynamic shared memory of the fast kernel: b of each warp's token, for group scoring.
MOEEXT_HOST_DEVICE inline int64_t fast_smem_bytes(const FastPathPlan& plan, int64_t num_experts,
                                                  int64_t warps_per_block) {
  return plan.group_scores_in_registers ? 0 : warps_per_block * num_experts * int64_t(sizeof(float));
}

constexpr int kGeneralThreads = 256;
constexpr int64_t kMaxExperts = 4096;
// Each thread of the general path owns items i = thread + m * kGeneralThreads and keeps the
// ones already taken as bits of a 32-bit mask.
static_assert((kMaxExperts + kGeneralThreads - 1) / kGeneralThreads <= 32,
              "general path: items per thread must fit a 32-bit mask");

// Dynamic shared memory of the general kernel, in 32-bit words from a 16-byte aligned base:
//   [0, E)               b of the token (the logits, then exp, while softmax is reduced)
//   [E, E + G)           the group scores as ordered_bits, then the kept flags (1 or 0)
//   then, 8-byte aligned, 2 x warps keys (the argmax slots, double buffered), and
//   3 x warps words for the block reductions (row maximum, NaN flag, sum).
struct GeneralSmemLayout {
  int64_t group_offset;
  int64_t slots_offset;
  int64_t reduce_offset;
  int64_t total_words;
};

MOEEXT_HOST_DEVICE inline GeneralSmemLayout general_smem_layout(int64_t num_experts,
                                                                int64_t num_expert_group,
                                                                int warps) {
  GeneralSmemLayout layout;
  layout.group_offset = num_experts;
  const int64_t after_groups = num_experts + num_expert_group;
  layout.slots_offset = (after_groups + 1) / 2 * 2;
  layout.reduce_offset = layout.slots_offset + 2 * 2 * int64_t(warps);
  layout.total_words = layout.reduce_offset + 3 * int64_t(warps);
  return layout;
}

}  // namespace moeext::gpu::grouped_topk
