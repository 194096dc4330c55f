// The small-T router GEMM's work for one block (router_gemm.cu has the why of its layout):
// experts [block * kExperts, ...) of every token, fp32 accumulation, the sums formed in the
// same order whatever the token count. Used by the router GEMM kernel and by the fused
// router's (fused_router.cu), so that both write the same logits bit for bit.
#pragma once

#include "gpu/compat.h"
#include "gpu/router_gemm_tiling.h"
#include "moeext/router_gemm.h"

namespace moeext::gpu::router_gemm {
namespace {

constexpr int kThreads = 256;


// One 16-byte chunk of kElements values of In, widened to fp32.
template <typename In>
struct Chunk;

template <>
struct Chunk<gpu::bf16> {
  static constexpr int kElements = 8;
  // bf16 is the top half of an fp32: the even element (low half) shifts up, the odd one is
  // the word with its low half cleared.
  __device__ __forceinline__ static void widen(const uint4& v, float (&out)[kElements]) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      out[2 * k] = gpu::bits_float(w[k] << 16);
      out[2 * k + 1] = gpu::bits_float(w[k] & 0xffff0000u);
    }
  }
};

template <>
struct Chunk<gpu::fp16> {
  static constexpr int kElements = 8;
  __device__ __forceinline__ static void widen(const uint4& v, float (&out)[kElements]) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      out[2 * k] = gpu::to_float(gpu::fp16{uint16_t(w[k] & 0xffffu)});
      out[2 * k + 1] = gpu::to_float(gpu::fp16{uint16_t(w[k] >> 16)});
    }
  }
};

template <>
struct Chunk<float> {
  static constexpr int kElements = 4;
  __device__ __forceinline__ static void widen(const uint4& v, float (&out)[kElements]) {
    out[0] = gpu::bits_float(v.x);
    out[1] = gpu::bits_float(v.y);
    out[2] = gpu::bits_float(v.z);
    out[3] = gpu::bits_float(v.w);
  }
};

__device__ __forceinline__ uint4 load_chunk(const uint4* p) {
#if defined(MOEEXT_HIP)
  return *p;
#else
  return __ldg(p);
#endif
}

// Chunk c of a row, or zeros past its end. The load always happens (from the row's last
// chunk when c is past it), so all the loads of a pass sit in one basic block and are issued
// before the first FMA waits on one.
__device__ __forceinline__ uint4 load_chunk_or_zero(const uint4* row, int c, int num_chunks) {
  const bool in_row = c < num_chunks;
  const uint4 v = load_chunk(row + (in_row ? c : num_chunks - 1));
  return in_row ? v : make_uint4(0, 0, 0, 0);
}

__device__ __forceinline__ void store_logit(float* out, float value) { *out = value; }
__device__ __forceinline__ void store_logit(gpu::bf16* out, float value) {
  *out = gpu::to_bf16(value);
}

// Reduce-scatter over the warp (see router_gemm_tiling.h): each step over lane mask kMask
// halves the values a lane holds; once one value is left the remaining steps are plain
// sums, and if the lanes run out first each lane ends with N values.
template <int kMask, int N, int kOut>
__device__ __forceinline__ void warp_reduce_scatter(const float (&v)[N], int lane,
                                                    float (&out)[kOut]) {
  if constexpr (kMask == 0) {
    static_assert(N == kOut, "the lanes ran out with N values left");
#pragma unroll
    for (int j = 0; j < N; ++j) out[j] = v[j];
  } else if constexpr (N == 1) {
    static_assert(kOut == 1, "one value left means one out");
    float x = v[0];
#pragma unroll
    for (int m = kMask; m >= 1; m /= 2) x += gpu::shfl_xor(x, m);
    out[0] = x;
  } else {
    constexpr int kHalf = N / 2;
    const bool upper = gpu::butterfly_keeps_upper(lane, kMask);
    float next[kHalf];
#pragma unroll
    for (int j = 0; j < kHalf; ++j) {
      const float keep = upper ? v[j + kHalf] : v[j];
      const float send = upper ? v[j] : v[j + kHalf];
      next[j] = keep + gpu::shfl_xor(send, kMask);
    }
    warp_reduce_scatter<kMask / 2, kHalf, kOut>(next, lane, out);
  }
}

// Lines of a weight row each thread asks L2 for in prefetch_weight_rows: 2 x 256 lines of 128
// bytes cover rows of up to 64 KiB (hidden_size 32768 in bf16); the rest of a longer row is
// read as it is without the hint.
constexpr int kPrefetchLinesPerThread = 2;

// Whether the GEMM kernels (router_gemm's, the fused router's one launch) launch the instance
// that calls prefetch_weight_rows: where the launch is programmatic (on an H200, 2026-11-30,
// 1.00-1.12x faster with PDL and 0.92-1.00x without: docs/notes/gpu-kernels.md), unless the
// router GEMM variant 1 asks for the kernel without it (the others prefetch as the current
// kernel does); never with hidden_size 0.
inline bool prefetches_weight_rows(const RouterGemmParams& p) {
  return p.hidden_size > 0 && gpu_router_gemm_variant() != 1 && launches_programmatic();
}

