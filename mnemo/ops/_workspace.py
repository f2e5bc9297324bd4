"""A cache of CPU buffers for the large tensors of the ops' fast forms, reused across calls (the
chunk forms of GLA, the delta rules and SSD, and the native Functions of the selective scan, of
the short causal convolution in :mod:`mnemo.layers.conv` and of the gated RMSNorm in
:mod:`mnemo.layers.norm`).

PyTorch has no caching allocator for CPU tensors, and glibc's ``malloc`` serves blocks of a few
MiB with fresh ``mmap`` pages: every call of a chunk form would touch megabytes of new pages, one
page fault per 4 KiB (``docs/benchmarks/notes.md``: 2,000–5,000 faults per forward+backward of the
gated linear attention at T = 4096, a quarter of its time). :func:`mnemo.runtime.tune_malloc`
avoids that for the whole process; this module avoids it for the ops' own tensors without changing
the process: the chunk forms take their chunk-layout copies, products, saved tensors and gradients
from :func:`empty`, which hands out a cached buffer of the same size once nothing refers to it any
more, so after the first call the same pages serve every later call of that shape.

A buffer counts as free when no tensor other than the cache's own holds its storage (the storage's
reference count; views, tensors saved for backward, ``.grad`` and outputs the caller kept all hold
one) and its memory was not moved into shared memory (``share_memory_``, as when a tensor is sent
to another process: such a buffer is never handed out again, and leaves the cache when a request
finds it free, at eviction or at :func:`release`). The tensors handed out are not views of the
cached buffer (they share its storage), so an op's output may be modified in place as before.

The cache holds at most :func:`limit` bytes (default 1 GiB; ``MNEMO_WORKSPACE_MB`` sets it,
``0`` turns the cache off); beyond that, least recently used free buffers are dropped, and when
every buffer is in use a plain ``torch.empty`` serves the request. :func:`release` drops every free
buffer (the memory goes back to ``malloc``), :func:`stats` reports the cache's size and hits.

Only CPU tensors of at least :data:`MIN_BYTES` bytes are cached (smaller blocks come from
``malloc``'s heap, which recycles them anyway; CUDA has its own caching allocator), never while
``torch.compile`` traces, and buffers made under ``torch.inference_mode`` (inference tensors,
which autograd refuses to save) are kept apart from the others.
"""

from __future__ import annotations

import math
import os
import threading
from collections import OrderedDict

import torch

__all__ = ["empty", "release", "stats", "limit", "set_limit", "enabled"]

#: smallest request (bytes) served from the cache: glibc's default mmap threshold (128 KiB)
MIN_BYTES = 128 << 10

_lock = threading.Lock()
# (dtype, numel, inference) -> [(buffer, its storage's handle), ...]; _order keeps every buffer by
# last use (LRU first): id -> (key, buffer, handle)
_free: dict[tuple, list[tuple[torch.Tensor, int]]] = {}
_order: OrderedDict[int, tuple[tuple, torch.Tensor, int]] = OrderedDict()
_held = 0
_hits = 0
_misses = 0
_bypassed = 0


def _limit_from_env() -> int:
    raw = os.environ.get("MNEMO_WORKSPACE_MB", "1024").strip()
    try:
        mb = float(raw)
    except ValueError:
        raise ValueError(
            f"MNEMO_WORKSPACE_MB: expected a number of MiB (0 turns the cache off), got {raw!r}"
        ) from None
    if not math.isfinite(mb) or mb < 0:
        raise ValueError(f"MNEMO_WORKSPACE_MB: expected a number of MiB >= 0, got {raw!r}")
    return int(mb * (1 << 20))


_limit = _limit_from_env()


def _refcount_works() -> bool:
    """Whether the storage reference count reads as this module assumes: the buffer plus the
    temporary storage object while it is asked, one more per view (checked once, at import)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return False
    try:
        t = torch.empty(4)
        alone = count(t.untyped_storage()._cdata)
        v = t.view(2, 2)
        viewed = count(t.untyped_storage()._cdata)
        del v
        again = count(t.untyped_storage()._cdata)
    except Exception:  # pragma: no cover - a PyTorch without the private counter
        return False
    return alone == 2 and viewed == 3 and again == 2


_REFCOUNT_OK = _refcount_works()


def _unused(buf: torch.Tensor) -> bool:
    """Nothing but the cache holds ``buf``, and its memory is not shared with other processes
    (``share_memory_`` moves a tensor sent through ``torch.multiprocessing`` or a ``DataLoader``
    worker into shared memory in place: the receiver may still read it after the sender let go)."""
    return torch._C._storage_Use_Count(buf.untyped_storage()._cdata) == 2 and not buf.is_shared()


def _handle(buf: torch.Tensor) -> int:
    """The handle of ``buf``'s storage, kept with the buffer: the same for its whole life in the
    cache (``share_memory_`` moves the memory, not the storage)."""
    return buf.untyped_storage()._cdata


def _handout(buf: torch.Tensor, shape: tuple) -> torch.Tensor:
    """A tensor of ``shape`` on ``buf``'s memory that is not a view of ``buf`` (an autograd
    ``Function`` output may be modified in place only if it is not a view), yet holds its storage."""
    return torch.empty(0, dtype=buf.dtype, device=buf.device).set_(buf.untyped_storage(), 0, shape)


def enabled() -> bool:
    """Whether :func:`empty` may serve from the cache at all (a limit above 0 and a PyTorch whose
    storage reference count reads as expected)."""
    return _REFCOUNT_OK and _limit > 0


def limit() -> int:
    """The cache's size limit in bytes (``MNEMO_WORKSPACE_MB`` at import, else 1 GiB)."""
    return _limit


