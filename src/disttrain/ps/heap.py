"""The server process's allocator: keep freed receive buffers instead of returning them.

One function, called by a server rank's `connect` before it serves (transport.py moves
the bytes; this only tunes glibc's malloc for the process that receives them).
"""

from __future__ import annotations

__all__ = ["keep_freed_memory"]


def keep_freed_memory() -> bool:
    """Make glibc keep freed receive buffers for reuse in this process; True if it did.

    ZeroMQ receives each chunk into fresh malloc'd memory; with glibc's default dynamic
    thresholds a server that has freed a 16 MB push's chunks returns most of that memory
    to the kernel and page-faults it back in on the next push (about 2300 minor faults
    per 16 MB push+pull, measured; about 100 with this). So heap allocations up to 32 MB
    stay off mmap and up to 1 GB of freed memory stays in the process. Called by a
    server rank's `connect` only (the process serves and nothing else); does nothing
    where libc has no mallopt.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
    return bool(mallopt(m_mmap_threshold, 32 << 20) and mallopt(m_trim_threshold, 1 << 30))
