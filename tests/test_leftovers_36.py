"""Small defects noticed in earlier reviews and left for later (session 35's note), each test failing
on the code before its fix."""

from __future__ import annotations

import pytest
import torch

from mnemo.interp.capacity import recall_accuracy
from mnemo.ops import ssd


def test_ssd_state_size_zero_names_b_and_c():
    # the error named q and k, arguments ssd does not have (it reached the GLA form's check)
    x, dt, A = torch.randn(1, 5, 2, 3), torch.rand(1, 5, 2), -torch.rand(2)
    B = C = torch.randn(1, 5, 1, 0)
    with pytest.raises(ValueError, match=r"B and C need a state size N >= 1, got B of shape \[1, 5, 1, 0\]"):
        ssd(x, dt, A, B, C)


@pytest.mark.parametrize("shape", [(1, 0, 1, 4), (1, 3, 1, 0)])
def test_recall_accuracy_without_pairs_or_channels_is_refused(shape):
    # an IndexError from amax() before
    with pytest.raises(ValueError, match=r"v: expected N >= 1 pairs and D >= 1 channels"):
        recall_accuracy(torch.randn(shape), torch.randn(shape))
