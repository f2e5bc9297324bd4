"""``LinearAttention(n_heads=None, head_dim=K)``: a fixed head size at every width (Based's 16)."""

import pytest
import torch

from mnemo.layers import LinearAttention
from mnemo.models import build_config


@pytest.mark.parametrize("d_model, heads", [(64, 4), (128, 8)])
def test_heads_from_head_dim(d_model, heads):
    m = LinearAttention(d_model, n_heads=None, head_dim=16, feature_map="taylor")
    assert (m.n_heads, m.key_dim, m.value_dim) == (heads, 16, 16)
    y, s = m(torch.randn(2, 5, d_model))
    assert y.shape == (2, 5, d_model)
    assert s.memory.shape == (2, heads, 1 + 16 + 16 * 16, 16 + 1)  # taylor features, value + normaliser


def test_heads_from_head_dim_needs_a_divisor():
    with pytest.raises(ValueError, match="head_dim"):
        LinearAttention(64, n_heads=None)
    with pytest.raises(ValueError, match="head_dim"):
        LinearAttention(64, n_heads=None, head_dim=24)


def test_heads_from_head_dim_in_a_model_config():
    opts = {"linear_attention": {"n_heads": None, "head_dim": 16, "feature_map": "taylor"}}
    cfg = build_config("linear_attention", d_model=128, n_layers=2, mlp="none", mixer_options=opts)
    assert cfg.mixer_options["linear_attention"]["n_heads"] is None
