"""Process-wide settings that the ``mnemo`` command applies before it does any work.

PyTorch has no caching allocator for CPU tensors: every tensor comes from ``malloc`` and goes back
to it when freed. glibc's ``malloc`` serves large blocks with fresh ``mmap`` pages, and hands freed
memory at the top of its heap back to the kernel once more than a few MiB are free (its mmap and
trim thresholds, adjusted on the fly between 128 KiB and 32 MiB). A training step makes and frees
many tensors of a few MiB, so their pages keep going back to the kernel and coming back fresh, and
the first touch of every fresh 4 KiB page is a page fault, zero-filled by the kernel (measured page
faults and step times: ``docs/benchmarks/notes.md``). PyTorch's CPU tuning guide makes the same point when it
recommends jemalloc or tcmalloc.

:func:`tune_malloc` keeps the memory in the process instead: blocks below 32 MiB come from the
heap, the heap grows 256 MiB at a time (so larger blocks are carved from its top instead of
getting their own ``mmap``), and up to 1 GiB of freed heap stays mapped for reuse. The price is a
resident set that does not shrink after a peak (by at most that 1 GiB). ``mnemo`` applies it at
start-up (so ``mnemo train``, ``mnemo bench`` and their ``torchrun`` workers all run with it);
library users may call it themselves. ``MNEMO_MALLOC_TUNE=0`` turns it off.

Library users do not need it for the chunk forms of the ops: those take their large tensors from a
cache of buffers that they reuse across calls (:mod:`mnemo.ops._workspace`), so a plain Python
process calling them touches no fresh pages after the first call of a shape either.
"""

from __future__ import annotations

import ctypes
import numbers
import os
import platform

__all__ = ["tune_malloc", "malloc_tuned"]

# glibc's mallopt parameters (malloc.h)
_tuned = False

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3


def tune_malloc(
    mmap_threshold: int = 32 << 20, trim_threshold: int = 1 << 30, top_pad: int = 256 << 20
) -> bool:
    """Make glibc's ``malloc`` keep freed memory for reuse (see the module docstring).

    Args:
        mmap_threshold: blocks of at least this many bytes get their own ``mmap`` unless the top of
            the heap has room for them (32 MiB: where glibc's own adjustment of it stops on 64-bit
            systems).
        trim_threshold: freed memory at the top of the heap stays mapped up to this many bytes.
        top_pad: extra bytes the heap grows by whenever it grows (address space; pages count in
            the resident set only once touched).

    Returns:
        ``True`` if all three settings were applied; ``False`` when the C library is not glibc
        (macOS, musl, Windows), ``MNEMO_MALLOC_TUNE`` is ``0``/``false``/``off``/``no``, or glibc
        refused a value. The process is left as it was in every ``False`` case except the last
        (where some of the settings may have been applied).

    Raises:
        ValueError: a setting that is not an int in ``[0, 2**31 - 1]`` (``mallopt`` takes a C
            ``int``), naming it; checked before anything is applied. ``MNEMO_MALLOC_TUNE`` set to
            neither an on nor an off value (``1``/``true``/``on``/``yes``, ``0``/``false``/``off``/``no``).
    """
    given = dict(mmap_threshold=mmap_threshold, trim_threshold=trim_threshold, top_pad=top_pad)
    for name, value in given.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value < 1 << 31:
            raise ValueError(
                f"tune_malloc: {name}: expected an int in [0, 2**31 - 1] bytes (mallopt takes a C int), "
                f"got {value!r}"
            )
    switch = os.environ.get("MNEMO_MALLOC_TUNE", "1")
    if switch.strip().lower() in ("0", "false", "off", "no"):
        return False
    if switch.strip().lower() not in ("", "1", "true", "on", "yes"):  # (as MNEMO_NATIVE: a typo is said)
        raise ValueError(
            f"MNEMO_MALLOC_TUNE must be one of 1, true, on, yes (tuned) or 0, false, off, no, got {switch!r}"
        )
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    global _tuned
    settings = (
        (_M_MMAP_THRESHOLD, mmap_threshold),
        (_M_TRIM_THRESHOLD, trim_threshold),
        (_M_TOP_PAD, top_pad),
    )
    _tuned = all([libc.mallopt(param, int(value)) == 1 for param, value in settings])
    return _tuned


def malloc_tuned() -> bool:
    """Whether :func:`tune_malloc` succeeded in this process (the chunked ops then work on larger
    groups of heads at a time; see ``mnemo.ops._chunked.head_groups``)."""
    return _tuned
