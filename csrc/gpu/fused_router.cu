// Fused router on the GPU (SPEC.md section 7): the small-T router GEMM and the warp routing
// kernel as one launch, for decode sizes.
//
// Each block of the GEMM computes its slice of the experts' logits into the logits buffer,
// exactly as router_gemm.cu's kernel does (the same function, router_gemm_block.h), then
// counts itself done on a completion counter; the block that counts last sees every logit
// and routes all the tokens, a token per warp, with the warp routing kernel's own function
// (grouped_topk_warp.h). In fused router variant 3 a plain call of a gate with its own warp
// kernel instance routes with that instance, and a single token with the whole last block
// (grouped_topk_gate_block.h). So the ids and weights are those of router_gemm_gpu then
// biased_grouped_topk_gpu, bit for bit; what goes is the second launch and the time between
// the two kernels.
//
// The counter: every thread fences its logits stores before its block counts (the pattern
// of the CUDA programming guide's last-block reduction); the last block resets the counter
// to zero, so the next launch on the stream, or the next replay of a captured graph, starts
// from zero with no host involvement. Two launches running at once must not share a counter:
// fused_router_gpu_counter hands one out per stream and per graph capture.
#include <functional>
#include <mutex>
#include <unordered_map>

#include "gpu/compat.h"
#include "gpu/grouped_topk_gate_block.h"
#include "gpu/grouped_topk_plan.h"
#include "gpu/grouped_topk_warp.h"
#include "gpu/router_gemm_block.h"
#include "gpu/router_gemm_tiling.h"
#include "moeext/fused_router.h"

