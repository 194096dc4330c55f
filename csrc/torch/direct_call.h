// Direct calls of the per-step ops from their Python wrappers (moeext._C.call_<op>), made from
// the op's C++ signature by one template. torch.ops converts every argument through the
// schema's generic IValue path, which at decode sizes was most of a routing call's time
// (docs/notes/bindings-and-shuffles.md). A direct call parses the plain Python types itself (exactly
// torch.Tensor or Parameter, int, bool, float, str, torch.dtype, or None where the schema says
// optional) and calls the op through the dispatcher, so every dispatch key (CPU, CUDA, Meta,
// Autograd, modes) behaves as through torch.ops, and errors reach Python as torch.ops raises
// them. For anything else (a tensor subclass such as a fake tensor, a torch-function mode, a
// numpy int, an int where a bool goes) it returns NotImplemented, and the wrapper calls
// torch.ops, which converts the argument or says why it cannot.
#pragma once

#include <Python.h>

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/SymInt.h>
#include <torch/csrc/Exceptions.h>

#include <cstdint>
#include <deque>
#include <optional>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>

namespace moeext::torch_glue {

// Each parse returns false, raising nothing, where obj is not of the plain type. The ones a
// routing call passes most (None, int, float, bool) are inline: every decode step parses them.
bool parse(PyObject* obj, at::Tensor& out);
bool parse_tensor(PyObject* obj, std::optional<at::Tensor>& out);
inline bool parse(PyObject* obj, std::optional<at::Tensor>& out) {
  if (obj == Py_None) {
    out.reset();
    return true;
  }
  return parse_tensor(obj, out);
}
inline bool parse(PyObject* obj, int64_t& out) {
  if (!PyLong_CheckExact(obj)) return false;
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
  out = v;
  return overflow == 0;
}
inline bool parse(PyObject* obj, bool& out) {
  if (!PyBool_Check(obj)) return false;
  out = obj == Py_True;
  return true;
}
inline bool parse(PyObject* obj, double& out) {  // an int too, as torch.ops takes one
  if (PyFloat_CheckExact(obj)) {
    out = PyFloat_AS_DOUBLE(obj);
    return true;
  }
  int64_t i = 0;
  if (!parse(obj, i)) return false;
  out = double(i);
  return true;
}
bool parse(PyObject* obj, c10::string_view& out);
bool parse(PyObject* obj, std::optional<at::ScalarType>& out);
bool parse(PyObject* obj, c10::SymInt& out);  // a plain int only

// A trailing argument left out takes the schema's default (false where it has none).
bool from_default(const c10::IValue& value, at::Tensor& out);
bool from_default(const c10::IValue& value, std::optional<at::Tensor>& out);
bool from_default(const c10::IValue& value, int64_t& out);
bool from_default(const c10::IValue& value, bool& out);
bool from_default(const c10::IValue& value, double& out);
bool from_default(const c10::IValue& value, c10::string_view& out);
bool from_default(const c10::IValue& value, std::optional<at::ScalarType>& out);
bool from_default(const c10::IValue& value, c10::SymInt& out);

PyObject* to_python(const at::Tensor& t);
PyObject* to_python(const std::tuple<at::Tensor, at::Tensor>& t);
PyObject* to_python(const std::tuple<at::Tensor, at::Tensor, at::Tensor>& t);
// (t0, t1, None): the third tensor left out of Python.
PyObject* to_python_first_two(const std::tuple<at::Tensor, at::Tensor, at::Tensor>& t);

// A torch-function mode would see the op through torch.ops; a direct call would not.
bool torch_function_mode_active();

// torch.ops raises MemoryError for a std::bad_alloc (pybind11's mapping of it); torch's
// HANDLE_TH_ERRORS alone would make it a RuntimeError.
[[noreturn]] void throw_memory_error(const std::bad_alloc& error);

// Releases the GIL around calls long enough for another thread to use it; releasing and
// retaking it costs a few percent of a one-token routing call, so short calls keep it.
class ReleaseGilIf {
 public:
  explicit ReleaseGilIf(bool release) : state_(release ? PyEval_SaveThread() : nullptr) {}
  ~ReleaseGilIf() {
    if (state_ != nullptr) PyEval_RestoreThread(state_);
  }
  ReleaseGilIf(const ReleaseGilIf&) = delete;
  ReleaseGilIf& operator=(const ReleaseGilIf&) = delete;

 private:
  PyThreadState* state_;
};

template <typename Signature>
struct DirectCall;

template <typename Result, typename... Args>
struct DirectCall<Result(Args...)> {
  using Handle = c10::TypedOperatorHandle<Result(Args...)>;
  using Parsed = std::tuple<std::decay_t<Args>...>;

  // What an op returns, as its Python wrapper returns it, from the result and the arguments
  // (an op that returns nothing returns None).
  using Returned = std::conditional_t<std::is_void_v<Result>, std::nullptr_t, Result>;
  using ToPython = PyObject* (*)(const Returned&, PyObject* const*, Py_ssize_t);

  // A METH_FASTCALL function: the arguments positionally, trailing ones with a default in the
  // schema optional. Long::test(parsed arguments...) says whether the call is long enough to
  // release the GIL for; kToPython, where given, makes the Python result (else to_python).
  template <const Handle& (*kHandle)(), typename Long, ToPython kToPython = nullptr>
  static PyObject* call(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
    HANDLE_TH_ERRORS
    try {
      const Handle& op = kHandle();
      Parsed parsed;
      if (nargs > Py_ssize_t(sizeof...(Args)) || torch_function_mode_active() ||
          !parse_all(op, args, nargs, parsed, std::index_sequence_for<Args...>{})) {
        Py_RETURN_NOTIMPLEMENTED;
      }
      const auto run = [&](const auto&... a) { return op.call(a...); };
      const auto is_long = [](const auto&... a) { return Long::test(a...); };
      if constexpr (std::is_void_v<Result>) {
        {
          ReleaseGilIf no_gil(std::apply(is_long, parsed));
          std::apply(run, parsed);
        }
        Py_RETURN_NONE;
      } else {
        Result out;
        {
          ReleaseGilIf no_gil(std::apply(is_long, parsed));
          out = std::apply(run, parsed);
        }
        if constexpr (kToPython != nullptr) {
          return kToPython(out, args, nargs);
        } else {
          return to_python(out);
        }
      }
    } catch (const std::bad_alloc& e) {
      throw_memory_error(e);
    }
    END_HANDLE_TH_ERRORS
  }

 private:
  template <size_t... I>
  static bool parse_all(const Handle& op, PyObject* const* args, Py_ssize_t nargs,
                        Parsed& parsed, std::index_sequence<I...>) {
    const auto take = [&](auto index, auto& out) {
      constexpr size_t i = decltype(index)::value;
      if (Py_ssize_t(i) < nargs) return parse(args[i], out);
      const std::optional<c10::IValue>& fallback = op.schema().arguments()[i].default_value();
      return fallback.has_value() && from_default(*fallback, out);
    };
    return (take(std::integral_constant<size_t, I>{}, std::get<I>(parsed)) && ...);
  }
};

// Adds a direct call to moeext._C under `name`; one static instance per call, constructed when
// the library loads (module.cpp adds them to the module).
struct DirectCallRegistration {
  DirectCallRegistration(const char* name, PyObject* (*call)(PyObject*, PyObject* const*, Py_ssize_t),
                         const char* doc);
};

// Every registered call, as CPython method definitions (stable addresses: a deque).
const std::deque<PyMethodDef>& direct_call_methods();

}  // namespace moeext::torch_glue
