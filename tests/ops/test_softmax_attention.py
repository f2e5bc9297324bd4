"""Softmax attention: SDPA form vs the token-loop reference, GQA, windows, KV cache, packing."""

from __future__ import annotations

import pytest
import torch
from einops import repeat

from mnemo.ops import KVCache, softmax_attention
from tests.helpers import assert_close

TOL = 1e-10


def _inputs(B=2, T=19, H=4, Hkv=2, K=8, V=6, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(B, T, H, K, generator=g, dtype=dtype),
        torch.randn(B, T, Hkv, K, generator=g, dtype=dtype),
        torch.randn(B, T, Hkv, V, generator=g, dtype=dtype),
    )


def _naive(q, k, v, causal=True, window=None):
    """Independent dense reference: explicit scores and mask over the whole sequence."""
    B, T, H, K = q.shape
    G = H // k.shape[2]
    k, v = repeat(k, "b t h d -> b t (h g) d", g=G), repeat(v, "b t h d -> b t (h g) d", g=G)
    s = torch.einsum("bthd,bshd->bhts", q, k) * K**-0.5
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    allowed = torch.ones(T, T, dtype=torch.bool)
    if causal:
        allowed &= j <= i
    if window is not None:
        allowed &= (i - j < window) if causal else ((i - j).abs() < window)
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.einsum("bhts,bshd->bthd", s.softmax(-1), v)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [None, 1, 4])
@pytest.mark.parametrize("Hkv", [4, 2, 1])
@pytest.mark.parametrize("mode", ["parallel", "recurrent"])
def test_matches_dense_reference(causal, window, Hkv, mode):
    q, k, v = _inputs(Hkv=Hkv)
    o, _ = softmax_attention(q, k, v, causal=causal, window=window, mode=mode)
    assert_close(o, _naive(q, k, v, causal, window), TOL)


def test_gqa_equals_repeated_heads():
    q, k, v = _inputs(H=6, Hkv=2)
    o, _ = softmax_attention(q, k, v)
    o_mha, _ = softmax_attention(
        q, repeat(k, "b t h d -> b t (h g) d", g=3), repeat(v, "b t h d -> b t (h g) d", g=3)
    )
    assert_close(o, o_mha, TOL)


@pytest.mark.parametrize("window", [None, 3, 8])
def test_kv_cache_decoding_equals_full(window):
    q, k, v = _inputs(T=17)
    full, _ = softmax_attention(q, k, v, window=window)
    outs = []
    o, cache = softmax_attention(q[:, :5], k[:, :5], v[:, :5], window=window, output_final_state=True)
    outs.append(o)
    for t in range(5, 11):  # one token at a time
        o, cache = softmax_attention(
            q[:, t : t + 1],
            k[:, t : t + 1],
            v[:, t : t + 1],
            window=window,
            initial_state=cache,
            output_final_state=True,
        )
        outs.append(o)
        if window is not None:
            assert cache.k.shape[1] <= window - 1
    o, cache = softmax_attention(
        q[:, 11:], k[:, 11:], v[:, 11:], window=window, initial_state=cache, output_final_state=True
    )  # then a multi-token chunk
    outs.append(o)
    assert_close(torch.cat(outs, 1), full, TOL)
    assert isinstance(cache, KVCache)


@pytest.mark.parametrize("mode", ["parallel", "recurrent"])
def test_cache_forms_agree(mode):
    q, k, v = _inputs(T=9)
    cache = KVCache(*_inputs(T=7, seed=3)[1:])
    o_ref, c_ref = softmax_attention(q, k, v, initial_state=cache, output_final_state=True, mode="recurrent")
    o, c = softmax_attention(q, k, v, initial_state=cache, output_final_state=True, mode=mode)
    assert_close(o, o_ref, TOL)
    assert torch.equal(c.k, c_ref.k) and c.k.shape[1] == 16


def test_gradients_agree_between_forms():
    def grads(mode):
        q, k, v = (t.requires_grad_(True) for t in _inputs(T=11))
        o, _ = softmax_attention(q, k, v, window=5, mode=mode)
        (o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)).sum().backward()
        return q.grad, k.grad, v.grad

    for a, b in zip(grads("parallel"), grads("recurrent")):
        assert_close(a, b, TOL)


