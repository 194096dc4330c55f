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

// What engines do with a routed choice, done by the routing call itself (docs/SPEC.md §6). A
// plain call leaves every field unset. Strides in elements.
struct RoutingOptions {
  // Columns [topk, topk + S) of both outputs: id num_experts + j, weight shared_expert_weight.
  int64_t num_shared_experts = 0;
  float shared_expert_weight = 1.0f;
  // [num_experts + S]: every id written to topk_ids is expert_map[id].
  const int32_t* expert_map = nullptr;
  int64_t map_stride = 1;
  // [num_experts], kInt32 or kInt64: += 1 per routed logical id of every counted row.
  void* expert_counts = nullptr;
  IntType counts_dtype = IntType::kInt32;
  int64_t counts_stride = 1;
  // [>= num_tokens, topk], kInt16 or kInt32: row t gets row t's routed logical ids (columns
  // contiguous).
  void* routed_experts = nullptr;
  IntType routed_dtype = IntType::kInt32;
  int64_t routed_row_stride = 0;
  // One kInt32 or kInt64 in the kernels' memory: rows at or past it are neither counted nor
  // recorded (a negative value counts no row). Unset: every row counts.
  const void* num_valid_tokens = nullptr;
  IntType valid_dtype = IntType::kInt64;

  bool any() const {
    return num_shared_experts > 0 || expert_map != nullptr || expert_counts != nullptr ||
           routed_experts != nullptr;
  }
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

  float* topk_weights = nullptr;  // [num_tokens, topk + S], columns contiguous
  int64_t weights_row_stride = 0;
  int32_t* topk_ids = nullptr;  // [num_tokens, topk + S], columns contiguous
  int64_t ids_row_stride = 0;

  int64_t num_tokens = 0;
  int64_t num_experts = 0;
  int64_t num_expert_group = 1;
  int64_t topk_group = 1;
  int64_t topk = 1;
  bool renormalize = true;
  float routed_scaling_factor = 1.0f;
  ScoringFunc scoring_func = ScoringFunc::kSigmoid;
  RoutingOptions options;
};

// routing_weights (docs/SPEC.md §6.6): the weights routing gives given experts. Strides in
// elements.
struct RoutingWeightsParams {
  const void* gating_output = nullptr;  // [num_tokens, num_experts]
  DType gating_dtype = DType::kFloat32;
  int64_t gating_row_stride = 0;
  int64_t gating_col_stride = 1;
  const void* topk_ids = nullptr;  // [num_tokens, k], kInt16, kInt32 or kInt64
  IntType ids_dtype = IntType::kInt32;
  int64_t ids_row_stride = 0;
  int64_t ids_col_stride = 1;
  float* topk_weights = nullptr;  // [num_tokens, k], columns contiguous
  int64_t weights_row_stride = 0;
  int64_t num_tokens = 0;
  int64_t num_experts = 0;
  int64_t k = 0;
  bool renormalize = true;
  float routed_scaling_factor = 1.0f;
  ScoringFunc scoring_func = ScoringFunc::kSigmoid;
};

// The first row in [row_begin, row_end) holding an id outside [0, num_experts) or the same
// id twice, or -1. Reads the ids only.
int64_t routing_weights_cpu_invalid_row(const RoutingWeightsParams& params, int64_t row_begin,
                                        int64_t row_end);
// The weights of rows [row_begin, row_end) (ids checked) on the CPU path cpu_isa_active():
// bit for bit the weights biased_grouped_topk_cpu writes for the same ids in the same order.
void routing_weights_cpu(const RoutingWeightsParams& params, int64_t row_begin, int64_t row_end);
// Every row on the GPU; a row holding an invalid id gets NaN weights (no host round trip).
// What the GPU kernel cannot weigh (more than 4096 experts, a warp of neither 32 nor 64
// lanes: see routing_weights_gpu_limit) is not launched: the caller checks first.
GpuError routing_weights_gpu(const RoutingWeightsParams& params, void* stream);
const char* routing_weights_gpu_limit(const RoutingWeightsParams& params);

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
