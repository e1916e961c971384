"""On CPU, glibc's malloc told to keep the memory that tensors free, for the next tensors to reuse.

glibc serves every allocation above its mmap threshold (32 MiB at most) with fresh pages from the kernel and
returns them on free; smaller freed blocks at the top of the heap are returned too, past a trim threshold. A
training step allocates and frees the same large tensors at every micro-batch (the loss's [chunk, vocab]
blocks, activations, gathered parameters), so each of them paid the kernel's page faults and zeroing again:
converting a [1024, 32000] block from bf16 to fp32 took 36 ms on fresh pages and 4.4 ms on reused ones, and a
step of benchmarks/throughput.py's 19M Llama (8 x 512 tokens, one process) took 0.78-0.86 s instead of 1.11 s
in bf16 and 1.82-1.85 s instead of 2.10-2.16 s in fp32 with the memory kept. jemalloc and
tcmalloc, which PyTorch's CPU tuning guide loads with LD_PRELOAD, do the same; this needs no library and no
change to how a run is launched. The cost: the process's resident memory does not shrink below its peak,
which a training process reaches again at every step anyway.
"""

import ctypes
import sys

# mallopt parameters, from glibc's malloc.h.
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4


def keep_freed_memory() -> bool:
    """Serve every allocation from the heap and never trim it; False where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # musl and other C libraries: no glibc tunables
        return False
    mallopt = getattr(libc, "mallopt", None)
    return bool(mallopt and mallopt(M_MMAP_MAX, 0) and mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
