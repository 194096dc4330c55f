// Variant 6 of the routing warp kernel, in a translation unit of its own
// (grouped_topk_variants.h): the current kernel, but the model gates' own instances (DeepSeek-V3/R1,
// Kimi-K2) score a lane's experts as one chunk, with one range test for their reciprocals
// (sigmoid_scores, grouped_topk_device.h), and skip the NaN tests once b is NaN-free.
#include "gpu/grouped_topk_variants.h"

namespace moeext::gpu::grouped_topk {
namespace {

template <typename LogitT, typename BiasT>
Kernel variant_6_kernel(int topology, int experts_per_lane) {
  static_assert(kCurrentFixedTopologies == 3, "an instance for each current fixed topology");
  switch (topology) {
    case 1: return fixed_topology_kernel<LogitT, BiasT, 6, 1>(experts_per_lane);
    case 2: return fixed_topology_kernel<LogitT, BiasT, 6, 2>(experts_per_lane);
  }
  return nullptr;
}

}  // namespace

GpuError launch_routing_variant_6(const BiasedGroupedTopkParams& params, void* stream) {
  return launch_fixed_topology_variant(
      params, kCurrentFixedTopologies, stream,
      [](auto logits, auto bias, int topology, int lanes) {
        using LogitT = typename decltype(logits)::type;
        using BiasT = typename decltype(bias)::type;
        return variant_6_kernel<LogitT, BiasT>(topology, lanes);
      });
}

}  // namespace moeext::gpu::grouped_topk
