#!/usr/bin/env bash
# A/B of two versions of the CPU attention kernel in one process (see cpu_attention_ab.cpp).
#
#   bench/cpu_attention_ab.sh REV_A REV_B [SEQS CONTEXT bf16|fp32 REPS THREADS [huge] [new=N]
#                             [kv=H]]
#
# REV_A, REV_B: git revisions, or "." for the working tree. Their csrc/cpu attention kernels are
# compiled side by side against B's csrc/cpu/attention_work.h (A's kernels must accept its
# interface: B is the newer one). Defaults: 8 2048 bf16 30 $(nproc). new=N: chunked prefill of N
# queries per sequence (the last N of CONTEXT), in items of as many query rows as each version's
# attention.cpp plans. Needs g++ with AVX2; prints median times (wall and CPU), each version's
# fraction of the probe (decode: read bandwidth; prefill: FMA rate), B/A and the largest
# difference between their outputs.
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
  # The version's kernel files, flat in ab_<side>/ (their includes of each other made local),
  # and ab_<side>/kernels.inc, which includes the one its attention_isa.inc includes (older
  # versions: attention_kernel.h).
  cpu=$work/src/$side/csrc/cpu
  mkdir -p "$work/ab_$side"
  for f in "$cpu"/attention_*.h "$cpu"/attention_*.inc; do
    case $(basename "$f") in attention_work.h | attention_isa.inc | 'attention_*'*) continue ;; esac
    sed '/attention_work\.h/!s|#include "cpu/\(attention_[a-z0-9_]*\.[a-z]*\)"|#include "\1"|' \
      "$f" > "$work/ab_$side/$(basename "$f")"
  done
  entry=$(sed -n 's|^#include "cpu/\(attention_[a-z0-9_]*\.[a-z]*\)"$|\1|p' \
    "$cpu/attention_isa.inc" 2>/dev/null | grep -v '^attention_work\.h$' || true)
  echo "#include \"${entry:-attention_kernel.h}\"" > "$work/ab_$side/kernels.inc"
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
