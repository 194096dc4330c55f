// Autograd and ADInplaceOrView kernels of moeext's ops (every backend: the backward is ATen
// arithmetic).
//
// Autograd, routing op. Without it each call took autograd's boxed fallback, which packs all
// eight arguments into IValues (the scoring function as a freshly allocated string) only to
// find that nothing requires grad: 0.15 us of the 0.9 us a call with no rows costs. Here that
// case is one unboxed redispatch, exactly what the fallback then does. Where an input requires
// grad the weights get a real gradient with respect to the logits (the fallback gave none and
// warned). The bias and the ids get none: the bias only moves which experts are chosen, and
// the ids are integers.
//
// Autograd, router GEMM. The fallback gave hidden states and weight no gradient and warned
// only when the backward ran, so a gate trained through moeext.nn.GroupedTopKRouter silently
// kept its weight. Now both get the GEMM's gradient.
//
// Autograd, shuffles. A weight shuffle moves elements, so its gradient is the inverse move;
// E8M0 scale codes are exponents and, like integers, carry none (see their kernels). Both
// replace the fallback, which made the outputs require grad and then warned and gave nothing.
//
// Autograd, zeroing ops. Without a kernel they took the boxed fallback, which wrote the zeros
// into a tensor of the graph and left its history alone: a backward through the zeroed rows
// passed the gradient on as if nothing had been written (torch's zero_ gives those rows a zero
// gradient). Now, where buf requires grad, zero_tail_ records the write as torch records an
// in-place op, and refuses a leaf (or a view of one) that requires grad before writing, as
// torch's in-place ops do; zero_tail_tracked_ refuses every such buf (see its kernel).
//
// ADInplaceOrView, every op that writes into its arguments (the Tensor(a!) ones of the
// schema): bump the version counter of each tensor written, as torch's own in-place and out=
// ops do, so that a backward through a value saved before the write raises autograd's "modified
// by an inplace operation" error instead of silently using the new values. Inference tensors
// have no counter and are skipped, as torch.library.custom_op's mutating ops skip them
// (torch.autograd.graph.increment_version): writing one outside inference mode stays allowed,
// where torch's own fill_ would write it and then raise.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/VariableTypeUtils.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "torch/op_handles.h"

