// Variant 7 of the routing kernels, in a translation unit of its own (grouped_topk_variants.h):
// variant 4 with two threads a token (grouped_topk_thread.h, kSplit 2), twice the warps for a
// batch, for the A/B at prefill sizes.
#include "gpu/grouped_topk_thread.h"
#include "gpu/grouped_topk_variants.h"

namespace moeext::gpu::grouped_topk {
namespace {

template <typename LogitT, typename BiasT>
Kernel variant_7_kernel(int topology) {
  static_assert(kCurrentFixedTopologies == 3, "an instance for each current fixed topology");
  switch (topology) {
    case 1: return grouped_topk_thread_kernel<LogitT, BiasT, 1, 2>;
    case 2: return grouped_topk_thread_kernel<LogitT, BiasT, 2, 2>;
  }
  return nullptr;
}

}  // namespace

// Blocks of one warp, 16 tokens each, up to 32 a multiprocessor (DeepSeek-V3's 21 KiB of shared
// memory a block keeps ten).
GpuError launch_routing_variant_7(const BiasedGroupedTopkParams& params, void* stream) {
  return launch_gate_kernel(params, kThreadKernelThreads, kThreadKernelThreads / 2, 32, stream,
                            [](auto logits, auto bias, int gate) {
                              using LogitT = typename decltype(logits)::type;
                              using BiasT = typename decltype(bias)::type;
                              return variant_7_kernel<LogitT, BiasT>(gate);
                            });
}

}  // namespace moeext::gpu::grouped_topk
