"""Review 8 of the layers (SSMs, conv, norms, MLP, delta rule, linear attention, base, state):
bf16 rounding of the gated norm and the L2 normalisation against float64 values of the same
inputs, FAVOR+'s arguments named, ``select_rows`` with a tuple, and the documented read-out scale
checked against a hand loop of the hooked values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mnemo.layers import DeltaNet, GatedLinearAttention, LinearAttention, RMSNorm
from mnemo.layers.delta import l2_normalize
from mnemo.layers.norm import gated_rms_norm
from mnemo.layers.state import select_rows

U_BF16 = 2.0**-8  # bf16's unit roundoff (8 significant bits): the largest relative rounding error


def _rel_err(y: torch.Tensor, exact: torch.Tensor) -> float:
    return ((y.double() - exact).abs() / exact.abs().clamp_min(1e-30)).max().item()


def _group_rms(a: torch.Tensor, groups: int, eps: float) -> torch.Tensor:
    g = a.unflatten(-1, (groups, -1))
    return (g / torch.sqrt(g.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)


@pytest.mark.parametrize("gate_first", [False, True])
@pytest.mark.parametrize("groups", [1, 2])
def test_gated_rms_norm_in_bf16_is_the_exact_value_rounded_once(gate_first, groups):
    """``RMSNorm(x) ⊙ w ⊙ silu(z)`` (or ``RMSNorm(x ⊙ silu(z)) ⊙ w``) on bf16 inputs, computed in
    float32 and rounded once, is within bf16's unit roundoff of the float64 value of the same
    inputs. The PyTorch form rounded ``silu(z)``, the normalised value and the product each to
    bf16: up to 2.4 unit roundoffs off, a third of the outputs not the rounded value."""
    g = torch.Generator().manual_seed(0)
    x, z = (torch.randn(64, 32, generator=g).bfloat16() for _ in range(2))
    w = (1 + 0.3 * torch.randn(32, generator=g)).bfloat16()
    y = gated_rms_norm(x, z, w, 1e-5, groups=groups, gate_first=gate_first)
    assert y.dtype == torch.bfloat16
    xd, zd, wd = x.double(), z.double(), w.double()
    if gate_first:
        exact = _group_rms(xd * F.silu(zd), groups, 1e-5) * wd
    else:
        exact = _group_rms(xd, groups, 1e-5) * wd * F.silu(zd)
    assert _rel_err(y, exact) <= U_BF16 * 1.01
    # the module's gated call (GLA, RetNet, Gated DeltaNet's read-out) rounds once too
    n = RMSNorm(32).bfloat16()
    with torch.no_grad():
        n.weight.copy_(w)
    assert torch.equal(n.gated(x, z), gated_rms_norm(x, z, w, 1e-5))


def test_gated_rms_norm_keeps_its_output_dtypes():
    """One rounding changes no dtype: ``x``'s, or PyTorch's promotion of ``x`` and ``z``."""
    x, z, w = torch.randn(3, 4), torch.randn(3, 4), torch.ones(4)
    for xd, zd, out in (
        (torch.bfloat16, torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32, torch.float32),
        (torch.float32, torch.float64, torch.float64),
        (torch.float16, torch.float16, torch.float16),
    ):
        for gate_first in (False, True):
            y = gated_rms_norm(x.to(xd), z.to(zd), w, gate_first=gate_first)
            assert y.dtype == out, (xd, zd, gate_first)


@pytest.mark.parametrize("eps", [None, 1e-6])
def test_l2_normalize_in_bf16_is_the_exact_value_rounded_once(eps):
    """DeltaNet's q/k normalisation on bf16 values is within bf16's unit roundoff of the float64
    value (it rounded each square, the sum and the inverse norm: up to 2.1 unit roundoffs off, which left
    the keys of the delta rule 0.5% off unit length where one rounding leaves 0.16%)."""
    x = (3 * torch.randn(512, 16, generator=torch.Generator().manual_seed(1))).bfloat16()
    y = l2_normalize(x, eps)
    assert y.dtype == torch.bfloat16
    xd = x.double()
    exact = xd / (
        xd.norm(dim=-1, keepdim=True) if eps is None else (xd.pow(2).sum(-1, keepdim=True) + eps).sqrt()
    )
    assert _rel_err(y, exact) <= U_BF16 * 1.01
    # float32 / float64 values are computed as before (no rounding added)
    xf = x.float()
    ref = F.normalize(xf, dim=-1) if eps is None else xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)
    assert torch.equal(l2_normalize(xf, eps), ref)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(num_features=0), "num_features"),  # (was read as "not given": 2 · head_dim features)
        (dict(num_features=2.5), "num_features"),
        (dict(num_features=True), "num_features"),
        (dict(seed="a"), "seed"),  # (a RuntimeError from torch.Generator.manual_seed)
        (dict(seed=1.5), "seed"),
    ],
)
def test_favor_arguments_are_named(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name}: expected"):
        LinearAttention(8, n_heads=2, feature_map="favor", **kwargs)


def test_favor_arguments_still_build():
    m = LinearAttention(8, n_heads=2, feature_map="favor", num_features=3, seed=5)
    assert m.feature_map.num_features == 3 and m.feature_map.seed == 5
    assert LinearAttention(8, n_heads=2, feature_map="favor").feature_map.num_features == 8  # 2 · 4


def test_select_rows_takes_a_tuple_of_rows_as_an_index():
    """``select_rows(state, (2, 0))`` is rows 2 and 0, as a list or an index tensor; it read
    element ``[2, 0]`` of every tensor (the memory ``[B, H, K, V]`` became ``[K, V]``)."""
    torch.manual_seed(0)
    m = DeltaNet(8, n_heads=2, chunk_size=4).double()
    x = torch.randn(3, 6, 8, dtype=torch.float64)
    with torch.no_grad():
        full, _ = m(x)
        _, s = m(x[:, :4])
        picked = select_rows(s, (2, 0))
        assert picked.memory.shape == (2, *s.memory.shape[1:])
        for other in (select_rows(s, [2, 0]), select_rows(s, torch.tensor([2, 0]))):
            assert torch.equal(picked.memory, other.memory) and torch.equal(picked.conv, other.conv)
        y, _ = m(x[[2, 0], 4:], picked)
    assert torch.allclose(y, full[[2, 0], 4:], rtol=0, atol=1e-12)


@pytest.mark.parametrize("gated", [False, True])
def test_deltanet_read_out_scale_is_documented_and_computed(gated):
    """The docstring's ``o_t = S_tᵀ q_t K^{-1/2}``: a hand loop of the delta rule on the hooked
    ``q, k, v, β`` (and ``g``) reproduces ``hook_o`` only with the ``K^{-1/2}`` factor."""
    assert "S_tᵀ q_t K^{-1/2}" in DeltaNet.__doc__
    assert "S_tᵀ q_t K^{-1/2}" in GatedLinearAttention.__doc__
    torch.manual_seed(0)
    m = DeltaNet(8, n_heads=2, gated=gated, chunk_size=2).double()
    acts = m.mixing_acts(torch.randn(2, 5, 8, dtype=torch.float64))
    q, k, v, beta, o = (acts[n] for n in ("hook_q", "hook_k", "hook_v", "hook_beta", "hook_o"))
    g = acts["hook_g"] if gated else torch.zeros_like(beta)
    K = q.shape[-1]
    S = q.new_zeros(2, 2, K, v.shape[-1])
    eye = torch.eye(K, dtype=q.dtype)
    for t in range(5):
        kt, bt = k[:, t], beta[:, t, :, None, None]
        S = g[:, t, :, None, None].exp() * (eye - bt * kt[..., :, None] * kt[..., None, :]) @ S
        S = S + bt * kt[..., :, None] * v[:, t, :, None, :]
        ot = torch.einsum("bhk,bhkv->bhv", q[:, t], S) * K**-0.5
        assert torch.allclose(o[:, t], ot, rtol=0, atol=1e-12), t