namespace moeext::torch_glue {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// d(score)/d(logit) of the chosen experts, times grad_scores. `x` is the chosen experts'
// logits in fp32 ([T, topk]) and `s` their scores; softmax needs the whole row and is handled
// by the caller. The formulas are those torch's own autograd takes through moeext.reference
// (sigmoid_backward; sqrt's grad / (2 * result), then softplus_backward with threshold 20).
at::Tensor elementwise_score_backward(const at::Tensor& grad_scores, const at::Tensor& x,
                                      const at::Tensor& s, const std::string& scoring_func) {
  if (scoring_func == "sigmoid") {
    return at::sigmoid_backward(grad_scores, s);
  }
  return at::softplus_backward(grad_scores / (2 * s), x, 1.0, 20.0);
}

struct BiasedGroupedTopkFunction : public torch::autograd::Function<BiasedGroupedTopkFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& gating_output,
                               const std::optional<at::Tensor>& correction_bias,
                               int64_t num_expert_group, int64_t topk_group, int64_t topk,
                               bool renormalize, double routed_scaling_factor,
                               const std::string& scoring_func) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [topk_weights, topk_ids] = biased_grouped_topk_handle().call(
        gating_output, correction_bias, num_expert_group, topk_group, topk, renormalize,
        routed_scaling_factor, scoring_func);
    ctx->mark_non_differentiable({topk_ids});
    ctx->save_for_backward({gating_output, topk_ids});
    ctx->saved_data["renormalize"] = renormalize;
    ctx->saved_data["routed_scaling_factor"] = routed_scaling_factor;
    ctx->saved_data["scoring_func"] = scoring_func;
    return {topk_weights, topk_ids};
  }

  // w = c * u / (sum(u) + 1e-20) with renormalize (w = c * u without), u the chosen scores
  // with NaN replaced by 0, as SPEC section 1 steps 6-7 compute them.
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const at::Tensor& grad_weights = grad_outputs[0];
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& gating_output = saved[0];
    if (!grad_weights.defined()) {
      return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
              at::Tensor(), at::Tensor(), at::Tensor()};
    }
    const at::Tensor ids = saved[1].to(at::kLong);
    const bool renormalize = ctx->saved_data["renormalize"].toBool();
    const double scale = ctx->saved_data["routed_scaling_factor"].toDouble();
    const std::string scoring_func = ctx->saved_data["scoring_func"].toStringRef();

    const at::Tensor logits = gating_output.to(at::kFloat);
    const at::Tensor g = grad_weights.to(at::kFloat);
    at::Tensor scores = scoring_func == "softmax" ? at::softmax(logits, -1) : at::Tensor();
    const at::Tensor x = logits.gather(1, ids);
    const at::Tensor s = scores.defined()         ? scores.gather(1, ids)
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
    return {grad_logits.to(gating_output.scalar_type()), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

bool requires_grad(const at::Tensor& gating_output,
                   const std::optional<at::Tensor>& correction_bias) {
  return at::GradMode::is_enabled() &&
         (gating_output.requires_grad() ||
          (correction_bias.has_value() && correction_bias->requires_grad()));
}

std::tuple<at::Tensor, at::Tensor> biased_grouped_topk_autograd(
    c10::DispatchKeySet keys, const at::Tensor& gating_output,
    const std::optional<at::Tensor>& correction_bias, int64_t num_expert_group,
    int64_t topk_group, int64_t topk, bool renormalize, double routed_scaling_factor,
    c10::string_view scoring_func) {
  if (!requires_grad(gating_output, correction_bias)) {
    return biased_grouped_topk_handle().redispatch(
        keys & c10::after_autograd_keyset, gating_output, correction_bias, num_expert_group,
        topk_group, topk, renormalize, routed_scaling_factor, scoring_func);
  }
  auto outputs = BiasedGroupedTopkFunction::apply(
      gating_output, correction_bias, num_expert_group, topk_group, topk, renormalize,
      routed_scaling_factor, std::string(scoring_func.data(), scoring_func.size()));
  return {outputs[0], outputs[1]};
}

// logits = hidden_states @ weight.T, so the gradients are grad @ weight and grad.T @
// hidden_states, each computed in fp32 (as the forward accumulates) and returned in its
// input's dtype.
struct RouterGemmFunction : public torch::autograd::Function<RouterGemmFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& hidden_states,
                               const at::Tensor& weight,
                               std::optional<c10::ScalarType> out_dtype) {
    at::AutoDispatchBelowADInplaceOrView guard;
    at::Tensor logits = router_gemm_handle().call(hidden_states, weight, out_dtype);
    ctx->save_for_backward({hidden_states, weight});
    return {logits};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const at::Tensor& grad_logits = grad_outputs[0];
    if (!grad_logits.defined()) {
      return {at::Tensor(), at::Tensor(), at::Tensor()};
    }
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& hidden_states = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor g = grad_logits.to(at::kFloat);
    at::Tensor grad_hidden, grad_weight;
    if (ctx->needs_input_grad(0)) {
      grad_hidden = g.mm(weight.to(at::kFloat)).to(hidden_states.scalar_type());
    }
    if (ctx->needs_input_grad(1)) {
      grad_weight = g.t().mm(hidden_states.to(at::kFloat)).to(weight.scalar_type());
    }
    return {grad_hidden, grad_weight, at::Tensor()};
  }
};

at::Tensor router_gemm_autograd(c10::DispatchKeySet keys, const at::Tensor& hidden_states,
                                const at::Tensor& weight,
                                std::optional<c10::ScalarType> out_dtype) {
  if (!at::GradMode::is_enabled() ||
      (!hidden_states.requires_grad() && !weight.requires_grad())) {
    return router_gemm_handle().redispatch(keys & c10::after_autograd_keyset, hidden_states,
                                           weight, out_dtype);
  }
  // Its gradient would have to be packed, and the hidden states' read through the tiles: a
  // serving layout, made once under no_grad, with no use for either.
  TORCH_CHECK(weight.dim() != 3, "router_gemm: ",
              hidden_states.requires_grad() ? "hidden_states" : "weight",
              " requires grad, but a prepacked weight has no gradient formula (pass the "
              "[num_experts, hidden_size] weight, or call this under torch.no_grad())");
  return RouterGemmFunction::apply(hidden_states, weight, out_dtype)[0];
}

