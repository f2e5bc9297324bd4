"""Leftovers mended by the lead in session 40 (each test fails on the code before)."""

import math

import pytest
import torch

from mnemo.layers.linear_attention import GatedLinearAttention, LinearAttention
from mnemo.models import LanguageModel, build_config, model_names
from mnemo.ops.feature_maps import FavorPlus


@pytest.mark.parametrize("name", model_names())
def test_every_preset_built_on_meta_and_loaded_computes_what_an_eager_build_does(name):
    """The large-model build — ``with torch.device("meta")``, ``to_empty``, ``load_state_dict`` —
    leaves non-persistent buffers as uninitialised memory (``load_state_dict`` does not fill them):
    RetNet's fixed decays ``log γ`` read garbage (review 5-Y's leftover). Every preset's logits must
    equal an eager build's with the same weights, bit for bit."""
    torch.manual_seed(0)
    cfg = build_config(name, vocab_size=13, d_model=16, n_layers=1)
    ref = LanguageModel(cfg)
    with torch.device("meta"):
        lazy = LanguageModel(cfg)
    lazy.to_empty(device="cpu")
    lazy.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 13, (2, 9))
    with torch.no_grad():
        assert torch.equal(lazy(ids)[0], ref(ids)[0])


def test_retnet_decays_after_to_empty_are_the_papers():
    """``log γ_h = log(1 − 2^{−5−h})`` (Sun et al. 2023, §2.2) after a meta build, by hand."""
    with torch.device("meta"):
        layer = GatedLinearAttention(16, n_heads=4, gate="retnet")
    layer.to_empty(device="cpu")
    hand = torch.tensor([math.log(1 - 2.0 ** (-5 - h)) for h in range(4)])
    assert torch.allclose(layer.log_gamma.double(), hand.double(), rtol=1e-7, atol=0)


def test_favor_features_after_to_empty_are_the_seeds_draw():
    """FAVOR+'s projection is redrawn from its seed when materialised (it is not saved), so a
    linear attention with ``feature_map="favor"`` built on meta equals an eager one."""
    eager = FavorPlus(8, 12, seed=3)
    with torch.device("meta"):
        lazy = FavorPlus(8, 12, seed=3)
    lazy.to_empty(device="cpu")
    assert lazy.projection.dtype == torch.float64
    assert torch.equal(lazy.projection, eager.projection)
    torch.manual_seed(0)
    ref = LinearAttention(16, n_heads=2, feature_map="favor")
    with torch.device("meta"):
        att = LinearAttention(16, n_heads=2, feature_map="favor")
    att.to_empty(device="cpu")
    att.load_state_dict(ref.state_dict())
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        assert torch.equal(att(x)[0], ref(x)[0])


def test_an_odd_derived_head_size_under_rope_names_d_model_and_n_heads():
    """``Attention(16, n_heads=3)`` takes ``head_dim = 16 // 3 = 5`` and failed with "rotary
    embeddings need an even head_dim, got 5", which does not say where the 5 came from."""
    from mnemo.layers import Attention

    with pytest.raises(ValueError, match=r"n_heads: .*d_model // n_heads = 16 // 3 = 5"):
        Attention(16, n_heads=3)
    assert Attention(16, n_heads=3, rope=False).head_dim == 5  # no rotary: any size
    assert Attention(16, n_heads=3, head_dim=6).head_dim == 6
