// The pagedkv._simt extension module: torch.ops.pagedkv_simt, the op schemas of pagedkv
// (csrc/schemas.h) implemented by the CUDA kernel source run on the emulator (csrc/simt) for
// CPU tensors (cache_ops.cpp, attention_ops.cpp), and torch.ops.pagedkv_simt_ctl, the
// emulator's controls (controls.cpp). Importing the module loads the library, which registers
// them.
#include <Python.h>

#include "schemas.h"

TORCH_LIBRARY(pagedkv_simt, m) { pagedkv::define_schemas(m); }

extern "C" PyMODINIT_FUNC PyInit__simt() {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_simt",
                               "CUDA kernels of pagedkv run on the CPU by the simt emulator",
                               -1, nullptr};
  return PyModule_Create(&module);
}
