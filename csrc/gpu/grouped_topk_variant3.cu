// Variant 3 of the routing warp kernel, in a translation unit of its own
// (grouped_topk_variants.h): the current kernel, but a call with routing options whose gate has
// an instance of its own (FixedTopology ids below kCurrentFixedTopologies) runs that instance
// with the options, where the current kernel runs the generic options instance.
#include "gpu/grouped_topk_variants.h"

namespace moeext::gpu::grouped_topk {

GpuError launch_routing_variant_3(const BiasedGroupedTopkParams& params, void* stream) {
  return launch_gate_instance_variant<0, true>(params, stream);
}

}  // namespace moeext::gpu::grouped_topk
