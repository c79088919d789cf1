// The pagedkv._C Python module: the op schemas and the CPU kernel query. Each backend registers
// its kernels with TORCH_LIBRARY_IMPL in its own file (csrc/cpu, csrc/cuda).
#include <Python.h>

#include <string>

#include "cpu/attention_work.h"
#include "schemas.h"

TORCH_LIBRARY(pagedkv, m) {
  pagedkv::define_schemas(m);
  // The CPU attention kernels in use (base, avx2, avx512): a query of this build and processor,
  // not a tensor op, so it is defined here with its one implementation rather than per backend.
  m.def("cpu_attention_kernel(int head_size=128) -> str", [](int64_t head_size) {
    TORCH_CHECK(head_size > 0, "cpu_attention_kernel: head_size must be positive, got ",
                head_size);
    return std::string(pagedkv::cpu::attention_kernel_name(static_cast<int32_t>(head_size)));
  });
  // Whether bfloat16 prefill on the CPU takes bf16 dot products (vdpbf16ps) for this head size.
  m.def("cpu_bf16_dot_products(int head_size=128) -> bool", [](int64_t head_size) {
    TORCH_CHECK(head_size > 0, "cpu_bf16_dot_products: head_size must be positive, got ",
                head_size);
    return pagedkv::cpu::bf16_dot_products(static_cast<int32_t>(head_size));
  });
  // Whether bfloat16 prefill on the CPU takes AMX tiles (tdpbf16ps) for this head size.
  m.def("cpu_amx_tiles(int head_size=128) -> bool", [](int64_t head_size) {
    TORCH_CHECK(head_size > 0, "cpu_amx_tiles: head_size must be positive, got ", head_size);
    return pagedkv::cpu::amx_tiles(static_cast<int32_t>(head_size));
  });
  // The CPU's measured peak rate (GFLOP/s on every thread of ATen's pool) of float FMAs ("fp32")
  // or bfloat16 dot products ("bf16", AVX512_BF16 only), with the kernels' own instructions.
  m.def("cpu_peak_gflops(str kind='fp32', float seconds=0.05) -> float",
        [](std::string kind, double seconds) {
          return pagedkv::cpu::peak_gflops(kind.c_str(), seconds);
        });
}

extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
