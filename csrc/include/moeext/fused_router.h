// Fused router (SPEC.md section 7): the router GEMM and the routing in one launch; launcher API.
// (Calls run it only while moeext::gpu_fused_router_variant asks for it: fused_router_gpu_takes.)
#pragma once

#include "moeext/common.h"
#include "moeext/grouped_topk.h"
#include "moeext/router_gemm.h"

namespace moeext {

// gemm writes fp32 logits [num_tokens, num_experts] (contiguous rows) that routing reads as
// its gating_output: the same pointer, the same token and expert counts.
struct FusedRouterParams {
  RouterGemmParams gemm;
  BiasedGroupedTopkParams routing;
  // GPU only: the kernel's completion counter, an unsigned int that is zero when the kernel
  // starts and that the kernel leaves at zero. Two kernels that may run at the same time
  // must not share one (fused_router_gpu_counter hands one out per stream and graph).
  unsigned* completion_counter = nullptr;
};

// Whether the one-launch GPU kernel takes these params (completion_counter aside): the
// small-T router GEMM takes params.gemm (router_gemm_gpu_supported: the same kernel and so
// the same logits as router_gemm), bfloat16 inputs, an fp32 bias or none, and a topology the
// warp routing kernel routes. Anything else runs as router_gemm_gpu (or the platform GEMM)
// and then biased_grouped_topk_gpu.
bool fused_router_gpu_supported(const FusedRouterParams& params);

// Whether a call runs as one launch: gpu_fused_router_variant() asks for it (1 to 3; 0 runs
// the two kernels) and fused_router_gpu_supported(params).
inline bool fused_router_gpu_takes(const FusedRouterParams& params) {
  return gpu_fused_router_variant() != 0 && fused_router_gpu_supported(params);
}

// The routing of params.routing, bit for bit as biased_grouped_topk_gpu writes it from the
// logits router_gemm_gpu writes: every block computes a slice of the experts' logits into
// params.gemm.logits, and the last block to finish (params.completion_counter) routes every
// token. Needs fused_router_gpu_supported(params) and a counter; a plain call counts as
// gpu_fused_router_variant() 2 or 3 says, any other as 1, and under variant 3 a plain call
// of DeepSeek-V3's or Kimi-K2's gate is routed by the gate's own code (a single token by the
// whole last block) (whatever the variant: tests launch it directly).
GpuError fused_router_gpu(const FusedRouterParams& params, void* stream);

// A completion counter for fused_router_gpu on `stream` of the current device: the same one
// for every call on that stream outside a graph capture, and one per capture (a graph keeps
// its own, so replays of two graphs on different streams do not share one). The first call
// on a device allocates its counters and waits for them to be zeroed; nullptr where none can
// be had (a capture before that first call, the device's counters all handed out, a runtime
// error), and the caller runs the two kernels instead.
unsigned* fused_router_gpu_counter(void* stream);

}  // namespace moeext
