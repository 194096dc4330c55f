// routing_weights (docs/SPEC.md section 6.6): checks, launcher params, the CPU and GPU
// implementations, autograd, and the direct call of the Python wrapper.
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "moeext/grouped_topk.h"
#include "torch/binding.h"
#include "torch/check_messages.h"
#include "torch/direct_call.h"
#include "torch/parallel.h"
#include "torch/routing_backward.h"
#include "torch/routing_common.h"

namespace moeext::torch_glue {
namespace {

// ---- Checks ------------------------------------------------------------------------------

const CheckMessage kIds{
    "routing_weights.ids",
    "{op}: topk_ids must be int16, int32 or int64 of shape [{num_tokens}, k], got {dtype} of "
    "shape {shape}"};
const CheckMessages kMessages{&kIds};

IntType ids_dtype(const at::Tensor& ids) {
  switch (ids.scalar_type()) {
    case at::kShort:
      return IntType::kInt16;
    case at::kInt:
      return IntType::kInt32;
    default:
      return IntType::kInt64;
  }
}

RoutingWeightsParams check_and_fill(const at::Tensor& gating_output, const at::Tensor& topk_ids,
                                    const at::Tensor& topk_weights, bool renormalize,
                                    double routed_scaling_factor, std::string_view scoring_func,
                                    const char* op) {
  check_logits(gating_output, op);
  RoutingWeightsParams p;
  p.gating_dtype = to_moeext_dtype(gating_output, op, "gating_output");
  const at::ScalarType t = topk_ids.scalar_type();
  TORCH_CHECK((t == at::kShort || t == at::kInt || t == at::kLong) && topk_ids.dim() == 2 &&
                  topk_ids.size(0) == gating_output.size(0),
              kIds({{"op", op}, {"num_tokens", gating_output.size(0)}, {"dtype", t},
                    {"shape", topk_ids.sizes()}}));
  check_same_device(topk_ids, "topk_ids", gating_output, "gating_output", op);
  p.scoring_func = parse_scoring_func(scoring_func, op);
  p.gating_output = gating_output.data_ptr();
  p.gating_row_stride = gating_output.stride(0);
  p.gating_col_stride = gating_output.stride(1);
  p.topk_ids = topk_ids.data_ptr();
  p.ids_dtype = ids_dtype(topk_ids);
  p.ids_row_stride = topk_ids.stride(0);
  p.ids_col_stride = topk_ids.stride(1);
  p.topk_weights = topk_weights.data_ptr<float>();
  p.weights_row_stride = topk_weights.stride(0);
  p.num_tokens = gating_output.size(0);
  p.num_experts = gating_output.size(1);
  p.k = topk_ids.size(1);
  p.renormalize = renormalize;
  p.routed_scaling_factor = static_cast<float>(routed_scaling_factor);
  return p;
}

// ---- Launch, per device ------------------------------------------------------------------

int64_t id_at(const at::Tensor& ids, int64_t t, int64_t j) { return ids[t][j].item<int64_t>(); }

// Every row is checked before any is written.
void launch(Cpu, const RoutingWeightsParams& p, const at::Tensor& topk_ids, const char* op) {
  // About k^2 compares a row: rows of 8 ids need thousands of rows to pay for a thread.
  const int64_t grain = 4096;
  std::atomic<int64_t> first_invalid{-1};
  parallel_for(0, p.num_tokens, grain, [&](int64_t begin, int64_t end) {
    const int64_t row = routing_weights_cpu_invalid_row(p, begin, end);
    int64_t seen = first_invalid.load();
    while (row >= 0 && (seen < 0 || row < seen) &&
           !first_invalid.compare_exchange_weak(seen, row)) {
    }
  });
  const int64_t row = first_invalid.load();
  if (row >= 0) {
    for (int64_t j = 0; j < p.k; ++j) {
      const int64_t id = id_at(topk_ids, row, j);
      TORCH_CHECK(id >= 0 && id < p.num_experts, op, ": topk_ids[", row, "] holds ", id,
                  ", outside [0, ", p.num_experts, ") (the experts of gating_output)");
      for (int64_t i = 0; i < j; ++i) {
        TORCH_CHECK(id_at(topk_ids, row, i) != id, op, ": topk_ids[", row, "] holds ", id,
                    " twice; a row's experts are distinct");
      }
    }
    TORCH_INTERNAL_ASSERT(false, "routing_weights: row ", row, " was reported invalid");
  }
  parallel_for(0, p.num_tokens, biased_grouped_topk_cpu_grain(p.num_experts),
               [&](int64_t begin, int64_t end) { routing_weights_cpu(p, begin, end); });
}

#if defined(MOEEXT_GPU_BACKEND)
void launch(Gpu, const RoutingWeightsParams& p, const at::Tensor& topk_ids, const char* op) {
  const char* limit = routing_weights_gpu_limit(p);
  TORCH_CHECK(limit == nullptr, limit);
  if (p.num_tokens == 0 || p.k == 0) return;
  const c10::DeviceGuard guard(topk_ids.device());
  Gpu::check_launch(routing_weights_gpu(p, Gpu::stream(topk_ids)), op);
}
#endif

// ---- The op ------------------------------------------------------------------------------

template <typename Device>
at::Tensor routing_weights(const at::Tensor& gating_output, const at::Tensor& topk_ids,
                           bool renormalize, double routed_scaling_factor,
                           c10::string_view scoring_func) {
  constexpr const char* op = "routing_weights";
  Device::check_device(gating_output, op, "gating_output");
  // Checked before the output exists: its shape comes from topk_ids.
  const bool ids_2d = topk_ids.dim() == 2;
  at::Tensor topk_weights = Device::empty(
      {ids_2d ? topk_ids.size(0) : 0, ids_2d ? topk_ids.size(1) : 0}, at::kFloat, gating_output);
  const RoutingWeightsParams p = check_and_fill(gating_output, topk_ids, topk_weights, renormalize,
                                                routed_scaling_factor, as_std(scoring_func), op);
  launch(Device{}, p, topk_ids, op);
  return topk_weights;
}

using Signature = decltype(routing_weights<Cpu>);

const c10::TypedOperatorHandle<Signature>& handle() {
  static const auto h = typed_op<Signature>("moeext::routing_weights");
  return h;
}

// ---- Autograd ----------------------------------------------------------------------------
// The weights are differentiable in the logits, as biased_grouped_topk's are; the ids get no
// gradient.

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct RoutingWeightsFunction : public torch::autograd::Function<RoutingWeightsFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& gating_output,
                               const at::Tensor& topk_ids, bool renormalize,
                               double routed_scaling_factor, const std::string& scoring_func) {
    at::AutoDispatchBelowADInplaceOrView guard;
    at::Tensor weights =
        handle().call(gating_output, topk_ids, renormalize, routed_scaling_factor, scoring_func);
    ctx->save_for_backward({gating_output, topk_ids});
    ctx->saved_data["renormalize"] = renormalize;
    ctx->saved_data["routed_scaling_factor"] = routed_scaling_factor;
    ctx->saved_data["scoring_func"] = scoring_func;
    return {weights};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    variable_list grads(5);
    if (!grad_outputs[0].defined()) return grads;
    const auto saved = ctx->get_saved_variables();
    grads[0] = routing_weights_backward(grad_outputs[0], saved[0], saved[1],
                                        ctx->saved_data["renormalize"].toBool(),
                                        ctx->saved_data["routed_scaling_factor"].toDouble(),
                                        ctx->saved_data["scoring_func"].toStringRef());
    return grads;
  }
};

