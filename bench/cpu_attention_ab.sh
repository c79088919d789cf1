#!/usr/bin/env bash
# A/B of two versions of the CPU attention kernel in one process (see cpu_attention_ab.cpp).
#
#   bench/cpu_attention_ab.sh REV_A REV_B [SEQS CONTEXT bf16|fp32 REPS THREADS [huge]]
#
# REV_A, REV_B: git revisions, or "." for the working tree. Their csrc/cpu attention headers are
# compiled side by side (they must share csrc/cpu/attention_work.h's interface). Defaults:
# 8 2048 bf16 30 $(nproc). Needs g++ with AVX2; prints median times, each version's fraction of
# the probe's read bandwidth, B/A and the largest difference between their outputs.
set -euo pipefail
[ $# -ge 2 ] || { sed -n '2,9p' "$0"; exit 2; }
root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for side in a b; do
  rev=$([ "$side" = a ] && echo "$1" || echo "$2")
  mkdir -p "$work/src/$side"
  if [ "$rev" = . ]; then
    cp -r "$root/csrc" "$work/src/$side/"
  else
    git -C "$root" archive "$rev" csrc | tar -x -C "$work/src/$side"
  fi
  mkdir -p "$work/ab_$side"
  for h in attention_kernel.h attention_simd.h attention_merge.h; do
    sed 's|#include "cpu/\(attention_[a-z]*\.h\)"|#include "\1"|' \
      "$work/src/$side/csrc/cpu/$h" > "$work/ab_$side/$h"
  done
done
shift 2
g++ -O3 -std=c++20 -fopenmp -mavx2 -mfma -mf16c -I"$work" -I"$work/src/a/csrc" \
  "$root/bench/cpu_attention_ab.cpp" -o "$work/ab"
"$work/ab" "${1:-8}" "${2:-2048}" "${3:-bf16}" "${4:-30}" "${5:-$(nproc)}" ${6:+"$6"}
