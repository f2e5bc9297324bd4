"""The peers' Triton kernels as ``torch.library`` custom ops, and the glue that keeps mnemo's
semantics around them (the ``fla`` and ``mamba_ssm`` rows of :mod:`mnemo.ops.dispatch`).

Custom ops (each with a fake kernel and an autograd formula; the backward is a second custom op,
``mnemo::<name>_backward``):

* ``mnemo::gated_delta_rule_fla(q, k, v, g, beta, initial_state?, cu_seqlens?, scale, output_final_state)``
* ``mnemo::delta_rule_fla(q, k, v, beta, initial_state?, cu_seqlens?, scale, output_final_state)``
* ``mnemo::gated_linear_attention_fla(q, k, v, g?, initial_state?, cu_seqlens?, scale, output_final_state)``
* ``mnemo::linear_attention_fla(q, k, v, initial_state?, cu_seqlens?, scale, output_final_state)``
* ``mnemo::ssd_mamba_ssm(x, dt, A, B, C, initial_state?, chunk_size, output_final_state)``

Each returns ``(o, final_state)`` in mnemo's layouts (``final_state`` is an empty tensor when
``output_final_state`` is false: a custom op cannot return ``None``). Their inputs are what the
peer takes: one dtype for ``q, k, v`` (``x, B, C``), float32 log-gates already clamped, a float32
initial state, int64 ``cu_seqlens``; the glue functions (``fla_*``, ``mamba_ssd``) prepare them
from an op's arguments and convert the results back (``o`` in ``q``'s dtype, the state float32).

The backward. A peer's kernels are reached through its public autograd functions; a custom op's
kernel runs below autograd (no graph is recorded there), so the backward op turns autograd back on
for its thread (:func:`_autograd_on`: PyTorch's private dispatch-key guards), re-runs the peer's
forward and asks it for the gradients, a reentrant backward as in ``torch.utils.checkpoint``: one
extra forward per backward, traded for using only the peers' public entry points (their internal
forward/backward functions change between releases). The backward is first order: a graph of it
(``create_graph=True``) raises, as mnemo's own chunk forms do.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import threading
import types
import warnings
from collections.abc import Iterator

import torch

from . import _triton_interpret
from ._common import LOG_GATE_MIN, check_finite, default_scale

__all__ = [
    "import_problem",
    "fla_gated_delta_rule",
    "fla_gated_linear_attention",
    "fla_linear_attention",
    "mamba_ssd",
]

Tensor = torch.Tensor

# ----------------------------------------------------------------------------------------------
# importing the peers (once)
# ----------------------------------------------------------------------------------------------

_ENTRY = {
    "fla": {
        "gated_delta_rule": ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
        "kda": ("fla.ops.kda", "chunk_kda"),
        "simple_gla": ("fla.ops.simple_gla", "chunk_simple_gla"),
        "gla": ("fla.ops.gla", "chunk_gla"),
    },
    "mamba_ssm": {
        "ssd": ("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined"),
    },
}
_fns: dict[str, dict] = {}
_problems: dict[str, str | None] = {}
_import_lock = threading.Lock()


def _mamba_package_stub() -> None:
    """``import mamba_ssm`` runs its package ``__init__``, which needs the CUDA extension
    (``selective_scan_cuda``); its Triton modules do not. Where the ``__init__`` fails, register
    the package without running it, so that ``mamba_ssm.ops.triton.*`` import (the stub is marked
    ``__mnemo_stub__``; ``from mamba_ssm import Mamba`` then fails as it did before)."""
    if "mamba_ssm" in sys.modules:
        return
    try:
        importlib.import_module("mamba_ssm")
        return
    except Exception:  # noqa: BLE001 (any failure of the package __init__)
        sys.modules.pop("mamba_ssm", None)
    spec = importlib.util.find_spec("mamba_ssm")
    stub = types.ModuleType("mamba_ssm")
    stub.__path__ = list(spec.submodule_search_locations)
    stub.__spec__ = spec  # (importlib.util.find_spec("mamba_ssm") reads it)
    stub.__mnemo_stub__ = True
    sys.modules["mamba_ssm"] = stub


def _interpreted(module) -> bool | None:
    """Whether the Triton kernels of ``module`` were defined for the interpreter (``None``: none found)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    for value in vars(module).values():
        fn = value
        for _ in range(4):  # Autotuner / Heuristics wrap the jitted function in .fn
            if isinstance(fn, InterpretedFunction):
                return True
            if isinstance(fn, JITFunction):
                return False
            fn = getattr(fn, "fn", None)
            if fn is None:
                break
    return None


