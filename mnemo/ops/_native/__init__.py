"""Native CPU kernels: small C files built on first use with the system C compiler.

A kernel here replaces a PyTorch form only where the work per step is too small for PyTorch's
dispatch or too light for its memory traffic: the selective scan's diagonal recurrence (one
``[B, D, N]`` multiply-add per token), the short causal depthwise convolution (a few
multiply-adds per element, which PyTorch runs as one pass over memory per tap), and the
sequential parts of the chunked forms (``chunk_scan.c``: the chunk-to-chunk state pass of the
delta rule and of gated linear attention, one small operator per chunk in PyTorch, and the
per-chunk unit lower-triangular inverse of the delta rule).
Each kernel has a pure-PyTorch twin that computes the same function; :func:`library` returns
``None`` (and the twin is used) when

* the environment sets ``MNEMO_NATIVE=0``,
* no C compiler is found (``$CC``, else ``cc``, ``gcc``, ``clang``), or the build fails (a
  :class:`RuntimeWarning` says why, once per process).

Threads: an entry point splits its jobs into ``nt`` slots (``torch.get_num_threads()``). Built
with ``-fopenmp`` (tried first when PyTorch's parallel backend is OpenMP), the library links the
``libgomp.so.1`` PyTorch has already loaded, and the slots run on PyTorch's own OpenMP threads:
after PyTorch's parallel operators those threads spin-wait on the cores for a while, and a
separate pool of ours would share the cores with them (measured: no gain at all from a second
thread in a training step). Without OpenMP, or in a forked child (whose inherited OpenMP team
has no threads), a Python thread pool runs one slot per thread; ctypes releases the GIL.

The shared library is cached per source hash, compiler and machine in ``$MNEMO_NATIVE_CACHE``
(default ``~/.cache/mnemo/native``; the temporary directory if that cannot be created), written to
a temporary name and renamed, so concurrent processes (``torchrun``) never load a half-written
file (a failed OpenMP build leaves a ``.failed`` marker, so it is tried once per cache). Build
flags: ``-O3 -march=native -fPIC -shared`` and ``-fopenmp`` when it builds (no fast-math: IEEE
semantics, and no process-wide flush-to-zero).
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

__all__ = ["library", "enabled", "usable", "call", "slots", "query", "simd_width", "openmp", "Strided"]

_SOURCES = ("selective_scan.c", "causal_conv.c", "chunk_scan.c")
_HEADERS = ("selective_scan_body.h", "chunk_scan_body.h", "slots.h", "simd.h")
_ENTRY_POINTS = [
    f"{op}_{t}"
    for op in ("ss_fwd", "ss_bwd", "conv_fwd", "conv_bwd")
    + ("scan_mat_fwd", "scan_mat_bwd", "scan_dec_fwd", "scan_dec_bwd", "unit_lower_inv")
    for t in ("f32", "f64")
]
_FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-std=gnu11", "-Wno-psabi"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_pool: ThreadPoolExecutor | None = None
_forked = False


def _forget_pool_after_fork() -> None:
    # a forked child (DataLoader workers, fork-started processes) inherits the pool object and
    # the OpenMP team but not their threads; using either would wait forever
    global _pool, _lock, _forked
    _pool, _lock, _forked = None, threading.Lock(), True


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


def _torch_uses_openmp() -> bool:
    return "parallel backend: OpenMP" in torch.__config__.parallel_info()


def _build(cc: str, flags: list[str], remember_failure: bool = False) -> Path:
    here = Path(__file__).parent
    srcs = [here / s for s in _SOURCES]
    h = hashlib.sha256()
    for s in srcs + [here / name for name in _HEADERS]:
        h.update(s.read_bytes())
    h.update(" ".join([cc] + flags).encode())
    h.update(_machine_id().encode())  # -march=native: a library built on another CPU may not run
    name = f"libmnemo_{h.hexdigest()[:16]}.so"
    if (_cache_dir() / name).exists():
        return _cache_dir() / name
    fallback = Path(tempfile.gettempdir()) / f"mnemo-native-{os.getuid() if hasattr(os, 'getuid') else 0}"
    for out_dir in (_cache_dir(), fallback):
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        except OSError:  # a read-only cache or home: build into the temporary directory instead
            continue
        os.close(fd)
        break
    else:
        raise RuntimeError(f"no writable directory for the native library ({_cache_dir()}, {fallback})")
    target = out_dir / name
    try:
        if target.exists():
            return target
        failed = target.with_suffix(".failed")  # a build that failed before (only for optional flags)
        if remember_failure and failed.exists():
            raise RuntimeError(f"{cc} failed before with these flags ({failed})")
        proc = subprocess.run([cc, *flags, *map(str, srcs), "-o", tmp, "-lm"], capture_output=True, text=True)
        if proc.returncode != 0:
            if remember_failure:
                failed.touch()
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
            lib = None
            if _torch_uses_openmp():
                try:  # the OpenMP build, on PyTorch's threads (see the module docstring)
                    lib = ctypes.CDLL(str(_build(cc, _FLAGS + ["-fopenmp"], remember_failure=True)))
                except (OSError, RuntimeError):
                    lib = None  # e.g. a compiler without OpenMP: the thread-pool build below
            if lib is None:
                lib = ctypes.CDLL(str(_build(cc, _FLAGS)))
            for name in _ENTRY_POINTS:
                getattr(lib, name).restype = None
            for t in ("f32", "f64"):
                getattr(lib, f"ss_bwd_work_{t}").restype = ctypes.c_int64
            lib.mnemo_simd_width.restype = ctypes.c_int
            lib.mnemo_openmp.restype = ctypes.c_int
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


def _loaded() -> ctypes.CDLL:
    """The library for a kernel call. Once built and loaded it stays usable whatever
    ``MNEMO_NATIVE`` says now: the switch decides which form runs (:func:`usable`), and a backward
    pass must finish with the form its forward used, even if the switch changed in between."""
    lib = _lib if _lib is not None else library()
    if lib is None:
        raise RuntimeError("mnemo: the native CPU kernels are not available (see mnemo.ops._native.library)")
    return lib


def slots(jobs: int) -> int:
    """Thread slots a kernel call over ``jobs`` jobs uses: ``torch.get_num_threads()``, at most
    one per job (callers size per-slot scratch with it)."""
    return max(1, min(torch.get_num_threads(), jobs))


def openmp() -> bool:
    """Whether the slots of a call run on PyTorch's OpenMP threads (the library was built with
    OpenMP, and this is not a forked child). Only valid when :func:`library` is not ``None``."""
    return bool(_loaded().mnemo_openmp()) and not _forked


def simd_width() -> int:
    """Floats per SIMD register the library was built for (16 with AVX-512, 8 with AVX/AVX2, else
    4): the channel tile of the selective-scan kernel. Only valid when :func:`library` is not
    ``None``."""
    return int(_loaded().mnemo_simd_width())


def usable(*tensors: torch.Tensor) -> bool:
    """Whether a kernel can take these tensors: all on the CPU, float32 or float64 (one dtype), and
    the library builds."""
    return (
        all(t.device.type == "cpu" and t.dtype == tensors[0].dtype for t in tensors)
        and tensors[0].dtype in (torch.float32, torch.float64)
        and library() is not None
    )


class Strided:
    """A tensor argument of :func:`call` passed as a pointer to its first element although it is
    not contiguous: the caller passes its strides to the kernel as ints."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


