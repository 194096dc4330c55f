// routing_weights on NVIDIA and AMD GPUs (docs/SPEC.md section 6.6): the weights routing gives
// given experts, for replaying a recorded routing. Builds as CUDA and as HIP.
//
// One token per block of kGeneralThreads. Each given id is checked where it is (in range,
// not repeated in its row: a bit per expert in shared memory), with no host round trip; a
// row that fails gets NaN weights. The scores are the routing kernels' own: sigmoid and
// sqrt-softplus are elementwise (the same function of the same logit, so the same bits);
// softmax needs the row's maximum and sum, reduced in the lane layout of the warp kernel
// that routes such a row where it routes one (E <= 1024, top-k <= 32), else as the block
// kernel does, so that a replay of routing's ids gives routing's weights bit for bit (up to a
// topology whose groups made routing pick wider lanes or the block kernel: there, within the
// rounding of the sum).
#include <type_traits>

#include "gpu/compat.h"
#include "gpu/grouped_topk_block.h"
#include "gpu/grouped_topk_plan.h"
#include "gpu/grouped_topk_warp.h"
#include "moeext/grouped_topk.h"

namespace moeext {
namespace gpu::grouped_topk {
namespace {

template <typename IdT>
__device__ __forceinline__ int64_t id_at(const RoutingWeightsParams& p, int64_t token,
                                         int64_t j) {
  return int64_t(
      static_cast<const IdT*>(p.topk_ids)[token * p.ids_row_stride + j * p.ids_col_stride]);
}

// The warp kernel's softmax of the row, by the first warp: scores into s[0, num_experts).
template <int kWarpSize, int V, typename LogitT>
__device__ __forceinline__ void softmax_by_warp(const RoutingWeightsParams& p,
                                                const LogitT* row, float* s) {
  const int lane = thread_index();
  const int first = lane * V;
  const int num_experts = int(p.num_experts);
  float x[V];
  load_experts<V>(row, p.gating_col_stride, first, num_experts, x);
  score_lane<kWarpSize, V>(ScoringFunc::kSoftmax, first, num_experts, x);
#pragma unroll
  for (int i = 0; i < V; ++i) {
    if (first + i < num_experts) s[first + i] = x[i];
  }
}

// softmax_by_warp in the instance the warp kernel routes such a row with (V ==
// experts_per_lane, from plan_fast_path).
template <int kWarpSize, typename LogitT, int V = kFastExpertsPerLaneStep>
__device__ __forceinline__ void softmax_by_warp_of(int experts_per_lane,
                                                   const RoutingWeightsParams& p,
                                                   const LogitT* row, float* s) {
  if constexpr (fast_instance_exists(kWarpSize, V)) {
    if (experts_per_lane == V) {
      softmax_by_warp<kWarpSize, V>(p, row, s);
    } else {
      softmax_by_warp_of<kWarpSize, LogitT, V + kFastExpertsPerLaneStep>(experts_per_lane, p,
                                                                          row, s);
    }
  }
}

template <int kWarpSize, typename LogitT, typename IdT>
__device__ __forceinline__ void weigh_rows(const RoutingWeightsParams& p, int64_t token_step,
                                           int experts_per_lane) {
  constexpr int kWarps = kGeneralThreads / kWarpSize;
  const int tid = thread_index();
  const int num_experts = int(p.num_experts);
  const int seen_words = (num_experts + 31) / 32;
  const bool softmax = p.scoring_func == ScoringFunc::kSoftmax;
  const bool warp_softmax = softmax && experts_per_lane != 0;
  // Shared memory: a bit per expert, the warp softmax's scores, the block reductions'
  // partials, and the row's failure flag.
  uint32_t* const seen = shared_words();
  float* const warp_scores = reinterpret_cast<float*>(seen + seen_words);
  float* const partial = warp_scores + (warp_softmax ? num_experts : 0);
  int* const bad = reinterpret_cast<int*>(partial + 3 * kWarps);

  for (int64_t token = block_index(); token < p.num_tokens; token += token_step) {
    const LogitT* row = static_cast<const LogitT*>(p.gating_output) + token * p.gating_row_stride;
    for (int w = tid; w < seen_words; w += kGeneralThreads) seen[w] = 0;
    if (tid == 0) *bad = 0;
    __syncthreads();
    for (int64_t j = tid; j < p.k; j += kGeneralThreads) {
      const int64_t id = id_at<IdT>(p, token, j);
      if (id < 0 || id >= num_experts) {
        atomicOr(bad, 1);
      } else {
        const uint32_t bit = 1u << (id % 32);
        if ((atomicOr(seen + id / 32, bit) & bit) != 0) atomicOr(bad, 1);
      }
    }

    // The softmax's statistics, in the layout of the kernel that routes the row.
    float row_max = 0.0f, row_sum = 1.0f;
    if (warp_softmax) {
      if (tid < kWarpSize) {
        softmax_by_warp_of<kWarpSize, LogitT>(experts_per_lane, p, row, warp_scores);
      }
    } else if (softmax) {
      float local_max = neg_inf();
      bool has_nan = false;
      for (int e = tid; e < num_experts; e += kGeneralThreads) {
        const float x = to_float(row[int64_t(e) * p.gating_col_stride]);
        has_nan |= is_nan(x);
        local_max = x > local_max ? x : local_max;
      }
      const float nan_flag = block_max<kWarpSize>(has_nan ? 1.0f : 0.0f, partial + kWarps);
      row_max = block_max<kWarpSize>(local_max, partial);
      if (nan_flag != 0.0f) row_max = quiet_nan();
      float local_sum = 0.0f;
      for (int e = tid; e < num_experts; e += kGeneralThreads) {
        local_sum += expf(to_float(row[int64_t(e) * p.gating_col_stride]) - row_max);
      }
      row_sum = block_sum<kWarpSize>(local_sum, partial + 2 * kWarps);
    }
    __syncthreads();  // the checks' flags and the warp's scores are written

    float* const weights = p.topk_weights + token * p.weights_row_stride;
    const bool failed = *bad != 0;
    for (int64_t j = tid; j < p.k; j += kGeneralThreads) {
      float w = quiet_nan();
      if (!failed) {
        const int64_t e = id_at<IdT>(p, token, j);
        const float x = to_float(row[e * p.gating_col_stride]);
        const float s = warp_softmax ? warp_scores[e]
                        : softmax    ? expf(x - row_max) / row_sum
                                     : elementwise_score(p.scoring_func, x);
        w = weight_of_score(s);
        if (!p.renormalize) w = finalize_weight(w, 0.0f, false, p.routed_scaling_factor);
      }
      weights[j] = w;
    }
    if (p.renormalize && !failed) {
      __syncthreads();  // every weight is written
      float sum = 0.0f;  // in column order, as routing adds its winners
      for (int64_t j = 0; j < p.k; ++j) sum += weights[j];
      __syncthreads();  // and read by every thread before any is rewritten
      for (int64_t j = tid; j < p.k; j += kGeneralThreads) {
        weights[j] = finalize_weight(weights[j], sum, true, p.routed_scaling_factor);
      }
    }
    __syncthreads();  // the shared memory is reused by the next token
  }
}

template <int kWarpSize, typename LogitT, typename IdT>
__global__ void __launch_bounds__(kGeneralThreads, kMinBlocksPerMultiprocessor)
    routing_weights_kernel(const RoutingWeightsParams p, int64_t token_step,
                           int experts_per_lane) {
  if constexpr (kWarpSize == MOEEXT_DEVICE_WARP_SIZE) {
    wait_for_prior_grids();
    allow_dependent_grids();
    weigh_rows<kWarpSize, LogitT, IdT>(p, token_step, experts_per_lane);
  } else {
    (void)p;  // not this target's warp width: never launched here
    (void)token_step;
    (void)experts_per_lane;
  }
}

using WeightsKernel = void (*)(RoutingWeightsParams, int64_t, int);

template <int kWarpSize, typename LogitT>
WeightsKernel kernel_for_ids(IntType ids) {
  switch (ids) {
    case IntType::kInt16: return routing_weights_kernel<kWarpSize, LogitT, int16_t>;
    case IntType::kInt32: return routing_weights_kernel<kWarpSize, LogitT, int32_t>;
    case IntType::kInt64: return routing_weights_kernel<kWarpSize, LogitT, int64_t>;
  }
  return nullptr;
}

template <int kWarpSize>
WeightsKernel kernel_for(const RoutingWeightsParams& p) {
  switch (p.gating_dtype) {
    case DType::kFloat32: return kernel_for_ids<kWarpSize, float>(p.ids_dtype);
    case DType::kBFloat16: return kernel_for_ids<kWarpSize, bf16>(p.ids_dtype);
    case DType::kFloat16: return kernel_for_ids<kWarpSize, fp16>(p.ids_dtype);
  }
  return nullptr;
}

}  // namespace
}  // namespace gpu::grouped_topk

const char* routing_weights_gpu_limit(const RoutingWeightsParams& params) {
  if (params.num_experts > gpu::grouped_topk::kMaxExperts) {
    return "routing_weights: the GPU kernel takes at most 4096 experts";
  }
  const int warp_size = gpu::warp_size_of_current_device();
  if (warp_size != 32 && warp_size != 64) {
    return "routing_weights: the GPU kernel runs on warps of 32 or 64 lanes, and the current "
           "device's could not be asked or are neither";
  }
  return nullptr;
}

GpuError routing_weights_gpu(const RoutingWeightsParams& params, void* stream) {
  using namespace gpu::grouped_topk;
  if (params.num_tokens <= 0 || params.k <= 0) return nullptr;
  if (const char* limit = routing_weights_gpu_limit(params)) return limit;
  const int warp_size = gpu::warp_size_of_current_device();
  // The warp kernel routes a softmax row of this many experts and this top-k (with no groups
  // to keep, the narrowest lanes that cover it) where plan_fast_path gives it one; past its
  // top-k the block kernel routes it, and its reductions are the ones to follow.
  const FastPathPlan plan = plan_fast_path(warp_size, params.num_experts, 1, 1, params.k);
  const bool softmax = params.scoring_func == ScoringFunc::kSoftmax;
  const int experts_per_lane = softmax ? plan.experts_per_lane : 0;
  const int warps = kGeneralThreads / warp_size;
  const int64_t words = (params.num_experts + 31) / 32 +
                        (experts_per_lane != 0 ? params.num_experts : 0) + 3 * warps + 1;
  const int64_t sms = gpu::multiprocessor_count_of_current_device();
  const int64_t blocks = params.num_tokens < sms * 8 ? params.num_tokens : sms * 8;
  const WeightsKernel kernel = warp_size == 64 ? kernel_for<64>(params) : kernel_for<32>(params);
  if (kernel == nullptr) return "routing_weights: unknown gating_output or topk_ids dtype";
  return gpu::launch_dependent(kernel, dim3(unsigned(blocks)), dim3(unsigned(kGeneralThreads)),
                              size_t(words) * sizeof(uint32_t), gpu::as_stream(stream), params,
                              blocks, experts_per_lane);
}

}  // namespace moeext
