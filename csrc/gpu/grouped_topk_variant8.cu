// Variant 8 of the routing warp kernel, in a translation unit of its own
// (grouped_topk_variants.h): the current kernel, but a plain call whose gate has an instance of
// its own (FixedTopology ids below kCurrentFixedTopologies, 32-lane warps, topk up to 8) finds
// its topk by merging the lanes' sorted lists over a butterfly of shuffles (kMergeSelect of
// grouped_topk_warp.h): five steps, each of independent work, where the current kernel runs topk
// argmax rounds that each wait on the one before. For the A/B at decode sizes, where a token is
// one warp's chain of latencies.
#include "gpu/grouped_topk_variants.h"

namespace moeext::gpu::grouped_topk {

GpuError launch_routing_variant_8(const BiasedGroupedTopkParams& params, void* stream) {
  return launch_gate_instance_variant<8, false>(params, stream);
}

}  // namespace moeext::gpu::grouped_topk
