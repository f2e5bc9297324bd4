"""Statistics over a sweep's seeds: Student-t quantiles and confidence intervals of a mean.

Why Student-t and not a bootstrap: sweeps run 3–5 seeds per cell. A percentile bootstrap of 3
values has 10 distinct resamples and its interval never leaves ``[min, max]`` of the values, so it
is far too narrow at that size; the t interval is the standard small-sample interval for a mean
and widens correctly as ``n`` shrinks (``t_{0.975, 2} = 4.30``). Its assumption (roughly normal
per-seed results) is weakest for accuracies piled up against 1.0, where the interval can reach
past 1; it is reported as computed, not clipped, so a reader sees that the seeds disagree.

The quantile is exact for every integer number of degrees of freedom, without scipy: the
two-sided probability ``A(t | ν) = P(|T| ≤ t)`` has the finite closed forms of Abramowitz &
Stegun 26.7.3–26.7.4 (with ``θ = arctan(t / √ν)``)::

    ν = 1:      A = 2θ / π
    ν odd > 1:  A = (2/π) · (θ + sin θ cos θ · Σ_{j=0}^{(ν−3)/2} a_j cos^{2j} θ),
                a_0 = 1, a_j = a_{j−1} · 2j / (2j + 1)
    ν even:     A = sin θ · Σ_{j=0}^{(ν−2)/2} b_j cos^{2j} θ,   b_0 = 1, b_j = b_{j−1} · (2j − 1) / (2j)

``A`` increases monotonically in ``θ ∈ [0, π/2)`` with the closed-form slope
``dA/dθ = K cos^{ν−1} θ``, ``K = 2 Γ((ν+1)/2) / (√π Γ(ν/2))``, so ``t_{p, ν}`` is found by Newton's
method kept inside a bracket (a step outside it bisects) to the float spacing: on ``θ`` against
``A = 1 − 2q`` while the tail ``q = min(p, 1 − p) ≥ 0.005`` (a ``t`` near 0 keeps its relative
precision), else on ``φ = π/2 − θ`` against ``log((1 − A) / 2q)`` (``t = √ν · cot φ``): the tail of
a tiny ``p`` is summed as the rest of A's series (no ``1 − A`` cancellation), and ``φ`` resolves a
``t`` of 1e100 where ``θ`` would round to ``π/2``. Each evaluation costs O(ν) terms; Newton needs
a handful where bisection needed 50–60 (at ``ν = 1000``, ``p = 1e-10``: 4 against 53).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence


def _two_sided_cdf(theta: float, df: int) -> float:
    """``P(|T| ≤ √df · tan θ)`` for Student's t with ``df`` degrees of freedom (A&S 26.7.3–4)."""
    s, c = math.sin(theta), math.cos(theta)
    c2 = c * c
    if df % 2 == 1:
        total, term = 0.0, 1.0
        if df > 1:
            total = term
            for j in range(1, (df - 3) // 2 + 1):
                term *= c2 * (2 * j) / (2 * j + 1)
                total += term
        return (2 / math.pi) * (theta + s * c * total)
    total, term = 1.0, 1.0
    for j in range(1, (df - 2) // 2 + 1):
        term *= c2 * (2 * j - 1) / (2 * j)
        total += term
    return s * total


def _two_sided_tail(phi: float, df: int) -> float:
    """``P(|T| > √df · cot φ)`` (``φ = π/2 − θ``) with its relative precision kept in the far tail:
    ``1 − A`` from the closed forms while that is above 0.01, else the rest of A's series beyond its
    last closed-form term (the full series sum to 1: ``Σ_j b_j c^{2j} = 1/s`` and
    ``s c Σ_j a_j c^{2j} = π/2 − θ``), which has no cancellation and converges as ``c^{2j}``."""
    s, c = math.cos(phi), math.sin(phi)  # sin θ, cos θ
    c2 = c * c
    if df % 2 == 1:
        total, term = 0.0, 1.0
        for j in range(1, (df - 1) // 2 + 1):
            total += term
            term *= c2 * (2 * j) / (2 * j + 1)
        q = (2 / math.pi) * (phi - s * c * total)  # 1 − A: 1 − 2θ/π is 2φ/π
        if q > 0.01:
            return q
        j, rest = (df - 1) // 2, 0.0  # term is a_j c^{2j} now
        while rest + term != rest:
            rest += term
            j += 1
            term *= c2 * (2 * j) / (2 * j + 1)
        return (2 / math.pi) * s * c * rest
    total, term = 0.0, 1.0
    for j in range(1, df // 2 + 1):
        total += term
        term *= c2 * (2 * j - 1) / (2 * j)
    q = 1.0 - s * total
    if q > 0.01:
        return q
    j, rest = df // 2, 0.0  # term is b_j c^{2j} now
    while rest + term != rest:
        rest += term
        j += 1
        term *= c2 * (2 * j - 1) / (2 * j)
    return s * rest


#: above this many degrees of freedom :func:`t_quantile` takes the expansion in 1/df where it is exact
#: to rounding (the closed forms' series cost O(df): 22 ms at df 1e5)
_SERIES_MAX_DF = 10_000


def t_quantile(p: float, df: int) -> float:
    """The ``p``-quantile ``t_{p, df}`` of Student's t distribution.

    Accurate to ≤ 6e-15 relative for the few degrees of freedom of a sweep and ``p ≤ 0.995``
    (≤ 4e-14 at ``df = 500``). The tail ``min(p, 1 − p)`` is solved for directly, so a tiny ``p``
    (down to the smallest normal float, ~2.2e-308; a subnormal ``p`` carries fewer digits itself:
    at ``5e-324`` the result is ~2% off at ``df = 3``) keeps its relative precision; a ``p`` near 1 is
    only as precise as the float ``1 − p`` it stands for (``1 − 1e-300`` is 1.0, outside (0, 1)).
    Monotone in ``p`` to within that accuracy, not bit for bit: neighbouring floats ``p`` can give
    results out of order by up to ~3e-14 relative at df 500 (the solver stops inside the series' rounding).
    Above ``df = 10,000`` the quantile is A&S 26.7.5's expansion in ``1/df`` (four terms) wherever
    the term it leaves out (estimated as ``(t² + 5) / df`` times its last) is below ``1e-17`` of ``t``
    (every ``p`` above ``df = 10⁷``; ≤ 7e-16 relative against 40-digit arithmetic), else the series
    (~1e-14 relative there): a huge ``df`` costs microseconds, not hours.

    Args:
        p: probability in (0, 1); e.g. ``0.975`` for a two-sided 95% interval.
        df: degrees of freedom, an int ≥ 1 (``n − 1`` for the mean of ``n`` values; a NumPy
            integer scalar counts as an int).
    Returns:
        ``t`` with ``P(T ≤ t) = p``; e.g. ``t_quantile(0.975, 2) = 4.302652729749462``: the closed form
        ``(2p − 1) / √(2p(1 − p))`` of ``df = 2``, used as such, at the float ``0.975`` (the decimal
        0.975 gives 4.3026527297494639; some tables print 4.302652729911275).
    Raises:
        ValueError: ``p`` is not in (0, 1) or ``df`` is not an int ≥ 1 (names the argument).
    """
    if isinstance(df, bool) or not isinstance(df, numbers.Integral) or df < 1:
        raise ValueError(f"t_quantile: df must be an int >= 1, got {df!r}")
    df = int(df)
    if not isinstance(p, numbers.Real) or not 0.0 < p < 1.0:
        raise ValueError(f"t_quantile: p must be a probability in (0, 1), got {p!r}")
    p = float(p)
    if p == 0.5:
        return 0.0
    sign, q = (1.0, 1.0 - p) if p > 0.5 else (-1.0, p)  # q = P(T > |t|), exact (Sterbenz) for p > ½
    if df == 1:  # Cauchy: cot(π q) (tan θ near π/2 lost 2.6e-14 at 0.995)
        return sign / math.tan(math.pi * q)
    if df == 2:  # closed form (the t of three seeds, the most common interval): exact to rounding
        return sign * (1.0 - 2.0 * q) / math.sqrt(2.0 * q * (1.0 - q))
    if df > _SERIES_MAX_DF:
        # the closed forms below are series of O(df) terms (22 ms at df 1e5, hours at 1e12); the
        # expansion in 1/df is taken where the term it leaves out (~(t² + 5)/df times its last:
        # g₅/g₄ → 4.75 at z → 0, ~0.09 z² for a large z) is below 1e-17 of t (always above 1e7)
        t, last = _cornish_fisher(q, df)
        if df > 10**7 or abs(last) * (t * t + 5) / df <= 1e-17 * t:  # (first: no float of a huge df)
            return sign * t
    # Newton's method on the closed forms, kept inside a bracket that every evaluation narrows
    # (a step that leaves it bisects instead): ~5–10 evaluations of
    # the O(df) series where bisection to the float spacing took 60–1100 (20–40 ms at df = 1000)
    log_k = math.log(2.0) + math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(math.pi)
    t0 = _first_guess(q, df)
    if q >= 0.005:
        # on θ (t = √df · tan θ) against A = 1 − 2q (exact for q > ¼): a t near 0 keeps its relative
        # precision (on φ it lost 1e-9 at p = 0.5000001) and A's closed form is cheap; dA/dθ is the
        # density of |T| in θ, K cos^{df−1} θ with K = 2 Γ((df+1)/2) / (√π Γ(df/2))
        target = 1.0 - 2.0 * q

        def f(x):
            return _two_sided_cdf(x, df) - target, math.exp(log_k + (df - 1) * math.log(math.cos(x)))

        theta = _safe_newton(f, 0.0, math.pi / 2, math.atan(t0 / math.sqrt(df)))
        return sign * math.sqrt(df) * math.tan(theta)
    # the tail (q < 0.005): on φ = π/2 − θ (t = √df · cot φ), where a far-tail t of 1e100 is still a
    # float φ, against log P(|T| > t) = log 2q (the tail spans hundreds of decades): halve φ until
    # the tail falls below 2q (a bracket), then Newton with d(tail)/dφ = K sin^{df−1} φ
    target, hi = 2.0 * q, math.pi / 2
    lo = hi / 2
    while lo > 0.0 and _two_sided_tail(lo, df) > target:
        hi, lo = lo, lo / 2

    def g(x):
        tail = _two_sided_tail(x, df)
        if tail <= 0.0:  # (below the float range: a step that far left is refused by its sign)
            return -math.inf, math.inf
        ratio = tail / target  # (its log, not log(tail) − log(2q): 1e-300 lost 2e-14 to the difference)
        value = math.log(ratio) if 0.0 < ratio < math.inf else math.log(tail) - math.log(target)
        return value, math.exp(log_k + (df - 1) * math.log(math.sin(x)) - math.log(tail))

    phi = _safe_newton(g, lo, hi, min(max(math.atan2(math.sqrt(df), t0), lo), hi))
    return sign * math.sqrt(df) / math.tan(phi)


def _cornish_fisher(q: float, df: int, terms: int = 4) -> tuple[float, float]:
    """The upper ``q``-quantile of t as the normal quantile ``z`` plus the first ``terms`` (≤ 4)
    corrections of its expansion in ``1/df`` (A&S 26.7.5: ``t = z + g₁/ν + g₂/ν² + g₃/ν³ + g₄/ν⁴``);
    returns ``(t, the last term taken)``. Asymptotic: for a large ``df`` the neglected ``g₅/ν⁵``
    is about ``(z² + 5)/ν`` times the last term (``g₅/g₄`` tends to 4.75 at ``z → 0``)."""
    from statistics import NormalDist

    z = -NormalDist().inv_cdf(q)
    z2 = z * z
    g = (
        z * (z2 + 1) / 4,
        z * ((5 * z2 + 16) * z2 + 3) / 96,
        z * (((3 * z2 + 19) * z2 + 17) * z2 - 15) / 384,
        z * ((((79 * z2 + 776) * z2 + 1482) * z2 - 1920) * z2 - 945) / 92160,
    )
    inv = 1 / df  # (a true division of ints: no overflow for any int df)
    t, last = z, z
    for i in range(terms):
        last = g[i] * inv ** (i + 1)
        t += last
    return t, last


def _first_guess(q: float, df: int) -> float:
    """A start for the upper ``q``-quantile of t (two terms of :func:`_cornish_fisher`; only a
    start: the solver does not depend on its accuracy)."""
    return _cornish_fisher(max(q, 1e-300), df, terms=2)[0]


def _safe_newton(f, lo: float, hi: float, x: float) -> float:
    """The root of an increasing ``f`` in ``[lo, hi]`` (``f(lo) ≤ 0 < f(hi)`` as far as evaluated),
    to the float spacing: ``f(x)`` returns ``(value, derivative)``. Newton steps from ``x``; a
    step outside the bracket is replaced by the bracket's middle."""
    for _ in range(300):
        if not lo < x < hi:
            x = 0.5 * (lo + hi)
        if x in (lo, hi):  # the bracket is two adjacent floats
            return x
        fx, dfx = f(x)
        if fx == 0.0:
            return x
        if fx < 0.0:
            lo = x
        else:
            hi = x
        step = fx / dfx if dfx > 0.0 and math.isfinite(dfx) else math.nan
        if abs(step) <= 2 * math.ulp(x):  # converged: the step is at the float spacing (tested before
            return x - step  # the bracket: x is now one of its ends, and x − step may round to x)
        new = x - step
        if not lo < new < hi:
            new = 0.5 * (lo + hi)
        x = new
    return 0.5 * (lo + hi)


def mean_interval(values: Sequence[float], confidence: float = 0.95) -> dict:
    """Mean and Student-t confidence interval of ``values`` (one value per seed).

    ``mean = Σx / n``; ``std = √(Σ(x − mean)² / (n − 1))`` (sample standard deviation);
    ``half_width = t_{(1 + confidence)/2, n−1} · std / √n``; the interval is
    ``[mean − half_width, mean + half_width]`` in the units of ``values``.

    Args:
        values: the per-seed results (finite real numbers: Python or NumPy scalars), any number ≥ 0.
        confidence: coverage of the interval in (0, 1), default 0.95.
    Returns:
        ``{"n", "mean", "std", "half_width", "low", "high"}``; with ``n = 1`` only ``n`` and
        ``mean`` are set (the others are ``None``: one seed gives no interval), with ``n = 0``
        only ``n``.
    Raises:
        ValueError: a value is not a finite number, or ``confidence`` is not in (0, 1).
    """
    if not isinstance(confidence, numbers.Real) or not 0.0 < confidence < 1.0:
        raise ValueError(f"mean_interval: confidence must be in (0, 1), got {confidence!r}")
    xs = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
            raise ValueError(f"mean_interval: values[{i}] must be a finite number, got {v!r}")
        xs.append(float(v))
    n = len(xs)
    out: dict = {"n": n, "mean": None, "std": None, "half_width": None, "low": None, "high": None}
    if n == 0:
        return out
    # Σx / n from the exact sum (fsum): the same mean in any order of the values (offsets from xs[0]
    # rounded each, so the mean depended on which seed came first and cancelled 1e16, 1, −1e16 to 0);
    # a sum past the float range is taken of the values scaled by 2^−k (exact). Clamped to
    # [min, max]: n equal values give that value exactly (fsum(3 × 0.99) / 3 is 0.9899999999999999)
    # and a spread of exactly 0
    try:
        mean = math.fsum(xs) / n
    except OverflowError:
        k = n.bit_length()
        mean = math.ldexp(math.fsum(math.ldexp(x, -k) for x in xs) / n, k)
    mean = min(max(mean, min(xs)), max(xs))
    out["mean"] = mean
    if n == 1:
        return out
    # the deviations scaled by the largest first: their squares past the float range (values
    # beyond ~1e154) raised OverflowError, where the mean above handles an overflowing sum
    dev, scale = [x - mean for x in xs], 1.0
    if not all(map(math.isfinite, dev)):  # a difference itself past the range (values near ±1.8e308)
        dev, scale = [x / 2 - mean / 2 for x in xs], 2.0
    big = max(abs(d) for d in dev)
    std = big * math.sqrt(math.fsum((d / big) ** 2 for d in dev) / (n - 1)) * scale if big > 0 else 0.0
    # t_{(1 + c)/2} as −t_{(1 − c)/2}: 1 − c is exact for c ≥ ½, where 0.5 + c/2 rounded to 1.0 for
    # c = 1 − 2⁻⁵³ (refused as t_quantile's p); (t · std may overflow)
    half = (0.0 - t_quantile((1.0 - confidence) / 2, n - 1)) * (std / math.sqrt(n))
    out.update(std=std, half_width=half, low=mean - half, high=mean + half)
    return out
