#include "torch/router_gemm_common.h"

#include <ATen/ATen.h>
#include <torch/version.h>

#include <algorithm>

#include "torch/binding.h"
#include "torch/check_messages.h"
#include "torch/parallel.h"

namespace moeext::torch_glue {
namespace {

const CheckMessage kHiddenRank{
    "router_gemm.hidden_states_rank",
    "{op}: hidden_states must be 2-D [num_tokens, hidden_size], got shape {shape}"};
const CheckMessage kPackedDtype{
    "router_gemm.packed_dtype",
    "{op}: a prepacked weight and hidden_states must both be bfloat16, got weight "
    "{weight_dtype} and hidden_states {hidden_dtype}"};
const CheckMessage kPackedShape{
    "router_gemm.packed_shape",
    "{op}: a prepacked weight must have shape [{pairs}, num_experts, 2] (ceil(hidden_size / 2) "
    "for the hidden_size {hidden_size} of hidden_states), got {shape}"};
const CheckMessage kWeightRank{
    "router_gemm.weight_rank",
    "{op}: weight must be 2-D [num_experts, hidden_size] (or prepacked, 3-D "
    "[ceil(hidden_size / 2), num_experts, 2]), got shape {shape}"};
const CheckMessage kWeightDtype{
    "router_gemm.weight_dtype",
    "{op}: weight must have the dtype of hidden_states ({hidden_dtype}), got {dtype}"};
const CheckMessage kWeightShape{
    "router_gemm.weight_shape",
    "{op}: weight must have shape [num_experts, {hidden_size}] (hidden_size of hidden_states), "
    "got {shape}"};
const CheckMessage kOutDtype{
    "router_gemm.out_dtype",
    "{op}: out_dtype must be float32 or bfloat16 (or None for float32), got {dtype}"};
const CheckMessages kMessages{&kHiddenRank, &kPackedDtype, &kPackedShape, &kWeightRank,
                              &kWeightDtype, &kWeightShape, &kOutDtype};

}  // namespace


at::ScalarType check_router_gemm(const at::Tensor& hidden_states, const at::Tensor& weight,
                            std::optional<at::ScalarType> out_dtype, const char* op) {
  TORCH_CHECK(hidden_states.dim() == 2,
              kHiddenRank({{"op", op}, {"shape", hidden_states.sizes()}}));
  to_moeext_dtype(hidden_states, op, "hidden_states");
  const int64_t hidden_size = hidden_states.size(1);
  if (is_prepacked(weight)) {
    const int64_t pairs = (hidden_size + 1) / 2;
    TORCH_CHECK(hidden_states.scalar_type() == at::kBFloat16 &&
                    weight.scalar_type() == at::kBFloat16,
                kPackedDtype({{"op", op}, {"weight_dtype", weight.scalar_type()},
                              {"hidden_dtype", hidden_states.scalar_type()}}));
    TORCH_CHECK(weight.size(0) == pairs && weight.size(2) == 2,
                kPackedShape({{"op", op}, {"pairs", pairs}, {"hidden_size", hidden_size},
                              {"shape", weight.sizes()}}));
    TORCH_CHECK(weight.is_contiguous(), op,
                ": a prepacked weight must be contiguous, as moeext.prepack_router_weight "
                "returns it, got strides ",
                weight.strides());
  } else {
    TORCH_CHECK(weight.dim() == 2, kWeightRank({{"op", op}, {"shape", weight.sizes()}}));
    TORCH_CHECK(weight.scalar_type() == hidden_states.scalar_type(),
                kWeightDtype({{"op", op}, {"hidden_dtype", hidden_states.scalar_type()},
                              {"dtype", weight.scalar_type()}}));
    TORCH_CHECK(weight.size(1) == hidden_size,
                kWeightShape({{"op", op}, {"hidden_size", hidden_size}, {"shape", weight.sizes()}}));
  }
  check_same_device(weight, "weight", hidden_states, "hidden_states", op);
  const at::ScalarType logits_dtype = out_dtype.value_or(at::kFloat);
  TORCH_CHECK(logits_dtype == at::kFloat || logits_dtype == at::kBFloat16,
              kOutDtype({{"op", op}, {"dtype", logits_dtype}}));
  return logits_dtype;
}

RouterGemmParams fill_router_gemm_params(const at::Tensor& hidden_states, const at::Tensor& weight,
                             const at::Tensor& logits) {
  RouterGemmParams p;
  p.hidden_states = hidden_states.data_ptr();
  p.hidden_row_stride = hidden_states.stride(0);
  p.weight = weight.data_ptr();
  p.weight_prepacked = is_prepacked(weight);
  p.weight_row_stride = p.weight_prepacked ? 0 : weight.stride(0);
  p.input_dtype = to_moeext_dtype(hidden_states, "router_gemm", "hidden_states");
  p.logits = logits.data_ptr();
  p.logits_row_stride = logits.stride(0);
  p.logits_dtype = to_moeext_dtype(logits, "router_gemm", "out_dtype");
  p.num_tokens = hidden_states.size(0);
  p.hidden_size = hidden_states.size(1);
  p.num_experts = num_experts_of(weight);
  return p;
}

// Threads split the experts, so each streams its own slice of the weight once and computes
// every token for it (a prepacked weight at its tiles).
void run_router_gemm(Cpu, const RouterGemmParams& p, const at::Tensor& /*hidden_states*/,
                     const at::Tensor& /*weight*/, at::Tensor& /*logits*/, const char* /*op*/) {
  const int64_t block = router_gemm_expert_block(p);
  const int64_t num_blocks = (p.num_experts + block - 1) / block;
  const int64_t grain = router_gemm_cpu_grain(p, block);
  parallel_for(0, num_blocks, grain, [&](int64_t begin, int64_t end) {
    router_gemm_cpu(p, begin * block, std::min(end * block, p.num_experts));
  });
}

#if defined(MOEEXT_GPU_BACKEND)
namespace {

// Past the small-T kernel, the platform GEMM (cuBLAS / hipBLASLt) with an fp32 result: mm's
// out_dtype overload (torch >= 2.8) accumulates and returns fp32 from bf16/fp16 inputs; a bf16
// result is that fp32 rounded once, never a GEMM that reduces in bf16.
void platform_gemm(const at::Tensor& hidden_states, const at::Tensor& weight,
                   at::Tensor& logits) {
  const at::Tensor weight_t = weight.t();
  const bool fp32_out = logits.scalar_type() == at::kFloat;
  if (hidden_states.scalar_type() == at::kFloat) {
    if (fp32_out) {
      at::mm_out(logits, hidden_states, weight_t);
    } else {
      logits.copy_(at::mm(hidden_states, weight_t));
    }
    return;
  }
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 8)
  if (fp32_out) {
    at::mm_out(logits, hidden_states, weight_t, at::kFloat);
  } else {
    logits.copy_(at::mm(hidden_states, weight_t, at::kFloat));
  }
#else
  // No out_dtype before torch 2.8: widen, at the cost of two casts (large T only).
  logits.copy_(at::mm(hidden_states.to(at::kFloat), weight_t.to(at::kFloat)));
#endif
}

}  // namespace

void run_router_gemm(Gpu, const RouterGemmParams& p, const at::Tensor& hidden_states,
                     const at::Tensor& weight, at::Tensor& logits, const char* op) {
  const c10::DeviceGuard guard(hidden_states.device());
  if (p.hidden_size == 0) {
    logits.zero_();
  } else if (router_gemm_gpu_supported(p)) {
    Gpu::check_launch(router_gemm_gpu(p, Gpu::stream(hidden_states)), op);
  } else {
    platform_gemm(hidden_states, weight, logits);
  }
}
#endif

}  // namespace moeext::torch_glue
