"""Implicit maps reproduce each mixer's output; hooks leave outputs unchanged."""

from __future__ import annotations

import pytest
import torch

from mnemo.interp import capture_maps, mixing
from mnemo.layers import MIXERS, GatedLinearAttention, LinearAttention, Mamba, Mamba2
from mnemo.models import LanguageModel, build_config
from tests.helpers import assert_close

D = 16
CASES = {
    "attention": lambda: MIXERS["attention"](D, n_heads=4, n_kv_heads=2),
    "attention_window": lambda: MIXERS["attention"](D, n_heads=2, window=4),
    "linear_attention": lambda: MIXERS["linear_attention"](D, n_heads=2),
    "linear_identity_conv": lambda: LinearAttention(
        D, n_heads=2, feature_map="identity", normalize=False, short_conv=True
    ),
    "retnet": lambda: MIXERS["retnet"](D, n_heads=2),
    "gla": lambda: MIXERS["gla"](D, n_heads=2),
    "scalar_gate": lambda: GatedLinearAttention(D, n_heads=2, gate="scalar"),
    "deltanet": lambda: MIXERS["deltanet"](D, n_heads=2),
    "gated_deltanet": lambda: MIXERS["gated_deltanet"](D, n_heads=2),
    "mamba": lambda: Mamba(D, d_state=4),
    "mamba_lti": lambda: Mamba(D, d_state=4, selective=False),
    "mamba2": lambda: Mamba2(D, d_state=8, head_dim=8, n_groups=2),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_maps_times_values_reproduce_the_output(name):
    torch.manual_seed(0)
    m = CASES[name]().double()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    x = torch.randn(2, 11, D, dtype=torch.float64)
    mx = mixing(m, x)
    B, T, H, V = mx.values.shape
    assert mx.maps.shape == (B, H, T, T)
    assert torch.all(mx.maps.triu(1) == 0), "maps must be causal"
    recon = torch.einsum("bhts,bshv->bthv", mx.maps, mx.values)
    assert_close(recon, mx.output, 1e-10, what=name)


def test_titans_mlp_memory_map_is_a_causal_attribution():
    """An MLP memory has no exact mixing matrix: its map is an attribution (tests/interp/test_ttt_maps.py
    checks it against the exact maps of matrix memories); here only its shape and causality."""
    mx = mixing(MIXERS["neural_memory"](D, n_heads=2), torch.randn(1, 5, D))
    assert mx.maps.shape == (1, 2, 5, 5) and torch.all(mx.maps.triu(1) == 0)


@pytest.mark.parametrize("model", ["transformer", "gated_deltanet", "mamba", "gla_hybrid"])
def test_capture_maps_leaves_outputs_unchanged(model):
    torch.manual_seed(0)
    m = LanguageModel(
        build_config(model, vocab_size=30, d_model=16, n_layers=2 if model != "gla_hybrid" else 4)
    )
    ids = torch.randint(0, 30, (2, 9))
    inputs = {}  # each mixer's input in a plain forward pass, read by hooks of the test's own
    hooks = [
        b.mixer.register_forward_pre_hook(lambda mod, args, i=i: inputs.__setitem__(i, args[0].detach()))
        for i, b in enumerate(m.blocks)
    ]
    with torch.no_grad():
        before, _ = m(ids)
    for h in hooks:
        h.remove()
    maps = capture_maps(m, ids)
    after, _ = m(ids)
    assert torch.equal(before, after)
    assert sorted(maps) == list(range(len(m.blocks)))
    for i, mp in maps.items():  # the map of layer i, on layer i's own input
        mx = mixing(m.blocks[i].mixer, inputs[i])
        assert torch.equal(mp, mx.maps), f"layer {i}"
        # and it is the layer's mixing: maps times values give its output
        assert_close(torch.einsum("bhts,bshv->bthv", mp, mx.values), mx.output, 1e-5, what=f"layer {i}")