def import_problem(backend: str) -> str | None:
    """Import ``backend``'s kernels (once per process, the interpreter shims first when
    ``TRITON_INTERPRET=1``); return why that failed, or ``None``."""
    if backend in _problems:
        return _problems[backend]
    with _import_lock:
        if backend in _problems:
            return _problems[backend]
        problem = None
        try:
            _triton_interpret.install()
            if backend == "mamba_ssm":
                _mamba_package_stub()
            fns = {}
            with warnings.catch_warnings():  # fla on a CPU: "Triton is not supported ..., roll back to CPU"
                warnings.filterwarnings("ignore", message="Triton is not supported")
                for key, (module, name) in _ENTRY[backend].items():
                    fns[key] = getattr(importlib.import_module(module), name)
            if _triton_interpret.interpreting() and not torch.cuda.is_available():
                kernel_module = importlib.import_module(
                    "fla.ops.utils.cumsum" if backend == "fla" else "mamba_ssm.ops.triton.ssd_chunk_state"
                )
                if _interpreted(kernel_module) is False:
                    problem = (
                        f"{backend} was imported before TRITON_INTERPRET=1 was set (its kernels are "
                        "compiled for a GPU); set the variable before the first import"
                    )
            _fns[backend] = fns
        except Exception as err:  # noqa: BLE001 (reported in the table)
            problem = f"import failed: {type(err).__name__}: {err}".splitlines()[0][:200]
        _problems[backend] = problem
        return problem


def _fn(backend: str, key: str):
    problem = import_problem(backend)
    if problem:
        raise RuntimeError(f"mnemo: backend {backend!r} is unavailable: {problem}")
    return _fns[backend][key]


# ----------------------------------------------------------------------------------------------
# the backward: the peer's own autograd, re-run (reentrant) on the calling thread
# ----------------------------------------------------------------------------------------------

_AUTOGRAD_KEYS = ("AutogradFunctionality", "AutogradOther", "AutogradNestedTensor")


@contextlib.contextmanager
def _autograd_on() -> Iterator[None]:
    """Autograd back on inside a custom op's kernel (which runs with the autograd dispatch keys
    excluded, so no graph would be recorded there), grad mode on: the include/exclude sets of
    this thread as they are, less the autograd keys, restored on exit. What runs inside is a
    reentrant backward on the calling thread, as ``torch.utils.checkpoint``'s reentrant variant
    does (a second thread would deadlock on CUDA: the autograd engine's device thread is the one
    waiting)."""
    D = torch._C.DispatchKey
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for name in _AUTOGRAD_KEYS:
        if hasattr(D, name):
            exclude = exclude.remove(getattr(D, name))
    with (
        torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude),
        torch.enable_grad(),
    ):
        yield


