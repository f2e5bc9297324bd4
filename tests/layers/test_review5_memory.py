"""Fifth break-it review of the Titans / Miras memories: constructor and attribution arguments that
were misread (a spec of the wrong type, a non-bool ``short_conv``, an attribution's ``max_rows``)."""

from __future__ import annotations

import pytest
import torch

from mnemo.layers import NeuralMemory, TitansMAC, TitansMAG, TitansMAL
from mnemo.memory import preset
from mnemo.memory.attribution import attribute_read, value_attribution

D = 16


@pytest.mark.parametrize("cls", [NeuralMemory, TitansMAG, TitansMAL, TitansMAC])
@pytest.mark.parametrize("bad", [123, {"objective": "l2"}, None])
def test_a_spec_that_is_neither_a_memory_spec_nor_a_preset_name_is_refused_naming_it(cls, bad):
    """``spec=123`` raised ``AttributeError: 'int' object has no attribute 'validate'``."""
    with pytest.raises(TypeError, match=r"spec: expected a MemorySpec or a preset name .*got"):
        cls(D, n_heads=2, spec=bad)


@pytest.mark.parametrize("bad", ["False", "no", 0, 1, None])
def test_short_conv_must_be_a_bool(bad):
    """``short_conv="False"`` (a config's string) was truthy: the conv was silently built and used."""
    with pytest.raises(ValueError, match=r"short_conv: expected a bool, got"):
        NeuralMemory(D, n_heads=2, short_conv=bad)


def test_short_conv_false_builds_no_conv_and_true_builds_one():
    assert NeuralMemory(D, n_heads=2, short_conv=False).conv is None
    assert NeuralMemory(D, n_heads=2, short_conv=True).conv is not None


def _attribution_inputs():
    g = torch.Generator().manual_seed(0)
    B, T, H, K = 1, 4, 1, 2
    return dict(
        q=torch.randn(B, T, H, K, generator=g, dtype=torch.float64),
        k=torch.randn(B, T, H, K, generator=g, dtype=torch.float64),
        v=torch.randn(B, T, H, K, generator=g, dtype=torch.float64),
        theta=torch.rand(B, T, H, generator=g, dtype=torch.float64),
        g=-torch.rand(B, T, H, generator=g, dtype=torch.float64),
        eta=torch.rand(B, T, H, generator=g, dtype=torch.float64),
    )


@pytest.mark.parametrize("bad", [2.5, None, 0, -1, True])
def test_value_attribution_names_a_bad_max_rows(bad):
    """``max_rows=2.5`` or ``None`` gave a bare ``TypeError`` from ``range``/``//`` naming nothing;
    ``0`` and ``-1`` were taken silently."""
    spec = preset("titans", expansion=1.0, chunk_size=2)
    x = _attribution_inputs()
    with pytest.raises(ValueError, match=r"max_rows must be an int >= 1, got"):
        value_attribution(spec, x["q"], x["k"], x["v"], x["theta"], g=x["g"], eta=x["eta"], max_rows=bad)
    with pytest.raises(ValueError, match=r"max_rows must be an int >= 1, got"):
        attribute_read(lambda vr: vr * 2, x["v"], max_rows=bad)


def test_value_attribution_is_the_same_for_any_valid_max_rows():
    spec = preset("titans", expansion=1.0, chunk_size=2)
    x = _attribution_inputs()
    kw = dict(g=x["g"], eta=x["eta"], method="jacobian")
    a = value_attribution(spec, x["q"], x["k"], x["v"], x["theta"], max_rows=1, **kw)
    b = value_attribution(spec, x["q"], x["k"], x["v"], x["theta"], max_rows=1024, **kw)
    assert torch.allclose(a.contributions, b.contributions, rtol=0, atol=1e-12)


def test_an_mlp_memory_from_zero_weights_never_moves_as_its_docstring_says():
    """``neural_memory(..., initial_state=None)`` starts an MLP memory at zero weights, a stationary
    point: the read is the residual ``q`` for every token and the weights stay zero. The op's
    docstring now says so (it said only "zeros when None"); the layer passes learned weights."""
    import torch.nn.functional as F

    from mnemo.memory import neural_memory

    g = torch.Generator().manual_seed(0)
    B, T, H, K = 1, 6, 2, 4
    q = torch.randn(B, T, H, K, generator=g, dtype=torch.float64)
    k = F.normalize(torch.randn(B, T, H, K, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, H, K, generator=g, dtype=torch.float64)
    theta = torch.rand(B, T, H, generator=g, dtype=torch.float64)
    spec = preset("titans", chunk_size=2)
    o, st = neural_memory(
        spec, q, k, v, theta, g=-0.1 * theta, eta=theta, output_final_state=True
    )  # fmt: skip
    assert torch.equal(o, q) and all(bool((w == 0).all()) for w in st.weights)
    assert "stationary point" in neural_memory.__doc__
    m = NeuralMemory(D, n_heads=2, spec="titans", expansion=1.0)
    assert all(bool(w.abs().sum() > 0) for w in m.init_weights)  # the layer starts elsewhere
