"""Short convolution, rotary embeddings, RMSNorm, SwiGLU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mnemo.layers import RMSNorm, RotaryEmbedding, ShortConvolution, SwiGLU
from mnemo.ops import _native
from tests.helpers import assert_close


def test_short_conv_is_causal_depthwise_conv():
    torch.manual_seed(0)
    conv = ShortConvolution(6, 4).double()
    x = torch.randn(2, 11, 6, dtype=torch.float64)
    y, _ = conv(x)
    ref = F.conv1d(F.pad(x.transpose(1, 2), (3, 0)), conv.weight, conv.bias, groups=6).transpose(1, 2)
    assert_close(y, F.silu(ref), 1e-12)


@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize(
    "W,bias,dtype",
    [(4, True, torch.float64), (3, False, torch.float64), (1, True, torch.float64), (4, True, torch.float32)],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_short_conv_values_and_gradients_match_conv1d(backend, W, bias, dtype, threads, monkeypatch):
    """Both backends of the conv (the C kernel, and the PyTorch shifted multiply-adds), with a
    streaming state in front, against ``F.conv1d`` on the concatenated input: output, state and the
    gradients of the input, the state, the taps and the bias."""
    if backend == "torch":
        monkeypatch.setenv("MNEMO_NATIVE", "0")
    elif _native.library() is None:
        pytest.skip("native kernels unavailable (MNEMO_NATIVE=0, no C compiler, or the build failed)")
    torch.manual_seed(0)
    C = 37  # not a multiple of the SIMD width; split unevenly between two threads
    conv = ShortConvolution(C, W, bias=bias).to(dtype)
    x = torch.randn(2, 13, C, dtype=dtype, requires_grad=True)
    state = torch.randn(2, C, W - 1, dtype=dtype, requires_grad=True)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y, new_state = conv(x, state)
        gy = torch.randn(y.shape, dtype=dtype)
        got = torch.autograd.grad((y * gy).sum(), [x, state, *conv.parameters()])
    finally:
        torch.set_num_threads(prev)
    xp = torch.cat([state.transpose(1, 2), x], 1)
    ref = F.silu(F.conv1d(xp.transpose(1, 2), conv.weight, conv.bias, groups=C).transpose(1, 2))
    want = torch.autograd.grad((ref * gy).sum(), [x, state, *conv.parameters()])
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert_close(y, ref, tol, what="y")
    assert torch.equal(new_state, xp[:, xp.shape[1] - (W - 1) :].transpose(1, 2))
    for a, b, what in zip(got, want, ["dx", "dstate", "dw", "dbias"]):
        assert_close(a, b, tol, what=what)


def test_short_conv_streams_in_pieces_shorter_than_its_width():
    torch.manual_seed(0)
    conv = ShortConvolution(5, 4).double()
    x = torch.randn(1, 9, 5, dtype=torch.float64)
    full, _ = conv(x)
    outs, state = [], None
    for a, b in [(0, 1), (1, 3), (3, 4), (4, 9)]:
        y, state = conv(x[:, a:b], state)
        outs.append(y)
    assert_close(torch.cat(outs, 1), full, 1e-12)
    assert torch.equal(state, x[:, -3:].transpose(1, 2))


def test_short_conv_one_token_step_values_and_gradients():
    """The one-token path (a decoding step, no kernel call) against conv1d over [state | x]."""
    torch.manual_seed(0)
    conv = ShortConvolution(5, 4).double()
    x = torch.randn(2, 1, 5, dtype=torch.float64, requires_grad=True)
    state = torch.randn(2, 5, 3, dtype=torch.float64, requires_grad=True)
    y, new_state = conv(x, state)
    xp = torch.cat([state, x.transpose(1, 2)], -1)  # [B, C, W]
    want = F.silu(F.conv1d(xp, conv.weight, conv.bias, groups=5)).transpose(1, 2)
    assert_close(y, want, 1e-12)
    assert torch.equal(new_state, xp[..., 1:])
    got = torch.autograd.grad(y.square().sum(), (x, state, conv.weight, conv.bias))
    ref = torch.autograd.grad(want.square().sum(), (x, state, conv.weight, conv.bias))
    for a, b, what in zip(got, ref, ["dx", "dstate", "dw", "dbias"]):
        assert_close(a, b, 1e-12, what=what)


def test_rotary_scores_depend_only_on_relative_position():
    rope = RotaryEmbedding(8).double()
    g = torch.Generator().manual_seed(0)
    q, k = (
        torch.randn(1, 1, 1, 8, generator=g, dtype=torch.float64),
        torch.randn(1, 1, 1, 8, generator=g, dtype=torch.float64),
    )

    def score(m, n):
        return (rope(q, m) * rope(k, n)).sum()

    assert torch.allclose(score(5, 2), score(103, 100))
    assert torch.allclose(score(0, 0), (q * k).sum())
    assert not torch.allclose(score(5, 2), score(5, 3))


def test_rmsnorm_and_swiglu_shapes_and_values():
    x = torch.randn(3, 4, 16)
    n = RMSNorm(16)
    assert_close(n(x), x / x.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt(), 1e-6)
    mlp = SwiGLU(16)
    assert mlp(x).shape == x.shape
    assert mlp.w_in.out_features == 2 * 64  # 8/3 * 16 -> 42 -> rounded up to a multiple of 32


def test_short_convolution_is_twice_differentiable():
    """Under ``create_graph=True`` the convolution's backward runs its PyTorch form (the C kernel is
    first order), so second derivatives are right: ``gradgradcheck`` in float64, with the kernel
    available or not."""
    from mnemo.layers import ShortConvolution

    torch.manual_seed(0)
    conv = ShortConvolution(5, 3).double()
    x = torch.randn(2, 7, 5, dtype=torch.float64, requires_grad=True)
    state = torch.randn(2, 5, 2, dtype=torch.float64, requires_grad=True)

    def f(x, state, weight, bias):  # the convolution and its SiLU
        return torch.func.functional_call(conv, {"weight": weight, "bias": bias}, (x, state))[0]

    params = (conv.weight.detach().clone().requires_grad_(), conv.bias.detach().clone().requires_grad_())
    assert torch.autograd.gradgradcheck(f, (x, state, *params))