def _grads_by_recompute(run, inputs: list, grad_outputs: list) -> list:
    """Gradients of ``run(*inputs)``'s outputs (weighted by ``grad_outputs``; ``None`` or empty
    entries are left out) with respect to every floating-point input; ``None`` for the others.
    ``run`` is the peer's public (autograd) entry point, re-run here with autograd on."""
    with _autograd_on():
        xs = [
            t.detach().requires_grad_(True) if isinstance(t, Tensor) and t.is_floating_point() else t
            for t in inputs
        ]
        outs = run(*xs)
        pairs = [
            (o, g) for o, g in zip(outs, grad_outputs) if g is not None and o.numel() and o.requires_grad
        ]
        wrt = [x for x in xs if isinstance(x, Tensor) and x.requires_grad]
        gs = (
            torch.autograd.grad(
                [o for o, _ in pairs], wrt, [g.to(o.dtype) for o, g in pairs], allow_unused=True
            )
            if pairs
            else [None] * len(wrt)
        )
    gs = iter(gs)
    out = []
    for x in xs:
        if isinstance(x, Tensor) and x.requires_grad:
            g = next(gs)
            out.append(torch.zeros_like(x) if g is None else g)
        else:
            out.append(None)
    return out


def _empty_for(t: Tensor | None, like: Tensor) -> Tensor:
    """A gradient as a custom op returns it: an empty tensor for an absent input."""
    return like.new_empty(0) if t is None else t.contiguous()


def _first_order(name: str) -> None:
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"mnemo::{name}: the peer kernel's backward is first order, so a graph of its gradient "
            "(create_graph=True) is not available; use mode='recurrent' (or the torch backend) for "
            "higher-order gradients"
        )


def _state_or_empty(S: Tensor | None, output_final_state: bool, like: Tensor) -> Tensor:
    if output_final_state and S is not None:
        return S.float().contiguous()
    return like.new_empty(0, dtype=torch.float32)


def _rows(B: int, initial_state: Tensor | None, cu_seqlens: Tensor | None) -> int:
    if cu_seqlens is not None:
        return cu_seqlens.shape[0] - 1
    return B


# ----------------------------------------------------------------------------------------------
# fla: the delta rules
# ----------------------------------------------------------------------------------------------


def _nothing_to_compute(q, v, S_shape, output_final_state):
    """``(o, state)`` for a call without elements (no batch row, head or value channel; ``T`` and
    ``K`` are at least 1 here): zeros, the state as empty as ``o``. The peers' launchers are not
    asked (fla's delta rule divides by the number of heads: ``ZeroDivisionError`` for ``H = 0``)."""
    o = q.new_zeros((*q.shape[:3], v.shape[-1]))
    return o, _state_or_empty(q.new_zeros(S_shape, dtype=torch.float32), output_final_state, q)


def _run_gdn(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state):
    if q.numel() == 0 or v.numel() == 0:
        B, _, H, K = q.shape
        S_shape = (_rows(B, initial_state, cu_seqlens), H, K, v.shape[-1])
        return _nothing_to_compute(q, v, S_shape, output_final_state)
    # per-channel log gates [B, T, H, K] (KDA): fla's chunk_kda, given the final gate (its
    # use_gate_in_kernel, use_qk_l2norm_in_kernel and use_beta_sigmoid_in_kernel stay off)
    o, S = _fn("fla", "kda" if g.ndim == 4 else "gated_delta_rule")(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
    )
    return o.contiguous(), _state_or_empty(S, output_final_state, q)


def _fake_matrix(q, v, initial_state, cu_seqlens, output_final_state):
    B, T, H, K = q.shape
    o = q.new_empty((B, T, H, v.shape[-1]))
    S = q.new_empty(
        (_rows(B, initial_state, cu_seqlens), H, K, v.shape[-1]) if output_final_state else 0,
        dtype=torch.float32,
    )
    return o, S


@torch.library.custom_op("mnemo::gated_delta_rule_fla", mutates_args=())
def gated_delta_rule_fla(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    scale: float,
    output_final_state: bool,
) -> tuple[Tensor, Tensor]:
    """fla's ``chunk_gated_delta_rule`` (``g [B,T,H]``) or ``chunk_kda`` (``g [B,T,H,K]``):
    ``(o [B,T,H,V]`` in q's dtype, final state ``[N,H,K,V]`` float32 or empty)."""
    return _run_gdn(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state)


@gated_delta_rule_fla.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state):
    return _fake_matrix(q, v, initial_state, cu_seqlens, output_final_state)


