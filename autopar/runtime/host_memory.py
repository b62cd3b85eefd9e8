"""Giving the C heap's free memory back to the system.

glibc keeps memory that large tensors freed (its mmap threshold grows after the first
large free, so later tensors come from the heap) and a rank's resident memory then stays
at its high-water mark: starting a model one module at a time would leave every module's
transient full values resident. `trim()` returns the free pages (glibc's malloc_trim);
elsewhere it does nothing.

`give_back_large_frees()` goes further for a process that starts a model larger than it
may hold: it fixes glibc's mmap threshold (`mallopt(M_MMAP_THRESHOLD)`) at 128 KiB, where
glibc starts it, so a block of that size or more that the heap cannot serve from a free
chunk is its own mapping, given back the moment it is freed. Left dynamic, the threshold
rises to the largest block freed so far (up to 32 MiB), and a training step's layer-sized
gathers, gradients and reduce-scatter buffers then come from the heap, which keeps what
they freed: a ZeRO-3 rank's peak over a step was 2.5x its live tensors. Fixed higher (it was
1 MiB), blocks under it, such as a micro-batch's activations, still grow the heap, and the
free space they leave serves later large blocks too (glibc maps a block only where no free
chunk fits it): on a pipeline's first stage, the optimizer state, the optimizer step's
temporaries and the next step's gradients then lived in the heap, and what they freed stayed
resident (up to 0.1 GB on a 0.47 GB GPT at pp 2 x tp 2).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
LARGE = 128 << 10  # blocks of at least this many bytes are mapped on their own


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def _malloc_trim():
    return getattr(_libc(), "malloc_trim", None)


def trim() -> bool:
    """Return the C heap's free pages to the system; whether the C library could."""
    fn = _malloc_trim()
    return bool(fn(0)) if fn is not None else False


@functools.cache
def give_back_large_frees() -> bool:
    """Map every block of at least 128 KiB on its own, returned to the system when freed
    (glibc's mmap threshold fixed, once per process); whether the C library could."""
    fn = getattr(_libc(), "mallopt", None)
    return bool(fn(M_MMAP_THRESHOLD, LARGE)) if fn is not None else False
