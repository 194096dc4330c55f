// Variant 4 of the routing kernels, in a translation unit of its own (grouped_topk_variants.h):
// a plain call of a gate with its own warp kernel instance (FixedTopology ids below
// kCurrentFixedTopologies, 32-lane warps) routed one thread a token (grouped_topk_thread.h),
// at every batch size, for the A/B to find where it pays.
#include "gpu/grouped_topk_thread.h"

namespace moeext::gpu::grouped_topk {

GpuError launch_routing_variant_4(const BiasedGroupedTopkParams& params, void* stream) {
  return launch_thread_kernel<1>(params, stream);
}

}  // namespace moeext::gpu::grouped_topk
