"""The short convolution (and its SiLU) against a hand loop written from the equation: values, the
new state and the gradients of every input (x, the state, weight, bias), on the C kernel and on the
PyTorch form, with and without a state, bias and activation, for T below, at and above W − 1 (and
T = 0)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mnemo.layers.conv import ShortConvolution
from mnemo.ops import _native


def _hand(x, state, weight, bias, act):
    """y_t = act(b + Σ_i w_i x_{t−W+1+i}) token by token, the inputs before t = 0 read from the
    state ``[B, C, W−1]`` (zeros without one); and the last W − 1 inputs as the new state."""
    B, T, C = x.shape
    W = weight.shape[-1]
    hist = [state[:, :, j] if state is not None else x.new_zeros(B, C) for j in range(W - 1)]
    ys = []
    for t in range(T):
        hist.append(x[:, t])
        window = hist[len(hist) - W :]
        pre = sum(weight[:, 0, i] * window[i] for i in range(W))
        if bias is not None:
            pre = pre + bias
        ys.append(F.silu(pre) if act else pre)
    y = torch.stack(ys, 1) if ys else x[:, :0] * 1.0
    new_state = torch.stack(hist[len(hist) - (W - 1) :], -1) if W > 1 else x.new_zeros(B, C, 0)
    return y, new_state


def _native_switch(monkeypatch, on: bool):
    monkeypatch.setenv("MNEMO_NATIVE", "1" if on else "0")


needs_native = pytest.mark.skipif(_native.library() is None, reason="no C compiler")


@pytest.mark.parametrize("native", [pytest.param(True, marks=needs_native), False])
@pytest.mark.parametrize("T", [0, 2, 3, 4, 17])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("bias,act", [(True, True), (False, True), (True, False)])
def test_matches_a_hand_loop_with_gradients(monkeypatch, native, T, with_state, bias, act):
    _native_switch(monkeypatch, native)
    torch.manual_seed(T)
    B, C, W = 2, 5, 4
    conv = ShortConvolution(C, W, activation=act, bias=bias).double()
    if bias:
        torch.nn.init.normal_(conv.bias)
    x = torch.randn(B, T, C, dtype=torch.float64, requires_grad=True)
    state = torch.randn(B, C, W - 1, dtype=torch.float64, requires_grad=True) if with_state else None
    y, s = conv(x, state)
    yr, sr = _hand(x, state, conv.weight, conv.bias, act)
    torch.testing.assert_close(y, yr, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(s, sr, rtol=0, atol=0)
    gy, gs = torch.randn_like(y), torch.randn_like(s)
    ins = [x, conv.weight] + ([state] if with_state else []) + ([conv.bias] if bias else [])
    got = torch.autograd.grad((y * gy).sum() + (s * gs).sum(), ins, allow_unused=True, materialize_grads=True)
    want = torch.autograd.grad(
        (yr * gy).sum() + (sr * gs).sum(), ins, allow_unused=True, materialize_grads=True
    )
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@needs_native
def test_kernel_float32_matches_float64_and_the_pytorch_form(monkeypatch):
    torch.manual_seed(0)
    conv = ShortConvolution(37, 4)  # an odd channel count: the SIMD tail of each thread's range
    torch.nn.init.normal_(conv.bias)
    x = torch.randn(3, 50, 37, requires_grad=True)
    state = torch.randn(3, 37, 3, requires_grad=True)
    outs = {}
    for on in (True, False):
        _native_switch(monkeypatch, on)
        y, s = conv(x, state)
        g = torch.autograd.grad(y.square().sum() + s.sum(), [x, state, conv.weight, conv.bias])
        outs[on] = (y, *g)
    conv64 = ShortConvolution(37, 4).double()
    conv64.load_state_dict({k: v.double() for k, v in conv.state_dict().items()})
    x64, st64 = x.detach().double().requires_grad_(), state.detach().double().requires_grad_()
    y64, s64 = _hand(x64, st64, conv64.weight, conv64.bias, True)
    g64 = torch.autograd.grad(y64.square().sum() + s64.sum(), [x64, st64, conv64.weight, conv64.bias])
    for on in (True, False):
        for a, b in zip(outs[on], (y64, *g64)):
            torch.testing.assert_close(a.double(), b, rtol=2e-5, atol=2e-5)


def test_pytorch_form_is_twice_differentiable(monkeypatch):
    _native_switch(monkeypatch, False)
    torch.manual_seed(1)
    conv = ShortConvolution(3, 3).double()
    torch.nn.init.normal_(conv.bias)
    x = torch.randn(1, 5, 3, dtype=torch.float64, requires_grad=True)
    st = torch.randn(1, 3, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda a, b: conv(a, b)[0], (x, st))