at::Tensor routing_weights_autograd(c10::DispatchKeySet keys, const at::Tensor& gating_output,
                                    const at::Tensor& topk_ids, bool renormalize,
                                    double routed_scaling_factor,
                                    c10::string_view scoring_func) {
  if (!at::GradMode::is_enabled() || !gating_output.requires_grad()) {
    return handle().redispatch(keys & c10::after_autograd_keyset, gating_output, topk_ids,
                               renormalize, routed_scaling_factor, scoring_func);
  }
  return RoutingWeightsFunction::apply(gating_output, topk_ids, renormalize,
                                       routed_scaling_factor,
                                       std::string(as_std(scoring_func)))[0];
}

// ---- Direct call -------------------------------------------------------------------------

const DirectCallRegistration kDirectCall{
    "call_routing_weights", &DirectCall<Signature>::call<&handle, RoutesMany>,
    "moeext.routing_weights's direct call of the op: all five arguments positionally, of the "
    "plain Python types; returns NotImplemented for anything else."};

}  // namespace

TORCH_LIBRARY_IMPL(moeext, CPU, m) {
  m.impl("routing_weights", &routing_weights<Cpu>);
}

#if defined(MOEEXT_GPU_BACKEND)
TORCH_LIBRARY_IMPL(moeext, CUDA, m) {
  m.impl("routing_weights", &routing_weights<Gpu>);
}
#endif

TORCH_LIBRARY_IMPL(moeext, Autograd, m) {
  m.impl("routing_weights", &routing_weights_autograd);
}

}  // namespace moeext::torch_glue
