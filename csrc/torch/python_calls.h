// The Python wrappers' direct calls of the per-step ops (routing, router_gemm, zero_tail_,
// zero_tail_tracked_; python_calls.cpp), as CPython methods for moeext._C.
#pragma once

#include <Python.h>

namespace moeext::torch_glue {

// A table of METH_FASTCALL functions, ended by an entry with a null name.
PyMethodDef* python_call_methods();

}  // namespace moeext::torch_glue
