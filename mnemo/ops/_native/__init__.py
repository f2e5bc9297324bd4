"""Native CPU kernels: small C files built on first use with the system C compiler.

A kernel here replaces a PyTorch form only where the work per step is too small for PyTorch's
dispatch or too light for its memory traffic: the selective scan's diagonal recurrence (one
``[B, D, N]`` multiply-add per token), the short causal depthwise convolution (a few
multiply-adds per element, which PyTorch runs as one pass over memory per tap), the gated
RMSNorm of the mixers' outputs (``gated_norm.c``: a SiLU gate and a norm, one pass each way
instead of PyTorch's half-dozen elementwise passes), SwiGLU's gate between the MLP's two
projections (``swiglu.c``: one pass each way instead of five, and no concatenation), and the
sequential parts of the chunked forms (``chunk_scan.c``: the chunk-to-chunk state pass of the
delta rule and of gated linear attention, one small operator per chunk in PyTorch, and the
per-chunk unit lower-triangular inverse of the delta rule), and the products of one-token
decoding (``small_mm.c``: a few rows times a weight matrix, each weight row read once for all of
them, where BLAS reads the weights at a quarter of the memory bandwidth).
Each kernel has a pure-PyTorch twin that computes the same function; :func:`library` returns
``None`` (and the twin is used) when

* the environment sets ``MNEMO_NATIVE=0`` (or ``false``, ``off``, ``no``; an unknown value raises
  ``ValueError``),
* no C compiler is found (``$CC``, else ``cc``, ``gcc``, ``clang``), or the build fails (a
  :class:`RuntimeWarning` says why, once per process).

Threads: an entry point splits its jobs into ``nt`` slots (``torch.get_num_threads()``). Built
with ``-fopenmp`` (tried first when PyTorch's parallel backend is OpenMP), the library links the
``libgomp.so.1`` PyTorch has already loaded, and the slots run on PyTorch's own OpenMP threads:
after PyTorch's parallel operators those threads spin-wait on the cores for a while, and a
separate pool of ours would share the cores with them (measured: no gain at all from a second
thread in a training step). Without OpenMP, or in a forked child (whose inherited OpenMP team
has no threads), a Python thread pool runs one slot per thread; ctypes releases the GIL.

Every entry point is called through :func:`call` (:func:`query` for the integer-valued ones),
which checks the arguments against the kernel's declared signature (:data:`SIGNATURES`: the C
prototype's parameters in order, with the dtype, contiguity and number of elements of every
tensor and the conditions between the sizes), so a wrong argument raises a clear error instead of
handing the kernel a pointer to too little (or the wrong kind of) memory.

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
import re
import shutil
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import torch

from ..._compile_marks import constant_result

__all__ = [
    "library",
    "enabled",
    "suppressed",
    "usable",
    "usable_opaque",
    "call",
    "slots",
    "query",
    "simd_width",
    "openmp",
    "Strided",
    "SIGNATURES",
    "QUERIES",
]

_SOURCES = ("selective_scan.c", "causal_conv.c", "chunk_scan.c", "gated_norm.c", "swiglu.c", "small_mm.c")
_HEADERS = ("selective_scan_body.h", "chunk_scan_body.h", "slots.h", "simd.h", "vexp.h")
_ENTRY_POINTS = [
    f"{op}_{t}"
    for op in ("ss_fwd", "ss_bwd", "conv_fwd", "conv_bwd", "gn_fwd", "gn_bwd", "glu_fwd", "glu_bwd")
    + ("scan_mat_fwd", "scan_mat_bwd", "scan_dec_fwd", "scan_dec_bwd", "unit_lower_inv", "smm_fwd")
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


class _Depth(threading.local):
    """Open :class:`suppressed` blocks in this thread. ``depth`` is set on each thread's first
    access (``threading.local`` runs ``__init__`` per thread), so a ``torch.compile``'d function
    that opens a block does not guard on the attribute's absence and compile again on its
    second call."""

    def __init__(self):
        self.depth = 0


_suppressed = _Depth()


_SWITCH_ON = ("", "1", "true", "on", "yes")
_SWITCH_OFF = ("0", "false", "off", "no")


def enabled() -> bool:
    """Whether native kernels may be used (``MNEMO_NATIVE`` is not ``0``/``false``/``off``/``no``,
    and no :func:`suppressed` block is open in this thread). Raises ``ValueError`` for a value of
    ``MNEMO_NATIVE`` that is neither (a typo must not leave the kernels on silently)."""
    if getattr(_suppressed, "depth", 0):
        return False
    raw = os.environ.get("MNEMO_NATIVE", "1")
    value = raw.strip().lower()
    if value in _SWITCH_OFF:
        return False
    if value not in _SWITCH_ON:
        raise ValueError(
            f"MNEMO_NATIVE must be one of {', '.join(_SWITCH_ON[1:])} (the C kernels on) or "
            f"{', '.join(_SWITCH_OFF)} (off), got {raw!r}"
        )
    return True


class suppressed:
    """``with suppressed():`` the kernels are off in this thread, as with ``MNEMO_NATIVE=0`` (the
    ``torch`` backend of :mod:`mnemo.ops.dispatch`). The backward of a chunk form whose forward
    ran in the block runs without them too, also after the block has ended
    (:func:`mnemo.ops._chunked.native_as_in_forward`)."""

    def __enter__(self):
        _suppressed.depth = getattr(_suppressed, "depth", 0) + 1
        return self

    def __exit__(self, *exc):
        _suppressed.depth -= 1
        return False


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


_simd_width: int | None = None


def _lanes() -> int:
    """:func:`simd_width`, read once (a plain global, not ``lru_cache``: torch.compile traces this)."""
    global _simd_width
    if _simd_width is None:
        _simd_width = simd_width()
    return _simd_width


def simd_width() -> int:
    """Floats per SIMD register the library was built for (16 with AVX-512, 8 with AVX/AVX2, else
    4): the channel tile of the selective-scan kernel. Only valid when :func:`library` is not
    ``None``."""
    return int(_loaded().mnemo_simd_width())


def usable(*tensors: torch.Tensor) -> bool:
    """Whether a kernel can take these tensors: all on the CPU, float32 or float64 (one dtype), and
    the library builds. ``False`` while ``torch.compile`` traces: a ctypes call cannot be traced
    (it would break the graph); compiled code calls a kernel only from inside an opaque custom op
    (:func:`usable_opaque`, the selective scan), else runs the PyTorch forms, which inductor compiles."""
    if torch.compiler.is_compiling():
        return False
    return (
        all(t.device.type == "cpu" and t.dtype == tensors[0].dtype for t in tensors)
        and tensors[0].dtype in (torch.float32, torch.float64)
        and library() is not None
    )


@constant_result
def _available() -> bool:
    """Whether the library builds and loads, with :func:`_lanes` read in: run as Python, not
    traced, when ``torch.compile`` meets it (its result enters the graph as a constant; after a
    change of ``MNEMO_NATIVE``, ``torch._dynamo.reset()`` retraces)."""
    if library() is None:
        return False
    _lanes()
    return True


def usable_opaque(*tensors: torch.Tensor) -> bool:
    """:func:`usable` without its ``torch.compile`` clause: whether a kernel can take these tensors
    when it is called inside an opaque custom op (``torch.library.custom_op``), which runs eagerly
    in a compiled graph. Traceable: the checks read devices and dtypes only, and the library is
    built, and its SIMD width read, outside the trace (so :func:`_lanes` is a plain read)."""
    return (
        all(t.device.type == "cpu" and t.dtype == tensors[0].dtype for t in tensors)
        and tensors[0].dtype in (torch.float32, torch.float64)
        and _available()
    )


class Strided:
    """A tensor argument of :func:`call` passed as a pointer to its first element although it is
    not contiguous: the caller passes its strides to the kernel as ints."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


