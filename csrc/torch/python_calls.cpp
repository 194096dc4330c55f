// Direct calls of the per-step ops from the Python wrappers (moeext.biased_grouped_topk and
// its _out form, router_gemm, zero_tail_ and zero_tail_tracked_). torch.ops converts each
// argument through the schema's generic IValue path: on the 2-core VM of 2026-11-25 that is
// 0.1 us per int argument and 2.1 us for a routing call with no rows, against 0.8 us here, so
// at decode batch sizes it was most of the op's time.
//
// These functions take the plain Python types only (exactly torch.Tensor or Parameter, int,
// bool, float, str, torch.dtype or None where the schema has ScalarType?) and call the
// registered op through the dispatcher, so every dispatch key
// (CPU, CUDA, Meta, Autograd, dispatch modes) behaves as it does through
// torch.ops. The GIL is released around long calls, and errors reach Python as torch.ops
// raises them. For anything else (a tensor subclass such as a fake tensor, a torch-function
// mode, a numpy int, an int where a bool goes) they return NotImplemented and the wrapper
// calls torch.ops, which converts the argument or explains why it cannot.
#include "torch/python_calls.h"

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <new>
#include <optional>
#include <string_view>
#include <tuple>

#include "torch/op_handles.h"

namespace moeext::torch_glue {
namespace {

// Each parse_* returns false where the argument is not of the plain type (nothing raised).
bool parse_tensor(PyObject* obj, at::Tensor& out) {
  if (!THPVariable_CheckExact(obj)) return false;
  out = THPVariable_Unpack(obj);
  return true;
}

bool parse_optional_tensor(PyObject* obj, std::optional<at::Tensor>& out) {
  if (obj == Py_None) {
    out.reset();
    return true;
  }
  at::Tensor t;
  if (!parse_tensor(obj, t)) return false;
  out = std::move(t);
  return true;
}

bool parse_int(PyObject* obj, int64_t& out) {
  if (!PyLong_CheckExact(obj)) return false;
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
  if (overflow != 0) return false;
  out = v;
  return true;
}

bool parse_bool(PyObject* obj, bool& out) {
  if (!PyBool_Check(obj)) return false;
  out = obj == Py_True;
  return true;
}

// torch.ops takes an int for a float argument too.
bool parse_float(PyObject* obj, double& out) {
  if (PyFloat_CheckExact(obj)) {
    out = PyFloat_AS_DOUBLE(obj);
    return true;
  }
  int64_t i = 0;
  if (!parse_int(obj, i)) return false;
  out = double(i);
  return true;
}

bool parse_str(PyObject* obj, std::string_view& out) {
  if (!PyUnicode_CheckExact(obj)) return false;
  Py_ssize_t size = 0;
  const char* data = PyUnicode_AsUTF8AndSize(obj, &size);
  if (data == nullptr) {  // not encodable (lone surrogates): torch.ops says why
    PyErr_Clear();
    return false;
  }
  out = std::string_view(data, size_t(size));
  return true;
}

bool parse_optional_dtype(PyObject* obj, std::optional<at::ScalarType>& out) {
  if (obj == Py_None) {
    out.reset();
    return true;
  }
  if (!THPDtype_Check(obj)) return false;
  out = reinterpret_cast<THPDtype*>(obj)->scalar_type;
  return true;
}

// A torch-function mode would see the op through torch.ops; here it would not.
bool torch_function_mode_active() { return at::impl::torch_function_mode_enabled(); }

PyObject* not_implemented() { Py_RETURN_NOTIMPLEMENTED; }

// torch.ops raises MemoryError for a std::bad_alloc (pybind11's mapping of it); torch's
// HANDLE_TH_ERRORS alone would make it a RuntimeError. A python_error holding MemoryError
// goes through HANDLE_TH_ERRORS's own handlers, which restore it.
[[noreturn]] void throw_memory_error(const std::bad_alloc& error) {
  PyErr_SetString(PyExc_MemoryError, error.what());
  python_error e;
  e.persist();
  throw e;
}

#define MOEEXT_HANDLE_ERRORS \
  HANDLE_TH_ERRORS           \
  try {
#define MOEEXT_END_HANDLE_ERRORS         \
  }                                      \
  catch (const std::bad_alloc& e) {      \
    throw_memory_error(e);               \
  }                                      \
  END_HANDLE_TH_ERRORS

// Releases the GIL around calls long enough for another thread to use it (16k logits: about
// 8-16 us of routing). Releasing and retaking it costs 25-30 ns, 2.5% of a one-token call.
class ReleaseGilIfLong {
 public:
  explicit ReleaseGilIfLong(const at::Tensor& gating_output)
      : ReleaseGilIfLong(gating_output.numel() >= 16384) {}
  explicit ReleaseGilIfLong(bool is_long) : state_(is_long ? PyEval_SaveThread() : nullptr) {}
  ~ReleaseGilIfLong() {
    if (state_ != nullptr) PyEval_RestoreThread(state_);
  }
  ReleaseGilIfLong(const ReleaseGilIfLong&) = delete;
  ReleaseGilIfLong& operator=(const ReleaseGilIfLong&) = delete;

