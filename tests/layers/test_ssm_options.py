"""Mamba / Mamba-2 options used by released checkpoints, against an independent token-loop
computation of the original equations (float64, relative RMS error <= 1e-10)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mnemo.layers.ssm import Mamba, Mamba2
from mnemo.testing.mixers import check_mixer
from tests.helpers import rel_rms

TOL = 1e-10


def _randomise(m: torch.nn.Module, seed: int = 0) -> None:
    """Every parameter random (biases and norm weights too, so that each one matters)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=g, dtype=p.dtype) * 1.5 - 0.5)
            elif name.endswith("dt_proj.bias") or name.endswith("dt_bias"):
                p.copy_(torch.rand(p.shape, generator=g, dtype=p.dtype) * 2 - 3)
            else:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)


def _conv(x, w, b):
    """Causal depthwise convolution by its definition: ``y_t = Σ_i w[:, i] x_{t−W+1+i} + b``."""
    Bsz, T, C = x.shape
    W = w.shape[-1]
    y = torch.zeros_like(x)
    for t in range(T):
        for i in range(W):
            s = t - W + 1 + i
            if s >= 0:
                y[:, t] += w[:, 0, i] * x[:, s]
    return F.silu(y + (0 if b is None else b))


def _lin(x, lin):
    return x @ lin.weight.T + (0 if lin.bias is None else lin.bias)


def ref_mamba2(m: Mamba2, x: torch.Tensor) -> torch.Tensor:
    """Mamba-2 (mamba-ssm ``Mamba2`` with ``rmsnorm=True``) one token at a time."""
    Bsz, T, _ = x.shape
    Din, G, N, H, P = m.d_inner, m.n_groups, m.d_state, m.n_heads, m.head_dim
    z, xBC, dt = _lin(x, m.in_proj).split([Din, Din + 2 * G * N, H], -1)
    xBC = _conv(xBC, m.conv.weight, m.conv.bias)
    xs, Bm, Cm = xBC.split([Din, G * N, G * N], -1)
    dt = F.softplus(dt + m.dt_bias).clamp(*m.dt_limit)
    A = -m.A_log.exp()
    D = m.D.view(H, P) if m.D_has_hdim else m.D[:, None].expand(H, P)
    h = x.new_zeros(Bsz, H, P, N)
    ys = []
    for t in range(T):
        yt = x.new_zeros(Bsz, H, P)
        for hd in range(H):
            grp = hd // (H // G)
            b_t, c_t = Bm[:, t, grp * N : (grp + 1) * N], Cm[:, t, grp * N : (grp + 1) * N]
            x_t = xs[:, t, hd * P : (hd + 1) * P]
            h[:, hd] = torch.exp(dt[:, t, hd] * A[hd])[:, None, None] * h[:, hd] + (
                dt[:, t, hd][:, None, None] * x_t[:, :, None] * b_t[:, None, :]
            )
            yt[:, hd] = (h[:, hd] @ c_t[:, :, None])[..., 0] + D[hd] * x_t
        ys.append(yt.reshape(Bsz, Din))
    y = torch.stack(ys, 1)
    gate = F.silu(z)
    v = y if m.norm_before_gate else y * gate
    gs = Din // m.norm_groups
    out = torch.empty_like(v)
    for k in range(m.norm_groups):
        part = v[..., k * gs : (k + 1) * gs]
        out[..., k * gs : (k + 1) * gs] = part / torch.sqrt(part.pow(2).mean(-1, keepdim=True) + m.norm.eps)
    out = out * m.norm.weight
    if m.norm_before_gate:
        out = out * gate
    return _lin(out, m.o_proj)


def ref_mamba(m: Mamba, x: torch.Tensor) -> torch.Tensor:
    """Mamba (S6, mamba-ssm ``Mamba``) one token at a time."""
    Din, N, R = m.d_inner, m.d_state, m.dt_rank
    u, z = _lin(x, m.in_proj).split([Din, Din], -1)
    u = _conv(u, m.conv.weight, m.conv.bias)
    dt, Bm, Cm = (u @ m.x_proj.weight.T).split([R, N, N], -1)
    delta = F.softplus(dt @ m.dt_proj.weight.T + m.dt_proj.bias)
    A = -m.A_log.exp()
    h = x.new_zeros(x.shape[0], Din, N)
    ys = []
    for t in range(x.shape[1]):
        h = (
            torch.exp(delta[:, t, :, None] * A) * h
            + delta[:, t, :, None] * Bm[:, t, None, :] * u[:, t, :, None]
        )
        ys.append((h @ Cm[:, t, :, None])[..., 0] + m.D * u[:, t])
    return _lin(torch.stack(ys, 1) * F.silu(z), m.o_proj)


MAMBA2_CASES = {
    "groups4": dict(n_groups=4),
    "groups2_bias": dict(n_groups=2, bias=True, conv_bias=False),
    "dt_limit": dict(n_groups=1, dt_limit=(0.05, 0.3)),
    "D_has_hdim": dict(n_groups=2, D_has_hdim=True),
    "norm_before_gate": dict(n_groups=4, norm_before_gate=True, norm_eps=1e-3),
    "norm_groups1": dict(n_groups=4, norm_groups=1),
}


def _mamba2(opts):
    m = Mamba2(16, d_state=4, head_dim=4, chunk_size=4, **opts).double()
    _randomise(m)
    return m


