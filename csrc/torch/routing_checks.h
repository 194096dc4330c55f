// Checks the ops that route or weigh routed experts share (biased_grouped_topk and its out=
// form, routing_weights): the logits and the scoring function, with one message each.
#pragma once

#include <ATen/core/Tensor.h>

#include <string_view>

#include "moeext/grouped_topk.h"

namespace moeext::torch_glue {

// gating_output is 2-D float32, bfloat16 or float16.
void check_logits(const at::Tensor& gating_output, const char* op);

ScoringFunc parse_scoring_func(std::string_view name, const char* op);

}  // namespace moeext::torch_glue