# ----------------------------------------------------------------------------------------------
# declared signatures
# ----------------------------------------------------------------------------------------------

#: The arguments of every entry point after ``(jobs, nt, slot0, slot1)``, named and ordered as in
#: its C prototype (``tests/ops/test_native_wrappers.py`` compares the two). A word is an int;
#: ``name[n]`` a contiguous CPU tensor of the call's dtype with exactly ``n`` elements (an
#: expression in the ints, ``jobs``, ``nt`` and ``lanes``, the floats per SIMD register);
#: ``name?[n]`` the same or ``None`` (a NULL pointer); ``name~[d0, ..., dk]`` a :class:`Strided`
#: view of exactly that shape with a unit last stride, whose other ``k`` strides are the ints that
#: follow it. After ``|``, conditions (``;``-separated) the arguments must satisfy (``dtype`` is
#: the call's dtype, ``query`` the function :func:`query`).
SIGNATURES: dict[str, str] = {
    "ss_fwd": (
        "T Dp Dgp G N L delta[jobs*lanes*T] bias?[Dp] sp u[jobs*lanes*T] At[N*Dp]"
        " Bm[jobs*lanes//Dp*T*G*N] Cm[jobs*lanes//Dp*T*G*N] h0[jobs*lanes*N] Dsk?[Dp] z?[jobs*lanes*T]"
        " y[jobs*lanes*T] hT[jobs*lanes*N] starts[jobs*lanes*((T+L-1)//L)*N] work[nt*N*lanes]"
        " | Dgp % lanes == 0; Dp == G*Dgp; jobs*lanes % Dp == 0; L >= 1; sp in (0, 1)"
    ),
    "ss_bwd": (
        "Bsz T Dp Dgp G N L delta[Bsz*T*Dp] bias?[Dp] sp u[Bsz*T*Dp] At[N*Dp] Bm[Bsz*T*G*N]"
        " Cm[Bsz*T*G*N] starts[Bsz*((T+L-1)//L)*N*Dp] Dsk?[Dp] z?[Bsz*T*Dp] dy[Bsz*T*Dp] dhT[Bsz*N*Dp]"
        " ddelta[Bsz*T*Dp] du[Bsz*T*Dp] dA[Bsz*N*Dp] dD?[Bsz*Dp] dz?[Bsz*T*Dp] dB[nt*Bsz*T*G*N]"
        " dC[nt*Bsz*T*G*N] dh0[Bsz*N*Dp] work[nt*work_stride*lanes] work_stride"
        " | jobs == Bsz*Dp//lanes; Dgp % lanes == 0; Dp == G*Dgp; L >= 1; sp in (0, 1);"
        " z is None or dz is not None; work_stride >= query('ss_bwd_work', dtype, jobs, nt, Dgp, N, L)"
    ),
    "scan_mat_fwd": (
        "H n K Vd S0[jobs*K*Vd] M~[jobs//H, H, n, K, K] mb mh mn mr D~[jobs//H, H, n, K, Vd] db dh dn dr"
        " states[jobs*n*K*Vd] Sf[jobs*K*Vd] | H >= 1; jobs % H == 0"
    ),
    "scan_mat_bwd": (
        "H n K Vd dSf[jobs*K*Vd] R[jobs*n*K*Vd] M~[jobs//H, H, n, K, K] mb mh mn mr dS0[jobs*K*Vd]"
        " states?[jobs*n*K*Vd] Sf?[jobs*K*Vd] dots?[jobs*n*K] work[nt*2*K*Vd]"
        " | H >= 1; jobs % H == 0; dots is None or (states is not None and Sf is not None)"
    ),
    "scan_dec_fwd": (
        "n K Vd Kl S0[jobs*K*Vd] dS[jobs*n*K*Vd] lam?[jobs*n*Kl] Sf[jobs*K*Vd] work[nt*K*Vd] | Kl in (1, K)"
    ),
    "scan_dec_bwd": (
        "n K Vd Kl dSf[jobs*K*Vd] R[jobs*n*K*Vd] lam?[jobs*n*Kl] dS0[jobs*K*Vd] states?[jobs*n*K*Vd]"
        " Sf?[jobs*K*Vd] dots?[jobs*n*K] scale_out work[nt*K*Vd]"
        " | Kl in (1, K); dots is None or (states is not None and Sf is not None)"
    ),
    "unit_lower_inv": "C A[jobs*C*C] work[nt*C]",
    "conv_fwd": "B T C W xp[B*(T+W-1)*C] w[W*C] bias?[C] y[B*T*C] | jobs == C; W >= 1",
    "gn_fwd": (
        "D G gate_first eps[1] x~[jobs, D] xs z~[jobs, D] zs w[D] y[jobs*D] rstd[jobs*G]"
        " | G >= 1; D % G == 0; gate_first in (0, 1)"
    ),
    "gn_bwd": (
        "D G gate_first x~[jobs, D] xs z~[jobs, D] zs w[D] rstd[jobs*G] dy[jobs*D] dx[jobs*D] dz[jobs*D]"
        " dw[nt*D]"
        " | G >= 1; D % G == 0; gate_first in (0, 1)"
    ),
    "glu_fwd": "H x[jobs*2*H] y[jobs*H] | H >= 1",
    "glu_bwd": "H x[jobs*2*H] dy[jobs*H] dx[jobs*2*H] | H >= 1",
    "smm_fwd": "M K x[M*K] w[jobs*K] bias?[jobs] y[M*jobs] | 1 <= M <= 8; K >= 1",
    "conv_bwd": (
        "B T C W xp[B*(T+W-1)*C] w[W*C] dy[B*T*C] dxp?[B*(T+W-1)*C] dw[W*C] dbias?[C] | jobs == C; W >= 1"
    ),
}