@torch.library.custom_op("mnemo::gated_delta_rule_fla_backward", mutates_args=())
def gated_delta_rule_fla_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    scale: float,
    do: Tensor,
    dS: Tensor,
) -> list[Tensor]:
    """``[dq, dk, dv, dg, dbeta, d initial_state (empty if absent)]``; ``dS`` empty: no state gradient."""
    ofs = dS.numel() > 0

    def run(q, k, v, g, beta, h0):
        return _run_gdn(q, k, v, g, beta, h0, cu_seqlens, scale, ofs)

    grads = _grads_by_recompute(run, [q, k, v, g, beta, initial_state], [do, dS if ofs else None])
    return [_empty_for(d, q) for d in grads]


@gated_delta_rule_fla_backward.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, scale, do, dS):
    return [t.new_empty(t.shape) for t in (q, k, v, g, beta)] + [
        _empty_for(None if initial_state is None else initial_state.new_empty(initial_state.shape), q)
    ]


def _setup_gdn(ctx, inputs, output):
    q, k, v, g, beta, initial_state, cu_seqlens, scale, _ = inputs
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens)
    ctx.scale = scale


def _grad_gdn(ctx, do, dS):
    _first_order("gated_delta_rule_fla")
    q, k, v, g, beta, h0, cu = ctx.saved_tensors
    do = torch.zeros_like(q[..., :1].expand(*q.shape[:3], v.shape[-1])) if do is None else do
    dS = q.new_empty(0, dtype=torch.float32) if dS is None else dS
    dq, dk, dv, dg, db, dh0 = gated_delta_rule_fla_backward(q, k, v, g, beta, h0, cu, ctx.scale, do, dS)
    return dq, dk, dv, dg, db, (dh0 if h0 is not None else None), None, None, None


gated_delta_rule_fla.register_autograd(_grad_gdn, setup_context=_setup_gdn)


def _run_delta(q, k, v, beta, initial_state, cu_seqlens, scale, output_final_state):
    g = torch.zeros(beta.shape, dtype=torch.float32, device=beta.device)
    return _run_gdn(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state)


@torch.library.custom_op("mnemo::delta_rule_fla", mutates_args=())
def delta_rule_fla(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    scale: float,
    output_final_state: bool,
) -> tuple[Tensor, Tensor]:
    """The delta rule through fla's ``chunk_gated_delta_rule`` with ``g = 0`` (fla's
    ``chunk_delta_rule`` refuses float32)."""
    return _run_delta(q, k, v, beta, initial_state, cu_seqlens, scale, output_final_state)


@delta_rule_fla.register_fake
def _(q, k, v, beta, initial_state, cu_seqlens, scale, output_final_state):
    return _fake_matrix(q, v, initial_state, cu_seqlens, output_final_state)


@torch.library.custom_op("mnemo::delta_rule_fla_backward", mutates_args=())
def delta_rule_fla_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    scale: float,
    do: Tensor,
    dS: Tensor,
) -> list[Tensor]:
    """``[dq, dk, dv, dbeta, d initial_state (empty if absent)]``."""
    ofs = dS.numel() > 0

    def run(q, k, v, beta, h0):
        return _run_delta(q, k, v, beta, h0, cu_seqlens, scale, ofs)

    grads = _grads_by_recompute(run, [q, k, v, beta, initial_state], [do, dS if ofs else None])
    return [_empty_for(d, q) for d in grads]


@delta_rule_fla_backward.register_fake
def _(q, k, v, beta, initial_state, cu_seqlens, scale, do, dS):
    return [t.new_empty(t.shape) for t in (q, k, v, beta)] + [
        _empty_for(None if initial_state is None else initial_state.new_empty(initial_state.shape), q)
    ]


def _setup_delta(ctx, inputs, output):
    q, k, v, beta, initial_state, cu_seqlens, scale, _ = inputs
    ctx.save_for_backward(q, k, v, beta, initial_state, cu_seqlens)
    ctx.scale = scale