// A shuffle moves elements and nothing else, so its gradient is the inverse move of the
// incoming one: unshuffle_weight for shuffle_weight and the other way round.
struct ShuffleWeightFunction : public torch::autograd::Function<ShuffleWeightFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& w,
                               const std::vector<int64_t>& layout, bool gate_up, bool inverse) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->saved_data["layout"] = layout;
    ctx->saved_data["gate_up"] = gate_up;
    ctx->saved_data["inverse"] = inverse;
    return {shuffle_weight_handle(inverse).call(w, layout, gate_up)};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const at::Tensor& grad = grad_outputs[0];
    at::Tensor grad_w;
    if (grad.defined()) {
      const std::vector<int64_t> layout = ctx->saved_data["layout"].toIntVector();
      grad_w = shuffle_weight_handle(!ctx->saved_data["inverse"].toBool())
                   .call(grad, layout, ctx->saved_data["gate_up"].toBool());
    }
    return {grad_w, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

template <bool kInverse>
at::Tensor shuffle_weight_autograd(c10::DispatchKeySet keys, const at::Tensor& w,
                                   at::IntArrayRef layout, bool gate_up) {
  if (!at::GradMode::is_enabled() || !w.requires_grad()) {
    return shuffle_weight_handle(kInverse).redispatch(keys & c10::after_autograd_keyset, w,
                                                      layout, gate_up);
  }
  return ShuffleWeightFunction::apply(w, layout.vec(), gate_up, kInverse)[0];
}

// E8M0 scales are exponent codes: like integer outputs, the shuffled codes carry no gradient,
// whatever the input's requires_grad (the fallback made them require grad, then warned and
// gave none when a backward reached them).
at::Tensor e8m0_shuffle_autograd(c10::DispatchKeySet keys, const at::Tensor& scale,
                                 bool gate_up, std::optional<int64_t> num_experts) {
  return e8m0_shuffle_handle().redispatch(keys & c10::after_autograd_keyset, scale, gate_up,
                                          num_experts);
}

at::Tensor e8m0_unshuffle_autograd(c10::DispatchKeySet keys, const at::Tensor& shuffled,
                                   int64_t m, int64_t n, bool gate_up,
                                   std::optional<int64_t> num_experts) {
  return e8m0_unshuffle_handle().redispatch(keys & c10::after_autograd_keyset, shuffled, m, n,
                                            gate_up, num_experts);
}

// torch's own in-place ops make this check before writing (check_inplace); here the messages
// name the op and the argument. Views that autograd cannot rewrite (made under no_grad, or by
// a multi-output op such as unbind) get torch's own explanation.
void check_writable_with_grad(const at::Tensor& t, const char* op, const char* name) {
  using torch::autograd::can_mutate_inplace_result;
  switch (torch::autograd::can_mutate_inplace(t, /*requires_grad=*/true)) {
    case can_mutate_inplace_result::success:
      return;
    case can_mutate_inplace_result::non_default_backward_view:
      torch::autograd::handle_view_on_rebase(torch::autograd::impl::get_view_autograd_meta(t));
      return;
    case can_mutate_inplace_result::view_of_leaf:
      TORCH_CHECK(false, op, ": ", name,
                  " is a view of a leaf tensor that requires grad, which cannot be written in "
                  "place while grad mode is on (write it under torch.no_grad())");
    case can_mutate_inplace_result::is_leaf:
      TORCH_CHECK(false, op, ": ", name,
                  " is a leaf tensor that requires grad, which cannot be written in place "
                  "while grad mode is on (write it under torch.no_grad())");
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled can_mutate_inplace result");
}

// The gradient of buf after zeroing is the gradient before it, with the zeroed rows cleared.
// Symbolic under torch.compile: no comparison here may become a guard on the extents.
at::Tensor clear_zeroed_rows(const at::Tensor& grad, const c10::SymInt& new_extent,
                             const c10::SymInt& prev_extent) {
  const c10::SymInt rows = grad.sym_size(0);
  const c10::SymInt begin = new_extent.min(rows);
  const c10::SymInt length = (prev_extent.min(rows) - begin).max(0);
  at::Tensor out = grad.clone();
  out.narrow_symint(0, begin, length).zero_();
  return out;
}

struct ZeroTailFunction : public torch::autograd::Function<ZeroTailFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& buf,
                               const c10::SymInt& new_extent, const c10::SymInt& prev_extent) {
    zero_tail_handle().call(buf, new_extent, prev_extent);
    ctx->mark_dirty({buf});
    ctx->saved_data["new_extent"] = new_extent;
    ctx->saved_data["prev_extent"] = prev_extent;
    return {buf};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const at::Tensor& grad = grad_outputs[0];
    if (!grad.defined()) {
      return {at::Tensor(), at::Tensor(), at::Tensor()};
    }
    return {clear_zeroed_rows(grad, ctx->saved_data["new_extent"].toSymInt(),
                              ctx->saved_data["prev_extent"].toSymInt()),
            at::Tensor(), at::Tensor()};
  }
};

void zero_tail_autograd(c10::DispatchKeySet keys, const at::Tensor& buf, c10::SymInt new_extent,
                        c10::SymInt prev_extent) {
  if (!at::GradMode::is_enabled() || !buf.requires_grad()) {
    zero_tail_handle().redispatch(keys & c10::after_autograd_keyset, buf, new_extent,
                                  prev_extent);
    return;
  }
  check_writable_with_grad(buf, "zero_tail_", "buf");
  ZeroTailFunction::apply(buf, new_extent, prev_extent);
}