#: The integer-valued entry points (:func:`query`): all their arguments are ints, as in the C prototype.
QUERIES: dict[str, str] = {"ss_bwd_work": "jobs nt Dgp N L"}

_PARAM = re.compile(r"(\w+)(\?)?(~)?(?:\[([^\]]*)\])?")


class _Param(NamedTuple):
    name: str
    kind: str  # "int", "tensor" (contiguous) or "strided"
    optional: bool
    size_text: str | None
    size: object  # compiled expression: the number of elements (tensor) or the shape (strided)


class _Signature(NamedTuple):
    text: str
    params: tuple[_Param, ...]
    conditions: tuple[tuple[str, object], ...]
    ok: Callable[..., bool]  # the whole check as one expression (messages: _explain)


def _compile_check(name: str, params: list[_Param], conditions: list[str]) -> Callable[..., bool]:
    """One function ``ok(dtype, jobs, nt, lanes, args) -> bool`` that evaluates every check of the
    declaration as a single expression (a few microseconds per call: some kernels run once per
    decoded token); :func:`_explain` finds and reports what failed."""
    terms = [f"isinstance({p.name}, int)" for p in params if p.kind == "int"]
    for i, p in enumerate(params):
        if p.kind == "int":
            continue
        if p.kind == "tensor":
            t = p.name
            term = f"isinstance({t}, Tensor) and {t}.is_contiguous() and {t}.numel() == ({p.size_text})"
        else:
            t = f"{p.name}.tensor"
            strides = "".join(f"{q.name}, " for q in params[i + 1 : i + 1 + p.size_text.count(",")])
            term = (
                f"isinstance({p.name}, Strided) and isinstance({t}, Tensor) and {t}.shape == ({p.size_text},)"
                f" and {t}.stride() == ({strides}1)"
            )
        term = f"{term} and {t}.dtype == dtype and {t}.is_cpu"
        terms.append(f"({p.name} is None or ({term}))" if p.optional else f"({term})")
    terms += [f"({c})" for c in conditions]
    src = (
        f"def ok(dtype, jobs, nt, lanes, args):\n    ({', '.join(p.name for p in params)},) = args\n"
        f"    return bool({' and '.join(terms) or 'True'})\n"
    )
    env = {"Tensor": torch.Tensor, "Strided": Strided, "query": query, "isinstance": isinstance, "bool": bool}
    exec(compile(src, f"<native signature {name}>", "exec"), env)
    return env["ok"]


