"""Leftovers of the last reviews (43d): TitansMAC's 0-token state as ``state_spec`` declares it; the
training tracker refuses a ``spectrum_burn_in`` that leaves a memory nothing to average;
``t_quantile``'s far tail solved in a few evaluations, at its accuracy."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch


def _fields(state, prefix=""):
    """``{field path: (shape, dtype)}`` of a state (``None`` for an unset field; ints as they are)."""
    out = {}
    for f in dataclasses.fields(state):
        v = getattr(state, f.name)
        if dataclasses.is_dataclass(v):
            out.update(_fields(v, f"{prefix}{f.name}."))
        elif isinstance(v, torch.Tensor):
            out[prefix + f.name] = (tuple(v.shape), v.dtype)
        elif isinstance(v, (list, tuple)):
            out[prefix + f.name] = [(tuple(t.shape), t.dtype) for t in v]
        else:
            out[prefix + f.name] = v
    return out


def test_titans_mac_zero_token_state_is_what_state_spec_declares():
    """``state_spec(B, 0)`` declared the conv tails ``[B, 3 H D, W − 1]`` and empty KV caches
    ``[B, 0, H_kv, D]``, while a 0-token call returned ``None`` for all six (and its byte count was
    short by the two tails); now the call returns zero tails and empty caches, field by field as
    declared, and a stream continued from it is the fresh stream."""
    from mnemo.layers.titans_architectures import TitansMAC

    torch.manual_seed(0)
    mac = TitansMAC(16, n_heads=2, segment=4)
    x = torch.randn(2, 5, 16)
    _, empty = mac(x[:, :0])
    assert _fields(empty) == _fields(mac.state_spec(2, 0))
    assert empty.read_conv is not None and empty.read_conv.abs().max() == 0
    assert empty.memory.conv.abs().max() == 0
    y_fresh, s_fresh = mac(x)
    y_cont, s_cont = mac(x, empty)
    torch.testing.assert_close(y_cont, y_fresh, rtol=0, atol=0)
    assert _fields(s_cont) == _fields(mac.state_spec(2, 5))


def _titans_model(chunk: int):
    from mnemo.models import LanguageModel, build_config

    torch.manual_seed(0)
    options = {"neural_memory": {"n_heads": 2, "spec": "titans", "persistent_tokens": 0, "chunk_size": chunk}}
    cfg = build_config("titans_lmm", vocab_size=20, d_model=16, n_layers=1, mixer_options=options)
    return LanguageModel(cfg).eval()


def test_tracker_refuses_a_burn_in_that_leaves_no_whole_chunk_naming_the_largest_value():
    """10 tokens in inner chunks of 4 (chunks 0–3, 4–7, 8–9): a burn-in of 9 skips all three
    chunks, and the tracker recorded the memory's spectrum as "unsupported" without a word; it now
    raises, naming ``spectrum_burn_in``, the window and the largest value, 8 (= 4 · (⌈10/4⌉ − 1)),
    which ``memory_spectrum`` itself measures (the independent check of that value)."""
    from mnemo.interp import CircuitTracker
    from mnemo.interp.spectrum import memory_spectrum

    model = _titans_model(chunk=4)
    tracker = CircuitTracker(length=4, batch=1, spectrum=True, spectrum_tokens=10, spectrum_burn_in=9)
    with pytest.raises(
        ValueError, match=r"spectrum_burn_in: 9 of the spectrum's 10 tokens.*largest value.* 8"
    ):
        tracker._spectrum(model)
    ids = torch.randint(0, 20, (1, 10), generator=torch.Generator().manual_seed(0))
    assert memory_spectrum(model, ids, directions=2, burn_in=9)["0"]["kind"] == "unsupported"
    assert memory_spectrum(model, ids, directions=2, burn_in=8)["0"]["kind"] == "test-time (JVP)"


def _t_quantile_mp(p: float, df: int) -> float:
    """``t_{p, df}`` for ``p < ½`` from mpmath's regularised incomplete beta at 40 digits:
    ``P(T > t) = I_{df/(df + t²)}(df/2, ½) / 2``, solved for ``log t``."""
    mpmath = pytest.importorskip("mpmath")
    with mpmath.workdps(40):

        def tail(u):
            t = mpmath.exp(u)
            return (
                mpmath.betainc(mpmath.mpf(df) / 2, mpmath.mpf(1) / 2, 0, df / (df + t * t), regularized=True)
                / 2
            )

        start = math.log(-_normal_start(p, df))
        u = mpmath.findroot(lambda u: mpmath.log(tail(u)) - mpmath.log(mpmath.mpf(p)), start)
        return -float(mpmath.exp(u))


def _normal_start(p, df):
    from statistics import NormalDist

    z = NormalDist().inv_cdf(max(p, 1e-300))
    return z * (1 + (z * z + 1) / (4 * df))


@pytest.mark.parametrize(
    "p, df", [(1e-10, 1000), (1e-300, 1000), (1e-5, 500), (1e-10, 30), (1e-300, 3), (1e-100, 4)]
)
def test_t_quantile_far_tail_against_mpmath(p, df):
    from mnemo.sweep.stats import t_quantile

    exact = _t_quantile_mp(p, df)
    assert t_quantile(p, df) == pytest.approx(exact, rel=1e-14, abs=0)


def test_t_quantile_far_tail_needs_few_evaluations_of_the_series(monkeypatch):
    """Bisection to the float spacing evaluated the O(df) series 53 times at ``df = 1000``,
    ``p = 1e-10`` (36 ms); Newton's method inside the bracket needs a handful (a count, not a time)."""
    import mnemo.sweep.stats as stats

    calls = []
    for name in ("_two_sided_tail", "_two_sided_cdf"):
        f = getattr(stats, name)
        monkeypatch.setattr(stats, name, lambda *a, f=f: calls.append(1) or f(*a))
    stats.t_quantile(1e-10, 1000)
    assert len(calls) <= 12
    calls.clear()
    stats.t_quantile(0.3, 1000)
    assert len(calls) <= 12
