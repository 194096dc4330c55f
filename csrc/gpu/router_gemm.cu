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
#include "gpu/router_gemm_tiling.h"
#include "moeext/router_gemm.h"

namespace moeext {
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

// One instance per (tokens, warp width, dtypes). Instances for a warp width other than the
// target's compile to an empty body; the launcher only runs the one for the device's width.
template <int kTokens, int kWarpSize, typename In, typename Out>
__global__ void __launch_bounds__(kThreads, gpu::router_gemm_min_blocks_per_sm(kTokens))
    router_gemm_kernel(RouterGemmParams p) {
  if constexpr (kWarpSize == MOEEXT_DEVICE_WARP_SIZE) {
    constexpr int kExperts = gpu::router_gemm_experts_per_block(kTokens);
    constexpr int kUnroll = gpu::router_gemm_unroll(kTokens);
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
    const int expert_begin = int(blockIdx.x) * kExperts;

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
}

template <int kTokens, int kWarpSize, typename In, typename Out>
GpuError launch(const RouterGemmParams& p, gpu::Stream stream) {
  const unsigned blocks = unsigned(gpu::router_gemm_blocks(kTokens, p.num_experts));
  router_gemm_kernel<kTokens, kWarpSize, In, Out><<<blocks, kThreads, 0, stream>>>(p);
  return gpu::launch_status();
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
