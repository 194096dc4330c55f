// The derivative of routing's weights in the logits, for the two ops that give such weights
// (biased_grouped_topk and routing_weights): docs/SPEC.md section 1, steps 1, 6 and 7, at the
// chosen experts.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

namespace moeext::torch_glue {

// grad_weights [T, k] (the weights' columns of the chosen experts only), ids [T, k] the
// chosen logical experts; returns the gradient in gating_output's dtype.
at::Tensor routing_weights_backward(const at::Tensor& grad_weights,
                                    const at::Tensor& gating_output, const at::Tensor& ids,
                                    bool renormalize, double routed_scaling_factor,
                                    const std::string& scoring_func);

}  // namespace moeext::torch_glue
