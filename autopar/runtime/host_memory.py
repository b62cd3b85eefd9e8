"""Giving the C heap's free memory back to the system.

glibc keeps memory that large tensors freed (its mmap threshold grows after the first
large free, so later tensors come from the heap) and a rank's resident memory then stays
at its high-water mark: starting a model one module at a time would leave every module's
transient full values resident. `trim()` returns the free pages (glibc's malloc_trim);
elsewhere it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return getattr(libc, "malloc_trim", None) if libc is not None else None


def trim() -> bool:
    """Return the C heap's free pages to the system; whether the C library could."""
    fn = _malloc_trim()
    return bool(fn(0)) if fn is not None else False
