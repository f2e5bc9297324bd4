"""Comparison helpers shared by the tests (relative RMS error with an absolute floor)."""

from __future__ import annotations

import torch


def rel_rms(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    """``rms(a − b) / max(rms(b), floor)`` in float64."""
    a, b = a.detach().double(), b.detach().double()
    err = (a - b).pow(2).mean().sqrt().item() if a.numel() else 0.0
    ref = b.pow(2).mean().sqrt().item() if b.numel() else 0.0
    return err / max(ref, floor, 1e-300)


def assert_close(actual, expected, tol: float, floor: float = 1e-6, what: str = "") -> None:
    """Assert ``rel_rms(actual, expected) <= tol`` (``floor`` keeps all-zero references meaningful)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    e = rel_rms(actual, expected, floor)
    assert e <= tol, f"{what}: relative RMS error {e:.3e} > {tol:.1e}"
