// CPU implementations of the moeext ops: validate, fill the launcher params, split the rows
// over torch's intra-op thread pool.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>

#include "moeext/grouped_topk.h"
#include "torch/params.h"

namespace moeext::torch_glue {
namespace {

void check_cpu(const at::Tensor& t, const char* op, const char* arg) {
  TORCH_CHECK(t.device().is_cpu(), op, ": ", arg, " must be a CPU tensor here, got ", t.device());
}

void biased_grouped_topk_out_cpu(const at::Tensor& gating_output,
                                 const std::optional<at::Tensor>& correction_bias,
                                 const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                                 int64_t num_expert_group, int64_t topk_group, bool renormalize,
                                 double routed_scaling_factor, c10::string_view scoring_func) {
  constexpr const char* op = "biased_grouped_topk_out";
  check_cpu(gating_output, op, "gating_output");
  const BiasedGroupedTopkParams p = make_grouped_topk_params(
      gating_output, correction_bias, topk_weights, topk_ids, num_expert_group, topk_group,
      renormalize, routed_scaling_factor, std::string_view(scoring_func.data(), scoring_func.size()), op);
  // A row costs about 1 ns per expert; chunks of ~16k expert-rows amortise a thread wake-up
  // (a few us) and keep decode batches on the calling thread.
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, p.num_experts));
  at::parallel_for(0, p.num_tokens, grain, [&](int64_t begin, int64_t end) {
    biased_grouped_topk_cpu(p, begin, end);
  });
}

std::tuple<at::Tensor, at::Tensor> biased_grouped_topk_impl_cpu(
    const at::Tensor& gating_output, const std::optional<at::Tensor>& correction_bias,
    int64_t num_expert_group, int64_t topk_group, int64_t topk, bool renormalize,
    double routed_scaling_factor, c10::string_view scoring_func) {
  constexpr const char* op = "biased_grouped_topk";
  check_cpu(gating_output, op, "gating_output");
  check_grouped_topk_inputs(gating_output, correction_bias, num_expert_group, topk_group, topk,
                            std::string_view(scoring_func.data(), scoring_func.size()), op);
  const int64_t num_tokens = gating_output.size(0);
  at::Tensor topk_weights =
      at::empty({num_tokens, topk}, gating_output.options().dtype(at::kFloat));
  at::Tensor topk_ids = at::empty({num_tokens, topk}, gating_output.options().dtype(at::kInt));
  biased_grouped_topk_out_cpu(gating_output, correction_bias, topk_weights, topk_ids,
                              num_expert_group, topk_group, renormalize, routed_scaling_factor,
                              scoring_func);
  return {topk_weights, topk_ids};
}

}  // namespace

TORCH_LIBRARY_IMPL(moeext, CPU, m) {
  m.impl("biased_grouped_topk", &biased_grouped_topk_impl_cpu);
  m.impl("biased_grouped_topk_out", &biased_grouped_topk_out_cpu);
}

}  // namespace moeext::torch_glue
