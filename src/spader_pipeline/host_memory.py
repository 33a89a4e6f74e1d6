"""The process's memory on the host: its resident size, and glibc's heap kept from creeping up.

glibc serves blocks below its mmap threshold from its heap and keeps freed blocks there for reuse.
The threshold is dynamic: each freed mapped block raises it, up to 32 MiB. A training step allocates
and frees KV caches, activations and gradients whose shapes change from step to step, so after a
few steps they all come from the heap, whose freed pieces no later request fits exactly: the
resident size grows every step although the trainer keeps nothing (docs/reliability.md, memory).

:func:`bound_heap` fixes the threshold (blocks of at least that size are mapped, and unmapped when
freed), as the environment variable ``MALLOC_MMAP_THRESHOLD_`` would, but for whoever starts the
process. Fixing it also freezes glibc's trim threshold at its 128 KiB default: the heap's top is handed
back to the operating system at nearly every free and faulted in again by the next forward
(docs/reliability.md), so :func:`bound_heap` sets it to :data:`TRIM_THRESHOLD` too
(``MALLOC_TRIM_THRESHOLD_``: at most that much free memory stays at the top of the heap).
:func:`release_free_heap` hands the heap's free pages back (``malloc_trim``). Both do nothing where
the C library is not glibc. ``SPADER_HEAP=keep`` switches both off, to measure what
they change.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

logger = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
DEFAULT_THRESHOLD = 4 << 20
"""4 MiB: KV-cache and activation blocks are larger, small tensors and Python objects smaller"""
TRIM_THRESHOLD = 64 << 20
"""64 MiB of free memory kept at the heap's top: a forward's activations below the mmap threshold are
reused instead of returned and faulted in again (the trainer still hands it all back after each step)"""

__all__ = ["bound_heap", "release_free_heap", "rss_bytes"]


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    if os.environ.get("SPADER_HEAP", "").lower() == "keep":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 - glibc only: other C libraries lack them
    except (OSError, AttributeError):
        return None
    return libc


def bound_heap(threshold: int = DEFAULT_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes and its trim threshold at ``trim_threshold``
    for this process (unless the user set ``MALLOC_MMAP_THRESHOLD_``, which glibc has read already;
    ``MALLOC_TRIM_THRESHOLD_`` likewise for the trim threshold); ``True`` if the mmap threshold was set."""
    libc = _glibc()
    if libc is None or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    if "MALLOC_TRIM_THRESHOLD_" not in os.environ:
        libc.mallopt(M_TRIM_THRESHOLD, int(trim_threshold))
    return bool(libc.mallopt(M_MMAP_THRESHOLD, int(threshold)))


def release_free_heap() -> None:
    """Return the free pages of glibc's heap to the operating system (a few ms)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def rss_bytes() -> int | None:
    """This process's resident set size now (Linux ``/proc``; ``None`` elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
