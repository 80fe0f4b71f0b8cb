"""Native CPU support, in one place: what this CPU can do (capabilities.py), which of kvcli's C kernel
libraries are built and loaded, and why one is not (registry.py), and the scratch buffers the CPU paths
reuse between calls (scratch.py).

Everything that asks "does this machine have AVX-512 / native bf16 / a C compiler?" or "is the
decode-attention kernel here?" asks this package; nothing under kvcli/model/ or kvcli/attention/ reads
/proc/cpuinfo or loads a library itself.
"""