void zero_tail_tracked_autograd(c10::DispatchKeySet keys, const at::Tensor& buf,
                                const at::Tensor& state, c10::SymInt new_extent) {
  if (!at::GradMode::is_enabled() || !buf.requires_grad()) {
    zero_tail_tracked_handle().redispatch(keys & c10::after_autograd_keyset, buf, state,
                                          new_extent);
    return;
  }
  // The rows zeroed depend on the extent the state held, which a backward could only keep as
  // a tensor saved from before the write; torch.compile (2.13) may hand the backward the state
  // input itself instead, after the new extent is stored in it (pure-PyTorch code that saves
  // a clone of an input it then mutates gets the same wrong gradient). Refused rather than
  // differentiable in eager mode alone.
  TORCH_CHECK(false, "zero_tail_tracked_: buf requires grad, but the tracked form records no "
              "gradient (use zero_tail_, whose extents are arguments rather than device "
              "values, or call this under torch.no_grad())");
}

void bump_version_of_written(const at::Tensor& t) {
  if (!t.is_inference()) {
    torch::autograd::impl::bump_version(t);
  }
}

// The out= form writes into its arguments and returns nothing, so autograd has nothing to
// attach a gradient to. Where one was wanted it raises, as torch's out= ops do, rather than
// leave weights that look computed from the logits but carry no gradient. A bias that requires
// grad is let through: the weights' derivative in it is zero wherever it exists (the bias only
// moves the choice), which is what the functional form gives it too.
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
  biased_grouped_topk_out_handle().redispatch(
      keys & c10::after_autograd_keyset, gating_output, correction_bias, topk_weights, topk_ids,
      num_expert_group, topk_group, renormalize, routed_scaling_factor, scoring_func);
}

// Unboxed, as the Autograd kernel above redispatches: a boxed kernel here would box the nine
// arguments on every call again. It costs about 45 ns of a 0.6-0.7 us call (10 of them the
// guard), inside inference mode too: normal tensors keep their ADInplaceOrView key there.
void biased_grouped_topk_out_inplace_or_view(
    c10::DispatchKeySet keys, const at::Tensor& gating_output,
    const std::optional<at::Tensor>& correction_bias, const at::Tensor& topk_weights,
    const at::Tensor& topk_ids, int64_t num_expert_group, int64_t topk_group, bool renormalize,
    double routed_scaling_factor, c10::string_view scoring_func) {
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    biased_grouped_topk_out_handle().redispatch(
        keys & c10::after_ADInplaceOrView_keyset, gating_output, correction_bias, topk_weights,
        topk_ids, num_expert_group, topk_group, renormalize, routed_scaling_factor,
        scoring_func);
  }
  bump_version_of_written(topk_weights);
  bump_version_of_written(topk_ids);
}

// Unboxed, as the Autograd kernels above redispatch.
void zero_tail_inplace_or_view(c10::DispatchKeySet keys, const at::Tensor& buf,
                               c10::SymInt new_extent, c10::SymInt prev_extent) {
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    zero_tail_handle().redispatch(keys & c10::after_ADInplaceOrView_keyset, buf, new_extent,
                                  prev_extent);
  }
  bump_version_of_written(buf);
}

void zero_tail_tracked_inplace_or_view(c10::DispatchKeySet keys, const at::Tensor& buf,
                                       const at::Tensor& state, c10::SymInt new_extent) {
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    zero_tail_tracked_handle().redispatch(keys & c10::after_ADInplaceOrView_keyset, buf, state,
                                          new_extent);
  }
  bump_version_of_written(buf);
  bump_version_of_written(state);
}

}  // namespace

TORCH_LIBRARY_IMPL(moeext, Autograd, m) {
  m.impl("biased_grouped_topk", &biased_grouped_topk_autograd);
  m.impl("biased_grouped_topk_out", &biased_grouped_topk_out_autograd);
  m.impl("router_gemm", &router_gemm_autograd);
  m.impl("shuffle_weight", &shuffle_weight_autograd</*kInverse=*/false>);
  m.impl("unshuffle_weight", &shuffle_weight_autograd</*kInverse=*/true>);
  m.impl("e8m0_shuffle", &e8m0_shuffle_autograd);
  m.impl("e8m0_unshuffle", &e8m0_unshuffle_autograd);
  m.impl("zero_tail_", &zero_tail_autograd);
  m.impl("zero_tail_tracked_", &zero_tail_tracked_autograd);
}

TORCH_LIBRARY_IMPL(moeext, ADInplaceOrView, m) {
  m.impl("biased_grouped_topk_out", &biased_grouped_topk_out_inplace_or_view);
  m.impl("zero_tail_", &zero_tail_inplace_or_view);
  m.impl("zero_tail_tracked_", &zero_tail_tracked_inplace_or_view);
}

}  // namespace moeext::torch_glue
