// Types shared by every launcher in the plain C++ API. No torch here: the torch bindings and
// the C++ benchmark binary both fill these in.
#pragma once

#include <atomic>
#include <cstdint>

// Functions the host and the GPU kernels share (key packing, index arithmetic) are marked
// with this, so the host build, and its unit tests, compile the very code the device runs.
#if defined(__CUDACC__) || defined(__HIPCC__)
#define MOEEXT_HOST_DEVICE __host__ __device__
#else
#define MOEEXT_HOST_DEVICE
#endif

namespace moeext {

// Every *_gpu launcher enqueues its work on `stream` (a cudaStream_t, or a hipStream_t
// when built as HIP) on the current device, allocates nothing, never synchronises, and
// returns nullptr, or a message: the runtime's when a launch failed, the launcher's own for
// params or a device it does not take (nothing is launched then).
using GpuError = const char*;

// The element types a kernel may be asked to read. The bindings map torch dtypes onto these.
enum class DType : int8_t {
  kFloat32,
  kBFloat16,
  kFloat16,
};

// The integer element types of ids and counts.
enum class IntType : int8_t {
  kInt16,
  kInt32,
  kInt64,
};

// Instruction-set paths of the CPU kernels, best last. kAuto means "the best this CPU runs".
enum class CpuIsa : int8_t {
  kAuto = -1,
  kPortable = 0,  // generic vectors of the compiler: aarch64, x86-64 without AVX2
  kAvx2 = 1,        // AVX2 + FMA + F16C: routing, router_gemm and e8m0_shuffle
  kAvx512 = 2,
  kAvx512Bf16 = 3,  // AVX-512 plus vdpbf16ps (Zen 4/5, Cooper Lake, Sapphire Rapids)
};

// The best path this binary has and this CPU (and OS) supports.
CpuIsa cpu_isa_best();
// The path the CPU kernels use now: the best one unless forced, by set_cpu_isa() or by the
// environment variable MOEEXT_CPU_ISA=portable|avx2|avx512|avx512bf16 read once at start.
CpuIsa cpu_isa_active();
// Forces a path (kAuto restores the best one). Returns false, changing nothing, when the
// binary or the CPU lacks it. Each launcher call reads the path when it starts, so the
// chunks of one op split over threads may run on both sides of a switch made meanwhile.
bool set_cpu_isa(CpuIsa isa);
const char* cpu_isa_name(CpuIsa isa);
// Whether this binary has the path and this CPU (and OS) runs it.
bool cpu_isa_supported(CpuIsa isa);

// Programmatic dependent launch (PDL) of the decode-path GPU kernels (routing, router GEMM,
// fused router, routing_weights): off unless set. When on, the *_gpu launchers of those
// kernels launch them so that each may start while the kernel before it on the stream is still
// running (CUDA's programmatic stream serialization); each kernel then waits for that kernel's
// results before its first global memory access, so results are the same bits either way.
// It takes effect on CUDA devices of compute capability 9.0 or newer that run this build's
// sm_90+ code (gpu_programmatic_dependent_launch_supported); elsewhere, and always on HIP, the
// launch is the plain one. Each launcher reads the setting when it launches: a CUDA graph
// keeps the mode that was set while it was captured. A process-wide setting rather than a
// field of each params struct, so that the torch ops take no new argument (their schemas,
// fakes and traced graphs are the same in both modes) and one switch covers every op.
namespace detail {
// One flag per binary: an inline function's static is a single object wherever the header is
// included (the kernel library, the torch glue and the GPU launchers all link into one module).
inline std::atomic<bool>& programmatic_dependent_launch_flag() {
  static std::atomic<bool> enabled{false};
  return enabled;
}
}  // namespace detail

inline bool gpu_programmatic_dependent_launch() {
  return detail::programmatic_dependent_launch_flag().load(std::memory_order_relaxed);
}
// Sets the mode; returns the previous one.
inline bool set_gpu_programmatic_dependent_launch(bool enabled) {
  return detail::programmatic_dependent_launch_flag().exchange(enabled,
                                                               std::memory_order_relaxed);
}
// Whether kernels launched now on the current GPU device would use PDL if it were on. Defined
// by GPU builds only (csrc/gpu/device.cu).
bool gpu_programmatic_dependent_launch_supported();

// The variants of the routing kernels (grouped_topk_warp.h's kVariant, the thread kernel of
// grouped_topk_thread.h and the block kernel of grouped_topk_variant5.cu): more
// biased_grouped_topk instances that compute the same bits by other instructions, kept beside
// the current one (variant 0) so that all can be timed in one process on a GPU (bench_cuda.py
// --only routing_variant, and --only routing_options_variant for 3) before the fastest becomes
// the only one. 0 unless set; a developer's switch (moeext._C), not part of the API. Read by
// the launcher at launch, so a CUDA graph keeps the variant that was set while it was captured.
//   1: the kernel before the sorted lanes and the model gates' own instances
//      (grouped_topk_warp.h, sorts_lanes; grouped_topk_plan.h, FixedTopology): an argmax
//      round over every expert a lane holds, the weight sum over every lane;
//   2: the current kernel, with an instance of its own for more model gates (DeepSeek-V4-Flash
//      and -Pro, a Nemotron-style 512 experts top 22; FixedTopology ids 3-5);
//   3: the current kernel, but a call with routing options of a gate with its own instance
//      (DeepSeek-V3/R1, Kimi-K2) runs that instance with the options, where the current
//      kernel runs the generic options instance;
//   4: the current kernel, but a plain call of those gates routed one thread a token
//      (grouped_topk_thread.h), at every batch size, for the A/B at prefill sizes;
//   5: as 4, but a token a block of 256 threads, ranks counted in parallel in place of the
//      argmax rounds (grouped_topk_gate_block.h, the fused router's single-token code), for
//      the A/B at decode sizes;
//   6: the current kernel, each lane's sigmoid scores computed as one chunk with one range
//      test for their reciprocals (sigmoid_scores) and no NaN tests once b is NaN-free, for
//      every plain call the warp kernel takes;
//   7: as 4, but two threads a token (grouped_topk_thread.h, kSplit), twice the warps;
//   8: the current kernel, but a plain call of those gates finds its topk by merging the
//      lanes' sorted lists over a butterfly (merge_top_keys) in place of topk argmax rounds,
//      for the A/B at decode sizes.
constexpr int kGpuRoutingVariants = 9;
namespace detail {
// The variant set for one kind of kernel (kKind: 0 routing, 1 router GEMM, 2 fused router's
// completion count), one flag per binary
// as programmatic_dependent_launch_flag is.
template <int kKind>
inline std::atomic<int>& variant_flag() {
  static std::atomic<int> variant{0};
  return variant;
}
}  // namespace detail

inline int gpu_routing_variant() {
  return detail::variant_flag<0>().load(std::memory_order_relaxed);
}
// Sets the variant (0 <= variant < kGpuRoutingVariants, checked by the caller); returns the
// previous one.
inline int set_gpu_routing_variant(int variant) {
  return detail::variant_flag<0>().exchange(variant, std::memory_order_relaxed);
}

// The variants of the small-T router GEMM kernel, and of the fused router's plain kernel that
// computes its logits the same way (router_gemm_block.h), on the same terms as the routing
// variants above (bench_cuda.py --only router_gemm_variant). The current kernel has each
// block ask L2 for its weight rows before it waits for the grid before it where the launch is
// programmatic (prefetches_weight_rows), so that the weight streams from memory while that
// grid finishes (CUDA only):
//   1: never (the kernel until 2026-11-30; with PDL the same bits, slower on an H200);
//   2: the 4-token tile (3 or 4 tokens) compiled for three blocks a multiprocessor, where the
//      current one has two, so that Kimi-K2's 384 blocks take one wave of an H200, not two
//      (router_gemm_tiling.h; router_gemm only, not the fused router's one launch);
//   3: the 4-token tile with two experts a block (192 blocks at Kimi-K2), likewise.
constexpr int kGpuRouterGemmVariants = 4;
inline int gpu_router_gemm_variant() {
  return detail::variant_flag<1>().load(std::memory_order_relaxed);
}
inline int set_gpu_router_gemm_variant(int variant) {  // as set_gpu_routing_variant
  return detail::variant_flag<1>().exchange(variant, std::memory_order_relaxed);
}

// How a GPU fused_router call runs, on the same terms (bench_cuda.py --only
// fused_router_variant); they combine with the router GEMM variant set:
//   0: router_gemm_gpu's kernel and then biased_grouped_topk_gpu's, two launches (on an H200,
//      2026-11-30, 0.70-1.01x the one launch's time at T <= 16, with or without PDL);
//   1: the one launch (fused_router_gpu) where it takes the call: every thread fences
//      (sequentially consistent) before its block counts itself done, and again in the last
//      block after the count (fused_router.cu, kCounterVariant 0);
//   2: the one launch, each block's threads meeting at a barrier and thread 0 counting the
//      block with one acquire-release atomic (kCounterVariant 1; plain calls only, a call
//      with options counts as 1 does);
//   3: as 2, and a plain call of a gate with its own warp kernel instance (DeepSeek-V3/R1,
//      Kimi-K2) routed by the gate's own code: a single token by all the last block's
//      threads, ranks counted in parallel in place of one warp's argmax rounds
//      (grouped_topk_gate_block.h), more tokens by that instance; other calls as 2.
constexpr int kGpuFusedRouterVariants = 4;
inline int gpu_fused_router_variant() {
  return detail::variant_flag<2>().load(std::memory_order_relaxed);
}
inline int set_gpu_fused_router_variant(int variant) {  // as set_gpu_routing_variant
  return detail::variant_flag<2>().exchange(variant, std::memory_order_relaxed);
}

}  // namespace moeext
