// Argument validation for every op, and the translation of checked tensors into the plain
// launcher params of csrc/include/moeext/. Shared by the CPU and CUDA bindings so both reject
// the same inputs with the same words, before anything is written.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <string_view>

#include "moeext/grouped_topk.h"

namespace moeext::torch_glue {

DType to_moeext_dtype(const at::Tensor& t, const char* op, const char* arg);

// Checks everything but the outputs; returns the scoring function.
ScoringFunc check_grouped_topk_inputs(const at::Tensor& gating_output,
                                      const std::optional<at::Tensor>& correction_bias,
                                      int64_t num_expert_group, int64_t topk_group,
                                      int64_t topk, std::string_view scoring_func,
                                      const char* op);

// Checks all arguments, outputs included, and fills the launcher params.
BiasedGroupedTopkParams make_grouped_topk_params(
    const at::Tensor& gating_output, const std::optional<at::Tensor>& correction_bias,
    const at::Tensor& topk_weights, const at::Tensor& topk_ids, int64_t num_expert_group,
    int64_t topk_group, bool renormalize, double routed_scaling_factor,
    std::string_view scoring_func, const char* op);

}  // namespace moeext::torch_glue
