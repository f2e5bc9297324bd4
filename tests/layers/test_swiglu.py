"""SwiGLU's gate (:func:`mnemo.layers.mlp.swiglu`): its C kernel against the PyTorch form and a
hand loop of the equation, its gradients (finite differences, a graph of the gradient), the
fallbacks, the errors, and the MLP that uses it.

Tolerances: float64 kernel vs PyTorch form ``1e-13`` (measured ~2e-16: the kernel's exp is a
polynomial of its own, accurate to rounding); float32 ``2e-6`` (measured ~6e-8 for the values and
~1e-7 relative for the gradients: its exp is accurate to ~1e-7 relative, float32's epsilon)."""

from __future__ import annotations

import math

import pytest
import torch

import mnemo.layers.mlp as mlp_mod
from mnemo.layers.mlp import SwiGLU, _swiglu_reference, swiglu
from mnemo.ops import _native
from tests.helpers import assert_close, spy_native_calls

needs_native = pytest.mark.skipif(
    _native.library() is None,
    reason="native kernels unavailable (MNEMO_NATIVE=0, no C compiler, or the build failed)",
)


@pytest.fixture
def any_size(monkeypatch):
    """The kernel for every size (these tests' inputs are below ``_KERNEL_MIN_NUMEL``)."""
    monkeypatch.setattr(mlp_mod, "_KERNEL_MIN_NUMEL", 0)


def _spy_calls(monkeypatch):
    calls = spy_native_calls(monkeypatch)
    return calls


def _inputs(shape, H, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = 3 * torch.randn(*shape, 2 * H, generator=g, dtype=dtype)  # both tails of the sigmoid
    dy = torch.randn(*shape, H, generator=g, dtype=dtype)
    return h, dy


def _value_and_grad(fn, h, dy):
    h = h.clone().requires_grad_(True)
    y = fn(h)
    return y, torch.autograd.grad(y, h, dy)[0]


@needs_native
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-13), (torch.float32, 2e-6)])
@pytest.mark.parametrize("H", [64, 37, 5, 1])
def test_kernel_matches_the_pytorch_form(dtype, tol, H, any_size, monkeypatch):
    """Value and gradient; ``H`` = 37, 5 and 1 leave partial SIMD registers, and 15 rows split
    unevenly over the threads."""
    h, dy = _inputs((3, 5), H, dtype)
    calls = _spy_calls(monkeypatch)
    got = _value_and_grad(swiglu, h, dy)
    assert calls == ["glu_fwd", "glu_bwd"]  # the kernel really ran
    want = _value_and_grad(_swiglu_reference, h, dy)
    for what, a, b in zip(("y", "dh"), got, want):
        assert a.dtype == dtype
        assert_close(a, b, tol, what=what)


@pytest.mark.parametrize("fn", [swiglu, _swiglu_reference], ids=["swiglu", "pytorch"])
def test_the_equation_by_hand(fn, any_size):
    """A hand loop of ``silu(a) ⊙ b`` and of its gradient ``(dy b silu'(a), dy silu(a))``, in
    Python floats, on a 2 x 2H input with H = 3 (``swiglu``: the kernel when it builds), including
    a gate of -800 (the sigmoid's exp overflows: the value is -0, not NaN)."""
    h, dy = _inputs((2,), 3, torch.float64, seed=3)
    h[1, 0] = -800.0
    y, dh = _value_and_grad(fn, h, dy)

    def sig(t):
        return 1 / (1 + math.exp(-t)) if t > -700 else 0.0

    for r in range(2):
        for i in range(3):
            a, b, g = h[r, i].item(), h[r, 3 + i].item(), dy[r, i].item()
            s = sig(a)
            assert y[r, i].item() == pytest.approx(a * s * b, rel=1e-13, abs=1e-300)
            assert dh[r, i].item() == pytest.approx(g * b * (s + a * s * (1 - s)), rel=1e-13, abs=1e-300)
            assert dh[r, 3 + i].item() == pytest.approx(g * a * s, rel=1e-13, abs=1e-300)
    assert torch.isfinite(y).all() and torch.isfinite(dh).all()


@needs_native
def test_gradients_by_finite_differences_and_a_graph_of_the_gradient(any_size):
    """``gradcheck`` of the kernel's backward, and ``gradgradcheck`` (the backward differentiated
    again: the PyTorch form's autograd on the saved input)."""
    h, _ = _inputs((2, 3), 5, torch.float64, seed=1)
    assert torch.autograd.gradcheck(swiglu, (h.requires_grad_(True),))
    assert torch.autograd.gradgradcheck(swiglu, (h,))
    # a non-contiguous input (a transpose): the graph of the gradient is the input's own
    h_t = torch.randn(6, 10, dtype=torch.float64).t().requires_grad_(True)
    assert not h_t.is_contiguous()
    assert torch.autograd.gradgradcheck(swiglu, (h_t,))
    (g,) = torch.autograd.grad(swiglu(h_t).square().sum(), h_t, create_graph=True)
    (g_ref,) = torch.autograd.grad(_swiglu_reference(h_t).square().sum(), h_t, create_graph=True)
    assert_close(g, g_ref, 1e-13)
    assert_close(torch.autograd.grad(g.sum(), h_t)[0], torch.autograd.grad(g_ref.sum(), h_t)[0], 1e-12)


