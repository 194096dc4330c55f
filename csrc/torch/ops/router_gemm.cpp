// router_gemm (docs/SPEC.md section 2): checks, launcher params, the CPU and GPU
// implementations, autograd, and the direct call of the Python wrapper.
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>
#include <torch/version.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "moeext/router_gemm.h"
#include "torch/binding.h"
#include "torch/check_messages.h"
#include "torch/direct_call.h"
#include "torch/parallel.h"
#include "torch/router_gemm_common.h"

namespace moeext::torch_glue {
namespace {

// ---- The op ------------------------------------------------------------------------------

template <typename Device>
at::Tensor router_gemm(const at::Tensor& hidden_states, const at::Tensor& weight,
                       std::optional<at::ScalarType> out_dtype) {
  constexpr const char* op = "router_gemm";
  Device::check_device(hidden_states, op, "hidden_states");
  check_weight_layout<Device>(hidden_states, weight, op);
  const at::ScalarType logits_dtype = check_router_gemm(hidden_states, weight, out_dtype, op);
  at::Tensor logits = Device::empty({hidden_states.size(0), num_experts_of(weight)},
                                    logits_dtype, hidden_states);
  if (logits.numel() == 0) return logits;
  const at::Tensor hidden = with_contiguous_rows(hidden_states);
  const at::Tensor gate = is_prepacked(weight) ? weight : with_contiguous_rows(weight);
  run_router_gemm(Device{}, fill_router_gemm_params(hidden, gate, logits), hidden, gate,
                  logits, op);
  return logits;
}

using Signature = decltype(router_gemm<Cpu>);

const c10::TypedOperatorHandle<Signature>& handle() {
  static const auto h = typed_op<Signature>("moeext::router_gemm");
  return h;
}

// ---- Autograd ----------------------------------------------------------------------------
// logits = hidden_states @ weight.T, so the gradients are grad @ weight and grad.T @
// hidden_states, each computed in fp32 (as the forward accumulates) and returned in its
// input's dtype. Without this kernel autograd's fallback gave both none, and a gate trained
// through moeext.nn.GroupedTopKRouter silently kept its weight.

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct RouterGemmFunction : public torch::autograd::Function<RouterGemmFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& hidden_states,
                               const at::Tensor& weight,
                               std::optional<c10::ScalarType> out_dtype) {
    at::AutoDispatchBelowADInplaceOrView guard;
    at::Tensor logits = handle().call(hidden_states, weight, out_dtype);
    ctx->save_for_backward({hidden_states, weight});
    return {logits};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const at::Tensor& grad_logits = grad_outputs[0];
    if (!grad_logits.defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& hidden_states = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor g = grad_logits.to(at::kFloat);
    at::Tensor grad_hidden, grad_weight;
    if (ctx->needs_input_grad(0)) {
      grad_hidden = g.mm(weight.to(at::kFloat)).to(hidden_states.scalar_type());
    }
    if (ctx->needs_input_grad(1)) {
      grad_weight = g.t().mm(hidden_states.to(at::kFloat)).to(weight.scalar_type());
    }
    return {grad_hidden, grad_weight, at::Tensor()};
  }
};

at::Tensor router_gemm_autograd(c10::DispatchKeySet keys, const at::Tensor& hidden_states,
                                const at::Tensor& weight,
                                std::optional<c10::ScalarType> out_dtype) {
  if (!at::GradMode::is_enabled() ||
      (!hidden_states.requires_grad() && !weight.requires_grad())) {
    return handle().redispatch(keys & c10::after_autograd_keyset, hidden_states, weight,
                               out_dtype);
  }
  // Its gradient would have to be packed, and the hidden states' read through the tiles: a
  // serving layout, made once under no_grad, with no use for either.
  TORCH_CHECK(!is_prepacked(weight), "router_gemm: ",
              hidden_states.requires_grad() ? "hidden_states" : "weight",
              " requires grad, but a prepacked weight has no gradient formula (pass the "
              "[num_experts, hidden_size] weight, or call this under torch.no_grad())");
  return RouterGemmFunction::apply(hidden_states, weight, out_dtype)[0];
}

// ---- Direct call -------------------------------------------------------------------------

const DirectCallRegistration kDirectCall{
    "call_router_gemm", &DirectCall<Signature>::call<&handle, RouterGemmComputesMuch>,
    "moeext.router_gemm's direct call of the op: all three arguments positionally, of the "
    "plain Python types; returns NotImplemented for anything else."};

// ---- The prepacked layout, written once at load time -------------------------------------
// No op: a load-time layout change of a CPU weight, with no gradient and no GPU form.

at::Tensor prepack(const at::Tensor& weight) {
  constexpr const char* op = "prepack_router_weight";
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 &&
                  weight.scalar_type() == at::kBFloat16,
              op, ": weight must be a 2-D bfloat16 CPU tensor, got ", weight.scalar_type(), " ",
              weight.sizes(), " on ", weight.device());
  const int64_t num_experts = weight.size(0), hidden_size = weight.size(1);
  at::Tensor packed = Cpu::empty({(hidden_size + 1) / 2, num_experts, 2}, at::kBFloat16, weight);
  RouterWeightPackParams p;
  p.weight = weight.data_ptr();
  p.weight_row_stride = weight.stride(0);
  p.weight_col_stride = weight.stride(1);
  p.packed = packed.data_ptr();
  p.num_experts = num_experts;
  p.hidden_size = hidden_size;
  // Streams at memory speed: a few MiB per thread.
  parallel_for(0, num_experts, std::max<int64_t>(1, (int64_t(1) << 20) / std::max<int64_t>(1, 2 * hidden_size)),
               [&](int64_t begin, int64_t end) { prepack_router_weight_cpu(p, begin, end); });
  return packed;
}

// moeext.prepack_router_weight's call: the weight, an exact torch.Tensor (the wrapper checks
// and explains the rest).
PyObject* prepack_call(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  at::Tensor weight;
  if (nargs != 1 || !parse(args[0], weight)) {
    PyErr_SetString(PyExc_TypeError, "prepack_router_weight: weight must be a torch.Tensor");
    return nullptr;
  }
  at::Tensor packed;
  {
    ReleaseGilIf no_gil(weight.numel() >= (int64_t(1) << 16));
    packed = prepack(weight);
  }
  return to_python(packed);
  END_HANDLE_TH_ERRORS
}

const DirectCallRegistration kPrepack{
    "prepack_router_weight", &prepack_call,
    "The [ceil(H / 2), E, 2] prepacked layout of a bf16 CPU router weight [E, H] (any strides); "
    "see moeext.prepack_router_weight."};

}  // namespace

TORCH_LIBRARY_IMPL(moeext, CPU, m) {
  m.impl("router_gemm", &router_gemm<Cpu>);
}

#if defined(MOEEXT_GPU_BACKEND)
TORCH_LIBRARY_IMPL(moeext, CUDA, m) {
  m.impl("router_gemm", &router_gemm<Gpu>);
}
#endif

TORCH_LIBRARY_IMPL(moeext, Autograd, m) {
  m.impl("router_gemm", &router_gemm_autograd);
}

}  // namespace moeext::torch_glue
