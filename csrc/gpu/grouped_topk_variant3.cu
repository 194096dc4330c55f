// Variant 3 of the routing warp kernel, in a translation unit of its own
// (grouped_topk_variants.h): the current kernel, but a call with routing options whose gate has
// an instance of its own (FixedTopology ids below kCurrentFixedTopologies) runs that instance
// with the options, where the current kernel runs the generic options instance.
#include "gpu/grouped_topk_variants.h"

namespace moeext::gpu::grouped_topk {
namespace {

template <typename LogitT, typename BiasT>
Kernel variant_3_kernel(int topology, int experts_per_lane) {
  static_assert(kCurrentFixedTopologies == 3, "an instance for each current fixed topology");
  switch (topology) {
    case 1: return fixed_topology_kernel<LogitT, BiasT, 0, 1, true>(experts_per_lane);
    case 2: return fixed_topology_kernel<LogitT, BiasT, 0, 2, true>(experts_per_lane);
  }
  return nullptr;
}

}  // namespace

GpuError launch_routing_variant_3(const BiasedGroupedTopkParams& params, void* stream) {
  return launch_fixed_topology_variant(
      params, kCurrentFixedTopologies, stream,
      [](auto logits, auto bias, int topology, int lanes) {
        using LogitT = typename decltype(logits)::type;
        using BiasT = typename decltype(bias)::type;
        return variant_3_kernel<LogitT, BiasT>(topology, lanes);
      });
}

}  // namespace moeext::gpu::grouped_topk
