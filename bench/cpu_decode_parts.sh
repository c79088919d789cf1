#!/usr/bin/env bash
# Builds and runs bench/cpu_decode_parts.cpp: a quantized decode step's S, softmax and P V alone,
# the kernels of this checkout for one instruction set and cache format (needs g++).
#
#   [ISA=avx512bf16|avx2] [FORMAT=int4|int8] bench/cpu_decode_parts.sh [ROWS] [PARTS] [STEPS]
#
# e.g. `64 S`, `4096 all`; ISA defaults to avx512bf16 where the processor has it, else avx2.
set -euo pipefail
root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [ -z "${ISA:-}" ]; then
  ISA=avx2
  grep -qw avx512_bf16 /proc/cpuinfo && ISA=avx512bf16
fi
case "$ISA" in avx2) isa=1 ;; avx512bf16) isa=3 ;; *) echo "ISA: avx2 or avx512bf16" >&2; exit 2 ;; esac
case "${FORMAT:-int4}" in int4) int4=1 ;; int8) int4=0 ;; *) echo "FORMAT: int4 or int8" >&2; exit 2 ;; esac
g++ -O3 -fno-wrapv -std=c++20 -DPKV_PARTS_ISA=$isa -DPKV_PARTS_INT4=$int4 -I"$root/csrc" \
  "$root/bench/cpu_decode_parts.cpp" -o "$work/cpu_decode_parts"
"$work/cpu_decode_parts" "$@"
