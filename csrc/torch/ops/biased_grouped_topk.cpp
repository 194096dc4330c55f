// biased_grouped_topk and its out= form (docs/SPEC.md sections 1 and 6): checks, launcher
// params, the CPU and GPU implementations, autograd, and the direct calls of the Python
// wrappers.
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "moeext/grouped_topk.h"
#include "torch/autograd_kernels.h"
#include "torch/binding.h"
#include "torch/direct_call.h"
#include "torch/memory_overlap.h"
#include "torch/routing_backward.h"
#include "torch/routing_common.h"

namespace moeext::torch_glue {
namespace {

// ---- The ops -----------------------------------------------------------------------------

template <typename Device>
std::tuple<at::Tensor, at::Tensor> biased_grouped_topk(
    const at::Tensor& gating_output, const std::optional<at::Tensor>& correction_bias,
    int64_t num_expert_group, int64_t topk_group, int64_t topk, bool renormalize,
    double routed_scaling_factor, c10::string_view scoring_func,
    int64_t num_fused_shared_experts, double shared_expert_weight,
    const std::optional<at::Tensor>& expert_map, const std::optional<at::Tensor>& expert_counts,
    const std::optional<at::Tensor>& routed_experts,
    const std::optional<at::Tensor>& num_valid_tokens) {
  constexpr const char* op = "biased_grouped_topk";
  Device::check_device(gating_output, op, "gating_output");
  const ScoringFunc scoring = check_routing(gating_output, correction_bias, num_expert_group,
                                           topk_group, topk, as_std(scoring_func), op);
  const OptionArgs options{num_fused_shared_experts, shared_expert_weight, expert_map,
                           expert_counts, routed_experts, num_valid_tokens};
  const bool any_option = options.any();
  if (any_option) check_shared_experts(num_fused_shared_experts, op);
  const int64_t num_tokens = gating_output.size(0);
  const int64_t columns = topk + num_fused_shared_experts;
  at::Tensor topk_weights = Device::empty({num_tokens, columns}, at::kFloat, gating_output);
  at::Tensor topk_ids = Device::empty({num_tokens, columns}, at::kInt, gating_output);
  BiasedGroupedTopkParams p =
      fill_routing_params(gating_output, correction_bias, topk_weights, topk_ids, num_expert_group,
                  topk_group, topk, renormalize, routed_scaling_factor, scoring);
  // The outputs are ours and the inputs were checked once above; only what the options write
  // is checked against them.
  if (any_option) {
    p.options = check_options(options, gating_output, topk, op);
    check_writes_apart(p, /*outputs=*/false, op);
  }
  run_routing(Device{}, p, gating_output, op);
  return {topk_weights, topk_ids};
}

template <typename Device>
void biased_grouped_topk_out(
    const at::Tensor& gating_output, const std::optional<at::Tensor>& correction_bias,
    const at::Tensor& topk_weights, const at::Tensor& topk_ids, int64_t num_expert_group,
    int64_t topk_group, bool renormalize, double routed_scaling_factor,
    c10::string_view scoring_func, int64_t num_fused_shared_experts, double shared_expert_weight,
    const std::optional<at::Tensor>& expert_map, const std::optional<at::Tensor>& expert_counts,
    const std::optional<at::Tensor>& routed_experts,
    const std::optional<at::Tensor>& num_valid_tokens) {
  constexpr const char* op = "biased_grouped_topk_out";
  Device::check_device(gating_output, op, "gating_output");
  const int64_t topk = check_out_columns(topk_ids, num_fused_shared_experts, op);
  const int64_t columns = topk_ids.size(1);
  const ScoringFunc scoring = check_routing(gating_output, correction_bias, num_expert_group,
                                           topk_group, topk, as_std(scoring_func), op);
  check_output(topk_weights, gating_output, at::kFloat, columns, op, "topk_weights");
  check_output(topk_ids, gating_output, at::kInt, columns, op, "topk_ids");
  BiasedGroupedTopkParams p =
      fill_routing_params(gating_output, correction_bias, topk_weights, topk_ids, num_expert_group,
                  topk_group, topk, renormalize, routed_scaling_factor, scoring);
  const OptionArgs options{num_fused_shared_experts, shared_expert_weight, expert_map,
                           expert_counts, routed_experts, num_valid_tokens};
  if (options.any()) p.options = check_options(options, gating_output, topk, op);
  check_writes_apart(p, /*outputs=*/true, op);
  run_routing(Device{}, p, gating_output, op);
}

using Signature = decltype(biased_grouped_topk<Cpu>);
using OutSignature = decltype(biased_grouped_topk_out<Cpu>);

const c10::TypedOperatorHandle<Signature>& handle() {
  static const auto h = typed_op<Signature>("moeext::biased_grouped_topk");
  return h;
}

const c10::TypedOperatorHandle<OutSignature>& out_handle() {
  static const auto h = typed_op<OutSignature>("moeext::biased_grouped_topk_out");
  return h;
}

// ---- Autograd ----------------------------------------------------------------------------
// The routed weights are differentiable in the logits; the bias, the ids and the shared
// experts' weights (constants) get no gradient. Where nothing requires grad the kernel is one
// unboxed redispatch, what autograd's boxed fallback would do at the cost of boxing every
// argument.

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The routed choice without the shared experts' columns and the expert map, whose ids the
// backward needs; counts and records are written as asked.
struct RoutingFunction : public torch::autograd::Function<RoutingFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& gating_output,
                               const std::optional<at::Tensor>& correction_bias,
                               int64_t num_expert_group, int64_t topk_group, int64_t topk,
                               bool renormalize, double routed_scaling_factor,
                               const std::string& scoring_func,
                               const std::optional<at::Tensor>& expert_counts,
                               const std::optional<at::Tensor>& routed_experts,
                               const std::optional<at::Tensor>& num_valid_tokens) {
    at::Tensor topk_weights, topk_ids;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      std::tie(topk_weights, topk_ids) = handle().call(
          gating_output, correction_bias, num_expert_group, topk_group, topk, renormalize,
          routed_scaling_factor, scoring_func, 0, 1.0, std::nullopt, expert_counts,
          routed_experts, num_valid_tokens);
    }
    bump_version_of_written(expert_counts);
    bump_version_of_written(routed_experts);
    ctx->mark_non_differentiable({topk_ids});
    ctx->save_for_backward({gating_output, topk_ids});
    ctx->saved_data["renormalize"] = renormalize;
    ctx->saved_data["routed_scaling_factor"] = routed_scaling_factor;
    ctx->saved_data["scoring_func"] = scoring_func;
    return {topk_weights, topk_ids};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    variable_list grads(11);
    if (!grad_outputs[0].defined()) return grads;
    const auto saved = ctx->get_saved_variables();
    grads[0] = routing_weights_backward(grad_outputs[0], saved[0], saved[1],
                                        ctx->saved_data["renormalize"].toBool(),
                                        ctx->saved_data["routed_scaling_factor"].toDouble(),
                                        ctx->saved_data["scoring_func"].toStringRef());
    return grads;
  }
};

