// Router GEMM on the GPU (SPEC.md section 2): the small-T (decode) kernel.
//
// logits[T, E] = hidden[T, H] @ weight[E, H]^T with T <= 16 is a matrix-vector product in
// disguise: the weight (3.7 MB at E = 256, H = 7168, bf16) is read once per call and the
// time is the time to stream it. So:
//   * a block of 256 threads computes kExperts experts for every token at once; its threads
//     split H into 16-byte chunks (chunk c of a row goes to thread c % 256), each thread
//     keeps 4 weight chunks in flight per pass and all kTokens x kExperts fp32 accumulators
//     in registers, so each weight row is read exactly once and the hidden states (small,
//     L2-resident) are re-read once per block;
//   * at E = 256 that is 256 blocks (T <= 4) or 128 (T = 8, 16), filling an H100's 132 SMs;
//     the 16-token instance runs one block per SM, and past one wave of them the platform
//     GEMM is faster, so the caller is told to use it (router_gemm_small_t_pays);
//   * per-thread partial sums are reduced by a reduce-scatter butterfly within each warp
//     (router_gemm_tiling.h), then across the block's warps through shared memory in a fixed
//     order.
// Every sum is formed in the same order whatever the token count, the instance and the
// other tokens (the reduce-scatter adds the same pairs as a full butterfly), so a token's
// logits do not depend on the batch it came in (up to the sign of an exact zero).
// Token rows past the runtime count repeat the last row (loads of the same addresses, all
// in one basic block so the loads of every token can be issued before the FMAs) and are
// never written.
#include "gpu/compat.h"
#include "gpu/router_gemm_block.h"
#include "gpu/router_gemm_tiling.h"
#include "moeext/router_gemm.h"

namespace moeext {
namespace {

using gpu::router_gemm::compute_logits_block;
using gpu::router_gemm::kThreads;

// One instance per (tokens, warp width, dtypes, kPrefetch: prefetches_weight_rows, kShape: the
// tiling, router_gemm_tiling.h). Instances for a warp width other than the target's compile to
// an empty body; the launcher only runs the one for the device's width.
template <int kTokens, int kWarpSize, typename In, typename Out, int kPrefetch, int kShape>
__global__ void __launch_bounds__(kThreads, gpu::router_gemm_min_blocks_per_sm(kTokens, kShape))
    router_gemm_kernel(RouterGemmParams p) {
  if constexpr (kWarpSize == MOEEXT_DEVICE_WARP_SIZE) {
    if constexpr (kPrefetch == 1) {
      gpu::router_gemm::prefetch_weight_rows<kTokens, In, kShape>(p, int(blockIdx.x));
    }
    gpu::wait_for_prior_grids();
    gpu::allow_dependent_grids();
    compute_logits_block<kTokens, kWarpSize, In, Out, kShape>(p, int(blockIdx.x));
  }
}

template <int kTokens, int kWarpSize, typename In, typename Out, int kShape>
GpuError launch_shape(const RouterGemmParams& p, gpu::Stream stream) {
  const unsigned blocks = unsigned(gpu::router_gemm_blocks(kTokens, p.num_experts, kShape));
  const auto kernel = gpu::router_gemm::prefetches_weight_rows(p)
                          ? router_gemm_kernel<kTokens, kWarpSize, In, Out, 1, kShape>
                          : router_gemm_kernel<kTokens, kWarpSize, In, Out, 0, kShape>;
  return gpu::launch_dependent(kernel, dim3(blocks), dim3(kThreads), 0, stream, p);
}

// The 4-token tile in router GEMM variant 2's or 3's tiling where that variant is set.
template <int kTokens, int kWarpSize, typename In, typename Out>
GpuError launch(const RouterGemmParams& p, gpu::Stream stream) {
  if constexpr (kTokens == 4) {
    switch (gpu_router_gemm_variant()) {
      case 2: return launch_shape<kTokens, kWarpSize, In, Out, 2>(p, stream);
      case 3: return launch_shape<kTokens, kWarpSize, In, Out, 3>(p, stream);
      default: break;
    }
  }
  return launch_shape<kTokens, kWarpSize, In, Out, 0>(p, stream);
}

template <int kWarpSize, typename In, typename Out>
GpuError launch_for_tokens(const RouterGemmParams& p, gpu::Stream stream) {
  switch (gpu::router_gemm_token_tile(p.num_tokens)) {
    case 1:
      return launch<1, kWarpSize, In, Out>(p, stream);
    case 2:
      return launch<2, kWarpSize, In, Out>(p, stream);
    case 4:
      return launch<4, kWarpSize, In, Out>(p, stream);
    case 8:
      return launch<8, kWarpSize, In, Out>(p, stream);
    case 16:
      return launch<16, kWarpSize, In, Out>(p, stream);
    default:
      return "router_gemm_gpu: num_tokens outside the small-T kernel's 1..16";
  }
}

template <int kWarpSize, typename In>
GpuError launch_for_logits(const RouterGemmParams& p, gpu::Stream stream) {
  switch (p.logits_dtype) {
    case DType::kFloat32:
      return launch_for_tokens<kWarpSize, In, float>(p, stream);
    case DType::kBFloat16:
      return launch_for_tokens<kWarpSize, In, gpu::bf16>(p, stream);
    default:
      return "router_gemm_gpu: logits dtype must be float32 or bfloat16";
  }
}

template <int kWarpSize>
GpuError launch_for_inputs(const RouterGemmParams& p, gpu::Stream stream) {
  switch (p.input_dtype) {
    case DType::kBFloat16:
      return launch_for_logits<kWarpSize, gpu::bf16>(p, stream);
    case DType::kFloat16:
      return launch_for_logits<kWarpSize, gpu::fp16>(p, stream);
    case DType::kFloat32:
      return launch_for_logits<kWarpSize, float>(p, stream);
    default:
      return "router_gemm_gpu: input dtype must be bfloat16, float16 or float32";
  }
}

}  // namespace

bool router_gemm_gpu_supported(const RouterGemmParams& params) {
  return gpu::router_gemm_small_t_supported(params) &&
         gpu::router_gemm_small_t_pays(params.num_tokens, params.num_experts,
                                       gpu::multiprocessor_count_of_current_device());
}

GpuError router_gemm_gpu(const RouterGemmParams& params, void* stream) {
  if (params.num_tokens == 0 || params.num_experts == 0) return nullptr;  // no logits
  if (!router_gemm_gpu_supported(params)) {
    return "router_gemm_gpu: params not supported by the small-T kernel (needs 1..16 tokens, "
           "9..16 only while their blocks fit one wave, hidden_size % 8 == 0, 16-byte "
           "aligned rows); check router_gemm_gpu_supported";
  }
  const gpu::Stream s = gpu::as_stream(stream);
  switch (gpu::warp_size_of_current_device()) {
    case 32:
      return launch_for_inputs<32>(params, s);
    case 64:
      return launch_for_inputs<64>(params, s);
    default:
      return "router_gemm_gpu: the device's warp size is neither 32 nor 64 (or it could not "
             "be asked)";
  }
}

}  // namespace moeext
