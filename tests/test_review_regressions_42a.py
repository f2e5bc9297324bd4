"""Regression review 42a (c9a8491: the balancing bias's sign in the counts' own dtype; 08ff39b held):
each test failed on the code after those commits."""

from __future__ import annotations

import pytest
import torch

from mnemo.layers.moe import MoE


@pytest.mark.parametrize(
    "counts",
    [
        # float16: Σ c = 72032 and 8 · c overflow to inf, inf − inf = NaN, sign(NaN) = 0: no step
        torch.tensor([9000.0] * 4 + [9008.0] * 4, dtype=torch.float16),
        # bfloat16: Σ c = 1026 rounds to 1024 = 4 · 256: the three experts under the mean got no step
        torch.tensor([256.0, 256.0, 256.0, 258.0], dtype=torch.bfloat16),
    ],
    ids=["float16", "bfloat16"],
)
def test_update_bias_steps_half_precision_counts_toward_their_mean(counts):
    """c9a8491 computed ``sign(Σ c − E c_e)`` in the counts' own dtype; before, the counts were
    widened to float32, where these (exactly representable) counts gave the documented
    ``sign(c̄ − c_e)``."""
    E = counts.numel()
    m = MoE(4, n_experts=E, top_k=2, expert_hidden=3, bias_balancing=True, bias_update_rate=0.5)
    m.update_bias(counts)
    c = counts.double()
    want = (0.5 * torch.sign(c.mean() - c)).float()
    assert m.expert_bias.tolist() == want.tolist()
    assert set(want.tolist()) == {0.5, -0.5}


def test_update_bias_float32_counts_sum_exactly():
    """float32 counts (a caller's own sums) are exact integers here, but their float32 sum
    ``2²⁵ + 2`` rounds to ``2²⁵``: expert 0 (one below the mean) got no step."""
    m = MoE(4, n_experts=2, top_k=1, expert_hidden=3, bias_balancing=True, bias_update_rate=0.5)
    m.update_bias(torch.tensor([2.0**24, 2.0**24 + 2], dtype=torch.float32))
    assert m.expert_bias.tolist() == [0.5, -0.5]
