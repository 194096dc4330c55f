// Biased grouped top-k routing on NVIDIA and AMD GPUs (SPEC.md section 1); builds as CUDA and
// as HIP. The tie rule, the NaN policy and the weight arithmetic are the CPU kernel's
// (csrc/cpu/grouped_topk.cpp), through the shared functions of host_device/routing.h.
//
// Two kernels, picked per topology by plan_fast_path() (grouped_topk_plan.h):
//   * warp kernel (grouped_topk_warp.h; E <= 1024, topk <= 32, num_expert_group <= 32): one
//     token per warp, each lane holding kExpertsPerLane contiguous experts in registers.
//     Decode batches are a handful of tokens, so the latency of one token is what counts:
//     each of the topk argmax rounds is a few dozen instructions on 32-bit values with two
//     warp reductions (one redux.sync each on CUDA sm_80+), and a block holds as few warps as
//     the batch allows so that tokens spread over the multiprocessors. A plain call whose
//     topology is a model gate's (FixedTopology, grouped_topk_plan.h) runs that gate's own
//     instance, with its counts constants.
//   * block kernel (grouped_topk_block.h; everything else up to kMaxExperts experts): one
//     token per block of kGeneralThreads, b and the group scores in shared memory,
//     block-wide argmax.
//
// Every kernel is templated on the logits dtype and the bias dtype (or NoBias), read as they
// are, and on the warp width; the instance whose width is not the target's compiles to an
// empty body, so that both widths build on every target and the host launches the one the
// device reports. The scoring function is a run-time switch: it is uniform across the grid,
// and templating on it would triple the instances for no gain outside the scoring loop.
//
// This file is the host side: the launch configuration of each kernel and the dispatch from
// run-time dtypes and warp width to the kernel instances (the warp kernel's in
// grouped_topk_launch.h), and the hand-over to the warp kernel's variants
// (grouped_topk_variants.h) while one is set.
#include "gpu/compat.h"
#include "gpu/grouped_topk_block.h"
#include "gpu/grouped_topk_launch.h"
#include "gpu/grouped_topk_plan.h"
#include "gpu/grouped_topk_variants.h"
#include "gpu/grouped_topk_warp.h"
#include "moeext/grouped_topk.h"

