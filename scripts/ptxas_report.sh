#!/usr/bin/env bash
# Resource report of the CUDA kernels: registers, shared memory and spills per kernel, from
# ptxas -v, for sm_80 and sm_90. No GPU needed.
#
#   scripts/ptxas_report.sh [file.cu ...]   compile each file (default: csrc/cuda/attention_*.cu)
#                                           once for both archs and report
#   scripts/ptxas_report.sh --logs DIR      report from the ptxas logs that setup.py's build of
#                                           pagedkv._C (scripts/ptxas_log.sh) left under DIR
#                                           (build/ for `make build`): no compile
#
# Exits non-zero when a paged_attention kernel spills on sm_90, or a tensor-core one
# (paged_attention_tc_kernel, mla_attention_tc_kernel) on any arch, or when a unit's log is
# missing.
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC=${NVCC:-nvcc}
ARCHS=${ARCHS:-"80 90"}
units=(csrc/cuda/attention_*.cu)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
if [ "${1:-}" = --logs ]; then
  dir=${2:?usage: scripts/ptxas_report.sh --logs DIR}
  for f in "${units[@]}"; do
    found=$(find "$dir" -path "*/${f%.cu}.o.ptxas.log" -newer "$f" -print -quit)
    [ -n "$found" ] || { echo "ptxas_report: no ptxas log of $f under $dir newer than it" >&2; exit 1; }
    cp "$found" "$out/$(basename "$f" .cu).log"
  done
else
  files=("$@")
  [ ${#files[@]} -gt 0 ] || files=("${units[@]}")
  gencode=()
  for arch in $ARCHS; do gencode+=("-gencode=arch=compute_$arch,code=sm_$arch"); done
  for f in "${files[@]}"; do
    log="$out/$(basename "$f" .cu).log"
    "$NVCC" -std=c++20 -O3 --expt-relaxed-constexpr -Icsrc "${gencode[@]}" -c "$f" \
      -o "$out/obj.o" -Xptxas -v >"$log" 2>&1 || { cat "$log"; exit 1; }
  done
fi
python3 - "$out" <<'PY'
import glob, re, subprocess, sys

rows = []
for log in sorted(glob.glob(sys.argv[1] + "/*.log")):
    unit_rows = []
    arch = name = None
    spill = (0, 0)
    for line in open(log):
        m = re.search(r"Compiling entry function '\S+' for '(sm_\d+)'", line)
        if m:
            arch = m.group(1)
            continue
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            name = m.group(1)
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and name:
            spill = (int(m.group(1)), int(m.group(2)))
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and name:
            smem = re.search(r"(\d+) bytes smem", line)
            unit_rows.append([arch, name, int(m.group(1)), int(smem.group(1)) if smem else 0,
                              *spill])
            name, spill = None, (0, 0)
    rows += sorted(unit_rows, key=lambda r: r[0])  # by arch, in ptxas's order within one
names = subprocess.run(["c++filt"], input="\n".join(r[1] for r in rows), text=True,
                       capture_output=True).stdout.split("\n")
def short(n):
    n = re.sub(r"pagedkv::(cuda|simt)::attn(_tc|_mla)?::", "", n)
    n = n.replace("pagedkv::", "").replace("__nv_bfloat16", "bf16").replace("__half", "half")
    return re.sub(r"\(.*\)$", "", n)
print(f"{'arch':6} {'regs':>4} {'smem':>5} {'spill st/ld':>11}  kernel (static smem; dynamic smem is"
      " DecodeSmem<HEAD>::kBytes, TcConfig<HEAD, WM, WN, BN>::kBytes for the tensor-core ones,"
      " MlaConfig<DV, WM>::kBytes for MLA)")
bad = 0
for r, n in zip(rows, names):
    print(f"{r[0]:6} {r[2]:4d} {r[3]:5d} {r[4]:5d}/{r[5]:<5d}  {short(n)}")
    checked = (("paged_attention_kernel" in n and r[0] == "sm_90") or "paged_attention_tc_kernel" in n
               or "mla_attention_tc_kernel" in n)
    if checked and (r[4] or r[5]):
        bad += 1
print(f"\n{len(rows)} kernels; {bad} paged_attention kernels spill (any on sm_90, tensor-core"
      " ones on any arch)")
sys.exit(1 if bad else 0)
PY
