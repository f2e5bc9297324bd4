"""The chunk forms' backward passes work on groups of heads (:func:`mnemo.ops._chunked.head_groups`):
the groups tile the flattened ``B · H`` heads exactly, and the gradients with one head per group
are those of a hand token loop of the ops' equations."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mnemo.ops import _chunked, delta_rule, gated_linear_attention
from tests.helpers import assert_close


@pytest.mark.parametrize("per_head", [1, _chunked.GROUP_BYTES // 2, _chunked.GROUP_BYTES_TUNED // 2, 1 << 30])
def test_head_groups_tile_the_flattened_heads(per_head):
    """Yields ``(b, h0, h1, i0, i1)`` with ``[i0, i1)`` the flat indices of heads ``h0:h1`` of row
    ``b``: here against ``arange(B·H).view(B, H)``; every head once, groups of equal size."""
    B, H = 3, 4
    flat = torch.arange(B * H).view(B, H)
    seen = []
    for b, h0, h1, i0, i1 in _chunked.head_groups(B, H, per_head):
        assert 0 <= h0 < h1 <= H
        assert list(range(i0, i1)) == flat[b, h0:h1].tolist()
        seen += flat[b, h0:h1].tolist()
    assert seen == list(range(B * H))
    if per_head >= _chunked.GROUP_BYTES_TUNED:  # over any budget: one head per group
        assert len(list(_chunked.head_groups(B, H, per_head))) == B * H


def _leaves(B, T, H, K, V, gate):
    g_ = torch.Generator().manual_seed(5)
    q = torch.randn(B, T, H, K, generator=g_, dtype=torch.float64)
    k = F.normalize(torch.randn(B, T, H, K, generator=g_, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, H, V, generator=g_, dtype=torch.float64)
    other = (
        torch.rand(B, T, H, generator=g_, dtype=torch.float64) * 0.8 + 0.1  # beta
        if gate is None
        else F.logsigmoid(torch.randn(B, T, H, K, generator=g_, dtype=torch.float64) + 1)  # g
    )
    return [x.requires_grad_() for x in (q, k, v, other)]


def _delta_loop(q, k, v, beta):
    """S_t = S_{t−1} + β_t k_t (v_t − S_{t−1}ᵀ k_t)ᵀ, o_t = S_tᵀ q_t / √K."""
    B, T, H, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1])
    outs = []
    for t in range(T):
        err = v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t])
        S = S + (beta[:, t, :, None] * k[:, t])[..., None] * err[..., None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]) / K**0.5)
    return torch.stack(outs, 1)


def _gla_loop(q, k, v, g):
    """S_t = diag(exp(g_t)) S_{t−1} + k_t v_tᵀ, o_t = S_tᵀ q_t / √K."""
    B, T, H, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1])
    outs = []
    for t in range(T):
        S = torch.exp(g[:, t])[..., None] * S + k[:, t, ..., None] * v[:, t, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]) / K**0.5)
    return torch.stack(outs, 1)


@pytest.mark.parametrize("op", ["delta_rule", "gla"])
def test_backward_with_one_head_per_group_matches_the_token_loop(op, monkeypatch):
    """A budget of 1 byte makes every head its own group (groups at flat offsets b·H + h0, h0 > 0)."""
    monkeypatch.setattr(_chunked, "GROUP_BYTES", 1)
    monkeypatch.setattr(_chunked, "GROUP_BYTES_TUNED", 1)
    B, T, H, K, V = 2, 7, 3, 3, 2
    gate = None if op == "delta_rule" else "channel"
    leaves = _leaves(B, T, H, K, V, gate)
    w = torch.randn(B, T, H, V, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    if op == "delta_rule":
        o, _ = delta_rule(*leaves, chunk_size=4, mode="chunk")
        ref = _delta_loop(*leaves)
    else:
        q, k, v, g = leaves
        o, _ = gated_linear_attention(q, k, v, g, chunk_size=4, mode="chunk")
        ref = _gla_loop(q, k, v, g)
    assert_close(o, ref, 1e-10)
    got = torch.autograd.grad((o * w).sum(), leaves)
    want = torch.autograd.grad((ref * w).sum(), leaves)
    for name, a, b in zip("qkvx", got, want):
        assert_close(a, b, 1e-9, what=f"d/d{name}")
