"""glibc's malloc during a CPU run: freed memory kept for reuse instead of handed back and faulted in again.

By default glibc hands a freed block back to the system once it is larger than a threshold that
adapts to the program (blocks above it are mapped and unmapped one by one; the top of the heap is
trimmed once twice that much is free there), up to 32 MB. A block forward allocates tensors of
several megabytes for each of its activations, the statistics as many, and each one handed back
costs its page faults again when the next is allocated. Keeping them cuts the page faults by more
than half, but the run's time moved within the machine's noise (docs/scale.md, "The CPU kernels"):
hence opt-in, `FeatCalConfig.reuse_freed_cpu_memory`.

The other way round, `release_freed_memory()` hands the free memory inside the heap back to the
system (`malloc_trim`), between tasks. glibc returns only the free memory at the heap's top by itself;
a run's long-lived tensors (the streams between blocks) taken from the heap among short-lived
activations leave free holes below the top that stay resident. On the CLIP benchmark at 8 tasks ×
256 images this kept ~0.2–0.4 GiB more resident at the peak, depending on which product library
ran the forwards (docs/scale.md, "At the paper's scale").

`reuse_freed_memory()` raises both thresholds for the run (`mallopt`), so freed blocks stay in the
heap and the next tensor of that size reuses them without faults. Results are the same bit for bit
(only where memory comes from changes). glibc offers no way back to its adaptive thresholds, so
on exit they are set to the values they adapt to in a program whose tensors reach 32 MB — blocks of
up to 32 MB from the heap, its top trimmed beyond 64 MB — and the free memory is handed back
(`malloc_trim`). Elsewhere (another C library, another OS) nothing is done.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Iterator

# mallopt parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

#: during the run: blocks up to this size come from the heap (a 3072² float32 Gram is 37.7 MB)
RUN_MMAP_THRESHOLD = 64 << 20
#: during the run: the heap's top is handed back only beyond this much free memory (keeping more
#: saved no further faults on the CLIP benchmark)
RUN_TRIM_THRESHOLD = 64 << 20
#: after the run: glibc's adaptive ceiling (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit) and twice it, the
#: values its adaptation reaches in a program whose freed tensors reach 32 MB
AFTER_MMAP_THRESHOLD = 32 << 20
AFTER_TRIM_THRESHOLD = 64 << 20


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The process's C library when it is glibc (it has `mallopt` and `malloc_trim`), else None."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it
        mallopt, malloc_trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    malloc_trim.argtypes, malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    return libc


def available() -> bool:
    """Whether `reuse_freed_memory` can tune the allocator here (glibc)."""
    return _glibc() is not None


_depth = 0  # how many `reuse_freed_memory` contexts are open (only the outermost sets and resets)


def active() -> bool:
    """Whether a `reuse_freed_memory` context is tuning the allocator now."""
    return _depth > 0


@contextlib.contextmanager
def reuse_freed_memory(enabled: bool = True) -> Iterator[bool]:
    """While active, glibc keeps freed blocks of up to `RUN_MMAP_THRESHOLD` in the heap and trims
    its top only beyond `RUN_TRIM_THRESHOLD` of free memory; yields whether it does. On exit of the
    outermost such context (also on error) the thresholds become `AFTER_MMAP_THRESHOLD` /
    `AFTER_TRIM_THRESHOLD` and free memory is handed back to the system."""
    global _depth
    libc = _glibc() if enabled else None
    if libc is None:
        yield active()
        return
    if _depth == 0:
        libc.mallopt(_M_MMAP_THRESHOLD, RUN_MMAP_THRESHOLD)
        libc.mallopt(_M_TRIM_THRESHOLD, RUN_TRIM_THRESHOLD)
    _depth += 1
    try:
        yield True
    finally:
        _depth -= 1
        if _depth == 0:
            libc.mallopt(_M_TRIM_THRESHOLD, AFTER_TRIM_THRESHOLD)
            libc.mallopt(_M_MMAP_THRESHOLD, AFTER_MMAP_THRESHOLD)
            libc.malloc_trim(0)


def release_freed_memory() -> bool:
    """Hand the free memory inside glibc's heaps back to the system (`malloc_trim(0)`: free pages
    below the heap's top as well); returns whether it was done. Not while `reuse_freed_memory` keeps
    freed memory on purpose, and nowhere but on glibc. Costs a walk over the heap's free blocks
    (milliseconds) and the page faults of memory taken back later."""
    libc = _glibc()
    if libc is None or active():
        return False
    libc.malloc_trim(0)
    return True