std::tuple<at::Tensor, at::Tensor> biased_grouped_topk_autograd(
    c10::DispatchKeySet keys, const at::Tensor& gating_output,
    const std::optional<at::Tensor>& correction_bias, int64_t num_expert_group,
    int64_t topk_group, int64_t topk, bool renormalize, double routed_scaling_factor,
    c10::string_view scoring_func, int64_t num_fused_shared_experts, double shared_expert_weight,
    const std::optional<at::Tensor>& expert_map, const std::optional<at::Tensor>& expert_counts,
    const std::optional<at::Tensor>& routed_experts,
    const std::optional<at::Tensor>& num_valid_tokens) {
  const bool requires_grad =
      at::GradMode::is_enabled() &&
      (gating_output.requires_grad() ||
       (correction_bias.has_value() && correction_bias->requires_grad()));
  if (!requires_grad) {
    auto outputs = handle().redispatch(
        keys & c10::after_autograd_keyset, gating_output, correction_bias, num_expert_group,
        topk_group, topk, renormalize, routed_scaling_factor, scoring_func,
        num_fused_shared_experts, shared_expert_weight, expert_map, expert_counts,
        routed_experts, num_valid_tokens);
    // The options' buffers are written in place: their versions move, as a mutating op of
    // torch.library.custom_op's moves them (here rather than in an ADInplaceOrView kernel,
    // which every plain call would pass through).
    bump_version_of_written(expert_counts);
    bump_version_of_written(routed_experts);
    return outputs;
  }
  // The kernels refuse a negative count; checked here before anything is written.
  check_shared_experts(num_fused_shared_experts, "biased_grouped_topk");
  auto outputs = RoutingFunction::apply(gating_output, correction_bias, num_expert_group,
                                        topk_group, topk, renormalize, routed_scaling_factor,
                                        std::string(as_std(scoring_func)), expert_counts,
                                        routed_experts, num_valid_tokens);
  at::Tensor topk_weights = outputs[0], topk_ids = outputs[1];
  if (num_fused_shared_experts > 0) {
    const int64_t num_experts = gating_output.size(1);
    topk_weights = at::cat({topk_weights, at::full({topk_weights.size(0), num_fused_shared_experts},
                                                   shared_expert_weight, topk_weights.options())},
                           1);
    topk_ids = at::cat({topk_ids, at::arange(num_experts, num_experts + num_fused_shared_experts,
                                             topk_ids.options())
                                      .expand({topk_ids.size(0), num_fused_shared_experts})},
                       1);
  }
  if (expert_map.has_value()) {
    // The map's values, whatever they are (-1 included), at the logical ids.
    topk_ids = expert_map->index_select(0, topk_ids.reshape(-1)).view_as(topk_ids);
  }
  return {topk_weights, topk_ids};
}

