// Biased grouped top-k routing (SPEC.md section 1): launcher API.
#pragma once

#include <algorithm>
#include <cstdint>

#include "moeext/common.h"

namespace moeext {

enum class ScoringFunc : int8_t {
  kSigmoid,
  kSqrtSoftplus,
  kSoftmax,
};

// All strides are in elements. The caller has validated the topology
// (num_experts % num_expert_group == 0, 1 <= topk_group <= num_expert_group,
// 1 <= topk <= topk_group * num_experts / num_expert_group).
struct BiasedGroupedTopkParams {
  const void* gating_output = nullptr;  // [num_tokens, num_experts]
  DType gating_dtype = DType::kFloat32;
  int64_t gating_row_stride = 0;
  int64_t gating_col_stride = 1;

  const void* correction_bias = nullptr;  // [num_experts], or nullptr for no bias
  DType bias_dtype = DType::kFloat32;
  int64_t bias_stride = 1;

  float* topk_weights = nullptr;  // [num_tokens, topk], columns contiguous
  int64_t weights_row_stride = 0;
  int32_t* topk_ids = nullptr;  // [num_tokens, topk], columns contiguous
  int64_t ids_row_stride = 0;

  int64_t num_tokens = 0;
  int64_t num_experts = 0;
  int64_t num_expert_group = 1;
  int64_t topk_group = 1;
  int64_t topk = 1;
  bool renormalize = true;
  float routed_scaling_factor = 1.0f;
  ScoringFunc scoring_func = ScoringFunc::kSigmoid;
};

// Routes tokens [row_begin, row_end) on the CPU path cpu_isa_active(). Runs on the calling
// thread: callers split the rows over their own thread pool.
void biased_grouped_topk_cpu(const BiasedGroupedTopkParams& params, int64_t row_begin,
                             int64_t row_end);

// The fewest rows worth a thread of their own, for callers that split the rows (the torch
// binding, the C++ benchmark): chunks of at least 4k expert-rows, a few microseconds, pay for
// the second thread's wake-up (docs/notes/bindings-and-shuffles.md).
inline int64_t biased_grouped_topk_cpu_grain(int64_t num_experts) {
  return std::max<int64_t>(1, 4096 / std::max<int64_t>(1, num_experts));
}

// Routes every token on the GPU. What the GPU kernels cannot route (more than 4096 experts,
// a warp that is neither 32 nor 64 lanes: see biased_grouped_topk_gpu_limit) is not
// launched: the caller checks first.
GpuError biased_grouped_topk_gpu(const BiasedGroupedTopkParams& params, void* stream);

// nullptr when the GPU kernels route this topology, else a message naming the limit.
const char* biased_grouped_topk_gpu_limit(const BiasedGroupedTopkParams& params);

}  // namespace moeext
