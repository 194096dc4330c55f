// Variant 1 of the routing warp kernel, in a translation unit of its own
// (grouped_topk_variants.h).
#include "gpu/grouped_topk_variants.h"

namespace moeext::gpu::grouped_topk {

GpuError launch_routing_variant_1(const BiasedGroupedTopkParams& params, void* stream) {
  return launch_plain_variant<1>(params, stream);
}

}  // namespace moeext::gpu::grouped_topk
