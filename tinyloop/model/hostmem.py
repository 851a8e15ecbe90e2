"""Host memory for the big buffers a CPU decode step streams (the KV pool, the C kernels' weight
panels), on 2 MiB pages where Linux gives them.

A step reads tens of megabytes spread over these buffers. On 4 KiB pages each page costs a TLB
miss and the hardware prefetchers stop at every page edge; torch's allocator gets no huge pages
where transparent huge pages are ``madvise``-only (a common default, this machine's). So these
buffers are private anonymous maps advised ``MADV_HUGEPAGE``: measured here, a one-row product
over the panels reads 16.6-19 GB/s against 14.5-15 (bench/LOG.md, 2026-11-30 23:50), decode
attention over a cold pool of scattered blocks runs 1.14-1.19x faster. Where the kernel has no
transparent huge pages, or the platform no ``madvise``, the pages stay small: same memory, same
values. ``zeros`` writes every page once, as ``torch.zeros`` does: the memory is committed when
the buffer is made, so a KV pool that does not fit fails when the engine is built, not at the
first request that reaches its last blocks.
"""

from __future__ import annotations

import math
import mmap

import torch

__all__ = ["huge_page_bytes", "zeros"]


def huge_page_bytes(nbytes: int) -> torch.Tensor:
    """``nbytes`` zeroed bytes (uint8, on the CPU) advised to 2 MiB pages, not yet written (the
    caller writes them: ``zeros``, the panels' packing); the memory lives as long as any view of
    the tensor."""
    if nbytes == 0:
        return torch.zeros(0, dtype=torch.uint8, device="cpu")
    # private: a shared anonymous map is shmem, which transparent huge pages leave alone by default
    try:
        arena = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as exc:  # ENOMEM: the address space or the overcommit limit
        raise MemoryError(f"could not map {nbytes} bytes of host memory: {exc}") from exc
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            arena.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # no transparent huge pages in this kernel: small pages
            pass
    return torch.frombuffer(arena, dtype=torch.uint8)  # (the tensor keeps the map alive)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype, device=device)``; on the CPU, on 2 MiB pages."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    out = huge_page_bytes(math.prod(shape) * dtype.itemsize).view(dtype).view(shape)
    return out.zero_()  # every page written: the memory committed now
