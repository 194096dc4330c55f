#include "torch/routing_backward.h"

#include <ATen/ATen.h>

namespace moeext::torch_glue {
namespace {

// exp of float32 values computed in float64 and rounded once, as the kernels compute it.
at::Tensor rounded_exp(const at::Tensor& x) { return at::exp(x.to(at::kDouble)).to(at::kFloat); }

// The scores the forward kernels give and the weights were made of (docs/SPEC.md section 1,
// step 1; moeext.reference's _rounded_score): the renormalisation's derivative is taken at
// them. float32's own softplus, in a vectorised lane, can underflow where they do not.
at::Tensor forward_scores(const at::Tensor& x, const std::string& scoring_func) {
  if (scoring_func == "sigmoid") return at::reciprocal(1 + rounded_exp(-x));
  if (scoring_func == "sqrtsoftplus") {
    const at::Tensor softplus =
        at::where(x > 20, x, at::log1p(rounded_exp(x).to(at::kDouble)).to(at::kFloat));
    return at::sqrt(softplus.to(at::kDouble)).to(at::kFloat);
  }
  const at::Tensor e = rounded_exp(x - x.amax(-1, true));
  return e / e.sum(-1, true);
}

// d(score)/d(logit) of the chosen experts, times grad_scores; `x` is the chosen experts'
// logits in fp32 ([T, k]) (softmax, which needs the whole row, is the caller's). The formulas
// torch's autograd takes through moeext.reference's _torch_score: sigmoid_backward at
// float32's sigmoid; for sqrt-softplus, exp(x / 2)'s derivative below x = -20 (half its
// value), and above it sqrt's grad / (2 * result), then softplus_backward with threshold 20.
at::Tensor elementwise_score_backward(const at::Tensor& grad_scores, const at::Tensor& x,
                                      const std::string& scoring_func) {
  if (scoring_func == "sigmoid") return at::sigmoid_backward(grad_scores, at::sigmoid(x));
  const at::Tensor far = x < -20;
  // Each branch is computed everywhere and picked per element: the other one's inf or NaN
  // (a zero score's quotient, exp of a large x) is dropped, not multiplied by 0.
  const at::Tensor far_branch = grad_scores * at::exp(0.5 * x) * 0.5;
  const at::Tensor near_branch = at::softplus_backward(
      grad_scores / (2 * at::sqrt(at::softplus(x, 1.0, 20.0))), x, 1.0, 20.0);
  return at::where(far, far_branch, near_branch);
}

}  // namespace

// w = c * u / (sum(u) + 1e-20) with renormalize (w = c * u without), u the chosen scores with
// NaN replaced by 0.
at::Tensor routing_weights_backward(const at::Tensor& grad_weights,
                                    const at::Tensor& gating_output, const at::Tensor& ids_in,
                                    bool renormalize, double routed_scaling_factor,
                                    const std::string& scoring_func) {
  const at::Tensor ids = ids_in.to(at::kLong);
  const at::Tensor logits = gating_output.to(at::kFloat);
  const at::Tensor g = grad_weights.to(at::kFloat);
  const bool softmax = scoring_func == "softmax";
  const at::Tensor x = logits.gather(1, ids);
  const at::Tensor s = softmax ? forward_scores(logits, scoring_func).gather(1, ids)
                               : forward_scores(x, scoring_func);
  const at::Tensor is_nan = at::isnan(s);
  const at::Tensor u = at::where(is_nan, at::zeros_like(s), s);
  at::Tensor grad_u;
  if (renormalize) {
    const at::Tensor denom = u.sum(-1, true) + 1e-20;
    grad_u = routed_scaling_factor * (g - (g * u).sum(-1, true) / denom) / denom;
  } else {
    grad_u = routed_scaling_factor * g;
  }
  const at::Tensor grad_s = at::where(is_nan, at::zeros_like(grad_u), grad_u);
  at::Tensor grad_logits;
  if (softmax) {
    const at::Tensor scores = at::softmax(logits, -1);
    const at::Tensor grad_all = at::zeros_like(scores).scatter(1, ids, grad_s);
    grad_logits = scores * (grad_all - (grad_all * scores).sum(-1, true));
  } else {
    grad_logits = at::zeros_like(logits).scatter(
        1, ids, elementwise_score_backward(grad_s, x, scoring_func));
  }
  return grad_logits.to(gating_output.scalar_type());
}

}  // namespace moeext::torch_glue
