// The block kernel of biased grouped top-k routing: one token per block of kGeneralThreads,
// b and the group scores in shared memory, block-wide argmax (see grouped_topk.cu for when it
// runs).
// Included by the routing .cu files (grouped_topk.cu, routing_weights.cu): the anonymous
// namespace keeps each one's instances internal to it.
#pragma once

#include <type_traits>

#include "gpu/grouped_topk_device.h"

namespace moeext::gpu::grouped_topk {
namespace {

template <int kWarpSize>
__device__ __forceinline__ uint64_t warp_max_key(uint64_t key) {
#if defined(MOEEXT_HAS_WARP_REDUX)
  // The value word, then the index word among the lanes that hold that value: two
  // instructions in place of ten shuffles.
  const uint32_t high = warp_reduce_max(uint32_t(key >> 32));
  const uint32_t low = warp_reduce_max(uint32_t(key >> 32) == high ? uint32_t(key) : 0u);
  return (uint64_t(high) << 32) | low;
#else
  return butterfly_max<kWarpSize>(key);
#endif
}

template <typename BiasT>
__device__ __forceinline__ float add_bias(float s, const void* bias, int64_t bias_stride,
                                          int expert) {
  if constexpr (std::is_same_v<BiasT, NoBias>) {
    (void)bias;
    (void)bias_stride;
    (void)expert;
    return s;
  } else {
    return s + to_float(static_cast<const BiasT*>(bias)[int64_t(expert) * bias_stride]);
  }
}

// Thread t owns items t, t + kGeneralThreads, ...; item m of a thread is bit m of its masks.
// Selects the k largest keys (key_of(item), all nonzero) of items [0, n) not in `skip`, in
// descending order: round j calls on_win(j, item) in the owner's thread. Returns the owner's
// mask of the items taken. `slots` holds 2 x warps keys.
template <int kWarpSize, typename KeyOf, typename OnWin>
__device__ __forceinline__ uint32_t block_select(int n, int k, uint32_t skip, uint64_t* slots,
                                                 KeyOf key_of, OnWin on_win) {
  constexpr int kWarps = kGeneralThreads / kWarpSize;
  const int tid = thread_index();
  const int lane = tid % kWarpSize;
  const int warp = tid / kWarpSize;
  uint32_t taken = 0;
  auto own_best = [&]() {
    uint64_t best = kRemovedKey;
    for (int m = 0, item = tid; item < n; ++m, item += kGeneralThreads) {
      if ((((taken | skip) >> m) & 1) == 0) {
        const uint64_t key = key_of(item);
        best = key > best ? key : best;
      }
    }
    return best;
  };
  uint64_t mine = own_best();
  for (int j = 0; j < k; ++j) {
    // Double buffered: a thread writing round j's slots has passed round j - 1's barrier,
    // which every reader of round j - 2's slots had reached after reading them.
    uint64_t* round_slots = slots + (j & 1) * kWarps;
    const uint64_t warp_best = warp_max_key<kWarpSize>(mine);
    if (lane == 0) round_slots[warp] = warp_best;
    __syncthreads();
    uint64_t best = kRemovedKey;
    for (int w = 0; w < kWarps; ++w) best = round_slots[w] > best ? round_slots[w] : best;
    const uint32_t item = key_index(best);
    if (best != kRemovedKey && int(item % kGeneralThreads) == tid) {
      taken |= 1u << (item / kGeneralThreads);
      on_win(j, int(item));
      mine = own_best();
    }
  }
  return taken;
}

template <int kWarpSize>
__device__ __forceinline__ float block_max(float x, float* partial) {
  constexpr int kWarps = kGeneralThreads / kWarpSize;
  x = butterfly_max<kWarpSize>(x);
  if (thread_index() % kWarpSize == 0) partial[thread_index() / kWarpSize] = x;
  __syncthreads();
  float result = partial[0];
  for (int w = 1; w < kWarps; ++w) result = partial[w] > result ? partial[w] : result;
  return result;
}

// Every thread gets the same bits: the warps' sums added in warp order.
template <int kWarpSize>
__device__ __forceinline__ float block_sum(float x, float* partial) {
  constexpr int kWarps = kGeneralThreads / kWarpSize;
  x = warp_sum<kWarpSize>(x);
  if (thread_index() % kWarpSize == 0) partial[thread_index() / kWarpSize] = x;
  __syncthreads();
  float result = partial[0];
  for (int w = 1; w < kWarps; ++w) result += partial[w];
  return result;
}

template <int kWarpSize, typename LogitT, typename BiasT, bool kOptions>
__device__ __forceinline__ void route_tokens_per_block(const KernelArgs& args) {
  constexpr int kWarps = kGeneralThreads / kWarpSize;
  constexpr int kThreads = kGeneralThreads;
  constexpr bool kHasBias = !std::is_same_v<BiasT, NoBias>;
  const BiasedGroupedTopkParams& p = args.p;
  const int tid = thread_index();
  const int lane = tid % kWarpSize;
  const int warp = tid / kWarpSize;
  const int num_experts = int(p.num_experts);
  const int num_groups = int(p.num_expert_group);
  const int group_size = args.group_size;
  const bool select_groups = p.topk_group < p.num_expert_group;
  const bool softmax = p.scoring_func == ScoringFunc::kSoftmax;

  const GeneralSmemLayout layout = general_smem_layout(num_experts, num_groups, kWarps);
  uint32_t* const words = shared_words();
  float* const b = reinterpret_cast<float*>(words);
  uint32_t* const groups = words + layout.group_offset;
  uint64_t* const slots = reinterpret_cast<uint64_t*>(words + layout.slots_offset);
  float* const partial = reinterpret_cast<float*>(words + layout.reduce_offset);

  const int64_t counted_end = kOptions ? counted_rows(p.options, p.num_tokens) : 0;
  for (int64_t token = block_index(); token < p.num_tokens; token += args.token_step) {
    const LogitT* row = static_cast<const LogitT*>(p.gating_output) + token * p.gating_row_stride;
    auto logit = [&](int e) { return to_float(row[int64_t(e) * p.gating_col_stride]); };

    // Steps 1-2: b of every expert into shared memory, each by the thread that later ranks
    // it (so only the reductions need barriers).
    float row_max = 0.0f;
    float row_sum = 1.0f;
    if (softmax) {
      float local_max = neg_inf();
      bool has_nan = false;
      for (int e = tid; e < num_experts; e += kThreads) {
        const float x = logit(e);
        b[e] = x;
        has_nan |= is_nan(x);
        local_max = x > local_max ? x : local_max;
      }
      // A NaN anywhere makes the whole row NaN, as in the reference.
      const float nan_flag = block_max<kWarpSize>(has_nan ? 1.0f : 0.0f, partial + kWarps);
      row_max = block_max<kWarpSize>(local_max, partial);
      if (nan_flag != 0.0f) row_max = quiet_nan();
      float local_sum = 0.0f;
      for (int e = tid; e < num_experts; e += kThreads) {
        const float ex = expf(b[e] - row_max);
        b[e] = ex;
        local_sum += ex;
      }
      row_sum = block_sum<kWarpSize>(local_sum, partial + 2 * kWarps);
      for (int e = tid; e < num_experts; e += kThreads) {
        b[e] = nan_to_neg_inf(add_bias<BiasT>(b[e] / row_sum, p.correction_bias, p.bias_stride, e));
      }
    } else {
      for (int e = tid; e < num_experts; e += kThreads) {
        const float s = elementwise_score(p.scoring_func, logit(e));
        b[e] = nan_to_neg_inf(add_bias<BiasT>(s, p.correction_bias, p.bias_stride, e));
      }
    }
    __syncthreads();

    // Steps 3-4: group scores, then the kept groups, whose flags replace the scores.
    if (select_groups) {
      if (group_size <= 16) {
        for (int g = tid; g < num_groups; g += kThreads) {
          Top2 t = top2_empty();
          for (int k = 0; k < group_size; ++k) t = top2_push(t, b[g * group_size + k]);
          groups[g] = ordered_bits(group_score(t, kHasBias, group_size));
        }
      } else {  // a warp per group
        for (int g = warp; g < num_groups; g += kWarps) {
          Top2 t = top2_empty();
          for (int k = lane; k < group_size; k += kWarpSize) t = top2_push(t, b[g * group_size + k]);
          t = merge_top2_across_lanes(t, kWarpSize);
          if (lane == 0) groups[g] = ordered_bits(group_score(t, kHasBias, group_size));
        }
      }
      __syncthreads();
      const uint32_t kept = block_select<kWarpSize>(
          num_groups, int(p.topk_group), 0u, slots,
          [&](int g) { return key_from_ordered(groups[g], uint32_t(g)); }, [](int, int) {});
      // Only the owner reads a group's score while selecting, so the owner may overwrite it.
      for (int m = 0, g = tid; g < num_groups; ++m, g += kThreads) groups[g] = (kept >> m) & 1;
      __syncthreads();
    }

    // Steps 5-7. The owner of each winner writes its id and weight; s is recomputed from the
    // logit (the same operations as above, so the same bits) rather than kept.
    uint32_t skip = 0;
    if (select_groups) {
      for (int m = 0, e = tid; e < num_experts; ++m, e += kThreads) {
        if (groups[e / group_size] == 0) skip |= 1u << m;
      }
    }
    float* const weights = p.topk_weights + token * p.weights_row_stride;
    int32_t* const ids = p.topk_ids + token * p.ids_row_stride;
    const int topk = int(p.topk);
    block_select<kWarpSize>(
        num_experts, topk, skip, slots,
        [&](int e) { return make_key(b[e], uint32_t(e)); },
        [&](int j, int e) {
          const float x = logit(e);
          const float s = softmax ? expf(x - row_max) / row_sum
                                  : elementwise_score(p.scoring_func, x);
          const float w = weight_of_score(s);
          ids[j] = e;
          weights[j] = p.renormalize ? w : finalize_weight(w, 0.0f, false, p.routed_scaling_factor);
        });
    if (p.renormalize) {
      __syncthreads();  // every winner's weight is written
      float sum = 0.0f;
      for (int j = 0; j < topk; ++j) sum += weights[j];
      __syncthreads();  // and read by every thread before any is rewritten
      for (int j = tid; j < topk; j += kThreads) {
        weights[j] = finalize_weight(weights[j], sum, true, p.routed_scaling_factor);
      }
    }
    if constexpr (kOptions) {
      __syncthreads();  // every winner's id is written
      const bool counted = token < counted_end;
      for (int j = tid; j < topk; j += kThreads) {
        ids[j] = finish_routed(p.options, token, j, uint32_t(ids[j]), counted);
      }
      write_shared_experts(p, token, tid, kThreads);
    }
  }
}

// kOptions: the instance that applies the routing options; a plain call runs the other.
template <int kWarpSize, typename LogitT, typename BiasT, bool kOptions>
__global__ void __launch_bounds__(kGeneralThreads, kMinBlocksPerMultiprocessor)
    grouped_topk_block_kernel(const KernelArgs args) {
  if constexpr (kWarpSize == MOEEXT_DEVICE_WARP_SIZE) {
    wait_for_prior_grids();
    allow_dependent_grids();
    route_tokens_per_block<kWarpSize, LogitT, BiasT, kOptions>(args);
  } else {
    (void)args;  // not this target's warp width: never launched here
  }
}

}  // namespace
}  // namespace moeext::gpu::grouped_topk
