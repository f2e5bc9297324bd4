"""Review 4 of the layers (fourth pass): float64 buffers under the default dtype, RetNet's value
width, and what the break-it pass found."""

from __future__ import annotations

import math

import pytest
import torch

from mnemo.layers import MIXERS
from mnemo.layers.linear_attention import GatedLinearAttention
from mnemo.layers.moe import MoE
from mnemo.layers.norm import RMSNorm
from mnemo.layers.rotary import RotaryEmbedding


@pytest.fixture
def float64_default():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _hand_rotary(x: torch.Tensor, theta: float, R: int, offset: int = 0) -> torch.Tensor:
    """RoPE in float64 from the equation: pairs (x_i, x_{i+R/2}) rotated by pos · θ^{−2i/R}."""
    out = x.clone()
    B, T, H, D = x.shape
    for t in range(T):
        for i in range(R // 2):
            a = (offset + t) * theta ** (-2 * i / R)
            c, s = math.cos(a), math.sin(a)
            x1, x2 = x[:, t, :, i], x[:, t, :, i + R // 2]
            out[:, t, :, i] = x1 * c - x2 * s
            out[:, t, :, i + R // 2] = x1 * s + x2 * c
    return out


# ------------------------------------------------------------------ part 1: known defects
def test_rotary_built_under_float64_default_uses_float64_frequencies(float64_default):
    """Built under ``set_default_dtype(float64)`` the frequencies were float32 (``10000^{-1/4}``
    off by 1.5e-9): rotations at position 3000 off by ~1e-6 against the equation, and against the
    same module cast with ``.double()``."""
    built = RotaryEmbedding(8, theta=10000.0)
    torch.set_default_dtype(torch.float32)
    cast = RotaryEmbedding(8, theta=10000.0).double()
    assert built.inv_freq.dtype == torch.float64 and built.base_inv_freq.dtype == torch.float64
    x = torch.randn(1, 3, 2, 8, dtype=torch.float64)
    want = _hand_rotary(x, 10000.0, 8, offset=3000)
    for m in (built, cast):
        got = m(x, offset=3000)
        assert (got - want).abs().max() < 1e-12
    # partial rotary too: the last D − R channels pass unchanged
    part = RotaryEmbedding(8, rotary_dim=4)
    torch.set_default_dtype(torch.float64)
    part64 = RotaryEmbedding(8, rotary_dim=4)
    y = part64(x, offset=1000)
    assert torch.equal(y[..., 4:], x[..., 4:])
    assert (y[..., :4] - _hand_rotary(x[..., :4], 10000.0, 4, offset=1000)).abs().max() < 1e-12
    assert (part.double()(x, offset=1000) - y).abs().max() < 1e-13


def test_retnet_built_under_float64_default_equals_double_cast(float64_default):
    """RetNet's log γ and its rotary frequencies were float32 buffers when the model was built
    under the float64 default dtype: outputs 2e-8 away from the same weights cast with
    ``.double()``. Now both are float64 and agree to rounding."""
    torch.manual_seed(0)
    built = GatedLinearAttention(16, n_heads=4, gate="retnet")
    assert built.log_gamma.dtype == torch.float64
    want = torch.tensor([math.log1p(-(2.0 ** (-5 - h))) for h in range(4)], dtype=torch.float64)
    assert torch.equal(built.log_gamma, want)
    torch.set_default_dtype(torch.float32)
    cast = GatedLinearAttention(16, n_heads=4, gate="retnet").double()
    cast.load_state_dict(built.state_dict())
    x = torch.randn(2, 50, 16, dtype=torch.float64)
    with torch.no_grad():
        ya, sa = built(x)
        yb, sb = cast(x)
    assert (ya - yb).abs().max() < 1e-13 * ya.abs().max()
    assert (sa.memory - sb.memory).abs().max() < 1e-13 * sa.memory.abs().max()


def test_moe_balancing_bias_follows_the_float64_default(float64_default):
    built = MoE(8, n_experts=4, top_k=2, expert_hidden=8, bias_balancing=True)
    assert built.expert_bias.dtype == torch.float64
    torch.set_default_dtype(torch.float32)
    assert (
        MoE(8, n_experts=4, top_k=2, expert_hidden=8, bias_balancing=True).expert_bias.dtype == torch.float32
    )


def test_retnet_preset_has_the_papers_value_width():
    """RetNet (Sun et al. 2023, §3.1): ``W_Q, W_K ∈ R^{d×d}``, ``W_V, W_G ∈ R^{d×2d}``,
    ``W_O ∈ R^{2d×d}`` — values (and the gate) twice the keys' width, ``8 d²`` weights in the
    retention. The preset had ``expand_v = 1`` (``6 d²``)."""
    d, H = 16, 4
    m = MIXERS["retnet"](d, n_heads=H)
    assert m.key_dim == d // H and m.value_dim == 2 * d // H
    n_weights = sum(p.numel() for n, p in m.named_parameters() if not n.startswith("norm."))
    assert n_weights == 8 * d * d
    assert tuple(m.o_proj.weight.shape) == (d, 2 * d) and tuple(m.out_gate.weight.shape) == (2 * d, d)
    # the decode still equals the full pass at the new width
    torch.manual_seed(0)
    x = torch.randn(1, 7, d)
    with torch.no_grad():
        full, _ = m(x)
        st, steps = None, []
        for t in range(7):
            y, st = m(x[:, t : t + 1], st)
            steps.append(y)
    assert (torch.cat(steps, 1) - full).abs().max() < 1e-5


# ------------------------------------------------------------------ part 2: break-it review
@pytest.mark.parametrize("dim", [-3, 0, 2.0, True])
def test_rmsnorm_refuses_a_bad_dim_by_name(dim):
    """``RMSNorm(-3)`` raised torch's "negative dimension" RuntimeError, ``RMSNorm(0)`` built a norm
    no input fits."""
    with pytest.raises(ValueError, match=rf"dim: expected an int >= 1 .*got {dim!r}"):
        RMSNorm(dim)


def test_rmsnorm_names_an_input_of_the_wrong_width():
    """A ``[..., 3]`` input to ``RMSNorm(4)`` raised torch's RuntimeError about ``normalized_shape``
    (the gated form already named ``x``); now a ValueError naming ``x``, expected and received."""
    norm = RMSNorm(4)
    with pytest.raises(ValueError, match=r"x: expected shape \[\.\.\., dim = 4\], got \[2, 3\]"):
        norm(torch.randn(2, 3))
    with pytest.raises(ValueError, match=r"x: expected shape \[\.\.\., dim = 4\], got \[2, 5, 3\]"):
        norm(torch.randn(2, 5, 3), torch.randn(2, 5, 3))
    x = torch.randn(3, 4, dtype=torch.float64)
    want = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5)
    assert (norm.double()(x) - want).abs().max() < 1e-15
