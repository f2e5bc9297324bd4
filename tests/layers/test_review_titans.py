"""Break-it review of the Titans layers: MAC over a closed-form memory, the persistent prefix and an
empty first call, ``max_lr`` as the bound of ``θ``."""

from __future__ import annotations

import pytest
import torch

from mnemo.layers import NeuralMemory, TitansMAC
from tests.helpers import assert_close, prefill_then_tokens
from tests.layers.test_titans import _make

D = 16
TOL = 1e-10


def _x(T, B=2, seed=1):
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("spec", ["linear_attention", "retnet"])
def test_mac_over_a_closed_form_memory_decodes_and_streams_like_the_full_pass(spec):
    """MAC reads the memory's chunk anchor (the weights before the segment); the dedicated ops
    (dot objective) returned the end state as the anchor, so a cut inside a segment read the wrong
    weights."""
    m = _make(lambda: TitansMAC(D, n_heads=2, segment=4, persistent_tokens=2, spec=spec))
    x = _x(10)
    full, _ = m(x)
    assert_close(prefill_then_tokens(m, x, 2), full, TOL, what=f"{spec} decoding")
    y1, s = m(x[:, :6])
    y2, _ = m(x[:, 6:], s)
    assert_close(torch.cat([y1, y2], 1), full, TOL, what=f"{spec} cut at 6")


def test_an_empty_first_call_does_not_write_the_persistent_prefix():
    """The prefix is written once, with the stream's first token: an empty call before it must not
    write it (it did, and the next call, at offset 0, wrote it again)."""
    m = _make(lambda: NeuralMemory(D, n_heads=2, expansion=2.0, chunk_size=4, persistent_tokens=2))
    x = _x(6)
    full, _ = m(x)
    y0, s = m(x[:, :0])
    assert y0.shape == (2, 0, D)
    assert s.position == m.state_spec(2, 0).position == 0
    y, _ = m(x, s)
    assert_close(y, full, TOL, what="after an empty call")


def test_max_lr_is_the_bound_of_theta():
    """``max_lr`` above the preset's clamp (titans: 1) must not be cut back to it by the engine."""
    m = NeuralMemory(D, n_heads=2, expansion=2.0, chunk_size=4, max_lr=3.0)
    assert m.spec.max_lr == 3.0
    m2 = NeuralMemory(D, n_heads=2, spec="ttt_linear", max_lr=3.0)  # no clamp stays no clamp
    assert m2.spec.max_lr is None and m2.max_lr == 3.0


def test_mac_refuses_a_chunk_size_other_than_its_segment():
    with pytest.raises(ValueError, match="pass segment=, not chunk_size="):
        TitansMAC(D, n_heads=2, segment=4, chunk_size=8)
