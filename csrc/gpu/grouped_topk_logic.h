// The pure logic of the biased grouped top-k GPU kernels (SPEC.md section 1): key packing,
// group scores, the final weights and the launch plan. The kernels in grouped_topk.cu and the
// host unit test tests/cpp/test_grouped_topk_logic.cpp compile these very functions, so no
// GPU runtime header may come in here.
//
// Conventions, the same as the CPU kernel's (csrc/cpu/grouped_topk.cpp):
//   * b is the biased score with NaN replaced by -inf before anything compares it.
//   * A key packs a value and an index so that "larger value, then lower index" is one
//     unsigned compare: the value as an order-preserving unsigned int (-0 folded onto +0,
//     NaN counted as -inf) in the high word, the inverted index in the low word.
//   * Key 0 is below the key of every real value (-inf included), so a kernel removes a
//     winner, or leaves out an expert, by setting its key to 0.
#pragma once

#include <cstdint>

#include "gpu/numeric.h"
#include "moeext/common.h"

namespace moeext::gpu::grouped_topk {

constexpr uint32_t kNegInfBits = 0xff800000u;
constexpr uint64_t kRemovedKey = 0;

MOEEXT_HOST_DEVICE inline float neg_inf() { return bits_float(kNegInfBits); }

// By its bits, so that no compiler flag can turn the test into "never NaN".
MOEEXT_HOST_DEVICE inline bool is_nan(float x) { return (float_bits(x) & 0x7fffffffu) > 0x7f800000u; }

MOEEXT_HOST_DEVICE inline float nan_to_neg_inf(float x) { return is_nan(x) ? neg_inf() : x; }

// ordered(a) > ordered(b) exactly when a > b as floats, with -0 == +0 and NaN as -inf.
MOEEXT_HOST_DEVICE inline uint32_t ordered_bits(float value) {
  // + 0.0f turns -0 into +0 under round-to-nearest and leaves every other value alone.
  const uint32_t bits = float_bits(nan_to_neg_inf(value) + 0.0f);
  return bits ^ ((bits >> 31) ? 0xffffffffu : 0x80000000u);
}

// Inverse of ordered_bits for the values it produces (never -0, never NaN).
MOEEXT_HOST_DEVICE inline float ordered_value(uint32_t ordered) {
  return bits_float((ordered >> 31) ? (ordered ^ 0x80000000u) : ~ordered);
}

MOEEXT_HOST_DEVICE inline uint64_t key_from_ordered(uint32_t ordered, uint32_t index) {
  return (uint64_t(ordered) << 32) | uint32_t(~index);
}

MOEEXT_HOST_DEVICE inline uint64_t make_key(float value, uint32_t index) {
  return key_from_ordered(ordered_bits(value), index);
}

MOEEXT_HOST_DEVICE inline uint32_t key_index(uint64_t key) { return ~uint32_t(key); }

MOEEXT_HOST_DEVICE inline float key_value(uint64_t key) { return ordered_value(uint32_t(key >> 32)); }

// The two largest of a set of NaN-free values, a repeated maximum counted twice (as
// topk(2) counts it). Empty: both -inf.
struct Top2 {
  float first;
  float second;
};

MOEEXT_HOST_DEVICE inline Top2 top2_empty() { return Top2{neg_inf(), neg_inf()}; }

MOEEXT_HOST_DEVICE inline Top2 top2_push(Top2 t, float x) {
  const float low = x < t.first ? x : t.first;
  return Top2{x > t.first ? x : t.first, low > t.second ? low : t.second};
}

// The top-2 of the union of two sets: the larger first, and the larger of the smaller first
// and the two seconds.
MOEEXT_HOST_DEVICE inline Top2 top2_merge(Top2 a, Top2 b) {
  const float high = a.first > b.first ? a.first : b.first;
  const float low = a.first > b.first ? b.first : a.first;
  const float seconds = a.second > b.second ? a.second : b.second;
  return Top2{high, low > seconds ? low : seconds};
}

// SPEC step 3: with a bias the sum of the top two (a group of one expert scores that
// expert), without a bias the maximum. +inf + -inf is NaN: it ranks as -inf, like NaN in b.
MOEEXT_HOST_DEVICE inline float group_score(Top2 t, bool has_bias, int64_t group_size) {
  if (!has_bias || group_size == 1) return t.first;
  return nan_to_neg_inf(t.first + t.second);
}

// SPEC step 6: the weight of a chosen expert is its unbiased score, 0 where that is NaN.
MOEEXT_HOST_DEVICE inline float weight_of_score(float s) { return is_nan(s) ? 0.0f : s; }

// SPEC step 7, written as the CPU kernel writes it so that the two agree bit for bit:
// `sum` is the fp32 sum of the topk weights added in order j = 0, 1, ..., topk - 1.
MOEEXT_HOST_DEVICE inline float finalize_weight(float w, float sum, bool renormalize,
                                                float routed_scaling_factor) {
  if (renormalize) return w / (sum + 1e-20f) * routed_scaling_factor;
  return w * routed_scaling_factor;
}

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
// template argument of the kernel, one of 4, 8, 12, 16; the warp covers
// warp_size * experts_per_lane <= kFastMaxExperts experts.
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

constexpr int64_t kFastMaxExperts = 512;
constexpr int64_t kFastMaxTopk = 32;
constexpr int64_t kFastMaxGroups = 32;
// The experts_per_lane instances: multiples of 4, so that a lane's fp32 chunk is whole
// 16-byte loads (and a 16-bit chunk whole 8-byte ones).
constexpr int kFastExpertsPerLaneStep = 4;
constexpr int kFastMaxExpertsPerLane = 16;

// Whether the fast kernel for this warp width and experts_per_lane is instantiated.
MOEEXT_HOST_DEVICE constexpr bool fast_instance_exists(int warp_size, int experts_per_lane) {
  return int64_t(warp_size) * experts_per_lane <= kFastMaxExperts;
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
    // of lanes per group, keeps the group scores in registers.
    if (!select_groups) break;
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
