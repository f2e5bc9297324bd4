"""The quadrature of integrated gradients (helper 45): the ``rule`` of
:func:`~mnemo.memory.attribution.attribute_read` and everything that passes ``steps`` down.

``c_ts = Σ_i w_i J_ts(α_i v) v_s`` integrates ``J(α v) v`` over ``α ∈ [0, 1]``; ``"midpoint"``
(the default) or ``"gauss_legendre"`` nodes. Measured on the five nonlinear presets of
tests/interp/test_ttt_maps.py (its ``_inputs(2)``, θ and g scaled by 0.1, initial weights from seeds
0–19, completeness error median / max over the 20 draws)::

    preset      n   midpoint median / max   Gauss-Legendre median / max
    titans      4   1.03e-01 / 1.51e+00     1.40e-01 / 5.19e+00
    titans      8   2.83e-02 / 1.87e+00     1.26e-02 / 4.36e+00
    titans     16   4.25e-03 / 1.03e+00     1.43e-04 / 8.96e-01
    ttt_mlp     4   6.30e-02 / 7.48e-01     9.32e-02 / 6.01e-01
    ttt_mlp     8   1.10e-02 / 5.58e-01     8.05e-03 / 1.00e+00
    ttt_mlp    16   2.04e-03 / 1.91e-01     5.85e-05 / 2.98e-01
    ttt_linear  4   9.10e-03 / 7.26e-02     3.12e-03 / 1.33e-01
    ttt_linear  8   2.21e-03 / 9.74e-03     7.88e-06 / 1.65e-02
    ttt_linear 16   5.33e-04 / 2.40e-03     3.63e-11 / 1.75e-04
    moneta      4   5.21e-01 / 2.20e+00     5.11e-01 / 2.14e+00
    moneta      8   1.93e-01 / 1.18e+00     2.23e-01 / 1.48e+00
    moneta     16   2.80e-02 / 3.64e-01     5.53e-02 / 6.13e-01
    memora      4   1.11e-01 / 1.14e+00     1.59e-01 / 9.46e-01
    memora      8   1.43e-02 / 3.99e-01     2.55e-02 / 5.66e-01
    memora     16   2.45e-03 / 4.96e-02     8.21e-04 / 1.55e-01

Gauss–Legendre is not better at every ``n`` for every preset, so midpoint stays the default. The
draws that stay above 0.1 at 16 steps have a read that nearly jumps along the path (titans, seed 4:
``|d o/dα|`` peaks at 300× its median near ``α = 0.67``), which neither rule resolves.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from mnemo.layers import NeuralMemory, SelfModifyingTitans
from mnemo.memory import preset
from mnemo.memory.attribution import (
    RULES,
    attribute_read,
    attribution_of_read,
    quadrature_nodes,
    value_attribution,
)
from tests.interp.test_ttt_maps import H, K, _inputs

F64 = torch.float64


def rel(a, b):
    return float((a - b).norm() / b.norm())


# --------------------------------------------------------------------------------------------------
# the rules' nodes and weights
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", range(1, 21))
def test_gauss_legendre_nodes_match_numpy(n):
    """Against numpy's ``leggauss`` (an independent implementation) mapped to ``[0, 1]``. Measured
    differences are ≤ 8e-16 for ``n ≤ 20`` (Golub–Welsch eigenvalues polished by Newton on ``P_n``,
    weights from ``P_n'``); 1e-13 leaves room for a different LAPACK, not for a wrong node."""
    a, w = quadrature_nodes(n, "gauss_legendre")
    assert a.dtype == w.dtype == F64 and a.shape == w.shape == (n,)
    x, omega = np.polynomial.legendre.leggauss(n)
    assert np.abs(a.numpy() - (x + 1) / 2).max() <= 1e-13
    assert np.abs(w.numpy() - omega / 2).max() <= 1e-13
    assert abs(float(w.sum()) - 1) <= 1e-14 and bool((w > 0).all())
    assert bool((a > 0).all() and (a < 1).all() and (a[1:] > a[:-1]).all())
    assert float((a + a.flip(0) - 1).abs().max()) <= 1e-15  # nodes symmetric about ½
    assert torch.equal(w, w.flip(0))  # symmetrised exactly
    # exact for polynomials of degree ≤ 2n − 1; on α^{2n} the error is the rule's closed form
    # (n!)⁴ / ((2n + 1) ((2n)!)²) (f^{(2n)} = (2n)!), above rounding for n ≤ 6 (≥ 6e-8)
    for m in range(2 * n):
        assert abs(float((w * a**m).sum()) - 1 / (m + 1)) <= 1e-14, (n, m)
    if n <= 6:
        err = 1 / (2 * n + 1) - float((w * a ** (2 * n)).sum())
        want = math.factorial(n) ** 4 / ((2 * n + 1) * math.factorial(2 * n) ** 2)
        assert abs(err - want) <= 1e-6 * want, (n, err, want)


@pytest.mark.parametrize("n", [1, 2, 5, 16])
def test_midpoint_nodes(n):
    a, w = quadrature_nodes(n, "midpoint")
    assert torch.equal(a, (torch.arange(n, dtype=F64) + 0.5) / n)
    assert torch.equal(w, torch.full((n,), 1 / n, dtype=F64))


# --------------------------------------------------------------------------------------------------
# known answer: a read that is a polynomial in the values
# --------------------------------------------------------------------------------------------------


def _poly_read(degrees):
    """``o_t = Σ_{s ≤ t} Σ_d v_s^d`` element-wise: causal, rows and heads independent, forward-AD-able;
    ``J_ts(α v) v_s = Σ_d d α^{d−1} v_s^d``, so ``c_ts = Σ_d d·Q(α^{d−1}) v_s^d`` for a rule ``Q``,
    and the exact integral gives ``c_ts = Σ_d v_s^d`` (baseline 0)."""

    def read(v):
        return sum(v**d for d in degrees).cumsum(1)

    return read


def _values(seed=0, shape=(2, 6, 2, 3)):
    gen = torch.Generator().manual_seed(seed)
    return 3 * torch.rand(*shape, generator=gen, dtype=F64) - 1.5  # |v| ≤ 1.5


def _expected(v, coef):
    """``c_ts = Σ_d coef[d] v_s^d`` for ``s ≤ t`` ``[B, H, T, T, V]``."""
    per_s = sum(c * v**d for d, c in coef.items()).transpose(1, 2)  # [B, H, S, V]
    T = v.shape[1]
    causal = torch.ones(T, T, dtype=F64).tril()[:, :, None]
    return per_s[:, :, None] * causal


# Tolerance: float64, |v| ≤ 1.5, at most 16 weighted terms and a 6-term cumsum; measured rounding is
# ~1e-16 relative. 1e-12 is 10⁴ above that and 10⁸ below the smallest quadrature error that must show
# (the smallest, d = 9 with 4 nodes, is 2.0e-4: the "not exact" branch below asserts ≥ 1e-4).
TOL = 1e-12


@pytest.mark.parametrize("d", range(2, 10))
def test_gauss_legendre_is_exact_on_polynomial_reads(d):
    """``read = cumsum(v^d)``: the integrand ``d α^{d−1} v^d`` has degree ``d − 1`` in ``α``, so
    ``n`` Gauss–Legendre nodes give complete contributions iff ``2n − 1 ≥ d − 1``."""
    v = _values(d)
    for n in range(2, 7):
        contrib, out, base = attribute_read(_poly_read([d]), v, steps=n, rule="gauss_legendre")
        assert float(base.abs().max()) == 0
        err = rel(contrib, _expected(v, {d: 1.0}))
        a = attribution_of_read(_poly_read([d]), v, steps=n, rule="gauss_legendre")
        if 2 * n - 1 >= d - 1:
            assert err <= TOL and a.completeness_error() <= TOL, (d, n, err)
        else:
            assert err >= 1e-4 and a.completeness_error() >= 1e-4, (d, n, err)


def test_polynomial_read_closed_forms():
    """``read = cumsum(v⁵ + v³ + v²)``; the rules' errors computed by hand.

    Midpoint, ``n`` nodes ``(i + ½)/n`` (Faulhaber's sums, checked in exact arithmetic below):
    ``Q(α) = ½`` (exact), ``Q(α²) = ⅓ − 1/(12n²)``, ``Q(α⁴) = ⅕ − 1/(6n²) + 7/(240n⁴)``, so
    ``c_ts = v² + (1 − 1/(4n²)) v³ + (1 − 5/(6n²) + 7/(48n⁴)) v⁵``.
    Gauss–Legendre, ``n = 2`` (nodes ``½ ± 1/(2√3)``, weights ½): exact to degree 3,
    ``Q(α⁴) = 1/16 + 6·¼·1/12 + 1/144 = 7/36``, so ``c_ts = v² + v³ + (35/36) v⁵``; ``n ≥ 3``: exact.
    ``steps = 1``: gradient × input at ``α = 1``, ``c_ts = 2v² + 3v³ + 5v⁵`` under either rule."""
    for n in range(1, 9):  # the hand-derived midpoint sums, in exact arithmetic
        mid = [Fraction(2 * i + 1, 2 * n) for i in range(n)]
        assert sum(a**2 for a in mid) / n == Fraction(1, 3) - Fraction(1, 12 * n * n)
        assert sum(a**4 for a in mid) / n == Fraction(1, 5) - Fraction(1, 6 * n * n) + Fraction(7, 240 * n**4)
    read = _poly_read([2, 3, 5])
    v = _values(1)
    exact = {2: 1.0, 3: 1.0, 5: 1.0}
    for n in (2, 3, 4, 8, 16):
        mid = {2: 1.0, 3: 1 - 1 / (4 * n * n), 5: 1 - 5 / (6 * n * n) + 7 / (48 * n**4)}
        a = attribution_of_read(read, v, steps=n, rule="midpoint")
        assert rel(a.contributions, _expected(v, mid)) <= TOL, n
        # its completeness error is the closed form's: ‖Σ_s (c_ts − exact)‖ / ‖o_t − b_t‖
        want = rel(_expected(v, mid).sum(3).transpose(1, 2), a.output)
        assert abs(a.completeness_error() - want) <= TOL * want, n
        assert a.completeness_error() > 1e-3 / n**2  # O(1/n²), never exact on v³ and v⁵
        gl = attribution_of_read(read, v, steps=n, rule="gauss_legendre")
        assert rel(gl.contributions, _expected(v, {2: 1.0, 3: 1.0, 5: 35 / 36} if n == 2 else exact)) <= TOL
        if n >= 3:
            assert gl.completeness_error() <= TOL
    for rule in RULES:
        c, _, _ = attribute_read(read, v, steps=1, rule=rule)
        assert rel(c, _expected(v, {2: 2.0, 3: 3.0, 5: 5.0})) <= TOL


# --------------------------------------------------------------------------------------------------
# validation; steps = 1; the layers
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["simpson", "Midpoint", "", None, 1])
def test_rule_is_validated_with_a_clear_message(bad):
    msg = rf"rule must be 'gauss_legendre' or 'midpoint', got {bad!r}"
    v = _values()
    with pytest.raises(ValueError, match=msg):
        attribute_read(_poly_read([2]), v, steps=4, rule=bad)
    with pytest.raises(ValueError, match="rule must be"):
        attribution_of_read(_poly_read([2]), v, steps=1, rule=bad)  # checked even where unused
    with pytest.raises(ValueError, match="rule must be"):
        quadrature_nodes(3, bad)
    q, k, vv, theta, g, eta = _inputs(0)
    with pytest.raises(ValueError, match="rule must be"):
        value_attribution(preset("titans", chunk_size=4), q, k, vv, theta, steps=2, rule=bad)


