"""The ops' backend table: which implementation runs each call of an op that has a peer kernel.

Five public ops can run on more than one implementation (a *backend*):

| op | torch | native | fla (fla-core, Triton) | mamba_ssm (Triton) |
|---|---|---|---|---|
| ``gated_delta_rule`` | yes | yes | ``chunk_gated_delta_rule``; ``chunk_kda`` (g per channel) | no kernel |
| ``delta_rule`` | yes | yes | the same kernel with ``g = 0`` | no kernel |
| ``gated_linear_attention`` | yes | yes | ``chunk_simple_gla``, ``chunk_gla`` | no kernel |
| ``linear_attention`` | yes | yes | ``chunk_simple_gla`` without gate | no kernel |
| ``ssd`` | yes | yes | via gated linear attention | ``mamba_chunk_scan_combined`` |

* ``torch``: mnemo's PyTorch forms (every ``mode``, every device, every dtype); the reference.
* ``native``: the same forms with the CPU C kernels of :mod:`mnemo.ops._native` in their
  sequential parts (``mode="chunk"``, CPU tensors, the library built; today's default on a CPU).
* ``fla``: fla-core's Triton chunk kernels. ``mamba_ssm``: mamba-ssm's Triton SSD kernel. Both
  serve ``mode="chunk"`` on CUDA, and on a CPU only under Triton's interpreter
  (``TRITON_INTERPRET=1``, set before the peer is imported; float32 only there, the interpreter's
  bfloat16 arithmetic is wrong); float64 is never theirs (they compute in float32). Each runs as a
  ``torch.library`` custom op ``mnemo::<op>_<backend>`` (see :mod:`mnemo.ops._peer_ops`) with a
  fake kernel and an autograd formula, so meta tensors, ``FakeTensorMode`` and ``torch.compile``
  see through it. The glue keeps mnemo's semantics: log-gates clamped at ``-60`` first (fla gives
  NaN for ``-inf``), ``scale`` (a tensor one multiplies ``q`` first, so it gets its gradient),
  ``initial_state``, ``cu_seqlens``, float32 states under bfloat16 inputs, mnemo's layouts
  (mamba-ssm's states are ``[B, H, P, N]``, mnemo's ``[B, H, N, P]``), a step ``dt`` as given
  (mamba-ssm clamps it to ``[0, inf)`` by default; the glue passes ``dt_limit=(-inf, inf)``). The
  ``chunk_size`` argument tunes mnemo's forms only; the peers use their own chunk length (the
  result does not depend on it).

Choosing. ``auto`` (the default) takes, per call, the first backend in the order below that can
serve the call (device, dtypes, shape, options), and records the reasons of those it skipped
(:func:`dispatch_log`):

* CUDA: ``mamba_ssm`` (ssd), ``fla``, then ``torch``;
* CPU: ``native``, then ``torch`` — the Triton backends are never chosen on a CPU, not even
  under the interpreter (it is slow): there they run only when forced;
* any other device (``meta``, ``mps``): ``torch``.

The device is ``q``'s (``x``'s for ``ssd``); every other tensor of the call must be on it
(:func:`check_devices`: ``ValueError`` naming the argument, else a CUDA tensor would reach the C
kernels or a CPU one a Triton kernel; ``cu_seqlens`` may be anywhere, it is moved).

``with use_backend("fla"):`` or ``MNEMO_BACKEND=fla`` (``auto``, ``torch``, ``native``, ``fla``,
``mamba_ssm``) forces one backend: a call it cannot serve raises :class:`BackendError` naming
the op, the backend and the reason; nothing falls back silently. :func:`backends` lists, per op and
backend, whether it is available here and why not. ``mnemo info`` prints that table.

What each peer cannot serve (auto falls back, forcing raises): ``mode="recurrent"`` (the
token-loop reference stays mnemo's) and ``mode="parallel"`` (mnemo's quadratic form); calls under
a ``torch.func`` transform or forward-mode AD (:func:`under_transform`); float64;
``T = 0``; head dims ``K > 256`` for the delta rules; bfloat16/float16 with an odd ``K`` or ``V``
for ``gated_linear_attention`` and ``linear_attention`` (fla's ``chunk_simple_gla`` backward asserts
even head dims in 16 bits; the rule, applied before the gate's shape or the feature map is looked
at, also keeps ``chunk_gla`` and a feature-mapped linear attention off fla there); ``cu_seqlens``
for ``mamba_ssm`` (its packed path has no per-sequence initial state). ``create_graph=True``
through a peer's backward raises, as through mnemo's chunk forms (use ``mode="recurrent"``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .._compile_marks import constant_result
from . import _native
from ._triton_interpret import interpreting

__all__ = [
    "BACKENDS",
    "CHOICES",
    "OPS",
    "BackendError",
    "BackendRow",
    "backends",
    "check_devices",
    "use_backend",
    "current_backend",
    "recompute_as_chosen",
    "under_transform",
    "dispatch_log",
    "reset_dispatch_log",
    "format_table",
]

#: the implementations an op may run on
BACKENDS = ("torch", "native", "fla", "mamba_ssm")
#: what ``use_backend`` and ``MNEMO_BACKEND`` accept
CHOICES = ("auto",) + BACKENDS
#: the ops that pick a backend per call
OPS = ("gated_delta_rule", "delta_rule", "gated_linear_attention", "linear_attention", "ssd")

#: the peer kernel behind each (op, backend) that exists; the other peer rows say there is none
PEER_KERNELS = {
    ("gated_delta_rule", "fla"): (
        "fla.ops.gated_delta_rule.chunk_gated_delta_rule (g [B,T,H]), fla.ops.kda.chunk_kda (g [B,T,H,K])"
    ),
    ("delta_rule", "fla"): "chunk_gated_delta_rule with g = 0 (fla's chunk_delta_rule refuses float32)",
    ("gated_linear_attention", "fla"): "chunk_simple_gla (g [B,T,H] or None), chunk_gla (g [B,T,H,K])",
    ("linear_attention", "fla"): "chunk_simple_gla with g = None, on the feature-mapped q, k",
    ("ssd", "fla"): "gated_linear_attention's fla kernel, B and C repeated over heads",
    ("ssd", "mamba_ssm"): "mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined",
}

_PACKAGES = {"fla": ("fla", "fla-core"), "mamba_ssm": ("mamba_ssm", "mamba-ssm")}


class BackendError(RuntimeError):
    """A forced backend (``use_backend`` / ``MNEMO_BACKEND``) cannot serve a call; the message
    names the op, the backend and the reason."""


@dataclass(frozen=True)
class BackendRow:
    """One row of :func:`backends`: ``available`` says whether ``backend`` can serve ``op`` on
    ``device`` here (for some call: dtype, mode and options are decided per call); ``reason`` says
    why not (empty when available); ``kernel`` names what runs."""

    op: str
    backend: str
    available: bool
    reason: str
    kernel: str


@dataclass
class Call:
    """What the table needs to know of one op call (filled in by the op after its checks): the
    op, the device, the dtypes of its tensors, ``mode``, ``T``, the head dims ``K`` and ``V``
    (defaults ``K=0``, ``V=0``: not known), whether ``cu_seqlens`` is given (default
    ``varlen=False``) and whether a ``torch.func`` transform or forward-mode AD sees an input
    (default ``transformed=False``; :func:`under_transform`)."""

    op: str
    device: torch.device
    dtypes: tuple
    mode: str
    T: int
    K: int = 0
    varlen: bool = False
    V: int = 0
    transformed: bool = False


def under_transform(*values) -> bool:
    """Whether a ``torch.func`` transform (``grad``, ``vjp``, ``jacrev``, ``jvp``, ``jacfwd``,
    ``vmap``) or forward-mode AD (a ``torch.autograd.forward_ad`` dual tensor) sees any tensor of
    ``values`` (others are ignored; ``False`` while dynamo traces):
    :func:`mnemo.ops._common.seen_by_transform`.
    The peers' custom ops cannot serve those calls: their autograd formula raises under the
    ``torch.func`` transforms, and they have no jvp rule (a tangent came out as zeros, silently);
    mnemo's forms support both."""
    from ._common import seen_by_transform

    return seen_by_transform(*values)