// Into L2, block `block`'s weight rows, before the kernel waits for the grid before it (where
// prefetches_weight_rows): with programmatic dependent launch the weight then streams from
// memory while that grid finishes, and the loads after the wait find it in L2. A prefetch
// returns nothing to the thread, and L2 is where every grid's stores land, so what the loads
// read after the wait is what they read without it.
// Every thread asks for kPrefetchLinesPerThread addresses in every row, those past the row's
// end for its last byte, with no branch (the grid-dependency check then sees no path around
// the wait). Needs hidden_size > 0. CUDA only: a hint, nothing else changes.
template <int kTokens, typename In, int kShape = 0>
__device__ __forceinline__ void prefetch_weight_rows(const RouterGemmParams& p, int block) {
#if !defined(MOEEXT_HIP)
  constexpr int kExperts = gpu::router_gemm_experts_per_block(kTokens, kShape);
  constexpr int kLine = 128;
  const int64_t row_bytes = p.hidden_size * int64_t(sizeof(In));
#pragma unroll
  for (int i = 0; i < kExperts; ++i) {
    // The last block's experts past the gate repeat the last one, as compute_logits_block's.
    const int64_t e = min(int64_t(block) * kExperts + i, p.num_experts - 1);
    const char* row = static_cast<const char*>(p.weight) +
                      e * p.weight_row_stride * int64_t(sizeof(In));
#pragma unroll
    for (int k = 0; k < kPrefetchLinesPerThread; ++k) {
      // Offsets a line apart, then the row's last byte: every line the row touches.
      const int64_t at = int64_t(threadIdx.x + k * kThreads) * kLine;
      asm volatile("prefetch.global.L2 [%0];" ::"l"(row + (at < row_bytes ? at : row_bytes - 1)));
    }
  }
#else
  (void)p, (void)block;
#endif
}

// Block `block`'s logits, written to p.logits. A __syncthreads inside: every thread of the
// block calls it. kShape: 0, or the router GEMM variant whose tiling it takes
// (router_gemm_tiling.h); the sums are the same whichever.
template <int kTokens, int kWarpSize, typename In, typename Out, int kShape = 0>
__device__ __forceinline__ void compute_logits_block(const RouterGemmParams& p, int block) {
  constexpr int kExperts = gpu::router_gemm_experts_per_block(kTokens, kShape);
  constexpr int kUnroll = gpu::router_gemm_unroll(kTokens, kShape);
  constexpr int kValues = kTokens * kExperts;
  constexpr int kWarps = kThreads / kWarpSize;
  constexpr int kOut = gpu::reduced_values_per_lane(kValues, kWarpSize);
  constexpr int kElements = Chunk<In>::kElements;
  static_assert((kValues & (kValues - 1)) == 0, "the butterfly needs a power of two");
  static_assert(kValues <= kThreads, "one thread per value sums the warps");

  const int tid = threadIdx.x;
  const int lane = tid % kWarpSize;
  const int warp = tid / kWarpSize;
  const int num_tokens = int(p.num_tokens);
  const int num_experts = int(p.num_experts);
  const int num_chunks = int(p.hidden_size / kElements);
  const int expert_begin = block * kExperts;

  // Rows in 16-byte chunks (router_gemm_gpu_supported checked the alignment).
  const uint4* weight_rows[kExperts];
#pragma unroll
  for (int i = 0; i < kExperts; ++i) {
    const int e = min(expert_begin + i, num_experts - 1);
    weight_rows[i] = reinterpret_cast<const uint4*>(static_cast<const In*>(p.weight) +
                                                    int64_t(e) * p.weight_row_stride);
  }
  // 32-bit chunk offsets (router_gemm_gpu_supported checked that they fit): a 64-bit
  // pointer per token would hold twice the registers.
  const uint4* hidden = static_cast<const uint4*>(p.hidden_states);
  const int hidden_stride_chunks = num_tokens > 1 ? int(p.hidden_row_stride / kElements) : 0;

  float acc[kValues];  // acc[t * kExperts + i]
#pragma unroll
  for (int v = 0; v < kValues; ++v) acc[v] = 0.0f;

  for (int base = tid; base < num_chunks; base += kUnroll * kThreads) {
    // The weight loads of the whole pass first, so they are all in flight together.
    uint4 w[kExperts][kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = base + u * kThreads;
#pragma unroll
      for (int i = 0; i < kExperts; ++i) {
        w[i][u] = load_chunk_or_zero(weight_rows[i], c, num_chunks);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = base + u * kThreads;
      float wf[kExperts][kElements];
#pragma unroll
      for (int i = 0; i < kExperts; ++i) Chunk<In>::widen(w[i][u], wf[i]);
#pragma unroll
      for (int t = 0; t < kTokens; ++t) {
        const int row = min(t, num_tokens - 1);
        // Past the row both operands are zero, so no inf * 0 enters a sum.
        const uint4 x = load_chunk_or_zero(hidden + row * hidden_stride_chunks, c, num_chunks);
        float xf[kElements];
        Chunk<In>::widen(x, xf);
#pragma unroll
        for (int i = 0; i < kExperts; ++i) {
          float& a = acc[t * kExperts + i];
#pragma unroll
          for (int k = 0; k < kElements; ++k) a = fmaf(xf[k], wf[i][k], a);
        }
      }
    }
  }

  float reduced[kOut];
  warp_reduce_scatter<kWarpSize / 2, kValues, kOut>(acc, lane, reduced);

  __shared__ float partial[kWarps][kValues];
  constexpr int kLanesPerValue = kValues >= kWarpSize ? 1 : kWarpSize / kValues;
  if (lane % kLanesPerValue == 0) {
#pragma unroll
    for (int j = 0; j < kOut; ++j) {
      partial[warp][gpu::reduced_value_index(lane, j, kValues, kWarpSize)] = reduced[j];
    }
  }
  __syncthreads();
  if (tid < kValues) {
    float sum = partial[0][tid];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) sum += partial[w][tid];
    const int t = tid / kExperts;
    const int e = expert_begin + tid % kExperts;
    if (t < num_tokens && e < num_experts) {
      store_logit(static_cast<Out*>(p.logits) + int64_t(t) * p.logits_row_stride + e, sum);
    }
  }
}

}  // namespace
}  // namespace moeext::gpu::router_gemm
