#include "torch/routing_backward.h"

#include <ATen/ATen.h>

namespace moeext::torch_glue {
namespace {

// d(score)/d(logit) of the chosen experts, times grad_scores; `x` is the chosen experts'
// logits in fp32 ([T, k]) and `s` their scores (softmax, which needs the whole row, is the
// caller's). The formulas torch's autograd takes through moeext.reference: sigmoid_backward;
// sqrt's grad / (2 * result), then softplus_backward with threshold 20.
at::Tensor elementwise_score_backward(const at::Tensor& grad_scores, const at::Tensor& x,
                                      const at::Tensor& s, const std::string& scoring_func) {
  if (scoring_func == "sigmoid") return at::sigmoid_backward(grad_scores, s);
  return at::softplus_backward(grad_scores / (2 * s), x, 1.0, 20.0);
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
    grad_u = routed_scaling_factor * (g - (g * u).sum(-1, true) / denom) / denom;
  } else {
    grad_u = routed_scaling_factor * g;
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
  return grad_logits.to(gating_output.scalar_type());
}

}  // namespace moeext::torch_glue
