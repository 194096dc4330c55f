// The warp kernel of biased grouped top-k routing: one token per warp, each lane holding
// kExpertsPerLane contiguous experts in registers (see grouped_topk.cu for when it runs).
// Included by the .cu files that route (grouped_topk.cu and its variant files,
// routing_weights.cu, fused_router.cu): the anonymous namespace keeps each one's instances
// internal to it.
#pragma once

#include <type_traits>

#include "gpu/grouped_topk_device.h"
#include "gpu/sort_lane.h"

namespace moeext::gpu::grouped_topk {
namespace {

// Orders shared-memory writes of the warp before its later reads (CUDA: __syncwarp; HIP's
// __syncwarp is recent, so its definition is spelled out).
__device__ __forceinline__ void sync_warp() {
#if defined(MOEEXT_HIP)
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront");
  __builtin_amdgcn_wave_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront");
#else
  __syncwarp();
#endif
}

// The largest of x[kBegin, kEnd), reduced as a tree: log2(kCount) dependent compares rather
// than kCount - 1, on the critical path of every argmax round. (Recursion, not a loop: a
// loop whose stride halves is not unrolled, and the array went to local memory.)
template <int kBegin, int kEnd, typename T, int kCount>
__device__ __forceinline__ T lane_max(const T (&x)[kCount]) {
  if constexpr (kEnd - kBegin == 1) {
    return x[kBegin];
  } else {
    const T a = lane_max<kBegin, (kBegin + kEnd) / 2>(x);
    const T b = lane_max<(kBegin + kEnd) / 2, kEnd>(x);
    return a > b ? a : b;
  }
}

// This lane's first expert whose value is target, or none. Lane l holds experts first,
// first + 1, ... in value[0, V), ascending with the lane.
template <int V>
__device__ __forceinline__ uint32_t first_holding(const uint32_t (&value)[V], int first,
                                                  uint32_t target, uint32_t none) {
  uint32_t expert = none;
#pragma unroll
  for (int i = V - 1; i >= 0; --i) expert = value[i] == target ? uint32_t(first + i) : expert;
  return expert;
}

// One argmax round's winner, in every lane: the expert with the largest value, the lowest
// such expert on a tie (the tie rule). 0 marks an expert out of play; at least one is in.
template <int kWarpSize, int V>
__device__ __forceinline__ uint32_t round_winner(const uint32_t (&value)[V], int first) {
#if defined(MOEEXT_HAS_WARP_REDUX)
  // The largest value, then the least of the lanes' first experts holding it (lanes holding
  // none offer 0xffffffff).
  const uint32_t best = warp_reduce_max(lane_max<0, V>(value));
  return warp_reduce_min(first_holding(value, first, best, 0xffffffffu));
#else
  // Each lane's largest value and the first expert holding it, as one key (key_from_ordered:
  // the larger key is the lower expert on a tie), and one butterfly over the keys: one
  // dependent round trip fewer than a value butterfly, then a ballot and a shuffle for its
  // holder, and faster (docs/notes/gpu-kernels.md).
  const uint32_t lane_best = lane_max<0, V>(value);
  const uint32_t lane_first = first_holding(value, first, lane_best, uint32_t(first));
  return key_index(butterfly_max<kWarpSize>(key_from_ordered(lane_best, lane_first)));
#endif
}

// Whether the warp kernel sorts each lane's experts once a token, so that an argmax round
// compares the lanes' first experts only (sorted_round_winner), and sums the weights over the
// topk lanes only: the current kernel (and variant 2) up to kMaxSortedExpertsPerLane experts a
// lane. Wider lanes, and variant 1 (the kernel before them, moeext::gpu_routing_variant), run
// round_winner and sum over every lane.
MOEEXT_HOST_DEVICE constexpr bool sorts_lanes(int variant, int experts_per_lane) {
  return variant != 1 && experts_per_lane <= kMaxSortedExpertsPerLane;
}

// One argmax round over sorted lanes: the largest first value, the lowest expert holding it
// (the lowest lane among those whose first value it is: lanes hold ascending experts, and a
// lane's equal values are in expert order), returned in every lane; that lane then drops its
// first value. The same winner as round_winner's. 0 marks an expert out of play.
template <int kWarpSize, int V>
__device__ __forceinline__ uint32_t sorted_round_winner(uint32_t (&value)[V],
                                                        SlotOrder<V>& order, int first,
                                                        int lane) {
  const uint32_t head = uint32_t(first) + first_slot(order);
#if defined(MOEEXT_HAS_WARP_REDUX)
  // Ballot, not a second reduction: which lane drops is known a few instructions after the
  // maximum, and the winner's expert (a shuffle) is off the path to the next round.
  const uint32_t best = warp_reduce_max(value[0]);
  const bool holds = value[0] == best;
  const LaneMask holders = ballot(holds);
  const bool drops = holds && (holders & ((LaneMask(1) << lane) - 1)) == 0;
  const uint32_t id = shfl(head, __ffs(holders) - 1);
#else
  (void)lane;
  const uint32_t id = key_index(butterfly_max<kWarpSize>(key_from_ordered(value[0], head)));
  const bool drops = head == id;
#endif
  drop_first_if(drops, value, order);
  return id;
}

// out[i] = ptr[i] widened, in loads of chunk_load_bytes(kCount, sizeof(T)) bytes.
template <int kCount, typename T>
__device__ __forceinline__ void load_chunk(const T* ptr, float (&out)[kCount]) {
  constexpr int kBytes = kCount * int(sizeof(T));
  static_assert(kBytes % 4 == 0, "whole 32-bit words");
  constexpr int kWords = kBytes / 4;
  constexpr int kWordsPerLoad = chunk_load_bytes(kCount, int(sizeof(T))) / 4;
  uint32_t words[kWords];
#pragma unroll
  for (int i = 0; i < kWords; i += kWordsPerLoad) {
    if constexpr (kWordsPerLoad == 4) {
      const uint4 v = reinterpret_cast<const uint4*>(ptr)[i / 4];
      words[i] = v.x;
      words[i + 1] = v.y;
      words[i + 2] = v.z;
      words[i + 3] = v.w;
    } else if constexpr (kWordsPerLoad == 2) {
      const uint2 v = reinterpret_cast<const uint2*>(ptr)[i / 2];
      words[i] = v.x;
      words[i + 1] = v.y;
    } else {
      words[i] = reinterpret_cast<const uint32_t*>(ptr)[i];
    }
  }
#pragma unroll
  for (int i = 0; i < kCount; ++i) {
    if constexpr (sizeof(T) == 4) {
      out[i] = bits_float(words[i]);
    } else {  // little-endian: the lower address is the low half
      out[i] = to_float(T{uint16_t(words[i / 2] >> (16 * (i % 2)))});
    }
  }
}

// Experts [first, first + kCount) of a row with `stride` between experts; those at or past
// num_experts read as 0 (they are never chosen). Whole in-range chunks of contiguous,
// aligned rows are read in vector loads.
template <int kCount, typename T>
__device__ __forceinline__ void load_experts(const T* row, int64_t stride, int first,
                                             int num_experts, float (&out)[kCount]) {
  constexpr int kAlign = chunk_load_bytes(kCount, int(sizeof(T)));
  if (stride == 1 && reinterpret_cast<uintptr_t>(row) % kAlign == 0 &&
      first + kCount <= num_experts) {
    load_chunk<kCount>(row + first, out);  // first * sizeof(T) is a multiple of kAlign
    return;
  }
#pragma unroll
  for (int i = 0; i < kCount; ++i) {
    const int e = first + i;
    out[i] = e < num_experts ? to_float(row[int64_t(e) * stride]) : 0.0f;
  }
}

// x (the logits of the lane's experts) -> s in place. Experts past the row are left out of
// the softmax reductions.
template <int kWarpSize, int kCount>
__device__ __forceinline__ void score_lane(ScoringFunc scoring_func, int first, int num_experts,
                                           float (&x)[kCount]) {
  switch (scoring_func) {
    case ScoringFunc::kSigmoid:
    case ScoringFunc::kSqrtSoftplus: {
#pragma unroll
      for (int i = 0; i < kCount; ++i) x[i] = elementwise_score(scoring_func, x[i]);
      break;
    }
    case ScoringFunc::kSoftmax: {
      float row_max = neg_inf();
      bool has_nan = false;
#pragma unroll
      for (int i = 0; i < kCount; ++i) {
        if (first + i < num_experts) {
          has_nan |= is_nan(x[i]);
          row_max = x[i] > row_max ? x[i] : row_max;
        }
      }
      row_max = butterfly_max<kWarpSize>(row_max);
      // A NaN anywhere makes the whole row NaN, as in the reference.
      if (ballot(has_nan) != 0) row_max = quiet_nan();
      float sum = 0.0f;
#pragma unroll
      for (int i = 0; i < kCount; ++i) {
        x[i] = first + i < num_experts ? expf(x[i] - row_max) : 0.0f;
        sum += x[i];
      }
      sum = warp_sum<kWarpSize>(sum);
#pragma unroll
      for (int i = 0; i < kCount; ++i) x[i] = x[i] / sum;
      break;
    }
  }
}

// The sum of lanes [0, topk)'s weights, added in lane order (the winning order, the CPU's
// summation order), in every lane: runs of 8 independent shuffles, none past topk.
template <int kWarpSize>
__device__ __forceinline__ float sum_of_first_lanes(float weight, int topk) {
  float sum = 0.0f;
  for (int run = 0; run < topk; run += 8) {
    float w[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) w[u] = shfl(weight, (run + u) % kWarpSize);
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      if (run + u < topk) sum += w[u];
    }
  }
  return sum;
}

// kVariant: 0 the current kernel, or one of the variants of moeext::gpu_routing_variant (the
// same bits by other instructions, kept beside it for A/B timing).
// kTopology: 0, or the id of the call's FixedTopology (grouped_topk_plan.h): the instance of a
// model gate, whose counts and scoring function are then constants.
template <int kWarpSize, int kExpertsPerLane, typename LogitT, typename BiasT, bool kOptions,
          int kVariant = 0, int kTopology = 0>
__device__ __forceinline__ void route_tokens_per_warp(const KernelArgs& args) {
  constexpr int V = kExpertsPerLane;
  constexpr bool kHasBias = !std::is_same_v<BiasT, NoBias>;
  constexpr bool kFixed = kTopology != 0;
  constexpr FixedTopology kShape = fixed_topology(kTopology);
  static_assert(!kFixed || kShape.num_experts == kWarpSize * V,
                "a fixed topology fills the warp's lanes exactly");
  const BiasedGroupedTopkParams& p = args.p;
  const int lane = thread_index() % kWarpSize;
  const int warp = thread_index() / kWarpSize;
  const int warps_per_block = args.warps_per_block;
  const int num_experts = kFixed ? kShape.num_experts : int(p.num_experts);
  const int num_groups = kFixed ? kShape.num_expert_group : int(p.num_expert_group);
  const int group_size = kFixed ? kShape.num_experts / kShape.num_expert_group : args.group_size;
  const int topk = kFixed ? kShape.topk : int(p.topk);
  const int topk_group = kFixed ? kShape.topk_group : int(p.topk_group);
  const ScoringFunc scoring_func = kFixed ? kShape.scoring_func : p.scoring_func;
  const int first = lane * V;  // this lane's experts: [first, first + V)
  const bool select_groups = topk_group < num_groups;
  const bool groups_in_registers = kFixed || args.group_scores_in_registers;
  // Variant 6: a lane's sigmoid scores as one chunk (sigmoid_scores: one range test for its V
  // reciprocals), and b's keys and group top 2 without NaN tests once fmaxf has made b
  // NaN-free (never -0 either: every score is at least +0).
  constexpr bool kChunkScores = kVariant == 6;
  // Variant 8: a gate's own instance (topk up to 8) finds the topk by merging the lanes' sorted
  // lists over a butterfly (merge_top_keys keeps the best kMergeWidth of two lanes' lists at
  // each step), in place of topk argmax rounds that each wait on the one before.
  constexpr int kMergeWidth = kFixed ? sort_network_width(kShape.topk) : 0;
  constexpr bool kMergeSelect =
      kVariant == 8 && kFixed && kMergeWidth <= 8 && V <= kMaxSortedExpertsPerLane;
  const int lanes_per_group = !kFixed ? args.lanes_per_group : select_groups ? group_size / V : 1;
  // This warp's row of b, when the groups are scored from shared memory.
  float* const shared_b = reinterpret_cast<float*>(shared_words()) + int64_t(warp) * num_experts;

  // The bias is the same for every token: read once, kept in registers.
  float bias[V];
  if constexpr (kHasBias) {
    load_experts<V>(static_cast<const BiasT*>(p.correction_bias), p.bias_stride, first,
                    num_experts, bias);
  }

  const int64_t counted_end = kOptions ? counted_rows(p.options, p.num_tokens) : 0;
  for (int64_t token = block_index() * warps_per_block + warp; token < p.num_tokens;
       token += args.token_step) {
    // Steps 1-2: s and the keys of b.
    float s[V];
    load_experts<V>(static_cast<const LogitT*>(p.gating_output) + token * p.gating_row_stride,
                    p.gating_col_stride, first, num_experts, s);
    if constexpr (kChunkScores && kFixed) {
      elementwise_scores<kShape.scoring_func>(s);
    } else if (kChunkScores && scoring_func == ScoringFunc::kSigmoid) {
      sigmoid_scores(s);  // experts past the row are scored too, and left out below
    } else {
      score_lane<kWarpSize, V>(scoring_func, first, num_experts, s);
    }

    // The rounds below compare b by ordered_bits; 0, below every real value (-inf's is
    // 0x007fffff), marks an expert out of play.
    uint32_t value[V];
    Top2 top2 = top2_empty();  // of this lane's b, which lies in one group
#pragma unroll
    for (int i = 0; i < V; ++i) {
      float b = s[i];
      if constexpr (kHasBias) b += bias[i];
      // Variant 6: -inf for NaN in one instruction, then no NaN test in the key or the top 2.
      if constexpr (kChunkScores) {
        b = fmaxf(b, neg_inf());
      } else {
        b = nan_to_neg_inf(b);
      }
      const bool valid = first + i < num_experts;
      if constexpr (kChunkScores) {
        value[i] = valid ? host_device::ordered_bits_nan_free(b) : 0u;
      } else {
        value[i] = valid ? ordered_bits(b) : 0u;
      }
      if (select_groups && valid) {
        if (groups_in_registers) {
          if constexpr (kChunkScores) {
            top2 = top2_push_nan_free(top2, b);
          } else {
            top2 = top2_push(top2, b);
          }
        } else {
          shared_b[first + i] = b;
        }
      }
    }

    // Steps 3-4: group g's top-2 gathered in lanes [g * lanes_per_group, ...), its score
    // ranked against every other group's, and the experts of groups not kept removed.
    if (select_groups) {
      const int group = lane / lanes_per_group;
      if (!groups_in_registers) {
        sync_warp();
        if (group < num_groups) {
          const int span = (group_size + lanes_per_group - 1) / lanes_per_group;
          const int begin = (lane % lanes_per_group) * span;
          const int end = begin + span < group_size ? begin + span : group_size;
          const float* group_b = shared_b + int64_t(group) * group_size;
          for (int k = begin; k < end; ++k) top2 = top2_push(top2, group_b[k]);
        }
        sync_warp();  // read before the next token's row overwrites it
      }
      top2 = merge_top2_across_lanes(top2, lanes_per_group);
      const uint32_t ordered = ordered_bits(group_score(top2, kHasBias, group_size));
      const uint64_t own_key = key_from_ordered(ordered, uint32_t(group));
      // rank = how many groups beat this one; all shuffles are independent.
      int rank = 0;
      for (int other = 0; other < num_groups; ++other) {
        const uint32_t other_ordered = shfl(ordered, other * lanes_per_group);
        rank += key_from_ordered(other_ordered, uint32_t(other)) > own_key ? 1 : 0;
      }
      const bool leader = lane % lanes_per_group == 0 && group < num_groups;
      // Bit g * lanes_per_group set for each kept group g.
      const LaneMask kept = ballot(leader && rank < topk_group);
      if (groups_in_registers) {
        // group * lanes_per_group <= lane: in range even for lanes past the last expert.
        if (((kept >> (group * lanes_per_group)) & 1) == 0) {
#pragma unroll
          for (int i = 0; i < V; ++i) value[i] = 0u;
        }
      } else {
        int expert_group = first / group_size;
        int in_group = first - expert_group * group_size;
#pragma unroll
        for (int i = 0; i < V; ++i) {
          if (first + i < num_experts &&
              ((kept >> (expert_group * lanes_per_group)) & 1) == 0) {
            value[i] = 0u;
          }
          if (++in_group == group_size) {
            in_group = 0;
            ++expert_group;
          }
        }
      }
    }

    // Steps 5-7: topk rounds of warp argmax, each clearing its winner. Lane j keeps the j-th
    // winner; the weights are gathered after the last round, keeping a shuffle off each
    // round's path.
    uint32_t chosen_id = 0;
    if constexpr (kMergeSelect) {
      const SlotOrder<V> order = sort_lane(value);
      // The lane's best kMergeWidth as keys (the larger key: the larger b, then the lower
      // expert); 0, below every key of an expert in play, past its V.
      uint64_t top[kMergeWidth];
#pragma unroll
      for (int i = 0; i < kMergeWidth; ++i) {
        top[i] = i < V ? key_from_ordered(value[i], uint32_t(first) +
                                                        uint32_t((order >> (4 * i)) & 15u))
                       : 0u;
      }
#pragma unroll
      for (int step = kWarpSize / 2; step > 0; step /= 2) {
        uint64_t theirs[kMergeWidth];
#pragma unroll
        for (int i = 0; i < kMergeWidth; ++i) theirs[i] = shfl_xor(top[i], step);
        merge_top_keys(top, theirs);
      }
      // Every lane now holds the warp's best, in winning order: lane j keeps the j-th.
#pragma unroll
      for (int j = 0; j < kShape.topk; ++j) chosen_id = lane == j ? key_index(top[j]) : chosen_id;
    } else if constexpr (sorts_lanes(kVariant, V)) {
      SlotOrder<V> order = sort_lane(value);
      for (int j = 0; j < topk; ++j) {
        const uint32_t id = sorted_round_winner<kWarpSize>(value, order, first, lane);
        chosen_id = lane == j ? id : chosen_id;
      }
    } else {
      for (int j = 0; j < topk; ++j) {
        const uint32_t id =
            round_winner<kWarpSize, V>(value, first);
#pragma unroll
        for (int i = 0; i < V; ++i) value[i] = uint32_t(first + i) == id ? 0u : value[i];
        chosen_id = lane == j ? id : chosen_id;
      }
    }
    // The owner of expert e holds s[e % V]; one independent shuffle per slot.
    float chosen_weight = 0.0f;
    const int owner = int(chosen_id) / V;
    const int slot = int(chosen_id) % V;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const float w = shfl(s[i], owner);
      chosen_weight = slot == i ? w : chosen_weight;
    }
    chosen_weight = weight_of_score(chosen_weight);
    // Every lane adds the weights in winning order, the CPU's summation order.
    float sum = 0.0f;
    if constexpr (sorts_lanes(kVariant, V)) {
      // Lanes [0, topk) only: the same additions in the same order, without the
      // kWarpSize - topk shuffles and selects past topk.
      sum = sum_of_first_lanes<kWarpSize>(chosen_weight, topk);
    } else {
      // All kWarpSize shuffles, unrolled and independent; a loop to topk waits on each.
#pragma unroll
      for (int j = 0; j < kWarpSize; ++j) {
        const float w = shfl(chosen_weight, j);
        if (j < topk) sum += w;
      }
    }
    if (lane < topk) {
      p.topk_ids[token * p.ids_row_stride + lane] =
          kOptions ? finish_routed(p.options, token, lane, chosen_id, token < counted_end)
                   : int32_t(chosen_id);
      p.topk_weights[token * p.weights_row_stride + lane] =
          finalize_weight(chosen_weight, sum, p.renormalize, p.routed_scaling_factor);
    }
    if constexpr (kOptions) write_shared_experts(p, token, lane, kWarpSize);
  }
}

