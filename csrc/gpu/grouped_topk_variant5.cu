// Variant 5 of the routing warp kernel, in a translation unit of its own
// (grouped_topk_variants.h): variant 3 with the topology of a known model gate fixed at compile
// time (FixedTopology, grouped_topk_warp.h).
#include "gpu/grouped_topk_variants.h"

namespace moeext::gpu::grouped_topk {
namespace {

// The FixedTopology id of the call's topology on a warp of `warp_size` lanes, or 0.
int fixed_topology_of(const BiasedGroupedTopkParams& p, int warp_size) {
  if (warp_size != 32 || p.scoring_func != ScoringFunc::kSigmoid) return 0;
  for (int id = 1; id < kFixedTopologies; ++id) {
    const FixedTopology shape = fixed_topology(id);
    if (p.num_experts == shape.num_experts && p.num_expert_group == shape.num_expert_group &&
        p.topk_group == shape.topk_group && p.topk == shape.topk) {
      return id;
    }
  }
  return 0;
}

template <int kTopology>
GpuError launch_fixed(const BiasedGroupedTopkParams& params, void* stream) {
  constexpr int kWarpSize = 32;
  constexpr int V = fixed_topology(kTopology).num_experts / kWarpSize;
  const FastPathPlan plan = plan_for(params, kWarpSize);
  if (plan.experts_per_lane != V || !plan.group_scores_in_registers) {
    return "biased_grouped_topk: a fixed topology's plan differs (internal error)";
  }
  return visit_dtypes(params, [&](auto logits, auto bias) {
    using LogitT = typename decltype(logits)::type;
    using BiasT = typename decltype(bias)::type;
    return launch_warp_kernel<kWarpSize>(
        Kernel(grouped_topk_warp_kernel<kWarpSize, V, LogitT, BiasT, false, 5, kTopology>),
        kernel_args(params, plan), plan, stream);
  });
}

}  // namespace

GpuError launch_routing_variant_5(const BiasedGroupedTopkParams& params, void* stream) {
  static_assert(kFixedTopologies == 3, "a launch for each fixed topology");
  switch (fixed_topology_of(params, warp_size_of_current_device())) {
    case 1: return launch_fixed<1>(params, stream);
    case 2: return launch_fixed<2>(params, stream);
  }
  return launch_plain_variant<5>(params, stream);
}

}  // namespace moeext::gpu::grouped_topk