# ----------------------------------------------------------------------------------------------
# the forced backend: use_backend / MNEMO_BACKEND
# ----------------------------------------------------------------------------------------------

_forced = threading.local()


def _check_choice(name, where: str) -> str:
    if not isinstance(name, str) or name.strip().lower() not in CHOICES:
        raise ValueError(f"{where} must be one of {', '.join(CHOICES)}, got {name!r}")
    return name.strip().lower()


def current_backend() -> str:
    """The backend ops use now: the innermost ``use_backend`` block of this thread, else
    ``MNEMO_BACKEND``, else ``"auto"``. Raises ``ValueError`` for an unknown ``MNEMO_BACKEND``."""
    stack = getattr(_forced, "stack", None)
    if stack:
        return stack[-1]
    env = os.environ.get("MNEMO_BACKEND")
    if not env:
        return "auto"
    return _check_choice(env, "MNEMO_BACKEND")


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """``with use_backend("fla"):`` every op call of this thread inside the block runs on
    ``name`` (``"auto"``, ``"torch"``, ``"native"``, ``"fla"``, ``"mamba_ssm"``) or raises
    :class:`BackendError` (op, backend, reason) if that backend cannot serve it. Blocks nest; the
    previous choice is restored on exit, also on an error. A backward pass runs the backward of
    whatever its forward ran. A forward *recomputed* in the backward pass (activation
    checkpointing, ``torch.utils.checkpoint``) chooses again, by the block open then in the thread
    that runs it: outside this block, or on CUDA, where the autograd engine runs the backward in a
    thread of its own, under ``auto`` — unless the checkpoint's ``context_fn`` re-enters the
    forward's choice (:func:`recompute_as_chosen`; :class:`mnemo.models.LanguageModel`'s activation
    checkpointing does), or ``MNEMO_BACKEND`` (read in every thread) is set. Raises ``ValueError``
    for an unknown name."""
    name = _check_choice(name, "backend")
    stack = getattr(_forced, "stack", None)
    if stack is None:
        stack = _forced.stack = []
    stack.append(name)
    try:
        yield
    finally:
        stack.pop()