def _grad_delta(ctx, do, dS):
    _first_order("delta_rule_fla")
    q, k, v, beta, h0, cu = ctx.saved_tensors
    do = torch.zeros_like(q[..., :1].expand(*q.shape[:3], v.shape[-1])) if do is None else do
    dS = q.new_empty(0, dtype=torch.float32) if dS is None else dS
    dq, dk, dv, db, dh0 = delta_rule_fla_backward(q, k, v, beta, h0, cu, ctx.scale, do, dS)
    return dq, dk, dv, db, (dh0 if h0 is not None else None), None, None, None


delta_rule_fla.register_autograd(_grad_delta, setup_context=_setup_delta)


# ----------------------------------------------------------------------------------------------
# fla: gated linear attention (and linear attention: no gate)
# ----------------------------------------------------------------------------------------------


def _run_gla(q, k, v, g, initial_state, cu_seqlens, scale, output_final_state):
    if q.numel() == 0 or v.numel() == 0:
        B, _, H, K = q.shape
        S_shape = (_rows(B, initial_state, cu_seqlens), H, K, v.shape[-1])
        return _nothing_to_compute(q, v, S_shape, output_final_state)
    kw = dict(
        scale=scale, initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens
    )
    if g is not None and g.ndim == 4:
        o, S = _fn("fla", "gla")(q, k, v, g, **kw)
    else:
        o, S = _fn("fla", "simple_gla")(q, k, v, g=g, **kw)
    return o.to(q.dtype).contiguous(), _state_or_empty(S, output_final_state, q)


@torch.library.custom_op("mnemo::gated_linear_attention_fla", mutates_args=())
def gated_linear_attention_fla(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    scale: float,
    output_final_state: bool,
) -> tuple[Tensor, Tensor]:
    """fla's ``chunk_simple_gla`` (``g [B,T,H]`` or ``None``) or ``chunk_gla`` (``g [B,T,H,K]``)."""
    return _run_gla(q, k, v, g, initial_state, cu_seqlens, scale, output_final_state)


@gated_linear_attention_fla.register_fake
def _(q, k, v, g, initial_state, cu_seqlens, scale, output_final_state):
    return _fake_matrix(q, v, initial_state, cu_seqlens, output_final_state)


@torch.library.custom_op("mnemo::gated_linear_attention_fla_backward", mutates_args=())
def gated_linear_attention_fla_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    scale: float,
    do: Tensor,
    dS: Tensor,
) -> list[Tensor]:
    """``[dq, dk, dv, dg (empty if absent), d initial_state (empty if absent)]``."""
    ofs = dS.numel() > 0

    def run(q, k, v, g, h0):
        return _run_gla(q, k, v, g, h0, cu_seqlens, scale, ofs)

    grads = _grads_by_recompute(run, [q, k, v, g, initial_state], [do, dS if ofs else None])
    return [_empty_for(d, q) for d in grads]


@gated_linear_attention_fla_backward.register_fake
def _(q, k, v, g, initial_state, cu_seqlens, scale, do, dS):
    return [t.new_empty(t.shape) for t in (q, k, v)] + [
        _empty_for(None if t is None else t.new_empty(t.shape), q) for t in (g, initial_state)
    ]


def _setup_gla(ctx, inputs, output):
    q, k, v, g, initial_state, cu_seqlens, scale, _ = inputs
    ctx.save_for_backward(q, k, v, g, initial_state, cu_seqlens)
    ctx.scale = scale


def _grad_gla(ctx, do, dS):
    _first_order("gated_linear_attention_fla")
    q, k, v, g, h0, cu = ctx.saved_tensors
    do = torch.zeros_like(q[..., :1].expand(*q.shape[:3], v.shape[-1])) if do is None else do
    dS = q.new_empty(0, dtype=torch.float32) if dS is None else dS
    dq, dk, dv, dg, dh0 = gated_linear_attention_fla_backward(q, k, v, g, h0, cu, ctx.scale, do, dS)
    return dq, dk, dv, (dg if g is not None else None), (dh0 if h0 is not None else None), None, None, None


