"""Ring attention (mnemo/ops/ring_attention.py): the blockwise online-softmax merge equals plain
softmax attention, and the ring's custom forward/backward, run by a ring of threads in one process,
equals :func:`~mnemo.ops.softmax_attention` in outputs and gradients (float64, to rounding).
The same ring over gloo processes is checked at model level in tests/train/test_ring_attention_cp.py."""

from __future__ import annotations

import threading

import pytest
import torch

from mnemo.ops import softmax_attention
from mnemo.ops.ring_attention import (
    ThreadRing,
    _attend_block,
    _merge,
    blockwise_attention,
    current_ring,
    ring_attention,
    ring_context,
)

CASES = [  # (H, Hkv, window)
    (2, 2, None),
    (4, 2, None),  # grouped-query heads
    (2, 1, 5),  # GQA + a window shorter than a block
    (2, 2, 9),  # a window spanning two blocks
]


def _qkv(B=2, T=12, H=2, Hkv=2, K=4, V=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(B, T, H, K, generator=g, dtype=torch.float64),
        torch.randn(B, T, Hkv, K, generator=g, dtype=torch.float64),
        torch.randn(B, T, Hkv, V, generator=g, dtype=torch.float64),
    )


def test_merging_blocks_in_any_order_equals_one_softmax():
    """Equation (1), independent of the ring: split the keys of one query block in three uneven
    parts, attend to each alone, merge in a shuffled order: equal to softmax over all keys."""
    q, k, v = _qkv(T=10)
    q5 = q[:, :4].reshape(2, 4, 2, 1, 4)
    parts = [(0, 3), (3, 4), (4, 10)]
    o = lse = None
    for a, b in [parts[2], parts[0], parts[1]]:
        o, lse = _merge(o, lse, *_attend_block(q5, k[:, a:b], v[:, a:b], 0.5, None))
    s = torch.einsum("bthk,bshk->bhts", q[:, :4], k) * 0.5
    want = torch.einsum("bhts,bshv->bthv", s.softmax(-1), v)
    torch.testing.assert_close(o.reshape(2, 4, 2, 3), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse[:, :, 0], torch.logsumexp(s, -1), rtol=1e-12, atol=1e-12)


def test_merging_fully_masked_rows_stays_finite():
    q, k, v = _qkv(T=4)
    q5 = q.reshape(2, 4, 2, 1, 4)
    none = torch.zeros(4, 4, dtype=torch.bool)
    o, lse = _merge(None, None, *_attend_block(q5, k, v, 0.5, none))
    assert torch.isneginf(lse).all() and (o == 0).all()
    o, lse = _merge(o, lse, *_attend_block(q5, k, v, 0.5, none))
    assert torch.isneginf(lse).all() and (o == 0).all()
    o, lse = _merge(o, lse, *_attend_block(q5, k, v, 0.5, None))
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()


@pytest.mark.parametrize("H, Hkv, window", CASES)
@pytest.mark.parametrize("n_blocks", [1, 3, 4])
def test_blockwise_equals_plain_attention(H, Hkv, window, n_blocks):
    q, k, v = _qkv(H=H, Hkv=Hkv)
    want, _ = softmax_attention(q, k, v, window=window)
    got = blockwise_attention(q, k, v, n_blocks, window=window)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def _run_ring(q, k, v, world, window):
    """Every member in its own thread: outputs and the gradients of ``Σ o ⊙ w``."""
    n = q.shape[1] // world
    w = torch.randn(q.shape[:3] + v.shape[3:], generator=torch.Generator().manual_seed(3), dtype=q.dtype)
    rings = ThreadRing.make(world)
    outs, errors = [None] * world, []

    def member(r):
        try:
            sl = slice(r * n, (r + 1) * n)
            qs, ks, vs = (t[:, sl].clone().requires_grad_() for t in (q, k, v))
            o = ring_attention(qs, ks, vs, ring=rings[r], window=window)
            (o * w[:, sl]).sum().backward()
            outs[r] = (o.detach(), qs.grad, ks.grad, vs.grad)
        except BaseException as e:  # surfaced in the main thread
            errors.append(e)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return [torch.cat(parts, 1) for parts in zip(*outs)], w


@pytest.mark.parametrize("H, Hkv, window", CASES)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_ring_forward_and_backward_equal_plain_attention(H, Hkv, window, world):
    q, k, v = _qkv(H=H, Hkv=Hkv)
    (o, dq, dk, dv), w = _run_ring(q, k, v, world, window)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    want, _ = softmax_attention(qr, kr, vr, window=window)
    (want * w).sum().backward()
    for name, a, b in (
        ("o", o, want.detach()),
        ("dq", dq, qr.grad),
        ("dk", dk, kr.grad),
        ("dv", dv, vr.grad),
    ):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


def test_ring_context_sets_and_restores_the_ring():
    (ring,) = ThreadRing.make(1)
    assert current_ring() is None
    with ring_context(ring):
        assert current_ring() is ring
    assert current_ring() is None


def test_bad_arguments_name_the_argument():
    q, k, v = _qkv(H=3, Hkv=2)
    (ring,) = ThreadRing.make(1)
    with pytest.raises(ValueError, match="multiple of the key/value heads, got H = 3 and Hkv = 2"):
        ring_attention(q, k, v, ring=ring)
    q, k, v = _qkv()
    with pytest.raises(
        ValueError, match=r"k must have shape \[B, n, Hkv, K\] = \[2, 12, Hkv, 4\], got \[2, 11, 2, 4\]"
    ):
        ring_attention(q, k[:, :11], v, ring=ring)
    with pytest.raises(ValueError, match="window must be None or a positive int, got 0"):
        ring_attention(q, k, v, ring=ring, window=0)
    with pytest.raises(ValueError, match="n_blocks must be a positive divisor of T = 12, got 5"):
        blockwise_attention(q, k, v, 5)


def test_bf16_autocast_keeps_float32_accumulation():
    """The docstring's promise (float32 accumulation) under an enclosing bf16 autocast: the ring's
    forward/backward and the blockwise form compute exactly what they compute without autocast
    (their einsums were cast to bfloat16: errors ~1e-2)."""
    q, k, v = (t.float() for t in _qkv(H=4, Hkv=2))
    w = torch.randn(q.shape[:3] + v.shape[3:], generator=torch.Generator().manual_seed(5))

    def run(autocast):
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            o = ring_attention(qr, kr, vr, ring=ThreadRing.make(1)[0], window=7)
            (o * w).sum().backward()
            ob = blockwise_attention(q, k, v, 3, window=7)
        return o.detach(), qr.grad, kr.grad, vr.grad, ob

    for name, a, b in zip(("o", "dq", "dk", "dv", "blockwise"), run(True), run(False)):
        assert a.dtype == torch.float32, name
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)