@pytest.mark.parametrize("case", sorted(MAMBA2_CASES))
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_mamba2_options_match_hand_computation(case, mode):
    m = _mamba2(MAMBA2_CASES[case])
    x = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref = ref_mamba2(m, x)
    y, _ = m(x, mode=mode)
    assert rel_rms(y, ref) <= TOL
    # token steps with the state give the same
    state, outs = None, []
    for t in range(x.shape[1]):
        o, state = m(x[:, t : t + 1], state)
        outs.append(o)
    assert rel_rms(torch.cat(outs, 1), ref) <= TOL


def test_mamba2_groups_normalise_per_group():
    """With ``n_groups > 1`` the gated norm is per group (the original): scaling one group's
    channels of ``y ⊙ silu(z)`` leaves the other groups' outputs unchanged."""
    m = _mamba2(dict(n_groups=4))
    gen = torch.Generator().manual_seed(0)  # (unseeded draws failed the eps-limited check below at times)
    y = torch.randn(1, 3, m.d_inner, dtype=torch.float64, generator=gen)
    z = torch.randn(1, 3, m.d_inner, dtype=torch.float64, generator=gen)
    a = m._gated_norm(y, z)
    gs = m.d_inner // 4
    y2 = y.clone()
    y2[..., :gs] *= 10
    b = m._gated_norm(y2, z)
    assert torch.allclose(a[..., gs:], b[..., gs:], rtol=1e-12, atol=0)
    assert torch.allclose(a[..., :gs], b[..., :gs], rtol=1e-3)  # a group's own scale cancels too
    # the legacy norm_groups=1 normalises all of d_inner
    m.norm.groups = 1
    assert not torch.allclose(m._gated_norm(y, z)[..., gs:], m._gated_norm(y2, z)[..., gs:])


def test_mamba2_n_groups_1_unchanged():
    """``n_groups = 1`` keeps the former computation: ``RMSNorm(d_inner)(y ⊙ silu(z))``."""
    m = _mamba2(dict(n_groups=1))
    y = torch.randn(2, 3, m.d_inner, dtype=torch.float64)
    z = torch.randn(2, 3, m.d_inner, dtype=torch.float64)
    v = y * F.silu(z)
    expected = v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + m.norm.eps) * m.norm.weight
    assert rel_rms(m._gated_norm(y, z), expected) <= 1e-14


@pytest.mark.parametrize(
    "opts", [dict(bias=True), dict(conv_bias=False), dict(bias=True, conv_bias=False, dt_rank=3)]
)
def test_mamba_options_match_hand_computation(opts):
    m = Mamba(8, d_state=4, chunk_size=4, **opts).double()
    _randomise(m)
    assert (m.in_proj.bias is not None) == opts.get("bias", False)
    assert (m.conv.bias is not None) == opts.get("conv_bias", True)
    x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    ref = ref_mamba(m, x)
    for mode in ("chunk", "recurrent"):
        assert rel_rms(m(x, mode=mode)[0], ref) <= TOL


def test_parameter_shapes():
    m = Mamba2(16, d_state=4, head_dim=4, D_has_hdim=True, bias=True, conv_bias=False)
    assert m.D.shape == (32,) and m.in_proj.bias is not None and m.o_proj.bias is not None
    assert m.conv.bias is None and m.norm.eps == 1e-5
    with pytest.raises(ValueError, match="dt_limit"):
        Mamba2(16, dt_limit=(1.0, 0.1))
    with pytest.raises(ValueError, match="norm_groups"):
        Mamba2(16, head_dim=4, norm_groups=5)


@pytest.mark.parametrize(
    "name,options",
    [
        ("mamba", {"d_state": 4, "chunk_size": 4, "bias": True, "conv_bias": False}),
        (
            "mamba2",
            {
                "d_state": 4,
                "head_dim": 8,
                "n_groups": 2,
                "chunk_size": 4,
                "bias": True,
                "conv_bias": False,
                "dt_limit": (0.01, 0.5),
                "D_has_hdim": True,
                "norm_before_gate": True,
            },
        ),
    ],
)
def test_generic_mixer_checks_with_options(name, options):
    """Streaming splits, token steps, state size, hooks, maps, gradients, cached decoding."""
    failed = [r for r in check_mixer(name, 32, options) if not r.passed]
    assert not failed, failed


def test_dt_limit_default_is_no_clamp():
    assert Mamba2(16).dt_limit == (0.0, math.inf)


@pytest.mark.parametrize("point", ["hook_g", "hook_B"])
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_mamba2_a_hook_that_changes_its_value_in_place_replaces_it(point, mode):
    """A hook on hook_g / hook_B that scales its value in place and returns it acts as one that
    returns the scaled copy, in every form: before, the chunk form saw the same tensor object come
    back and ran the op on the unhooked dt·A (or the grouped B), dropping the intervention."""
    m = _mamba2(dict(n_groups=2))
    x = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    hook = getattr(m, point)
    plain, _ = m(x, mode=mode)
    with torch.no_grad():
        h = hook.register_forward_hook(lambda mod, i, out: out * 0.5)
        copy, _ = m(x, mode=mode)
        h.remove()
        h = hook.register_forward_hook(lambda mod, i, out: out.mul_(0.5))
        inplace, _ = m(x, mode=mode)
        h.remove()
    assert rel_rms(copy, plain) > 1e-3  # the intervention matters
    assert rel_rms(inplace, copy) <= TOL
