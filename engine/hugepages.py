"""Host tensors backed by transparent huge pages (2 MiB), for the bytes a CPU decode step streams.

A decode step reads the whole KV cache of its batch and, at small batches, every weight: hundreds of
MiB a step, in 4 KiB pages a TLB miss and a page walk every 4 KiB. Linux gives anonymous memory huge
pages either always or, by default on many distributions (`/sys/kernel/mm/transparent_hugepage/enabled`
= madvise), only where the process asks with madvise(MADV_HUGEPAGE) before the memory is first touched;
torch's allocator never asks. The engine asks when `huge_pages` is on, which it is not by default:
`.venv/bin/python -m bench.huge_pages` (2026-12-05, this repository's dev VM) read 1 GiB 1.19-1.25x as fast
from huge pages, but the engine's kernels, which prefetch ahead in software, gained little (SmolLM2 decode
steps 1.01-1.14x at batches 1-8, 1.00-1.03x from 16 up, the throughput workload within noise), and an
engine could take up to 18 s longer to start where the kernel had to compact memory (THP defrag `madvise`)
to find the pages.

`HugePageArena` maps one private anonymous region, asks for huge pages, and hands out tensors
carved from it, so that a set of tensors shares one region (a tensor of its own would round its
last huge page up). The region is zero-filled by the kernel and released when the last tensor
carved from it is freed. Where huge pages cannot be had (not Linux, THP `never`, no
MADV_HUGEPAGE in this Python), `available()` is False and callers keep torch's allocations.
"""

from __future__ import annotations

import mmap
from functools import cache
from math import prod
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
_ALIGN = 4096  # each tensor's start within the region
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@cache
def available() -> bool:
    """Whether this host gives madvised anonymous memory transparent huge pages."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or not hasattr(mmap, "MAP_ANONYMOUS"):
        return False
    try:
        mode = _THP.read_text()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


def _aligned(n: int, to: int) -> int:
    return -(-n // to) * to


class HugePageArena:
    """One region of `nbytes` (rounded up to whole huge pages) that `take` carves tensors from, in order."""

    def __init__(self, nbytes: int) -> None:
        size = _aligned(max(nbytes, 1), HUGE_PAGE)
        # One huge page more, so that the region can start on a 2 MiB boundary: only whole, aligned
        # 2 MiB ranges of a mapping get huge pages.
        region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
        region.madvise(mmap.MADV_HUGEPAGE)
        raw = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive while any view is
        start = -raw.data_ptr() % HUGE_PAGE
        self._bytes = raw[start:start + size]
        self._used = 0

    @property
    def capacity(self) -> int:
        return self._bytes.numel()

    def take(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor of `shape` and `dtype` from the next free bytes (zeros, as the kernel maps them)."""
        nbytes = prod(shape) * torch.empty((), dtype=dtype).element_size()
        start = _aligned(self._used, _ALIGN)
        if start + nbytes > self.capacity:
            raise ValueError(f"huge-page arena of {self.capacity} bytes has no room for {nbytes} more "
                             f"({start} used)")
        self._used = start + nbytes
        return self._bytes[start:start + nbytes].view(dtype).view(shape)


def arena_bytes(specs: list[tuple[tuple[int, ...] | torch.Size, torch.dtype]]) -> int:
    """Bytes an arena needs for tensors of these shapes and dtypes, taken in this order."""
    used = 0
    for shape, dtype in specs:
        used = _aligned(used, _ALIGN) + prod(shape) * torch.empty((), dtype=dtype).element_size()
    return used


def zeros(specs: list[tuple[tuple[int, ...] | torch.Size, torch.dtype]]) -> list[torch.Tensor]:
    """Zero tensors of these shapes and dtypes in one huge-page region, their pages faulted in now (as
    torch.zeros would), so that the first steps do not pay for it; torch.zeros where huge pages are unavailable."""
    if (arena := arena_for(specs)) is None:
        return [torch.zeros(shape, dtype=dtype) for shape, dtype in specs]
    out = [arena.take(shape, dtype) for shape, dtype in specs]
    for t in out:
        t.zero_()  # faults the pages in; the values are already zero
    return out


def arena_for(specs: list[tuple[tuple[int, ...] | torch.Size, torch.dtype]]) -> HugePageArena | None:
    """An arena with room for tensors of these shapes and dtypes, taken in this order; None where huge pages
    are unavailable (or nothing is asked for)."""
    if not available() or not specs:
        return None
    return HugePageArena(arena_bytes(specs))