@pytest.mark.parametrize("window", [None, 3])
def test_packed_sequences_equal_separate(window):
    lengths = [5, 1, 9]
    parts = [_inputs(B=1, T=L, seed=i) for i, L in enumerate(lengths)]
    q, k, v = (torch.cat([p[j] for p in parts], 1) for j in range(3))
    cu = torch.tensor([0, 5, 6, 15])
    o, _ = softmax_attention(q, k, v, window=window, cu_seqlens=cu)
    ref = torch.cat([softmax_attention(*p, window=window)[0] for p in parts], 1)
    assert_close(o, ref, TOL)


def test_bf16_runs_and_stays_close():
    q, k, v = _inputs(T=64, dtype=torch.float32)
    o32, _ = softmax_attention(q, k, v)
    o16, _ = softmax_attention(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert o16.dtype == torch.bfloat16
    assert_close(o16.float(), o32, 2e-2)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"H": 3, "Hkv": 2}, "multiple of the key/value heads"),
    ],
)
def test_bad_head_counts(kwargs, match):
    q, k, v = _inputs(**kwargs)
    with pytest.raises(ValueError, match=match):
        softmax_attention(q, k, v)


def test_bad_inputs_name_the_argument():
    q, k, v = _inputs()
    with pytest.raises(ValueError, match=r"k must have shape \[B, T, Hkv, K\]"):
        softmax_attention(q, k[:, :-1], v)
    with pytest.raises(ValueError, match=r"v must have shape"):
        softmax_attention(q, k, v[:, :, :1])
    with pytest.raises(ValueError, match="window"):
        softmax_attention(q, k, v, window=0)
    with pytest.raises(ValueError, match="mode must be one of"):
        softmax_attention(q, k, v, mode="chunk")
    with pytest.raises(ValueError, match="initial_state.k"):
        softmax_attention(q, k, v, initial_state=KVCache(k[:, :, :1], v))
    with pytest.raises(ValueError, match="not supported with cu_seqlens"):
        softmax_attention(q[:1], k[:1], v[:1], cu_seqlens=torch.tensor([0, 19]), output_final_state=True)


@pytest.mark.parametrize("window", [1, 5, 12])
@pytest.mark.parametrize("Hkv", [4, 2])
def test_blockwise_sliding_window_equals_dense(window, Hkv, monkeypatch):
    """Long sequences with a window run in query blocks (O(T · window)); force small blocks."""
    import importlib

    sa = importlib.import_module("mnemo.ops.softmax_attention")  # the module, not the function
    monkeypatch.setattr(sa, "WINDOW_BLOCK", 7)
    q, k, v = _inputs(T=40, Hkv=Hkv)
    o, _ = softmax_attention(q, k, v, window=window)
    assert_close(o, _naive(q, k, v, True, window), TOL)
    cache = KVCache(*_inputs(T=9, Hkv=Hkv, seed=5)[1:])
    o2, _ = softmax_attention(q, k, v, window=window, initial_state=cache)
    ref, _ = softmax_attention(q, k, v, window=window, initial_state=cache, mode="recurrent")
    assert_close(o2, ref, TOL)


def test_the_map_with_a_cache_is_what_the_op_multiplies_the_values_by():
    """softmax_attention_map over ``S = P + T`` keys (``P`` cached) reproduces the op's output with
    that cache as its state; with all-zero queries each row is uniform over the visible keys."""
    from einops import einsum, repeat

    from mnemo.ops import KVCache, softmax_attention, softmax_attention_map

    g = torch.Generator().manual_seed(0)
    B, P, T, H, Hk, K = 2, 5, 4, 4, 2, 8
    q = torch.randn(B, T, H, K, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, P + T, Hk, K, generator=g, dtype=torch.float64) for _ in range(2))
    o, _ = softmax_attention(q, k[:, P:], v[:, P:], initial_state=KVCache(k[:, :P], v[:, :P]))
    for window in (None, 3):
        M = softmax_attention_map(q, k, window=window)
        assert M.shape == (B, H, T, P + T)
        if window is None:
            got = einsum(M, repeat(v, "b s h d -> b s (h g) d", g=H // Hk), "b h t s, b s h d -> b t h d")
            torch.testing.assert_close(got, o, rtol=1e-12, atol=1e-12)
        visible = [min(P + t + 1, window or P + T) for t in range(T)]
        U = softmax_attention_map(torch.zeros_like(q), k, window=window)
        for t, n in enumerate(visible):
            row = U[:, :, t]
            torch.testing.assert_close(
                row[..., P + t + 1 - n : P + t + 1], torch.full_like(row[..., :n], 1 / n)
            )
            assert float(row.sum(-1).sub(1).abs().max()) < 1e-12
