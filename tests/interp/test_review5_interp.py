"""Fifth break-it review of the hooks and mnemo.interp: the spectrum of TTT-Linear against a hand
Jacobian (the short-length bias of its exponents), and the probes' numbers against closed forms."""

from __future__ import annotations

import pytest
import torch

from mnemo.interp.lyapunov import memory_jvp_spectrum
from mnemo.memory.spec import MemorySpec
from mnemo.memory.state import init_state

LN_EPS = 1e-5  # the layer norm's epsilon of x + LN(W x)


def _ttt_linear(C=4):
    return MemorySpec(objective="l2", retention="none", residual=True, norm=True, chunk_size=C)


def _inputs(T, d=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, T, 1, d, generator=gen, dtype=torch.float64) for _ in range(3))
    theta = 0.01 + 0.04 * torch.rand(1, T, 1, generator=gen, dtype=torch.float64)
    return q, k, v, theta


# --- part 1: the TTT-Linear exponents -------------------------------------------------------------


@pytest.mark.parametrize("method", ["central", "forward"])
def test_ttt_linear_first_chunk_exponents_are_the_hand_jacobian_at_w_zero(method):
    """At ``W = 0`` the layer norm is linear, ``LN(z) = P z / √ε`` (``P`` the centring projector),
    so one chunk's state Jacobian is ``δW ↦ δW − M δW P / ε`` with ``M = Σ_t θ_t k_t k_tᵀ``: its
    eigenvalues are ``1 − μ_j / ε`` (``d − 1`` times each) and ``1``. The sum of all exponents over
    one chunk is ``log |det J|``, here ``≈ 60`` nats: TTT-Linear's large positive exponents are a
    true property of its state map at the zero start, not a wrong normalisation."""
    d, C = 4, 4
    spec = _ttt_linear(C)
    q, k, v, theta = _inputs(C, d)
    state = init_state(spec, [torch.zeros(1, 1, d, d, dtype=torch.float64)])
    lam, n = memory_jvp_spectrum(spec, state, q, k, v, theta, directions=d * d, method=method)
    assert n == d * d and lam.shape == (1, d * d)
    M = torch.einsum("t,ti,tj->ij", theta[0, :, 0], k[0, :, 0], k[0, :, 0])
    mu = torch.linalg.eigvalsh(M)
    log_det = (d - 1) * (1 - mu / LN_EPS).abs().log().sum()
    assert float(lam.sum() * C) == pytest.approx(float(log_det), rel=1e-6)
    # the largest exponent is at most the log of the largest stretch (σ_max = max |1 − μ/ε|) per token
    assert float(lam.max()) <= float((mu.max() / LN_EPS - 1).log()) / C + 1e-9


def test_ttt_linear_short_length_bias_is_one_transient_and_burn_in_removes_it():
    """The first chunk's stretch counts once, so ``λ · T`` stays the same as ``T`` grows (``λ ≈
    10/T``: "relevant" at any ``context = T``); skipping that chunk (``burn_in=1``) gives the long-run
    rate, ≈ 0 (no retention: nothing is forgotten)."""
    spec = _ttt_linear(4)
    d = 4
    totals, after = [], []
    for T in (8, 16, 32):
        q, k, v, theta = _inputs(T, d, seed=1)
        first = (q[:, :4], k[:, :4], v[:, :4], theta[:, :4])
        state = init_state(spec, [torch.zeros(1, 1, d, d, dtype=torch.float64)])
        lam, _ = memory_jvp_spectrum(spec, state, *first, directions=3)
        lam_T, _ = memory_jvp_spectrum(spec, state, q, k, v, theta, directions=3)
        late, _ = memory_jvp_spectrum(spec, state, q, k, v, theta, directions=3, burn_in=1)
        totals.append((float(lam_T[0, 0]) * T, float(lam[0, 0]) * 4))
        after.append(float(late.abs().max()))
    assert all(t[0] > 5 for t in totals)  # a large stretch ...
    for tot, first in totals:  # ... all of it from the first chunk
        assert tot == pytest.approx(first, abs=0.05 * abs(first))
    assert max(after) < 0.05 * min(t[0] for t in totals) / 32


@pytest.mark.parametrize("bad", [-1, 2, 1.0, True])
def test_memory_jvp_spectrum_burn_in_out_of_range_is_named(bad):
    spec = _ttt_linear(4)
    q, k, v, theta = _inputs(8)
    state = init_state(spec, [torch.zeros(1, 1, 4, 4, dtype=torch.float64)])
    with pytest.raises(ValueError, match=r"burn_in: expected an int number of inner chunks in \[0, 2\)"):
        memory_jvp_spectrum(spec, state, q, k, v, theta, directions=2, burn_in=bad)


# --- part 2 ---------------------------------------------------------------------------------------


