"""Session 44's leftovers: Student's t quantile at a huge number of degrees of freedom."""

from __future__ import annotations

from statistics import NormalDist

import mpmath
import pytest

from mnemo.sweep.stats import t_quantile


def _t_upper(q: float, df: int) -> float:
    """The upper ``q``-quantile of t in 40-digit arithmetic (the regularised incomplete beta:
    ``P(T > t) = ½ I_{ν/(ν+t²)}(ν/2, ½)``, solved on its logarithm from the normal quantile),
    independent of the library's series and expansion."""
    with mpmath.workdps(40):

        def log_tail(t):
            return mpmath.log(
                mpmath.betainc(mpmath.mpf(df) / 2, 0.5, 0, df / (df + t * t), regularized=True) / 2
            )

        start = mpmath.mpf(-NormalDist().inv_cdf(q))
        return float(mpmath.findroot(lambda t: log_tail(t) - mpmath.log(q), start))


@pytest.mark.parametrize("df", [10_001, 100_000, 10**7])
def test_t_quantile_at_large_df_matches_forty_digit_arithmetic(df):
    # the series took 22 ms at df 1e5 and was 1.2e-13 off there (1.9599877075348509 against
    # 1.9599877075346093); the expansion in 1/df is exact to rounding where it is taken
    assert t_quantile(0.975, df) == pytest.approx(_t_upper(1 - 0.975, df), rel=5e-16)
    assert t_quantile(0.025, df) == pytest.approx(-_t_upper(0.025, df), rel=5e-16)


def test_t_quantile_at_a_trillion_df_is_the_normal_quantile_and_returns():
    # an O(df) series hung here (hours at df 1e12); t → z as df → ∞, the gap (z³ + z) / (4 df)
    z = 1.959963984540054  # Φ⁻¹(0.975)
    assert t_quantile(0.975, 10**12) == pytest.approx(z + (z**3 + z) / 4e12, rel=2e-16)
    assert t_quantile(0.975, 10**400) == pytest.approx(z, rel=2e-16)  # (an int beyond the float range)
    far = t_quantile(1e-300, 10**8)  # the far tail too
    assert far == pytest.approx(-_t_upper(1e-300, 10**8), rel=5e-16)


def test_a_float64_state_into_a_float32_neural_memory_is_refused_by_name():
    # it was cast to float32 silently (every other memory mixer refuses it: session 43)
    import torch

    from mnemo.layers.state import to as state_to
    from mnemo.layers.titans import NeuralMemory

    torch.manual_seed(0)
    mem = NeuralMemory(16, n_heads=2)
    x = torch.randn(1, 3, 16)
    _, st = mem(x)
    y, _ = mem(x[:, :1], st)  # its own state passes
    y_again, _ = mem(x[:, :1], st)
    assert torch.equal(y, y_again)
    with pytest.raises(ValueError, match=r"expected dtype torch\.float32.*got torch\.float64"):
        mem(x[:, :1], state_to(st, torch.float64))
    bf = NeuralMemory(16, n_heads=2).to(torch.bfloat16)  # a bf16 memory keeps float32 weights: legal
    _, st_bf = bf(x.bfloat16())
    bf(x[:, :1].bfloat16(), st_bf)
