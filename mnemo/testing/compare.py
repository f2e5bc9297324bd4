"""Relative-RMS comparison, the one error measure of the equivalence contract."""

from __future__ import annotations

import math

import torch

#: float64 tolerance (relative RMS) between two forms of the same recurrence.
F64_TOL = 1e-10
#: float32 tolerance (relative RMS) at realistic sizes, against the float64 reference.
F32_TOL = 2e-5
#: ``rms(expected)`` below this is treated as this (keeps all-zero references meaningful).
FLOOR = 1e-6


def rel_rms(actual: torch.Tensor, expected: torch.Tensor, floor: float = 0.0) -> float:
    """``rms(actual − expected) / max(rms(expected), floor)``, computed in float64.

    Both tensors are detached and moved to the CPU; an empty pair gives ``0.0``. Shapes must
    broadcast (:func:`assert_close` requires them equal). The same ratio at any magnitude: both
    are divided by their largest absolute value first, so that the squares of values beyond
    ``1e154`` do not overflow (``inf / inf``) nor those below ``1e-154`` underflow to ``0``.
    """
    a = actual.detach().to("cpu", torch.float64)
    b = expected.detach().to("cpu", torch.float64)
    top = max((t.abs().max().item() for t in (a, b) if t.numel()), default=0.0)
    s = top if 0.0 < top < math.inf else 1.0  # (inf or NaN values: left as they are)
    err = ((a - b) / s).pow(2).mean().sqrt().item() if a.numel() else 0.0
    ref = (b / s).pow(2).mean().sqrt().item() if b.numel() else 0.0
    den = max(ref, floor / s, 1e-300 / s)  # (0 when 1e-300 / s underflows: an error past any bound)
    return err / den if den > 0.0 else (math.inf if err > 0.0 else err)


def compare(actual: torch.Tensor, expected: torch.Tensor, floor: float = FLOOR) -> tuple[float, str]:
    """``(error, problem)``: the relative RMS error of ``actual`` against ``expected``, or
    ``(inf, reason)`` when the shapes differ or either has non-finite values."""
    if actual is None or expected is None:
        return float("inf"), f"got {type(actual).__name__}, expected {type(expected).__name__}"
    if tuple(actual.shape) != tuple(expected.shape):
        return float("inf"), f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if not torch.isfinite(actual.detach()).all():
        return float("inf"), "non-finite values"
    if not torch.isfinite(expected.detach()).all():
        return float("inf"), "non-finite values in the reference"
    return rel_rms(actual, expected, floor), ""


def assert_close(actual, expected, tol: float, floor: float = FLOOR, what: str = "") -> None:
    """Raise ``AssertionError`` unless ``rel_rms(actual, expected, floor) <= tol``, the shapes are
    equal and ``actual`` is finite. ``what`` names the comparison in the message."""
    err, problem = compare(actual, expected, floor)
    assert not problem, f"{what}: {problem}"
    assert err <= tol, f"{what}: relative RMS error {err:.3e} > {tol:.1e}"
