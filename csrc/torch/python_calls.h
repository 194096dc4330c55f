// The Python wrappers' direct calls of the routing ops (python_calls.cpp), as CPython
// methods for moeext._C.
#pragma once

#include <Python.h>

namespace moeext::torch_glue {

// A table of METH_FASTCALL functions, ended by an entry with a null name.
PyMethodDef* python_call_methods();

}  // namespace moeext::torch_glue
