#!/usr/bin/env bash
# Builds and runs bench/cpu_decode_parts.cpp: an int4 decode step's S, softmax and P V alone
# (the avx512bf16 kernels of this checkout; needs g++ and AVX512_BF16).
#
#   bench/cpu_decode_parts.sh [ROWS] [PARTS] [STEPS]     e.g. 64 S, 4096 all
set -euo pipefail
root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
g++ -O3 -fno-wrapv -std=c++20 -I"$root/csrc" "$root/bench/cpu_decode_parts.cpp" \
  -o "$work/cpu_decode_parts"
"$work/cpu_decode_parts" "$@"
