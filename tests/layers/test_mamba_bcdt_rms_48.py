"""Mamba's ``bcdt_rms_eps`` (FalconMamba's weightless RMS normalisation of the Δ input, B and C
before the selective scan): what it computes, by hand on a tiny case; the same function in every
form (chunk, recurrent token loop, one-token steps), values and gradients, from an initial state;
the generic mixer checks; default off; bad values refused by name."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mnemo.layers import Mamba
from mnemo.testing.mixers import check_mixer
from tests.helpers import assert_close

D_MODEL, EPS = 6, 1e-3


def _mamba(eps=EPS, seed=0, **kw) -> Mamba:
    torch.manual_seed(seed)
    m = Mamba(D_MODEL, d_state=3, expand=2, dt_rank=2, conv_size=3, bias=True, bcdt_rms_eps=eps, **kw)
    m = m.double()
    with torch.no_grad():  # off the init, so that every term matters numerically
        for p in m.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return m


def _x(B=2, T=5, seed=1):
    return torch.randn(B, T, D_MODEL, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_the_norm_of_a_vector_by_hand():
    """``[3, 4]``: mean square 12.5, so with ε = 0 the norm gives ``[3, 4] / √12.5``; with ε = 7.5
    it gives ``[3, 4] / √20`` (no weight, last dimension only)."""
    from mnemo.layers.ssm import _weightless_rms

    t = torch.tensor([[3.0, 4.0], [0.0, 2.0]], dtype=torch.float64)
    assert torch.allclose(
        _weightless_rms(t, 0.0)[0], torch.tensor([3, 4], dtype=torch.float64) / math.sqrt(12.5)
    )
    assert torch.allclose(
        _weightless_rms(t, 7.5)[0], torch.tensor([3, 4], dtype=torch.float64) / math.sqrt(20)
    )
    assert torch.allclose(_weightless_rms(t, 0.0)[1], torch.tensor([0.0, math.sqrt(2)], dtype=torch.float64))
    half = _weightless_rms(t.to(torch.bfloat16), 0.0)
    assert half.dtype == torch.bfloat16  # computed in float32, returned in the input's dtype


def test_the_layer_computes_falcon_mambas_function_by_hand():
    """The whole layer against a hand-written token loop: ``u, z = W_in x``, ``u ← silu(conv(u))``,
    ``(dt, B, C) = W_x u``, each divided by ``√(mean(·²) + ε)`` over its own channels, ``Δ =
    softplus(W_dt dt̂ + b)``, ``h_t = exp(Δ_t A) h_{t−1} + Δ_t B̂_t u_t``, ``y_t = Ĉ_t·h_t + D u_t``,
    ``out = W_out (y ⊙ silu(z))``; the hooks see the normalised B, C and the Δ made from dt̂."""
    m = _mamba()
    x = _x(B=1, T=5)
    seen = {}
    for name in ("hook_v", "hook_B", "hook_C", "hook_dt"):
        getattr(m, name).add(lambda v, _, name=name: seen.__setitem__(name, v.clone()))
    y, _ = m(x, mode="chunk")

    u_in, z = m.in_proj(x).chunk(2, dim=-1)
    W, b = m.conv.weight[:, 0, :], m.conv.bias  # [C, K]: a causal depthwise conv, then SiLU
    K = W.shape[-1]
    padded = F.pad(u_in.transpose(1, 2), (K - 1, 0))
    u = F.silu(torch.stack([(padded[..., t : t + K] * W).sum(-1) for t in range(5)], -1) + b[:, None])
    u = u.transpose(1, 2)  # [1, T, d_inner]
    assert_close(seen["hook_v"], u, 1e-12, what="u")
    dt, Bm, Cm = m.x_proj(u).split([2, 3, 3], dim=-1)

    def norm(t):
        return t / torch.sqrt((t * t).sum(-1, keepdim=True) / t.shape[-1] + EPS)

    dt, Bm, Cm = norm(dt), norm(Bm), norm(Cm)
    assert_close(seen["hook_B"], Bm, 1e-12, what="B")
    assert_close(seen["hook_C"], Cm, 1e-12, what="C")
    delta = F.softplus(dt @ m.dt_proj.weight.T + m.dt_proj.bias)
    assert_close(seen["hook_dt"], delta, 1e-12, what="Δ")
    A = -m.A_log.exp()
    h = torch.zeros(m.d_inner, 3, dtype=torch.float64)
    ys = []
    for t in range(5):
        h = torch.exp(delta[0, t, :, None] * A) * h + delta[0, t, :, None] * Bm[0, t] * u[0, t, :, None]
        ys.append(h @ Cm[0, t] + m.D * u[0, t])
    ref = m.o_proj(torch.stack(ys)[None] * F.silu(z))
    assert_close(y, ref, 1e-12, what="layer output")


def test_forms_agree_in_values_and_gradients_from_an_initial_state():
    """Chunk form (chunks of 4) vs the token-loop reference on 21 tokens (odd, several chunks),
    starting from the state another 6 tokens left: outputs, final states, and the gradients of
    both with respect to the input, every parameter and the initial state (float64)."""
    m = _mamba(chunk_size=4)
    with torch.no_grad():
        _, s0 = m(_x(T=6, seed=3))
    x = _x(T=21)
    results = {}
    for mode in ("chunk", "recurrent"):
        m.zero_grad()
        xi = x.clone().requires_grad_(True)
        h0 = s0.ssm.detach().clone().requires_grad_(True)
        y, s = m(xi, type(s0)(ssm=h0, conv=s0.conv, offset=s0.offset), mode=mode)
        (y.square().sum() + s.ssm.sin().sum()).backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters()}
        results[mode] = (y, s.ssm, xi.grad, h0.grad, grads)
    (yc, hc, gxc, ghc, gpc), (yr, hr, gxr, ghr, gpr) = results["chunk"], results["recurrent"]
    assert_close(yc, yr, 1e-10, what="y")
    assert_close(hc, hr, 1e-10, what="final state")
    assert_close(gxc, gxr, 1e-10, what="d/dx")
    assert_close(ghc, ghr, 1e-10, what="d/dh0")
    for n in gpr:
        assert_close(gpc[n], gpr[n], 1e-10, what=f"d/d{n}")


def test_one_token_steps_equal_the_full_pass():
    m = _mamba(chunk_size=4)
    x = _x(T=11)
    full, _ = m(x)
    y, s = m(x[:, :2])
    outs = [y]
    for t in range(2, 11):
        y, s = m(x[:, t : t + 1], s)
        outs.append(y)
    assert_close(torch.cat(outs, 1), full, 1e-10, what="token steps")


def test_the_generic_mixer_checks_pass_with_the_norm():
    for r in check_mixer("mamba", options={"d_state": 4, "chunk_size": 4, "bcdt_rms_eps": 1e-6}):
        assert r.passed, r


def test_default_off_and_the_option_changes_the_function():
    """Default ``None``: the plain Mamba (the same weights give the same output as a layer built
    without the argument); on, the output differs; a huge ε makes dt̂, B̂, Ĉ ≈ t / √ε."""
    torch.manual_seed(0)
    plain = Mamba(D_MODEL, d_state=3).double()
    assert plain.bcdt_rms_eps is None and "bcdt" not in repr(plain)
    on = _mamba(eps=1e-6)
    off = _mamba(eps=None)
    x = _x()
    assert (on(x)[0] - off(x)[0]).abs().max() > 1e-3
    big = _mamba(eps=1e8)
    seen = {}
    big.hook_B.add(lambda v, _: seen.__setitem__("B", v))
    big.hook_v.add(lambda v, _: seen.__setitem__("u", v))
    big(x)
    raw = big.x_proj(seen["u"]).split([2, 3, 3], dim=-1)[1]
    assert_close(seen["B"], raw / 1e4, 1e-6, what="B with a huge ε")


@pytest.mark.parametrize("bad", [-1e-6, float("inf"), float("nan"), "1e-6", True])
def test_a_bad_epsilon_is_refused_by_name(bad):
    with pytest.raises(ValueError, match=r"bcdt_rms_eps: expected a finite number >= 0.*got"):
        Mamba(8, bcdt_rms_eps=bad)