_signatures: dict[str, _Signature] = {}


def _signature(name: str) -> _Signature:
    sig = _signatures.get(name)
    if sig is None:
        if name not in SIGNATURES:
            raise ValueError(
                f"native kernel {name!r} has no declared signature (mnemo.ops._native.SIGNATURES)"
            )
        text = SIGNATURES[name]
        head, _, tail = text.partition("|")
        params = []
        for m in _PARAM.finditer(head):
            pname, opt, strided, size = m.groups()
            if size is None:
                params.append(_Param(pname, "int", False, None, None))
            else:
                expr = f"({size},)" if strided else size
                kind = "strided" if strided else "tensor"
                params.append(
                    _Param(pname, kind, bool(opt), size, compile(expr, f"<{name}:{pname}>", "eval"))
                )
        for i, p in enumerate(params):  # a strided view's strides: the ints after it
            k = p.size_text.count(",") if p.kind == "strided" else 0
            if any(q.kind != "int" for q in params[i + 1 : i + 1 + k]) or i + k >= len(params):
                raise ValueError(f"native kernel {name}: {p.name} must be followed by its {k} strides")
        texts = [c.strip() for c in tail.split(";") if c.strip()]
        conds = tuple((c, compile(c, f"<{name}>", "eval")) for c in texts)
        sig = _signatures[name] = _Signature(text, tuple(params), conds, _compile_check(name, params, texts))
    return sig


