#include "torch/routing_common.h"

#include <limits>

#include "torch/binding.h"
#include "torch/check_messages.h"
#include "torch/memory_overlap.h"
#include "torch/parallel.h"

namespace moeext::torch_glue {
namespace {

const CheckMessage kLogitsRank{
    "routing.gating_output_rank",
    "{op}: gating_output must be 2-D [num_tokens, num_experts], got shape {shape}"};
const CheckMessage kScoringFunc{
    "routing.scoring_func",
    "{op}: scoring_func must be 'sigmoid', 'sqrtsoftplus' or 'softmax', got '{scoring_func}'"};
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
const CheckMessage kSharedExperts{
    "routing.num_fused_shared_experts",
    "{op}: num_fused_shared_experts must be >= 0, got {shared}"};
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
const CheckMessage kOutputRank{"routing.output_rank",
                               "{op}: {arg} must be 2-D [num_tokens, topk], got {dim}-D"};
const CheckMessage kOutputDtype{"routing.output_dtype", "{op}: {arg} must be {expected}, got {dtype}"};
const CheckMessage kOutputShape{"routing.output_shape",
                                "{op}: {arg} must have shape [{num_tokens}, {columns}], got {shape}"};
const CheckMessage kOutColumns{
    "routing.out_columns",
    "{op}: topk_ids has {columns} columns, which leaves no routed expert beside the "
    "num_fused_shared_experts ({shared})"};
const CheckMessages kOutMessages{&kOutputRank, &kOutputDtype, &kOutputShape, &kOutColumns};
const CheckMessages kMessages{
    &kLogitsRank,     &kScoringFunc,   &kExpertsFitInt32, &kGroupsPositive, &kGroupsDivide,
    &kTopkGroupRange, &kTopkPositive,  &kTopkRange,       &kBiasShape,      &kSharedExperts,
    &kExpertMap,      &kExpertCounts,  &kRoutedExperts,   &kRoutedInt16,    &kValidTokens};

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

}  // namespace

void check_logits(const at::Tensor& gating_output, const char* op) {
  TORCH_CHECK(gating_output.dim() == 2,
              kLogitsRank({{"op", op}, {"shape", gating_output.sizes()}}));
  to_moeext_dtype(gating_output, op, "gating_output");
}

int64_t check_out_columns(const at::Tensor& topk_ids, int64_t num_fused_shared_experts,
                          const char* op) {
  TORCH_CHECK(topk_ids.dim() == 2,
              kOutputRank({{"op", op}, {"arg", "topk_ids"}, {"dim", topk_ids.dim()}}));
  check_shared_experts(num_fused_shared_experts, op);
  const int64_t columns = topk_ids.size(1);
  const int64_t topk = columns - num_fused_shared_experts;
  TORCH_CHECK(num_fused_shared_experts == 0 || topk >= 1,
              kOutColumns({{"op", op}, {"columns", columns}, {"shared", num_fused_shared_experts}}));
  return topk;
}

void check_output(const at::Tensor& out, const at::Tensor& gating_output, at::ScalarType dtype,
                  int64_t columns, const char* op, const char* arg, const char* logits_name) {
  TORCH_CHECK(out.dim() == 2, kOutputRank({{"op", op}, {"arg", arg}, {"dim", out.dim()}}));
  TORCH_CHECK(out.scalar_type() == dtype, kOutputDtype({{"op", op}, {"arg", arg},
                                                        {"expected", dtype},
                                                        {"dtype", out.scalar_type()}}));
  check_same_device(out, arg, gating_output, logits_name, op);
  TORCH_CHECK(out.size(0) == gating_output.size(0) && out.size(1) == columns,
              kOutputShape({{"op", op}, {"arg", arg}, {"num_tokens", gating_output.size(0)},
                            {"columns", columns}, {"shape", out.sizes()}}));
  TORCH_CHECK(out.size(1) <= 1 || out.stride(1) == 1, op, ": ", arg,
              " must have contiguous columns (stride(1) == 1; rows may be strided), got strides ",
              out.strides());
}

ScoringFunc parse_scoring_func(std::string_view name, const char* op) {
  if (name == "sigmoid") return ScoringFunc::kSigmoid;
  if (name == "sqrtsoftplus") return ScoringFunc::kSqrtSoftplus;
  if (name == "softmax") return ScoringFunc::kSoftmax;
  TORCH_CHECK(false, kScoringFunc({{"op", op}, {"scoring_func", name}}));
}

ScoringFunc check_routing(const at::Tensor& gating_output,
                          const std::optional<at::Tensor>& correction_bias,
                          int64_t num_expert_group, int64_t topk_group, int64_t topk,
                          std::string_view scoring_func, const char* op,
                          const char* logits_name) {
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
    check_same_device(bias, "correction_bias", gating_output, logits_name, op);
  }
  return parse_scoring_func(scoring_func, op);
}

void check_shared_experts(int64_t shared, const char* op) {
  TORCH_CHECK(shared >= 0, kSharedExperts({{"op", op}, {"shared", shared}}));
}

// Checks the option tensors (num_fused_shared_experts was checked) and fills their params.
RoutingOptions check_options(const OptionArgs& a, const at::Tensor& gating_output, int64_t topk,
                             const char* op, const char* logits_name) {
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
    check_same_device(map, "expert_map", gating_output, logits_name, op);
    o.expert_map = map.data_ptr<int32_t>();
    o.map_stride = map.stride(0);
  }
  if (a.expert_counts.has_value()) {
    const at::Tensor& counts = *a.expert_counts;
    TORCH_CHECK((counts.scalar_type() == at::kInt || counts.scalar_type() == at::kLong) &&
                    counts.dim() == 1 && counts.size(0) == num_experts,
                kExpertCounts({{"op", op}, {"num_experts", num_experts},
                               {"dtype", counts.scalar_type()}, {"shape", counts.sizes()}}));
    check_same_device(counts, "expert_counts", gating_output, logits_name, op);
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
    check_same_device(routed, "routed_experts", gating_output, logits_name, op);
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
    check_same_device(valid, "num_valid_tokens", gating_output, logits_name, op);
    o.num_valid_tokens = valid.data_ptr();
    o.valid_dtype = valid.scalar_type() == at::kInt ? IntType::kInt32 : IntType::kInt64;
  }
  return o;
}

BiasedGroupedTopkParams fill_routing_params(
    const at::Tensor& gating_output, const std::optional<at::Tensor>& correction_bias,
    const at::Tensor& topk_weights, const at::Tensor& topk_ids, int64_t num_expert_group,
    int64_t topk_group, int64_t topk, bool renormalize, double routed_scaling_factor,
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

void run_routing(Cpu, const BiasedGroupedTopkParams& p, const at::Tensor& /*gating_output*/,
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
void run_routing(Gpu, const BiasedGroupedTopkParams& p, const at::Tensor& gating_output,
                 const char* op) {
  const char* limit = biased_grouped_topk_gpu_limit(p);
  TORCH_CHECK(limit == nullptr, limit);
  if (p.num_tokens == 0) return;
  const c10::DeviceGuard guard(gating_output.device());
  Gpu::check_launch(biased_grouped_topk_gpu(p, Gpu::stream(gating_output)), op);
}
#endif

}  // namespace moeext::torch_glue
