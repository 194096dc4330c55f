// biased_grouped_topk and its out= form (docs/SPEC.md section 1): checks, launcher params,
// the CPU and GPU implementations, autograd, and the direct calls of the Python wrappers.
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include "moeext/grouped_topk.h"
#include "torch/autograd_kernels.h"
#include "torch/binding.h"
#include "torch/check_messages.h"
#include "torch/direct_call.h"
#include "torch/memory_overlap.h"
#include "torch/parallel.h"

namespace moeext::torch_glue {
namespace {

// ---- Checks ------------------------------------------------------------------------------

const CheckMessage kLogitsRank{
    "routing.gating_output_rank",
    "{op}: gating_output must be 2-D [num_tokens, num_experts], got shape {shape}"};
const CheckMessage kExpertsFitInt32{"routing.num_experts_int32",
                                    "{op}: num_experts must fit int32 expert ids, got {num_experts}"};
const CheckMessage kGroupsPositive{"routing.num_expert_group_positive",
                                   "{op}: num_expert_group must be >= 1, got {num_expert_group}"};
const CheckMessage kGroupsDivide{
    "routing.num_expert_group_divides",
    "{op}: num_expert_group ({num_expert_group}) must divide the number of experts "
    "({num_experts})"};
const CheckMessage kTopkGroupRange{
    "routing.topk_group_range",
    "{op}: topk_group must be in [1, num_expert_group = {num_expert_group}], got {topk_group}"};
const CheckMessage kTopkPositive{"routing.topk_positive", "{op}: topk must be >= 1, got {topk}"};
const CheckMessage kTopkRange{
    "routing.topk_range",
    "{op}: topk ({topk}) exceeds the experts in the kept groups (topk_group {topk_group} x "
    "{per_group} per group)"};
const CheckMessage kBiasShape{"routing.bias_shape",
                              "{op}: correction_bias must have shape [{num_experts}], got {shape}"};
const CheckMessage kScoringFunc{
    "routing.scoring_func",
    "{op}: scoring_func must be 'sigmoid', 'sqrtsoftplus' or 'softmax', got '{scoring_func}'"};
const CheckMessage kOutputRank{"routing.output_rank",
                               "{op}: {arg} must be 2-D [num_tokens, topk], got {dim}-D"};
const CheckMessage kOutputDtype{"routing.output_dtype", "{op}: {arg} must be {expected}, got {dtype}"};
const CheckMessage kOutputShape{"routing.output_shape",
                                "{op}: {arg} must have shape [{num_tokens}, {topk}], got {shape}"};
const CheckMessages kMessages{&kLogitsRank,     &kExpertsFitInt32, &kGroupsPositive,
                              &kGroupsDivide,   &kTopkGroupRange,  &kTopkPositive,
                              &kTopkRange,      &kBiasShape,       &kScoringFunc,
                              &kOutputRank,     &kOutputDtype,     &kOutputShape};

ScoringFunc parse_scoring_func(std::string_view name, const char* op) {
  if (name == "sigmoid") return ScoringFunc::kSigmoid;
  if (name == "sqrtsoftplus") return ScoringFunc::kSqrtSoftplus;
  if (name == "softmax") return ScoringFunc::kSoftmax;
  TORCH_CHECK(false, kScoringFunc({{"op", op}, {"scoring_func", name}}));
}

// Everything but the outputs; returns the scoring function.
ScoringFunc check_inputs(const at::Tensor& gating_output,
                         const std::optional<at::Tensor>& correction_bias,
                         int64_t num_expert_group, int64_t topk_group, int64_t topk,
                         std::string_view scoring_func, const char* op) {
  TORCH_CHECK(gating_output.dim() == 2, kLogitsRank({{"op", op}, {"shape", gating_output.sizes()}}));
  to_moeext_dtype(gating_output, op, "gating_output");
  const int64_t num_experts = gating_output.size(1);
  TORCH_CHECK(num_experts <= std::numeric_limits<int32_t>::max(),
              kExpertsFitInt32({{"op", op}, {"num_experts", num_experts}}));
  TORCH_CHECK(num_expert_group >= 1,
              kGroupsPositive({{"op", op}, {"num_expert_group", num_expert_group}}));
  TORCH_CHECK(num_experts % num_expert_group == 0,
              kGroupsDivide({{"op", op}, {"num_expert_group", num_expert_group},
                             {"num_experts", num_experts}}));
  TORCH_CHECK(topk_group >= 1 && topk_group <= num_expert_group,
              kTopkGroupRange({{"op", op}, {"num_expert_group", num_expert_group},
                               {"topk_group", topk_group}}));
  const int64_t per_group = num_experts / num_expert_group;
  TORCH_CHECK(topk >= 1, kTopkPositive({{"op", op}, {"topk", topk}}));
  TORCH_CHECK(topk <= topk_group * per_group,
              kTopkRange({{"op", op}, {"topk", topk}, {"topk_group", topk_group},
                          {"per_group", per_group}}));
  if (correction_bias.has_value()) {
    const at::Tensor& bias = *correction_bias;
    TORCH_CHECK(bias.dim() == 1 && bias.size(0) == num_experts,
                kBiasShape({{"op", op}, {"num_experts", num_experts}, {"shape", bias.sizes()}}));
    to_moeext_dtype(bias, op, "correction_bias");
    check_same_device(bias, "correction_bias", gating_output, "gating_output", op);
  }
  return parse_scoring_func(scoring_func, op);
}

void check_output(const at::Tensor& out, const at::Tensor& gating_output, at::ScalarType dtype,
                  int64_t topk, const char* op, const char* arg) {
  TORCH_CHECK(out.dim() == 2, kOutputRank({{"op", op}, {"arg", arg}, {"dim", out.dim()}}));
  TORCH_CHECK(out.scalar_type() == dtype, kOutputDtype({{"op", op}, {"arg", arg},
                                                        {"expected", dtype},
                                                        {"dtype", out.scalar_type()}}));
  check_same_device(out, arg, gating_output, "gating_output", op);
  TORCH_CHECK(out.size(0) == gating_output.size(0) && out.size(1) == topk,
              kOutputShape({{"op", op}, {"arg", arg}, {"num_tokens", gating_output.size(0)},
                            {"topk", topk}, {"shape", out.sizes()}}));
  TORCH_CHECK(out.size(1) <= 1 || out.stride(1) == 1, op, ": ", arg,
              " must have contiguous columns (stride(1) == 1; rows may be strided), got strides ",
              out.strides());
}

// Launcher params from checked inputs and outputs (float32 / int32 [num_tokens, topk] with
// contiguous columns on gating_output's device).
BiasedGroupedTopkParams fill_params(const at::Tensor& gating_output,
                                    const std::optional<at::Tensor>& correction_bias,
                                    const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                                    int64_t num_expert_group, int64_t topk_group,
                                    bool renormalize, double routed_scaling_factor,
                                    ScoringFunc scoring) {
  constexpr const char* op = "biased_grouped_topk";  // dtypes were checked: cannot fail
  BiasedGroupedTopkParams p;
  p.scoring_func = scoring;
  p.gating_output = gating_output.data_ptr();
  p.gating_dtype = to_moeext_dtype(gating_output, op, "gating_output");
  p.gating_row_stride = gating_output.stride(0);
  p.gating_col_stride = gating_output.stride(1);
  if (correction_bias.has_value()) {
    p.correction_bias = correction_bias->data_ptr();
    p.bias_dtype = to_moeext_dtype(*correction_bias, op, "correction_bias");
    p.bias_stride = correction_bias->stride(0);
  }
  p.topk_weights = topk_weights.data_ptr<float>();
  p.weights_row_stride = topk_weights.stride(0);
  p.topk_ids = topk_ids.data_ptr<int32_t>();
  p.ids_row_stride = topk_ids.stride(0);
  p.num_tokens = gating_output.size(0);
  p.num_experts = gating_output.size(1);
  p.num_expert_group = num_expert_group;
  p.topk_group = topk_group;
  p.topk = topk_ids.size(1);
  p.renormalize = renormalize;
  p.routed_scaling_factor = static_cast<float>(routed_scaling_factor);
  return p;
}

int64_t element_size(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

// The out= form's outputs may not overlap the inputs or each other (their own rows included).
// Read from the filled params, so the common case (separate buffers) costs a few compares.
void check_outputs_apart(const BiasedGroupedTopkParams& p, const char* op) {
  const RowBytes weights =
      rows_of(p.topk_weights, p.num_tokens, p.weights_row_stride, p.topk, 1, 4);
  const RowBytes ids = rows_of(p.topk_ids, p.num_tokens, p.ids_row_stride, p.topk, 1, 4);
  const RowBytes logits = rows_of(p.gating_output, p.num_tokens, p.gating_row_stride,
                                  p.num_experts, p.gating_col_stride, element_size(p.gating_dtype));
  // The bias as one row per expert (a broadcast stride 0 is one element).
  const RowBytes bias = rows_of(p.correction_bias, p.correction_bias ? p.num_experts : 0,
                                p.bias_stride, 1, 1, element_size(p.bias_dtype));
  for (const auto& [out, name] : {std::pair{&weights, "topk_weights"}, {&ids, "topk_ids"}}) {
    TORCH_CHECK(!rows_overlap_each_other(*out), op, ": ", name,
                " has rows that share memory (row stride ", out->stride / 4, " < topk ", p.topk,
                "); every row needs its own");
  }
  const char* clash = rows_overlap(weights, ids)      ? "topk_weights and topk_ids"
                      : rows_overlap(weights, logits) ? "topk_weights and gating_output"
                      : rows_overlap(ids, logits)     ? "topk_ids and gating_output"
                      : rows_overlap(weights, bias)   ? "topk_weights and correction_bias"
                      : rows_overlap(ids, bias)       ? "topk_ids and correction_bias"
                                                      : nullptr;
  TORCH_CHECK(clash == nullptr, op, ": ", clash,
              " share memory; the outputs must not overlap the inputs or each other");
}

// ---- Launch, per device ------------------------------------------------------------------

void launch(Cpu, const BiasedGroupedTopkParams& p, const at::Tensor& /*gating_output*/,
            const char* /*op*/) {
  const int64_t grain = biased_grouped_topk_cpu_grain(p.num_experts);
  // One chunk runs here: parallel_for's set-up and thread-state guards cost a few percent of
  // a one-token call.
  if (p.num_tokens <= grain) {
    biased_grouped_topk_cpu(p, 0, p.num_tokens);
    return;
  }
  parallel_for(0, p.num_tokens, grain, [&](int64_t begin, int64_t end) {
    biased_grouped_topk_cpu(p, begin, end);
  });
}

#if defined(MOEEXT_GPU_BACKEND)
// On gating_output's device and current stream; the kernel's own limits are checked first.
void launch(Gpu, const BiasedGroupedTopkParams& p, const at::Tensor& gating_output,
            const char* op) {
  const char* limit = biased_grouped_topk_gpu_limit(p);
  TORCH_CHECK(limit == nullptr, limit);
  if (p.num_tokens == 0) return;
  const c10::DeviceGuard guard(gating_output.device());
  Gpu::check_launch(biased_grouped_topk_gpu(p, Gpu::stream(gating_output)), op);
}
#endif

// ---- The ops -----------------------------------------------------------------------------

template <typename Device>
std::tuple<at::Tensor, at::Tensor> biased_grouped_topk(
    const at::Tensor& gating_output, const std::optional<at::Tensor>& correction_bias,
    int64_t num_expert_group, int64_t topk_group, int64_t topk, bool renormalize,
    double routed_scaling_factor, c10::string_view scoring_func) {
  constexpr const char* op = "biased_grouped_topk";
  Device::check_device(gating_output, op, "gating_output");
  const ScoringFunc scoring = check_inputs(gating_output, correction_bias, num_expert_group,
                                           topk_group, topk, as_std(scoring_func), op);
  const int64_t num_tokens = gating_output.size(0);
  at::Tensor topk_weights = Device::empty({num_tokens, topk}, at::kFloat, gating_output);
  at::Tensor topk_ids = Device::empty({num_tokens, topk}, at::kInt, gating_output);
  // The outputs are ours and the inputs checked once above: no second validation.
  launch(Device{},
         fill_params(gating_output, correction_bias, topk_weights, topk_ids, num_expert_group,
                     topk_group, renormalize, routed_scaling_factor, scoring),
         gating_output, op);
  return {topk_weights, topk_ids};
}

template <typename Device>
void biased_grouped_topk_out(const at::Tensor& gating_output,
                             const std::optional<at::Tensor>& correction_bias,
                             const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                             int64_t num_expert_group, int64_t topk_group, bool renormalize,
                             double routed_scaling_factor, c10::string_view scoring_func) {
  constexpr const char* op = "biased_grouped_topk_out";
  Device::check_device(gating_output, op, "gating_output");
  TORCH_CHECK(topk_ids.dim() == 2,
              kOutputRank({{"op", op}, {"arg", "topk_ids"}, {"dim", topk_ids.dim()}}));
  const int64_t topk = topk_ids.size(1);
  const ScoringFunc scoring = check_inputs(gating_output, correction_bias, num_expert_group,
                                           topk_group, topk, as_std(scoring_func), op);
  check_output(topk_weights, gating_output, at::kFloat, topk, op, "topk_weights");
  check_output(topk_ids, gating_output, at::kInt, topk, op, "topk_ids");
  const BiasedGroupedTopkParams p =
      fill_params(gating_output, correction_bias, topk_weights, topk_ids, num_expert_group,
                  topk_group, renormalize, routed_scaling_factor, scoring);
  check_outputs_apart(p, op);
  launch(Device{}, p, gating_output, op);
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
// The weights are differentiable in the logits; the bias and the ids get no gradient (the
// bias only moves which experts are chosen, and the ids are integers). Where nothing requires
// grad the kernel is one unboxed redispatch, what autograd's boxed fallback would do at the
// cost of boxing all eight arguments.

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// d(score)/d(logit) of the chosen experts, times grad_scores; `x` is the chosen experts'
// logits in fp32 ([T, topk]) and `s` their scores (softmax, which needs the whole row, is the
// caller's). The formulas torch's autograd takes through moeext.reference: sigmoid_backward;
// sqrt's grad / (2 * result), then softplus_backward with threshold 20.
at::Tensor elementwise_score_backward(const at::Tensor& grad_scores, const at::Tensor& x,
                                      const at::Tensor& s, const std::string& scoring_func) {
  if (scoring_func == "sigmoid") return at::sigmoid_backward(grad_scores, s);
  return at::softplus_backward(grad_scores / (2 * s), x, 1.0, 20.0);
}

struct RoutingFunction : public torch::autograd::Function<RoutingFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& gating_output,
                               const std::optional<at::Tensor>& correction_bias,
                               int64_t num_expert_group, int64_t topk_group, int64_t topk,
                               bool renormalize, double routed_scaling_factor,
                               const std::string& scoring_func) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [topk_weights, topk_ids] =
        handle().call(gating_output, correction_bias, num_expert_group, topk_group, topk,
                      renormalize, routed_scaling_factor, scoring_func);
    ctx->mark_non_differentiable({topk_ids});
    ctx->save_for_backward({gating_output, topk_ids});
    ctx->saved_data["renormalize"] = renormalize;
    ctx->saved_data["routed_scaling_factor"] = routed_scaling_factor;
    ctx->saved_data["scoring_func"] = scoring_func;
    return {topk_weights, topk_ids};
  }

