"""Review 6 (toolbox: attention, rotary/YaRN/NTK, MoE, auxiliary losses, sinks): each test failed
on the code before its fix."""

from __future__ import annotations

import pytest
import torch

from mnemo.layers.linear_attention import LinearAttention
from mnemo.models import LanguageModel, build_config, model_names


def _meta_assign_matches_eager(cfg, ref_dtype=torch.float64, tol=1e-12):
    torch.manual_seed(0)
    ref = LanguageModel(cfg).to(ref_dtype)
    with torch.device("meta"):
        lazy = LanguageModel(cfg)
    lazy.load_state_dict(ref.state_dict(), assign=True)
    left = [n for n, t in [*lazy.named_parameters(), *lazy.named_buffers()] if t.is_meta]
    assert not left, f"left on meta after load_state_dict(assign=True): {left}"
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    with torch.no_grad():
        a, b = lazy(ids)[0], ref(ids)[0]
    assert a.dtype == b.dtype == ref_dtype
    torch.testing.assert_close(a, b, rtol=0, atol=tol)


@pytest.mark.parametrize("name", model_names())
def test_meta_build_then_assign_load_equals_an_eager_build(name):
    """Leftover: ``with torch.device("meta")`` build, then ``load_state_dict(sd, assign=True)`` (no
    ``to_empty``): the non-persistent constants (rotary frequencies, RetNet's decays) stayed on
    meta and the first forward raised "Cannot copy out of meta tensor". They must be recomputed on
    the loaded weights' device, in float64 for float64 weights (as ``.double()`` does)."""
    over = {"n_layers": 4} if name.endswith(("hybrid", "moe")) else {"n_layers": 1}
    _meta_assign_matches_eager(build_config(name, vocab_size=13, d_model=16, **over))


def test_meta_build_then_assign_load_float32_weights_give_float32_frequencies():
    cfg = build_config("transformer", vocab_size=13, d_model=16, n_layers=1)
    _meta_assign_matches_eager(cfg, ref_dtype=torch.float32, tol=0)


def test_favor_plus_meta_build_then_assign_load_redraws_its_projection():
    """FAVOR+'s projection (non-persistent, drawn from the seed) after a meta build and an
    ``assign=True`` load equals an eager layer's, bit for bit."""
    torch.manual_seed(0)
    ref = LinearAttention(16, n_heads=2, feature_map="favor").double()
    with torch.device("meta"):
        lazy = LinearAttention(16, n_heads=2, feature_map="favor")
    lazy.load_state_dict(ref.state_dict(), assign=True)
    assert torch.equal(lazy.feature_map.projection, ref.feature_map.projection)
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    assert torch.equal(lazy(x)[0], ref(x)[0])


def test_yarn_attention_meta_build_then_assign_load_keeps_its_scaled_frequencies():
    """The recomputed frequencies are the YaRN-scaled ones (the scaling survives), in float64."""
    from mnemo.layers.attention import Attention

    rs = {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 64, "beta_fast": 8}
    torch.manual_seed(0)
    ref = Attention(16, n_heads=2, window=3, n_sink=1, rope_scaling=rs).double()
    with torch.device("meta"):
        lazy = Attention(16, n_heads=2, window=3, n_sink=1, rope_scaling=rs)
    lazy.load_state_dict(ref.state_dict(), assign=True)
    assert lazy.rotary.inv_freq.dtype == torch.float64
    assert torch.equal(lazy.rotary.inv_freq, ref.rotary.inv_freq)
    assert not torch.equal(lazy.rotary.inv_freq, lazy.rotary.base_inv_freq)
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    torch.testing.assert_close(lazy(x)[0], ref(x)[0], rtol=0, atol=1e-12)
