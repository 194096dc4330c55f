// Host unit test of csrc/gpu/grouped_topk_plan.h, the launch plan of the grouped top-k GPU
// kernels: the plan's choices for the presets, and its invariants on every topology.
#include <algorithm>
#include <cstdint>
#include <cstdio>

#include "check.h"
#include "gpu/grouped_topk_plan.h"

namespace gt = moeext::gpu::grouped_topk;

namespace {

void test_plan() {
  CHECK(gt::is_pow2(1) && gt::is_pow2(2) && gt::is_pow2(64) && !gt::is_pow2(0) &&
            !gt::is_pow2(3) && !gt::is_pow2(12),
        "is_pow2");
  for (int64_t x = 1; x < 300; ++x) {
    const int64_t p = gt::pow2_floor(x);
    CHECK(gt::is_pow2(p) && p <= x && 2 * p > x, "pow2_floor(%lld) = %lld", (long long)x,
          (long long)p);
  }
  CHECK(gt::chunk_load_bytes(4, 4) == 16 && gt::chunk_load_bytes(12, 4) == 16 &&
            gt::chunk_load_bytes(4, 2) == 8 && gt::chunk_load_bytes(8, 2) == 16 &&
            gt::chunk_load_bytes(12, 2) == 8 && gt::chunk_load_bytes(2, 2) == 4,
        "chunk_load_bytes");

  // DeepSeek-V3: 8 groups of 32, kept in registers (4 lanes of 8 on a 32-wide warp, 8 lanes
  // of 4 on a 64-wide one).
  gt::FastPathPlan plan = gt::plan_fast_path(32, 256, 8, 4, 8);
  CHECK(plan.experts_per_lane == 8 && plan.lanes_per_group == 4 && plan.group_scores_in_registers,
        "deepseek-v3 / 32: %d %d %d", plan.experts_per_lane, plan.lanes_per_group,
        int(plan.group_scores_in_registers));
  plan = gt::plan_fast_path(64, 256, 8, 4, 8);
  CHECK(plan.experts_per_lane == 4 && plan.lanes_per_group == 8 && plan.group_scores_in_registers,
        "deepseek-v3 / 64: %d %d %d", plan.experts_per_lane, plan.lanes_per_group,
        int(plan.group_scores_in_registers));
  plan = gt::plan_fast_path(32, 384, 1, 1, 8);  // kimi-k2
  CHECK(plan.experts_per_lane == 12, "kimi-k2 / 32: %d", plan.experts_per_lane);
  plan = gt::plan_fast_path(32, 160, 8, 3, 6);  // deepseek-v2: groups of 20 straddle lanes of 8
  CHECK(plan.experts_per_lane == 8 && !plan.group_scores_in_registers && plan.lanes_per_group == 4,
        "deepseek-v2 / 32: %d %d %d", plan.experts_per_lane, plan.lanes_per_group,
        int(plan.group_scores_in_registers));
  // Kimi-K3-style 896 experts, top-16: 28 a lane; 1024 fills a 32-wide warp's 32 a lane.
  CHECK(gt::plan_fast_path(32, 896, 1, 1, 16).experts_per_lane == 28, "896 / 32");
  CHECK(gt::plan_fast_path(64, 896, 1, 1, 16).experts_per_lane == 16, "896 / 64");
  plan = gt::plan_fast_path(32, 1024, 8, 4, 8);  // groups of 128: 4 lanes of 32
  CHECK(plan.experts_per_lane == 32 && plan.lanes_per_group == 4 && plan.group_scores_in_registers,
        "1024 in 8 groups / 32: %d %d %d", plan.experts_per_lane, plan.lanes_per_group,
        int(plan.group_scores_in_registers));
  CHECK(gt::plan_fast_path(32, 1025, 1, 1, 8).experts_per_lane == 0, "E = 1025 is not fast");
  CHECK(!gt::fast_instance_exists(32, 36) && !gt::fast_instance_exists(64, 20) &&
            !gt::fast_instance_exists(32, 6) && gt::fast_instance_exists(32, 32) &&
            gt::fast_instance_exists(64, 16),
        "fast_instance_exists");
  // pick_experts_per_lane finds exactly the instances that exist.
  for (int v = 0; v <= 40; ++v) {
    const int got32 = gt::pick_experts_per_lane<32, int>(v, 0, [](auto i) { return int(i); });
    const int got64 = gt::pick_experts_per_lane<64, int>(v, 0, [](auto i) { return int(i); });
    CHECK(got32 == (gt::fast_instance_exists(32, v) ? v : 0) &&
              got64 == (gt::fast_instance_exists(64, v) ? v : 0),
          "pick_experts_per_lane(%d): %d %d", v, got32, got64);
  }
  CHECK(gt::plan_fast_path(32, 256, 8, 4, 33).experts_per_lane == 0, "topk 33 is not fast");
  CHECK(gt::plan_fast_path(32, 512, 64, 4, 8).experts_per_lane == 0, "64 groups are not fast");
  CHECK(gt::plan_fast_path(48, 256, 8, 4, 8).experts_per_lane == 0, "warp of 48");

  // Every valid topology: the plan's invariants, which the warp kernel's indexing relies on.
  for (int warp_size : {32, 64}) {
    for (int64_t num_experts = 1; num_experts <= 1100; ++num_experts) {
      for (int64_t num_groups = 1; num_groups <= std::min<int64_t>(num_experts, 40); ++num_groups) {
        if (num_experts % num_groups != 0) continue;
        const int64_t group_size = num_experts / num_groups;
        for (int64_t topk_group : {int64_t(1), (num_groups + 1) / 2, num_groups}) {
          for (int64_t topk : {int64_t(1), int64_t(8), int64_t(32), int64_t(33)}) {
            if (topk > topk_group * group_size) continue;
            const gt::FastPathPlan pl =
                gt::plan_fast_path(warp_size, num_experts, num_groups, topk_group, topk);
            const bool fast = num_experts <= 1024 && topk <= 32 && num_groups <= 32;
            CHECK((pl.experts_per_lane != 0) == fast, "eligibility of %lld/%lld/%lld/%lld",
                  (long long)num_experts, (long long)num_groups, (long long)topk_group,
                  (long long)topk);
            if (!fast) continue;
            const int v = pl.experts_per_lane;
            CHECK(v % 4 == 0 && v >= 4 && v <= 32 && gt::fast_instance_exists(warp_size, v) &&
                      int64_t(warp_size) * v >= num_experts,
                  "experts_per_lane %d for %lld experts on %d lanes", v, (long long)num_experts,
                  warp_size);
            if (topk_group == num_groups) continue;
            const int64_t lpg = pl.lanes_per_group;
            CHECK(gt::is_pow2(lpg) && lpg * num_groups <= warp_size,
                  "lanes_per_group %lld for %lld groups", (long long)lpg, (long long)num_groups);
            if (pl.group_scores_in_registers) {
              CHECK(group_size % v == 0 && group_size / v == lpg,
                    "registers: group of %lld, %d per lane, %lld lanes", (long long)group_size,
                    v, (long long)lpg);
            } else {
              CHECK(lpg == gt::pow2_floor(warp_size / num_groups), "shared: lanes_per_group");
            }
          }
        }
      }
    }
  }
}

void test_general_layout() {
  for (int warps : {4, 8}) {
    for (int64_t num_experts : {int64_t(1), int64_t(7), int64_t(1000), int64_t(1024),
                                gt::kMaxExperts}) {
      for (int64_t num_groups : {int64_t(1), int64_t(2), int64_t(8), num_experts}) {
        if (num_experts % num_groups != 0) continue;
        const gt::GeneralSmemLayout l = gt::general_smem_layout(num_experts, num_groups, warps);
        CHECK(l.group_offset >= num_experts && l.slots_offset >= l.group_offset + num_groups &&
                  l.slots_offset % 2 == 0 && l.reduce_offset >= l.slots_offset + 4 * warps &&
                  l.total_words >= l.reduce_offset + 3 * warps,
              "layout of %lld experts, %lld groups", (long long)num_experts,
              (long long)num_groups);
        // Within the default 48 KiB of shared memory, so no opt-in is needed.
        CHECK(l.total_words * 4 <= 48 * 1024, "layout of %lld experts takes %lld bytes",
              (long long)num_experts, (long long)(l.total_words * 4));
      }
    }
  }
}

// Each model gate with a warp kernel instance of its own: the plan gives it the lanes the
// instance was compiled for (num_experts / 32 experts a lane, exactly filled, the group scores
// in registers), and the call's topology finds it on 32-lane warps with its own scoring
// function only, and among the current kernel's ids unless asked for all.
void test_fixed_topologies() {
  using moeext::ScoringFunc;
  constexpr ScoringFunc kSigmoid = ScoringFunc::kSigmoid;
  CHECK(gt::fixed_topology_of(32, 256, 8, 4, 8, kSigmoid) == 1, "deepseek-v3 is topology 1");
  CHECK(gt::fixed_topology_of(32, 384, 1, 1, 8, kSigmoid) == 2, "kimi-k2 is topology 2");
  CHECK(gt::fixed_topology_of(32, 384, 1, 1, 6, ScoringFunc::kSqrtSoftplus) == 0 &&
            gt::fixed_topology_of(32, 384, 1, 1, 6, ScoringFunc::kSqrtSoftplus,
                                  gt::kFixedTopologies) == 4,
        "deepseek-v4-pro is topology 4, not the current kernel's");
  for (int id = 1; id < gt::kFixedTopologies; ++id) {
    const gt::FixedTopology t = gt::fixed_topology(id);
    const gt::FastPathPlan plan =
        gt::plan_fast_path(32, t.num_experts, t.num_expert_group, t.topk_group, t.topk);
    CHECK(t.num_experts % 32 == 0 && plan.experts_per_lane == t.num_experts / 32 &&
              plan.group_scores_in_registers &&
              (t.topk_group == t.num_expert_group ||
               plan.lanes_per_group * plan.experts_per_lane ==
                   t.num_experts / t.num_expert_group),
          "fixed topology %d: %d a lane, %d lanes a group", id, plan.experts_per_lane,
          plan.lanes_per_group);
    const auto find = [&](int warp_size, int64_t topk, ScoringFunc scoring) {
      return gt::fixed_topology_of(warp_size, t.num_experts, t.num_expert_group, t.topk_group,
                                   topk, scoring, gt::kFixedTopologies);
    };
    const ScoringFunc other =
        t.scoring_func == kSigmoid ? ScoringFunc::kSoftmax : kSigmoid;
    CHECK(find(32, t.topk, t.scoring_func) == id, "fixed topology %d found", id);
    CHECK(find(64, t.topk, t.scoring_func) == 0 && find(32, t.topk, other) == 0 &&
              find(32, t.topk + 1, t.scoring_func) == 0,
          "fixed topology %d only on 32 lanes, its scoring function, its own topk", id);
    CHECK((gt::fixed_topology_of(32, t.num_experts, t.num_expert_group, t.topk_group, t.topk,
                                 t.scoring_func) == id) == (id < gt::kCurrentFixedTopologies),
          "fixed topology %d is the current kernel's exactly when below the current count", id);
  }
  CHECK(gt::fixed_topology_of(32, 256, 8, 3, 8, kSigmoid, gt::kFixedTopologies) == 0 &&
            gt::fixed_topology_of(32, 160, 8, 3, 6, kSigmoid, gt::kFixedTopologies) == 0,
        "other topologies are none");
}

}  // namespace

int main() {
  test_plan();
  test_general_layout();
  test_fixed_topologies();
  return moeext_test::finish("grouped_topk_plan");
}
