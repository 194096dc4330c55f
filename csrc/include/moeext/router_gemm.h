// Router GEMM (SPEC.md section 2): launcher API.
#pragma once

#include <cstdint>

#include "moeext/common.h"

namespace moeext {

// Experts per tile of a prepacked router weight (the layout: csrc/cpu/router_weight_pack.h).
constexpr int64_t kRouterPackTile = 64;

// logits[t][e] = sum_h hidden[t][h] * weight[e][h], accumulated in fp32. All strides are in
// elements; rows of both inputs are contiguous (stride 1 along hidden_size).
struct RouterGemmParams {
  const void* hidden_states = nullptr;  // [num_tokens, hidden_size]
  int64_t hidden_row_stride = 0;
  const void* weight = nullptr;  // [num_experts, hidden_size], the nn.Linear layout
  int64_t weight_row_stride = 0;
  // Or, bf16 only (CPU), the contiguous prepacked weight: the layout csrc/cpu/router_weight_pack.h
  // documents and prepack_router_weight_cpu writes (weight_row_stride unused).
  bool weight_prepacked = false;
  DType input_dtype = DType::kBFloat16;  // of both inputs

  void* logits = nullptr;  // [num_tokens, num_experts], columns contiguous
  int64_t logits_row_stride = 0;
  DType logits_dtype = DType::kFloat32;  // kFloat32, or kBFloat16 rounded once at the end

  int64_t num_tokens = 0;
  int64_t hidden_size = 0;
  int64_t num_experts = 0;
};

// Computes the logits of experts [expert_begin, expert_end) for every token, on the calling
// thread, reading those weight rows from memory once. Callers split the experts over their
// own pool, so each thread streams a disjoint slice of the weight. expert_begin must be a
// multiple of router_gemm_expert_block(params): a prepacked weight is read in whole tiles,
// so a range starting inside one computes wrong logits and writes experts outside it.
void router_gemm_cpu(const RouterGemmParams& params, int64_t expert_begin, int64_t expert_end);

// The granularity, in experts, at which callers split the experts between threads on the
// active CPU path: kRouterPackTile for a prepacked weight (required), else 2 (any split is
// correct; an even split, each range ending in a narrower tile, beat whole tiles).
int64_t router_gemm_expert_block(const RouterGemmParams& params);

// The fewest blocks of router_gemm_expert_block(params) experts worth a thread of their own,
// for callers that split the experts (the torch binding, the C++ benchmark): a chunk should
// carry at least ~512k multiply-adds (a few us, more than a thread wake-up costs), so small
// gates stay on the calling thread.
inline int64_t router_gemm_cpu_grain(const RouterGemmParams& params, int64_t expert_block) {
  const int64_t hidden = params.hidden_size > 1 ? params.hidden_size : 1;
  const int64_t work_per_block = expert_block * hidden * params.num_tokens;
  const int64_t grain = (int64_t(1) << 19) / (work_per_block > 1 ? work_per_block : 1);
  return grain > 1 ? grain : 1;
}

// A bf16 router weight to write in the prepacked layout of RouterGemmParams::weight_prepacked
// (csrc/cpu/router_weight_pack.h). Strides in elements, any of them: a transposed or sliced
// view packs without a copy.
struct RouterWeightPackParams {
  const void* weight = nullptr;  // [num_experts, hidden_size]
  int64_t weight_row_stride = 0;
  int64_t weight_col_stride = 1;
  void* packed = nullptr;  // ceil(hidden_size / 2) * num_experts * 2 elements, contiguous
  int64_t num_experts = 0;
  int64_t hidden_size = 0;
};

// Writes the packed elements of experts [expert_begin, expert_end) on the calling thread,
// and nothing else: each expert's elements are its own, so callers may split the experts
// between threads anywhere. Made once at load time, never per call.
void prepack_router_weight_cpu(const RouterWeightPackParams& params, int64_t expert_begin,
                               int64_t expert_end);

// The GPU small-T kernel: whether it takes these params (few tokens, hidden_size a multiple
// of 8, 16-byte aligned rows) and beats the platform GEMM on the current device for them
// (9..16 tokens only while their blocks fit one wave); the caller hands anything else to
// the platform GEMM.
bool router_gemm_gpu_supported(const RouterGemmParams& params);
GpuError router_gemm_gpu(const RouterGemmParams& params, void* stream);

}  // namespace moeext
