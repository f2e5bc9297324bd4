"""``decay_exp``: the masked, flushed ``exp`` of log decays that every chunk form builds on."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mnemo.ops._common import FLUSH_LOG, decay_exp


def _reference(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    keep = x >= FLUSH_LOG if mask is None else (x >= FLUSH_LOG) & mask
    return torch.where(keep, x.clamp(max=0).exp(), torch.zeros_like(x))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), scale=st.sampled_from([0.1, 5.0, 60.0]))
def test_values_and_gradient(seed, scale):
    """Kept factors equal ``exp`` to float64 rounding plus at most ``exp(FLUSH_LOG)``; masked and
    flushed ones are exactly zero; the gradient is ``grad · out`` (zero where flushed/masked)."""
    gen = torch.Generator().manual_seed(seed)
    b = (-scale * torch.rand(3, 17, dtype=torch.float64, generator=gen)).cumsum(-1)
    x = (b[..., :, None] - b[..., None, :]).requires_grad_(True)  # ≤ 0 on and below the diagonal
    mask = torch.ones(17, 17, dtype=torch.bool).tril()
    out = decay_exp(x, mask)
    ref = _reference(x.detach(), mask)
    assert torch.equal(out == 0, ref == 0)
    ulp = torch.finfo(torch.float64).eps * ref.abs()
    assert torch.all((out - ref).abs() <= math.exp(FLUSH_LOG) + ulp)
    g = torch.randn(out.shape, dtype=torch.float64, generator=gen)
    (out * g).sum().backward()
    assert torch.equal(x.grad, g * out.detach())  # the exp-like backward, exactly
    assert torch.all(x.grad[..., ~mask] == 0)


def test_masked_entries_may_hold_anything_finite():
    """Above the diagonal ``b_t − b_s`` is positive (huge for strong decays): no inf, no NaN, and
    no gradient leaks through it."""
    x = torch.tensor([[0.0, 500.0], [-3.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[True, False], [True, True]])
    out = decay_exp(x, mask)
    assert torch.equal(out, torch.tensor([[1.0, 0.0], [math.exp(-3.0), 1.0]]))
    out.sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad[0, 1] == 0


def test_without_mask_and_hard_reset():
    x = torch.tensor([0.0, -1.0, -39.0, -41.0, -float("inf")], dtype=torch.float64)
    out = decay_exp(x)
    assert out[0] == 1.0 and out[3] == 0.0 and out[4] == 0.0
    # a factor above exp(FLUSH_LOG) is exact (it was exp(-39) - exp(-40), 37 % too small)
    assert abs(out[1] - math.exp(-1.0)) <= 1e-17 and abs(out[2] - math.exp(-39.0)) <= 1e-32
