"""Regressions of the attention toolbox's review 2 (commit fb769b0), each shown by a test that
failed on that commit."""

from __future__ import annotations

import pytest
import torch

from mnemo.layers.moe import MoE
from mnemo.layers.rotary import RotaryEmbedding

F64 = torch.float64


def test_moe_capacity_traces_under_torch_compile_fullgraph():
    """fb769b0 computed the capacity as ``ceil(Fraction(str(c)) · N k / E)`` in every forward:
    ``str`` of a float is not traced by torch.compile (a graph break per MoE layer and call, an
    error under ``fullgraph=True``); before, ``ceil(c · N k / E)`` traced, with a symbolic ``N``
    too. The capacity stays the documented ceiling of the decimal ``c``: ``1.1 · 100 / 2 = 55``."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = MoE(4, n_experts=2, top_k=1, expert_hidden=8, capacity_factor=1.1, dispatch="fixed").double()
    m.train()
    with torch.no_grad():  # every token to expert 0: 100 assignments, 55 kept
        m.router.weight.zero_()
        m.router.weight[0] = 1.0
    x = torch.rand(1, 100, 4, dtype=F64) + 0.1
    compiled = torch.compile(m, backend="eager", fullgraph=True, dynamic=True)
    for T in (100, 37):
        xt = x[:, :T]
        got = compiled(xt)
        dropped = int(m.last_dropped)
        want = m(xt)
        assert int(m.last_dropped) == dropped == T - (-(-11 * T // 20))  # T - ceil(1.1 T / 2)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert m.capacity_factor == 1.1
    torch._dynamo.reset()


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "linear", "factor": 3.0},
        {"rope_type": "ntk", "factor": 2.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    ],
)
def test_rotary_cast_back_from_float64_gives_the_float32_modules_frequencies(scaling):
    """fb769b0 recomputes the frequencies of a ``.double()`` module in float64; a cast back
    (``.float()``, or ``.to(bfloat16)``, whose frequencies stay float32) then rounded those down,
    which differ from a float32 module's own (``θ^{−2i/R}`` computed in float32) by an ulp: a model
    after ``.double().float()`` no longer computed what it did before (before fb769b0 the round
    trip was exact). The float64 frequencies are still the equation's in float64."""
    fresh = RotaryEmbedding(64, theta=10000.0, scaling=scaling)
    for cast in (lambda r: r.float(), lambda r: r.to(torch.bfloat16)):
        r = cast(RotaryEmbedding(64, theta=10000.0, scaling=scaling).double())
        for name in ("base_inv_freq", "inv_freq"):
            got, want = getattr(r, name), getattr(fresh, name)
            assert got.dtype == torch.float32
            assert torch.equal(got, want), (name, (got - want).abs().max().item())
    d = RotaryEmbedding(64, theta=10000.0, scaling=scaling).double().float().double()
    exact = 10000.0 ** (-torch.arange(0, 64, 2, dtype=F64) / 64)
    assert torch.equal(d.base_inv_freq, exact)
    # bfloat16 then float64: the float64 equation as well
    b = RotaryEmbedding(64, theta=10000.0, scaling=scaling).to(torch.bfloat16).double()
    assert torch.equal(b.base_inv_freq, exact)
