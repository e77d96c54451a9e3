"""Host tensors backed by transparent huge pages (2 MiB), for the bytes a CPU decode step streams.

A decode step reads the whole KV cache of its batch and, at small batches, every weight: hundreds of
MiB a step, in 4 KiB pages a TLB miss and a page walk every 4 KiB. Linux gives anonymous memory huge
pages either always or, by default on many distributions (`/sys/kernel/mm/transparent_hugepage/enabled`
= madvise), only where the process asks with madvise(MADV_HUGEPAGE) before the memory is first touched;
torch's allocator never asks. The engine asks for the weights a decode step streams by default
(`huge_pages: auto`), spending at most a fixed budget of its start-up faulting them in, and for the KV
cache too with `huge_pages: true`. Weights in huge pages speed up single-stream decode; the KV cache's
huge pages are worth little to decode steps and can make an engine start much longer where the kernel
must compact memory (THP defrag `madvise`) to find pages for the KV pool, so the KV cache is not in the
default (figures and commands: docs/perf/engine-notes.md, "Huge pages").

`HugePageArena` maps one private anonymous region, asks for huge pages, and hands out tensors
carved from it, so that a set of tensors shares one region (a tensor of its own would round its
last huge page up). The region is zero-filled by the kernel and released when the last tensor
carved from it is freed. Where huge pages cannot be had (not Linux, THP `never`, no
MADV_HUGEPAGE in this Python), `available()` is False and callers keep torch's allocations.
"""

from __future__ import annotations

import mmap
import time
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
    """One region of `nbytes` (rounded up to whole huge pages) that `take` carves tensors from, in order.

    With `fault_budget_s`, the region's pages are faulted in right away, one huge page at a time, and once
    that has taken longer than the budget (after the first page at least) the rest of the region stops asking
    for huge pages (MADV_NOHUGEPAGE) and gets 4 KiB pages when first touched: a host that must compact memory
    to find huge pages (THP defrag `madvise`) then delays the caller by about the budget, not by seconds per GiB.
    `huge_bytes` is how much of the region was faulted in while huge pages were asked for (all of it
    without a budget)."""

    def __init__(self, nbytes: int, fault_budget_s: float | None = None) -> None:
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
        self.huge_bytes = size
        if fault_budget_s is not None:
            began = time.perf_counter()
            for offset in range(0, size, HUGE_PAGE):
                self._bytes[offset:offset + HUGE_PAGE].zero_()  # faults the page in; it is zero already
                done = offset + HUGE_PAGE
                if done < size and time.perf_counter() - began > fault_budget_s:
                    region.madvise(mmap.MADV_NOHUGEPAGE, start + done, size - done)
                    self.huge_bytes = done
                    break

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


def arena_for(specs: list[tuple[tuple[int, ...] | torch.Size, torch.dtype]],
              fault_budget_s: float | None = None) -> HugePageArena | None:
    """An arena with room for tensors of these shapes and dtypes, taken in this order (`fault_budget_s`: see
    HugePageArena); None where huge pages are unavailable (or nothing is asked for)."""
    if not available() or not specs:
        return None
    return HugePageArena(arena_bytes(specs), fault_budget_s)
