"""Channel mixers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import _native, _workspace
from .base import upcast
from .norm import _transformed


def swiglu_hidden(d_model: int, multiple_of: int = 32) -> int:
    """``8/3 · d_model`` rounded up to a multiple of ``multiple_of`` (LLaMA's choice; default
    ``multiple_of=32``)."""
    h = int(8 * d_model / 3)
    return multiple_of * (-(-h // multiple_of))


def _swiglu_reference(h: torch.Tensor) -> torch.Tensor:
    """The PyTorch form of :func:`swiglu` (the native kernel's twin; any dtype): computed in at
    least float32 and rounded once to ``h``'s dtype (bf16 rounded ``silu(a)`` and the product each on
    its own: up to 1.9 unit roundoffs off, a quarter of the outputs not the rounded exact value)."""
    gate, up = upcast(h).chunk(2, dim=-1)
    return (F.silu(gate) * up).to(h.dtype)


#: The smallest ``h`` (in elements) whose gate runs the C kernel: below it the kernel's fixed cost
#: per call (~20 us) exceeds what it saves (``scripts/bench_swiglu.py``; docs/benchmarks/notes.md).
_KERNEL_MIN_NUMEL = 1 << 15


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate (Shazeer 2020, "GLU Variants Improve Transformer", Eq. 6): ``silu(a) ⊙ b`` for
    ``h = [a, b]`` split in halves on the last dimension (``a`` the gate projection's output, ``b``
    the up projection's; ``silu(a) = a · σ(a)``).

    Args:
        h: ``[..., 2H]``.
    Returns:
        ``[..., H]`` in ``h``'s dtype (bf16/fp16: the float32 result rounded once).
    Dtypes and forms: a float32/float64 CPU ``h`` of at least ``2**15`` elements that needs a
    gradient runs one C kernel each way (:mod:`mnemo.ops._native`, ``swiglu.c``: one pass over
    memory instead of the PyTorch form's SiLU and product forward and five passes backward, and
    the gradient written in ``h``'s layout, so the split's backward concatenation goes too: 2-3x
    faster forward and backward together). Everything else runs the PyTorch form: calls without a
    gradient (evaluation, decoding; the forward alone is no faster in C), small calls (the
    kernel's fixed cost), bfloat16, CUDA, ``MNEMO_NATIVE=0``, while ``torch.compile`` traces,
    under forward-mode AD or a ``torch.func`` transform. Both are twice differentiable (a graph of
    the kernel's gradient is built by the PyTorch form). A bfloat16/float16 ``h`` is computed in
    float32 and rounded once (forward and gradient); with a gradient it keeps only ``h`` for the
    backward (:class:`_SwiGLULowPrecision`, no float32 copy of the activations).
    Raises:
        ValueError: the last dimension of ``h`` is odd (or ``h`` is a scalar).
    """
    if h.ndim == 0 or h.shape[-1] % 2:
        raise ValueError(f"h: expected an even last dimension [..., 2H], got shape {list(h.shape)}")
    if (
        h.numel() >= _KERNEL_MIN_NUMEL
        and h.requires_grad
        and torch.is_grad_enabled()
        and _native.usable(h)
        and not _transformed(h)
    ):
        return _SwiGLU.apply(h)
    if h.dtype in (torch.bfloat16, torch.float16) and h.requires_grad and torch.is_grad_enabled():
        if not _transformed(h):
            return _SwiGLULowPrecision.apply(h)
    return _swiglu_reference(h)


def _reference_grad(h: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """``∂(dy · swiglu(h))/∂h`` with a graph (``create_graph=True``): the PyTorch form's autograd,
    what the custom backward passes run when a second derivative is asked for."""
    with torch.enable_grad():
        y = _swiglu_reference(h)
    return torch.autograd.grad(y, h, dy, create_graph=True)[0]


class _SwiGLULowPrecision(torch.autograd.Function):
    """:func:`swiglu` of a bfloat16/float16 ``h`` that needs a gradient: computed in float32 and
    rounded once, each way, keeping only ``h`` itself for the backward (the PyTorch form's autograd
    would keep float32 copies of both halves, twice the memory of ``h``, where bf16 training keeps
    activations small); ``∂silu(a)/∂a = σ(a) (1 + a (1 − σ(a)))``. With ``create_graph=True`` the
    backward differentiates the PyTorch form."""

    @staticmethod
    def forward(ctx, h):
        ctx.save_for_backward(h)
        return _swiglu_reference(h)

    @staticmethod
    def backward(ctx, dy):
        (h,) = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: the PyTorch form's autograd, on the saved input
            return _reference_grad(h, dy)
        a, b = h.float().chunk(2, dim=-1)
        sig = torch.sigmoid(a)
        g = dy.float()
        da = g * b * sig * (1 + a * (1 - sig))
        return torch.cat([da, g * a * sig], dim=-1).to(h.dtype)


class _SwiGLU(torch.autograd.Function):
    """:func:`swiglu` through the C kernels ``glu_fwd`` / ``glu_bwd`` (``swiglu.c``); when a graph
    of the gradient is asked for (``create_graph=True``) the backward differentiates the PyTorch
    form instead."""

    @staticmethod
    def forward(ctx, h):
        H = h.shape[-1] // 2
        R = h.numel() // (2 * H)
        y = _workspace.empty((*h.shape[:-1], H), h.dtype, h.device)  # reused across calls
        _native.call("glu_fwd", h.dtype, R, _native.slots(R), [H, h.contiguous(), y])
        ctx.save_for_backward(h)  # the input itself (not a copy): the create_graph path differentiates it
        return y

    @staticmethod
    def backward(ctx, dy):
        (h,) = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: the PyTorch form's autograd, on the saved input
            return _reference_grad(h, dy)
        H = h.shape[-1] // 2
        R = h.numel() // (2 * H)
        dh = _workspace.empty(h.shape, h.dtype, h.device)
        _native.call("glu_bwd", h.dtype, R, _native.slots(R), [H, h.contiguous(), dy.contiguous(), dh])
        return dh


class SwiGLU(nn.Module):
    """Gated MLP ``W_down (silu(W_gate x) ⊙ W_up x)`` (Shazeer 2020, "GLU Variants").

    ``x: [..., d_model] -> [..., d_model]``; ``hidden`` defaults to :func:`swiglu_hidden`.

    Raises:
        ValueError: ``d_model`` not an int ``>= 1``, or ``hidden`` not ``None`` or an int ``>= 1``.
    """

    def __init__(self, d_model: int, hidden: int | None = None):
        super().__init__()
        for name, n, optional in (("d_model", d_model, False), ("hidden", hidden, True)):
            if (n is None and not optional) or (
                n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1)
            ):
                raise ValueError(f"{name}: expected {'None or ' if optional else ''}an int >= 1, got {n!r}")
        hidden = hidden or swiglu_hidden(d_model)
        self.w_in = nn.Linear(d_model, 2 * hidden, bias=False)
        self.w_out = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_out(swiglu(self.w_in(x)))
