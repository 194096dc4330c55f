// A model gate's routing by a whole block, one token at a time: the fused router's last block
// at one token (fused_router.cu, moeext::gpu_fused_router_variant 3), where the warp kernel
// would leave seven of its eight warps idle and route the token as one warp's chain of argmax
// rounds; and routing variant 5's kernel, a token a block (grouped_topk_variant5.cu). Here
// every thread scores E / 256 experts, and the top-k comes from ranks counted in parallel, not
// from rounds: each warp ranks its own experts and keeps its best topk as candidates; a
// candidate's place in the token's top-k is then the number of candidates that beat it
// (whatever beats a winner is itself among its warp's best topk, so is a candidate).
// The bits are the warp kernel's: the same scores, keys, group scores and tie rule, and the
// weights summed in winning order by the same shuffles.
// Included by fused_router.cu and grouped_topk_variant5.cu: the anonymous namespace keeps
// each one's instances internal to it.
#pragma once

#include <type_traits>

#include "gpu/grouped_topk_device.h"
#include "gpu/grouped_topk_warp.h"

namespace moeext::gpu::grouped_topk {
namespace {

constexpr int kGateBlockThreads = 256;

// Of kThreads threads (32-lane warps), each takes kPerThread consecutive experts of a gate of
// fixed_topology(kTopology); the warps that hold experts are full, and with groups each
// group's experts are a power-of-two run of lanes of one warp, reduced in registers.
template <int kTopology, int kThreads>
struct GateBlockShape {
  static constexpr int kWarpSize = 32;
  static constexpr FixedTopology kGate = fixed_topology(kTopology);
  static constexpr int kExperts = kGate.num_experts;
  static constexpr int kPerThread = (kExperts + kThreads - 1) / kThreads;
  static constexpr int kActiveThreads = kExperts / kPerThread;
  static constexpr int kActiveWarps = kActiveThreads / kWarpSize;
  static constexpr int kWarpExperts = kWarpSize * kPerThread;
  static constexpr int kGroups = kGate.num_expert_group;
  static constexpr int kGroupSize = kExperts / kGroups;
  static constexpr bool kSelectGroups = kGate.topk_group < kGroups;
  static constexpr int kLanesPerGroup = kSelectGroups ? kGroupSize / kPerThread : 1;
  static constexpr int kTopk = kGate.topk;
  // Each warp's best topk, in rank order (a slot past a warp's experts in play holds 0).
  static constexpr int kCandidates = kActiveWarps * kTopk;
  // kSplit consecutive threads count one candidate's rivals, kCandidates / kSplit each.
  static constexpr int kSplit = kCandidates * 4 <= kThreads && kCandidates % 4 == 0   ? 4
                                : kCandidates * 2 <= kThreads && kCandidates % 2 == 0 ? 2
                                                                                      : 1;

