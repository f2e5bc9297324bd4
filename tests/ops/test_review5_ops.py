"""Fifth review of the recurrences' kernels: defects found by a break-it pass (each test failed on
the code before its fix)."""

from __future__ import annotations

import pytest
import torch

from mnemo.ops import RangeWarning, linear_attention_map, softmax_attention, softmax_attention_map
from mnemo.ops.ring_attention import ThreadRing, blockwise_attention, ring_attention


def _qkv(T=6, H=2, Hkv=1, K=3, V=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, H, K, generator=gen, dtype=torch.float64)
    k = torch.randn(1, T, Hkv, K, generator=gen, dtype=torch.float64)
    v = torch.randn(1, T, Hkv, V, generator=gen, dtype=torch.float64)
    return q, k, v


def test_ring_attention_refuses_a_second_order_gradient_it_would_get_wrong():
    # Its backward saves o and lse as constants, so create_graph=True gave a wrong second
    # derivative silently (0.105 where softmax attention's is 0.310 for this input).
    q0, k, v = _qkv()
    q = q0.clone().requires_grad_()
    o, _ = softmax_attention(q, k, v, mode="recurrent")
    (gq,) = torch.autograd.grad(o.square().sum(), q, create_graph=True)
    (want,) = torch.autograd.grad(gq.sum(), q)
    assert want.abs().max() > 0.1  # the second derivative is not trivially zero

    q = q0.clone().requires_grad_()
    o = ring_attention(q, k, v, ring=ThreadRing.make(1)[0])
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(o.square().sum(), q, create_graph=True)
    # first order is unchanged
    q = q0.clone().requires_grad_()
    (g_ring,) = torch.autograd.grad(ring_attention(q, k, v, ring=ThreadRing.make(1)[0]).square().sum(), q)
    q = q0.clone().requires_grad_()
    (g_ref,) = torch.autograd.grad(softmax_attention(q, k, v)[0].square().sum(), q)
    torch.testing.assert_close(g_ring, g_ref, rtol=1e-12, atol=1e-12)


def _k0():
    q, k, v = _qkv(T=5, K=3)
    return q[..., :0], k[..., :0], v


@pytest.mark.parametrize(
    "call",
    [
        lambda q, k, v: softmax_attention(q, k, v),
        lambda q, k, v: softmax_attention(q, k, v, mode="recurrent"),
        lambda q, k, v: blockwise_attention(q, k, v, 1),
        lambda q, k, v: ring_attention(q, k, v, ring=ThreadRing.make(1)[0]),
        lambda q, k, v: softmax_attention_map(q, k),
        lambda q, k, v: linear_attention_map(q, k),
        lambda q, k, v: softmax_attention(q, k, v, scale=float("nan")),
        lambda q, k, v: softmax_attention(q, k, v, scale=torch.tensor(float("inf"))),
    ],
)
def test_no_head_dimension_and_no_scale_is_named_not_a_zero_division(call):
    # K = 0 with the default scale K ** -0.5 raised a bare ZeroDivisionError (also while formatting
    # the message about a non-finite scale)
    with pytest.raises(ValueError, match="scale"):
        call(*_k0())


def test_no_head_dimension_with_a_given_scale_still_averages_the_visible_values():
    q, k, v = _k0()
    o, _ = softmax_attention(q, k, v, scale=1.0)
    want = v.cumsum(1) / torch.arange(1, 6, dtype=v.dtype)[:, None, None]  # all scores 0
    torch.testing.assert_close(o, want.expand_as(o), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ring_attention(q, k, v, ring=ThreadRing.make(1)[0], scale=1.0), o)


def test_softmax_attention_map_checks_its_scale_as_the_op_does():
    # the map took any scale unchecked: a NaN scale gave a map of NaN without a word
    q, k, _ = _qkv()
    with pytest.raises(ValueError, match="scale must be a finite number"):
        softmax_attention_map(q, k, scale=float("nan"))
    with pytest.raises(TypeError, match="scale must be a real number"):
        softmax_attention_map(q, k, scale="1")
    with pytest.warns(RangeWarning, match="scale should be >= 0"):
        softmax_attention_map(q, k, scale=-1.0)


def test_blockwise_attention_refuses_a_bool_block_count():
    # True passed the int check and ran as one block
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="n_blocks must be a positive divisor of T = 6, got True"):
        blockwise_attention(q, k, v, True)
