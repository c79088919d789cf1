"""CUDA translation units compiled to cubins for their SASS, without building the extension.

``cubin("attention_tc_bf16", "sm_90")`` runs ``nvcc -cubin`` on ``csrc/cuda/attention_tc_bf16.cu``
with the flags the extension's build gives nvcc (setup.py's ``NVCC_FLAGS`` and the defines
torch's cpp_extension adds), so the SASS is the extension module's. The cubin is cached under
``build/sass/``, named by a digest of the unit, the kernel headers, the flags and nvcc's version:
a later call compiles again only when one of them changed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from bench.sass.disasm import Kernel, disassemble

__all__ = ["ARCHS", "CACHE", "NVCC_FLAGS", "ROOT", "cubin", "find_nvcc", "unit_kernels"]

ARCHS = ("sm_80", "sm_90")  # setup.py's default TORCH_CUDA_ARCH_LIST, "8.0;9.0"
ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / "build" / "sass"
# setup.py's NVCC_FLAGS, then what torch.utils.cpp_extension adds to every nvcc command line.
NVCC_FLAGS = ("-O3", "-std=c++20", "--expt-relaxed-constexpr", "-lineinfo", "-Xptxas=-v",
              "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
              "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__")


def find_nvcc() -> str | None:
    """nvcc on PATH, else in $CUDA_HOME/bin or /usr/local/cuda/bin."""
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"):
        path = Path(root) / "bin" / "nvcc"
        if root and path.is_file():
            return str(path)
    return None


def cubin(unit: str, arch: str, cache: Path = CACHE) -> Path:
    """``csrc/cuda/<unit>.cu`` compiled for ``arch`` ("sm_90"), from the cache when its sources
    and flags are unchanged. RuntimeError when nvcc is missing or fails."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)")
    source = ROOT / "csrc" / "cuda" / f"{unit}.cu"
    if not source.is_file():
        raise ValueError(f"unit must name a file of csrc/cuda, got {unit!r}")
    command = [nvcc, "-cubin", *NVCC_FLAGS, f"-I{ROOT / 'csrc'}", f"-arch={arch}", str(source)]
    out = cache / f"{unit}.{arch}.{_digest(nvcc, command, source)}.cubin"
    if not out.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        partial = out.with_suffix(".partial")
        done = subprocess.run([*command, "-o", str(partial)], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"nvcc failed on {source.name} ({arch}): {done.stderr[-2000:]}")
        partial.replace(out)
    return out


def unit_kernels(unit: str, module: Path | None = None,
                 archs: tuple[str, ...] = ARCHS) -> list[Kernel]:
    """The kernels of ``csrc/cuda/<unit>.cu``: from the extension ``module``'s images of that
    unit when it holds them (a CUDA build), else compiled here (``cubin``, cached)."""
    if module is not None:
        kernels = disassemble(module, images=unit)
        if kernels:
            return kernels
    return [k for arch in archs for k in disassemble(cubin(unit, arch))]


def _digest(nvcc: str, command: list[str], source: Path) -> str:
    """The cache key: nvcc's version, the command, and every header the kernels include."""
    h = hashlib.sha256()
    h.update(subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.encode())
    h.update("\0".join(command[1:]).encode())
    for path in [source, *sorted((ROOT / "csrc" / "kernels").glob("*"))]:
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]