  static_assert(kTopology != 0, "a model gate's topology");
  static_assert(kGate.scoring_func != ScoringFunc::kSoftmax, "elementwise scores only");
  static_assert(kExperts % kPerThread == 0 && kActiveThreads % kWarpSize == 0,
                "the warps that hold experts are full");
  static_assert(kTopk <= kWarpSize && kTopk <= kWarpExperts, "a warp's candidates are lanes");
  static_assert(kCandidates <= kThreads, "a thread a candidate at least");
  static_assert(!kSelectGroups ||
                    (kGroupSize % kPerThread == 0 && (kLanesPerGroup & (kLanesPerGroup - 1)) == 0 &&
                     kLanesPerGroup <= kWarpSize),
                "a group is a power-of-two run of one warp's lanes");
};

// load_experts, but for fewer bytes than a 32-bit word (one bf16 or fp16 value a thread), which
// it reads in whole words only: element loads.
template <int kCount, typename T>
__device__ __forceinline__ void load_thread_experts(const T* row, int64_t stride, int first,
                                                    int num_experts, float (&out)[kCount]) {
  if constexpr (kCount * sizeof(T) % 4 == 0) {
    load_experts<kCount>(row, stride, first, num_experts, out);
  } else {
#pragma unroll
    for (int i = 0; i < kCount; ++i) out[i] = to_float(row[int64_t(first + i) * stride]);
  }
}

// The bias of this thread's experts (none without one), as route_tokens_per_block takes it.
// The fused router's blocks each read it before their share of the GEMM, so that the block
// that finishes last has it in registers and no load of it lies on the path after the count.
template <int kTopology, typename BiasT, int kThreads = kGateBlockThreads>
__device__ __forceinline__ void load_gate_bias(
    const KernelArgs& args, float (&bias)[GateBlockShape<kTopology, kThreads>::kPerThread]) {
  using Shape = GateBlockShape<kTopology, kThreads>;
  if constexpr (!std::is_same_v<BiasT, NoBias>) {
    const int tid = thread_index();
    if (tid < Shape::kActiveThreads) {
      load_thread_experts<Shape::kPerThread>(static_cast<const BiasT*>(args.p.correction_bias),
                                             args.p.bias_stride, tid * Shape::kPerThread,
                                             Shape::kExperts, bias);
    }
  } else {
    (void)args;
    (void)bias;
  }
}

// Routes tokens first_token, first_token + token_step, ... of args.p (a plain call of a gate
// of fixed_topology(kTopology), its logits LogitT) with the kThreads threads of the block,
// `bias` from load_gate_bias; every thread of the block calls it.
template <int kTopology, typename BiasT, int kThreads = kGateBlockThreads,
          typename LogitT = float>
__device__ __forceinline__ void route_tokens_per_block(
    const KernelArgs& args, const float (&bias)[GateBlockShape<kTopology, kThreads>::kPerThread],
    int64_t first_token = 0, int64_t token_step = 1) {
  using Shape = GateBlockShape<kTopology, kThreads>;
  constexpr int kWarpSize = Shape::kWarpSize;
  constexpr int V = Shape::kPerThread;
  constexpr int kTopk = Shape::kTopk;
  constexpr int kCandidates = Shape::kCandidates;
  constexpr int kSplit = Shape::kSplit;
  constexpr bool kHasBias = !std::is_same_v<BiasT, NoBias>;
  constexpr ScoringFunc kScoring = Shape::kGate.scoring_func;

  __shared__ uint64_t keys[Shape::kExperts];
  __shared__ uint32_t group_ordered[Shape::kGroups];
  __shared__ uint64_t candidates[kCandidates];
  __shared__ float candidate_score[kCandidates];
  __shared__ uint32_t winner_id[kTopk];
  __shared__ float winner_score[kTopk];

  const BiasedGroupedTopkParams& p = args.p;
  const int tid = thread_index();
  const int lane = tid % kWarpSize;
  const int warp = tid / kWarpSize;
  const int first = tid * V;  // this thread's experts: [first, first + V)
  const bool holds_experts = tid < Shape::kActiveThreads;  // whole warps

  for (int64_t token = first_token; token < p.num_tokens; token += token_step) {
    // s, and b's ordered bits (0: out of play), as route_tokens_per_warp computes them.
    float s[V];
    uint32_t value[V];
    Top2 top2 = top2_empty();
    if (holds_experts) {
      load_thread_experts<V>(
          static_cast<const LogitT*>(p.gating_output) + token * p.gating_row_stride,
          p.gating_col_stride, first, Shape::kExperts, s);
      elementwise_scores<kScoring>(s);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        float b = s[i];
        if constexpr (kHasBias) b += bias[i];
        b = fmaxf(b, neg_inf());  // -inf for NaN: no NaN and no -0 left
        value[i] = host_device::ordered_bits_nan_free(b);
        if constexpr (Shape::kSelectGroups) top2 = top2_push_nan_free(top2, b);
      }
    }

    // The groups: each group's score from its lanes' top-2, then its rank among all of them.
    if constexpr (Shape::kSelectGroups) {
      const int group = first / Shape::kGroupSize;
      if (holds_experts) {
        top2 = merge_top2_across_lanes(top2, Shape::kLanesPerGroup);
        if (lane % Shape::kLanesPerGroup == 0) {
          group_ordered[group] = ordered_bits(group_score(top2, kHasBias, Shape::kGroupSize));
        }
      }
      __syncthreads();
      if (holds_experts) {
        const uint64_t own_key = key_from_ordered(group_ordered[group], uint32_t(group));
        int rank = 0;
#pragma unroll
        for (int other = 0; other < Shape::kGroups; ++other) {
          rank += key_from_ordered(group_ordered[other], uint32_t(other)) > own_key ? 1 : 0;
        }
        if (rank >= Shape::kGate.topk_group) {
#pragma unroll
          for (int i = 0; i < V; ++i) value[i] = 0u;
        }
      }
    }

    // Each warp's best topk of its experts in play, by rank within the warp, to its slots.
    if (holds_experts) {
#pragma unroll
      for (int i = 0; i < V; ++i) keys[first + i] = key_from_ordered(value[i], uint32_t(first + i));
      if (lane < kTopk) candidates[warp * kTopk + lane] = 0;
      sync_warp();
      const uint64_t* warp_keys = keys + warp * Shape::kWarpExperts;
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const uint64_t own = key_from_ordered(value[i], uint32_t(first + i));
        int rank = 0;
#pragma unroll 8
        for (int j = 0; j < Shape::kWarpExperts; ++j) rank += warp_keys[j] > own ? 1 : 0;
        if (value[i] != 0 && rank < kTopk) {
          candidates[warp * kTopk + rank] = own;
          candidate_score[warp * kTopk + rank] = s[i];
        }
      }
    }
    __syncthreads();

    // Each candidate's place: how many candidates beat it, counted by kSplit threads.
    {
      constexpr int kChunk = kCandidates / kSplit;
      const int c = tid / kSplit;
      const bool counts = c < kCandidates;
      const uint64_t own = counts ? candidates[c] : 0;
      int beaten_by = 0;
      if (counts) {
        const uint64_t* chunk = candidates + (tid % kSplit) * kChunk;
#pragma unroll 8
        for (int j = 0; j < kChunk; ++j) beaten_by += chunk[j] > own ? 1 : 0;
      }
#pragma unroll
      for (int offset = 1; offset < kSplit; offset *= 2) beaten_by += shfl_xor(beaten_by, offset);
      if (counts && tid % kSplit == 0 && own != 0 && beaten_by < kTopk) {
        winner_id[beaten_by] = key_index(own);
        winner_score[beaten_by] = candidate_score[c];
      }
    }
    __syncthreads();

    // Lane j of warp 0 writes winner j; the weights are summed as the warp kernel sums them.
    if (warp == 0) {
      const uint32_t chosen_id = lane < kTopk ? winner_id[lane] : 0u;
      const float chosen_weight = lane < kTopk ? weight_of_score(winner_score[lane]) : 0.0f;
      const float sum = sum_of_first_lanes<kWarpSize>(chosen_weight, kTopk);
      if (lane < kTopk) {
        p.topk_ids[token * p.ids_row_stride + lane] = int32_t(chosen_id);
        p.topk_weights[token * p.weights_row_stride + lane] =
            finalize_weight(chosen_weight, sum, p.renormalize, p.routed_scaling_factor);
      }
    }
    // The next token's first shared writes (keys, group scores, slots) come after a barrier
    // every reader of this token's has passed; warp 0's reads of the winners are followed by
    // the next token's barriers before any thread writes them again.
  }
}

}  // namespace
}  // namespace moeext::gpu::grouped_topk
