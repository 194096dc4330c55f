// CUDA (and HIP: ROCm torch dispatches HIP tensors under the CUDA key) implementations of the
// moeext ops: validate with the shared checks, allocate outputs with the input's options, and
// call the plain launchers of csrc/include/moeext/ on the current stream of the input's device.
//
// This file is host C++ and includes no CUDA header: the stream and the device guard come
// through c10's device-generic interfaces, so it compiles against any torch build, a CPU-only
// one included (MOEEXT_FORCE_CUDA=1), where these registrations are present but never reached.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>
#include <torch/version.h>

#include <tuple>

#include "moeext/grouped_topk.h"
#include "moeext/mxfp4_shuffle.h"
#include "moeext/router_gemm.h"
#include "moeext/zero_tail.h"
#include "torch/params.h"

namespace moeext::torch_glue {
namespace {

void check_cuda(const at::Tensor& t, const char* op, const char* arg) {
  TORCH_CHECK(t.device().is_cuda(), op, ": ", arg, " must be a CUDA tensor here, got ",
              t.device());
}

// The stream torch would launch on for t's device (cudaStream_t / hipStream_t as void*).
void* current_stream(const at::Tensor& t) {
  const c10::Device device = t.device();
  return c10::impl::getDeviceGuardImpl(device.type())->getStream(device).native_handle();
}

void check_launch(GpuError error, const char* op) {
  TORCH_CHECK(error == nullptr, op, ": CUDA kernel launch failed: ", error);
}

// Launches on gating_output's device and current stream; checks the kernel's own limits first.
void run_grouped_topk_cuda(const BiasedGroupedTopkParams& p, const at::Tensor& gating_output,
                           const char* op) {
  const char* limit = biased_grouped_topk_gpu_limit(p);
  TORCH_CHECK(limit == nullptr, limit);
  if (p.num_tokens == 0) return;
  const c10::DeviceGuard guard(gating_output.device());
  check_launch(biased_grouped_topk_gpu(p, current_stream(gating_output)), op);
}

void biased_grouped_topk_out_cuda(const at::Tensor& gating_output,
                                  const std::optional<at::Tensor>& correction_bias,
                                  const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                                  int64_t num_expert_group, int64_t topk_group, bool renormalize,
                                  double routed_scaling_factor, c10::string_view scoring_func) {
  constexpr const char* op = "biased_grouped_topk_out";
  check_cuda(gating_output, op, "gating_output");
  run_grouped_topk_cuda(make_grouped_topk_params(
                            gating_output, correction_bias, topk_weights, topk_ids,
                            num_expert_group, topk_group, renormalize, routed_scaling_factor,
                            std::string_view(scoring_func.data(), scoring_func.size()), op),
                        gating_output, op);
}

std::tuple<at::Tensor, at::Tensor> biased_grouped_topk_cuda_op(
    const at::Tensor& gating_output, const std::optional<at::Tensor>& correction_bias,
    int64_t num_expert_group, int64_t topk_group, int64_t topk, bool renormalize,
    double routed_scaling_factor, c10::string_view scoring_func) {
  constexpr const char* op = "biased_grouped_topk";
  check_cuda(gating_output, op, "gating_output");
  const ScoringFunc scoring = check_grouped_topk_inputs(
      gating_output, correction_bias, num_expert_group, topk_group, topk,
      std::string_view(scoring_func.data(), scoring_func.size()), op);
  const int64_t num_tokens = gating_output.size(0);
  at::Tensor topk_weights =
      at::empty({num_tokens, topk}, gating_output.options().dtype(at::kFloat));
  at::Tensor topk_ids = at::empty({num_tokens, topk}, gating_output.options().dtype(at::kInt));
  // The outputs are ours and the inputs checked once above: no second validation.
  run_grouped_topk_cuda(fill_grouped_topk_params(gating_output, correction_bias, topk_weights,
                                                 topk_ids, num_expert_group, topk_group,
                                                 renormalize, routed_scaling_factor, scoring),
                        gating_output, op);
  return {topk_weights, topk_ids};
}

// Past the small-T kernel, the platform GEMM (cuBLAS / hipBLASLt) with an fp32 result: mm's
// out_dtype overload (torch >= 2.8) accumulates and returns fp32 from bf16/fp16 inputs; a bf16
// result is that fp32 rounded once, never a GEMM that reduces in bf16.
void router_gemm_platform(const at::Tensor& hidden_states, const at::Tensor& weight,
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

at::Tensor router_gemm_cuda_op(const at::Tensor& hidden_states, const at::Tensor& weight,
                               std::optional<at::ScalarType> out_dtype) {
  constexpr const char* op = "router_gemm";
  check_cuda(hidden_states, op, "hidden_states");
  TORCH_CHECK(weight.dim() != 3, op,
              ": a prepacked weight (moeext.prepack_router_weight) is a CPU layout; on ",
              hidden_states.device(), " pass the [num_experts, hidden_size] weight");
  const at::ScalarType logits_dtype =
      check_router_gemm_inputs(hidden_states, weight, out_dtype, op);
  at::Tensor logits = at::empty({hidden_states.size(0), weight.size(0)},
                                hidden_states.options().dtype(logits_dtype));
  const RouterGemmParams p = make_router_gemm_params(hidden_states, weight, logits);
  if (p.num_tokens == 0 || p.num_experts == 0) return logits;
  const c10::DeviceGuard guard(hidden_states.device());
  if (p.hidden_size == 0) {
    logits.zero_();
  } else if (router_gemm_gpu_supported(p)) {
    check_launch(router_gemm_gpu(p, current_stream(hidden_states)), op);
  } else {
    router_gemm_platform(hidden_states, weight, logits);
  }
  return logits;
}

void zero_tail_cuda(const at::Tensor& buf, int64_t new_extent, int64_t prev_extent) {
  constexpr const char* op = "zero_tail_";
  check_cuda(buf, op, "buf");
  const ZeroRowsParams p = make_zero_tail_params(buf, new_extent, prev_extent, op);
  if (p.row_end <= p.row_begin || p.row_bytes == 0) return;
  const c10::DeviceGuard guard(buf.device());
  check_launch(zero_rows_gpu(p, current_stream(buf)), op);
}

void zero_tail_tracked_cuda(const at::Tensor& buf, const at::Tensor& state, int64_t new_extent) {
  constexpr const char* op = "zero_tail_tracked_";
  check_cuda(buf, op, "buf");
  check_zero_tail_state(buf, state, op);
  TORCH_CHECK(new_extent >= 0, op, ": new_extent must be >= 0, got ", new_extent);
  // The previous extent lives on the device; the kernel reads it, so the host describes the
  // largest tail it could be: [new_extent, rows).
  const ZeroRowsParams p = make_zero_tail_params(buf, new_extent, buf.size(0), op, &state);
  const c10::DeviceGuard guard(buf.device());
  check_launch(zero_rows_tracked_gpu(p, state.data_ptr<int64_t>(), new_extent,
                                      current_stream(buf)),
               op);
}

at::Tensor shuffle_weight_cuda_impl(const at::Tensor& w, at::IntArrayRef layout, bool gate_up,
                                    bool inverse) {
  const char* op = inverse ? "unshuffle_weight" : "shuffle_weight";
  check_cuda(w, op, "w");
  at::Tensor out = at::empty(w.sizes(), w.options().memory_format(at::MemoryFormat::Contiguous));
  const c10::DeviceGuard guard(w.device());
  if (!inverse) {
    const at::Tensor src = shuffle_weight_source(w);
    const ShuffleWeightParams p =
        make_shuffle_weight_params(src, out.data_ptr(), layout, gate_up, op);
    if (p.batch * p.rows * p.row_bytes == 0) return out;
    check_launch(shuffle_weight_gpu(p, current_stream(w)), op);
  } else {
    // The shuffled layout is defined on dense memory: read a dense copy if w is a view.
    const at::Tensor src = w.contiguous();
    const ShuffleWeightParams p =
        make_shuffle_weight_params(out, const_cast<void*>(src.data_ptr()), layout, gate_up, op);
    if (p.batch * p.rows * p.row_bytes == 0) return out;
    check_launch(unshuffle_weight_gpu(p, current_stream(w)), op);
  }
  return out;
}

at::Tensor shuffle_weight_cuda_op(const at::Tensor& w, at::IntArrayRef layout, bool gate_up) {
  return shuffle_weight_cuda_impl(w, layout, gate_up, /*inverse=*/false);
}

at::Tensor unshuffle_weight_cuda_op(const at::Tensor& w, at::IntArrayRef layout, bool gate_up) {
  return shuffle_weight_cuda_impl(w, layout, gate_up, /*inverse=*/true);
}

at::Tensor e8m0_shuffle_cuda_op(const at::Tensor& scale, bool gate_up,
                                std::optional<int64_t> num_experts) {
  constexpr const char* op = "e8m0_shuffle";
  check_cuda(scale, op, "scale");
  E8m0ShuffleParams p = make_e8m0_shuffle_params(scale, gate_up, num_experts, op);
  at::Tensor out = at::empty({p.padded_m, p.padded_n}, scale.options());
  if (out.numel() == 0) return out;
  p.shuffled = static_cast<uint8_t*>(out.data_ptr());
  const c10::DeviceGuard guard(scale.device());
  check_launch(e8m0_shuffle_gpu(p, current_stream(scale)), op);
  return out;
}

at::Tensor e8m0_unshuffle_cuda_op(const at::Tensor& shuffled, int64_t m, int64_t n, bool gate_up,
                                  std::optional<int64_t> num_experts) {
  constexpr const char* op = "e8m0_unshuffle";
  check_cuda(shuffled, op, "shuffled");
  E8m0ShuffleParams p = make_e8m0_unshuffle_params(shuffled, m, n, gate_up, num_experts, op);
  at::Tensor out = at::empty({m, n}, shuffled.options());
  if (out.numel() == 0) return out;
  const at::Tensor src = shuffled.contiguous();
  p.shuffled_in = static_cast<const uint8_t*>(src.data_ptr());
  p.unshuffled = static_cast<uint8_t*>(out.data_ptr());
  const c10::DeviceGuard guard(shuffled.device());
  check_launch(e8m0_unshuffle_gpu(p, current_stream(shuffled)), op);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(moeext, CUDA, m) {
  m.impl("biased_grouped_topk", &biased_grouped_topk_cuda_op);
  m.impl("biased_grouped_topk_out", &biased_grouped_topk_out_cuda);
  m.impl("router_gemm", &router_gemm_cuda_op);
  m.impl("zero_tail_", &zero_tail_cuda);
  m.impl("zero_tail_tracked_", &zero_tail_tracked_cuda);
  m.impl("shuffle_weight", &shuffle_weight_cuda_op);
  m.impl("unshuffle_weight", &unshuffle_weight_cuda_op);
  m.impl("e8m0_shuffle", &e8m0_shuffle_cuda_op);
  m.impl("e8m0_unshuffle", &e8m0_unshuffle_cuda_op);
}

}  // namespace moeext::torch_glue
