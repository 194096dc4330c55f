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
    case 1: return grouped_topk_thread_kernel<LogitT, BiasT, 1>;
    case 2: return grouped_topk_thread_kernel<LogitT, BiasT, 2>;
  }
  return nullptr;
}

}  // namespace

GpuError launch_routing_variant_4(const BiasedGroupedTopkParams& params, void* stream) {
  const int topology = fixed_topology_for(params, 32);
  KernelArgs args = kernel_args(params, plan_for(params, 32));
  const int64_t sms = multiprocessor_count_of_current_device();
  int64_t blocks = ceil_div(params.num_tokens, kThreadKernelThreads);
  if (blocks > sms * 16) blocks = sms * 16;
  args.warps_per_block = kThreadKernelThreads / 32;
  args.token_step = blocks * kThreadKernelThreads;
  return visit_dtypes(params, [&](auto logits, auto bias) -> GpuError {
    using LogitT = typename decltype(logits)::type;
    using BiasT = typename decltype(bias)::type;
    const Kernel kernel = variant_4_kernel<LogitT, BiasT>(topology);
    if (kernel == nullptr) {
      return "biased_grouped_topk: no thread kernel for this gate (internal error)";
    }
    return launch(kernel, blocks, kThreadKernelThreads, thread_kernel_smem_bytes(topology),
                  stream, args);
  });
}

}  // namespace moeext::gpu::grouped_topk
