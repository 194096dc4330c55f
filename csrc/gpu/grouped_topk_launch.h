// The host side of launching the biased grouped top-k warp kernel, shared by grouped_topk.cu
// (the kernels every call runs) and grouped_topk_variant<n>.cu (the warp kernel's variants,
// one translation unit each so that they build in parallel): the kernel's arguments, its
// launch shape for a batch, and the dispatch from run-time dtypes to template types.
#pragma once

#include "gpu/compat.h"
#include "gpu/grouped_topk_plan.h"
#include "gpu/grouped_topk_warp.h"
#include "moeext/grouped_topk.h"

namespace moeext::gpu::grouped_topk {
namespace {

using Kernel = void (*)(KernelArgs);

GpuError launch(Kernel kernel, int64_t blocks, int threads, int64_t smem_bytes, void* stream,
                KernelArgs args) {
  return launch_dependent(kernel, dim3(unsigned(blocks)), dim3(unsigned(threads)),
                          size_t(smem_bytes), as_stream(stream), args);
}

[[maybe_unused]] int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The model gate's instance (FixedTopology id kTopology) of warp kernel variant kVariant, with
// the routing options where kOptions, where the plan gives it its lanes.
template <typename LogitT, typename BiasT, int kVariant, int kTopology, bool kOptions = false>
Kernel fixed_topology_kernel(int experts_per_lane) {
  constexpr int V = fixed_topology(kTopology).num_experts / 32;
  return experts_per_lane == V ? Kernel(grouped_topk_warp_kernel<32, V, LogitT, BiasT, kOptions,
                                                                 kVariant, kTopology>)
                               : nullptr;
}

// The warp kernel instance for experts_per_lane, or null. A plain call of the current kernel
// (or of variant 6) on 32-lane warps whose topology is FixedTopology `topology`
// (fixed_topology_for) runs that model gate's instance.
template <int kWarpSize, typename LogitT, typename BiasT, bool kOptions, int kVariant>
Kernel warp_kernel(int experts_per_lane, int topology = 0) {
  if constexpr (kWarpSize == 32 && !kOptions && (kVariant == 0 || kVariant == 6)) {
    static_assert(kCurrentFixedTopologies == 3, "an instance for each current fixed topology");
    if (topology == 1) return fixed_topology_kernel<LogitT, BiasT, kVariant, 1>(experts_per_lane);
    if (topology == 2) return fixed_topology_kernel<LogitT, BiasT, kVariant, 2>(experts_per_lane);
  } else {
    (void)topology;
  }
  return pick_experts_per_lane<kWarpSize, Kernel>(experts_per_lane, nullptr, [](auto v) {
    return Kernel(grouped_topk_warp_kernel<kWarpSize, decltype(v)::value, LogitT, BiasT,
                                           kOptions, kVariant>);
  });
}

// Launches a warp kernel instance for the plan's width. One warp per multiprocessor while
// the batch is small (decode: each token's latency is the cost), more warps per block as it
// grows; the grid then loops over the tokens.
template <int kWarpSize>
GpuError launch_warp_kernel(Kernel kernel, KernelArgs args, const FastPathPlan& plan,
                            void* stream) {
  if (kernel == nullptr) {
    return "biased_grouped_topk: no warp kernel for this plan (internal error)";
  }
  const int64_t num_tokens = args.p.num_tokens;
  const int64_t sms = multiprocessor_count_of_current_device();
  constexpr int64_t kMaxWarpsPerBlock = kMaxThreadsPerBlock / kWarpSize;
  int64_t warps_per_block = ceil_div(num_tokens, sms);
  if (warps_per_block > kMaxWarpsPerBlock) warps_per_block = kMaxWarpsPerBlock;
  int64_t blocks = ceil_div(num_tokens, warps_per_block);
  if (blocks > sms * 16) blocks = sms * 16;
  args.warps_per_block = int(warps_per_block);
  args.token_step = blocks * warps_per_block;
  return launch(kernel, blocks, int(warps_per_block * kWarpSize),
                fast_smem_bytes(plan, args.p.num_experts, warps_per_block), stream, args);
}

template <typename T>
struct TypeTag {
  using type = T;
};

// f(TypeTag<LogitT>{}, TypeTag<BiasT>{}) for the call's logits and bias dtypes (NoBias
// without a bias).
template <typename F>
GpuError visit_dtypes(const BiasedGroupedTopkParams& p, const F& f) {
  const auto with_bias = [&](auto logits) -> GpuError {
    if (p.correction_bias == nullptr) return f(logits, TypeTag<NoBias>{});
    switch (p.bias_dtype) {
      case DType::kFloat32: return f(logits, TypeTag<float>{});
      case DType::kBFloat16: return f(logits, TypeTag<bf16>{});
      case DType::kFloat16: return f(logits, TypeTag<fp16>{});
    }
    return "biased_grouped_topk: unknown correction_bias dtype";
  };
  switch (p.gating_dtype) {
    case DType::kFloat32: return with_bias(TypeTag<float>{});
    case DType::kBFloat16: return with_bias(TypeTag<bf16>{});
    case DType::kFloat16: return with_bias(TypeTag<fp16>{});
  }
  return "biased_grouped_topk: unknown gating_output dtype";
}

}  // namespace
}  // namespace moeext::gpu::grouped_topk