def recompute_as_chosen():
    """A factory of context managers (call it now, in the forward; enter what it returns around a
    recomputation of that forward, e.g. in a ``torch.utils.checkpoint`` ``context_fn``'s second
    context) that re-enter this thread's choice of the moment: the innermost :func:`use_backend`
    block (none: ``MNEMO_BACKEND``, else ``auto``, as in the forward) and the depth of
    :func:`mnemo.ops._native.suppressed` blocks, in whichever thread runs the recomputation,
    restoring that thread's own on exit. Without it a recomputation in the backward pass chooses
    again by the backward thread's blocks (on CUDA the autograd engine's thread: ``auto``), so a
    run forced to one backend would recompute on another."""
    stack = getattr(_forced, "stack", None)
    top = list(stack[-1:]) if stack else []
    depth = getattr(_native._suppressed, "depth", 0)

    @contextlib.contextmanager
    def again() -> Iterator[None]:
        prev_stack = getattr(_forced, "stack", None)
        prev_depth = getattr(_native._suppressed, "depth", 0)
        _forced.stack = list(top)
        _native._suppressed.depth = depth
        try:
            yield
        finally:
            _forced.stack = prev_stack if prev_stack is not None else []
            _native._suppressed.depth = prev_depth

    return again


# ----------------------------------------------------------------------------------------------
# what is installed and where the Triton kernels can run
# ----------------------------------------------------------------------------------------------


@functools.cache
def _installed(backend: str) -> str | None:
    """Why a peer package cannot be used at all (``None``: it is installed); no import."""
    module, dist = _PACKAGES[backend]
    if importlib.util.find_spec("triton") is None:
        return "triton not installed"
    if importlib.util.find_spec(module) is None:
        return f"{dist} not installed"
    return None


@constant_result
def _import_problem(backend: str) -> str | None:
    """Import the peer's kernels (once); why that failed, or ``None``. Run as Python, not traced,
    when ``torch.compile`` meets it (its result enters the graph as a constant): the first call of
    a process imports under a lock, which dynamo cannot enter (a graph break, an error under
    ``fullgraph=True``)."""
    from . import _peer_ops

    return _peer_ops.import_problem(backend)


def _device_problem(device: torch.device) -> str | None:
    """Why Triton kernels cannot run on ``device`` (``None``: they can)."""
    if device.type == "cuda":
        return None if torch.cuda.is_available() else "no CUDA"
    if device.type == "cpu":
        return None if interpreting() else "CPU: needs TRITON_INTERPRET=1 (Triton's interpreter)"
    if device.type == "meta":
        return None  # the fake kernels: shapes only
    return f"device {device.type!r} (Triton kernels run on CUDA, or on a CPU under TRITON_INTERPRET=1)"


def _native_problem(device: torch.device) -> str | None:
    if device.type != "cpu":
        return f"device {device.type!r} (the C kernels are CPU-only)"
    if not _native.enabled():
        if getattr(_native._suppressed, "depth", 0):  # (not the variable: it may be unset)
            return (
                "the C kernels are off in this thread (mnemo.ops._native.suppressed: the torch "
                "backend's block, or the backward of a form it ran)"
            )
        return "MNEMO_NATIVE=0"
    if _native.library() is None:
        return "the C kernels did not build (see mnemo.ops._native)"
    return None


