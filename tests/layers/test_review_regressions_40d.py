"""Regression review of 3067250 (MoE copies and normalised routing weights, rotary frequencies after
``to_empty``), 0984268 (RetNet's decays and FAVOR+'s projection after ``to_empty``) and 6d3db44
(Attention's odd derived head size)."""

from __future__ import annotations

import pytest
import torch

from mnemo.layers.linear_attention import GatedLinearAttention
from mnemo.layers.rotary import RotaryEmbedding
from tests.helpers import assert_meta_build_equals_eager


@pytest.mark.parametrize(
    "make",
    [
        lambda: RotaryEmbedding(8),
        lambda: RotaryEmbedding(8, scaling={"rope_type": "ntk", "factor": 2.0}),
        lambda: GatedLinearAttention(16, n_heads=4, gate="retnet"),
    ],
    ids=["rotary", "rotary_ntk", "retnet"],
)
def test_materialised_inside_the_meta_block_recomputes_on_the_host(make):
    """3067250 / 0984268 recompute the non-persistent constants when a meta-built module is
    materialised, but on the *default* device: inside the ``with torch.device("meta")`` block (or
    under ``torch.set_default_device("meta")``) they were made on meta, and copying them to the
    target raised "Cannot copy out of meta tensor" — where ``to_empty`` itself (and FAVOR+'s
    redraw, on the CPU) works. They must equal an eager build's."""
    eager = make()
    with torch.device("meta"):
        lazy = make()
        lazy.to_empty(device="cpu")
    for (name, a), (_, b) in zip(eager.named_buffers(), lazy.named_buffers()):
        assert b.device.type == "cpu" and b.dtype == a.dtype and torch.equal(a, b), name


def test_a_transformer_materialised_inside_the_meta_block_equals_an_eager_build():
    assert_meta_build_equals_eager("transformer", inside=True)


def test_aux_loss_ceiling_docstring_names_a_replaced_routing_that_repeats_an_expert():
    """3067250 says ``L_aux`` is at most ``E / k`` because "an expert takes at most one of a token's
    ``k`` choices"; a ``hook_topk_indices`` replacement may repeat an expert (the docstring of
    ``"fixed"`` dispatch says so), and then ``f_e = 1``: by hand 4 · 1 · 1 = 4 = E for E = 4, k = 2,
    router certain of expert 0 and every choice replaced by expert 0."""
    import math

    import mnemo.layers.moe as moe_module
    from mnemo.layers.moe import MoE

    m = MoE(4, n_experts=4, top_k=2, expert_hidden=3, norm_topk_prob=False).double()
    with torch.no_grad():
        m.router.weight.zero_()
        m.router.weight[0, 0] = 100.0
    x = torch.zeros(6, 4, dtype=torch.float64)
    x[:, 0] = 1.0
    m.hook_topk_indices.add(lambda v, name: torch.zeros_like(v))
    m(x)
    s0 = 1 / (1 + 3 * math.exp(-100.0))
    assert abs(m.last_aux_loss.item() - 4 * s0) < 1e-12 and m.last_aux_loss.item() > 4 / 2
    doc = " ".join(moe_module.__doc__.split())
    assert "``hook_topk_indices`` replacement that repeats an expert lifts the ceiling to ``E``" in doc