// The out= form writes into its arguments and returns nothing, so autograd has nothing to
// attach a gradient to. Where one was wanted it raises, as torch's out= ops do. A bias that
// requires grad is let through: the weights' derivative in it is zero wherever it exists,
// which is what the functional form gives it too.
void biased_grouped_topk_out_autograd(
    c10::DispatchKeySet keys, const at::Tensor& gating_output,
    const std::optional<at::Tensor>& correction_bias, const at::Tensor& topk_weights,
    const at::Tensor& topk_ids, int64_t num_expert_group, int64_t topk_group, bool renormalize,
    double routed_scaling_factor, c10::string_view scoring_func,
    int64_t num_fused_shared_experts, double shared_expert_weight,
    const std::optional<at::Tensor>& expert_map, const std::optional<at::Tensor>& expert_counts,
    const std::optional<at::Tensor>& routed_experts,
    const std::optional<at::Tensor>& num_valid_tokens) {
  if (at::GradMode::is_enabled()) {
    TORCH_CHECK(!gating_output.requires_grad() && !topk_weights.requires_grad(),
                "biased_grouped_topk_out: ",
                gating_output.requires_grad() ? "gating_output" : "topk_weights",
                " requires grad, but the out= form records no gradient (call "
                "biased_grouped_topk for differentiable weights, or call this under "
                "torch.no_grad())");
  }
  out_handle().redispatch(keys & c10::after_autograd_keyset, gating_output, correction_bias,
                          topk_weights, topk_ids, num_expert_group, topk_group, renormalize,
                          routed_scaling_factor, scoring_func, num_fused_shared_experts,
                          shared_expert_weight, expert_map, expert_counts, routed_experts,
                          num_valid_tokens);
}

// ---- Direct calls ------------------------------------------------------------------------

const DirectCallRegistration kDirectCall{
    "call_biased_grouped_topk", &DirectCall<Signature>::call<&handle, RoutesMany>,
    "moeext.biased_grouped_topk's direct call of the op: all fourteen arguments "
    "positionally, of the plain Python types; returns NotImplemented for anything else."};
const DirectCallRegistration kDirectOutCall{
    "call_biased_grouped_topk_out", &DirectCall<OutSignature>::call<&out_handle, RoutesMany>,
    "moeext.biased_grouped_topk_out's direct call of the op: all fifteen arguments "
    "positionally, of the plain Python types; returns NotImplemented for anything else."};

}  // namespace

TORCH_LIBRARY_IMPL(moeext, CPU, m) {
  m.impl("biased_grouped_topk", &biased_grouped_topk<Cpu>);
  m.impl("biased_grouped_topk_out", &biased_grouped_topk_out<Cpu>);
}

#if defined(MOEEXT_GPU_BACKEND)
TORCH_LIBRARY_IMPL(moeext, CUDA, m) {
  m.impl("biased_grouped_topk", &biased_grouped_topk<Gpu>);
  m.impl("biased_grouped_topk_out", &biased_grouped_topk_out<Gpu>);
}
#endif

TORCH_LIBRARY_IMPL(moeext, Autograd, m) {
  m.impl("biased_grouped_topk", &biased_grouped_topk_autograd);
  m.impl("biased_grouped_topk_out", &biased_grouped_topk_out_autograd);
}

// What the out= form writes into its arguments: its outputs and the options' buffers.
TORCH_LIBRARY_IMPL(moeext, ADInplaceOrView, m) {
  m.impl("biased_grouped_topk_out",
         &AutogradKernels<OutSignature>::bump_written<&out_handle, 2, 3, 12, 13>);
}

}  // namespace moeext::torch_glue
