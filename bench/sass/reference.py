"""FlashAttention-2's forward kernel as torch ships it: the reference loop of the tensor-core model.

torch's ``libtorch_cuda.so`` carries FlashAttention-2 (``pytorch_flash::flash_fwd_kernel``).
The reference is its bf16, head-128 configuration ``Flash_fwd_kernel_traits<128, 128, 32, 4>``
(blocks of 128 query rows, key tiles of 32, 4 warps of 32 rows each) without dropout, causal
mask, window, ALiBi or soft cap, on even sizes: FlashAttention-2's common instantiation, whose
main loop is the unmasked one that a causal run also spends most tiles in. The listing is
extracted once and cached under ``build/sass`` (``disassemble_function``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from bench.sass.build import CACHE
from bench.sass.disasm import Kernel, disassemble_function, find_tool
from bench.sass.tensor_core import TileGeometry

__all__ = ["FA2_GEOMETRY", "FA2_KERNEL", "fa2_kernel", "torch_cuda_library"]

# pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 32, 4, false, false,
# cutlass::bfloat16_t, ...>, Is_dropout, Is_causal, Is_local, Has_alibi, Is_even_MN, Is_even_K,
# Is_softcap, Return_softmax> = <false, false, false, false, true, true, false, false>.
FA2_KERNEL = ("_ZN13pytorch_flash16flash_fwd_kernelI23Flash_fwd_kernel_traitsILi128ELi128ELi32ELi4E"
              "Lb0ELb0EN7cutlass10bfloat16_tE19Flash_kernel_traitsILi128ELi128ELi32ELi4ES3_EE"
              "Lb0ELb0ELb0ELb0ELb1ELb1ELb0ELb0EEEvNS_16Flash_fwd_paramsE")


FA2_GEOMETRY = TileGeometry(rows=128, keys=32, warps=4, packs_group=False)


def torch_cuda_library() -> Path | None:
    """The installed torch's libtorch_cuda.so (None without torch or with a CPU-only torch)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "lib" / "libtorch_cuda.so"
    return path if path.is_file() else None


def fa2_kernel(arch: str = "sm_90") -> tuple[Kernel | None, str]:
    """FlashAttention-2's reference kernel for ``arch``, or None and the reason it is missing."""
    library = torch_cuda_library()
    if library is None:
        return None, "torch has no libtorch_cuda.so (a CPU-only torch)"
    if find_tool("cuobjdump") is None or find_tool("nvdisasm") is None:
        return None, "cuobjdump / nvdisasm not found (PATH, $CUDA_HOME/bin, triton)"
    kernels = [k for k in disassemble_function(library, FA2_KERNEL, arch, CACHE)
               if k.name == FA2_KERNEL]
    if not kernels:
        return None, f"{library.name} has no {arch} image of FlashAttention-2's head-128 kernel"
    return kernels[0], ""