namespace moeext {
namespace gpu::grouped_topk {
namespace {

template <int kWarpSize, typename LogitT, typename BiasT, bool kOptions>
GpuError launch_typed(KernelArgs args, const FastPathPlan& plan, void* stream) {
  if (plan.experts_per_lane != 0) {
    const int topology = kOptions ? 0 : fixed_topology_for(args.p, kWarpSize);
    return launch_warp_kernel<kWarpSize>(
        warp_kernel<kWarpSize, LogitT, BiasT, kOptions, 0>(plan.experts_per_lane, topology),
        args, plan, stream);
  }
  const int64_t sms = multiprocessor_count_of_current_device();
  constexpr int kWarps = kGeneralThreads / kWarpSize;
  const GeneralSmemLayout layout =
      general_smem_layout(args.p.num_experts, args.p.num_expert_group, kWarps);
  int64_t blocks = args.p.num_tokens;
  if (blocks > sms * 8) blocks = sms * 8;
  args.warps_per_block = kWarps;
  args.token_step = blocks;
  return launch(grouped_topk_block_kernel<kWarpSize, LogitT, BiasT, kOptions>, blocks,
                kGeneralThreads,
                layout.total_words * int64_t(sizeof(uint32_t)), stream, args);
}

// The options select their own instances (kOptions), so a plain call runs no code of theirs.
template <int kWarpSize>
GpuError launch_for_width(const KernelArgs& args, const FastPathPlan& plan, void* stream) {
  return visit_dtypes(args.p, [&](auto logits, auto bias) {
    using LogitT = typename decltype(logits)::type;
    using BiasT = typename decltype(bias)::type;
    if (args.p.options.any()) {
      return launch_typed<kWarpSize, LogitT, BiasT, true>(args, plan, stream);
    }
    return launch_typed<kWarpSize, LogitT, BiasT, false>(args, plan, stream);
  });
}

GpuError launch_routing_variant(int variant, const BiasedGroupedTopkParams& params,
                                void* stream) {
  switch (variant) {
    case 1: return launch_routing_variant_1(params, stream);
    case 2: return launch_routing_variant_2(params, stream);
    case 3: return launch_routing_variant_3(params, stream);
    case 4: return launch_routing_variant_4(params, stream);
    case 5: return launch_routing_variant_5(params, stream);
    case 6: return launch_routing_variant_6(params, stream);
    case 7: return launch_routing_variant_7(params, stream);
    case 8: return launch_routing_variant_8(params, stream);
  }
  return "biased_grouped_topk: no such routing variant (internal error)";
}

// Whether variant `variant` (moeext::gpu_routing_variant) routes a warp kernel call other than
// the current kernel does; where not, the current kernel takes it.
bool variant_differs(int variant, const BiasedGroupedTopkParams& params, int warp_size) {
  const bool options = params.options.any();
  switch (variant) {
    case 1:
    case 6: return !options;
    case 2: {
      return !options &&
             fixed_topology_for(params, warp_size, kFixedTopologies) >= kCurrentFixedTopologies;
    }
    case 3: return options && fixed_topology_for(params, warp_size) != 0;
    case 4:
    case 5:
    case 7:
    case 8: return !options && fixed_topology_for(params, warp_size) != 0;
  }
  return false;
}

// "<prefix><value><suffix>" into a per-thread buffer (the message outlives the call).
const char* format_message(const char* prefix, int64_t value, const char* suffix) {
  thread_local char buffer[192];
  int n = 0;
  auto append = [&](const char* text) {
    while (*text != '\0' && n + 1 < int(sizeof(buffer))) buffer[n++] = *text++;
  };
  append(prefix);
  char digits[24];
  int count = 0;
  const bool negative = value < 0;
  uint64_t magnitude = negative ? uint64_t(0) - uint64_t(value) : uint64_t(value);
  do {
    digits[count++] = char('0' + magnitude % 10);
    magnitude /= 10;
  } while (magnitude != 0);
  if (negative) append("-");
  while (count > 0 && n + 1 < int(sizeof(buffer))) buffer[n++] = digits[--count];
  append(suffix);
  buffer[n] = '\0';
  return buffer;
}

}  // namespace
}  // namespace gpu::grouped_topk

const char* biased_grouped_topk_gpu_limit(const BiasedGroupedTopkParams& params) {
  using namespace gpu::grouped_topk;
  if (params.num_experts > kMaxExperts) {
    return format_message("biased_grouped_topk: the GPU kernels take at most 4096 experts, got ",
                          params.num_experts, "");
  }
  const int warp_size = gpu::warp_size_of_current_device();
  if (warp_size == 0) {
    return "biased_grouped_topk: the current GPU device could not be asked its warp size";
  }
  if (warp_size != 32 && warp_size != 64) {
    return format_message("biased_grouped_topk: the GPU kernels run on warps of 32 or 64 lanes, "
                          "this device's have ", warp_size, "");
  }
  return nullptr;
}

GpuError biased_grouped_topk_gpu(const BiasedGroupedTopkParams& params, void* stream) {
  using namespace gpu::grouped_topk;
  if (params.num_tokens <= 0) return nullptr;
  if (const char* limit = biased_grouped_topk_gpu_limit(params)) return limit;
  const int warp_size = gpu::warp_size_of_current_device();
  const FastPathPlan plan = plan_for(params, warp_size);
  const int variant = gpu_routing_variant();
  if (variant != 0 && plan.experts_per_lane != 0 && variant_differs(variant, params, warp_size)) {
    return launch_routing_variant(variant, params, stream);
  }
  const KernelArgs args = kernel_args(params, plan);
  if (warp_size == 64) return launch_for_width<64>(args, plan, stream);
  return launch_for_width<32>(args, plan, stream);
}

}  // namespace moeext
