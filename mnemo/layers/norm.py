"""Normalisation layers."""

from __future__ import annotations

import math
import numbers

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import _native, _workspace
from ..ops._common import transformed as _transformed

__all__ = ["RMSNorm", "gated_rms_norm"]


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019): ``y = x / sqrt(mean(x²) + eps) · weight``.

    Normalises the last dimension ``dim``; computed in at least float32 (float64 stays float64)
    and returned in ``x``'s dtype. Default ``eps=1e-5``. Raises ``ValueError`` (naming ``eps``)
    unless ``eps`` is a finite number ``>= 0`` (a negative one silently gave NaN or a wrong scale),
    (naming ``dim``) unless ``dim`` is an int ``>= 1``, and (naming ``x``) in :meth:`forward` unless
    ``x`` is ``[..., dim]``.
    """

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        if not isinstance(dim, numbers.Integral) or isinstance(dim, bool) or dim < 1:
            raise ValueError(f"dim: expected an int >= 1 (the normalised width), got {dim!r}")
        check_eps("eps", eps)
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(
        self, x: torch.Tensor, z: torch.Tensor | None = None, gate_first: bool = False
    ) -> torch.Tensor:
        """``RMSNorm(x)``; with a gate ``z`` (default ``z=None``), :func:`gated_rms_norm` with this
        module's weight and ``eps``: ``RMSNorm(x) ⊙ silu(z)``, or ``RMSNorm(x ⊙ silu(z))`` with
        ``gate_first=True`` (default ``gate_first=False``). The layers call it through the module,
        so forward hooks on the norm see ``(x, z)``."""
        groups = getattr(self, "groups", 1)
        if x.ndim == 0 or x.shape[-1] != self.weight.shape[0]:
            raise ValueError(f"x: expected shape [..., dim = {self.weight.shape[0]}], got {list(x.shape)}")
        if z is None:
            return _rms_groups(x, self.weight, self.eps, groups)
        return gated_rms_norm(x, z, self.weight, self.eps, groups=groups, gate_first=gate_first)

    def gated(self, x: torch.Tensor, z: torch.Tensor, gate_first: bool = False) -> torch.Tensor:
        """``self(x, z, gate_first)``: this norm with a SiLU gate, fused (see :meth:`forward`;
        default ``gate_first=False``)."""
        return self(x, z, gate_first)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def check_eps(name: str, eps, added_to: str = "mean(x²)") -> None:
    """Raise ``ValueError`` naming ``name`` unless ``eps`` is a finite real number ``>= 0`` (the
    message says what it is ``added_to``, default ``"mean(x²)"``). While ``torch.compile`` traces,
    comparisons only: ``dynamic=True`` makes a module's ``eps`` a symbolic float, on which
    ``math.isfinite`` broke the graph of every GLA block (a NaN fails ``eps >= 0``)."""
    if torch.compiler.is_compiling():
        if isinstance(eps, bool) or not (eps >= 0 and eps < math.inf):
            raise ValueError(f"{name}: expected a finite number >= 0 (added to {added_to}), got {eps!r}")
        return
    ok = isinstance(eps, numbers.Real) and not isinstance(eps, bool) and math.isfinite(eps) and eps >= 0
    if not ok:
        raise ValueError(f"{name}: expected a finite number >= 0 (added to {added_to}), got {eps!r}")


def _rms_groups(x: torch.Tensor, weight: torch.Tensor, eps: float, groups: int) -> torch.Tensor:
    """RMSNorm over ``groups`` contiguous groups of the last dim, one ``weight`` over all of it,
    computed in at least float32 and returned in ``x``'s dtype (``RMSNorm`` / ``GroupRMSNorm``)."""
    xc = x if x.dtype in (torch.float32, torch.float64) else x.float()
    if groups == 1:
        return F.rms_norm(xc, (x.shape[-1],), weight.to(xc.dtype), eps).to(x.dtype)
    xg = xc.unflatten(-1, (groups, -1))  # [..., g, c] (plain views: cheap in one-token steps)
    y = F.rms_norm(xg, (xg.shape[-1],), None, eps).flatten(-2)
    return (y * weight.to(xc.dtype)).to(x.dtype)


def _gated_rms_norm_reference(x, z, weight, eps: float, groups: int, gate_first: bool) -> torch.Tensor:
    """The PyTorch form of :func:`gated_rms_norm` (the native kernel's twin; any dtype): the gate,
    the product and the norm in at least float32, rounded once to the promoted dtype of ``x`` and
    ``z`` (bf16 rounded the normalised value, ``silu(z)`` and their product each on its own: up to
    2.4 unit roundoffs off, a third of the outputs not the rounded exact value)."""
    out = torch.promote_types(x.dtype, z.dtype)
    acc = torch.promote_types(out, torch.float32)
    xc, zc = x.to(acc), z.to(acc)
    if gate_first:
        return _rms_groups(xc * F.silu(zc), weight, eps, groups).to(out)
    return (_rms_groups(xc, weight, eps, groups) * F.silu(zc)).to(out)


