// The pagedkv._simt extension module. Importing it loads the library, which registers the
// emulated kernels' torch ops (TORCH_LIBRARY blocks in this directory's other files).
#include <Python.h>

extern "C" PyMODINIT_FUNC PyInit__simt() {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_simt",
                               "CUDA kernels of pagedkv run on the CPU by the simt emulator",
                               -1, nullptr};
  return PyModule_Create(&module);
}
