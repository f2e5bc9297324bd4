"""Regression review 43d (of "MAC's 0-token state is what state_spec declares; ... t_quantile by
bracketed Newton"): a bf16 TitansMAC's 0-token state against ``state_spec``; the bracketed Newton
solver's convergence test, which a step below half a float spacing never reached."""

from __future__ import annotations

import dataclasses

import pytest
import torch


def _dtypes(state, prefix=""):
    """``{field path: dtype}`` of a state's tensors (lists for tuples of tensors)."""
    out = {}
    for f in dataclasses.fields(state):
        v = getattr(state, f.name)
        if dataclasses.is_dataclass(v):
            out.update(_dtypes(v, f"{prefix}{f.name}."))
        elif isinstance(v, torch.Tensor):
            out[prefix + f.name] = v.dtype
        elif isinstance(v, (list, tuple)):
            out[prefix + f.name] = [t.dtype for t in v]
    return out


def test_bf16_titans_mac_zero_token_state_keeps_the_memory_in_float32_as_state_spec_declares():
    """A bf16 TitansMAC's 0-token call returned the memory's weights, momentum and anchor in bf16
    (the learned initial weights as stored), while ``state_spec(B, 0)`` declares them float32 (the
    memory's compute dtype, what NeuralMemory's own 0-token call and every MAC call with tokens
    return): the state's dtypes now are the declared ones."""
    from mnemo.layers.titans import NeuralMemory
    from mnemo.layers.titans_architectures import TitansMAC

    torch.manual_seed(0)
    mac = TitansMAC(16, n_heads=2, segment=4).to(torch.bfloat16)
    x = torch.randn(2, 5, 16, dtype=torch.bfloat16)
    _, empty = mac(x[:, :0])
    declared = _dtypes(mac.state_spec(2, 0))
    assert declared["memory.weights"] == [torch.float32, torch.float32]  # the declaration itself
    assert _dtypes(empty) == declared
    # the reference: a bare NeuralMemory's 0-token call, and MAC's own state after tokens
    mem = NeuralMemory(16, n_heads=2).to(torch.bfloat16)
    assert _dtypes(mem(x[:, :0])[1])["weights"] == [torch.float32, torch.float32]
    assert _dtypes(mac(x)[1])["memory.weights"] == [torch.float32, torch.float32]
    y_fresh, _ = mac(x)
    y_cont, _ = mac(x, empty)
    torch.testing.assert_close(y_cont, y_fresh, rtol=0, atol=0)


@pytest.mark.parametrize("p, df, most", [(0.001, 7, 12), (1e-10, 4, 18), (0.004999, 7, 12), (1e-20, 10, 18)])
def test_t_quantile_newton_stops_at_a_sub_spacing_step_instead_of_bisecting_on(monkeypatch, p, df, most):
    """When Newton's step fell below half the float spacing, ``x − step`` rounded to ``x``, which
    is by then an end of the bracket, so the step was taken as leaving it and the solver bisected
    one float-spacing-wide bracket after another: 45 series evaluations at (0.001, df 7), 40 at
    (1e-10, df 4), 15 at (0.004999, df 7), 43 at (1e-20, df 10) — bisection's 53–61 — where
    Newton had converged after ~5. The value is checked against A&S 26.7.3–4 summed by hand."""
    import mnemo.sweep.stats as stats

    calls = []
    for name in ("_two_sided_tail", "_two_sided_cdf"):
        f = getattr(stats, name)
        monkeypatch.setattr(stats, name, lambda *a, f=f: calls.append(1) or f(*a))
    t = stats.t_quantile(p, df)
    assert len(calls) <= most  # (the tail's bracket halvings included: 2, 8, 2 and 7)
    # independent: P(T < t) at the returned t from mpmath's regularised incomplete beta (40 digits),
    # ``I_{df/(df + t²)}(df/2, ½) / 2``, equal to p to the solver's accuracy (a relative error e in
    # t is one of about df · e in the tail)
    mpmath = pytest.importorskip("mpmath")
    with mpmath.workdps(40):
        t2 = mpmath.mpf(t) ** 2
        tail = mpmath.betainc(mpmath.mpf(df) / 2, mpmath.mpf(1) / 2, 0, df / (df + t2), regularized=True) / 2
    assert t < 0 and float(tail) == pytest.approx(p, rel=df * 1e-14)
