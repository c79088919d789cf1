"""The emulator's self-test kernels for the tests:
tests/simt/selftest_{kernels,faults,tensor_core,ops}.cpp compiled into a test-only library (never
part of pagedkv._simt) that links the emulator of the pagedkv._simt in use, so that its kernels
run on the shipped emulator under the same controls.
Built with ninja into build/simt-selftest (build/simt-selftest-<mode> under
PAGEDKV_SIMT_SANITIZE) on first use and rebuilt only when a source or a flag changes.
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path

import torch
from torch.utils import cpp_extension

from helpers import ROOT, SIMT_SANITIZE

HERE = Path(__file__).resolve().parent
SOURCES = ["selftest_kernels.cpp", "selftest_faults.cpp", "selftest_tensor_core.cpp",
           "selftest_ops.cpp"]
# As setup.py compiles the emulated units: kernels type-pun (no strict aliasing) and assert;
# line tables only (-g1), as there.
FLAGS = ["-std=c++20", "-O1", "-g1", "-fno-strict-aliasing", "-UNDEBUG", "-Wno-unknown-pragmas",
         "-pthread"]
SANITIZE_FLAGS = {"address": ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
                              "-fno-omit-frame-pointer"]}


class Unavailable(Exception):
    """The library cannot be built here; the message says what is missing."""


def cuda_include() -> Path:
    """The toolkit's include folder (the CUDA headers the kernels compile against), found as
    setup.py finds it."""
    roots = [os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc is not None:
        roots.insert(1, str(Path(nvcc).resolve().parent.parent))
    for root in filter(None, roots):
        if (Path(root) / "include" / "cuda_fp16.h").exists():
            return Path(root) / "include"
    raise Unavailable("the CUDA toolkit headers (cuda_fp16.h) were not found: set CUDA_HOME")


def simt_module() -> Path:
    try:
        import pagedkv._simt as simt
    except ImportError as e:
        raise Unavailable(f"pagedkv._simt is not built ({e})") from e
    return Path(simt.__file__)


@functools.cache
def load():
    """``torch.ops.pagedkv_simt_selftest``, building the library first if needed; raises
    Unavailable when a compiler, ninja or the CUDA headers are missing (a build error raises)."""
    module = simt_module()
    include = cuda_include()
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise Unavailable(f"no C++ compiler: {compiler!r} is not on PATH")
    if not cpp_extension.is_ninja_available():
        raise Unavailable("ninja is not installed (requirements-dev.txt pins it)")
    sanitize = SANITIZE_FLAGS[SIMT_SANITIZE] if SIMT_SANITIZE else []
    build = ROOT / "build" / ("simt-selftest" + (f"-{SIMT_SANITIZE}" if SIMT_SANITIZE else ""))
    build.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name="pagedkv_simt_selftest",
        sources=[str(HERE / s) for s in SOURCES],
        extra_cflags=FLAGS + sanitize,
        extra_include_paths=[str(ROOT / "csrc"), str(include)],
        # The emulator comes from the loaded pagedkv._simt, which the library names (by rpath).
        extra_ldflags=["-pthread", *sanitize, f"-L{module.parent}", f"-l:{module.name}",
                       f"-Wl,-rpath,{module.parent}"],
        build_directory=str(build),
        is_python_module=False,
        verbose=False,
    )
    return torch.ops.pagedkv_simt_selftest
