// Biased grouped top-k routing one thread a token, for a model gate with an instance of its own
// (FixedTopology, grouped_topk_plan.h): routing variant 4 (moeext::gpu_routing_variant), kept
// beside the warp kernel for a GPU to time at prefill sizes.
//
// The warp kernel spreads a token's experts over 32 lanes, and most of its instructions are
// the lanes agreeing: the group scores' butterfly, the ranks, and a warp reduction a round.
// Here a thread holds its token alone, so nothing is exchanged: it scores every expert once
// for the group scores, keeping each b in shared memory, ranks the groups, then offers the kept
// groups' b that can win to a sorted list of topk registers: fewer instructions a token than
// the warp kernel's (docs/notes/gpu-kernels.md has the counts). A decode batch has too few
// tokens to fill the GPU this way: the variant is for the A/B at large T.
//
// The same bits as the warp kernel: the same score, bias, NaN and key functions
// (host_device/routing.h), the groups ranked by the same keys, the experts offered in
// ascending order to a list that puts an expert after those of its value already in it (the
// lower expert first on a tie), and the weights added in winning order.
#pragma once

#include <type_traits>

#include "gpu/grouped_topk_variants.h"
#include "gpu/grouped_topk_warp.h"

namespace moeext::gpu::grouped_topk {
namespace {

// A warp a block: the b of every expert of its 32 tokens (32 KiB for DeepSeek-V3) then fit the
// 48 KiB of static shared memory a block may have.
constexpr int kThreadKernelThreads = 32;

// The K largest values offered so far, largest first, with their experts. Empty slots hold 0,
// below every real value's ordered bits (-inf's are 0x007fffff).
template <int K>
struct TopList {
  uint32_t value[K];
  uint32_t id[K];
};

template <int K>
__device__ __forceinline__ void top_list_clear(TopList<K>& top) {
#pragma unroll
  for (int i = 0; i < K; ++i) {
    top.value[i] = 0u;
    top.id[i] = 0u;
  }
}

// Inserts (value, id) where it belongs, after every entry of a value at least as large; the
// last entry falls out. Branch-free: each slot takes its own entry, the one before it, or the
// new one.
template <int K>
__device__ __forceinline__ void top_list_offer(TopList<K>& top, uint32_t value, uint32_t id) {
#pragma unroll
  for (int i = K - 1; i > 0; --i) {
    const bool above_previous = value > top.value[i - 1];
    const bool above = value > top.value[i];
    top.value[i] = above_previous ? top.value[i - 1] : (above ? value : top.value[i]);
    top.id[i] = above_previous ? top.id[i - 1] : (above ? id : top.id[i]);
  }
  const bool first = value > top.value[0];
  top.value[0] = first ? value : top.value[0];
  top.id[0] = first ? id : top.id[0];
}

// Two sorted lists of K (TopList), merged: the K best of both, in order. Both hold distinct
// experts, each list's equal values in ascending expert order, so the keys (value, then the
// lower expert) order them all, and merge_top_keys keeps the K largest.
template <int K>
__device__ __forceinline__ void top_list_merge(TopList<K>& top, const TopList<K>& other) {
  uint64_t merged[K];
  uint64_t theirs[K];
#pragma unroll
  for (int i = 0; i < K; ++i) {
    merged[i] = key_from_ordered(top.value[i], top.id[i]);
    theirs[i] = key_from_ordered(other.value[i], other.id[i]);
  }
  merge_top_keys(merged, theirs);
#pragma unroll
  for (int i = 0; i < K; ++i) {
    top.value[i] = uint32_t(merged[i] >> 32);
    top.id[i] = key_index(merged[i]);
  }
}

// kTopology: the gate (FixedTopology id); its counts and scoring function are constants.
// kSplit: the threads a token, 1 or 2 (adjacent lanes). With 2, thread q of a token scores the
// groups [q * G / 2, (q + 1) * G / 2) (with one group, those experts), both rank every group from
// the keys they exchange, each offers its own kept experts to a list of its own, and the two
// lists are merged; each then weighs and writes half the winners. Twice the warps for a batch,
// to hide latency where one warp a scheduler would wait.
template <typename LogitT, typename BiasT, int kTopology, int kSplit = 1>
__device__ __forceinline__ void route_tokens_per_thread(const KernelArgs& args) {
  constexpr FixedTopology kShape = fixed_topology(kTopology);
  constexpr int kExperts = kShape.num_experts;
  constexpr int kGroups = kShape.num_expert_group;
  constexpr int kGroupSize = kExperts / kGroups;
  constexpr int kTopk = kShape.topk;
  constexpr int kChunk = 8;  // experts a load
  constexpr bool kHasBias = !std::is_same_v<BiasT, NoBias>;
  constexpr bool kSelectGroups = kShape.topk_group < kGroups;
  // Each kept group has two experts whose b is at least its second largest, so at least
  // 2 * topk_group experts reach the smallest of the kept groups' second largest: where topk is
  // no more, no expert below it can win, and only the kept experts that reach it are offered.
  constexpr bool kFilter = kSelectGroups && kTopk <= 2 * kShape.topk_group;
  // This thread's share of a token: kOwnGroups groups (kSelectGroups), kOwnExperts experts.
  constexpr int kOwnExperts = kExperts / kSplit;
  constexpr int kOwnGroups = kSelectGroups ? kGroups / kSplit : 1;
  constexpr int kOwnKept = kShape.topk_group < kOwnGroups ? kShape.topk_group : kOwnGroups;
  constexpr int kTokensPerBlock = kThreadKernelThreads / kSplit;
  static_assert(kSplit == 1 || kSplit == 2, "one or two threads a token");
  static_assert(kOwnExperts % kChunk == 0 && kGroupSize % kChunk == 0, "whole chunks");
  static_assert(!kSelectGroups || kGroups % kSplit == 0, "whole groups a thread");
  static_assert(kSplit == 1 || kTopk % kSplit == 0, "whole winners a thread");
  static_assert(!kFilter || kExperts <= 256, "an expert a byte");
  static_assert(kGroups <= 32, "a bit a group");
  const BiasedGroupedTopkParams& p = args.p;
  const int share = thread_index() % kSplit;  // q above
  const int own_first = share * kOwnExperts;  // this thread's first expert

  // The bias: every thread of a warp reads the same expert's at once.
  __shared__ float bias[kExperts];
  // Where groups are selected, each thread's b of its experts from the first pass, for the
  // second: the bits of b of its expert own_first + e in saved[e / 4][t], so that a warp's
  // 16-byte accesses to four experts each fall on 32 distinct banks a quarter-warp.
  __shared__ uint4 saved[kSelectGroups ? kOwnExperts / 4 : 1][kThreadKernelThreads];
  // Where kFilter, the experts offered, in order, of thread t in offered_id[k][t]; their b
  // overwrite the front of the thread's saved words (what is written never passes what is
  // read, the kept groups being read in ascending order).
  __shared__ uint8_t offered_id[kFilter ? kOwnKept * kGroupSize : 1][kThreadKernelThreads];
  // Word w (expert own_first + w's b in the first pass) of this thread's saved column.
  uint32_t* const saved_words = reinterpret_cast<uint32_t*>(saved) + 4 * thread_index();
  const auto saved_word = [&](uint32_t w) -> uint32_t& {
    return saved_words[w / 4 * (4 * kThreadKernelThreads) + w % 4];
  };
  if constexpr (kHasBias) {
    const BiasT* const source = static_cast<const BiasT*>(p.correction_bias);
    for (int e = thread_index(); e < kExperts; e += kThreadKernelThreads) {
      bias[e] = to_float(source[int64_t(e) * p.bias_stride]);
    }
    __syncthreads();
  }

  // Every lane of the warp runs each step (the pairs exchange by shuffles): a pair past the
  // last token routes the last one again and writes nothing.
  for (int64_t base = block_index() * kTokensPerBlock; base < p.num_tokens;
       base += args.token_step) {
    const int64_t wanted = base + thread_index() / kSplit;
    const bool writes = wanted < p.num_tokens;
    const int64_t token = writes ? wanted : p.num_tokens - 1;
    const LogitT* const row =
        static_cast<const LogitT*>(p.gating_output) + token * p.gating_row_stride;
    // s of a chunk's experts [first, first + kChunk), in place of their logits, and b of each
    // as fmaxf(b, -inf): -inf for NaN, as nan_to_neg_inf gives, in one instruction.
    float s[kChunk];
    float b[kChunk];
    const auto score_chunk = [&](int first) {
      load_experts<kChunk>(row, p.gating_col_stride, first, kExperts, s);
      elementwise_scores<kShape.scoring_func>(s);
#pragma unroll
      for (int i = 0; i < kChunk; ++i) {
        float biased = s[i];
        if constexpr (kHasBias) biased += bias[first + i];
        b[i] = fmaxf(biased, neg_inf());
      }
    };

    // Steps 3-4: each group's score from the top two of its b, ranked by key against the
    // others' (the other thread's groups' keys by shuffles); bit h of `kept` for this thread's
    // group h if kept.
    // The loops over groups and chunks stay loops: unrolled, a token's code would not fit the
    // instruction cache. A group's key goes to its register by selects, not by indexing.
    uint32_t kept = 0;
    float threshold = neg_inf();  // the least b offered (kFilter)
    if constexpr (kSelectGroups) {
      uint64_t own_key[kOwnGroups] = {};
      float own_second[kOwnGroups] = {};  // each group's second largest b (kFilter)
#pragma unroll 1
      for (int h = 0; h < kOwnGroups; ++h) {
        Top2 top2 = top2_empty();
#pragma unroll 1
        for (int c = h * kGroupSize; c < (h + 1) * kGroupSize; c += kChunk) {
          score_chunk(own_first + c);
#pragma unroll
          for (int i = 0; i < kChunk; ++i) top2 = top2_push_nan_free(top2, b[i]);
#pragma unroll
          for (int q = 0; q < kChunk / 4; ++q) {
            saved[c / 4 + q][thread_index()] =
                make_uint4(float_bits(b[4 * q]), float_bits(b[4 * q + 1]),
                           float_bits(b[4 * q + 2]), float_bits(b[4 * q + 3]));
          }
        }
        const uint32_t g = uint32_t(share * kOwnGroups + h);
        const uint64_t key =
            key_from_ordered(ordered_bits(group_score(top2, kHasBias, kGroupSize)), g);
#pragma unroll
        for (int i = 0; i < kOwnGroups; ++i) {
          own_key[i] = i == h ? key : own_key[i];
          own_second[i] = i == h ? top2.second : own_second[i];
        }
      }
      uint64_t group_key[kGroups];
      float group_second[kGroups];
#pragma unroll
      for (int i = 0; i < kOwnGroups; ++i) {
        if constexpr (kSplit == 1) {
          group_key[i] = own_key[i];
          group_second[i] = own_second[i];
        } else {
          const uint64_t other_key = shfl_xor(own_key[i], 1);
          const float other_second = shfl_xor(own_second[i], 1);
          group_key[i] = share == 0 ? own_key[i] : other_key;
          group_key[kOwnGroups + i] = share == 0 ? other_key : own_key[i];
          group_second[i] = share == 0 ? own_second[i] : other_second;
          group_second[kOwnGroups + i] = share == 0 ? other_second : own_second[i];
        }
      }
      kept = 0;
#pragma unroll
      for (int g = 0; g < kGroups; ++g) {
        int rank = 0;
#pragma unroll
        for (int other = 0; other < kGroups; ++other) {
          rank += group_key[other] > group_key[g] ? 1 : 0;
        }
        kept |= rank < kShape.topk_group ? 1u << g : 0u;
      }
      if constexpr (kFilter) {
        threshold = -neg_inf();
#pragma unroll
        for (int g = 0; g < kGroups; ++g) {
          threshold = (kept >> g) & 1u ? fminf(threshold, group_second[g]) : threshold;
        }
      }
      kept = (kept >> (share * kOwnGroups)) & (kOwnGroups == 32 ? ~0u : (1u << kOwnGroups) - 1);
    }

    // Steps 5-6: this thread's kept experts offered in ascending order, the j-th kept group of
    // every thread at once (a loop over all groups would run each group any thread keeps),
    // their b as the first pass left them, or scored here where every group is kept. Where
    // kFilter, those below the threshold are left out first: a store and a count an expert,
    // where an offer takes about forty instructions.
    TopList<kTopk> top;
    top_list_clear(top);
    if constexpr (kSelectGroups) {
      uint32_t offered = 0;
#pragma unroll 1
      for (int j = 0; j < kOwnKept && kept != 0; ++j) {
        const int h = __ffs(int(kept)) - 1;
        kept &= kept - 1;
#pragma unroll 1
        for (int c = h * kGroupSize; c < (h + 1) * kGroupSize; c += kChunk) {
#pragma unroll
          for (int q = 0; q < kChunk / 4; ++q) {
            const uint4 kept_b = saved[c / 4 + q][thread_index()];
            b[4 * q] = bits_float(kept_b.x);
            b[4 * q + 1] = bits_float(kept_b.y);
            b[4 * q + 2] = bits_float(kept_b.z);
            b[4 * q + 3] = bits_float(kept_b.w);
          }
#pragma unroll
          for (int i = 0; i < kChunk; ++i) {
            const uint32_t id = uint32_t(own_first + c + i);
            if constexpr (kFilter) {
              saved_word(offered) = float_bits(b[i]);
              offered_id[offered][thread_index()] = uint8_t(id);
              offered += b[i] >= threshold ? 1u : 0u;
            } else {
              top_list_offer(top, host_device::ordered_bits_nan_free(b[i]), id);
            }
          }
        }
      }
#pragma unroll 1
      for (uint32_t k = 0; k < offered; ++k) {
        top_list_offer(top, host_device::ordered_bits_nan_free(bits_float(saved_word(k))),
                       uint32_t(offered_id[k][thread_index()]));
      }
    } else {
#pragma unroll 1
      for (int c = 0; c < kOwnExperts; c += kChunk) {
        score_chunk(own_first + c);
#pragma unroll
        for (int i = 0; i < kChunk; ++i) {
          top_list_offer(top, host_device::ordered_bits_nan_free(b[i]),
                         uint32_t(own_first + c + i));
        }
      }
    }
    if constexpr (kSplit == 2) {
      TopList<kTopk> other;
#pragma unroll
      for (int i = 0; i < kTopk; ++i) {
        other.value[i] = shfl_xor(top.value[i], 1);
        other.id[i] = shfl_xor(top.id[i], 1);
      }
      top_list_merge(top, other);
    }

    // Step 7: each winner's unbiased score again, the weights added in winning order. With two
    // threads a token, each scores half the winners and they exchange them.
    constexpr int kOwnWinners = kTopk / kSplit;
    uint32_t own_id[kOwnWinners];
    float own_weight[kOwnWinners];
#pragma unroll
    for (int j = 0; j < kOwnWinners; ++j) {
      own_id[j] = share == 0 ? top.id[j] : top.id[(kSplit - 1) * kOwnWinners + j];
      own_weight[j] = to_float(row[int64_t(own_id[j]) * p.gating_col_stride]);
    }
    elementwise_scores<kShape.scoring_func>(own_weight);
    float weight[kTopk];
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < kTopk; ++j) {
      const int i = j % kOwnWinners;
      if constexpr (kSplit == 1) {
        weight[j] = weight_of_score(own_weight[j]);
      } else {
        const float other = shfl_xor(own_weight[i], 1);
        weight[j] = weight_of_score((j < kOwnWinners) == (share == 0) ? own_weight[i] : other);
      }
      sum += weight[j];
    }
    if (writes) {
#pragma unroll
      for (int j = 0; j < kOwnWinners; ++j) {
        const int column = share * kOwnWinners + j;
        const float own = share == 0 ? weight[j] : weight[(kSplit - 1) * kOwnWinners + j];
        p.topk_ids[token * p.ids_row_stride + column] = int32_t(own_id[j]);
        p.topk_weights[token * p.weights_row_stride + column] =
            finalize_weight(own, sum, p.renormalize, p.routed_scaling_factor);
      }
    }
  }
}

template <typename LogitT, typename BiasT, int kTopology, int kSplit>
__global__ void __launch_bounds__(kThreadKernelThreads)
    grouped_topk_thread_kernel(const KernelArgs args) {
  wait_for_prior_grids();
  allow_dependent_grids();
  route_tokens_per_thread<LogitT, BiasT, kTopology, kSplit>(args);
}

// Routing variants 4 (kSplit 1) and 7 (kSplit 2): a plain call of a gate with its own warp
// kernel instance (FixedTopology ids below kCurrentFixedTopologies, 32-lane warps), in blocks of
// one warp, up to 32 a multiprocessor (the shared memory keeps DeepSeek-V3 to six with kSplit 1,
// ten with 2).
template <int kSplit>
GpuError launch_thread_kernel(const BiasedGroupedTopkParams& params, void* stream) {
  return launch_gate_kernel(
      params, kThreadKernelThreads, kThreadKernelThreads / kSplit, 32, stream,
      [](auto logits, auto bias, int gate) -> Kernel {
        using LogitT = typename decltype(logits)::type;
        using BiasT = typename decltype(bias)::type;
        static_assert(kCurrentFixedTopologies == 3, "an instance for each current fixed topology");
        switch (gate) {
          case 1: return grouped_topk_thread_kernel<LogitT, BiasT, 1, kSplit>;
          case 2: return grouped_topk_thread_kernel<LogitT, BiasT, 2, kSplit>;
        }
        return nullptr;
      });
}

}  // namespace
}  // namespace moeext::gpu::grouped_topk