_MODE_REASON = {
    "recurrent": "mode='recurrent' is mnemo's token-loop reference",
    "parallel": "mode='parallel' is mnemo's quadratic form",
}


#: the ops whose fla route may run ``chunk_simple_gla`` on the caller's 16-bit tensors
_SIMPLE_GLA_OPS = ("gated_linear_attention", "linear_attention")


def _peer_problem(op: str, backend: str, call: Call) -> str | None:
    """Why the Triton ``backend`` cannot serve this call of ``op`` (``None``: it can)."""
    if (op, backend) not in PEER_KERNELS:
        return f"{_PACKAGES[backend][1]} has no kernel for {op}"
    why = _installed(backend) or _device_problem(call.device)
    if why:
        return why
    if call.mode != "chunk":
        return _MODE_REASON.get(call.mode, f"mode={call.mode!r}")
    if call.transformed:
        return (
            "a torch.func transform or forward-mode AD sees an input (the peer's custom op has no "
            "jvp rule, and its autograd formula does not run under torch.func)"
        )
    if torch.float64 in call.dtypes:
        return "float64 inputs (the Triton kernels compute in float32)"
    if call.device.type == "cpu" and any(d in (torch.bfloat16, torch.float16) for d in call.dtypes):
        return "bfloat16/float16 under Triton's interpreter (its bf16 arithmetic is wrong; float32 only)"
    if call.T == 0:
        return "T = 0 (nothing to compute)"
    if op in ("gated_delta_rule", "delta_rule") and call.K > 256:
        return f"head dim K = {call.K} > 256 (fla's delta-rule kernels)"
    if (
        op in _SIMPLE_GLA_OPS
        and (call.K % 2 or call.V % 2)
        and any(d in (torch.bfloat16, torch.float16) for d in call.dtypes)
    ):
        return (
            f"bfloat16/float16 with an odd head dim (K = {call.K}, V = {call.V}): fla's simple-GLA "
            "backward (chunk_bwd_dv) asserts even K and V in 16 bits"
        )
    if backend == "mamba_ssm" and call.varlen:
        return "cu_seqlens (mamba-ssm's packed path has no per-sequence initial state)"
    if call.device.type != "meta":
        return _import_problem(backend)
    return None


def _problem(op: str, backend: str, call: Call) -> str | None:
    """Why ``backend`` cannot serve this call of ``op`` (``None``: it can)."""
    if backend == "torch":
        return None
    if backend == "native":
        # first: while dynamo traces, nothing below may run (the first call of _native.library()
        # builds the kernels under a lock, a graph break in a fresh process)
        if torch.compiler.is_compiling():
            return "torch.compile traces (a ctypes call is not traced)"
        why = _native_problem(call.device)
        if why is None and call.mode != "chunk":
            why = f"mode={call.mode!r} has no C kernel (only the chunk forms use them)"
        return why
    return _peer_problem(op, backend, call)


def _auto_order(op: str, device: torch.device) -> tuple[str, ...]:
    if device.type == "cuda":
        return ("mamba_ssm", "fla", "torch") if op == "ssd" else ("fla", "torch")
    if device.type == "cpu":
        return ("native", "torch")
    return ("torch",)


# ----------------------------------------------------------------------------------------------
# choosing, per call
# ----------------------------------------------------------------------------------------------


def check_devices(op: str, tensors: dict) -> None:
    """Every tensor of ``tensors`` (``{name: tensor or None}``; the first one is the reference,
    ``q`` or ``x``) on the reference's device, else ``ValueError`` naming the op, the argument, the
    expected and the received device. The table picks a backend by the reference's device alone,
    so a tensor elsewhere would reach a kernel of another device (a CUDA pointer in a C kernel, a
    CPU one in a Triton kernel) or, from ``meta``, be read as uninitialised memory."""
    items = [(n, t) for n, t in tensors.items() if isinstance(t, torch.Tensor)]
    ref_name, ref = items[0]
    for name, t in items[1:]:
        if t.device != ref.device:
            raise ValueError(
                f"{op}: {name} must be on {ref_name}'s device {ref.device}, got {name} on {t.device}"
            )


_log: Counter = Counter()


