// torch.ops.pagedkv_simt_ctl: the emulator's controls (fiber order, workers) for Python
// (pagedkv.ops.simt.set_order / set_workers / config). Bad values raise RuntimeError.
#include <torch/library.h>

#include "simt/runtime.h"
#include "simt/traffic.h"

namespace {

void set_order(const std::string& order, int64_t seed) { simt::set_order(order, uint64_t(seed)); }
void set_workers(int64_t n) { simt::set_workers(int(n)); }

std::tuple<std::string, int64_t, int64_t> config() {
  static const char* names[] = {"forward", "reverse", "random"};
  return {names[int(simt::order())], int64_t(simt::seed()), simt::workers()};
}

}  // namespace

TORCH_LIBRARY(pagedkv_simt_ctl, m) {
  m.def("set_order(str order, int seed) -> ()", &set_order);
  m.def("set_workers(int n) -> ()", &set_workers);
  m.def("config() -> (str, int, int)", &config);
  m.def("profile_start() -> ()", [] { simt::traffic::start(); });
  m.def("profile_stop() -> str", [] { return simt::traffic::stop(); });
}