def set_limit(nbytes: int) -> None:
    """Set the cache's size limit to ``nbytes`` bytes (``0``: off; free buffers beyond the new
    limit are dropped at once). Raises ``ValueError`` for a negative or non-integer ``nbytes``."""
    global _limit
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes: expected an int >= 0, got {nbytes!r}")
    with _lock:
        _limit = nbytes
        _evict(0)


def _drop(ident: int) -> None:
    global _held
    key, buf, _ = _order.pop(ident)
    _free[key] = [(b, h) for b, h in _free[key] if id(b) != ident]
    if not _free[key]:
        del _free[key]
    _held -= buf.numel() * buf.element_size()


def _evict(need: int) -> bool:
    """Drop least recently used free buffers until ``need`` more bytes fit; whether they do. A
    miss while the cache is full walks every buffer: each storage's count is read through its kept
    handle (~0.1 µs), and a buffer in use is passed over without asking ``is_shared`` (~2 µs; a
    shared one leaves once it is found free, as every free buffer does here)."""
    count = torch._C._storage_Use_Count
    for ident in list(_order):
        if _held + need <= _limit:
            break
        if count(_order[ident][2]) == 2:  # free (shared or not: either way it goes)
            _drop(ident)
    return _held + need <= _limit


def empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialised contiguous tensor of ``shape`` and ``dtype`` on ``device``, served from
    the cache when it is a CPU tensor of at least :data:`MIN_BYTES` bytes (see the module
    docstring), else by ``torch.empty``. Its contents are whatever the buffer held last."""
    global _held, _hits, _misses, _bypassed
    shape = tuple(int(s) for s in shape)
    numel = math.prod(shape)
    device = torch.device(device)
    nbytes = numel * dtype.itemsize
    if device.type != "cpu" or nbytes < MIN_BYTES or not enabled() or torch.compiler.is_compiling():
        return torch.empty(shape, dtype=dtype, device=device)
    key = (dtype, numel, torch.is_inference_mode_enabled())
    with _lock:
        # a call scans every cached buffer of its key, and a step that keeps many of them alive
        # (an autograd graph over many segments) asks often: the scan reads each storage's count
        # through its kept handle (~0.1 µs), and asks is_shared (~2 µs) of the free ones only
        count = torch._C._storage_Use_Count
        for buf, handle in _free.get(key, ()):  # _drop replaces the list: iterating this one is safe
            if count(handle) != 2:  # in use
                continue
            if buf.is_shared():  # sent to another process (share_memory_): it leaves the cache
                _drop(id(buf))
                continue
            _hits += 1
            _order.move_to_end(id(buf))
            return _handout(buf, shape)
        _misses += 1
        if nbytes > _limit or not _evict(nbytes):
            _bypassed += 1
            return torch.empty(shape, dtype=dtype, device=device)
        buf = torch.empty(numel, dtype=dtype, device=device)
        handle = _handle(buf)
        _free.setdefault(key, []).append((buf, handle))
        _order[id(buf)] = (key, buf, handle)
        _held += nbytes
        return _handout(buf, shape)


def release() -> int:
    """Drop every free buffer, and every buffer moved to shared memory (their memory goes back to
    ``malloc`` once nothing else holds it); returns the bytes dropped. Buffers in use stay cached."""
    with _lock:
        before = _held
        for ident in list(_order):
            buf = _order[ident][1]
            if _unused(buf) or buf.is_shared():
                _drop(ident)
        return before - _held


def stats() -> dict:
    """The cache's state: ``held_bytes`` (cached buffers, in use or free), ``buffers``,
    ``in_use``, ``hits`` / ``misses`` (requests served by a cached buffer / by a new one),
    ``bypassed`` (misses served by ``torch.empty`` because the limit was reached), ``limit_bytes``
    and ``enabled``."""
    with _lock:
        in_use = sum(not _unused(buf) for _, buf, _ in _order.values())
        return {
            "held_bytes": _held,
            "buffers": len(_order),
            "in_use": in_use,
            "hits": _hits,
            "misses": _misses,
            "bypassed": _bypassed,
            "limit_bytes": _limit,
            "enabled": enabled(),
        }