def test_fallbacks_compute_the_same(monkeypatch, any_size):
    """No kernel (``_native.usable`` false: ``MNEMO_NATIVE=0``, no compiler, CUDA, torch.compile)
    runs the PyTorch form; bfloat16 runs it too and stays bfloat16."""
    h, dy = _inputs((4,), 8, torch.float64)
    fused = _value_and_grad(swiglu, h, dy)
    with monkeypatch.context() as m:
        m.setattr(mlp_mod._native, "usable", lambda *t: False)
        plain = _value_and_grad(swiglu, h, dy)
    for a, b in zip(fused, plain):
        assert_close(a, b, 1e-13)
    hb = h.bfloat16()
    y = swiglu(hb)
    assert y.dtype == torch.bfloat16
    assert_close(y, _swiglu_reference(hb), 0.0)
    assert_close(y, fused[0], 2e-2)  # bfloat16 rounding of the input and the output


def test_errors_name_the_argument():
    with pytest.raises(
        ValueError, match=r"h: expected an even last dimension \[\.\.\., 2H\], got shape \[2, 7\]"
    ):
        swiglu(torch.randn(2, 7))
    with pytest.raises(ValueError, match="h: expected an even last dimension"):
        swiglu(torch.tensor(1.0))


@needs_native
def test_which_calls_run_the_kernel(monkeypatch):
    """The kernel runs for a float CPU input of at least ``_KERNEL_MIN_NUMEL`` elements that needs
    a gradient; the PyTorch form for a smaller one, for one that needs none, and under ``no_grad``
    and ``inference_mode`` (evaluation, decoding: the forward alone is no faster in C)."""
    calls = _spy_calls(monkeypatch)
    n = mlp_mod._KERNEL_MIN_NUMEL
    big = torch.randn(n // 64, 64, requires_grad=True)
    swiglu(big).sum().backward()
    assert calls == ["glu_fwd", "glu_bwd"]
    calls.clear()
    swiglu(torch.randn(n // 64 - 1, 64, requires_grad=True)).sum().backward()
    swiglu(big.detach())
    for ctx in (torch.no_grad, torch.inference_mode):
        with ctx():
            swiglu(big)
    assert calls == []


@needs_native
def test_strided_input_kept_outputs_and_empty_inputs(any_size):
    """A transposed (non-contiguous) input gives the contiguous input's result; an output kept
    across later calls (its buffer is the workspace cache's) is not overwritten, nor is its
    gradient; empty inputs give empty outputs."""
    h, dy = _inputs((5, 3), 8, torch.float64)
    h_t = h.transpose(0, 1).contiguous().transpose(0, 1)
    assert not h_t.is_contiguous()
    for a, b in zip(_value_and_grad(swiglu, h_t, dy), _value_and_grad(_swiglu_reference, h, dy)):
        assert_close(a, b, 1e-13)
    x, dx = _inputs((64, 16), 32, torch.float32)
    want = _value_and_grad(_swiglu_reference, x, dx)
    kept = _value_and_grad(swiglu, x, dx)
    copies = [t.clone() for t in kept]
    for seed in (1, 2):
        _value_and_grad(swiglu, *_inputs((64, 16), 32, torch.float32, seed))
    for k, c, w in zip(kept, copies, want):
        assert torch.equal(k, c)
        assert_close(k, w, 2e-6)
    assert swiglu(torch.randn(0, 6, requires_grad=True)).shape == (0, 3)


def test_forward_mode_ad_and_torch_func_use_the_pytorch_form():
    """Dual tensors and ``torch.func`` transforms see the PyTorch form (the kernel's Function has no
    ``jvp`` or batching rule): the JVP equals a central finite difference, ``vmap`` a loop."""
    import torch.autograd.forward_ad as fwAD

    h, _ = _inputs((3,), 4, torch.float64, seed=4)
    t = torch.randn_like(h)
    with fwAD.dual_level():
        jvp = fwAD.unpack_dual(swiglu(fwAD.make_dual(h, t))).tangent
    eps = 1e-6
    assert_close(jvp, (swiglu(h + eps * t) - swiglu(h - eps * t)) / (2 * eps), 1e-8)
    batched = torch.func.vmap(swiglu)(h)
    assert_close(batched, torch.stack([swiglu(r) for r in h]), 1e-13)


def test_the_mlp_is_w_out_of_the_gated_halves():
    """``SwiGLU(x) = W_out (silu(W_gate x) ⊙ W_up x)`` with ``W_in = [W_gate; W_up]``, computed here
    from the two weight halves by hand; gradients of every weight equal the PyTorch form's."""
    torch.manual_seed(0)
    m = SwiGLU(12, hidden=20).double()
    x = torch.randn(2, 7, 12, dtype=torch.float64)
    Wg, Wu = m.w_in.weight[:20], m.w_in.weight[20:]
    a, b = x @ Wg.T, x @ Wu.T
    want = (a * torch.sigmoid(a) * b) @ m.w_out.weight.T
    y = m(x)
    assert_close(y, want, 1e-13)
    gw = torch.autograd.grad(y.square().sum(), (m.w_in.weight, m.w_out.weight))
    gw_ref = torch.autograd.grad(want.square().sum(), (m.w_in.weight, m.w_out.weight))
    for g, r in zip(gw, gw_ref):
        assert_close(g, r, 1e-12)
