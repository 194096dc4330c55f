// Pure tiling logic of the small-T router GEMM kernel (router_gemm.cu), shared with its host
// unit test (tests/cpp/test_router_gemm_tiling.cpp). No GPU runtime header here.
#pragma once

#include <cstdint>

#include "moeext/common.h"
#include "moeext/router_gemm.h"

namespace moeext::gpu {

// The kernel keeps every token's accumulators in registers, so the token count is a
// template parameter: one instance per power of two up to this, serving every runtime count
// up to it (rows past the runtime count repeat the last row and are never written).
constexpr int kRouterGemmMaxTokens = 16;

// Smallest instance token count that covers num_tokens, or 0 if none does.
MOEEXT_HOST_DEVICE inline int router_gemm_token_tile(int64_t num_tokens) {
  if (num_tokens < 1 || num_tokens > kRouterGemmMaxTokens) return 0;
  int tile = 1;
  while (tile < num_tokens) tile *= 2;
  return tile;
}

// The functions below take a `shape`: 0 for the kernel calls run, or router GEMM variant 2 or 3
// (moeext::gpu_router_gemm_variant), which differ at the 4-token tile only. There a block of one
// expert needs 110 registers (sm_90a), so two blocks a multiprocessor, and Kimi-K2's 384
// experts take two waves of an H200's 132 where every other gate and tile takes one. Variant 2
// compiles that tile for three blocks a multiprocessor, variant 3 gives its blocks two experts
// each (192 blocks). Neither changes a sum: a thread's chunks are the same whatever the unroll,
// and the warps' reduction the same whatever the experts a block.
MOEEXT_HOST_DEVICE constexpr bool router_gemm_shape_applies(int token_tile, int shape, int variant) {
  return token_tile == 4 && shape == variant;
}

// Experts one block computes. Every hidden-state chunk a thread loads is used for each of
// them, which divides the hidden-state traffic from L2 (kTokens times the weight's) by
// this; but it also divides the block count, and at T <= 4 the weight stream dominates, so
// only the larger tiles share.
MOEEXT_HOST_DEVICE constexpr int router_gemm_experts_per_block(int token_tile, int shape = 0) {
  return token_tile >= 8 || router_gemm_shape_applies(token_tile, shape, 3) ? 2 : 1;
}

// 16-byte weight chunks each thread keeps in flight per expert: 4 in all per thread, so the
// bytes in flight stay the same when a block takes more experts.
MOEEXT_HOST_DEVICE constexpr int router_gemm_unroll(int token_tile, int shape = 0) {
  return 4 / router_gemm_experts_per_block(token_tile, shape);
}

// Blocks of 256 threads per SM the kernel is compiled for (__launch_bounds__). Two (at most
// 128 registers a thread) let ptxas hoist every load of a pass and still keep E = 256
// resident at once; at 16 tokens the 32 accumulators plus the hoisted hidden-state loads
// need more than 128, and 128 blocks (E = 256) fit one per SM anyway.
MOEEXT_HOST_DEVICE constexpr int router_gemm_min_blocks_per_sm(int token_tile, int shape = 0) {
  return token_tile >= 16 ? 1 : router_gemm_shape_applies(token_tile, shape, 2) ? 3 : 2;
}

// Blocks the kernel launches.
MOEEXT_HOST_DEVICE inline int64_t router_gemm_blocks(int token_tile, int64_t num_experts,
                                                     int shape = 0) {
  const int experts = router_gemm_experts_per_block(token_tile, shape);
  return (num_experts + experts - 1) / experts;
}

// Whether the kernel beats the platform GEMM on a GPU of `sms` multiprocessors. The 16-token
// instance runs one block (two experts) per SM and wins only while its blocks fit one wave;
// the smaller instances won past one wave too (docs/notes/gpu-kernels.md).
MOEEXT_HOST_DEVICE inline bool router_gemm_small_t_pays(int64_t num_tokens, int64_t num_experts,
                                                        int sms) {
  const int tile = router_gemm_token_tile(num_tokens);
  if (tile < 16) return true;
  return router_gemm_blocks(tile, num_experts) <=
         int64_t(sms) * router_gemm_min_blocks_per_sm(tile);
}

MOEEXT_HOST_DEVICE inline int dtype_bytes(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

// Whether the small-T kernel takes these params (router_gemm_gpu_supported): 1..16 tokens,
// hidden_size a multiple of 8, and 16-byte aligned rows for both inputs (base pointer and
// row stride in bytes; the stride of a single row is never used, so it may be anything).
MOEEXT_HOST_DEVICE inline bool router_gemm_small_t_supported(const RouterGemmParams& p) {
  const bool input_dtype_ok = p.input_dtype == DType::kBFloat16 ||
                              p.input_dtype == DType::kFloat16 ||
                              p.input_dtype == DType::kFloat32;
  const bool logits_dtype_ok =
      p.logits_dtype == DType::kFloat32 || p.logits_dtype == DType::kBFloat16;
  if (!input_dtype_ok || !logits_dtype_ok) return false;
  if (router_gemm_token_tile(p.num_tokens) == 0) return false;
  // Chunk indices and the block count are 32-bit in the kernel.
  if (p.hidden_size < 0 || p.hidden_size % 8 != 0 || p.hidden_size > (int64_t(1) << 31) - 8) {
    return false;
  }
  if (p.num_experts < 0 || p.num_experts > (int64_t(1) << 31) - 1) return false;
  if (p.hidden_size > 0 && (p.hidden_states == nullptr || p.weight == nullptr)) return false;
  if (p.num_experts > 0 && p.logits == nullptr) return false;
  const int64_t element = dtype_bytes(p.input_dtype);
  const auto aligned = [](const void* ptr) {
    return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0;
  };
  if (!aligned(p.hidden_states) || !aligned(p.weight)) return false;
  if (p.num_tokens > 1) {
    if (p.hidden_row_stride < 0 || (p.hidden_row_stride * element) % 16 != 0) return false;
    // The kernel addresses the hidden states with 32-bit chunk offsets.
    const int64_t last_chunk = ((p.num_tokens - 1) * p.hidden_row_stride + p.hidden_size) *
                               element / 16;
    if (last_chunk > (int64_t(1) << 31) - 1) return false;
  }
  if (p.num_experts > 1 && (p.weight_row_stride * element) % 16 != 0) return false;
  return true;
}

// The warp reduction is a butterfly that halves the values each lane holds at every step
// (a reduce-scatter): with V values over a warp of W lanes it takes V - 1 + log2(W / V)
// shuffles (V <= W) instead of V * log2(W). At the step over lane mask m, a lane whose bit m
// is set keeps the upper half of its values and sends the lower half.
MOEEXT_HOST_DEVICE inline bool butterfly_keeps_upper(int lane, int mask) {
  return (lane & mask) != 0;
}

// After the butterfly, value j (of max(1, V / W)) of lane `lane` is the warp's sum of value
// index reduced_value_index(...); when V < W, W / V neighbouring lanes hold the same sum.
MOEEXT_HOST_DEVICE constexpr int reduced_values_per_lane(int values, int warp_size) {
  return values > warp_size ? values / warp_size : 1;
}
MOEEXT_HOST_DEVICE constexpr int reduced_value_index(int lane, int j, int values,
                                                     int warp_size) {
  return values >= warp_size ? lane * (values / warp_size) + j : lane / (warp_size / values);
}

}  // namespace moeext::gpu
