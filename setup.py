"""Build pagedkv's native modules.

pagedkv._C     the ops: CPU kernels always (the attention kernels once per instruction set,
               see cpu_isa_units); CUDA kernels when torch has CUDA and nvcc is found.
pagedkv._simt  the same CUDA kernel source compiled as host C++ against the SIMT emulator, for
               CPU tensors (built whenever the CUDA toolkit headers are found): the emulator
               (csrc/simt) and the backend glue (csrc/simt_backend).

Environment switches:
  PAGEDKV_CUDA=0|1   force the CUDA kernels off or on (default: on when possible)
  PAGEDKV_SIMT=0|1   force the simt module off or on (default: on when the toolkit is found)
  PAGEDKV_SIMT_SANITIZE=address  build only pagedkv._simt, with ASan + UBSan, into
                     build/simt-address/pagedkv (never in place; `make sanitize` runs it)
  TORCH_CUDA_ARCH_LIST  GPU archs to build for (default here "8.0;9.0" when no GPU is visible)
  PAGEDKV_DEBUG=1    full debug information (-g: locals in gdb) instead of line tables (-g1)
  MAX_JOBS           parallel compile jobs (default: the number of cores)
  CUDA_HOME          toolkit root (default: derived from the real path of nvcc)
  PAGEDKV_EXT=0      no native modules (used by `make` to install the source tree editable once,
                     while the modules themselves are built in place, incrementally)
"""

import glob
import os
import re
import shutil
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent.resolve()
DEFAULT_ARCHS = "8.0;9.0"


def cuda_home() -> str | None:
    """The toolkit root: $CUDA_HOME, else the first of (nvcc's real location, /usr/local/cuda)
    that has the runtime headers. /usr/local/bin/nvcc may be a wrapper whose prefix (/usr/local)
    has no toolkit, which is where torch.utils.cpp_extension would otherwise look."""
    if os.environ.get("CUDA_HOME"):
        return os.environ["CUDA_HOME"]
    candidates = [Path("/usr/local/cuda")]
    nvcc = shutil.which("nvcc")
    if nvcc is not None:
        candidates.insert(0, Path(nvcc).resolve().parent.parent)
    for root in candidates:
        if (root / "include" / "cuda_runtime.h").exists() and (root / "bin" / "nvcc").exists():
            return str(root)
    return None


def switch(name: str, available: bool, why: str) -> bool:
    value = os.environ.get(name)
    if value is None:
        return available
    if value == "1" and not available:
        raise SystemExit(f"{name}=1 but {why}")
    return value == "1"


def sources(*patterns: str) -> list[str]:
    """Relative paths, as setuptools requires."""
    return sorted(str(p.relative_to(ROOT)) for pat in patterns for p in ROOT.glob(pat))


CUDA_HOME = cuda_home()
if CUDA_HOME:
    os.environ["CUDA_HOME"] = CUDA_HOME  # read by torch.utils.cpp_extension at import

import torch  # noqa: E402
from torch.utils import cpp_extension  # noqa: E402

WITH_CUDA = switch(
    "PAGEDKV_CUDA",
    torch.version.cuda is not None and CUDA_HOME is not None,
    "torch has no CUDA or no CUDA toolkit (nvcc) was found",
)
WITH_SIMT = switch(
    "PAGEDKV_SIMT",
    CUDA_HOME is not None and Path(CUDA_HOME, "include", "cuda_fp16.h").exists(),
    "the CUDA toolkit headers were not found",
)
if WITH_CUDA and not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
    os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_ARCHS
os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))

# -fopenmp: at::parallel_for is inline in ATen's headers and runs serially in a unit compiled
# without OpenMP. The module then links libgomp.so.1, the soname torch already loaded.
# -fno-wrapv: undoes the -fwrapv of Python's own CFLAGS, which setuptools puts first. With it,
# GCC cannot assume that an int index does not overflow, and the CPU attention kernels' loops
# over rows and keys ran 3-9% slower (bench/cpu_attention_ab.cpp, one version built each way).
# -g1: line tables only (file and line in backtraces, perf and the sanitizers' reports) over the
# -g of Python's CFLAGS, whose full debug information of the torch headers doubled the compile
# time of every unit that includes them (simt_backend/attention_ops.cpp: 34 s with -g, 16 s with
# -g1; under ASan, 39 and 25 s). GCC emits the same code either way.
DEBUG_FLAGS = ["-g"] if os.environ.get("PAGEDKV_DEBUG") == "1" else ["-g1"]
CXX_FLAGS = ["-O3", "-std=c++20", "-Wall", "-Wno-unknown-pragmas", "-fopenmp", "-fno-wrapv",
             *DEBUG_FLAGS]
# -Xptxas=-v: ptxas's resource report of every kernel, which scripts/ptxas_log.sh (the nvcc that
# cpp_extension runs, see nvcc_with_ptxas_log) keeps beside each object for the spill check.
NVCC_FLAGS = ["-O3", "-std=c++20", "--expt-relaxed-constexpr", "-lineinfo", "-Xptxas=-v"]
SIMT_FLAGS = [
    "-std=c++20", "-O1", *DEBUG_FLAGS, "-fno-strict-aliasing", "-UNDEBUG",
    "-Wno-unknown-pragmas", "-pthread",
]
# PAGEDKV_SIMT_SANITIZE: a sanitized pagedkv._simt beside (not over) the normal one.
SIMT_SANITIZE = os.environ.get("PAGEDKV_SIMT_SANITIZE", "")
SANITIZE_FLAGS = {
    "address": [
        "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
        "-fno-omit-frame-pointer",
    ],
}


