// Variant 6 of the routing warp kernel, in a translation unit of its own
// (grouped_topk_variants.h): the current kernel, but a lane's sigmoid scores computed as one
// chunk, with one range test for their reciprocals (sigmoid_scores, grouped_topk_device.h), and
// b's keys and group top 2 without NaN tests once b is NaN-free. Every plain call the warp
// kernel takes, the model gates' in their own instances.
#include "gpu/grouped_topk_variants.h"

namespace moeext::gpu::grouped_topk {

GpuError launch_routing_variant_6(const BiasedGroupedTopkParams& params, void* stream) {
  return launch_plain_variant<6>(params, stream);
}

}  // namespace moeext::gpu::grouped_topk
