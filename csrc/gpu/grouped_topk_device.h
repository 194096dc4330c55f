// What both biased grouped top-k GPU kernels (grouped_topk_warp.h, grouped_topk_block.h)
// use: the arguments they are launched with, their launch bounds, and the warp-level device
// helpers they share. CUDA and HIP alike, through compat.h.
// Included by the routing .cu files (grouped_topk.cu, routing_weights.cu): the anonymous
// namespace keeps each one's instances internal to it.
#pragma once

#include "gpu/compat.h"
#include "gpu/grouped_topk_plan.h"
#include "host_device/routing.h"
#include "host_device/routing_options.h"
#include "moeext/grouped_topk.h"

namespace moeext::gpu::grouped_topk {

// The routing logic the CPU kernel shares (key packing, group scores, weights, NaN policy,
// the options' rows, map, record and shared experts).
using host_device::counted_rows;
using host_device::finalize_weight;
using host_device::group_score;
using host_device::is_nan;
using host_device::key_from_ordered;
using host_device::key_index;
using host_device::kRemovedKey;
using host_device::make_key;
using host_device::mapped_id;
using host_device::nan_to_neg_inf;
using host_device::neg_inf;
using host_device::ordered_bits;
using host_device::record_routed;
using host_device::Top2;
using host_device::top2_empty;
using host_device::top2_merge;
using host_device::top2_push;
using host_device::weight_of_score;
using host_device::write_shared_expert;

namespace {

struct NoBias {};

// Everything a kernel needs, passed by value. Strides in elements (those of
// BiasedGroupedTopkParams). The launch shape is passed in rather than read from
// blockDim/gridDim: see thread_index().
struct KernelArgs {
  BiasedGroupedTopkParams p;
  int group_size;                  // num_experts / num_expert_group
  int lanes_per_group;             // warp kernel, see plan_fast_path()
  bool group_scores_in_registers;  // warp kernel
  int warps_per_block;             // warp kernel: tokens per block and round
  int64_t token_step;              // tokens all blocks take per round (the grid-stride)
};

inline FastPathPlan plan_for(const BiasedGroupedTopkParams& params, int warp_size) {
  return plan_fast_path(warp_size, params.num_experts, params.num_expert_group,
                        params.topk_group, params.topk);
}

// What the kernels are launched with, but for the launch shape (warps_per_block, token_step:
// the launcher's to set).
inline KernelArgs kernel_args(const BiasedGroupedTopkParams& params, const FastPathPlan& plan) {
  KernelArgs args;
  args.p = params;
  args.group_size = int(params.num_experts / params.num_expert_group);
  args.lanes_per_group = plan.lanes_per_group;
  args.group_scores_in_registers = plan.group_scores_in_registers;
  return args;
}

constexpr int kMaxThreadsPerBlock = 256;
// Launch bounds (256 threads, 2 blocks per multiprocessor): without a minimum, ptxas for sm_90a
// held the 12-experts-per-lane kernel to 80 registers and spilled; 2 blocks allow 128, which
// every instance fits without spilling while prefill batches keep 16 warps per SM.
constexpr int kMinBlocksPerMultiprocessor = 2;
// The warp kernel's lanes hold three arrays of kExpertsPerLane values; the widest instances
// spilled within two blocks' registers (past 24 a lane on sm_90a's 32-wide warps, past 12 on
// gfx90a/gfx942's 64-wide ones), so they ask for one block per multiprocessor.
MOEEXT_HOST_DEVICE constexpr int warp_kernel_min_blocks(int warp_size, int experts_per_lane) {
  return experts_per_lane <= (warp_size == 64 ? 12 : 24) ? kMinBlocksPerMultiprocessor : 1;
}
// The sorted-lanes kernel (sorts_lanes, grouped_topk_warp.h) asks for three blocks at 12
// experts a lane in its sm_90 code (cuda_arch 900), the code an H200 runs: its weight sum took
// ptxas from 80 registers to 89 there, two blocks a multiprocessor where the unsorted kernel
// has three. Capped, it takes 80 and spills nothing, and its A/B against the unsorted kernel
// timed instructions at equal occupancy. Other targets keep warp_kernel_min_blocks (on sm_100a
// the unsorted kernel takes 118 registers at 12 a lane: a cap there would raise occupancy).
MOEEXT_HOST_DEVICE constexpr int sorted_lanes_min_blocks(int warp_size, int experts_per_lane,
                                                         int cuda_arch) {
  return cuda_arch == 900 && warp_size == 32 && experts_per_lane == 12
             ? 3
             : warp_kernel_min_blocks(warp_size, experts_per_lane);
}
static_assert(kGeneralThreads <= kMaxThreadsPerBlock, "launch bounds of the block kernel");

// HIP's threadIdx and blockIdx are calls into the device library, which the device-only
// build check (-nogpulib) cannot resolve and then counts as stack and registers of an
// unknown callee; the builtins they wrap are the same instructions.
__device__ __forceinline__ int thread_index() {
#if defined(MOEEXT_HIP)
  return int(__builtin_amdgcn_workitem_id_x());
#else
  return int(threadIdx.x);
#endif
}

__device__ __forceinline__ int64_t block_index() {
#if defined(MOEEXT_HIP)
  return int64_t(__builtin_amdgcn_workgroup_id_x());
#else
  return int64_t(blockIdx.x);
#endif
}

__device__ __forceinline__ float quiet_nan() { return bits_float(0x7fc00000u); }

// Accurate expf/log1pf/sqrtf, never the fast intrinsics: the scores must agree with the CPU
// to an ulp, since near ties decide which expert wins.
__device__ __forceinline__ float elementwise_score(ScoringFunc scoring_func, float x) {
  if (scoring_func == ScoringFunc::kSigmoid) return 1.0f / (1.0f + expf(-x));
  // softplus with torch's threshold: x itself above 20.
  return sqrtf(x > 20.0f ? x : log1pf(expf(x)));
}

// 1 / d for d in [1, 2^126). On CUDA: the path the compiler's IEEE reciprocal takes for such a
// d (MUFU.RCP and one Newton step, correctly rounded there), without its test of d's exponent
// and the call to its slow path that each reciprocal otherwise carries. Elsewhere the division.
__device__ __forceinline__ float reciprocal_in_range(float d) {
#if !defined(MOEEXT_HIP) && defined(__CUDA_ARCH__)
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
  return fmaf(r, -fmaf(d, r, -1.0f), r);
#else
  return 1.0f / d;
#endif
}

// elementwise_score's sigmoid of N logits in place, the same bits: one range test for all N
// denominators (their largest bits as integers, a NaN's above every number's), and the IEEE
// division for all N only where one is 2^126 or more (a logit below about -87.3) or NaN.
template <int N>
__device__ __forceinline__ void sigmoid_scores(float (&x)[N]) {
  constexpr uint32_t kSlowPathBits = 0x7e800000u;  // 2^126
  float denominator[N];
  uint32_t largest = 0;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    denominator[i] = 1.0f + expf(-x[i]);
    const uint32_t bits = float_bits(denominator[i]);
    largest = bits > largest ? bits : largest;
  }
  if (largest < kSlowPathBits) {
#pragma unroll
    for (int i = 0; i < N; ++i) x[i] = reciprocal_in_range(denominator[i]);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) x[i] = 1.0f / denominator[i];
  }
}

