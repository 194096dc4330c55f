// Variant 4 of the routing kernels, in a translation unit of its own (grouped_topk_variants.h):
// a plain call of a gate with its own warp kernel instance (FixedTopology ids below
// kCurrentFixedTopologies, 32-lane warps) routed one thread a token (grouped_topk_thread.h),
// at every batch size, for the A/B to find where it pays.
#include "gpu/grouped_topk_thread.h"
#include "gpu/grouped_topk_variants.h"

namespace moeext::gpu::grouped_topk {
namespace {

template <typename LogitT, typename BiasT>
Kernel variant_4_kernel(int topology) {
  static_assert(kCurrentFixedTopologies == 3, "an instance for each current fixed topology");
  switch (topology) {
    case 1: return grouped_topk_thread_kernel<LogitT, BiasT, 1, 1>;
    case 2: return grouped_topk_thread_kernel<LogitT, BiasT, 2, 1>;
  }
  return nullptr;
}

}  // namespace

// Blocks of one warp, up to 32 a multiprocessor (the most sm_90 keeps resident; DeepSeek-V3's
// 33 KiB of shared memory a block keeps six).
GpuError launch_routing_variant_4(const BiasedGroupedTopkParams& params, void* stream) {
  return launch_gate_kernel(params, kThreadKernelThreads, kThreadKernelThreads, 32, stream,
                            [](auto logits, auto bias, int gate) {
                              using LogitT = typename decltype(logits)::type;
                              using BiasT = typename decltype(bias)::type;
                              return variant_4_kernel<LogitT, BiasT>(gate);
                            });
}

}  // namespace moeext::gpu::grouped_topk