def test_one_step_is_gradient_times_input_under_either_rule():
    spec = preset("titans", chunk_size=4)
    q, k, v, theta, g, eta = _inputs(3)
    gen = torch.Generator().manual_seed(0)
    w0 = [torch.randn(H, i, o, dtype=F64, generator=gen) * i**-0.5 for i, o in spec.layer_dims(K, K)]
    kw = dict(g=g, eta=eta, initial_weights=w0, steps=1)
    a, b = (value_attribution(spec, q, k, v, theta, rule=r, **kw) for r in RULES)
    assert torch.equal(a.contributions, b.contributions) and torch.equal(a.maps, b.maps)


def test_layers_thread_the_rule():
    """``rule=`` and the ``attribution_rule`` attribute reach the quadrature; midpoint by default."""
    torch.manual_seed(0)
    x = torch.randn(1, 5, 16, dtype=F64)
    layers = [
        NeuralMemory(16, n_heads=2, spec="titans").double(),
        SelfModifyingTitans(16, n_heads=2, chunk_size=4, proj_chunk_size=3).double(),
    ]
    for m in layers:
        assert m.attribution_rule == "midpoint"
        acts = m.mixing_acts(x)
        mid = m.attribution(acts, steps=3)
        assert torch.equal(mid.contributions, m.attribution(acts, steps=3, rule="midpoint").contributions)
        gl = m.attribution(acts, steps=3, rule="gauss_legendre")
        assert not torch.equal(gl.contributions, mid.contributions)
        m.attribution_rule = "gauss_legendre"
        assert torch.equal(m.attribution(acts, steps=3).contributions, gl.contributions)
        with pytest.raises(ValueError, match="rule must be"):
            m.attribution(acts, steps=3, rule="trapezoid")


