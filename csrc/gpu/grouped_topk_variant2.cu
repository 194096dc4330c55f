// Variant 2 of the routing warp kernel, in a translation unit of its own
// (grouped_topk_variants.h): the current kernel, with an instance of its own for each of the
// model gates FixedTopology lists beyond the current kernel's (DeepSeek-V4-Flash and -Pro, a
// Nemotron-style 512 experts).
#include "gpu/grouped_topk_variants.h"

namespace moeext::gpu::grouped_topk {
namespace {

template <typename LogitT, typename BiasT>
Kernel variant_2_kernel(int topology, int experts_per_lane) {
  static_assert(kFixedTopologies == 6, "an instance for each fixed topology");
  switch (topology) {
    case 3: return fixed_topology_kernel<LogitT, BiasT, 2, 3>(experts_per_lane);
    case 4: return fixed_topology_kernel<LogitT, BiasT, 2, 4>(experts_per_lane);
    case 5: return fixed_topology_kernel<LogitT, BiasT, 2, 5>(experts_per_lane);
  }
  return nullptr;
}

}  // namespace

GpuError launch_routing_variant_2(const BiasedGroupedTopkParams& params, void* stream) {
  constexpr int kWarpSize = 32;
  const int topology = fixed_topology_for(params, kWarpSize, kFixedTopologies);
  const FastPathPlan plan = plan_for(params, kWarpSize);
  const KernelArgs args = kernel_args(params, plan);
  return visit_dtypes(params, [&](auto logits, auto bias) {
    using LogitT = typename decltype(logits)::type;
    using BiasT = typename decltype(bias)::type;
    return launch_warp_kernel<kWarpSize>(
        variant_2_kernel<LogitT, BiasT>(topology, plan.experts_per_lane), args, plan, stream);
  });
}

}  // namespace moeext::gpu::grouped_topk