gated_linear_attention_fla.register_autograd(_grad_gla, setup_context=_setup_gla)


@torch.library.custom_op("mnemo::linear_attention_fla", mutates_args=())
def linear_attention_fla(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    scale: float,
    output_final_state: bool,
) -> tuple[Tensor, Tensor]:
    """Un-normalised linear attention on (feature-mapped) ``q, k``: fla's ``chunk_simple_gla``, no gate."""
    return _run_gla(q, k, v, None, initial_state, cu_seqlens, scale, output_final_state)


@linear_attention_fla.register_fake
def _(q, k, v, initial_state, cu_seqlens, scale, output_final_state):
    return _fake_matrix(q, v, initial_state, cu_seqlens, output_final_state)


def _setup_la(ctx, inputs, output):
    q, k, v, initial_state, cu_seqlens, scale, _ = inputs
    ctx.save_for_backward(q, k, v, initial_state, cu_seqlens)
    ctx.scale = scale


def _grad_la(ctx, do, dS):
    _first_order("linear_attention_fla")
    q, k, v, h0, cu = ctx.saved_tensors
    do = torch.zeros_like(q[..., :1].expand(*q.shape[:3], v.shape[-1])) if do is None else do
    dS = q.new_empty(0, dtype=torch.float32) if dS is None else dS
    dq, dk, dv, _, dh0 = gated_linear_attention_fla_backward(q, k, v, None, h0, cu, ctx.scale, do, dS)
    return dq, dk, dv, (dh0 if h0 is not None else None), None, None, None


linear_attention_fla.register_autograd(_grad_la, setup_context=_setup_la)


# ----------------------------------------------------------------------------------------------
# mamba-ssm: SSD
# ----------------------------------------------------------------------------------------------


#: the ``dt_limit`` passed to mamba-ssm: no clamp. Its default ``(0, inf)`` clamps ``dt`` (in the
#: forward, and zeroes the clamped tokens' gradients), so a negative step, which mnemo computes as
#: given, would write nothing and not decay there
MAMBA_DT_LIMIT = (float("-inf"), float("inf"))


def _run_ssd(x, dt, A, B, C, initial_state, chunk_size, output_final_state):
    if x.numel() == 0:
        Bsz, _, H, P = x.shape
        return _nothing_to_compute(x, x, (Bsz, H, B.shape[-1], P), output_final_state)
    h0 = (
        None if initial_state is None else initial_state.transpose(-1, -2).contiguous()
    )  # [B,H,N,P] -> [B,H,P,N]
    out = _fn("mamba_ssm", "ssd")(
        x,
        dt,
        A,
        B,
        C,
        chunk_size,
        initial_states=h0,
        dt_limit=MAMBA_DT_LIMIT,
        return_final_states=output_final_state,
    )
    y, S = out if output_final_state else (out, None)
    S = None if S is None else S.transpose(-1, -2)  # back to mnemo's [B, H, N, P]
    return y.contiguous(), _state_or_empty(S, output_final_state, x)


@torch.library.custom_op("mnemo::ssd_mamba_ssm", mutates_args=())
def ssd_mamba_ssm(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    initial_state: Tensor | None,
    chunk_size: int,
    output_final_state: bool,
) -> tuple[Tensor, Tensor]:
    """mamba-ssm's ``mamba_chunk_scan_combined`` (no ``D``, bias or softplus: the glue applies
    them; ``dt_limit`` = :data:`MAMBA_DT_LIMIT`, no clamp of ``dt``): ``y [B,T,H,P]`` in x's dtype,
    final state ``[B,H,N,P]`` (mnemo's layout) float32 or empty."""
    return _run_ssd(x, dt, A, B, C, initial_state, chunk_size, output_final_state)


@ssd_mamba_ssm.register_fake
def _(x, dt, A, B, C, initial_state, chunk_size, output_final_state):
    Bsz, T, H, P = x.shape
    S = x.new_empty((Bsz, H, B.shape[-1], P) if output_final_state else 0, dtype=torch.float32)
    return x.new_empty(x.shape), S