# --------------------------------------------------------------------------------------------------
# completeness over draws of the initial weights (the claim of test_ttt_maps' integration test)
# --------------------------------------------------------------------------------------------------


def _errors(name, seeds, steps, rule="midpoint"):
    """Completeness errors at ``steps`` for each weight seed, as test_ttt_maps' integration test
    draws them; the seeds run as one batch (per-row initial weights ``[B, H, in, out]``; equal to
    separate runs to 3e-16 relative)."""
    spec = preset(name, chunk_size=4)
    q, k, v, theta, g, eta = _inputs(2)
    theta, g = 0.1 * theta, 0.1 * g
    S, B = len(seeds), q.shape[0]
    ws = []
    for seed in seeds:
        gen = torch.Generator().manual_seed(seed)
        ws.append(
            [torch.randn(H, i, o, dtype=F64, generator=gen) * i**-0.5 for i, o in spec.layer_dims(K, K)]
        )
    w0 = [torch.stack([w[j] for w in ws]).repeat_interleave(B, 0) for j in range(len(ws[0]))]

    def rep(x):
        return x.repeat(S, *([1] * (x.ndim - 1)))

    kw = dict(g=rep(g) if spec.decays else None, eta=rep(eta) if spec.optimizer == "momentum" else None)
    a = value_attribution(
        spec, rep(q), rep(k), rep(v), rep(theta), initial_weights=w0, steps=steps, rule=rule,
        max_rows=1 << 14, **kw,
    )  # fmt: skip
    diff = (a.contributions.sum(3).transpose(1, 2) - a.output).reshape(S, -1)
    return diff.norm(dim=1) / a.output.reshape(S, -1).norm(dim=1)


