#include "torch/direct_call.h"

#include <ATen/PythonTorchFunctionTLS.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>

#include <array>
#include <new>

namespace moeext::torch_glue {

bool parse(PyObject* obj, at::Tensor& out) {
  if (!THPVariable_CheckExact(obj)) return false;
  out = THPVariable_Unpack(obj);
  return true;
}

bool parse_tensor(PyObject* obj, std::optional<at::Tensor>& out) {
  at::Tensor t;
  if (!parse(obj, t)) return false;
  out = std::move(t);
  return true;
}

bool parse(PyObject* obj, c10::string_view& out) {
  if (!PyUnicode_CheckExact(obj)) return false;
  Py_ssize_t size = 0;
  const char* data = PyUnicode_AsUTF8AndSize(obj, &size);
  if (data == nullptr) {  // not encodable (lone surrogates): torch.ops says why
    PyErr_Clear();
    return false;
  }
  out = c10::string_view(data, size_t(size));
  return true;
}

bool parse(PyObject* obj, std::optional<at::ScalarType>& out) {
  if (obj == Py_None) {
    out.reset();
    return true;
  }
  if (!THPDtype_Check(obj)) return false;
  out = reinterpret_cast<THPDtype*>(obj)->scalar_type;
  return true;
}

bool parse(PyObject* obj, c10::SymInt& out) {
  int64_t i = 0;
  if (!parse(obj, i)) return false;
  out = c10::SymInt(i);
  return true;
}

bool from_default(const c10::IValue& /*value*/, at::Tensor& /*out*/) { return false; }

bool from_default(const c10::IValue& value, std::optional<at::Tensor>& out) {
  if (!value.isNone()) return false;
  out.reset();
  return true;
}

bool from_default(const c10::IValue& value, int64_t& out) {
  if (!value.isInt()) return false;
  out = value.toInt();
  return true;
}

bool from_default(const c10::IValue& value, bool& out) {
  if (!value.isBool()) return false;
  out = value.toBool();
  return true;
}

bool from_default(const c10::IValue& value, double& out) {
  if (value.isDouble()) {
    out = value.toDouble();
    return true;
  }
  if (!value.isInt()) return false;
  out = double(value.toInt());
  return true;
}

// The schema's own string: it lives as long as the op's registration.
bool from_default(const c10::IValue& value, c10::string_view& out) {
  if (!value.isString()) return false;
  const std::string& text = value.toStringRef();
  out = c10::string_view(text.data(), text.size());
  return true;
}

bool from_default(const c10::IValue& value, std::optional<at::ScalarType>& out) {
  if (!value.isNone()) return false;
  out.reset();
  return true;
}

bool from_default(const c10::IValue& value, c10::SymInt& out) {
  if (!value.isInt()) return false;
  out = c10::SymInt(value.toInt());
  return true;
}

PyObject* to_python(const at::Tensor& t) { return THPVariable_Wrap(t); }

namespace {

// A Python tuple of the tensors (None for a null entry), or nullptr with the Python error set.
template <size_t N>
PyObject* tensor_tuple(const std::array<const at::Tensor*, N>& tensors) {
  PyObject* result = PyTuple_New(Py_ssize_t(N));
  if (result == nullptr) return nullptr;
  for (size_t i = 0; i < N; ++i) {
    PyObject* item = Py_None;
    if (tensors[i] != nullptr) {
      item = THPVariable_Wrap(*tensors[i]);
    } else {
      Py_INCREF(item);
    }
    if (item == nullptr) {
      Py_DECREF(result);
      return nullptr;
    }
    PyTuple_SET_ITEM(result, Py_ssize_t(i), item);  // steals the reference
  }
  return result;
}

}  // namespace

PyObject* to_python(const std::tuple<at::Tensor, at::Tensor>& t) {
  return tensor_tuple<2>({&std::get<0>(t), &std::get<1>(t)});
}

PyObject* to_python(const std::tuple<at::Tensor, at::Tensor, at::Tensor>& t) {
  return tensor_tuple<3>({&std::get<0>(t), &std::get<1>(t), &std::get<2>(t)});
}

PyObject* to_python_first_two(const std::tuple<at::Tensor, at::Tensor, at::Tensor>& t) {
  return tensor_tuple<3>({&std::get<0>(t), &std::get<1>(t), nullptr});
}

bool torch_function_mode_active() { return at::impl::torch_function_mode_enabled(); }

void throw_memory_error(const std::bad_alloc& error) {
  // A python_error holding MemoryError goes through HANDLE_TH_ERRORS's own handlers, which
  // restore it.
  PyErr_SetString(PyExc_MemoryError, error.what());
  python_error e;
  e.persist();
  throw e;
}

namespace {

std::deque<PyMethodDef>& methods() {
  static std::deque<PyMethodDef> registered;
  return registered;
}

}  // namespace

DirectCallRegistration::DirectCallRegistration(
    const char* name, PyObject* (*call)(PyObject*, PyObject* const*, Py_ssize_t),
    const char* doc) {
  // METH_FASTCALL functions are stored as PyCFunction; the cast goes through void (*)() so
  // that compilers do not warn about the differing signature.
  methods().push_back(PyMethodDef{
      name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(call)), METH_FASTCALL,
      doc});
}

const std::deque<PyMethodDef>& direct_call_methods() { return methods(); }

}  // namespace moeext::torch_glue
