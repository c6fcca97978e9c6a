"""Keep large freed CPU buffers in the process, so that the next tensor of that size reuses them.

glibc's malloc serves every request above its mmap threshold (128 KiB, raised at run time up to
32 MiB) with fresh pages from the kernel and gives them back on free. A CPU training step or decode
step allocates the same large tensors again and again: the ``[tokens, vocab]`` logits of the LM head
(150 MB for 800 tokens of a 49k vocabulary), their softmax, their gradients. Each new one is a fresh
mapping, and the kernel faults in and zeroes every 4 KiB page at first touch. On a 2-core EPYC that
made ``exp`` over such a tensor 3x slower than the same op writing into a reused buffer
(``benchmarks/cpu_allocator_bench.py``).

`retain_freed_memory` raises the mmap threshold and the trim threshold to ``limit`` bytes
(``mallopt``): allocations up to ``limit`` come from malloc's heap and freed ones stay there for
reuse; at most about ``limit`` bytes of free memory at the heap's top are kept rather than returned.
The process then holds its peak working set instead of giving it back between steps, which is what
a trainer or an inference engine wants (the same trade as jemalloc's or tcmalloc's retention, which
PyTorch's CPU performance guides recommend). Linux with glibc only; elsewhere it does nothing.

Set ``AGENTGYM_RETAIN_FREED_MEMORY=0`` to leave malloc's defaults alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import threading

__all__ = ["DISABLE_VARIABLE", "RETAINED_BYTES", "retain_freed_memory"]

RETAINED_BYTES = 1 << 30
"""Allocations up to 1 GiB are served from the heap, and up to 1 GiB of freed memory at its top is kept."""

DISABLE_VARIABLE = "AGENTGYM_RETAIN_FREED_MEMORY"

# mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

_lock = threading.Lock()
_retained: int | None = None


def _glibc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def _set_thresholds(libc: ctypes.CDLL, value: int) -> bool:
    # Both: with only the mmap threshold raised, a large block freed at the heap's top is still trimmed.
    mmap_ok = libc.mallopt(ctypes.c_int(_M_MMAP_THRESHOLD), ctypes.c_int(value))
    trim_ok = libc.mallopt(ctypes.c_int(_M_TRIM_THRESHOLD), ctypes.c_int(value))
    return bool(mmap_ok) and bool(trim_ok)


def retain_freed_memory(limit: int = RETAINED_BYTES) -> bool:
    """Serve allocations up to ``limit`` bytes from malloc's heap and keep freed ones for reuse.

    Process-wide and idempotent. Returns True once the thresholds are set; False, changing nothing,
    off glibc, when ``AGENTGYM_RETAIN_FREED_MEMORY=0`` (or ``false``, ``no``, ``off``), or when glibc
    refuses the value. Any other value of that variable than these or ``1``/``true``/``yes``/``on``
    is a ``ValueError`` naming it.
    """
    global _retained
    if not 0 < limit < 2**31:
        raise ValueError(f"limit must be in (0, 2**31) bytes (mallopt takes an int), got {limit}")
    setting = os.environ.get(DISABLE_VARIABLE, "").strip().lower()
    if setting in ("0", "false", "no", "off"):
        return False
    if setting not in ("", "1", "true", "yes", "on"):
        raise ValueError(f"{DISABLE_VARIABLE}={setting!r}: use 0/false/no/off to turn it off, 1/true/yes/on (default)")
    with _lock:
        if _retained == limit:
            return True
        libc = _glibc()
        if libc is None or not _set_thresholds(libc, limit):
            return False
        _retained = limit
        return True