// The CUDA architecture this pass compiles device code for (0 for the host and HIP).
#if !defined(MOEEXT_HIP) && defined(__CUDA_ARCH__)
constexpr int kCudaArch = __CUDA_ARCH__;
#else
constexpr int kCudaArch = 0;
#endif

// kOptions: the instance that applies the routing options; a plain call runs the other.
template <int kWarpSize, int kExpertsPerLane, typename LogitT, typename BiasT, bool kOptions,
          int kVariant = 0, int kTopology = 0>
__global__ void __launch_bounds__(
    kMaxThreadsPerBlock,
    sorts_lanes(kVariant, kExpertsPerLane)
        ? sorted_lanes_min_blocks(kWarpSize, kExpertsPerLane, kCudaArch)
        : warp_kernel_min_blocks(kWarpSize, kExpertsPerLane))
    grouped_topk_warp_kernel(const KernelArgs args) {
  if constexpr (kWarpSize == MOEEXT_DEVICE_WARP_SIZE) {
    wait_for_prior_grids();
    allow_dependent_grids();
    route_tokens_per_warp<kWarpSize, kExpertsPerLane, LogitT, BiasT, kOptions, kVariant,
                          kTopology>(args);
  } else {
    (void)args;  // not this target's warp width: never launched here
  }
}

}  // namespace
}  // namespace moeext::gpu::grouped_topk