def cpu_isa_units() -> list[str]:
    """The CPU attention kernels once per instruction set of PAGEDKV_CPU_ISAS
    (csrc/cpu/attention_work.h): for each, a generated source in build/cpu_isa/ that defines
    PKV_ISA_NAME and includes csrc/cpu/attention_isa.inc. Written only when its text changes,
    so that rebuilds stay incremental, and atomically (a build running beside this one, as CI
    runs the ASan build, never reads a half-written unit)."""
    header = (ROOT / "csrc/cpu/attention_work.h").read_text()
    line = re.search(r"^#define PAGEDKV_CPU_ISAS\(X\)(.*)$", header, re.M).group(1)
    units = []
    for isa in re.findall(r"X\((\w+)\)", line):
        unit = ROOT / "build" / "cpu_isa" / f"attention_{isa}.cpp"
        text = f'#define PKV_ISA_NAME {isa}\n#include "cpu/attention_isa.inc"\n'
        if not unit.exists() or unit.read_text() != text:
            unit.parent.mkdir(parents=True, exist_ok=True)
            staged = unit.with_suffix(f".{os.getpid()}.tmp")
            staged.write_text(text)
            staged.replace(unit)
        units.append(str(unit.relative_to(ROOT)))
    return units


def nvcc_with_ptxas_log() -> None:
    """cpp_extension runs $PYTORCH_NVCC (one path) in place of nvcc: make it scripts/ptxas_log.sh,
    which runs the real one ($PYTORCH_NVCC as the user gave it, a ccache wrapper say, else the
    toolkit's) and keeps each object's ptxas report in OBJECT.ptxas.log, read by
    tests/test_ptxas_report.py and `scripts/ptxas_report.sh --logs build`."""
    wrapper = str(ROOT / "scripts" / "ptxas_log.sh")
    nvcc = os.environ.get("PYTORCH_NVCC", str(Path(CUDA_HOME, "bin", "nvcc")))
    if nvcc != wrapper:
        os.environ["PAGEDKV_NVCC"] = nvcc
        os.environ["PYTORCH_NVCC"] = wrapper


def c_extension() -> cpp_extension.CppExtension:
    srcs = sources("csrc/bindings.cpp", "csrc/cpu/*.cpp") + cpu_isa_units()
    common = dict(
        name="pagedkv._C", include_dirs=[str(ROOT / "csrc")], extra_link_args=["-fopenmp"]
    )
    if not WITH_CUDA:
        return cpp_extension.CppExtension(sources=srcs, extra_compile_args=CXX_FLAGS, **common)
    srcs += sources("csrc/cuda/*.cpp", "csrc/cuda/*.cu")
    nvcc_with_ptxas_log()
    flags = {"cxx": CXX_FLAGS + ["-DPAGEDKV_WITH_CUDA"], "nvcc": NVCC_FLAGS}
    return cpp_extension.CUDAExtension(sources=srcs, extra_compile_args=flags, **common)


def simt_extension(sanitize: str = "") -> cpp_extension.CppExtension:
    flags = SANITIZE_FLAGS[sanitize] if sanitize else []
    return cpp_extension.CppExtension(
        name="pagedkv._simt",
        sources=sources("csrc/simt/*.cpp", "csrc/simt_backend/*.cpp"),
        include_dirs=[str(ROOT / "csrc"), str(Path(CUDA_HOME, "include"))],
        extra_compile_args=SIMT_FLAGS + flags,
        extra_link_args=["-pthread"] + flags,
    )


def sanitized_simt_build(mode: str) -> tuple[list, dict]:
    """The extension list and build_ext options of PAGEDKV_SIMT_SANITIZE=mode."""
    if mode not in SANITIZE_FLAGS:
        raise SystemExit(f"PAGEDKV_SIMT_SANITIZE must be 'address', not {mode!r}")
    if not WITH_SIMT:
        raise SystemExit("PAGEDKV_SIMT_SANITIZE is set but the simt module is not built")
    if {"--inplace", "-i"} & set(sys.argv):
        raise SystemExit("PAGEDKV_SIMT_SANITIZE builds into build/simt-<mode>, never in place")
    out = str(ROOT / "build" / f"simt-{mode}")
    return [simt_extension(mode)], {"build_ext": {"build_lib": out, "build_temp": f"{out}/temp"}}


extensions = [c_extension()]
options = {}
if os.environ.get("PAGEDKV_EXT") == "0":
    extensions = []
elif SIMT_SANITIZE:
    extensions, options = sanitized_simt_build(SIMT_SANITIZE)
elif WITH_SIMT and glob.glob(str(ROOT / "csrc/simt/*.cpp")):
    extensions.append(simt_extension())

setup(
    ext_modules=extensions,
    options=options,
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
)
