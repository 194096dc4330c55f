// Runs the portable CPU routing kernel (biased_grouped_topk_cpu with no x86 path compiled in)
// over a fixed set of pseudo-random cases and writes every output to a text file, so that
// .ci/aarch64_check.sh can compare an aarch64 build (under qemu) with the x86-64 build the
// test suite checks against the reference. The cases cover the SPEC presets and random
// topologies, the three scoring functions, every logits and bias dtype, strided logits, ties,
// and rows with NaN and infinities. NaN weights print as "nan": aarch64's default NaN has the
// sign bit clear and x86's has it set.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "check_values.h"
#include "moeext/grouped_topk.h"

namespace {

using moeext::BiasedGroupedTopkParams;
using moeext::DType;
using moeext::ScoringFunc;

using ci_values::float_to_bits;
using ci_values::pick;
using ci_values::roughly_normal;
using ci_values::to_bf16;
using ci_values::to_fp16;

struct Topology {
  int64_t num_experts, num_expert_group, topk_group, topk;
  ScoringFunc scoring_func;
};

// The SPEC presets and the shapes around them (E, groups, kept groups, topk, scoring).
constexpr Topology kPresets[] = {
    {256, 8, 4, 8, ScoringFunc::kSigmoid},   {160, 8, 3, 6, ScoringFunc::kSoftmax},
    {64, 1, 1, 6, ScoringFunc::kSoftmax},    {384, 1, 1, 8, ScoringFunc::kSigmoid},
    {128, 1, 1, 8, ScoringFunc::kSigmoid},   {256, 1, 1, 6, ScoringFunc::kSqrtSoftplus},
    {384, 1, 1, 6, ScoringFunc::kSqrtSoftplus}, {512, 1, 1, 22, ScoringFunc::kSigmoid},
    {160, 1, 1, 8, ScoringFunc::kSigmoid},   {60, 1, 1, 4, ScoringFunc::kSoftmax},
    {1024, 128, 64, 32, ScoringFunc::kSigmoid}};
constexpr int kNumPresets = int(sizeof(kPresets) / sizeof(kPresets[0]));

Topology random_topology(int c) {
  Topology t;
  const int64_t group_size = 1 + pick(c % 5 == 1 ? 70 : 24);
  t.num_expert_group = 1 + pick(c % 7 == 1 ? 40 : 9);
  if (t.num_expert_group * group_size > 1024) t.num_expert_group = 1 + 512 / group_size;
  t.num_experts = t.num_expert_group * group_size;
  t.topk_group = 1 + pick(t.num_expert_group);
  const int64_t kept = t.topk_group * group_size;
  t.topk = 1 + pick(kept < 32 ? kept : 32);
  t.scoring_func = ScoringFunc(pick(3));
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s OUTPUT CASES\n", argv[0]);
    return 2;
  }
  FILE* out = std::fopen(argv[1], "w");
  if (out == nullptr) return 2;
  const int cases = std::atoi(argv[2]);
  for (int c = 0; c < cases; ++c) {
    Topology t = c % 2 == 1 ? random_topology(c) : kPresets[c / 2 % kNumPresets];
    if (c % 6 == 0) t.scoring_func = ScoringFunc(pick(3));
    const int64_t num_tokens = c % 4 == 0 ? 1 + pick(3) : 1 + pick(40);
    const auto logits_dtype = DType(pick(3));
    const int bias_kind = int(pick(4));  // none, fp32, bf16, fp16
    const int values = int(pick(6));     // 1: coarse values (ties), 2: NaN/inf rows, 3: large
    const int64_t col_stride = pick(5) == 0 ? 2 : 1;
    const int64_t row_stride = t.num_experts * col_stride + pick(3);

    std::vector<float> logits(size_t(num_tokens * row_stride));
    for (int64_t r = 0; r < num_tokens; ++r) {
      const int row_kind = values == 2 ? int(pick(6)) : 0;
      for (int64_t e = 0; e < t.num_experts; ++e) {
        float v = roughly_normal();
        if (values == 1) v = float(int(v * 2)) / 2;
        if (values == 3) v *= 12;
        if (row_kind == 1 && pick(7) == 0) v = __builtin_nanf("");
        if (row_kind == 2 && pick(9) == 0) v = __builtin_inff();
        if (row_kind == 3 && pick(9) == 0) v = -__builtin_inff();
        if (row_kind == 4) v = __builtin_nanf("");
        logits[size_t(r * row_stride + e * col_stride)] = v;
      }
    }
    std::vector<uint16_t> logits_16(logits.size());
    for (size_t i = 0; i < logits.size(); ++i) {
      logits_16[i] = logits_dtype == DType::kBFloat16 ? to_bf16(logits[i]) : to_fp16(logits[i]);
    }
    std::vector<float> bias(size_t(t.num_experts));
    for (float& b : bias) {
      b = values == 1 ? float(int(roughly_normal() * 2)) / 4 : 0.1f * roughly_normal();
    }
    std::vector<uint16_t> bias_16(bias.size());
    for (size_t i = 0; i < bias.size(); ++i) {
      bias_16[i] = bias_kind == 2 ? to_bf16(bias[i]) : to_fp16(bias[i]);
    }
    std::vector<float> weights(size_t(num_tokens * t.topk));
    std::vector<int32_t> ids(size_t(num_tokens * t.topk));

    BiasedGroupedTopkParams p;
    p.gating_output = logits_dtype == DType::kFloat32 ? static_cast<const void*>(logits.data())
                                                      : logits_16.data();
    p.gating_dtype = logits_dtype;
    p.gating_row_stride = row_stride;
    p.gating_col_stride = col_stride;
    p.correction_bias = bias_kind == 0   ? nullptr
                        : bias_kind == 1 ? static_cast<const void*>(bias.data())
                                         : bias_16.data();
    p.bias_dtype = bias_kind == 2 ? DType::kBFloat16 : bias_kind == 3 ? DType::kFloat16
                                                                      : DType::kFloat32;
    p.topk_weights = weights.data();
    p.weights_row_stride = t.topk;
    p.topk_ids = ids.data();
    p.ids_row_stride = t.topk;
    p.num_tokens = num_tokens;
    p.num_experts = t.num_experts;
    p.num_expert_group = t.num_expert_group;
    p.topk_group = t.topk_group;
    p.topk = t.topk;
    p.renormalize = pick(4) != 0;
    p.routed_scaling_factor = pick(3) == 0 ? 2.5f : 1.0f;
    p.scoring_func = t.scoring_func;
    moeext::biased_grouped_topk_cpu(p, 0, num_tokens);

    std::fprintf(out, "case %d: E %lld, groups %lld, kept %lld, topk %lld, scoring %d, T %lld\n", c,
                 static_cast<long long>(t.num_experts),
                 static_cast<long long>(t.num_expert_group), static_cast<long long>(t.topk_group),
                 static_cast<long long>(t.topk), int(t.scoring_func),
                 static_cast<long long>(num_tokens));
    for (int64_t r = 0; r < num_tokens; ++r) {
      for (int64_t j = 0; j < t.topk; ++j) {
        const float w = weights[size_t(r * t.topk + j)];
        const int id = ids[size_t(r * t.topk + j)];
        if (w != w) {
          std::fprintf(out, " %d:nan", id);
        } else {
          std::fprintf(out, " %d:%08x", id, float_to_bits(w));
        }
      }
      std::fprintf(out, "\n");
    }
  }
  return std::fclose(out) == 0 ? 0 : 1;
}