def _check_args(name: str, dtype: torch.dtype, jobs: int, nt: int, args) -> None:
    """Check ``args`` of kernel ``name`` against its declaration in :data:`SIGNATURES`."""
    sig = _signature(name)
    if (
        len(args) == len(sig.params)
        and isinstance(jobs, int)
        and isinstance(nt, int)
        and jobs >= 0
        and nt >= 1
    ):
        try:
            if sig.ok(dtype, jobs, nt, _lanes(), args):
                return
        except ZeroDivisionError:  # (a size of 0 that divides: see below)
            pass
    _explain(name, sig, dtype, jobs, nt, args)


def _explain(name: str, sig: _Signature, dtype: torch.dtype, jobs: int, nt: int, args) -> None:
    """Raise the error that says which argument of kernel ``name`` breaks its declaration."""
    if len(args) != len(sig.params):
        raise TypeError(
            f"native kernel {name} takes {len(sig.params)} arguments after (jobs, nt), got {len(args)}; "
            f"declared: {sig.text}"
        )
    if not (isinstance(jobs, int) and isinstance(nt, int) and jobs >= 0 and nt >= 1):
        raise ValueError(
            f"native kernel {name}: jobs must be an int >= 0 and nt an int >= 1, got {jobs!r}, {nt!r}"
        )
    env: dict = {"jobs": jobs, "nt": nt, "lanes": _lanes(), "dtype": dtype, "query": query}
    for p, a in zip(sig.params, args):
        if p.kind == "int":
            if not isinstance(a, int):
                raise TypeError(f"native kernel {name}: {p.name} must be an int, got {type(a).__name__}")
            env[p.name] = a
            continue
        if a is None:
            if not p.optional:
                raise TypeError(f"native kernel {name}: {p.name} must be a tensor, got None")
            env[p.name] = None
            continue
        if isinstance(a, Strided) != (p.kind == "strided"):
            want = "a Strided view" if p.kind == "strided" else "a tensor (not Strided)"
            raise TypeError(f"native kernel {name}: {p.name} must be {want}, got {type(a).__name__}")
        t = a.tensor if isinstance(a, Strided) else a
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"native kernel {name}: {p.name} must be a tensor, got {type(t).__name__}")
        env[p.name] = t

    def ints() -> str:  # for the messages
        return ", ".join(
            f"{k} = {env[k]}" for k in ["jobs", "nt"] + [p.name for p in sig.params if p.kind == "int"]
        )

    for i, p in enumerate(sig.params):
        t = env[p.name]
        if p.kind == "int" or t is None:
            continue
        contiguous = p.kind == "strided" or t.is_contiguous()
        if t.device.type != "cpu" or t.dtype != dtype or not contiguous:
            layout = f"{dtype} (strided)" if p.kind == "strided" else f"contiguous {dtype}"
            raise ValueError(
                f"native kernel {name}: {p.name} must be {layout} on the CPU, got {t.dtype} on {t.device} "
                f"with strides {t.stride()} for shape {tuple(t.shape)}"
            )
        try:
            want = eval(p.size, {"__builtins__": {}}, env)
        except ZeroDivisionError:  # a size of 0 divides the others: legitimate only with no jobs
            if jobs == 0:
                continue
            raise ValueError(
                f"native kernel {name}: the size of {p.name} divides by zero ({ints()})"
            ) from None
        if p.kind == "tensor":
            if t.numel() != want:
                raise ValueError(
                    f"native kernel {name}: {p.name} must have [{p.size_text}] = {want} elements "
                    f"({ints()}), got shape {tuple(t.shape)}"
                )
            continue
        strides = tuple(env[q.name] for q in sig.params[i + 1 : i + len(want)])
        if tuple(t.shape) != want or t.stride()[:-1] != strides or t.stride(-1) != 1:
            raise ValueError(
                f"native kernel {name}: {p.name} must be a view of shape {list(want)} with strides "
                f"{list(strides)} and 1 (the ints after it), got shape {tuple(t.shape)} with strides "
                f"{t.stride()}"
            )
    for text, cond in sig.conditions:
        try:
            ok = eval(cond, {"__builtins__": {}}, env)
        except ZeroDivisionError:
            ok = jobs == 0
        if not ok:
            raise ValueError(f"native kernel {name}: the arguments must satisfy {text} ({ints()})")