@torch.library.custom_op("mnemo::ssd_mamba_ssm_backward", mutates_args=())
def ssd_mamba_ssm_backward(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    initial_state: Tensor | None,
    chunk_size: int,
    dy: Tensor,
    dS: Tensor,
) -> list[Tensor]:
    """``[dx, ddt, dA, dB, dC, d initial_state (empty if absent)]``."""
    ofs = dS.numel() > 0

    def run(x, dt, A, B, C, h0):
        return _run_ssd(x, dt, A, B, C, h0, chunk_size, ofs)

    grads = _grads_by_recompute(run, [x, dt, A, B, C, initial_state], [dy, dS if ofs else None])
    return [_empty_for(d, x) for d in grads]


@ssd_mamba_ssm_backward.register_fake
def _(x, dt, A, B, C, initial_state, chunk_size, dy, dS):
    return [t.new_empty(t.shape) for t in (x, dt, A, B, C)] + [
        _empty_for(None if initial_state is None else initial_state.new_empty(initial_state.shape), x)
    ]


def _setup_ssd(ctx, inputs, output):
    x, dt, A, B, C, initial_state, chunk_size, _ = inputs
    ctx.save_for_backward(x, dt, A, B, C, initial_state)
    ctx.chunk_size = chunk_size


def _grad_ssd(ctx, dy, dS):
    _first_order("ssd_mamba_ssm")
    x, dt, A, B, C, h0 = ctx.saved_tensors
    dy = torch.zeros_like(x) if dy is None else dy
    dS = x.new_empty(0, dtype=torch.float32) if dS is None else dS
    dx, ddt, dA, dB, dC, dh0 = ssd_mamba_ssm_backward(x, dt, A, B, C, h0, ctx.chunk_size, dy, dS)
    return dx, ddt, dA, dB, dC, (dh0 if h0 is not None else None), None, None


ssd_mamba_ssm.register_autograd(_grad_ssd, setup_context=_setup_ssd)


# ----------------------------------------------------------------------------------------------
# glue: an op's arguments -> a custom op's inputs, and its results back
# ----------------------------------------------------------------------------------------------


def _common_dtype(*tensors: Tensor) -> torch.dtype:
    dt = tensors[0].dtype
    for t in tensors[1:]:
        dt = torch.promote_types(dt, t.dtype)
    return dt


def _matrix_inputs(q, k, v, initial_state, cu_seqlens, scale):
    dt = _common_dtype(q, k, v)
    scale = default_scale(scale, q.shape[-1])
    if isinstance(scale, Tensor):  # a tensor scale (e.g. learned) scales q here, so autograd reaches it
        q, scale = q.to(torch.float32) * scale, 1.0
    q, k, v = (t.to(dt).contiguous() for t in (q, k, v))
    h0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
    cu = None if cu_seqlens is None else cu_seqlens.to(device=q.device, dtype=torch.long)
    return q, k, v, h0, cu, float(scale)


def _clamped(g: Tensor) -> Tensor:
    """Log-gates as mnemo reads them: float32, clamped at ``LOG_GATE_MIN`` (``-inf`` -> ``-60``:
    fla gives NaN for ``-inf``, and loses precision for very negative gates in its in-chunk sums)."""
    return g.to(torch.float32).clamp(min=LOG_GATE_MIN).contiguous()


def fla_gated_delta_rule(q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens):
    """``gated_delta_rule`` (``g`` given) or ``delta_rule`` (``g=None``) on fla's kernel, with
    mnemo's checks and semantics (see the module docstring). Returns ``(o in q's dtype, state or None)``."""
    check_finite({"q": q, "k": k, "v": v, "beta": beta, "initial_state": initial_state}, {"g": g})
    out_dtype = q.dtype
    q, k, v, h0, cu, scale = _matrix_inputs(q, k, v, initial_state, cu_seqlens, scale)
    b = (beta if beta.dtype != torch.float64 else beta.float()).contiguous()  # (fp32 beta stays fp32)
    if g is None:
        o, S = delta_rule_fla(q, k, v, b, h0, cu, scale, output_final_state)
    else:
        o, S = gated_delta_rule_fla(q, k, v, _clamped(g), b, h0, cu, scale, output_final_state)
    return o.to(out_dtype), (S if output_final_state else None)


