#!/usr/bin/env bash
# What the emulated tensor-core instructions cost on simt (see simt_tensor_core.cpp).
#
#   bench/simt_tensor_core.sh [ITERATIONS]
#
# Compiles the emulator (csrc/simt/*.cpp) with the flags setup.py gives pagedkv._simt and the
# benchmark's kernels; needs g++ and the CUDA toolkit headers ($CUDA_HOME, default
# /usr/local/cuda). Prints CPU time per warp instruction (per thread for cp.async).
set -euo pipefail
root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
cuda=${CUDA_HOME:-/usr/local/cuda}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
g++ -std=c++20 -O1 -g -fno-strict-aliasing -UNDEBUG -Wno-unknown-pragmas -pthread \
  -I"$root/csrc" -I"$cuda/include" "$root/bench/simt_tensor_core.cpp" "$root"/csrc/simt/*.cpp \
  -ldl -o "$work/simt_tensor_core"
"$work/simt_tensor_core" "${1:-2000}"