namespace moeext {
namespace {

using gpu::grouped_topk::KernelArgs;
using gpu::grouped_topk::NoBias;
using gpu::router_gemm::kThreads;

// The bias registers of an instance that routes with the whole block (load_gate_bias), 1 for
// any other (unused).
template <int kTopology, bool kGateBlock>
MOEEXT_HOST_DEVICE constexpr int gate_bias_slots() {
  if constexpr (kGateBlock) {
    return gpu::grouped_topk::GateBlockShape<kTopology, kThreads>::kPerThread;
  } else {
    return 1;
  }
}

// The one launch routes with the warp kernel's instances up to 512 experts; wider gates run
// the two kernels. (The warp kernel goes to 1024: its wider instances here would add as many
// kernels again to this file's build, for gates not yet timed on a GPU.)
constexpr int64_t kMaxExperts = 512;
MOEEXT_HOST_DEVICE constexpr bool routes_in_one_launch(int warp_size, int experts_per_lane) {
  return gpu::grouped_topk::fast_instance_exists(warp_size, experts_per_lane) &&
         int64_t(warp_size) * experts_per_lane <= kMaxExperts;
}

struct FusedArgs {
  RouterGemmParams gemm;
  KernelArgs routing;
  unsigned* counter;
  unsigned blocks;
};

// Whether this block is the last of the grid to be done with its logits; then every other
// block's logits are visible to all its threads. Every thread of the block calls it.
// kCounterVariant (moeext::gpu_fused_router_variant less one) 0: every thread fences before
// the count, and again in the last block after it; 1: a barrier, then thread 0 counts with one
// acquire-release atomic (gpu::fetch_add_acq_rel) and a barrier hands its acquire on.
template <int kCounterVariant>
__device__ __forceinline__ bool finished_last(unsigned* counter, unsigned blocks) {
  __shared__ bool last;
  if constexpr (kCounterVariant == 0) __threadfence();  // this thread's logits, first
  __syncthreads();
  if (gpu::grouped_topk::thread_index() == 0) {
    const unsigned done_before = kCounterVariant == 0 ? atomicAdd(counter, 1u)
                                                      : gpu::fetch_add_acq_rel(counter, 1u);
    last = done_before == blocks - 1;
    // Every block has counted: the counter is free for the next launch.
    if (last) atomicExch(counter, 0u);
  }
  __syncthreads();
  if (kCounterVariant == 0 && last) __threadfence();
  return last;
}

// One instance per (tokens, warp width, experts per lane, bias dtype, options, and for plain
// calls whether the blocks prefetch their weight rows, prefetches_weight_rows, the
// completion count's variant, moeext::gpu_fused_router_variant 2, and kGateTopology); the
// input is bfloat16 and the logits fp32.
// kGateTopology: 0, the last block's warps route a token each; or a FixedTopology id, the
// gate's own routing (variant 3): a single token with all the last block's threads
// (route_tokens_per_block), more with the warp kernel's own instance of the gate.
// Instances for a warp width other than the target's, or for a width and experts_per_lane
// with no warp routing kernel, compile to an empty body.
template <int kTokens, int kWarpSize, int V, typename BiasT, bool kOptions, int kPrefetch = 0,
          int kCounterVariant = 0, int kGateTopology = 0>
__global__ void __launch_bounds__(kThreads, gpu::router_gemm_min_blocks_per_sm(kTokens))
    fused_router_kernel(const FusedArgs args) {
  static_assert(kGateTopology == 0 || (kThreads == gpu::grouped_topk::kGateBlockThreads &&
                                       kWarpSize == 32 && !kOptions),
                "a gate's own routing: plain calls, the GEMM's 256 threads as 32-lane warps");
  if constexpr (kWarpSize == MOEEXT_DEVICE_WARP_SIZE && routes_in_one_launch(kWarpSize, V)) {
    if constexpr (kPrefetch == 1) {
      gpu::router_gemm::prefetch_weight_rows<kTokens, gpu::bf16>(
          args.gemm, int(gpu::grouped_topk::block_index()));
    }
    // Before the completion counter too: the grid before this one on the stream may be
    // another fused_router launch, which shares the stream's counter and whose last block may
    // still be reading logits where this one writes its own.
    gpu::wait_for_prior_grids();
    gpu::allow_dependent_grids();
    constexpr bool kGateBlock = kGateTopology != 0 && kTokens == 1;
    // Read by every block (the last one is not known yet), its latency under the GEMM's.
    [[maybe_unused]] float gate_bias[gate_bias_slots<kGateTopology, kGateBlock>()];
    if constexpr (kGateBlock) {
      gpu::grouped_topk::load_gate_bias<kGateTopology, BiasT>(args.routing, gate_bias);
    }
    gpu::router_gemm::compute_logits_block<kTokens, kWarpSize, gpu::bf16, float>(
        args.gemm, int(gpu::grouped_topk::block_index()));
    if (!finished_last<kCounterVariant>(args.counter, args.blocks)) return;
    if constexpr (kGateBlock) {
      gpu::grouped_topk::route_tokens_per_block<kGateTopology, BiasT>(args.routing, gate_bias);
    } else {
      gpu::grouped_topk::route_tokens_per_warp<kWarpSize, V, float, BiasT, kOptions, 0,
                                               kGateTopology>(args.routing);
    }
  } else {
    (void)args;  // never launched for this target
  }
}

using Kernel = void (*)(FusedArgs);

// What a plain call's instance does: prefetch its weight rows (1) or not, and how it counts
// (kCounterVariant).
struct PlainVariants {
  int prefetch;
  int counter;
};

template <int kTokens, int kWarpSize, int V, typename BiasT>
Kernel pick_options(bool options, PlainVariants plain) {
  if (options) return fused_router_kernel<kTokens, kWarpSize, V, BiasT, true>;
  switch (plain.prefetch * 2 + plain.counter) {
    case 1: return fused_router_kernel<kTokens, kWarpSize, V, BiasT, false, 0, 1>;
    case 2: return fused_router_kernel<kTokens, kWarpSize, V, BiasT, false, 1, 0>;
    case 3: return fused_router_kernel<kTokens, kWarpSize, V, BiasT, false, 1, 1>;
    default: return fused_router_kernel<kTokens, kWarpSize, V, BiasT, false>;
  }
}

// Variant 3's instances: 32-lane warps, a gate of the warp kernel's own instances (whose
// experts per lane fill the warp), counted as variant 2 counts.
template <int kTokens, int kTopology, typename BiasT>
Kernel pick_gate_prefetch(int prefetch) {
  constexpr int V = gpu::grouped_topk::fixed_topology(kTopology).num_experts / 32;
  return prefetch == 1 ? fused_router_kernel<kTokens, 32, V, BiasT, false, 1, 1, kTopology>
                       : fused_router_kernel<kTokens, 32, V, BiasT, false, 0, 1, kTopology>;
}

template <int kTokens>
Kernel pick_gate_topology(int topology, bool bias, int prefetch) {
  switch (topology) {
    case 1: {
      return bias ? pick_gate_prefetch<kTokens, 1, float>(prefetch)
                  : pick_gate_prefetch<kTokens, 1, NoBias>(prefetch);
    }
    case 2: {
      return bias ? pick_gate_prefetch<kTokens, 2, float>(prefetch)
                  : pick_gate_prefetch<kTokens, 2, NoBias>(prefetch);
    }
    default: return nullptr;
  }
}

Kernel pick_gate(int token_tile, int topology, bool bias, int prefetch) {
  switch (token_tile) {
    case 1: return pick_gate_topology<1>(topology, bias, prefetch);
    case 2: return pick_gate_topology<2>(topology, bias, prefetch);
    case 4: return pick_gate_topology<4>(topology, bias, prefetch);
    case 8: return pick_gate_topology<8>(topology, bias, prefetch);
    case 16: return pick_gate_topology<16>(topology, bias, prefetch);
    default: return nullptr;
  }
}

template <int kTokens, int kWarpSize, int V>
Kernel pick_bias(bool bias, bool options, PlainVariants plain) {
  return bias ? pick_options<kTokens, kWarpSize, V, float>(options, plain)
              : pick_options<kTokens, kWarpSize, V, NoBias>(options, plain);
}

template <int kTokens, int kWarpSize>
Kernel pick_experts_per_lane(int experts_per_lane, bool bias, bool options,
                             PlainVariants plain) {
  switch (experts_per_lane) {
    case 4: return pick_bias<kTokens, kWarpSize, 4>(bias, options, plain);
    case 8: return pick_bias<kTokens, kWarpSize, 8>(bias, options, plain);
    case 12: return pick_bias<kTokens, kWarpSize, 12>(bias, options, plain);
    case 16: return pick_bias<kTokens, kWarpSize, 16>(bias, options, plain);
    default: return nullptr;
  }
}

template <int kWarpSize>
Kernel pick_tokens(int token_tile, int experts_per_lane, bool bias, bool options,
                   PlainVariants plain) {
  switch (token_tile) {
    case 1: return pick_experts_per_lane<1, kWarpSize>(experts_per_lane, bias, options, plain);
    case 2: return pick_experts_per_lane<2, kWarpSize>(experts_per_lane, bias, options, plain);
    case 4: return pick_experts_per_lane<4, kWarpSize>(experts_per_lane, bias, options, plain);
    case 8: return pick_experts_per_lane<8, kWarpSize>(experts_per_lane, bias, options, plain);
    case 16: return pick_experts_per_lane<16, kWarpSize>(experts_per_lane, bias, options, plain);
    default: return nullptr;
  }
}

// ---- Completion counters -----------------------------------------------------------------

constexpr int kMaxDevices = 64;
// Per device: one per stream that runs the kernel outside a capture, one per capture.
constexpr int kCountersPerDevice = 4096;

struct CounterKey {
  void* stream;
  unsigned long long capture;  // 0 outside a capture
  bool operator==(const CounterKey& other) const {
    return stream == other.stream && capture == other.capture;
  }
};

struct CounterKeyHash {
  size_t operator()(const CounterKey& k) const {
    return std::hash<void*>()(k.stream) ^ (std::hash<unsigned long long>()(k.capture) * 31u);
  }
};

struct DeviceCounters {
  unsigned* counters = nullptr;  // kCountersPerDevice, zeroed once, never freed
  std::unordered_map<CounterKey, int, CounterKeyHash> handed_out;
};

std::mutex counters_mutex;
DeviceCounters device_counters[kMaxDevices];

}  // namespace

bool fused_router_gpu_supported(const FusedRouterParams& params) {
  const RouterGemmParams& g = params.gemm;
  const BiasedGroupedTopkParams& r = params.routing;
  if (g.input_dtype != DType::kBFloat16 || g.logits_dtype != DType::kFloat32) return false;
  if (g.num_tokens < 1 || g.hidden_size < 1 || g.num_experts < 1) return false;
  if (r.gating_output != g.logits || r.gating_dtype != DType::kFloat32 ||
      r.num_tokens != g.num_tokens || r.num_experts != g.num_experts ||
      r.gating_col_stride != 1 || r.gating_row_stride != g.logits_row_stride) {
    return false;
  }
  if (r.correction_bias != nullptr && r.bias_dtype != DType::kFloat32) return false;
  if (biased_grouped_topk_gpu_limit(r) != nullptr) return false;
  const int warp_size = gpu::warp_size_of_current_device();
  const int experts_per_lane = gpu::grouped_topk::plan_for(r, warp_size).experts_per_lane;
  if (experts_per_lane == 0 || !routes_in_one_launch(warp_size, experts_per_lane)) {
    return false;
  }
  return router_gemm_gpu_supported(g);
}

GpuError fused_router_gpu(const FusedRouterParams& params, void* stream) {
  if (params.completion_counter == nullptr) return "fused_router_gpu: no completion counter";
  if (!fused_router_gpu_supported(params)) {
    return "fused_router_gpu: params not supported by the one-launch kernel; check "
           "fused_router_gpu_supported";
  }
  const int warp_size = gpu::warp_size_of_current_device();
  const BiasedGroupedTopkParams& r = params.routing;
  const gpu::grouped_topk::FastPathPlan plan = gpu::grouped_topk::plan_for(r, warp_size);
  const int token_tile = gpu::router_gemm_token_tile(params.gemm.num_tokens);
  const int warps = kThreads / warp_size;

  FusedArgs args;
  args.gemm = params.gemm;
  args.routing = gpu::grouped_topk::kernel_args(r, plan);
  // Warp w of a routing block starts at token block * warps_per_block + w: with 0 here the
  // last block's warps, whichever block it is, take tokens w, w + warps, ...
  args.routing.warps_per_block = 0;
  args.routing.token_step = warps;
  args.counter = params.completion_counter;
  args.blocks = unsigned(gpu::router_gemm_blocks(token_tile, params.gemm.num_experts));

  const bool bias = r.correction_bias != nullptr;
  const bool options = r.options.any();
  // Plain calls only, as router_gemm's kernel decides the prefetch.
  const int variant = gpu_fused_router_variant();
  const PlainVariants plain{gpu::router_gemm::prefetches_weight_rows(params.gemm) ? 1 : 0,
                            variant >= 2 ? 1 : 0};
  // Variant 3: a plain call of a gate with its own warp kernel instance routes with that
  // gate's code.
  const int gate =
      variant == 3 && !options ? gpu::grouped_topk::fixed_topology_for(r, warp_size) : 0;
  Kernel kernel = nullptr;
  if (gate != 0) {
    kernel = pick_gate(token_tile, gate, bias, plain.prefetch);
  } else if (warp_size == 64) {
    kernel = pick_tokens<64>(token_tile, plan.experts_per_lane, bias, options, plain);
  } else {
    kernel = pick_tokens<32>(token_tile, plan.experts_per_lane, bias, options, plain);
  }
  if (kernel == nullptr) return "fused_router_gpu: no kernel instance for these params";
  const int64_t smem_bytes = gpu::grouped_topk::fast_smem_bytes(plan, r.num_experts, warps);
  return gpu::launch_dependent(kernel, dim3(args.blocks), dim3(kThreads), size_t(smem_bytes),
                              gpu::as_stream(stream), args);
}

unsigned* fused_router_gpu_counter(void* stream) {
  int device = 0;
  if (gpu::current_device(&device) != gpu::kSuccess || device < 0 || device >= kMaxDevices) {
    (void)gpu::last_error();
    return nullptr;
  }
  bool capturing = false;
  unsigned long long capture = 0;
  if (gpu::stream_capture(gpu::as_stream(stream), &capturing, &capture) != gpu::kSuccess) {
    (void)gpu::last_error();
    return nullptr;
  }
  if (!capturing) capture = 0;
  const std::lock_guard<std::mutex> lock(counters_mutex);
  DeviceCounters& d = device_counters[device];
  if (d.counters == nullptr) {
    // An allocation would end the capture; the counters come with the first call outside one.
    if (capturing) return nullptr;
    void* memory = nullptr;
    const size_t bytes = kCountersPerDevice * sizeof(unsigned);
    if (gpu::device_malloc(&memory, bytes) != gpu::kSuccess) {
      (void)gpu::last_error();
      return nullptr;
    }
    // Zero before any stream may use them: the wait is once per device.
    if (gpu::memset_async(memory, 0, bytes, gpu::as_stream(stream)) != gpu::kSuccess ||
        gpu::stream_synchronize(gpu::as_stream(stream)) != gpu::kSuccess) {
      (void)gpu::last_error();
      return nullptr;  // the 16 KB leak: a runtime that cannot zero them has failed already
    }
    d.counters = static_cast<unsigned*>(memory);
  }
  const CounterKey key{stream, capture};
  const auto found = d.handed_out.find(key);
  if (found != d.handed_out.end()) return d.counters + found->second;
  const int next = int(d.handed_out.size());
  if (next == kCountersPerDevice) return nullptr;
  d.handed_out.emplace(key, next);
  return d.counters + next;
}

}  // namespace moeext
