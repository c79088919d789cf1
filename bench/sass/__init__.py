"""Development tooling: the speed of the CUDA kernels on a GPU, from their SASS, without one.

disasm       cuobjdump / nvdisasm listings parsed into kernels and instruction classes
loop         a kernel's main loop and what one pass of it issues on the common path
model        the CUDA-core decode kernel: bandwidth per device from instructions per byte
tensor_core  the tensor-core kernels: TFLOPS and bandwidth per device from one tile's cost
build        csrc/cuda units compiled to cubins (cached under build/sass)
reference    FlashAttention-2's forward kernel from the installed torch, the reference loop

Not part of the installed package; ``python -m bench.bench_gpu_model`` prints the report
(docs/gpu_model.md).
"""
