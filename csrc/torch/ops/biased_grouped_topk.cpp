// biased_grouped_topk and its out= form (docs/SPEC.md sections 1 and 6): checks, launcher
// params, the CPU and GPU implementations, autograd, and the direct calls of the Python
// wrappers.
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "moeext/grouped_topk.h"
#include "torch/autograd_kernels.h"
#include "torch/binding.h"
#include "torch/check_messages.h"
#include "torch/direct_call.h"
#include "torch/memory_overlap.h"
#include "torch/parallel.h"
#include "torch/routing_backward.h"
#include "torch/routing_checks.h"

namespace moeext::torch_glue {
namespace {

// ---- Checks ------------------------------------------------------------------------------

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
const CheckMessage kOutputRank{"routing.output_rank",
                               "{op}: {arg} must be 2-D [num_tokens, topk], got {dim}-D"};
const CheckMessage kOutputDtype{"routing.output_dtype", "{op}: {arg} must be {expected}, got {dtype}"};
const CheckMessage kOutputShape{"routing.output_shape",
                                "{op}: {arg} must have shape [{num_tokens}, {columns}], got {shape}"};
const CheckMessage kSharedExperts{
    "routing.num_fused_shared_experts",
    "{op}: num_fused_shared_experts must be >= 0, got {shared}"};
const CheckMessage kOutColumns{
    "routing.out_columns",
    "{op}: topk_ids has {columns} columns, which leaves no routed expert beside the "
    "num_fused_shared_experts ({shared})"};
const CheckMessage kExpertMap{
    "routing.expert_map",
    "{op}: expert_map must be int32 of shape [{size}] (num_experts + num_fused_shared_experts), "
    "got {dtype} of shape {shape}"};
const CheckMessage kExpertCounts{
    "routing.expert_counts",
    "{op}: expert_counts must be int32 or int64 of shape [{num_experts}], got {dtype} of shape "
    "{shape}"};
const CheckMessage kRoutedExperts{
    "routing.routed_experts",
    "{op}: routed_experts must be int16 or int32 of shape [R, {topk}] with R >= {num_tokens} "
    "(the tokens), got {dtype} of shape {shape}"};
const CheckMessage kRoutedInt16{
    "routing.routed_experts_int16",
    "{op}: routed_experts is int16, whose ids end at 32767, but there are {num_experts} experts"};
const CheckMessage kValidTokens{
    "routing.num_valid_tokens",
    "{op}: num_valid_tokens must hold one int32 or int64, got {dtype} with {numel} elements"};
const CheckMessages kMessages{
    &kExpertsFitInt32, &kGroupsPositive, &kGroupsDivide, &kTopkGroupRange,
    &kTopkPositive, &kTopkRange,       &kBiasShape,      &kOutputRank,
    &kOutputDtype,  &kOutputShape,     &kSharedExperts,  &kOutColumns,   &kExpertMap,
    &kExpertCounts, &kRoutedExperts,   &kRoutedInt16,    &kValidTokens};

// Everything but the outputs and the options; returns the scoring function.
ScoringFunc check_inputs(const at::Tensor& gating_output,
                         const std::optional<at::Tensor>& correction_bias,
                         int64_t num_expert_group, int64_t topk_group, int64_t topk,
                         std::string_view scoring_func, const char* op) {
  check_logits(gating_output, op);
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

// topk_weights or topk_ids of the out= form: [num_tokens, columns] of `dtype`.
void check_output(const at::Tensor& out, const at::Tensor& gating_output, at::ScalarType dtype,
                  int64_t columns, const char* op, const char* arg) {
  TORCH_CHECK(out.dim() == 2, kOutputRank({{"op", op}, {"arg", arg}, {"dim", out.dim()}}));
  TORCH_CHECK(out.scalar_type() == dtype, kOutputDtype({{"op", op}, {"arg", arg},
                                                        {"expected", dtype},
                                                        {"dtype", out.scalar_type()}}));
  check_same_device(out, arg, gating_output, "gating_output", op);
  TORCH_CHECK(out.size(0) == gating_output.size(0) && out.size(1) == columns,
              kOutputShape({{"op", op}, {"arg", arg}, {"num_tokens", gating_output.size(0)},
                            {"columns", columns}, {"shape", out.sizes()}}));
  TORCH_CHECK(out.size(1) <= 1 || out.stride(1) == 1, op, ": ", arg,
              " must have contiguous columns (stride(1) == 1; rows may be strided), got strides ",
              out.strides());
}

// The options of docs/SPEC.md section 6, as the schema passes them.
struct OptionArgs {
  int64_t num_fused_shared_experts;
  double shared_expert_weight;
  const std::optional<at::Tensor>& expert_map;
  const std::optional<at::Tensor>& expert_counts;
  const std::optional<at::Tensor>& routed_experts;
  const std::optional<at::Tensor>& num_valid_tokens;

  bool any() const {
    return num_fused_shared_experts != 0 || expert_map.has_value() || expert_counts.has_value() ||
           routed_experts.has_value() || num_valid_tokens.has_value();
  }
};

void check_shared_experts(int64_t shared, const char* op) {
  TORCH_CHECK(shared >= 0, kSharedExperts({{"op", op}, {"shared", shared}}));
}

// Checks the option tensors (num_fused_shared_experts was checked) and fills their params.
RoutingOptions check_options(const OptionArgs& a, const at::Tensor& gating_output, int64_t topk,
                             const char* op) {
  const int64_t num_tokens = gating_output.size(0);
  const int64_t num_experts = gating_output.size(1);
  RoutingOptions o;
  o.num_shared_experts = a.num_fused_shared_experts;
  o.shared_expert_weight = static_cast<float>(a.shared_expert_weight);
  if (a.expert_map.has_value()) {
    const at::Tensor& map = *a.expert_map;
    const int64_t size = num_experts + a.num_fused_shared_experts;
    TORCH_CHECK(map.scalar_type() == at::kInt && map.dim() == 1 && map.size(0) == size,
                kExpertMap({{"op", op}, {"size", size}, {"dtype", map.scalar_type()},
                            {"shape", map.sizes()}}));
    check_same_device(map, "expert_map", gating_output, "gating_output", op);
    o.expert_map = map.data_ptr<int32_t>();
    o.map_stride = map.stride(0);
  }
  if (a.expert_counts.has_value()) {
    const at::Tensor& counts = *a.expert_counts;
    TORCH_CHECK((counts.scalar_type() == at::kInt || counts.scalar_type() == at::kLong) &&
                    counts.dim() == 1 && counts.size(0) == num_experts,
                kExpertCounts({{"op", op}, {"num_experts", num_experts},
                               {"dtype", counts.scalar_type()}, {"shape", counts.sizes()}}));
    check_same_device(counts, "expert_counts", gating_output, "gating_output", op);
    TORCH_CHECK(num_experts <= 1 || counts.stride(0) != 0, op,
                ": expert_counts has experts that share memory (stride 0); each needs its own");
    o.expert_counts = counts.data_ptr();
    o.counts_dtype = counts.scalar_type() == at::kInt ? IntType::kInt32 : IntType::kInt64;
    o.counts_stride = counts.stride(0);
  }
  if (a.routed_experts.has_value()) {
    const at::Tensor& routed = *a.routed_experts;
    TORCH_CHECK((routed.scalar_type() == at::kShort || routed.scalar_type() == at::kInt) &&
                    routed.dim() == 2 && routed.size(0) >= num_tokens && routed.size(1) == topk,
                kRoutedExperts({{"op", op}, {"topk", topk}, {"num_tokens", num_tokens},
                                {"dtype", routed.scalar_type()}, {"shape", routed.sizes()}}));
    TORCH_CHECK(routed.scalar_type() != at::kShort || num_experts <= 32767,
                kRoutedInt16({{"op", op}, {"num_experts", num_experts}}));
    check_same_device(routed, "routed_experts", gating_output, "gating_output", op);
    TORCH_CHECK(topk <= 1 || routed.stride(1) == 1, op,
                ": routed_experts must have contiguous columns (stride(1) == 1; rows may be "
                "strided), got strides ",
                routed.strides());
    o.routed_experts = routed.data_ptr();
    o.routed_dtype = routed.scalar_type() == at::kShort ? IntType::kInt16 : IntType::kInt32;
    o.routed_row_stride = routed.stride(0);
  }
  if (a.num_valid_tokens.has_value()) {
    const at::Tensor& valid = *a.num_valid_tokens;
    TORCH_CHECK((valid.scalar_type() == at::kInt || valid.scalar_type() == at::kLong) &&
                    valid.numel() == 1,
                kValidTokens({{"op", op}, {"dtype", valid.scalar_type()},
                              {"numel", valid.numel()}}));
    check_same_device(valid, "num_valid_tokens", gating_output, "gating_output", op);
    o.num_valid_tokens = valid.data_ptr();
    o.valid_dtype = valid.scalar_type() == at::kInt ? IntType::kInt32 : IntType::kInt64;
  }
  return o;
}

// Launcher params from checked inputs and outputs (float32 / int32 [num_tokens, topk + S]
// with contiguous columns on gating_output's device).
BiasedGroupedTopkParams fill_params(const at::Tensor& gating_output,
                                    const std::optional<at::Tensor>& correction_bias,
                                    const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                                    int64_t num_expert_group, int64_t topk_group, int64_t topk,
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
  p.topk = topk;
  p.renormalize = renormalize;
  p.routed_scaling_factor = static_cast<float>(routed_scaling_factor);
  return p;
}

int64_t element_size(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }
int64_t element_size(IntType type) {
  return type == IntType::kInt16 ? 2 : type == IntType::kInt32 ? 4 : 8;
}

// check_writes_apart with the options' buffers: every write against every read and write.
[[gnu::noinline]] void check_option_writes_apart(const BiasedGroupedTopkParams& p, bool outputs,
                                                 const char* op) {
  const RoutingOptions& o = p.options;
  const int64_t columns = p.topk + o.num_shared_experts;
  struct Named {
    RowBytes rows;
    const char* name;
    int64_t element;
    int64_t columns;  // of a row, for the message
  };
  Named writes[4];
  size_t num_writes = 0;
  if (outputs) {
    writes[num_writes++] = {
        rows_of(p.topk_weights, p.num_tokens, p.weights_row_stride, columns, 1, 4),
        "topk_weights", 4, columns};
    writes[num_writes++] = {rows_of(p.topk_ids, p.num_tokens, p.ids_row_stride, columns, 1, 4),
                            "topk_ids", 4, columns};
  }
  if (o.routed_experts != nullptr) {
    const int64_t element = element_size(o.routed_dtype);
    writes[num_writes++] = {
        rows_of(o.routed_experts, p.num_tokens, o.routed_row_stride, p.topk, 1, element),
        "routed_experts", element, p.topk};
  }
  if (o.expert_counts != nullptr) {
    // One row per expert (a stride of 0 was refused, so no two share memory).
    const int64_t element = element_size(o.counts_dtype);
    writes[num_writes++] = {
        rows_of(o.expert_counts, p.num_experts, o.counts_stride, 1, 1, element),
        "expert_counts", element, 1};
  }
  if (num_writes == 0) return;
  Named reads[4];
  size_t num_reads = 0;
  reads[num_reads++] = {rows_of(p.gating_output, p.num_tokens, p.gating_row_stride,
                                p.num_experts, p.gating_col_stride, element_size(p.gating_dtype)),
                        "gating_output", 0, 0};
  // The bias and the map as one row per expert (a broadcast stride 0 is one element).
  if (p.correction_bias != nullptr) {
    reads[num_reads++] = {rows_of(p.correction_bias, p.num_experts, p.bias_stride, 1, 1,
                                  element_size(p.bias_dtype)),
                          "correction_bias", 0, 0};
  }
  if (o.expert_map != nullptr) {
    reads[num_reads++] = {
        rows_of(o.expert_map, p.num_experts + o.num_shared_experts, o.map_stride, 1, 1, 4),
        "expert_map", 0, 0};
  }
  if (o.num_valid_tokens != nullptr) {
    reads[num_reads++] = {rows_of(o.num_valid_tokens, 1, 1, 1, 1, element_size(o.valid_dtype)),
                          "num_valid_tokens", 0, 0};
  }
  for (size_t i = 0; i < num_writes; ++i) {
    const Named& w = writes[i];
    TORCH_CHECK(!rows_overlap_each_other(w.rows), op, ": ", w.name,
                " has rows that share memory (row stride ", w.rows.stride / w.element, " < ",
                w.columns == p.topk ? "topk " : "topk + num_fused_shared_experts ", w.columns,
                "); every row needs its own");
    for (size_t j = i + 1; j < num_writes; ++j) {
      TORCH_CHECK(!rows_overlap(w.rows, writes[j].rows), op, ": ", w.name, " and ",
                  writes[j].name, " share memory; what the op writes must overlap nothing else");
    }
    for (size_t j = 0; j < num_reads; ++j) {
      const Named& r = reads[j];
      TORCH_CHECK(!rows_overlap(w.rows, r.rows), op, ": ", w.name, " and ", r.name,
                  " share memory; what the op writes must overlap nothing else");
    }
  }
}

// What a call writes may not overlap what it reads or other writes (nor its own rows): the
// result would depend on the order the kernel touches memory in. Read from the filled
// params, so the common case (separate buffers) costs a few compares. `outputs`: whether the
// weights and ids are the caller's (the out= form) rather than fresh.
void check_writes_apart(const BiasedGroupedTopkParams& p, bool outputs, const char* op) {
  const RoutingOptions& o = p.options;
  if (o.expert_counts != nullptr || o.routed_experts != nullptr || o.expert_map != nullptr) {
    check_option_writes_apart(p, outputs, op);
    return;
  }
  // The plain out= call, at every decode step: its two outputs against its two inputs.
  if (!outputs) return;
  const int64_t columns = p.topk + o.num_shared_experts;
  const RowBytes weights =
      rows_of(p.topk_weights, p.num_tokens, p.weights_row_stride, columns, 1, 4);
  const RowBytes ids = rows_of(p.topk_ids, p.num_tokens, p.ids_row_stride, columns, 1, 4);
  const RowBytes logits =
      rows_of(p.gating_output, p.num_tokens, p.gating_row_stride, p.num_experts,
              p.gating_col_stride, element_size(p.gating_dtype));
  const RowBytes bias = rows_of(p.correction_bias, p.correction_bias ? p.num_experts : 0,
                                p.bias_stride, 1, 1, element_size(p.bias_dtype));
  for (const auto& [out, name] : {std::pair{&weights, "topk_weights"}, {&ids, "topk_ids"}}) {
    TORCH_CHECK(!rows_overlap_each_other(*out), op, ": ", name,
                " has rows that share memory (row stride ", out->stride / 4, " < ",
                o.num_shared_experts == 0 ? "topk " : "topk + num_fused_shared_experts ",
                columns, "); every row needs its own");
  }
  const char* clash = rows_overlap(weights, ids)      ? "topk_weights and topk_ids"
                      : rows_overlap(weights, logits) ? "topk_weights and gating_output"
                      : rows_overlap(ids, logits)     ? "topk_ids and gating_output"
                      : rows_overlap(weights, bias)   ? "topk_weights and correction_bias"
                      : rows_overlap(ids, bias)       ? "topk_ids and correction_bias"
                                                      : nullptr;
  TORCH_CHECK(clash == nullptr, op, ": ", clash,
              " share memory; what the op writes must overlap nothing else");
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
    double routed_scaling_factor, c10::string_view scoring_func,
    int64_t num_fused_shared_experts, double shared_expert_weight,
    const std::optional<at::Tensor>& expert_map, const std::optional<at::Tensor>& expert_counts,
    const std::optional<at::Tensor>& routed_experts,
    const std::optional<at::Tensor>& num_valid_tokens) {
  constexpr const char* op = "biased_grouped_topk";
  Device::check_device(gating_output, op, "gating_output");
  const ScoringFunc scoring = check_inputs(gating_output, correction_bias, num_expert_group,
                                           topk_group, topk, as_std(scoring_func), op);
  const OptionArgs options{num_fused_shared_experts, shared_expert_weight, expert_map,
                           expert_counts, routed_experts, num_valid_tokens};
  const bool any_option = options.any();
  if (any_option) check_shared_experts(num_fused_shared_experts, op);
  const int64_t num_tokens = gating_output.size(0);
  const int64_t columns = topk + num_fused_shared_experts;
  at::Tensor topk_weights = Device::empty({num_tokens, columns}, at::kFloat, gating_output);
  at::Tensor topk_ids = Device::empty({num_tokens, columns}, at::kInt, gating_output);
  BiasedGroupedTopkParams p =
      fill_params(gating_output, correction_bias, topk_weights, topk_ids, num_expert_group,
                  topk_group, topk, renormalize, routed_scaling_factor, scoring);
  // The outputs are ours and the inputs were checked once above; only what the options write
  // is checked against them.
  if (any_option) {
    p.options = check_options(options, gating_output, topk, op);
    check_writes_apart(p, /*outputs=*/false, op);
  }
  launch(Device{}, p, gating_output, op);
  return {topk_weights, topk_ids};
}

template <typename Device>
void biased_grouped_topk_out(
    const at::Tensor& gating_output, const std::optional<at::Tensor>& correction_bias,
    const at::Tensor& topk_weights, const at::Tensor& topk_ids, int64_t num_expert_group,
    int64_t topk_group, bool renormalize, double routed_scaling_factor,
    c10::string_view scoring_func, int64_t num_fused_shared_experts, double shared_expert_weight,
    const std::optional<at::Tensor>& expert_map, const std::optional<at::Tensor>& expert_counts,
    const std::optional<at::Tensor>& routed_experts,
    const std::optional<at::Tensor>& num_valid_tokens) {
  constexpr const char* op = "biased_grouped_topk_out";
  Device::check_device(gating_output, op, "gating_output");
  TORCH_CHECK(topk_ids.dim() == 2,
              kOutputRank({{"op", op}, {"arg", "topk_ids"}, {"dim", topk_ids.dim()}}));
  check_shared_experts(num_fused_shared_experts, op);
  const int64_t columns = topk_ids.size(1);
  const int64_t topk = columns - num_fused_shared_experts;
  TORCH_CHECK(num_fused_shared_experts == 0 || topk >= 1,
              kOutColumns({{"op", op}, {"columns", columns}, {"shared", num_fused_shared_experts}}));
  const ScoringFunc scoring = check_inputs(gating_output, correction_bias, num_expert_group,
                                           topk_group, topk, as_std(scoring_func), op);
  check_output(topk_weights, gating_output, at::kFloat, columns, op, "topk_weights");
  check_output(topk_ids, gating_output, at::kInt, columns, op, "topk_ids");
  BiasedGroupedTopkParams p =
      fill_params(gating_output, correction_bias, topk_weights, topk_ids, num_expert_group,
                  topk_group, topk, renormalize, routed_scaling_factor, scoring);
  const OptionArgs options{num_fused_shared_experts, shared_expert_weight, expert_map,
                           expert_counts, routed_experts, num_valid_tokens};
  if (options.any()) p.options = check_options(options, gating_output, topk, op);
  check_writes_apart(p, /*outputs=*/true, op);
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
// The routed weights are differentiable in the logits; the bias, the ids and the shared
// experts' weights (constants) get no gradient. Where nothing requires grad the kernel is one
// unboxed redispatch, what autograd's boxed fallback would do at the cost of boxing every
// argument.

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The routed choice without the shared experts' columns and the expert map, whose ids the
// backward needs; counts and records are written as asked.
struct RoutingFunction : public torch::autograd::Function<RoutingFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& gating_output,
                               const std::optional<at::Tensor>& correction_bias,
                               int64_t num_expert_group, int64_t topk_group, int64_t topk,
                               bool renormalize, double routed_scaling_factor,
                               const std::string& scoring_func,
                               const std::optional<at::Tensor>& expert_counts,
                               const std::optional<at::Tensor>& routed_experts,
                               const std::optional<at::Tensor>& num_valid_tokens) {
    at::Tensor topk_weights, topk_ids;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      std::tie(topk_weights, topk_ids) = handle().call(
          gating_output, correction_bias, num_expert_group, topk_group, topk, renormalize,
          routed_scaling_factor, scoring_func, 0, 1.0, std::nullopt, expert_counts,
          routed_experts, num_valid_tokens);
    }
    bump_version_of_written(expert_counts);
    bump_version_of_written(routed_experts);
    ctx->mark_non_differentiable({topk_ids});
    ctx->save_for_backward({gating_output, topk_ids});
    ctx->saved_data["renormalize"] = renormalize;
    ctx->saved_data["routed_scaling_factor"] = routed_scaling_factor;
    ctx->saved_data["scoring_func"] = scoring_func;
    return {topk_weights, topk_ids};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    variable_list grads(11);
    if (!grad_outputs[0].defined()) return grads;
    const auto saved = ctx->get_saved_variables();
    grads[0] = routing_weights_backward(grad_outputs[0], saved[0], saved[1],
                                        ctx->saved_data["renormalize"].toBool(),
                                        ctx->saved_data["routed_scaling_factor"].toDouble(),
                                        ctx->saved_data["scoring_func"].toStringRef());
    return grads;
  }
};

std::tuple<at::Tensor, at::Tensor> biased_grouped_topk_autograd(
    c10::DispatchKeySet keys, const at::Tensor& gating_output,
    const std::optional<at::Tensor>& correction_bias, int64_t num_expert_group,
    int64_t topk_group, int64_t topk, bool renormalize, double routed_scaling_factor,
    c10::string_view scoring_func, int64_t num_fused_shared_experts, double shared_expert_weight,
    const std::optional<at::Tensor>& expert_map, const std::optional<at::Tensor>& expert_counts,
    const std::optional<at::Tensor>& routed_experts,
    const std::optional<at::Tensor>& num_valid_tokens) {
  const bool requires_grad =
      at::GradMode::is_enabled() &&
      (gating_output.requires_grad() ||
       (correction_bias.has_value() && correction_bias->requires_grad()));
  if (!requires_grad) {
    auto outputs = handle().redispatch(
        keys & c10::after_autograd_keyset, gating_output, correction_bias, num_expert_group,
        topk_group, topk, renormalize, routed_scaling_factor, scoring_func,
        num_fused_shared_experts, shared_expert_weight, expert_map, expert_counts,
        routed_experts, num_valid_tokens);
    // The options' buffers are written in place: their versions move, as a mutating op of
    // torch.library.custom_op's moves them (here rather than in an ADInplaceOrView kernel,
    // which every plain call would pass through).
    bump_version_of_written(expert_counts);
    bump_version_of_written(routed_experts);
    return outputs;
  }
  // The kernels refuse a negative count; checked here before anything is written.
  check_shared_experts(num_fused_shared_experts, "biased_grouped_topk");
  auto outputs = RoutingFunction::apply(gating_output, correction_bias, num_expert_group,
                                        topk_group, topk, renormalize, routed_scaling_factor,
                                        std::string(as_std(scoring_func)), expert_counts,
                                        routed_experts, num_valid_tokens);
  at::Tensor topk_weights = outputs[0], topk_ids = outputs[1];
  if (num_fused_shared_experts > 0) {
    const int64_t num_experts = gating_output.size(1);
    topk_weights = at::cat({topk_weights, at::full({topk_weights.size(0), num_fused_shared_experts},
                                                   shared_expert_weight, topk_weights.options())},
                           1);
    topk_ids = at::cat({topk_ids, at::arange(num_experts, num_experts + num_fused_shared_experts,
                                             topk_ids.options())
                                      .expand({topk_ids.size(0), num_fused_shared_experts})},
                       1);
  }
  if (expert_map.has_value()) {
    // The map's values, whatever they are (-1 included), at the logical ids.
    topk_ids = expert_map->index_select(0, topk_ids.reshape(-1)).view_as(topk_ids);
  }
  return {topk_weights, topk_ids};
}

// The out= form writes into its arguments and returns nothing, so autograd has nothing to
// attach a gradient to. Where one was wanted it raises, as torch's out= ops do. A bias that
// requires grad is let through: the weights' derivative in it is zero wherever it exists,
// which is what the functional form gives it too.
void biased_grouped_topk_out_autograd(
    c10::DispatchKeySet keys, const at::Tensor& gating_output,
    const std::optional<at::Tensor>& correction_bias, const at::Tensor& topk_weights,
    const at::Tensor& topk_ids, int64_t num_expert_group, int64_t topk_group, bool renormalize,
    double routed_scaling_factor, c10::string_view scoring_func,
    int64_t num_fused_shared_experts, double shared_expert_weight,
    const std::optional<at::Tensor>& expert_map, const std::optional<at::Tensor>& expert_counts,
    const std::optional<at::Tensor>& routed_experts,
    const std::optional<at::Tensor>& num_valid_tokens) {
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
                          routed_scaling_factor, scoring_func, num_fused_shared_experts,
                          shared_expert_weight, expert_map, expert_counts, routed_experts,
                          num_valid_tokens);
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
    "moeext.biased_grouped_topk's direct call of the op: all fourteen arguments "
    "positionally, of the plain Python types; returns NotImplemented for anything else."};
const DirectCallRegistration kDirectOutCall{
    "call_biased_grouped_topk_out", &DirectCall<OutSignature>::call<&out_handle, RoutesMany>,
    "moeext.biased_grouped_topk_out's direct call of the op: all fifteen arguments "
    "positionally, of the plain Python types; returns NotImplemented for anything else."};

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

// What the out= form writes into its arguments: its outputs and the options' buffers.
TORCH_LIBRARY_IMPL(moeext, ADInplaceOrView, m) {
  m.impl("biased_grouped_topk_out",
         &AutogradKernels<OutSignature>::bump_written<&out_handle, 2, 3, 12, 13>);
}

}  // namespace moeext::torch_glue