def query(name: str, dtype: torch.dtype, *ints: int) -> int:
    """Integer-valued entry point ``name`` (``_f32``/``_f64`` from ``dtype``) on int arguments (as
    declared in :data:`QUERIES`), e.g. the scratch size ``ss_bwd_work`` of a call.

    Raises:
        TypeError: ``name`` is not declared, or the arguments are not its declared ints.
    """
    params = QUERIES.get(name, "").split()
    if not params or len(ints) != len(params) or not all(isinstance(a, int) for a in ints):
        raise TypeError(f"native query {name} takes the ints ({', '.join(params)}), got {ints!r}")
    fn = getattr(_loaded(), f"{name}_{'f64' if dtype == torch.float64 else 'f32'}")
    return int(fn(*(ctypes.c_int64(a) for a in ints)))


def call(name: str, dtype: torch.dtype, jobs: int, nt: int, args) -> None:
    """Run entry point ``name`` (``_f32``/``_f64`` appended from ``dtype``) as
    ``fn(jobs, nt, slot0, slot1, *args)``: the ``jobs`` split into ``nt`` thread slots (see
    :func:`slots`), all in one call on PyTorch's OpenMP threads (:func:`openmp`), else one call
    per slot on a thread pool. ``args`` are ints (passed as int64), tensors (passed as their data
    pointer), :class:`Strided` tensors (the same, without the contiguity check) or ``None`` (a NULL
    pointer), and must match the kernel's declaration in :data:`SIGNATURES`.

    Raises:
        TypeError: the number of arguments, or the kind of one (int, tensor, :class:`Strided`,
            ``None``), does not match the declaration.
        ValueError: a tensor is not on the CPU, not of ``dtype``, not contiguous (unless
            :class:`Strided`) or not of the declared size (the kernel would read or write the wrong
            memory), or a declared condition between the sizes fails.
    """
    global _pool
    _check_args(name, dtype, jobs, nt, args)
    fn = getattr(_loaded(), f"{name}_{'f64' if dtype == torch.float64 else 'f32'}")

    def conv(a):
        if a is None:
            return ctypes.c_void_p(None)
        if isinstance(a, int):
            return ctypes.c_int64(a)
        return ctypes.c_void_p((a.tensor if isinstance(a, Strided) else a).data_ptr())

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