// elementwise_score of N logits in place, for a scoring function known at compile time.
template <ScoringFunc kScoring, int N>
__device__ __forceinline__ void elementwise_scores(float (&x)[N]) {
  if constexpr (kScoring == ScoringFunc::kSigmoid) {
    sigmoid_scores(x);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) x[i] = elementwise_score(kScoring, x[i]);
  }
}

// top2_push for an x that is neither NaN nor -0 (b after fmaxf(b, -inf), whose s is at least
// +0): the same two values by fmaxf and fminf, an instruction each, where top2_push's compares
// and selects keep x86's NaN semantics.
__device__ __forceinline__ Top2 top2_push_nan_free(Top2 t, float x) {
  return Top2{fmaxf(x, t.first), fmaxf(fminf(x, t.first), t.second)};
}

// The dynamic shared memory of both kernels; uint4 gives the base 16-byte alignment.
__device__ __forceinline__ uint32_t* shared_words() {
  extern __shared__ uint4 moeext_grouped_topk_smem[];
  return reinterpret_cast<uint32_t*>(moeext_grouped_topk_smem);
}

// Largest value over the warp by a butterfly of shuffles: partner lanes combine the same two
// values, so every lane ends with the same bits. Integers, or NaN-free floats.
template <int kWarpSize, typename T>
__device__ __forceinline__ T butterfly_max(T x) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    const T other = shfl_xor(x, offset);
    x = other > x ? other : x;
  }
  return x;
}

template <int kWarpSize>
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) x += shfl_xor(x, offset);
  return x;
}

// ---- The routing options (docs/SPEC.md section 6), in the kernels' kOptions instances ----
// What the rows count and how an id is recorded, mapped and written for a shared expert:
// host_device/routing_options.h, the CPU's own functions.

// Routed expert j of row `token`, the logical expert `id`: recorded and counted where the row
// counts. Returns the id to write, through the expert map.
__device__ __forceinline__ int32_t finish_routed(const RoutingOptions& o, int64_t token, int j,
                                                 uint32_t id, bool counted) {
  if (counted) {
    if (o.routed_experts != nullptr) record_routed(o, token, j, id);
    if (o.expert_counts != nullptr) {
      const int64_t at = int64_t(id) * o.counts_stride;
      if (o.counts_dtype == IntType::kInt32) {
        atomicAdd(static_cast<int*>(o.expert_counts) + at, 1);
      } else {
        atomicAdd(reinterpret_cast<unsigned long long*>(static_cast<int64_t*>(o.expert_counts) + at),
                  1ull);
      }
    }
  }
  return mapped_id(o, id);
}

// The shared experts' columns of row `token`; this thread writes columns first, first + step...
__device__ __forceinline__ void write_shared_experts(const BiasedGroupedTopkParams& p,
                                                     int64_t token, int first, int step) {
  for (int64_t j = first; j < p.options.num_shared_experts; j += step) {
    write_shared_expert(p, token, j);
  }
}

// Merges the top-2 pairs of aligned runs of `lanes` (a power of two) lanes.
__device__ __forceinline__ Top2 merge_top2_across_lanes(Top2 t, int lanes) {
  for (int offset = 1; offset < lanes; offset *= 2) {
    const Top2 other{shfl_xor(t.first, offset), shfl_xor(t.second, offset)};
    t = top2_merge(t, other);
  }
  return t;
}

}  // namespace
}  // namespace moeext::gpu::grouped_topk
