"""Regressions of the decay-flush change (``threshold`` at ``exp(FLUSH_LOG)`` instead of
``exp(x) − exp(FLUSH_LOG)``) found in review."""

from __future__ import annotations

import pytest
import torch

from mnemo.ops._common import FLUSH_LOG, decay_exp
from mnemo.ops._ssd_chunk import _flushed_exp


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("fn", [decay_exp, _flushed_exp], ids=["decay_exp", "flushed_exp"])
def test_factors_at_or_below_the_flush_threshold_are_exactly_zero_in_every_dtype(fn, dtype):
    """``exp(FLUSH_LOG)`` rounded in bf16 (``4.2555e-18``) lies above the float64 constant
    ``exp(-40) = 4.2484e-18`` the threshold compared against, so in bf16 nothing was flushed: ``-40``,
    ``-41`` and ``-inf`` all gave ``4.26e-18`` instead of the documented exact ``0`` (the old
    ``exp − exp(FLUSH_LOG)`` gave ``0``). The first exponent above ``FLUSH_LOG`` that the dtype can hold
    is still kept, at its ``exp``."""
    x = torch.tensor([FLUSH_LOG, FLUSH_LOG - 1.0, -float("inf"), -1000.0], dtype=dtype)
    assert torch.equal(fn(x), torch.zeros_like(x))
    above = torch.tensor(FLUSH_LOG, dtype=dtype)
    above = (
        torch.nextafter(above, torch.zeros_like(above)) if dtype != torch.bfloat16 else above + 0.25
    )  # bf16's spacing at 40
    kept = fn(above[None])
    if dtype == torch.float16:  # exp(-40) underflows float16: every such factor is 0 anyway
        assert kept.item() == 0.0
    else:
        assert kept.item() == above.exp().item() > 0.0
    # the masked form: kept entries equal plain exp, the flushed and masked ones are 0
    y = torch.tensor([FLUSH_LOG, -0.5, -float("inf"), 0.0], dtype=dtype)
    mask = torch.tensor([True, True, True, False])
    assert torch.equal(decay_exp(y, mask), torch.tensor([0.0, y[1].exp().item(), 0.0, 0.0], dtype=dtype))