def query(name: str, dtype: torch.dtype, *ints: int) -> int:
    """Integer-valued entry point ``name`` (``_f32``/``_f64`` from ``dtype``) on int arguments, e.g.
    the scratch size ``ss_bwd_work`` of a call."""
    fn = getattr(_loaded(), f"{name}_{'f64' if dtype == torch.float64 else 'f32'}")
    return int(fn(*(ctypes.c_int64(a) for a in ints)))


def call(name: str, dtype: torch.dtype, jobs: int, nt: int, args) -> None:
    """Run entry point ``name`` (``_f32``/``_f64`` appended from ``dtype``) as
    ``fn(jobs, nt, slot0, slot1, *args)``: the ``jobs`` split into ``nt`` thread slots (see
    :func:`slots`), all in one call on PyTorch's OpenMP threads (:func:`openmp`), else one call
    per slot on a thread pool. ``args`` are ints (passed as int64), tensors (passed as their data
    pointer), :class:`Strided` tensors (the same, without the contiguity check) or ``None`` (a NULL
    pointer).

    Raises:
        ValueError: a tensor is not contiguous (unless :class:`Strided`) or not of ``dtype`` (the
            kernel would read the wrong memory).
    """
    global _pool
    fn = getattr(_loaded(), f"{name}_{'f64' if dtype == torch.float64 else 'f32'}")

    def conv(a):
        if a is None:
            return ctypes.c_void_p(None)
        if isinstance(a, int):
            return ctypes.c_int64(a)
        if isinstance(a, Strided):
            if a.tensor.dtype != dtype or a.tensor.device.type != "cpu":
                raise ValueError(f"native kernel {name}: expected a CPU {dtype} tensor, got {a.tensor.dtype}")
            return ctypes.c_void_p(a.tensor.data_ptr())
        if not a.is_contiguous() or a.dtype != dtype:
            raise ValueError(
                f"native kernel {name}: tensor arguments must be contiguous {dtype}, "
                f"got {a.dtype} with strides {a.stride()} for shape {tuple(a.shape)}"
            )
        return ctypes.c_void_p(a.data_ptr())

    head = [ctypes.c_int64(jobs), ctypes.c_int64(nt)]
    c_args = [conv(a) for a in args]
    if nt == 1 or openmp():
        fn(*head, ctypes.c_int64(0), ctypes.c_int64(nt), *c_args)
        return
    if _pool is None or _pool._max_workers < nt - 1:
        _pool = ThreadPoolExecutor(max_workers=nt - 1, thread_name_prefix="mnemo-native")
    # the calling thread takes slot 0 itself: one hand-off fewer, and it does not sit idle
    futures = [
        _pool.submit(fn, *head, ctypes.c_int64(i), ctypes.c_int64(i + 1), *c_args) for i in range(1, nt)
    ]
    fn(*head, ctypes.c_int64(0), ctypes.c_int64(1), *c_args)
    for f in futures:
        f.result()
