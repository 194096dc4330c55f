// Checks and params the ops that route share (biased_grouped_topk and its out= form,
// fused_router, routing_weights): the logits, the topology, the bias and the scoring
// function; the options of docs/SPEC.md section 6; the memory a call writes against the memory
// it reads; the launch. Each check's message is written once, here.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string_view>

#include "moeext/grouped_topk.h"
#include "torch/binding.h"

namespace moeext::torch_glue {

// gating_output is 2-D float32, bfloat16 or float16.
void check_logits(const at::Tensor& gating_output, const char* op);

ScoringFunc parse_scoring_func(std::string_view name, const char* op);

// Everything of a routing call but its outputs and the options: the logits, the topology,
// the bias; returns the scoring function. logits_name: what a device mismatch calls the
// tensor the logits come from.
ScoringFunc check_routing(const at::Tensor& gating_output,
                          const std::optional<at::Tensor>& correction_bias,
                          int64_t num_expert_group, int64_t topk_group, int64_t topk,
                          std::string_view scoring_func, const char* op,
                          const char* logits_name = "gating_output");

// The options of docs/SPEC.md section 6, as the schema passes them.
struct OptionArgs {
  int64_t num_fused_shared_experts;
  double shared_expert_weight;
  const std::optional<at::Tensor>& expert_map;
  const std::optional<at::Tensor>& expert_counts;
  const std::optional<at::Tensor>& routed_experts;
  const std::optional<at::Tensor>& num_valid_tokens;

  bool any() const {
    return num_fused_shared_experts != 0 || expert_map.has_value() || expert_counts.has_value() ||
           routed_experts.has_value() || num_valid_tokens.has_value();
  }
};

void check_shared_experts(int64_t shared, const char* op);

// Checks the option tensors of a call routing gating_output's rows (num_fused_shared_experts
// was checked) and fills their params.
RoutingOptions check_options(const OptionArgs& options, const at::Tensor& gating_output,
                             int64_t topk, const char* op,
                             const char* logits_name = "gating_output");

// The out= forms' topk_ids: 2-D, with a routed column beside the num_fused_shared_experts
// (checked here too); returns topk, its columns less the shared experts'.
int64_t check_out_columns(const at::Tensor& topk_ids, int64_t num_fused_shared_experts,
                          const char* op);

// topk_weights or topk_ids of an out= form: [num_tokens, columns] of `dtype`, on the device
// of the logits (gating_output, or the op's logits buffer; logits_name names it), columns
// contiguous.
void check_output(const at::Tensor& out, const at::Tensor& gating_output, at::ScalarType dtype,
                  int64_t columns, const char* op, const char* arg,
                  const char* logits_name = "gating_output");

// Launcher params from checked inputs and outputs (float32 / int32 [num_tokens, topk + S]
// with contiguous columns on gating_output's device); the options unset.
BiasedGroupedTopkParams fill_routing_params(
    const at::Tensor& gating_output, const std::optional<at::Tensor>& correction_bias,
    const at::Tensor& topk_weights, const at::Tensor& topk_ids, int64_t num_expert_group,
    int64_t topk_group, int64_t topk, bool renormalize, double routed_scaling_factor,
    ScoringFunc scoring);

// What a call writes may not overlap what it reads or other writes (nor its own rows): the
// result would depend on the order the kernel touches memory in. `outputs`: whether the
// weights and ids are the caller's (an out= form) rather than fresh.
void check_writes_apart(const BiasedGroupedTopkParams& p, bool outputs, const char* op);

// The direct calls of the routing ops release the GIL from 16k logits on: long enough
// (several us) for another Python thread to run meanwhile.
struct RoutesMany {
  template <typename... Rest>
  static bool test(const at::Tensor& gating_output, const Rest&...) {
    return gating_output.numel() >= 16384;
  }
};

// Routes checked params on gating_output's device (its current stream on a GPU).
void run_routing(Cpu, const BiasedGroupedTopkParams& p, const at::Tensor& gating_output,
                 const char* op);
#if defined(MOEEXT_GPU_BACKEND)
void run_routing(Gpu, const BiasedGroupedTopkParams& p, const at::Tensor& gating_output,
                 const char* op);
#endif

}  // namespace moeext::torch_glue
