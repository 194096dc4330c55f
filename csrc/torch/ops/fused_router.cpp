// fused_router (docs/SPEC.md section 7): the router GEMM and the routing in one call, the
// logits kept inside it unless asked for. The CPU and GPU implementations, autograd, and the
// direct call of the Python wrapper; the checks are the two ops' own (router_gemm_common.h,
// routing_common.h).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/InferenceMode.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

#include "moeext/fused_router.h"
#include "torch/autograd_kernels.h"
#include "torch/binding.h"
#include "torch/direct_call.h"
#include "torch/memory_overlap.h"
#include "torch/router_gemm_common.h"
#include "torch/routing_common.h"

namespace moeext::torch_glue {
namespace {

// ---- Launch, per device ------------------------------------------------------------------

// The two kernels one after the other, the logits in between never leaving the call. The
// GEMM splits the experts over the threads, so a token's logits are complete only once every
// thread is done: the routing starts after the last.
void launch(Cpu, const FusedRouterParams& p, const at::Tensor& hidden_states,
            const at::Tensor& weight, at::Tensor& logits, const char* op) {
  if (p.gemm.num_tokens == 0) return;
  run_router_gemm(Cpu{}, p.gemm, hidden_states, weight, logits, op);
  run_routing(Cpu{}, p.routing, logits, op);
}

#if defined(MOEEXT_GPU_BACKEND)
// The two kernels router_gemm and biased_grouped_topk run, one after the other on the
// stream; decode sizes as one kernel while the fused router variant asks for it
// (fused_router_gpu_takes).
void launch(Gpu, const FusedRouterParams& p, const at::Tensor& hidden_states,
            const at::Tensor& weight, at::Tensor& logits, const char* op) {
  const char* limit = biased_grouped_topk_gpu_limit(p.routing);
  TORCH_CHECK(limit == nullptr, limit);
  if (p.gemm.num_tokens == 0) return;
  const c10::DeviceGuard guard(hidden_states.device());
  void* stream = Gpu::stream(hidden_states);
  if (fused_router_gpu_takes(p)) {
    FusedRouterParams one_launch = p;
    one_launch.completion_counter = fused_router_gpu_counter(stream);
    if (one_launch.completion_counter != nullptr) {
      Gpu::check_launch(fused_router_gpu(one_launch, stream), op);
      return;
    }
  }
  run_router_gemm(Gpu{}, p.gemm, hidden_states, weight, logits, op);
  run_routing(Gpu{}, p.routing, logits, op);
}
#endif

// ---- The logits the call routes ----------------------------------------------------------

// Returned ones are a tensor of their own. Those kept inside a CPU call sit, at decode sizes,
// in a tensor of the calling thread that each call reshapes: no allocation and no tensor made
// a call. It never leaves the call.
at::Tensor routed_logits(Cpu, int64_t num_tokens, int64_t num_experts, bool returned,
                         const at::Tensor& like) {
  constexpr int64_t kReused = 16 * 1024;  // floats: 64 KiB a thread, 16 tokens of 1024 experts
  if (returned || num_tokens * num_experts > kReused) {
    return Cpu::empty({num_tokens, num_experts}, at::kFloat, like);
  }
  thread_local const at::Tensor buffer = Cpu::empty({kReused}, at::kFloat, like);
  buffer.unsafeGetTensorImpl()->set_sizes_contiguous({num_tokens, num_experts});
  return buffer;
}

#if defined(MOEEXT_GPU_BACKEND)
at::Tensor routed_logits(Gpu, int64_t num_tokens, int64_t num_experts, bool /*returned*/,
                         const at::Tensor& like) {
  return Gpu::empty({num_tokens, num_experts}, at::kFloat, like);
}
#endif

// The op's third result without return_logits: an empty [0, E] tensor. A CPU thread keeps the
// last one it made and returns it again while nothing else holds it and it is as made (the
// direct call drops it at once); one held or changed is left to its holder.
at::Tensor unreturned_logits(Cpu, int64_t num_experts, const at::Tensor& like) {
  thread_local at::Tensor kept;
  const bool inference = c10::InferenceMode::is_enabled();
  const bool reusable = kept.defined() && kept.use_count() == 1 && kept.dim() == 2 &&
                        kept.size(0) == 0 && kept.size(1) == num_experts &&
                        kept.is_contiguous() && !kept.requires_grad() &&
                        kept.is_inference() == inference;
  if (!reusable) kept = Cpu::empty({0, num_experts}, at::kFloat, like);
  return kept;
}

#if defined(MOEEXT_GPU_BACKEND)
at::Tensor unreturned_logits(Gpu, int64_t num_experts, const at::Tensor& like) {
  return Gpu::empty({0, num_experts}, at::kFloat, like);
}
#endif

// ---- The op ------------------------------------------------------------------------------

// The bytes a GEMM input covers: exact rows for a matrix, first to last byte for a prepacked
// weight.
RowBytes covered(const at::Tensor& t) {
  if (t.dim() == 2) {
    return rows_of(t.data_ptr(), t.size(0), t.stride(0), t.size(1), t.stride(1), t.itemsize());
  }
  int64_t span = t.numel() > 0 ? 1 : 0;
  for (int64_t d = 0; d < t.dim() && span > 0; ++d) span += (t.size(d) - 1) * t.stride(d);
  return rows_of(t.data_ptr(), 1, 0, span, 1, t.itemsize());
}

// The out= form's outputs against what its GEMM reads; against the routing's reads, the
// options and each other, check_writes_apart.
void check_outputs_apart_from_gemm(const BiasedGroupedTopkParams& p,
                                   const at::Tensor& hidden_states, const at::Tensor& weight,
                                   const char* op) {
  const int64_t columns = p.topk + p.options.num_shared_experts;
  const RowBytes weights =
      rows_of(p.topk_weights, p.num_tokens, p.weights_row_stride, columns, 1, 4);
  const RowBytes ids = rows_of(p.topk_ids, p.num_tokens, p.ids_row_stride, columns, 1, 4);
  const RowBytes hidden = covered(hidden_states);
  const RowBytes gate = covered(weight);
  const char* clash = rows_overlap(weights, hidden) ? "topk_weights and hidden_states"
                      : rows_overlap(ids, hidden)   ? "topk_ids and hidden_states"
                      : rows_overlap(weights, gate) ? "topk_weights and weight"
                      : rows_overlap(ids, gate)     ? "topk_ids and weight"
                                                    : nullptr;
  TORCH_CHECK(clash == nullptr, op, ": ", clash,
              " share memory; what the call writes must be apart from what it reads");
}

// Both forms' last step, once everything is checked and p.routing filled: the GEMM's params
// from inputs whose rows are made contiguous where they are not, and the launch.
template <typename Device>
void run_checked(FusedRouterParams& p, const at::Tensor& hidden_states, const at::Tensor& weight,
                 at::Tensor& logits, const char* op) {
  const at::Tensor hidden = with_contiguous_rows(hidden_states);
  const at::Tensor gate = is_prepacked(weight) ? weight : with_contiguous_rows(weight);
  p.gemm = fill_router_gemm_params(hidden, gate, logits);
  launch(Device{}, p, hidden, gate, logits, op);
}

template <typename Device>
std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_router(
    const at::Tensor& hidden_states, const at::Tensor& weight,
    const std::optional<at::Tensor>& correction_bias, int64_t num_expert_group,
    int64_t topk_group, int64_t topk, bool renormalize, double routed_scaling_factor,
    c10::string_view scoring_func, int64_t num_fused_shared_experts, double shared_expert_weight,
    const std::optional<at::Tensor>& expert_map, const std::optional<at::Tensor>& expert_counts,
    const std::optional<at::Tensor>& routed_experts,
    const std::optional<at::Tensor>& num_valid_tokens, bool return_logits) {
  constexpr const char* op = "fused_router";
  Device::check_device(hidden_states, op, "hidden_states");
  check_weight_layout<Device>(hidden_states, weight, op);
  check_router_gemm(hidden_states, weight, std::nullopt, op);
  const int64_t num_tokens = hidden_states.size(0);
  // The logits the routing reads: router_gemm's fp32 ones, bit for bit.
  at::Tensor logits = routed_logits(Device{}, num_tokens, num_experts_of(weight), return_logits,
                                    hidden_states);
  const ScoringFunc scoring =
      check_routing(logits, correction_bias, num_expert_group, topk_group, topk,
                    as_std(scoring_func), op, "hidden_states");
  const OptionArgs options{num_fused_shared_experts, shared_expert_weight, expert_map,
                           expert_counts, routed_experts, num_valid_tokens};
  const bool any_option = options.any();
  if (any_option) check_shared_experts(num_fused_shared_experts, op);
  const int64_t columns = topk + num_fused_shared_experts;
  at::Tensor topk_weights = Device::empty({num_tokens, columns}, at::kFloat, hidden_states);
  at::Tensor topk_ids = Device::empty({num_tokens, columns}, at::kInt, hidden_states);
  FusedRouterParams p;
  p.routing = fill_routing_params(logits, correction_bias, topk_weights, topk_ids,
                                  num_expert_group, topk_group, topk, renormalize,
                                  routed_scaling_factor, scoring);
  if (any_option) {
    p.routing.options = check_options(options, logits, topk, op, "hidden_states");
    check_writes_apart(p.routing, /*outputs=*/false, op);
  }
  run_checked<Device>(p, hidden_states, weight, logits, op);
  if (!return_logits) logits = unreturned_logits(Device{}, logits.size(1), hidden_states);
  return {topk_weights, topk_ids, logits};
}

// The out= form: the routing written into the caller's buffers (any row stride), the logits
// kept inside. At decode sizes the two outputs' tensors, and their Python objects, are most
// of what the allocating form costs beyond the GEMM on the CPU.
template <typename Device>
void fused_router_out(
    const at::Tensor& hidden_states, const at::Tensor& weight,
    const std::optional<at::Tensor>& correction_bias, const at::Tensor& topk_weights,
    const at::Tensor& topk_ids, int64_t num_expert_group, int64_t topk_group, bool renormalize,
    double routed_scaling_factor, c10::string_view scoring_func,
    int64_t num_fused_shared_experts, double shared_expert_weight,
    const std::optional<at::Tensor>& expert_map, const std::optional<at::Tensor>& expert_counts,
    const std::optional<at::Tensor>& routed_experts,
    const std::optional<at::Tensor>& num_valid_tokens) {
  constexpr const char* op = "fused_router_out";
  Device::check_device(hidden_states, op, "hidden_states");
  check_weight_layout<Device>(hidden_states, weight, op);
  check_router_gemm(hidden_states, weight, std::nullopt, op);
  const int64_t topk = check_out_columns(topk_ids, num_fused_shared_experts, op);
  const int64_t columns = topk_ids.size(1);
  const int64_t num_tokens = hidden_states.size(0);
  at::Tensor logits = routed_logits(Device{}, num_tokens, num_experts_of(weight),
                                    /*returned=*/false, hidden_states);
  const ScoringFunc scoring =
      check_routing(logits, correction_bias, num_expert_group, topk_group, topk,
                    as_std(scoring_func), op, "hidden_states");
  check_output(topk_weights, logits, at::kFloat, columns, op, "topk_weights", "hidden_states");
  check_output(topk_ids, logits, at::kInt, columns, op, "topk_ids", "hidden_states");
  FusedRouterParams p;
  p.routing = fill_routing_params(logits, correction_bias, topk_weights, topk_ids,
                                  num_expert_group, topk_group, topk, renormalize,
                                  routed_scaling_factor, scoring);
  const OptionArgs options{num_fused_shared_experts, shared_expert_weight, expert_map,
                           expert_counts, routed_experts, num_valid_tokens};
  if (options.any()) p.routing.options = check_options(options, logits, topk, op, "hidden_states");
  check_writes_apart(p.routing, /*outputs=*/true, op);
  check_outputs_apart_from_gemm(p.routing, hidden_states, weight, op);
  run_checked<Device>(p, hidden_states, weight, logits, op);
}

using Signature = decltype(fused_router<Cpu>);
using OutSignature = decltype(fused_router_out<Cpu>);

const c10::TypedOperatorHandle<Signature>& handle() {
  static const auto h = typed_op<Signature>("moeext::fused_router");
  return h;
}

const c10::TypedOperatorHandle<OutSignature>& out_handle() {
  static const auto h = typed_op<OutSignature>("moeext::fused_router_out");
  return h;
}

// ---- Autograd ----------------------------------------------------------------------------
// Where an input requires grad, the call is the two ops it fuses, through the dispatcher, so
// that each records its own gradient (the weights' to the logits, the logits' to the hidden
// states and the weight); the result is the same bits.

c10::IValue optional_tensor(const std::optional<at::Tensor>& t) {
  return t.has_value() ? c10::IValue(*t) : c10::IValue();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_router_autograd(
    c10::DispatchKeySet keys, const at::Tensor& hidden_states, const at::Tensor& weight,
    const std::optional<at::Tensor>& correction_bias, int64_t num_expert_group,
    int64_t topk_group, int64_t topk, bool renormalize, double routed_scaling_factor,
    c10::string_view scoring_func, int64_t num_fused_shared_experts, double shared_expert_weight,
    const std::optional<at::Tensor>& expert_map, const std::optional<at::Tensor>& expert_counts,
    const std::optional<at::Tensor>& routed_experts,
    const std::optional<at::Tensor>& num_valid_tokens, bool return_logits) {
  const bool requires_grad =
      at::GradMode::is_enabled() && (hidden_states.requires_grad() || weight.requires_grad());
  if (!requires_grad) {
    auto outputs = handle().redispatch(
        keys & c10::after_autograd_keyset, hidden_states, weight, correction_bias,
        num_expert_group, topk_group, topk, renormalize, routed_scaling_factor, scoring_func,
        num_fused_shared_experts, shared_expert_weight, expert_map, expert_counts,
        routed_experts, num_valid_tokens, return_logits);
    // The options' buffers are written in place: their versions move (see
    // biased_grouped_topk's Autograd kernel).
    bump_version_of_written(expert_counts);
    bump_version_of_written(routed_experts);
    return outputs;
  }
  static const c10::OperatorHandle router_gemm =
      c10::Dispatcher::singleton().findSchemaOrThrow("moeext::router_gemm", "");
  static const c10::OperatorHandle routing =
      c10::Dispatcher::singleton().findSchemaOrThrow("moeext::biased_grouped_topk", "");
  torch::jit::Stack stack{hidden_states, weight, c10::IValue()};
  router_gemm.callBoxed(stack);
  const at::Tensor logits = stack[0].toTensor();
  stack = {logits,
           optional_tensor(correction_bias),
           num_expert_group,
           topk_group,
           topk,
           renormalize,
           routed_scaling_factor,
           std::string(as_std(scoring_func)),
           num_fused_shared_experts,
           shared_expert_weight,
           optional_tensor(expert_map),
           optional_tensor(expert_counts),
           optional_tensor(routed_experts),
           optional_tensor(num_valid_tokens)};
  routing.callBoxed(stack);
  const at::Tensor returned_logits =
      return_logits ? logits : at::empty({0, logits.size(1)}, logits.options());
  return {stack[0].toTensor(), stack[1].toTensor(), returned_logits};
}

// The out= form records no gradient: where one was wanted it raises before anything is
// written, as torch's out= ops do (and as biased_grouped_topk_out does).
void fused_router_out_autograd(
    c10::DispatchKeySet keys, const at::Tensor& hidden_states, const at::Tensor& weight,
    const std::optional<at::Tensor>& correction_bias, const at::Tensor& topk_weights,
    const at::Tensor& topk_ids, int64_t num_expert_group, int64_t topk_group, bool renormalize,
    double routed_scaling_factor, c10::string_view scoring_func,
    int64_t num_fused_shared_experts, double shared_expert_weight,
    const std::optional<at::Tensor>& expert_map, const std::optional<at::Tensor>& expert_counts,
    const std::optional<at::Tensor>& routed_experts,
    const std::optional<at::Tensor>& num_valid_tokens) {
  if (at::GradMode::is_enabled()) {
    const char* wanted = hidden_states.requires_grad() ? "hidden_states"
                         : weight.requires_grad()      ? "weight"
                         : topk_weights.requires_grad() ? "topk_weights"
                                                        : nullptr;
    TORCH_CHECK(wanted == nullptr, "fused_router_out: ", wanted,
                " requires grad, but the out= form records no gradient (call fused_router "
                "for differentiable weights, or call this under torch.no_grad())");
  }
  out_handle().redispatch(keys & c10::after_autograd_keyset, hidden_states, weight,
                          correction_bias, topk_weights, topk_ids, num_expert_group, topk_group,
                          renormalize, routed_scaling_factor, scoring_func,
                          num_fused_shared_experts, shared_expert_weight, expert_map,
                          expert_counts, routed_experts, num_valid_tokens);
}

// ---- Direct call -------------------------------------------------------------------------

// The op's three results as the wrapper returns them: the logits None unless asked for.
PyObject* fused_router_to_python(const std::tuple<at::Tensor, at::Tensor, at::Tensor>& out,
                                 PyObject* const* args, Py_ssize_t nargs) {
  constexpr Py_ssize_t kReturnLogits = 15;
  const bool returned = nargs > kReturnLogits && args[kReturnLogits] == Py_True;
  return returned ? to_python(out) : to_python_first_two(out);
}

PyObject* call_fused_router(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  return DirectCall<Signature>::call<&handle, RouterGemmComputesMuch, &fused_router_to_python>(
      self, args, nargs);
}

const DirectCallRegistration kDirectCall{
    "call_fused_router", &call_fused_router,
    "moeext.fused_router's direct call of the op: all sixteen arguments positionally, of the "
    "plain Python types; returns (topk_weights, topk_ids, logits or None), or NotImplemented "
    "for anything else."};

const DirectCallRegistration kDirectOutCall{
    "call_fused_router_out", &DirectCall<OutSignature>::call<&out_handle, RouterGemmComputesMuch>,
    "moeext.fused_router_out's direct call of the op: all sixteen arguments positionally, of "
    "the plain Python types; returns None, or NotImplemented for anything else."};

}  // namespace

TORCH_LIBRARY_IMPL(moeext, CPU, m) {
  m.impl("fused_router", &fused_router<Cpu>);
  m.impl("fused_router_out", &fused_router_out<Cpu>);
}

#if defined(MOEEXT_GPU_BACKEND)
TORCH_LIBRARY_IMPL(moeext, CUDA, m) {
  m.impl("fused_router", &fused_router<Gpu>);
  m.impl("fused_router_out", &fused_router_out<Gpu>);
}
#endif

TORCH_LIBRARY_IMPL(moeext, Autograd, m) {
  m.impl("fused_router", &fused_router_autograd);
  m.impl("fused_router_out", &fused_router_out_autograd);
}

// What the out= form writes into its arguments: its outputs and the options' buffers.
TORCH_LIBRARY_IMPL(moeext, ADInplaceOrView, m) {
  m.impl("fused_router_out",
         &AutogradKernels<OutSignature>::bump_written<&out_handle, 3, 4, 13, 14>);
}

}  // namespace moeext::torch_glue