def dispatch_log() -> dict[tuple[str, str, str], int]:
    """Counts of the choices made so far in this process: ``{(op, backend, reason): calls}``;
    ``reason`` is ``"forced"`` for a forced backend, else the skipped backends of ``auto`` with
    their reasons (``""``: the first choice served). A call inside a function compiled by
    ``torch.compile`` is counted when dynamo traces it, once per trace (the compiled graph's later
    calls do not consult the table, so they are not counted), with ``"compiled; "`` before its
    reason (``"compiled"`` alone for an empty one), e.g. ``"compiled; forced"``."""
    return dict(_log)


def reset_dispatch_log() -> None:
    """Forget :func:`dispatch_log`'s counts."""
    _log.clear()


#: the prefix of a :func:`dispatch_log` reason counted while ``torch.compile`` traced the call
COMPILED = "compiled"


@constant_result
def _count_traced(op: str, backend: str, reason: str) -> bool:
    """Count a choice made while dynamo traces: run as Python once per trace (its result enters
    the graph as a constant), so no side effect is traced and ``fullgraph=True`` holds."""
    _log[(op, backend, f"{COMPILED}; {reason}" if reason else COMPILED)] += 1
    return True


def _record(op: str, backend: str, reason: str) -> None:
    if torch.compiler.is_compiling():
        _count_traced(op, backend, reason)
    else:
        _log[(op, backend, reason)] += 1


def select(call: Call) -> str:
    """The backend that runs this call (see the module docstring). Raises :class:`BackendError`
    when a forced backend cannot serve it."""
    want = current_backend()
    if want != "auto":
        why = _problem(call.op, want, call)
        if why is not None:
            raise BackendError(f"{call.op}: backend {want!r} cannot serve this call: {why}")
        _record(call.op, want, "forced")
        return want
    skipped = []
    for backend in _auto_order(call.op, call.device):
        why = _problem(call.op, backend, call)
        if why is None:
            _record(call.op, backend, "; ".join(skipped))
            return backend
        skipped.append(f"{backend}: {why}")
    raise AssertionError("unreachable: torch serves every call")


def pure_torch(backend: str):
    """The context an op's own forms run in for ``backend``: the C kernels off for ``"torch"``."""
    return _native.suppressed() if backend == "torch" else contextlib.nullcontext()


# ----------------------------------------------------------------------------------------------
# the table
# ----------------------------------------------------------------------------------------------

_KERNELS = {
    "torch": "mnemo's PyTorch forms (every mode)",
    "native": "mnemo's chunk forms with the C kernels of mnemo.ops._native",
}


def backends(device: str | torch.device | None = None) -> list[BackendRow]:
    """One row per (op, backend) for ``device`` (default: ``cuda`` when available, else ``cpu``):
    whether that backend can serve the op here, for a float32 ``mode="chunk"`` call, and why not
    (not installed, no CUDA, needs ``TRITON_INTERPRET=1`` on a CPU, an import failure, no kernel
    for the op). Options decided per call (dtype, mode, ``cu_seqlens``, ...) are listed in the
    module docstring; :func:`dispatch_log` shows the per-call reasons. Imports the installed
    peers' kernels (a second or two, once). Raises ``ValueError`` for a ``device`` that names none.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(
            "device must be a torch.device or a name such as 'cpu', 'cuda', 'cuda:1' or 'meta', "
            f"got {device!r}"
        ) from None
    rows = []
    for op in OPS:
        for backend in BACKENDS:
            if backend in ("torch", "native"):
                why = _problem(op, backend, Call(op, device, (torch.float32,), "chunk", 1, 16))
                kernel = _KERNELS[backend]
            else:
                kernel = PEER_KERNELS.get((op, backend), "")
                why = _peer_problem(op, backend, Call(op, device, (torch.float32,), "chunk", 1, 16))
            rows.append(BackendRow(op, backend, why is None, why or "", kernel))
    return rows


def format_table(rows: list[BackendRow] | None = None) -> str:
    """:func:`backends`' rows as a fixed-width text table (what ``mnemo info`` prints)."""
    rows = backends() if rows is None else rows
    head = ("op", "backend", "available", "reason / kernel")
    body = [
        (r.op, r.backend, "yes" if r.available else "no", r.kernel if r.available else r.reason) for r in rows
    ]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(3)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head[:3], widths)) + "  " + head[3]]
    for r in body:
        lines.append("  ".join(x.ljust(w) for x, w in zip(r[:3], widths)) + "  " + r[3])
    return "\n".join(lines)