def gated_rms_norm(
    x: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-5,
    *,
    groups: int = 1,
    gate_first: bool = False,
) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019) with a SiLU output gate, over ``groups`` contiguous groups of
    the last dimension (one ``weight`` over all of it):

    * ``gate_first=False`` (default; Gated DeltaNet, GLA, RetNet): ``RMSNorm(x) ⊙ w ⊙ silu(z)``;
    * ``gate_first=True`` (Mamba-2, Dao & Gu 2024 §7): ``RMSNorm(x ⊙ silu(z)) ⊙ w``,

    with ``RMSNorm(a) = a / sqrt(mean(a²) + eps)`` per group. Defaults: ``eps=1e-5``, ``groups=1``,
    ``gate_first=False``.

    Args:
        x, z: ``[..., D]``, the same shape. weight: ``[D]``.
    Returns:
        ``[..., D]`` in ``x``'s dtype (mixed dtypes: PyTorch's type promotion, as in the PyTorch form).
    Dtypes: float32/float64 CPU tensors of one dtype run one C kernel each way
    (:mod:`mnemo.ops._native`: one pass over memory instead of the PyTorch form's half-dozen
    elementwise passes, each with its own freshly allocated tensor); anything else (bfloat16, CUDA,
    mixed dtypes, ``MNEMO_NATIVE=0``, while ``torch.compile`` traces, under forward-mode AD or a
    ``torch.func`` transform) runs the PyTorch form, which computes the gate, the product and the norm
    in at least float32 and rounds once (a bf16 output is the float32 result rounded). Both are
    twice differentiable (a graph of the kernel's gradient is built by the PyTorch form).
    Raises:
        ValueError: ``z`` or ``weight`` does not match ``x``, ``groups`` is not an int dividing
            ``D``, or ``eps`` is not a finite number ``>= 0``.
    """
    D = x.shape[-1] if x.ndim else 0
    if z.shape != x.shape:
        raise ValueError(f"z: expected the shape of x {list(x.shape)}, got {list(z.shape)}")
    if weight.shape != (D,):
        raise ValueError(f"weight: expected shape [{D}] (the last dim of x), got {list(weight.shape)}")
    if not isinstance(groups, numbers.Integral) or isinstance(groups, bool) or groups < 1 or D % groups:
        raise ValueError(f"groups: expected a divisor of D = {D}, got {groups!r}")
    check_eps("eps", eps)  # (a negative one gave NaN or a wrong scale, as in RMSNorm)
    if x.numel() and _native.usable(x, z, weight) and not _transformed(x, z, weight):
        return _GatedRMSNorm.apply(x, z, weight, float(eps), groups, bool(gate_first))
    return _gated_rms_norm_reference(x, z, weight, eps, groups, gate_first)


def _rows(t: torch.Tensor) -> list:
    """``t [..., D]`` as ``[Strided rows, row stride]`` for the kernels: a view when its rows lie a
    fixed stride apart with contiguous channels (e.g. a slice of a wider projection), else a copy."""
    D = t.shape[-1]
    try:
        v = t.view(-1, D)
    except RuntimeError:
        v = None
    if v is None or (D > 1 and v.stride(1) != 1):
        v = t.reshape(-1, D).contiguous()
    elif D == 1:  # one channel: its stride is arbitrary (a transpose), the kernels want 1
        v = v.as_strided(v.shape, (v.stride(0), 1))
    return [_native.Strided(v), v.stride(0)]


class _GatedRMSNorm(torch.autograd.Function):
    """:func:`gated_rms_norm` through the C kernels ``gn_fwd`` / ``gn_bwd`` (``gated_norm.c``). The
    backward sums the per-thread partials of the weight gradient; when a graph of the gradient is
    asked for (``create_graph=True``) it differentiates the PyTorch form instead."""

    @staticmethod
    def forward(ctx, x, z, weight, eps, groups, gate_first):
        D = x.shape[-1]
        R = x.numel() // D
        y = _workspace.empty(x.shape, x.dtype, x.device)  # reused across calls (no page faults)
        rstd = x.new_empty(R, groups)
        args = [D, groups, int(gate_first), x.new_full((1,), eps), *_rows(x), *_rows(z), weight.contiguous()]
        _native.call("gn_fwd", x.dtype, R, _native.slots(R), args + [y, rstd])
        ctx.save_for_backward(x, z, weight, rstd)
        ctx.eps, ctx.groups, ctx.gate_first = eps, groups, gate_first
        return y

    @staticmethod
    def backward(ctx, dy):
        x, z, weight, rstd = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: the PyTorch form's autograd, on the saved inputs
            wanted = [t for t, need in zip((x, z, weight), ctx.needs_input_grad[:3]) if need]
            with torch.enable_grad():
                y = _gated_rms_norm_reference(x, z, weight, ctx.eps, ctx.groups, ctx.gate_first)
            grads = iter(torch.autograd.grad(y, wanted, dy, create_graph=True))
            return (*(next(grads) if need else None for need in ctx.needs_input_grad[:3]), None, None, None)
        D = x.shape[-1]
        R = x.numel() // D
        nt = _native.slots(R)
        dx, dz = (_workspace.empty(t.shape, t.dtype, t.device) for t in (x, z))
        dw = x.new_empty(nt, D)
        args = [D, ctx.groups, int(ctx.gate_first), *_rows(x), *_rows(z), weight.contiguous()]
        _native.call("gn_bwd", x.dtype, R, nt, args + [rstd, dy.contiguous(), dx, dz, dw])
        return dx, dz, dw.sum(0), None, None, None
