// Checks, params and the launch the ops that run the router GEMM share (router_gemm, and
// fused_router where it runs the GEMM as router_gemm does).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <type_traits>

#include "moeext/router_gemm.h"
#include "torch/binding.h"

namespace moeext::torch_glue {

// The one test of a prepacked weight (moeext.prepack_router_weight's layout
// [ceil(hidden_size / 2), num_experts, 2]): the nn.Linear layout is 2-D.
inline bool is_prepacked(const at::Tensor& weight) { return weight.dim() == 3; }

inline int64_t num_experts_of(const at::Tensor& weight) {
  return is_prepacked(weight) ? weight.size(1) : weight.size(0);
}

// The weight layouts a device reads: a prepacked weight is the CPU's own.
template <typename Device>
inline void check_weight_layout(const at::Tensor& hidden_states, const at::Tensor& weight,
                         const char* op) {
#if defined(MOEEXT_GPU_BACKEND)
  if constexpr (std::is_same_v<Device, Gpu>) {
    TORCH_CHECK(!is_prepacked(weight), op,
                ": a prepacked weight (moeext.prepack_router_weight) is a CPU layout; on ",
                hidden_states.device(), " pass the [num_experts, hidden_size] weight");
  }
#endif
  (void)hidden_states, (void)weight, (void)op;
}

// Checks the arguments of a router GEMM; returns the logits dtype (out_dtype, float32 if none).
at::ScalarType check_router_gemm(const at::Tensor& hidden_states, const at::Tensor& weight,
                                 std::optional<at::ScalarType> out_dtype, const char* op);

// The kernels read whole rows. Any other strides are accepted, as F.linear accepts them, at
// the cost of one copy here.
inline at::Tensor with_contiguous_rows(const at::Tensor& t) {
  return t.size(1) <= 1 || t.stride(1) == 1 ? t : t.contiguous();
}

// Launcher params from checked inputs (rows contiguous) and an output [num_tokens, num_experts].
RouterGemmParams fill_router_gemm_params(const at::Tensor& hidden_states,
                                         const at::Tensor& weight, const at::Tensor& logits);

// Whether a direct call releases the GIL around the op (DirectCall's predicate): 64k
// multiply-adds take about a microsecond even on the vector paths, long enough to let another
// Python thread run meanwhile.
struct RouterGemmComputesMuch {
  template <typename... Rest>
  static bool test(const at::Tensor& hidden_states, const at::Tensor& weight, const Rest&...) {
    const int64_t tokens = hidden_states.dim() > 0 ? hidden_states.size(0) : 0;
    return tokens * weight.numel() >= (int64_t(1) << 16);
  }
};

// Computes checked params' logits on hidden_states' device: the CPU kernel with the experts
// split over torch's threads; on a GPU the small-T kernel where it takes them, else the
// platform GEMM (hidden_states and weight are those params' tensors).
void run_router_gemm(Cpu, const RouterGemmParams& p, const at::Tensor& hidden_states,
                     const at::Tensor& weight, at::Tensor& logits, const char* op);
#if defined(MOEEXT_GPU_BACKEND)
void run_router_gemm(Gpu, const RouterGemmParams& p, const at::Tensor& hidden_states,
                     const at::Tensor& weight, at::Tensor& logits, const char* op);
#endif

}  // namespace moeext::torch_glue
