// Biased grouped top-k routing on NVIDIA and AMD GPUs (SPEC.md section 1); builds as CUDA and
// as HIP. The tie rule, the NaN policy and the weight arithmetic are the CPU kernel's
// (csrc/cpu/grouped_topk.cpp), through the shared functions of host_device/routing.h.
//
// Two kernels, picked per topology by plan_fast_path():
//   * warp kernel (E <= 512, topk <= 32, num_expert_group <= 32): one token per warp, each
//     lane holding kExpertsPerLane contiguous experts in registers. Decode batches are a
//     handful of tokens, so the latency of one token is what counts: each of the topk
//     argmax rounds is a few dozen instructions on 32-bit values with two warp reductions
//     (one redux.sync each on CUDA sm_80+), and a block holds as few warps as the batch
//     allows so that tokens spread over the multiprocessors.
//   * block kernel (everything else up to kMaxExperts experts): one token per block of
//     kGeneralThreads, b and the group scores in shared memory, block-wide argmax.
//
// Every kernel is templated on the logits dtype and the bias dtype (or NoBias), read as they
// are, and on the warp width; the instance whose width is not the target's compiles to an
// empty body, so that both widths build on every target and the host launches the one the
// device reports. The scoring function is a run-time switch: it is uniform across the grid,
// and templating on it would triple the instances for no gain outside the scoring loop.
#include <type_traits>

#include "gpu/compat.h"
#include "gpu/grouped_topk_plan.h"
#include "host_device/routing.h"
#include "moeext/grouped_topk.h"

namespace moeext {
namespace gpu::grouped_topk {

// The routing logic the CPU kernel shares (key packing, group scores, weights, NaN policy).
using host_device::finalize_weight;
using host_device::group_score;
using host_device::is_nan;
using host_device::key_from_ordered;
using host_device::key_index;
using host_device::kRemovedKey;
using host_device::make_key;
using host_device::nan_to_neg_inf;
using host_device::neg_inf;
using host_device::ordered_bits;
using host_device::Top2;
using host_device::top2_empty;
using host_device::top2_merge;
using host_device::top2_push;
using host_device::weight_of_score;

namespace {

struct NoBias {};

// Everything a kernel needs, passed by value. Strides in elements (those of
// BiasedGroupedTopkParams). The launch shape is passed in rather than read from
// blockDim/gridDim: see thread_index().
struct KernelArgs {
  BiasedGroupedTopkParams p;
  int group_size;                  // num_experts / num_expert_group
  int lanes_per_group;             // warp kernel, see plan_fast_path()
  bool group_scores_in_registers;  // warp kernel
  int warps_per_block;             // warp kernel: tokens per block and round
  int64_t token_step;              // tokens all blocks take per round (the grid-stride)
};

constexpr int kMaxThreadsPerBlock = 256;
// Launch bounds (256 threads, 2 blocks per multiprocessor): without a minimum, ptxas for sm_90a
// held the 12-experts-per-lane kernel to 80 registers and spilled; 2 blocks allow 128, which
// every instance fits without spilling while prefill batches keep 16 warps per SM.
constexpr int kMinBlocksPerMultiprocessor = 2;
static_assert(kGeneralThreads <= kMaxThreadsPerBlock, "launch bounds of the block kernel");

// ---------------------------------------------------------------------------------------
// Device helpers
// ---------------------------------------------------------------------------------------

// HIP's threadIdx and blockIdx are calls into the device library, which the device-only
// build check (-nogpulib) cannot resolve and then counts as stack and registers of an
// unknown callee; the builtins they wrap are the same instructions.
__device__ __forceinline__ int thread_index() {
#if defined(MOEEXT_HIP)
  return int(__builtin_amdgcn_workitem_id_x());
#else
  return int(threadIdx.x);
#endif
}

__device__ __forceinline__ int64_t block_index() {
#if defined(MOEEXT_HIP)
  return int64_t(__builtin_amdgcn_workgroup_id_x());
#else
  return int64_t(blockIdx.x);
#endif
}

__device__ __forceinline__ float quiet_nan() { return bits_float(0x7fc00000u); }

// Accurate expf/log1pf/sqrtf, never the fast intrinsics: the scores must agree with the CPU
// to an ulp, since near ties decide which expert wins.
__device__ __forceinline__ float elementwise_score(ScoringFunc scoring_func, float x) {
  if (scoring_func == ScoringFunc::kSigmoid) return 1.0f / (1.0f + expf(-x));
  // softplus with torch's threshold: x itself above 20.
  return sqrtf(x > 20.0f ? x : log1pf(expf(x)));
}

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

// The dynamic shared memory of both kernels; uint4 gives the base 16-byte alignment.
__device__ __forceinline__ uint32_t* shared_words() {
  extern __shared__ uint4 moeext_grouped_topk_smem[];
  return reinterpret_cast<uint32_t*>(moeext_grouped_topk_smem);
}

// Largest value over the warp by a butterfly of shuffles: partner lanes combine the same two
// values, so every lane ends with the same bits. Integers, or NaN-free floats.
template <int kWarpSize, typename T>
__device__ __forceinline__ T butterfly_max(T x) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    const T other = shfl_xor(x, offset);
    x = other > x ? other : x;
  }
  return x;
}

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
  // the larger key is the lower expert on a tie), and one butterfly over the keys.
  // Forced on an H100, routing calls took 0.87-0.98x the time (T <= 1024) they took with a
  // 32-bit butterfly for the value followed by a ballot and a shuffle for its holder, one
  // more dependent round trip; at T = 16384, 0.92-0.96x, but 1.02x at 12 experts a lane.
  const uint32_t lane_best = lane_max<0, V>(value);
  const uint32_t lane_first = first_holding(value, first, lane_best, uint32_t(first));
  return key_index(butterfly_max<kWarpSize>(key_from_ordered(lane_best, lane_first)));
#endif
}

