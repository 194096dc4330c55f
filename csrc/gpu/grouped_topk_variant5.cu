// Variant 5 of the routing kernels, in a translation unit of its own (grouped_topk_variants.h):
// a plain call of a gate with its own warp kernel instance (FixedTopology ids below
// kCurrentFixedTopologies, 32-lane warps) routed a token a block of 256 threads, with the
// fused router's single-token code (grouped_topk_gate_block.h): ranks counted in parallel in
// place of one warp's argmax rounds, for a decode token's latency. At every batch size, for
// the A/B to say where it pays.
#include "gpu/grouped_topk_gate_block.h"
#include "gpu/grouped_topk_variants.h"

namespace moeext::gpu::grouped_topk {
namespace {

template <typename LogitT, typename BiasT, int kTopology>
__global__ void __launch_bounds__(kGateBlockThreads)
    grouped_topk_gate_block_kernel(const KernelArgs args) {
  if constexpr (MOEEXT_DEVICE_WARP_SIZE == 32) {
    wait_for_prior_grids();
    allow_dependent_grids();
    float bias[GateBlockShape<kTopology, kGateBlockThreads>::kPerThread];
    load_gate_bias<kTopology, BiasT>(args, bias);
    route_tokens_per_block<kTopology, BiasT, kGateBlockThreads, LogitT>(
        args, bias, block_index(), args.token_step);
  } else {
    (void)args;  // 32-lane warps only: never launched here
  }
}

template <typename LogitT, typename BiasT>
Kernel variant_5_kernel(int topology) {
  static_assert(kCurrentFixedTopologies == 3, "an instance for each current fixed topology");
  switch (topology) {
    case 1: return grouped_topk_gate_block_kernel<LogitT, BiasT, 1>;
    case 2: return grouped_topk_gate_block_kernel<LogitT, BiasT, 2>;
  }
  return nullptr;
}

}  // namespace

GpuError launch_routing_variant_5(const BiasedGroupedTopkParams& params, void* stream) {
  return launch_gate_kernel(params, kGateBlockThreads, 1, 8, stream,
                            [](auto logits, auto bias, int gate) {
                              using LogitT = typename decltype(logits)::type;
                              using BiasT = typename decltype(bias)::type;
                              return variant_5_kernel<LogitT, BiasT>(gate);
                            });
}

}  // namespace moeext::gpu::grouped_topk
