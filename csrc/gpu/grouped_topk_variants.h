// The routing warp kernel's variants (kVariant of grouped_topk_warp.h, listed at
// moeext::gpu_routing_variant): the instances of each in a translation unit of its own,
// grouped_topk_variant<n>.cu, so that they build in parallel with each other and with the
// kernels every call runs (grouped_topk.cu), and go with their file once one has won.
#pragma once

#include <type_traits>

#include "gpu/grouped_topk_launch.h"
#include "moeext/grouped_topk.h"

namespace moeext::gpu::grouped_topk {

// Routes `params` with variant n's warp kernel: a call without options whose topology the warp
// kernel takes (plan_fast_path).
GpuError launch_routing_variant_1(const BiasedGroupedTopkParams& params, void* stream);
// Variant 2 only where the call's topology is one of the FixedTopology ids from
// kCurrentFixedTopologies (variant 2 is the current kernel elsewhere).
GpuError launch_routing_variant_2(const BiasedGroupedTopkParams& params, void* stream);
// Variant 3 only for a call with routing options whose topology is one of the FixedTopology ids
// below kCurrentFixedTopologies, on 32-lane warps (variant 3 is the current kernel elsewhere).
GpuError launch_routing_variant_3(const BiasedGroupedTopkParams& params, void* stream);
// Variant 4 only for a plain call whose topology is one of the FixedTopology ids below
// kCurrentFixedTopologies, on 32-lane warps (variant 4 is the current kernel elsewhere).
GpuError launch_routing_variant_4(const BiasedGroupedTopkParams& params, void* stream);
// Variant 5 likewise: those calls a token a block (grouped_topk_gate_block.h).
GpuError launch_routing_variant_5(const BiasedGroupedTopkParams& params, void* stream);
// Variant 6 as 1: every plain call the warp kernel takes, each lane's sigmoid scores as one
// chunk (a gate with an instance of its own in that instance).
GpuError launch_routing_variant_6(const BiasedGroupedTopkParams& params, void* stream);
// Variant 7 likewise: variant 4 with two threads a token (grouped_topk_thread.h, kSplit).
GpuError launch_routing_variant_7(const BiasedGroupedTopkParams& params, void* stream);
// Variant 8 likewise: those calls find their topk by a butterfly of list merges
// (grouped_topk_warp.h, kMergeSelect).
GpuError launch_routing_variant_8(const BiasedGroupedTopkParams& params, void* stream);

namespace {

// launch_routing_variant_<kVariant>'s body, instantiated in its file only.
template <int kVariant>
GpuError launch_plain_variant(const BiasedGroupedTopkParams& params, void* stream) {
  const int warp_size = warp_size_of_current_device();
  const FastPathPlan plan = plan_for(params, warp_size);
  const KernelArgs args = kernel_args(params, plan);
  const auto launch_for_width = [&](auto width) {
    constexpr int kWarpSize = decltype(width)::value;
    return visit_dtypes(params, [&](auto logits, auto bias) {
      using LogitT = typename decltype(logits)::type;
      using BiasT = typename decltype(bias)::type;
      return launch_warp_kernel<kWarpSize>(
          warp_kernel<kWarpSize, LogitT, BiasT, false, kVariant>(
              plan.experts_per_lane, fixed_topology_for(params, kWarpSize)),
          args, plan, stream);
    });
  };
  if (warp_size == 64) return launch_for_width(std::integral_constant<int, 64>{});
  return launch_for_width(std::integral_constant<int, 32>{});
}

// Launches, on 32-lane warps, the warp kernel instance pick(TypeTag<LogitT>, TypeTag<BiasT>,
// topology, experts_per_lane) gives for the call's dtypes and its FixedTopology id below
// id_end (fixed_topology_for).
template <typename Pick>
GpuError launch_fixed_topology_variant(const BiasedGroupedTopkParams& params, int id_end,
                                       void* stream, const Pick& pick) {
  constexpr int kWarpSize = 32;
  const int topology = fixed_topology_for(params, kWarpSize, id_end);
  const FastPathPlan plan = plan_for(params, kWarpSize);
  const KernelArgs args = kernel_args(params, plan);
  return visit_dtypes(params, [&](auto logits, auto bias) {
    return launch_warp_kernel<kWarpSize>(pick(logits, bias, topology, plan.experts_per_lane),
                                         args, plan, stream);
  });
}

// Launches, on 32-lane warps, variant kVariant's instance of the call's gate (its FixedTopology
// id below kCurrentFixedTopologies), with the routing options where kOptions.
template <int kVariant, bool kOptions>
GpuError launch_gate_instance_variant(const BiasedGroupedTopkParams& params, void* stream) {
  return launch_fixed_topology_variant(
      params, kCurrentFixedTopologies, stream,
      [](auto logits, auto bias, int topology, int lanes) -> Kernel {
        using LogitT = typename decltype(logits)::type;
        using BiasT = typename decltype(bias)::type;
        static_assert(kCurrentFixedTopologies == 3, "an instance for each current fixed topology");
        switch (topology) {
          case 1: return fixed_topology_kernel<LogitT, BiasT, kVariant, 1, kOptions>(lanes);
          case 2: return fixed_topology_kernel<LogitT, BiasT, kVariant, 2, kOptions>(lanes);
        }
        return nullptr;
      });
}

// Launches pick(TypeTag<LogitT>, TypeTag<BiasT>, topology), a kernel for the call's dtypes and
// its FixedTopology id below kCurrentFixedTopologies (32-lane warps), in blocks of `threads`
// threads that each take tokens_per_block tokens a step, at most max_blocks_per_sm blocks a
// multiprocessor (the grid then loops over the tokens). The kernels' shared memory is static.
template <typename Pick>
GpuError launch_gate_kernel(const BiasedGroupedTopkParams& params, int threads,
                            int tokens_per_block, int max_blocks_per_sm, void* stream,
                            const Pick& pick) {
  const int topology = fixed_topology_for(params, 32);
  KernelArgs args = kernel_args(params, plan_for(params, 32));
  int64_t blocks = ceil_div(params.num_tokens, tokens_per_block);
  const int64_t max_blocks = multiprocessor_count_of_current_device() * max_blocks_per_sm;
  if (blocks > max_blocks) blocks = max_blocks;
  args.warps_per_block = threads / 32;
  args.token_step = blocks * tokens_per_block;
  return visit_dtypes(params, [&](auto logits, auto bias) -> GpuError {
    const Kernel kernel = pick(logits, bias, topology);
    if (kernel == nullptr) return "biased_grouped_topk: no kernel for this gate (internal error)";
    return launch(kernel, blocks, threads, 0, stream, args);
  });
}

}  // namespace
}  // namespace moeext::gpu::grouped_topk