template <int kWarpSize>
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) x += shfl_xor(x, offset);
  return x;
}

// Merges the top-2 pairs of aligned runs of `lanes` (a power of two) lanes.
__device__ __forceinline__ Top2 merge_top2_across_lanes(Top2 t, int lanes) {
  for (int offset = 1; offset < lanes; offset *= 2) {
    const Top2 other{shfl_xor(t.first, offset), shfl_xor(t.second, offset)};
    t = top2_merge(t, other);
  }
  return t;
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

// ---------------------------------------------------------------------------------------
// Warp kernel: one token per warp.
// ---------------------------------------------------------------------------------------

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

template <int kWarpSize, int kExpertsPerLane, typename LogitT, typename BiasT>
__device__ __forceinline__ void route_tokens_per_warp(const KernelArgs& args) {
  constexpr int V = kExpertsPerLane;
  constexpr bool kHasBias = !std::is_same_v<BiasT, NoBias>;
  const BiasedGroupedTopkParams& p = args.p;
  const int lane = thread_index() % kWarpSize;
  const int warp = thread_index() / kWarpSize;
  const int warps_per_block = args.warps_per_block;
  const int num_experts = int(p.num_experts);
  const int num_groups = int(p.num_expert_group);
  const int group_size = args.group_size;
  const int topk = int(p.topk);
  const int first = lane * V;  // this lane's experts: [first, first + V)
  const bool select_groups = p.topk_group < p.num_expert_group;
  const bool groups_in_registers = args.group_scores_in_registers;
  const int lanes_per_group = args.lanes_per_group;
  // This warp's row of b, when the groups are scored from shared memory.
  float* const shared_b = reinterpret_cast<float*>(shared_words()) + int64_t(warp) * num_experts;

  // The bias is the same for every token: read once, kept in registers.
  float bias[V];
  if constexpr (kHasBias) {
    load_experts<V>(static_cast<const BiasT*>(p.correction_bias), p.bias_stride, first,
                    num_experts, bias);
  }

  for (int64_t token = block_index() * warps_per_block + warp; token < p.num_tokens;
       token += args.token_step) {
    // Steps 1-2: s and the keys of b.
    float s[V];
    load_experts<V>(static_cast<const LogitT*>(p.gating_output) + token * p.gating_row_stride,
                    p.gating_col_stride, first, num_experts, s);
    score_lane<kWarpSize, V>(p.scoring_func, first, num_experts, s);

    // The rounds below compare b by ordered_bits; 0, below every real value (-inf's is
    // 0x007fffff), marks an expert out of play.
    uint32_t value[V];
    Top2 top2 = top2_empty();  // of this lane's b, which lies in one group
#pragma unroll
    for (int i = 0; i < V; ++i) {
      float b = s[i];
      if constexpr (kHasBias) b += bias[i];
      b = nan_to_neg_inf(b);
      const bool valid = first + i < num_experts;
      value[i] = valid ? ordered_bits(b) : 0u;
      if (select_groups && valid) {
        if (groups_in_registers) {
          top2 = top2_push(top2, b);
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
      const LaneMask kept = ballot(leader && rank < p.topk_group);
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
    for (int j = 0; j < topk; ++j) {
      const uint32_t id = round_winner<kWarpSize>(value, first);
#pragma unroll
      for (int i = 0; i < V; ++i) value[i] = uint32_t(first + i) == id ? 0u : value[i];
      chosen_id = lane == j ? id : chosen_id;
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
    // (All kWarpSize shuffles, unrolled and independent; a loop to topk waits on each.)
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < kWarpSize; ++j) {
      const float w = shfl(chosen_weight, j);
      if (j < topk) sum += w;
    }
    if (lane < topk) {
      p.topk_ids[token * p.ids_row_stride + lane] = int32_t(chosen_id);
      p.topk_weights[token * p.weights_row_stride + lane] =
          finalize_weight(chosen_weight, sum, p.renormalize, p.routed_scaling_factor);
    }
  }
}

template <int kWarpSize, int kExpertsPerLane, typename LogitT, typename BiasT>
__global__ void __launch_bounds__(kMaxThreadsPerBlock, kMinBlocksPerMultiprocessor)
    grouped_topk_warp_kernel(const KernelArgs args) {
  if constexpr (kWarpSize == MOEEXT_DEVICE_WARP_SIZE) {
    route_tokens_per_warp<kWarpSize, kExpertsPerLane, LogitT, BiasT>(args);
  } else {
    (void)args;  // not this target's warp width: never launched here
  }
}

// ---------------------------------------------------------------------------------------
// Block kernel: one token per block of kGeneralThreads.
// ---------------------------------------------------------------------------------------

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

template <int kWarpSize, typename LogitT, typename BiasT>
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
  }
}

template <int kWarpSize, typename LogitT, typename BiasT>
__global__ void __launch_bounds__(kGeneralThreads, kMinBlocksPerMultiprocessor)
    grouped_topk_block_kernel(const KernelArgs args) {
  if constexpr (kWarpSize == MOEEXT_DEVICE_WARP_SIZE) {
    route_tokens_per_block<kWarpSize, LogitT, BiasT>(args);
  } else {
    (void)args;  // not this target's warp width: never launched here
  }
}

// ---------------------------------------------------------------------------------------
// Host side
// ---------------------------------------------------------------------------------------

using Kernel = void (*)(KernelArgs);

GpuError launch(Kernel kernel, int64_t blocks, int threads, int64_t smem_bytes, void* stream,
                KernelArgs args) {
  kernel<<<dim3(unsigned(blocks)), dim3(unsigned(threads)), size_t(smem_bytes),
           as_stream(stream)>>>(args);
  return launch_status();
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

template <int kWarpSize, typename LogitT, typename BiasT>
Kernel warp_kernel(int experts_per_lane) {
  switch (experts_per_lane) {
    case 4: {
      if constexpr (fast_instance_exists(kWarpSize, 4)) {
        return grouped_topk_warp_kernel<kWarpSize, 4, LogitT, BiasT>;
      }
      break;
    }
    case 8: {
      if constexpr (fast_instance_exists(kWarpSize, 8)) {
        return grouped_topk_warp_kernel<kWarpSize, 8, LogitT, BiasT>;
      }
      break;
    }
    case 12: {
      if constexpr (fast_instance_exists(kWarpSize, 12)) {
        return grouped_topk_warp_kernel<kWarpSize, 12, LogitT, BiasT>;
      }
      break;
    }
    case 16: {
      if constexpr (fast_instance_exists(kWarpSize, 16)) {
        return grouped_topk_warp_kernel<kWarpSize, 16, LogitT, BiasT>;
      }
      break;
    }
    default:
      break;
  }
  return nullptr;
}

template <int kWarpSize, typename LogitT, typename BiasT>
GpuError launch_typed(KernelArgs args, const FastPathPlan& plan, void* stream) {
  const int64_t num_tokens = args.p.num_tokens;
  const int64_t sms = multiprocessor_count_of_current_device();
  if (plan.experts_per_lane != 0) {
    // One warp per multiprocessor while the batch is small (decode: each token's latency is
    // the cost), more warps per block as it grows; the grid then loops over the tokens.
    constexpr int64_t kMaxWarpsPerBlock = kMaxThreadsPerBlock / kWarpSize;
    int64_t warps_per_block = ceil_div(num_tokens, sms);
    if (warps_per_block > kMaxWarpsPerBlock) warps_per_block = kMaxWarpsPerBlock;
    int64_t blocks = ceil_div(num_tokens, warps_per_block);
    if (blocks > sms * 16) blocks = sms * 16;
    args.warps_per_block = int(warps_per_block);
    args.token_step = blocks * warps_per_block;
    const Kernel kernel = warp_kernel<kWarpSize, LogitT, BiasT>(plan.experts_per_lane);
    if (kernel == nullptr) return "biased_grouped_topk: no warp kernel for this plan (internal error)";
    return launch(kernel, blocks, int(warps_per_block * kWarpSize),
                  fast_smem_bytes(plan, args.p.num_experts, warps_per_block), stream, args);
  }
  constexpr int kWarps = kGeneralThreads / kWarpSize;
  const GeneralSmemLayout layout =
      general_smem_layout(args.p.num_experts, args.p.num_expert_group, kWarps);
  int64_t blocks = num_tokens;
  if (blocks > sms * 8) blocks = sms * 8;
  args.warps_per_block = kWarps;
  args.token_step = blocks;
  return launch(grouped_topk_block_kernel<kWarpSize, LogitT, BiasT>, blocks, kGeneralThreads,
                layout.total_words * int64_t(sizeof(uint32_t)), stream, args);
}

template <int kWarpSize, typename LogitT>
GpuError launch_for_bias(const KernelArgs& args, const FastPathPlan& plan, void* stream) {
  if (args.p.correction_bias == nullptr) {
    return launch_typed<kWarpSize, LogitT, NoBias>(args, plan, stream);
  }
  switch (args.p.bias_dtype) {
    case DType::kFloat32: return launch_typed<kWarpSize, LogitT, float>(args, plan, stream);
    case DType::kBFloat16: return launch_typed<kWarpSize, LogitT, bf16>(args, plan, stream);
    case DType::kFloat16: return launch_typed<kWarpSize, LogitT, fp16>(args, plan, stream);
  }
  return "biased_grouped_topk: unknown correction_bias dtype";
}

template <int kWarpSize>
GpuError launch_for_logits(const KernelArgs& args, const FastPathPlan& plan, void* stream) {
  switch (args.p.gating_dtype) {
    case DType::kFloat32: return launch_for_bias<kWarpSize, float>(args, plan, stream);
    case DType::kBFloat16: return launch_for_bias<kWarpSize, bf16>(args, plan, stream);
    case DType::kFloat16: return launch_for_bias<kWarpSize, fp16>(args, plan, stream);
  }
  return "biased_grouped_topk: unknown gating_output dtype";
}

// "<prefix><value><suffix>" into a per-thread buffer (the message outlives the call).
const char* format_message(const char* prefix, int64_t value, const char* suffix) {
  thread_local char buffer[192];
  int n = 0;
  auto append = [&](const char* text) {
    while (*text != '\0' && n + 1 < int(sizeof(buffer))) buffer[n++] = *text++;
  };
  append(prefix);
  char digits[24];
  int count = 0;
  const bool negative = value < 0;
  uint64_t magnitude = negative ? uint64_t(0) - uint64_t(value) : uint64_t(value);
  do {
    digits[count++] = char('0' + magnitude % 10);
    magnitude /= 10;
  } while (magnitude != 0);
  if (negative) append("-");
  while (count > 0 && n + 1 < int(sizeof(buffer))) buffer[n++] = digits[--count];
  append(suffix);
  buffer[n] = '\0';
  return buffer;
}

}  // namespace
}  // namespace gpu::grouped_topk

const char* biased_grouped_topk_gpu_limit(const BiasedGroupedTopkParams& params) {
  using namespace gpu::grouped_topk;
  if (params.num_experts > kMaxExperts) {
    return format_message("biased_grouped_topk: the GPU kernels take at most 4096 experts, got ",
                          params.num_experts, "");
  }
  const int warp_size = gpu::warp_size_of_current_device();
  if (warp_size == 0) {
    return "biased_grouped_topk: the current GPU device could not be asked its warp size";
  }
  if (warp_size != 32 && warp_size != 64) {
    return format_message("biased_grouped_topk: the GPU kernels run on warps of 32 or 64 lanes, "
                          "this device's have ", warp_size, "");
  }
  return nullptr;
}

GpuError biased_grouped_topk_gpu(const BiasedGroupedTopkParams& params, void* stream) {
  using namespace gpu::grouped_topk;
  if (params.num_tokens <= 0) return nullptr;
  if (const char* limit = biased_grouped_topk_gpu_limit(params)) return limit;
  const int warp_size = gpu::warp_size_of_current_device();
  KernelArgs args;
  args.p = params;
  args.group_size = int(params.num_experts / params.num_expert_group);
  const FastPathPlan plan = plan_fast_path(warp_size, params.num_experts, params.num_expert_group,
                                           params.topk_group, params.topk);
  args.lanes_per_group = plan.lanes_per_group;
  args.group_scores_in_registers = plan.group_scores_in_registers;
  if (warp_size == 64) return launch_for_logits<64>(args, plan, stream);
  return launch_for_logits<32>(args, plan, stream);
}

}  // namespace moeext
