// Argument validation for every op, and the translation of checked tensors into the plain
// launcher params of csrc/include/moeext/. Shared by the CPU and CUDA bindings so both reject
// the same inputs with the same words, before anything is written.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <string_view>

#include "moeext/grouped_topk.h"
#include "moeext/mxfp4_shuffle.h"
#include "moeext/router_gemm.h"
#include "moeext/zero_tail.h"

namespace moeext::torch_glue {

DType to_moeext_dtype(const at::Tensor& t, const char* op, const char* arg);

// Checks everything but the outputs; returns the scoring function.
ScoringFunc check_grouped_topk_inputs(const at::Tensor& gating_output,
                                      const std::optional<at::Tensor>& correction_bias,
                                      int64_t num_expert_group, int64_t topk_group,
                                      int64_t topk, std::string_view scoring_func,
                                      const char* op);

// Fills the launcher params from inputs check_grouped_topk_inputs accepted and outputs that
// are float32 / int32 [num_tokens, topk] with contiguous columns on gating_output's device.
BiasedGroupedTopkParams fill_grouped_topk_params(
    const at::Tensor& gating_output, const std::optional<at::Tensor>& correction_bias,
    const at::Tensor& topk_weights, const at::Tensor& topk_ids, int64_t num_expert_group,
    int64_t topk_group, bool renormalize, double routed_scaling_factor, ScoringFunc scoring);

// Checks all arguments, outputs included, and fills the launcher params.
BiasedGroupedTopkParams make_grouped_topk_params(
    const at::Tensor& gating_output, const std::optional<at::Tensor>& correction_bias,
    const at::Tensor& topk_weights, const at::Tensor& topk_ids, int64_t num_expert_group,
    int64_t topk_group, bool renormalize, double routed_scaling_factor,
    std::string_view scoring_func, const char* op);

// The experts of a router weight: [num_experts, hidden_size], or prepacked (3-D,
// [ceil(hidden_size / 2), num_experts, 2]; see RouterGemmParams::weight_prepacked).
int64_t router_gemm_num_experts(const at::Tensor& weight);

// Checks the inputs of router_gemm and returns the logits dtype (out_dtype, float32 if none).
at::ScalarType check_router_gemm_inputs(const at::Tensor& hidden_states, const at::Tensor& weight,
                                        std::optional<at::ScalarType> out_dtype, const char* op);

// Fills the launcher params from checked inputs and an output [num_tokens, num_experts].
RouterGemmParams make_router_gemm_params(const at::Tensor& hidden_states,
                                         const at::Tensor& weight, const at::Tensor& logits);

// Checks buf (rows along dim 0 must each be one contiguous byte range, no two sharing
// memory), the extents and, for the tracked form, that state lies outside buf; describes
// rows [new_extent, min(prev_extent, buf.size(0))) for zeroing.
ZeroRowsParams make_zero_tail_params(const at::Tensor& buf, int64_t new_extent,
                                     int64_t prev_extent, const char* op,
                                     const at::Tensor* state = nullptr);

// Checks the state tensor of the tracked form: one int64 element on buf's device.
void check_zero_tail_state(const at::Tensor& buf, const at::Tensor& state, const char* op);

// Checks w for shuffle_weight / unshuffle_weight and describes it as [batch, rows, row_bytes]
// with w as the logical side (its strides) and `shuffled` as the dense side.
ShuffleWeightParams make_shuffle_weight_params(const at::Tensor& logical, void* shuffled,
                                               at::IntArrayRef layout, bool gate_up,
                                               const char* op);

// The tensor shuffle_weight reads: w itself when the kernels take its strides (rows dense,
// leading dims flattening into one batch stride), else a dense copy.
at::Tensor shuffle_weight_source(const at::Tensor& w);

// Checks the scale matrix of e8m0_shuffle; returns params with the padded shape, the gate/up
// grouping and the scale's pointer and strides filled in (the output pointer unset).
E8m0ShuffleParams make_e8m0_shuffle_params(const at::Tensor& scale, bool gate_up,
                                           std::optional<int64_t> num_experts, const char* op);

// Checks the shuffled bytes and target shape of e8m0_unshuffle; returns params with the
// padded shape and gate/up grouping filled in (pointers unset).
E8m0ShuffleParams make_e8m0_unshuffle_params(const at::Tensor& shuffled, int64_t m, int64_t n,
                                             bool gate_up, std::optional<int64_t> num_experts,
                                             const char* op);

}  // namespace moeext::torch_glue
