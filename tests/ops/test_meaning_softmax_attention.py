"""Softmax attention on inputs with answers known in closed form: equal scores average the visible
values, one dominant key copies its value, grouped heads read their own key/value head, caches keep
what the window can still see; malformed caches are refused."""

from __future__ import annotations

import pytest
import torch

from mnemo.ops import KVCache, softmax_attention
from mnemo.ops.softmax_attention import attention_mask

MODES = ("parallel", "recurrent")


def _running_mean(v, window=None):
    """o_i = mean of v_j over the visible keys j (causal, the last ``window`` of them)."""
    T = v.shape[1]
    out = torch.empty_like(v)
    for i in range(T):
        lo = 0 if window is None else max(0, i - window + 1)
        out[:, i] = v[:, lo : i + 1].mean(1)
    return out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("window", [None, 1, 3])
def test_equal_scores_average_the_visible_values(mode, window):
    v = torch.randn(2, 6, 2, 3, dtype=torch.float64)
    q = k = torch.zeros(2, 6, 2, 4, dtype=torch.float64)
    o, _ = softmax_attention(q, k, v, window=window, mode=mode)
    assert torch.allclose(o, _running_mean(v, window))
    o, _ = softmax_attention(q, k, v, causal=False, mode=mode)  # every key: the mean of all
    assert torch.allclose(o, v.mean(1, keepdim=True).expand_as(v))


@pytest.mark.parametrize("mode", MODES)
def test_scores_are_scaled_dot_products(mode):
    # two keys with scores s·(q·k): weights softmax([0, scale · 10]) on the second query
    q = torch.zeros(1, 2, 1, 4, dtype=torch.float64)
    q[0, 1, 0, 0] = 10.0
    k = torch.zeros(1, 2, 1, 4, dtype=torch.float64)
    k[0, 1, 0, 0] = 1.0
    v = torch.tensor([0.0, 1.0], dtype=torch.float64).reshape(1, 2, 1, 1)
    o, _ = softmax_attention(q, k, v, mode=mode)  # default scale K^-1/2 = 0.5
    w = torch.softmax(torch.tensor([0.0, 5.0], dtype=torch.float64), 0)
    assert o[0, 1, 0, 0].item() == pytest.approx(w[1].item())
    o, _ = softmax_attention(q, k, v, scale=0.1, mode=mode)
    w = torch.softmax(torch.tensor([0.0, 1.0], dtype=torch.float64), 0)
    assert o[0, 1, 0, 0].item() == pytest.approx(w[1].item())
    assert o[0, 0, 0, 0].item() == 0.0  # the first query sees only the first key


@pytest.mark.parametrize("mode", MODES)
def test_query_head_h_reads_key_value_head_h_over_group_size(mode):
    T, H, Hkv = 3, 4, 2
    q = torch.zeros(1, T, H, 2, dtype=torch.float64)
    k = torch.zeros(1, T, Hkv, 2, dtype=torch.float64)
    v = torch.stack([torch.full((1, T, 1), 10.0 * g + 1) for g in range(Hkv)], 2).double()  # [1,T,Hkv,1]
    o, _ = softmax_attention(q, k, v, mode=mode)
    for h in range(H):
        assert torch.all(o[0, :, h, 0] == 10.0 * (h // (H // Hkv)) + 1)


def test_attention_mask_allows_exactly_the_documented_keys():
    T, S = 3, 5  # queries at key positions 2, 3, 4
    m = attention_mask(T, S, window=2)
    expected = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(m, expected)
    assert torch.equal(attention_mask(T, S), torch.ones(T, S, dtype=torch.bool).tril(S - T))
    assert torch.equal(attention_mask(2, 2, causal=False, window=1), torch.eye(2, dtype=torch.bool))
    seg = torch.tensor([0, 0, 1, 1, 1])
    assert torch.equal(
        attention_mask(T, S, segment_ids=seg),
        expected.new_tensor([[0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]),
    )


@pytest.mark.parametrize("window", [None, 2, 4])
def test_final_cache_keeps_what_a_next_token_can_see(window):
    q, k, v = (torch.randn(1, 5, 2, 3, dtype=torch.float64) for _ in range(3))
    _, cache = softmax_attention(q, k, v, window=window, output_final_state=True)
    keep = 5 if window is None else window - 1
    assert torch.equal(cache.k, k[:, 5 - keep :]) and torch.equal(cache.v, v[:, 5 - keep :])
    # and decoding on from it sees the same keys as a full pass
    q1, k1, v1 = (torch.randn(1, 1, 2, 3, dtype=torch.float64) for _ in range(3))
    o1, _ = softmax_attention(q1, k1, v1, window=window, initial_state=cache)
    full, _ = softmax_attention(*(torch.cat(p, 1) for p in ((q, q1), (k, k1), (v, v1))), window=window)
    assert torch.allclose(o1[:, 0], full[:, -1])


def test_a_cache_with_misshaped_values_is_refused():
    q, k, v = (torch.randn(1, 2, 2, 3) for _ in range(3))
    with pytest.raises(ValueError, match="initial_state.v"):
        softmax_attention(q, k, v, initial_state=KVCache(torch.randn(1, 4, 2, 3), torch.randn(1, 3, 2, 3)))
    with pytest.raises(ValueError, match="initial_state.v"):
        softmax_attention(q, k, v, initial_state=KVCache(torch.randn(1, 4, 2, 3), torch.randn(1, 4, 2, 5)))
    with pytest.raises(TypeError, match="KVCache"):
        softmax_attention(q, k, v, initial_state=(torch.randn(1, 4, 2, 3),))


@pytest.mark.parametrize("window", [None, 3])
def test_long_queries_after_a_cache_average_every_visible_value(window, monkeypatch):
    """Queries in blocks (forced small) after a cache of 3 keys: equal scores average the visible
    values, the cached ones included."""
    import importlib

    sa = importlib.import_module("mnemo.ops.softmax_attention")
    monkeypatch.setattr(sa, "WINDOW_BLOCK", 4)
    P, T = 3, 9
    v_all = torch.randn(1, P + T, 1, 2, dtype=torch.float64)
    zeros = torch.zeros(1, P + T, 1, 2, dtype=torch.float64)
    cache = KVCache(zeros[:, :P], v_all[:, :P])
    o, _ = softmax_attention(zeros[:, P:], zeros[:, P:], v_all[:, P:], window=window, initial_state=cache)
    assert torch.allclose(o, _running_mean(v_all, window)[:, P:])