  // w = c * u / (sum(u) + 1e-20) with renormalize (w = c * u without), u the chosen scores
  // with NaN replaced by 0 (docs/SPEC.md section 1, steps 6 and 7).
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    variable_list grads(8);
    const at::Tensor& grad_weights = grad_outputs[0];
    if (!grad_weights.defined()) return grads;
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& gating_output = saved[0];
    const at::Tensor ids = saved[1].to(at::kLong);
    const bool renormalize = ctx->saved_data["renormalize"].toBool();
    const double scale = ctx->saved_data["routed_scaling_factor"].toDouble();
    const std::string scoring_func = ctx->saved_data["scoring_func"].toStringRef();

    const at::Tensor logits = gating_output.to(at::kFloat);
    const at::Tensor g = grad_weights.to(at::kFloat);
    at::Tensor scores = scoring_func == "softmax" ? at::softmax(logits, -1) : at::Tensor();
    const at::Tensor x = logits.gather(1, ids);
    const at::Tensor s = scores.defined()            ? scores.gather(1, ids)
                         : scoring_func == "sigmoid" ? at::sigmoid(x)
                                                     : at::sqrt(at::softplus(x, 1.0, 20.0));
    const at::Tensor is_nan = at::isnan(s);
    const at::Tensor u = at::where(is_nan, at::zeros_like(s), s);
    at::Tensor grad_u;
    if (renormalize) {
      const at::Tensor denom = u.sum(-1, true) + 1e-20;
      grad_u = scale * (g - (g * u).sum(-1, true) / denom) / denom;
    } else {
      grad_u = scale * g;
    }
    const at::Tensor grad_s = at::where(is_nan, at::zeros_like(grad_u), grad_u);