def test_ttt_linear_is_complete_for_every_weight_draw():
    """The cheap member of the claim (under 1 s): ttt_linear at 16 midpoint steps is under 0.1 for all 20
    draws with 40× margin (measured max 2.4e-3), and 16 Gauss–Legendre nodes are better on every draw
    (max 1.75e-4)."""
    mid = _errors("ttt_linear", range(20), 16)
    gl = _errors("ttt_linear", range(20), 16, "gauss_legendre")
    assert float(mid.max()) < 0.01, mid
    assert bool((gl < mid).all()) and float(gl.max()) < 1e-3, gl


# measured at 16 midpoint steps, 20 draws: (draws under 0.1, median, max)
#   titans 16/20 4.3e-3 1.03 | ttt_mlp 19/20 2.0e-3 0.19 | ttt_linear 20/20 5.3e-4 2.4e-3
#   moneta 13/20 2.8e-2 0.36 | memora 20/20 2.5e-3 0.050
# "under 0.1 for every draw" holds for ttt_linear (40× margin) and memora (2×) only; the counts are
# lower bounds with margin on the passing side (the largest draw counted, moneta's 0.082, is 18% under;
# the next is 0.120). The median is under 0.05 for every preset (worst: moneta 0.028). Neither rule
# makes every draw complete at 16 steps (Gauss–Legendre: titans 15, moneta 13, memora 17 of 20).
UNDER = {"titans": 16, "ttt_mlp": 19, "ttt_linear": 20, "moneta": 13, "memora": 20}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(UNDER))
def test_integration_completeness_over_weight_draws(name):
    """What holds of "16 steps bring the completeness error under 0.1" over 20 draws of the initial
    weights (about 40 s for the five presets on 2 cores; the pinned draw in test_ttt_maps and
    test_ttt_linear_is_complete_for_every_weight_draw run by default)."""
    e16 = _errors(name, range(20), 16)
    e4 = _errors(name, range(20), 4)
    assert int((e16 < 0.1).sum()) >= UNDER[name], e16
    assert float(e16.median()) < 0.05, e16
    # more steps help on (nearly) every draw: titans' seed 12 (1.03 at 16 steps, 0.31 at 4) is the exception
    assert int((e16 < e4).sum()) >= (19 if name == "titans" else 20), (e4, e16)
