"""glibc's heap, for the long-lived processes serve forks (the master, its workers and the runtime keeper).

Best effort: on a libc without these calls (musl) both do nothing.
"""

from __future__ import annotations

import ctypes
import gc

# mallopt(3) options, from glibc's malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8


def _libc():
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def tune() -> bool:
    """Two arenas (not eight per core for the app threads), and fixed thresholds, so that a freed 7 MiB body
    does not raise the mmap threshold and leave every later large buffer in the heap for good (measured: a
    worker kept 100 MiB after large reviews, 80 with these). Called in the master before it forks. True when
    glibc took every option."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    return all(libc.mallopt(option, value) == 1
               for option, value in ((M_ARENA_MAX, 2), (M_MMAP_THRESHOLD, 256 * 1024), (M_TRIM_THRESHOLD, 1 << 20)))


def trim() -> None:
    """Give the heap freed by a large piece of work (a list of 10,000 runtimes) back to the system: glibc keeps
    it otherwise, in the pod's memory until the next one."""
    gc.collect()
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
