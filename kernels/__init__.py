"""Triton kernels of kvcli, installed as the package `kvcli_kernels` (see docs/kernels.md).

Submodules are imported explicitly (cache_write, paged_attention, int4_gemm, reference) rather
than here, so that `import kvcli_kernels` needs no triton and TRITON_INTERPRET can still be set
before the first kernel module is imported.
"""
