// The pagedkv._C Python module: the op schemas. Each backend registers its kernels with
// TORCH_LIBRARY_IMPL in its own file (csrc/cpu, csrc/cuda).
#include <Python.h>

#include "schemas.h"

TORCH_LIBRARY(pagedkv, m) { pagedkv::define_schemas(m); }

extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
