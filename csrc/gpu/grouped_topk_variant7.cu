// Variant 7 of the routing kernels, in a translation unit of its own (grouped_topk_variants.h):
// variant 4 with two threads a token (grouped_topk_thread.h, kSplit 2), twice the warps for a
// batch, for the A/B at prefill sizes.
#include "gpu/grouped_topk_thread.h"

namespace moeext::gpu::grouped_topk {

GpuError launch_routing_variant_7(const BiasedGroupedTopkParams& params, void* stream) {
  return launch_thread_kernel<2>(params, stream);
}

}  // namespace moeext::gpu::grouped_topk