 private:
  PyThreadState* state_;
};

// The arguments both routing ops share after their tensors, in schema order.
struct RoutingArgs {
  std::optional<at::Tensor> correction_bias;
  int64_t num_expert_group = 0, topk_group = 0;
  bool renormalize = true;
  double routed_scaling_factor = 1.0;
  std::string_view scoring_func;
};

bool parse_routing_tail(PyObject* const* args, RoutingArgs& a) {
  return parse_bool(args[0], a.renormalize) && parse_float(args[1], a.routed_scaling_factor) &&
         parse_str(args[2], a.scoring_func);
}

// (gating_output, correction_bias, num_expert_group, topk_group, topk, renormalize,
//  routed_scaling_factor, scoring_func) -> (topk_weights, topk_ids) or NotImplemented
PyObject* call_biased_grouped_topk(PyObject* /*self*/, PyObject* const* args,
                                   Py_ssize_t nargs) {
  MOEEXT_HANDLE_ERRORS
  const auto& op = biased_grouped_topk_handle();
  at::Tensor gating_output;
  RoutingArgs a;
  int64_t topk = 0;
  if (nargs != 8 || torch_function_mode_active() || !parse_tensor(args[0], gating_output) ||
      !parse_optional_tensor(args[1], a.correction_bias) ||
      !parse_int(args[2], a.num_expert_group) || !parse_int(args[3], a.topk_group) ||
      !parse_int(args[4], topk) || !parse_routing_tail(args + 5, a)) {
    return not_implemented();
  }
  std::tuple<at::Tensor, at::Tensor> out;
  {
    ReleaseGilIfLong no_gil(gating_output);
    out = op.call(gating_output, a.correction_bias, a.num_expert_group, a.topk_group, topk,
                  a.renormalize, a.routed_scaling_factor,
                  c10::string_view(a.scoring_func.data(), a.scoring_func.size()));
  }
  PyObject* weights = THPVariable_Wrap(std::get<0>(out));
  PyObject* ids = weights == nullptr ? nullptr : THPVariable_Wrap(std::get<1>(out));
  PyObject* result = ids == nullptr ? nullptr : PyTuple_Pack(2, weights, ids);
  Py_XDECREF(weights);
  Py_XDECREF(ids);
  return result;
  MOEEXT_END_HANDLE_ERRORS
}

// (gating_output, correction_bias, topk_weights, topk_ids, num_expert_group, topk_group,
//  renormalize, routed_scaling_factor, scoring_func) -> None or NotImplemented
PyObject* call_biased_grouped_topk_out(PyObject* /*self*/, PyObject* const* args,
                                       Py_ssize_t nargs) {
  MOEEXT_HANDLE_ERRORS
  const auto& op = biased_grouped_topk_out_handle();
  at::Tensor gating_output, topk_weights, topk_ids;
  RoutingArgs a;
  if (nargs != 9 || torch_function_mode_active() || !parse_tensor(args[0], gating_output) ||
      !parse_optional_tensor(args[1], a.correction_bias) ||
      !parse_tensor(args[2], topk_weights) || !parse_tensor(args[3], topk_ids) ||
      !parse_int(args[4], a.num_expert_group) || !parse_int(args[5], a.topk_group) ||
      !parse_routing_tail(args + 6, a)) {
    return not_implemented();
  }
  {
    ReleaseGilIfLong no_gil(gating_output);
    op.call(gating_output, a.correction_bias, topk_weights, topk_ids, a.num_expert_group,
            a.topk_group, a.renormalize, a.routed_scaling_factor,
            c10::string_view(a.scoring_func.data(), a.scoring_func.size()));
  }
  Py_RETURN_NONE;
  MOEEXT_END_HANDLE_ERRORS
}

// (hidden_states, weight, out_dtype) -> logits or NotImplemented
PyObject* call_router_gemm(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  MOEEXT_HANDLE_ERRORS
  const auto& op = router_gemm_handle();
  at::Tensor hidden_states, weight;
  std::optional<at::ScalarType> out_dtype;
  if (nargs != 3 || torch_function_mode_active() || !parse_tensor(args[0], hidden_states) ||
      !parse_tensor(args[1], weight) || !parse_optional_dtype(args[2], out_dtype)) {
    return not_implemented();
  }
  at::Tensor logits;
  {
    // 64k multiply-adds take about a microsecond even on the vector paths.
    const int64_t tokens = hidden_states.dim() > 0 ? hidden_states.size(0) : 0;
    ReleaseGilIfLong no_gil(tokens * weight.numel() >= (int64_t(1) << 16));
    logits = op.call(hidden_states, weight, out_dtype);
  }
  return THPVariable_Wrap(logits);
  MOEEXT_END_HANDLE_ERRORS
}

// Whether zeroing rows [new_extent, prev_extent) of buf writes enough to release the GIL for
// (64 KiB: a few microseconds).
bool zeroes_much(const at::Tensor& buf, int64_t new_extent, int64_t prev_extent) {
  // Negative extents are the op's error to raise (and would overflow the difference).
  if (buf.dim() == 0 || buf.size(0) == 0 || new_extent < 0 || prev_extent < 0) return false;
  const int64_t rows = buf.size(0);
  const int64_t zeroed = std::min(prev_extent, rows) - std::min(new_extent, rows);
  return zeroed > 0 && zeroed * (buf.numel() / rows) * int64_t(buf.element_size()) >= 65536;
}

// (buf, new_extent, prev_extent) -> None or NotImplemented
PyObject* call_zero_tail(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  MOEEXT_HANDLE_ERRORS
  const auto& op = zero_tail_handle();
  at::Tensor buf;
  int64_t new_extent = 0, prev_extent = 0;
  if (nargs != 3 || torch_function_mode_active() || !parse_tensor(args[0], buf) ||
      !parse_int(args[1], new_extent) || !parse_int(args[2], prev_extent)) {
    return not_implemented();
  }
  {
    ReleaseGilIfLong no_gil(zeroes_much(buf, new_extent, prev_extent));
    op.call(buf, c10::SymInt(new_extent), c10::SymInt(prev_extent));
  }
  Py_RETURN_NONE;
  MOEEXT_END_HANDLE_ERRORS
}

// (buf, state, new_extent) -> None or NotImplemented. The previous extent is on the device,
// so any buf that could hold a long tail releases the GIL.
PyObject* call_zero_tail_tracked(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  MOEEXT_HANDLE_ERRORS
  const auto& op = zero_tail_tracked_handle();
  at::Tensor buf, state;
  int64_t new_extent = 0;
  if (nargs != 3 || torch_function_mode_active() || !parse_tensor(args[0], buf) ||
      !parse_tensor(args[1], state) || !parse_int(args[2], new_extent)) {
    return not_implemented();
  }
  {
    ReleaseGilIfLong no_gil(zeroes_much(buf, new_extent, buf.dim() > 0 ? buf.size(0) : 0));
    op.call(buf, state, c10::SymInt(new_extent));
  }
  Py_RETURN_NONE;
  MOEEXT_END_HANDLE_ERRORS
}

// METH_FASTCALL functions are stored as PyCFunction; the cast goes through void (*)() so
// that compilers do not warn about the differing signature.
PyCFunction fastcall(PyObject* (*f)(PyObject*, PyObject* const*, Py_ssize_t)) {
  return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(f));
}

PyMethodDef kMethods[] = {
    {"call_biased_grouped_topk", fastcall(&call_biased_grouped_topk), METH_FASTCALL,
     "moeext.biased_grouped_topk's direct call of the op: all eight arguments positionally, "
     "of the plain Python types; returns NotImplemented for anything else."},
    {"call_biased_grouped_topk_out", fastcall(&call_biased_grouped_topk_out), METH_FASTCALL,
     "moeext.biased_grouped_topk_out's direct call of the op: all nine arguments "
     "positionally, of the plain Python types; returns NotImplemented for anything else."},
    {"call_router_gemm", fastcall(&call_router_gemm), METH_FASTCALL,
     "moeext.router_gemm's direct call of the op: all three arguments positionally, of the "
     "plain Python types; returns NotImplemented for anything else."},
    {"call_zero_tail", fastcall(&call_zero_tail), METH_FASTCALL,
     "moeext.zero_tail_'s direct call of the op: all three arguments positionally, of the "
     "plain Python types; returns NotImplemented for anything else."},
    {"call_zero_tail_tracked", fastcall(&call_zero_tail_tracked), METH_FASTCALL,
     "moeext.zero_tail_tracked_'s direct call of the op: all three arguments positionally, of "
     "the plain Python types; returns NotImplemented for anything else."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

PyMethodDef* python_call_methods() { return kMethods; }

}  // namespace moeext::torch_glue