    at::Tensor grad_logits;
    if (scores.defined()) {
      const at::Tensor grad_all = at::zeros_like(scores).scatter(1, ids, grad_s);
      grad_logits = scores * (grad_all - (grad_all * scores).sum(-1, true));
    } else {
      grad_logits = at::zeros_like(logits).scatter(
          1, ids, elementwise_score_backward(grad_s, x, s, scoring_func));
    }
    grads[0] = grad_logits.to(gating_output.scalar_type());
    return grads;
  }
};

std::tuple<at::Tensor, at::Tensor> biased_grouped_topk_autograd(
    c10::DispatchKeySet keys, const at::Tensor& gating_output,
    const std::optional<at::Tensor>& correction_bias, int64_t num_expert_group,
    int64_t topk_group, int64_t topk, bool renormalize, double routed_scaling_factor,
    c10::string_view scoring_func) {
  const bool requires_grad =
      at::GradMode::is_enabled() &&
      (gating_output.requires_grad() ||
       (correction_bias.has_value() && correction_bias->requires_grad()));
  if (!requires_grad) {
    return handle().redispatch(keys & c10::after_autograd_keyset, gating_output, correction_bias,
                               num_expert_group, topk_group, topk, renormalize,
                               routed_scaling_factor, scoring_func);
  }
  auto outputs = RoutingFunction::apply(gating_output, correction_bias, num_expert_group,
                                        topk_group, topk, renormalize, routed_scaling_factor,
                                        std::string(as_std(scoring_func)));
  return {outputs[0], outputs[1]};
}

