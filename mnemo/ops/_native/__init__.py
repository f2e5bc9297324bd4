"""Native CPU kernels: small C files built on first use with the system C compiler.

A kernel here replaces a PyTorch form only where the work per step is too small for PyTorch's
dispatch or too light for its memory traffic: the selective scan's diagonal recurrence (one
``[B, D, N]`` multiply-add per token) and the short causal depthwise convolution (a few
multiply-adds per element, which PyTorch runs as one pass over memory per tap).
Each kernel has a pure-PyTorch twin that computes the same function; :func:`library` returns
``None`` (and the twin is used) when

* the environment sets ``MNEMO_NATIVE=0``,
* no C compiler is found (``$CC``, else ``cc``, ``gcc``, ``clang``), or the build fails (a
  :class:`RuntimeWarning` says why, once per process).

The shared library is cached per source hash, compiler and machine in ``$MNEMO_NATIVE_CACHE``
(default ``~/.cache/mnemo/native``; the temporary directory if that cannot be created), written to
a temporary name and renamed, so concurrent processes (``torchrun``) never load a half-written
file. Build flags: ``-O3 -march=native -fPIC -shared``
(no fast-math: IEEE semantics, and no process-wide flush-to-zero).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

__all__ = ["library", "parallel_rows", "enabled", "usable", "call", "simd_width"]

_SOURCES = ("selective_scan.c", "causal_conv.c")
_HEADERS = ("selective_scan_body.h",)
_ENTRY_POINTS = [f"{op}_{d}_{t}" for op in ("ss", "conv") for d in ("fwd", "bwd") for t in ("f32", "f64")]
_FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-std=gnu11", "-Wno-psabi"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_pool: ThreadPoolExecutor | None = None


def _forget_pool_after_fork() -> None:
    # a forked child (DataLoader workers, fork-started processes) inherits the pool object but
    # not its threads; submitting to it would wait forever
    global _pool, _lock
    _pool, _lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_after_fork)


def enabled() -> bool:
    """Whether native kernels may be used (``MNEMO_NATIVE`` is not ``0``/``false``/``off``)."""
    return os.environ.get("MNEMO_NATIVE", "1").strip().lower() not in ("0", "false", "off", "no")


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return shutil.which(cc)
    return None


def _cache_dir() -> Path:
    root = os.environ.get("MNEMO_NATIVE_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "mnemo" / "native"


def _machine_id() -> str:
    """Host name, architecture and CPU feature flags: a cache shared between machines (an NFS
    home) must not hand a library built for one CPU to another."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return f"{platform.node()}|{platform.machine()}|{flags}"


def _build(cc: str) -> Path:
    here = Path(__file__).parent
    srcs = [here / s for s in _SOURCES]
    h = hashlib.sha256()
    for s in srcs + [here / name for name in _HEADERS]:
        h.update(s.read_bytes())
    h.update(" ".join([cc] + _FLAGS).encode())
    h.update(_machine_id().encode())  # -march=native: a library built on another CPU may not run
    name = f"libmnemo_{h.hexdigest()[:16]}.so"
    out_dir = _cache_dir()
    if (out_dir / name).exists():
        return out_dir / name
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only home: build into the temporary directory instead
        out_dir = Path(tempfile.gettempdir()) / f"mnemo-native-{os.getuid() if hasattr(os, 'getuid') else 0}"
        out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / name
    if target.exists():
        return target
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        proc = subprocess.run(
            [cc, *_FLAGS, *map(str, srcs), "-o", tmp, "-lm"], capture_output=True, text=True
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} exited with {proc.returncode}: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def library() -> ctypes.CDLL | None:
    """The loaded native library, building it on first use; ``None`` if unavailable (see module)."""
    global _lib, _tried
    if not enabled():
        return None
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        cc = _compiler()
        try:
            if cc is None:
                raise RuntimeError("no C compiler found ($CC, cc, gcc, clang)")
            lib = ctypes.CDLL(str(_build(cc)))
            for name in _ENTRY_POINTS:
                getattr(lib, name).restype = None
            lib.mnemo_simd_width.restype = ctypes.c_int
            _lib = lib
        except (OSError, RuntimeError) as err:
            warnings.warn(
                f"mnemo: native CPU kernels unavailable ({err}); using the PyTorch forms "
                "(same results, slower). Set MNEMO_NATIVE=0 to silence this.",
                RuntimeWarning,
                stacklevel=3,
            )
            _lib = None
        _tried = True
    return _lib


def parallel_rows(fn, n_rows: int, args_for) -> None:
    """Run ``fn(row0, row1, *args_for(i))`` over ``[0, n_rows)`` split into one contiguous range
    per torch intra-op thread (``torch.get_num_threads()``); ``i`` is the range's index. The
    calling thread runs range 0, a pool of ``n - 1`` threads the others; ctypes releases the GIL
    during each call, so the ranges run in parallel."""
    global _pool
    n = max(1, min(torch.get_num_threads(), n_rows))
    bounds = [n_rows * i // n for i in range(n + 1)]
    if n == 1:
        fn(0, n_rows, *args_for(0))
        return
    if _pool is None or _pool._max_workers < n - 1:
        _pool = ThreadPoolExecutor(max_workers=n - 1, thread_name_prefix="mnemo-native")
    # the calling thread takes the first range itself: one hand-off fewer, and it does not sit idle
    futures = [_pool.submit(fn, bounds[i], bounds[i + 1], *args_for(i)) for i in range(1, n)]
    fn(bounds[0], bounds[1], *args_for(0))
    for f in futures:
        f.result()


def simd_width() -> int:
    """Floats per SIMD register the library was built for (16 with AVX-512, 8 with AVX/AVX2, else
    4): the channel tile of the selective-scan kernel. Only valid when :func:`library` is not
    ``None``."""
    return int(library().mnemo_simd_width())


def usable(*tensors: torch.Tensor) -> bool:
    """Whether a kernel can take these tensors: all on the CPU, float32 or float64 (one dtype), and
    the library builds."""
    return (
        all(t.device.type == "cpu" and t.dtype == tensors[0].dtype for t in tensors)
        and tensors[0].dtype in (torch.float32, torch.float64)
        and library() is not None
    )


def call(name: str, dtype: torch.dtype, jobs: int, args, per_thread=None) -> None:
    """Run entry point ``name`` (``_f32``/``_f64`` appended from ``dtype``) as
    ``fn(job0, job1, *args, *per_thread(i))`` over ``jobs`` jobs split between the threads. ``args``
    are ints (passed as int64), tensors (passed as their data pointer) or ``None`` (a NULL
    pointer).

    Raises:
        ValueError: a tensor is not contiguous or not of ``dtype`` (the kernel would read the
            wrong memory).
    """
    fn = getattr(library(), f"{name}_{'f64' if dtype == torch.float64 else 'f32'}")

    def conv(a):
        if a is None:
            return ctypes.c_void_p(None)
        if isinstance(a, int):
            return ctypes.c_int64(a)
        if not a.is_contiguous() or a.dtype != dtype:
            raise ValueError(
                f"native kernel {name}: tensor arguments must be contiguous {dtype}, "
                f"got {a.dtype} with strides {a.stride()} for shape {tuple(a.shape)}"
            )
        return ctypes.c_void_p(a.data_ptr())

    c_args = [conv(a) for a in args]
    parallel_rows(
        lambda r0, r1, *extra: fn(ctypes.c_int64(r0), ctypes.c_int64(r1), *c_args, *extra),
        jobs,
        lambda i: [] if per_thread is None else [conv(t) for t in per_thread(i)],
    )
