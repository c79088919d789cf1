#!/usr/bin/env bash
# A/B of two versions of the CPU attention kernel in one process (see cpu_attention_ab.cpp).
#
#   bench/cpu_attention_ab.sh REV_A REV_B [SEQS CONTEXT bf16|fp32 REPS THREADS [huge] [new=N]
#                             [kv=H]]
#
# REV_A, REV_B: git revisions, or "." for the working tree. Their csrc/cpu attention headers are
# compiled side by side against B's csrc/cpu/attention_work.h (A's kernels must accept its
# interface: B is the newer one). Defaults: 8 2048 bf16 30 $(nproc). new=N: chunked prefill of N
# queries per sequence (the last N of CONTEXT), in items of as many query rows as each version's
# attention.cpp plans. Needs g++ with AVX2; prints median times, each version's fraction of the
# probe (decode: read bandwidth; prefill: FMA rate), B/A and the largest difference between
# their outputs.
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
# Query rows per varlen item in each version's planner (kMaxRowsPerItem, a number or a constant
# of attention_work.h).
rows_of() {
  local v
  v=$(sed -n 's/^constexpr int kMaxRowsPerItem = \([A-Za-z0-9]*\);.*/\1/p' \
    "$work/src/$1/csrc/cpu/attention.cpp")
  case $v in
    [0-9]*) echo "$v" ;;
    *) sed -n "s/^constexpr int $v = \([0-9]*\);.*/\1/p" "$work/src/$1/csrc/cpu/attention_work.h" ;;
  esac
}
g++ -O3 -std=c++20 -fopenmp -mavx2 -mfma -mf16c -I"$work" -I"$work/src/b/csrc" \
  "$root/bench/cpu_attention_ab.cpp" -o "$work/ab"
"$work/ab" "${1:-8}" "${2:-2048}" "${3:-bf16}" "${4:-30}" "${5:-$(nproc)}" "${@:6}" \
  "rows=$(rows_of a),$(rows_of b)"
