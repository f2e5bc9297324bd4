"""Break-it review of the capacity probe's recall metric (:mod:`mnemo.interp.capacity`) and of the
value attribution (:mod:`mnemo.memory.attribution`): each test failed on the code it was written
against; the hand computation pins the attribution after a persistent prefix (``start > 0``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mnemo.interp.capacity as cap
from mnemo.interp.capacity import capacity_variants, initial_weights, random_pairs, write_and_recall
from mnemo.memory import preset
from mnemo.memory.attribution import value_attribution

D = torch.float64


def _values(N=4, dtype=torch.float32, seed=0):
    return torch.randn(2, N, 1, 8, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def test_recall_is_scale_free_when_a_reads_norm_overflows():
    """A finite float32 read of size 1e30 squares past float32's range: its norm is inf, the
    normalised read was 0, every cosine 0, and ``argmax`` gave the read of pair 0 a hit (1/N)."""
    v = _values()
    assert torch.isfinite(v * 1e30).all()
    assert cap.recall_accuracy(v * 1e30, v).tolist() == [1.0, 1.0]
    assert cap.recall_accuracy(v * 1e-30, v).tolist() == [1.0, 1.0]  # (squares underflow to 0)


def test_a_non_finite_read_is_a_miss():
    v = _values()
    y = v.clone()
    y[:, 0, 0, 0] = float("inf")  # read 0 has an inf entry: NaN cosines, argmax 0, was a hit
    assert cap.recall_accuracy(y, v).tolist() == [0.75, 0.75]
    y[:, 0] = float("nan")
    assert cap.recall_accuracy(y, v).tolist() == [0.75, 0.75]


def test_non_finite_values_are_refused():
    v = _values()
    v[0, 2, 0, 1] = float("nan")  # a NaN column won every argmax: read 2 counted recalled
    with pytest.raises(ValueError, match="v: expected finite values"):
        cap.recall_accuracy(torch.zeros_like(v), v)


def test_a_read_as_near_another_value_is_a_miss():
    """Pairs 0 and 1 hold one value: the read of either is no nearer its own value than the other's
    (a tie); ``argmax`` gave the lower index the hit, so read 0 counted and read 1 did not."""
    v = _values()
    v[:, 1] = v[:, 0]
    assert cap.recall_accuracy(v.clone(), v).tolist() == [0.5, 0.5]
    assert cap.recall_accuracy(v[:, :1], v[:, :1]).tolist() == [1.0, 1.0]  # one pair: no rival


def test_an_inf_read_gives_nan_in_both_measures(monkeypatch):
    """``write_and_recall``: "a non-finite read gives ``nan`` in both" (an inf read gave nmse inf)."""
    real = cap.memory_apply

    def apply(spec, weights, x):
        y, a, b = real(spec, weights, x)
        y = y.clone()
        y[0, 0, 0, 0] = float("inf")  # stream 0, pair 0
        return y, a, b

    monkeypatch.setattr(cap, "memory_apply", apply)
    spec = capacity_variants()["matrix_plain"][0]
    g = torch.Generator().manual_seed(0)
    k, v = random_pairs(3, 4, 2, g, D)
    r = write_and_recall(spec, k, v, 0.5, initial_weights(spec, 4, 2, g, D))
    assert torch.isnan(r["recall"][0]) and torch.isnan(r["nmse"][0])
    assert torch.isfinite(r["recall"][1]) and torch.isfinite(r["nmse"][1])


def _delta_inputs(T=3, K=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(1, T, 1, K, generator=gen, dtype=D), dim=-1)
    k = F.normalize(torch.randn(1, T, 1, K, generator=gen, dtype=D), dim=-1)
    v = torch.randn(1, T, 1, K, generator=gen, dtype=D)
    theta = 0.2 + 0.6 * torch.rand(1, T, 1, generator=gen, dtype=D)
    return q, k, v, theta


@pytest.mark.parametrize("method", ["exact", "jacobian"])
def test_attribution_after_a_prefix_equals_the_hand_computed_delta_rule(method):
    """Three tokens of the delta rule from learned weights ``W₀``, token 0 a prefix (``start = 1``):
    ``W_t = (I − θ_t k_t k_tᵀ) W_{t−1} + θ_t k_t v_tᵀ``, ``o_t = W_tᵀ q_t``, so
    ``m_11 = θ₁ q₁·k₁``, ``m_21 = θ₁ q₂ᵀ(I − θ₂ k₂k₂ᵀ)k₁``, ``m_22 = θ₂ q₂·k₂``; the baseline is the read
    with ``v₁ = v₂ = 0`` (``W₀`` and the prefix's write kept), and ``maps @ values`` the rest."""
    q, k, v, theta = _delta_inputs()
    W0 = torch.tensor([[0.3, -0.2], [0.1, 0.4]], dtype=D)
    spec = preset("deltanet")
    a = value_attribution(spec, q, k, v, theta, initial_weights=[W0[None]], start=1, method=method)
    qq, kk, vv, th = q[0, :, 0], k[0, :, 0], v[0, :, 0], theta[0, :, 0]
    eye = torch.eye(2, dtype=D)
    m = torch.zeros(2, 2, dtype=D)
    m[0, 0] = th[1] * qq[1] @ kk[1]
    m[1, 0] = th[1] * qq[2] @ (eye - th[2] * torch.outer(kk[2], kk[2])) @ kk[1]
    m[1, 1] = th[2] * qq[2] @ kk[2]
    assert torch.allclose(a.maps[0, 0], m, atol=1e-12)

    def read(vals):
        W, out = W0.clone(), []
        for t in range(3):
            W = (eye - th[t] * torch.outer(kk[t], kk[t])) @ W + th[t] * torch.outer(kk[t], vals[t])
            out.append(W.T @ qq[t])
        return torch.stack(out)

    base = read(torch.stack([vv[0], torch.zeros(2, dtype=D), torch.zeros(2, dtype=D)]))[1:]
    assert torch.allclose(a.baseline[0, :, 0], base, atol=1e-12)
    assert torch.allclose(a.output[0, :, 0], read(vv)[1:] - base, atol=1e-12)
    assert a.map_error() < 1e-12 and a.completeness_error() < 1e-12


@pytest.mark.parametrize("method", ["exact", "jacobian"])
def test_a_start_outside_the_stream_is_refused_naming_it(method):
    """``start = -1`` gave (exact) a 1×1 map of the last token, a raw reshape error (Jacobian);
    ``start > T`` an empty map or a negative-dimension error; a float start a slicing TypeError."""
    q, k, v, theta = _delta_inputs()
    spec = preset("deltanet")
    for bad in (-1, 4, 1.5, True):
        with pytest.raises(ValueError, match=r"start must be an int in \[0, 3\], got"):
            value_attribution(spec, q, k, v, theta, start=bad, method=method)
    a = value_attribution(spec, q, k, v, theta, start=3, method=method)  # nothing left to attribute
    assert a.maps.shape == (1, 1, 0, 0)


def test_integration_steps_must_be_a_positive_int():
    q, k, v, theta = _delta_inputs()
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="steps must be an int >= 1"):
            value_attribution(preset("deltanet"), q, k, v, theta, steps=bad, method="jacobian")


def test_a_theta_above_a_variants_max_lr_is_refused():
    """Such a θ is clamped to ``max_lr``: two grid values ran the same memory and the cell
    recorded a θ it never used (``theta: 100`` for a run at 10)."""
    variants = {"matrix_plain": capacity_variants(max_lr=10.0)["matrix_plain"]}
    with pytest.raises(
        ValueError, match=r"theta_grid: expected values ≤ the max_lr 10 of variant 'matrix_plain'"
    ):
        cap.capacity_sweep(variants, [4], theta_grid=[1.0, 100.0], streams=2, progress=False)
