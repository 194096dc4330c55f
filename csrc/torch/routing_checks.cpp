#include "torch/routing_checks.h"

#include "torch/binding.h"
#include "torch/check_messages.h"

namespace moeext::torch_glue {
namespace {

const CheckMessage kLogitsRank{
    "routing.gating_output_rank",
    "{op}: gating_output must be 2-D [num_tokens, num_experts], got shape {shape}"};
const CheckMessage kScoringFunc{
    "routing.scoring_func",
    "{op}: scoring_func must be 'sigmoid', 'sqrtsoftplus' or 'softmax', got '{scoring_func}'"};
const CheckMessages kMessages{&kLogitsRank, &kScoringFunc};

}  // namespace

void check_logits(const at::Tensor& gating_output, const char* op) {
  TORCH_CHECK(gating_output.dim() == 2,
              kLogitsRank({{"op", op}, {"shape", gating_output.sizes()}}));
  to_moeext_dtype(gating_output, op, "gating_output");
}

ScoringFunc parse_scoring_func(std::string_view name, const char* op) {
  if (name == "sigmoid") return ScoringFunc::kSigmoid;
  if (name == "sqrtsoftplus") return ScoringFunc::kSqrtSoftplus;
  if (name == "softmax") return ScoringFunc::kSoftmax;
  TORCH_CHECK(false, kScoringFunc({{"op", op}, {"scoring_func", name}}));
}

}  // namespace moeext::torch_glue