def fla_gated_linear_attention(q, k, v, g, *, scale, initial_state, output_final_state, cu_seqlens):
    """``gated_linear_attention`` on fla's kernels (``chunk_simple_gla`` / ``chunk_gla``)."""
    check_finite({"q": q, "k": k, "v": v, "initial_state": initial_state}, {"g": g})
    out_dtype = q.dtype
    q, k, v, h0, cu, scale = _matrix_inputs(q, k, v, initial_state, cu_seqlens, scale)
    gc = None if g is None else _clamped(g)
    o, S = gated_linear_attention_fla(q, k, v, gc, h0, cu, scale, output_final_state)
    return o.to(out_dtype), (S if output_final_state else None)


def fla_linear_attention(q, k, v, *, scale, initial_state, cu_seqlens):
    """The un-normalised recurrence of ``linear_attention`` on (feature-mapped) ``q, k`` by fla:
    ``(o, final state)`` in float32 (the caller normalises and converts)."""
    q, k, v, h0, cu, scale = _matrix_inputs(q, k, v, initial_state, cu_seqlens, scale)
    return linear_attention_fla(q, k, v, h0, cu, scale, True)


def _mamba_chunk(chunk_size: int) -> int:
    """mamba-ssm's chunk length: mnemo's ``chunk_size`` when a power of two in ``[16, 256]``, else 64."""
    return chunk_size if 16 <= chunk_size <= 256 and chunk_size & (chunk_size - 1) == 0 else 64


def mamba_ssd(x, dtc, A, B4, C4, D, *, initial_state, output_final_state, chunk_size):
    """``ssd`` on mamba-ssm's kernel. ``dtc`` is the step after bias and softplus (float32).

    mnemo clamps the log decay ``dt · A`` at ``-60`` but writes ``dt · x``; mamba-ssm takes one
    ``dt`` for both. Where the clamp bites, the kernel gets ``dt' = -60 / A`` (the clamped decay)
    and ``x' = x · dt / dt'`` (the same write), elementwise on the device (no value is read back);
    elsewhere ``dt' = dt``, ``x' = x``. ``D`` is added here, to the unscaled ``x``. The kernel gets
    ``dt_limit=(-inf, inf)`` (:data:`MAMBA_DT_LIMIT`): its default ``(0, inf)`` would clamp a
    negative ``dt`` (which mnemo computes as given, with a ``RangeWarning`` on a CPU) to 0."""
    cd = torch.float32
    A32 = A.to(cd)
    g = dtc * A32
    clamped = g < LOG_GATE_MIN
    A_safe = torch.where(A32 != 0, A32, torch.ones_like(A32))
    dtm = torch.where(clamped, LOG_GATE_MIN / A_safe, dtc)
    ratio = torch.where(clamped, g / LOG_GATE_MIN, torch.ones_like(g))
    dt_in = _common_dtype(x, B4, C4)
    xm = (x.to(cd) * ratio[..., None]).to(dt_in).contiguous()
    h0 = None if initial_state is None else initial_state.to(cd).contiguous()
    y, S = ssd_mamba_ssm(
        xm,
        dtm.contiguous(),
        A32.contiguous(),
        B4.to(dt_in).contiguous(),
        C4.to(dt_in).contiguous(),
        h0,
        _mamba_chunk(chunk_size),
        output_final_state,
    )
    y = y.to(cd)
    if D is not None:
        y = y + x.to(cd) * D.to(cd)[:, None]
    return y.to(x.dtype), (S if output_final_state else None)
