#!/usr/bin/env bash
# CUDA compiler launcher of the CMake kernel target (CMakeLists.txt): runs the nvcc command it
# is given and keeps ptxas's resource report (-Xptxas=-v: registers, shared memory, spills per
# kernel and arch) in OBJECT.ptxas.log, which `scripts/ptxas_report.sh --logs` reads, so that the
# report needs no compile of its own. Other output (warnings, errors) still goes to the build log.
#
#   scripts/ptxas_log.sh NVCC ARGS... -o OBJECT ...
set -uo pipefail
obj=
prev=
for arg in "$@"; do
  [ "$prev" = -o ] && obj=$arg
  prev=$arg
done
log=${obj:?ptxas_log.sh: the command has no -o OBJECT}.ptxas.log
"$@" >"$log" 2>&1
rc=$?
grep -v -e '^ptxas info' -e '^ *[0-9]* bytes stack frame' "$log" >&2
exit $rc
