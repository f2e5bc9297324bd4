"""Third break-it review of the recurrences' kernels (mnemo/ops): regressions for what it found.

1. A tensor ``scale`` (a learned one) skipped the checks a number gets: NaN/inf went through
   (softmax attention's parallel form then returned zeros, its reference form NaN; the matrix
   memories NaN), and a tensor of several values was broadcast differently by the forms
   (softmax attention's parallel form scales ``[B, H, T, K]``, its token loop ``[B, H, K]``).
2. ``linear_attention(normalize=True)`` with ``V = 0`` lost the normaliser column: the state came
   back ``[B, H, F, 0]`` (not ``[B, H, F, V + 1]``) and an initial state of the documented shape was
   refused.
3. ``ring_attention`` took any ``scale`` through ``float()``: NaN silently, and a tensor that needs
   a gradient silently cut off the graph.
"""

from __future__ import annotations

import threading

import pytest
import torch

from mnemo.ops import (
    gated_delta_rule,
    gated_linear_attention,
    linear_attention,
    softmax_attention,
)
from mnemo.ops.ring_attention import ThreadRing, blockwise_attention, ring_attention


def _qkv(T=4, H=2, K=3, V=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, H, K, generator=g, dtype=torch.float64)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(1, T, H, V, generator=g, dtype=torch.float64)
    return q, k, v


_OPS = {
    "softmax_attention": lambda q, k, v, **kw: softmax_attention(q, k, v, **kw),
    "gated_linear_attention": lambda q, k, v, **kw: gated_linear_attention(
        q, k, v, -torch.ones(q.shape[:3], dtype=q.dtype), **kw
    ),
    "gated_delta_rule": lambda q, k, v, **kw: gated_delta_rule(
        q, k, v, -torch.ones(q.shape[:3], dtype=q.dtype), torch.full(q.shape[:3], 0.5, dtype=q.dtype), **kw
    ),
    "linear_attention": lambda q, k, v, **kw: linear_attention(q, k, v, **kw),
}


@pytest.mark.parametrize("op", sorted(_OPS))
@pytest.mark.parametrize("mode", ["parallel", "recurrent"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_tensor_scale_is_refused_like_a_number(op, mode, bad):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="scale must be a finite number"):
        _OPS[op](q, k, v, scale=bad, mode=mode)
    with pytest.raises(ValueError, match="scale must be a finite number"):
        _OPS[op](q, k, v, scale=torch.tensor(bad, dtype=torch.float64), mode=mode)


def test_softmax_attention_gave_zeros_for_a_nan_tensor_scale():
    """The defect as it showed: the parallel form (SDPA) turned NaN scores into a zero output."""
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="finite"):
        softmax_attention(q, k, v, scale=torch.tensor(float("nan"), dtype=torch.float64))


@pytest.mark.parametrize("op", sorted(_OPS))
@pytest.mark.parametrize("shape", [(2, 1), (2,), (3,), (1, 2)])
def test_a_tensor_scale_of_several_values_is_refused_naming_its_shape(op, shape):
    """``T == H == 2``: a ``[H, 1]`` scale broadcast over ``[T, K]`` in the parallel form and over
    ``[H, K]`` in the token loop, so the forms disagreed without a word."""
    q, k, v = _qkv(T=2, H=2)
    scale = torch.full(shape, 0.5, dtype=torch.float64)
    with pytest.raises(
        ValueError, match=r"scale must be a number or a tensor of one value.*\[" + str(shape[0])
    ):
        _OPS[op](q, k, v, scale=scale, mode="parallel")


@pytest.mark.parametrize("shape", [(), (1,), (1, 1)])
def test_a_one_value_tensor_scale_still_works_and_gets_its_gradient(shape):
    """Any one-value tensor is a scale (all forms agree; the gradient reaches it): the value of
    ``∂(Σ o²)/∂scale`` for linear attention without a feature map is ``Σ 2 o² / scale``."""
    q, k, v = _qkv(T=5)
    expected, _ = linear_attention(q, k, v, scale=0.7, mode="recurrent")
    for mode in ("recurrent", "chunk", "parallel"):
        scale = torch.full(shape, 0.7, dtype=torch.float64, requires_grad=True)
        o, _ = linear_attention(q, k, v, scale=scale, mode=mode, chunk_size=2)
        torch.testing.assert_close(o, expected, rtol=1e-12, atol=1e-12)
        (grad,) = torch.autograd.grad((o * o).sum(), scale)
        torch.testing.assert_close(
            grad.reshape(()), (2 * expected * expected / 0.7).sum(), rtol=1e-12, atol=1e-12
        )


@pytest.mark.parametrize("mode", ["recurrent", "chunk", "parallel"])
@pytest.mark.parametrize("varlen", [False, True])
def test_normalised_linear_attention_keeps_its_normaliser_column_with_no_values(mode, varlen):
    """``V = 0``: the state is ``[N, H, F, 1]``, its one column ``z = z_0 + Σ_t φ(k_t)`` (by hand)."""
    B, T, H, K = (1, 5, 2, 3)
    q, k, _ = _qkv(T=T, H=H, K=K)
    v = torch.zeros(B, T, H, 0, dtype=torch.float64)
    cu = torch.tensor([0, 2, 5]) if varlen else None
    N = 2 if varlen else B
    z0 = torch.rand(N, H, K, 1, dtype=torch.float64)
    o, S = linear_attention(
        q,
        k,
        v,
        feature_map="elu",
        normalize=True,
        initial_state=z0,
        output_final_state=True,
        cu_seqlens=cu,
        mode=mode,
        chunk_size=2,
    )
    assert o.shape == (B, T, H, 0)
    phi_k = torch.nn.functional.elu(k) + 1.0  # [1, T, H, K]
    if varlen:
        want = torch.stack([z0[0, ..., 0] + phi_k[0, :2].sum(0), z0[1, ..., 0] + phi_k[0, 2:].sum(0)])
    else:
        want = z0[..., 0] + phi_k.sum(1)
    assert S.shape == (N, H, K, 1)
    torch.testing.assert_close(S[..., 0], want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_ring_and_blockwise_attention_refuse_a_non_finite_scale(bad):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="scale must be a finite number"):
        blockwise_attention(q, k, v, 2, scale=bad)
    with pytest.raises(ValueError, match="scale must be a finite number"):
        ring_attention(q, k, v, ring=ThreadRing.make(1)[0], scale=bad)


def test_ring_attention_refuses_a_scale_that_needs_a_gradient():
    """``float(scale)`` cut a learned scale off the graph: its gradient stayed ``None``."""
    q, k, v = _qkv()
    scale = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
    with pytest.raises(TypeError, match="scale"):
        ring_attention(q, k, v, ring=ThreadRing.make(1)[0], scale=scale)


def test_ring_attention_still_takes_a_number_or_a_plain_tensor_scale():
    """Two members (threads): equal to softmax attention at the same scale (float64, 1e-12)."""
    q, k, v = _qkv(T=6)
    want, _ = softmax_attention(q, k, v, scale=0.4)
    for scale in (0.4, torch.tensor(0.4, dtype=torch.float64)):
        rings, outs = ThreadRing.make(2), [None, None]

        def member(r, scale=scale, rings=rings, outs=outs):
            sl = slice(3 * r, 3 * r + 3)
            outs[r] = ring_attention(q[:, sl], k[:, sl], v[:, sl], ring=rings[r], scale=scale)

        threads = [threading.Thread(target=member, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        torch.testing.assert_close(torch.cat(outs, 1), want, rtol=1e-12, atol=1e-12)
