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
  return launch_fixed_topology_variant(
      params, kFixedTopologies, stream, [](auto logits, auto bias, int topology, int lanes) {
        using LogitT = typename decltype(logits)::type;
        using BiasT = typename decltype(bias)::type;
        return variant_2_kernel<LogitT, BiasT>(topology, lanes);
      });
}

}  // namespace moeext::gpu::grouped_topk