def test_a_starting_basis_with_too_few_columns_is_refused_not_broadcast():
    """``q0`` of shape ``[n, 1]`` with ``k = n`` made the sums ``[n]`` add ``[1]``-wide logs: three
    copies of the leading exponent came back, ``[-0.69, -0.69, -0.69]`` for ``diag(1/2, 1/4, 1/8)``."""
    from mnemo.interp.lyapunov import matrix_spectrum

    A = torch.diag(torch.tensor([0.5, 0.25, 0.125], dtype=torch.float64)).expand(10, 3, 3)
    with pytest.raises(ValueError, match=r"q0: expected a starting basis of shape .*\[3, 3\].*got \[3, 1\]"):
        matrix_spectrum(A, q0=torch.eye(3, dtype=torch.float64)[:, :1])


def test_a_scaled_or_skewed_starting_basis_gives_the_exact_exponents():
    """A starting basis that is not orthonormal added its own log-stretch to the first step: ``2·I``
    moved every exponent of ``diag(1/2, 1/4, 1/8)`` by ``ln 2 / T`` (−0.6238 for −0.6931 at T = 10).
    The exponents of a diagonal map are ``log`` of its diagonal exactly."""
    from mnemo.interp.lyapunov import matrix_spectrum

    d = torch.tensor([0.5, 0.25, 0.125], dtype=torch.float64)
    A = torch.diag(d).expand(10, 3, 3)
    want = d.log()
    skew = torch.tensor([[2.0, 1.0, 0.5], [0.0, 3.0, -1.0], [0.0, 0.0, 0.5]], dtype=torch.float64)
    for q0 in (2 * torch.eye(3, dtype=torch.float64), skew):
        torch.testing.assert_close(matrix_spectrum(A, q0=q0), want, rtol=0, atol=1e-13)
    # a basis shared over the batch broadcasts; a batched one is taken per row
    batched = torch.stack([A, A.flip(-1).flip(-2)])  # diag(1/8, 1/4, 1/2) in row 1
    got = matrix_spectrum(batched, q0=skew)
    torch.testing.assert_close(got, want.expand(2, 3), rtol=0, atol=1e-13)


def test_memory_jvp_spectrum_refuses_a_mid_stream_state_it_would_treat_as_fresh():
    """The iteration's chunks start at token 0 and each step rebuilt the state at position ``t0``
    with its anchors at the weights: a state from the middle of a stream (position 5, inside a chunk
    of 4, anchored at other weights) was taken as a fresh one without a word."""
    from mnemo.memory.recurrent import memory_recurrent

    spec = _ttt_linear(4)
    q, k, v, theta = _inputs(13, seed=2)
    state = init_state(spec, [torch.zeros(1, 1, 4, 4, dtype=torch.float64)])
    _, mid = memory_recurrent(spec, q[:, :5], k[:, :5], v[:, :5], theta[:, :5], None, None, None, state)
    assert mid.position == 5
    rest = (q[:, 5:], k[:, 5:], v[:, 5:], theta[:, 5:])
    with pytest.raises(ValueError, match=r"state: expected the memory's state at position 0.*position 5"):
        memory_jvp_spectrum(spec, mid, *rest, directions=2)


@pytest.mark.parametrize("bad", ["2", float("nan"), float("inf"), True, None])
def test_steer_names_a_scale_that_is_not_a_finite_number(bad):
    """``steer(..., scale="2")`` failed at run time with torch's unnamed ``TypeError: only integer
    tensors of a single element can be converted to an index``; a NaN scale made the run fail far
    downstream (a non-finite ``q``)."""
    from mnemo.interp.interventions import steer
    from mnemo.models import LanguageModel, build_config

    m = LanguageModel(build_config("gla", vocab_size=23, d_model=16, n_layers=1)).eval()
    with pytest.raises(ValueError, match=r"scale: expected a finite real number"):
        steer(m, "blocks.0.hook_resid_pre", torch.ones(16), scale=bad)


def test_steer_at_one_position_is_the_hand_sum_and_a_0d_tensor_scale_works():
    from mnemo.interp.interventions import steer
    from mnemo.models import LanguageModel, build_config

    torch.manual_seed(0)
    m = LanguageModel(build_config("gla", vocab_size=23, d_model=16, n_layers=1)).eval().double()
    ids = torch.randint(0, 23, (2, 7), generator=torch.Generator().manual_seed(3))
    d = torch.randn(16, dtype=torch.float64)

    def by_hand(value, name):
        value = value.clone()
        value[:, 4] += 0.5 * d
        return value

    with torch.no_grad():
        want, _ = m.run_with_hooks(ids, [("blocks.0.hook_resid_pre", by_hand)])
        got, _ = m.run_with_hooks(
            ids, steer(m, "blocks.0.hook_resid_pre", d, scale=torch.tensor(0.5), positions=[4])
        )
        plain, _ = m(ids)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(got[:, :4], plain[:, :4]) and not torch.equal(got[:, 4], plain[:, 4])