// The out= form writes into its arguments and returns nothing, so autograd has nothing to
// attach a gradient to. Where one was wanted it raises, as torch's out= ops do. A bias that
// requires grad is let through: the weights' derivative in it is zero wherever it exists,
// which is what the functional form gives it too.
void biased_grouped_topk_out_autograd(
    c10::DispatchKeySet keys, const at::Tensor& gating_output,
    const std::optional<at::Tensor>& correction_bias, const at::Tensor& topk_weights,
    const at::Tensor& topk_ids, int64_t num_expert_group, int64_t topk_group, bool renormalize,
    double routed_scaling_factor, c10::string_view scoring_func) {
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
                          routed_scaling_factor, scoring_func);
}

// ---- Direct calls ------------------------------------------------------------------------

// 16k logits take long enough (several us) to let another Python thread run meanwhile.
struct RoutesMany {
  template <typename... Rest>
  static bool test(const at::Tensor& gating_output, const Rest&...) {
    return gating_output.numel() >= 16384;
  }
};

const DirectCallRegistration kDirectCall{
    "call_biased_grouped_topk", &DirectCall<Signature>::call<&handle, RoutesMany>,
    "moeext.biased_grouped_topk's direct call of the op: all eight arguments positionally, "
    "of the plain Python types; returns NotImplemented for anything else."};
const DirectCallRegistration kDirectOutCall{
    "call_biased_grouped_topk_out", &DirectCall<OutSignature>::call<&out_handle, RoutesMany>,
    "moeext.biased_grouped_topk_out's direct call of the op: all nine arguments positionally, "
    "of the plain Python types; returns NotImplemented for anything else."};

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

TORCH_LIBRARY_IMPL(moeext, ADInplaceOrView, m) {
  m.impl("biased_grouped_topk_out",
         &AutogradKernels<OutSignature>::bump_written<&out_handle, 2, 3>);
}

}  // namespace moeext::torch_glue
