// Host unit test of csrc/cpu/grouped_topk_plan.h, the choice of strategy and the workspace of
// the CPU routing kernel: the presets of SPEC.md section 1 take the strategies their shapes
// call for, every call takes the path the conditions spread over dispatch.cpp and
// grouped_topk.cpp chose before the plan (commit 53a453a), and every workspace holds its
// arrays apart, inside its size, with the lane rows on a cache line.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "check.h"
#include "cpu/grouped_topk_plan.h"

namespace cpu = moeext::cpu;
using moeext::BiasedGroupedTopkParams;
using moeext::ScoringFunc;
using Strategy = cpu::GroupedTopkStrategy;

namespace {

struct NamedIsa {
  const char* name;
  cpu::GroupedTopkIsa isa;
};
const NamedIsa kIsas[] = {{"portable", cpu::kGroupedTopkPortable},
                          {"avx2", cpu::kGroupedTopkAvx2},
                          {"avx512", cpu::kGroupedTopkAvx512}};

const char* strategy_name(Strategy s) {
  switch (s) {
    case Strategy::kRows: return "rows";
    case Strategy::kLaneBlocks: return "lane blocks";
    case Strategy::kApproxRows: return "approx rows";
    case Strategy::kApproxLaneBlocks: return "approx lane blocks";
  }
  return "?";
}

const float kBias[1] = {0.0f};  // only its presence matters to the plan

BiasedGroupedTopkParams params(int64_t experts, int64_t groups, int64_t topk_group, int64_t topk,
                               ScoringFunc scoring, bool bias, int64_t col_stride = 1) {
  BiasedGroupedTopkParams p;
  p.num_experts = experts;
  p.num_expert_group = groups;
  p.topk_group = topk_group;
  p.topk = topk;
  p.scoring_func = scoring;
  p.correction_bias = bias ? kBias : nullptr;
  p.gating_col_stride = col_stride;
  p.gating_row_stride = experts * col_stride;
  return p;
}

// What the kernel of 53a453a ran for `rows` rows: the workspace's lane rows as dispatch.cpp
// allocated them, then route()'s candidate pass and route_in_lanes()'s conditions as written
// there, blocks of lanes counted as the loops over them counted.
struct Path {
  Strategy strategy;
  int64_t lane_block_rows;
};
Path path_at_53a453a(const BiasedGroupedTopkParams& p, int64_t rows,
                     const cpu::GroupedTopkIsa& isa) {
  const int64_t W = isa.lanes;
  const bool has_lane_rows =
      p.num_experts <= cpu::kLaneMaxExperts ||
      (p.scoring_func == ScoringFunc::kSqrtSoftplus &&
       p.num_experts <= cpu::kApproxLaneMaxExperts && rows >= cpu::kLaneRows);
  const bool all_kept = p.topk_group == p.num_expert_group;
  if (p.scoring_func == ScoringFunc::kSqrtSoftplus) {
    if (all_kept && p.topk <= 2 * W && p.gating_col_stride == 1) {  // and a finite bias
      int64_t blocks = 0;
      if (isa.approx_rows_in_lanes && has_lane_rows && p.topk <= cpu::kApproxLaneMaxTopk &&
          p.num_experts <= cpu::kApproxLaneMaxExperts) {
        blocks = rows / W * W;
      }
      return {blocks > 0 ? Strategy::kApproxLaneBlocks : Strategy::kApproxRows, blocks};
    }
    return {Strategy::kRows, 0};  // route_in_lanes took no sqrt-softplus rows
  }
  if (!isa.rows_in_lanes) return {Strategy::kRows, 0};
  const bool fits = p.num_experts <= cpu::kLaneMaxExperts;
  if (!has_lane_rows || !fits || p.gating_col_stride != 1 || p.topk > cpu::kLaneMaxTopk ||
      p.num_expert_group > cpu::kLaneMaxGroups || (p.correction_bias != nullptr && !all_kept)) {
    return {Strategy::kRows, 0};
  }
  if (W < cpu::kLaneRows && all_kept && p.num_experts * p.topk > cpu::kLaneMaxOffersAllKept) {
    return {Strategy::kRows, 0};
  }
  const int64_t blocks = rows / W * W;
  return {blocks > 0 ? Strategy::kLaneBlocks : Strategy::kRows, blocks};
}

void expect(const char* what, const NamedIsa& isa, int64_t rows, const cpu::GroupedTopkPlan& plan,
            Strategy strategy, int64_t lane_block_rows) {
  CHECK(plan.strategy == strategy && plan.lane_block_rows == lane_block_rows,
        "%s on %s, %lld rows: %s with %lld rows in blocks, want %s with %lld", what, isa.name,
        static_cast<long long>(rows), strategy_name(plan.strategy),
        static_cast<long long>(plan.lane_block_rows), strategy_name(strategy),
        static_cast<long long>(lane_block_rows));
}

// The presets' strategies, as the kernel's comments give the reasons for them.
void test_presets() {
  const auto sigmoid = ScoringFunc::kSigmoid, sqrt_softplus = ScoringFunc::kSqrtSoftplus;
  for (const NamedIsa& isa : kIsas) {
    const int64_t W = isa.isa.lanes;
    const bool avx512 = isa.isa.approx_rows_in_lanes;
    for (int64_t rows : {int64_t(1), W - 1, W, W + 1, int64_t(64), int64_t(1000)}) {
      const int64_t blocks = rows / W * W;
      const Strategy lanes = blocks > 0 ? Strategy::kLaneBlocks : Strategy::kRows;
      const Strategy approx_lanes =
          blocks > 0 ? Strategy::kApproxLaneBlocks : Strategy::kApproxRows;
      auto plan = [&](const BiasedGroupedTopkParams& p) {
        return cpu::plan_grouped_topk(p, rows, isa.isa);
      };
      // A bias and groups to drop: top-2 group scores, which only the rows compute.
      expect("deepseek-v3", isa, rows, plan(params(256, 8, 4, 8, sigmoid, true)),
             Strategy::kRows, 0);
      // More experts than a block of lanes holds.
      expect("kimi-k2", isa, rows, plan(params(384, 1, 1, 8, sigmoid, true)), Strategy::kRows,
             0);
      expect("nemotron", isa, rows, plan(params(512, 1, 1, 22, sigmoid, true)),
             Strategy::kRows, 0);
      // Every group kept: on 8 lanes 160 x 8 offers are past kLaneMaxOffersAllKept.
      const bool glm_in_lanes = isa.isa.rows_in_lanes && W == cpu::kLaneRows;
      expect("glm-4.5", isa, rows, plan(params(160, 1, 1, 8, sigmoid, true)),
             glm_in_lanes ? lanes : Strategy::kRows, glm_in_lanes ? blocks : 0);
      // No bias: groups dropped lane-wise, on both ISAs with lanes.
      expect("deepseek-v2", isa, rows,
             plan(params(160, 8, 3, 6, ScoringFunc::kSoftmax, false)),
             isa.isa.rows_in_lanes ? lanes : Strategy::kRows,
             isa.isa.rows_in_lanes ? blocks : 0);
      expect("deepseek-v4-flash", isa, rows, plan(params(256, 1, 1, 6, sqrt_softplus, true)),
             avx512 ? approx_lanes : Strategy::kApproxRows, avx512 ? blocks : 0);
      expect("deepseek-v4-pro", isa, rows, plan(params(384, 1, 1, 6, sqrt_softplus, true)),
             avx512 ? approx_lanes : Strategy::kApproxRows, avx512 ? blocks : 0);
      // The candidate pass needs contiguous logits and every group kept; in lanes, topk <= 6.
      expect("deepseek-v4-flash, column-strided", isa, rows,
             plan(params(256, 1, 1, 6, sqrt_softplus, true, 2)), Strategy::kRows, 0);
      expect("deepseek-v4-flash, 4 of 8 groups", isa, rows,
             plan(params(256, 8, 4, 6, sqrt_softplus, true)), Strategy::kRows, 0);
      expect("deepseek-v4-flash, topk 8", isa, rows,
             plan(params(256, 1, 1, 8, sqrt_softplus, true)), Strategy::kApproxRows, 0);
      expect("glm-4.5, column-strided", isa, rows,
             plan(params(160, 1, 1, 8, sigmoid, true, 3)), Strategy::kRows, 0);
    }
  }
}

// Every topology of a sweep, on every ISA, against the conditions of 53a453a.
void test_same_path_as_before() {
  const ScoringFunc scorings[] = {ScoringFunc::kSigmoid, ScoringFunc::kSqrtSoftplus,
                                  ScoringFunc::kSoftmax};
  int64_t cases = 0;
  for (const NamedIsa& isa : kIsas) {
    for (int64_t experts : {1, 2, 8, 16, 60, 64, 96, 128, 160, 192, 256, 264, 384, 512, 768,
                            1024, 1040, 2048}) {
      for (int64_t groups : {1, 2, 4, 8, 16, 32}) {
        if (experts % groups != 0) continue;
        const int64_t group_size = experts / groups;
        for (int64_t topk_group : {int64_t(1), int64_t(2), int64_t(3), groups - 1, groups}) {
          if (topk_group < 1 || topk_group > groups) continue;
          for (int64_t topk : {1, 2, 4, 6, 7, 8, 9, 16, 17, 22, 32, 33, 64}) {
            if (topk > topk_group * group_size) continue;
            for (ScoringFunc scoring : scorings) {
              for (bool bias : {false, true}) {
                for (int64_t col_stride : {1, 2}) {
                  for (int64_t rows : {1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 100}) {
                    const auto p = params(experts, groups, topk_group, topk, scoring, bias,
                                          col_stride);
                    const cpu::GroupedTopkPlan plan = cpu::plan_grouped_topk(p, rows, isa.isa);
                    const Path want = path_at_53a453a(p, rows, isa.isa);
                    CHECK(plan.strategy == want.strategy &&
                              plan.lane_block_rows == want.lane_block_rows,
                          "%s: E %lld, %lld/%lld groups, topk %lld, scoring %d, bias %d, col "
                          "stride %lld, %lld rows: %s (%lld), want %s (%lld)",
                          isa.name, static_cast<long long>(experts),
                          static_cast<long long>(topk_group), static_cast<long long>(groups),
                          static_cast<long long>(topk), int(scoring), int(bias),
                          static_cast<long long>(col_stride), static_cast<long long>(rows),
                          strategy_name(plan.strategy),
                          static_cast<long long>(plan.lane_block_rows),
                          strategy_name(want.strategy),
                          static_cast<long long>(want.lane_block_rows));
                    ++cases;
                  }
                }
              }
            }
          }
        }
      }
    }
  }
  CHECK(cases > 100000, "only %lld cases", static_cast<long long>(cases));
}

// [begin, begin + bytes) of one array, to check the arrays apart and inside the workspace.
struct Span {
  const char* name;
  uintptr_t begin, bytes;
};

void check_workspace(const BiasedGroupedTopkParams& p, int64_t rows, const NamedIsa& isa,
                     size_t misalign) {
  const cpu::GroupedTopkPlan plan = cpu::plan_grouped_topk(p, rows, isa.isa);
  // 64-aligned storage, started `misalign` bytes in: the stack buffer (0) or new[] (16).
  std::vector<uint64_t> storage(size_t(plan.workspace_bytes + 128) / 8 + 1);
  const uintptr_t base =
      (reinterpret_cast<uintptr_t>(storage.data()) + 63) / 64 * 64 + misalign;
  unsigned char* buffer = reinterpret_cast<unsigned char*>(base);
  const cpu::GroupedTopkWorkspace ws = cpu::lay_out_grouped_topk_workspace(plan, buffer);
  auto at = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr); };
  const uintptr_t E = uintptr_t(p.num_experts), slots = cpu::kMaxCandidates + 16;
  std::vector<Span> spans = {
      {"scores[0]", at(ws.scores[0]), 4 * E},
      {"scores[1]", at(ws.scores[1]), 4 * E},
      {"biased[0]", at(ws.biased[0]), 4 * E},
      {"biased[1]", at(ws.biased[1]), 4 * E},
      {"row", at(ws.row), 4 * E},
      {"bias", at(ws.bias), 4 * E},
      {"group_scores", at(ws.group_scores), 4 * uintptr_t(p.num_expert_group + 16)},
      {"group_seconds", at(ws.group_seconds), 4 * uintptr_t(p.num_expert_group + 16)},
      {"candidates", at(ws.candidates), 4 * slots},
      {"candidate_ids", at(ws.candidate_ids), 4 * slots},
      {"candidate_scores", at(ws.candidate_scores), 4 * slots},
      {"candidate_bias", at(ws.candidate_bias), 4 * slots},
      {"chosen", at(ws.chosen), 4 * uintptr_t(p.topk)},
      {"group_keys", at(ws.group_keys), 8 * uintptr_t(p.topk_group)},
      {"expert_keys", at(ws.expert_keys), 8 * uintptr_t(p.topk)},
      {"ranges", at(ws.ranges), sizeof(cpu::ExpertRange) * uintptr_t(p.topk_group)},
  };
  CHECK((ws.lane_rows != nullptr) == (plan.lane_block_rows > 0),
        "E %lld on %s: lane rows %p with %lld rows in blocks",
        static_cast<long long>(p.num_experts), isa.name, static_cast<void*>(ws.lane_rows),
        static_cast<long long>(plan.lane_block_rows));
  if (ws.lane_rows != nullptr) {
    CHECK(at(ws.lane_rows) % 64 == 0, "lane rows off a cache line");
    // A block's tiles: lanes x lanes floats per vector of experts.
    const int64_t W = isa.isa.lanes;
    const int64_t tiles = (p.num_experts + W - 1) / W;
    spans.push_back({"lane_rows", at(ws.lane_rows), uintptr_t(4 * W * W * tiles)});
  }
  CHECK(ws.score_pieces == nullptr, "score_pieces is the caller's to set");
  for (size_t i = 0; i < spans.size(); ++i) {
    const Span& s = spans[i];
    CHECK(s.begin >= base && s.begin + s.bytes <= base + uintptr_t(plan.workspace_bytes),
          "E %lld, topk %lld on %s: %s [%zu, %zu) outside the workspace's %lld bytes",
          static_cast<long long>(p.num_experts), static_cast<long long>(p.topk), isa.name,
          s.name, size_t(s.begin - base), size_t(s.begin - base + s.bytes),
          static_cast<long long>(plan.workspace_bytes));
    for (size_t j = 0; j < i; ++j) {
      const Span& t = spans[j];
      CHECK(s.begin >= t.begin + t.bytes || t.begin >= s.begin + s.bytes,
            "E %lld on %s: %s overlaps %s", static_cast<long long>(p.num_experts), isa.name,
            s.name, t.name);
    }
  }
}

void test_workspaces() {
  for (const NamedIsa& isa : kIsas) {
    for (int64_t experts : {1, 8, 60, 160, 256, 384, 512, 1024, 2048}) {
      for (int64_t groups : {int64_t(1), int64_t(8)}) {
        if (experts % groups != 0) continue;
        for (ScoringFunc scoring : {ScoringFunc::kSigmoid, ScoringFunc::kSqrtSoftplus}) {
          for (int64_t topk : {int64_t(1), int64_t(6), int64_t(8)}) {
            if (topk > experts) continue;
            for (int64_t rows : {int64_t(1), int64_t(16), int64_t(100)}) {
              for (size_t misalign : {size_t(0), size_t(16)}) {
                check_workspace(params(experts, groups, groups, topk, scoring, true), rows, isa,
                                misalign);
              }
            }
          }
        }
      }
    }
  }
}

}  // namespace

int main() {
  test_presets();
  test_same_path_as_before();
  test_workspaces();
  return moeext_test::finish("test_grouped_topk_plan");
}
