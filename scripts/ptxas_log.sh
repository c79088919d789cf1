#!/usr/bin/env bash
# nvcc as setup.py runs it for pagedkv._C (PYTORCH_NVCC): runs $PAGEDKV_NVCC with the arguments
# it is given and keeps ptxas's resource report (-Xptxas=-v, which setup.py adds: registers,
# shared memory, spills per kernel and arch) in OBJECT.ptxas.log beside the object, which
# `scripts/ptxas_report.sh --logs` and tests/test_ptxas_report.py read, so that the report needs
# no compile of its own. Other output (warnings, errors) still goes to the build log. A command
# without -o OBJECT runs unchanged.
#
#   PAGEDKV_NVCC=/usr/local/cuda/bin/nvcc scripts/ptxas_log.sh ARGS... -o OBJECT ...
set -uo pipefail
nvcc=${PAGEDKV_NVCC:?ptxas_log.sh: PAGEDKV_NVCC (the nvcc to run) is not set}
obj=
prev=
for arg in "$@"; do
  [ "$prev" = -o ] && obj=$arg
  prev=$arg
done
[ -n "$obj" ] || exec "$nvcc" "$@"
log=$obj.ptxas.log
"$nvcc" "$@" >"$log" 2>&1
rc=$?
grep -v -e '^ptxas info' -e '^ *[0-9]* bytes stack frame' "$log" >&2
exit $rc
