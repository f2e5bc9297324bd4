"""Session 43, area H: decoding-state dtypes and the remaining bf16 paths.

* The Titans mixers (the memory layer, MAC, MAG, MAL) refuse an input of another dtype than their
  first projection's weights outside autocast with a ``ValueError`` naming ``x`` (was torch's
  unnamed "expected m1 and m2 to have the same dtype"); under autocast it stays legal.
* The matrix-memory mixers (linear attention, GLA / RetNet, DeltaNet) take the CMS rule for a state
  of another dtype (:func:`~mnemo.layers.base.check_state_dtype`): float64 on one side only is a
  ``ValueError`` naming the entry (a float64 state into a float32 layer was computed in float64 and
  came back float64); the float32 memory a bf16 layer makes, and the bf16 conv tail an autocast
  run leaves, keep working.
* FAVOR+ on a bf16 input and GLA's map from a bf16 layer's hook values are computed in float32
  (FAVOR+ rounded once to bf16); float32 / float64 results bitwise unchanged.
"""

from __future__ import annotations

import math

import pytest
import torch

from mnemo.layers import state as S
from mnemo.layers.linear_attention import GatedLinearAttention
from mnemo.layers.registry import MIXERS
from mnemo.ops.feature_maps import FavorPlus

U_BF16 = 2.0**-8  # bf16's unit roundoff: one rounding is off by at most this, relative
TITANS = ["neural_memory", "titans_mag", "titans_mal", "titans_mac"]
MATRIX = ["linear_attention", "gla", "retnet", "deltanet", "gated_deltanet"]


def _build(name: str, dtype: torch.dtype = torch.float32, **kw):
    torch.manual_seed(0)
    return MIXERS[name](16, n_heads=2, **kw).to(dtype)


@pytest.mark.parametrize("name", TITANS)
def test_titans_input_of_another_dtype_is_refused_by_name(name):
    layer = _build(name)
    x = torch.randn(1, 3, 16)
    for layer_dtype, x_dtype in (
        (torch.float32, torch.float64),
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.float32),
    ):
        with pytest.raises(ValueError, match=rf"x: expected dtype {layer_dtype}.*got {x_dtype}"):
            layer.to(layer_dtype)(x.to(x_dtype))


@pytest.mark.parametrize("name", ["neural_memory", "titans_mac"])
def test_titans_input_of_another_dtype_is_legal_under_autocast(name):
    """Under autocast every use of ``x`` is a projection autocast casts to bf16: a bf16 input gives
    what the float32 input of the same values gives."""
    layer = _build(name)
    x = torch.randn(1, 3, 16).to(torch.bfloat16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        y_bf16, _ = layer(x)
        y_fp32, _ = layer(x.float())
    assert torch.equal(y_bf16, y_fp32)


@pytest.mark.parametrize("name", MATRIX)
def test_matrix_state_with_float64_on_one_side_is_refused_by_name(name):
    """A float64 state into a float32 layer was computed in float64 and returned a float64 memory
    (the model's state dtype changed silently); a float32 state into a float64 layer was read in
    float64 after float32 rounding. Both are refused, naming the entry."""
    x = torch.randn(1, 3, 16)
    layer = _build(name)
    _, st = layer(x)
    assert st.memory.dtype == torch.float32
    with pytest.raises(
        ValueError, match=r"state\.memory: expected dtype torch\.float32 .*got torch\.float64"
    ):
        layer(x[:, :1], S.to(st, torch.float64))
    with pytest.raises(
        ValueError, match=r"state\.memory: expected dtype torch\.float64 .*got torch\.float32"
    ):
        layer.double()(x[:, :1].double(), st)


@pytest.mark.parametrize("name", MATRIX)
def test_matrix_state_a_bf16_layer_makes_keeps_working(name):
    """A bf16 layer keeps its memory in float32 (and a float32 layer under bf16 autocast leaves bf16
    conv tails): decoding with that state gives the full pass's last token (recurrent form both
    times, so the same arithmetic) and keeps the state's dtypes."""
    x = torch.randn(1, 4, 16)
    layer = _build(name, torch.bfloat16)
    with torch.no_grad():
        y_full, _ = layer(x.bfloat16(), mode="recurrent")
        _, st = layer(x[:, :3].bfloat16(), mode="recurrent")
        assert st.memory.dtype == torch.float32
        y_last, st2 = layer(x[:, 3:].bfloat16(), st)
    assert y_last.dtype == torch.bfloat16 and st2.memory.dtype == torch.float32
    torch.testing.assert_close(y_last, y_full[:, 3:], rtol=2 * U_BF16, atol=1e-3)
    f32 = _build(name)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        _, st = f32(x[:, :3])
        y, st2 = f32(x[:, 3:], st)
    assert y.shape == (1, 1, 16) and st2.memory.dtype == torch.float32


@pytest.mark.parametrize("name", TITANS[1:])
def test_titans_state_with_float64_on_one_side_is_refused_by_name(name):
    """MAG, MAL, MAC given a float64 state in a float32 layer failed inside attention or a matmul with
    torch's unnamed dtype error; the state a bf16 layer makes itself (float32 fast weights, bf16
    caches) decodes on, and equals the full pass's last token."""
    x = torch.randn(1, 4, 16)
    layer = _build(name)
    _, st = layer(x[:, :3])
    with pytest.raises(
        ValueError, match=r"state\.memory\.weights\[0\]: expected dtype torch\.float32 .*got torch\.float64"
    ):
        layer(x[:, 3:], S.to(st, torch.float64))
    layer = layer.to(torch.bfloat16)
    xb = x.to(torch.bfloat16)
    with torch.no_grad():
        y_full, _ = layer(xb)
        _, st = layer(xb[:, :3])
        assert {t.dtype for t in S.tensors(st)} == {torch.float32, torch.bfloat16}
        y_last, _ = layer(xb[:, 3:], st)
    assert y_last.dtype == torch.bfloat16
    torch.testing.assert_close(y_last, y_full[:, 3:], rtol=4 * U_BF16, atol=1e-2)


def _favor_by_hand(fm: FavorPlus, x: torch.Tensor) -> torch.Tensor:
    """``φ(x) = exp(W x − ‖x‖²/2) / √m`` (Choromanski et al. 2021, Lemma 1) in float64."""
    W, xd = fm.projection.double(), x.double()
    return torch.exp(xd @ W.T - 0.5 * (xd * xd).sum(-1, keepdim=True)) / math.sqrt(W.shape[0])


def test_favor_bf16_input_rounds_once():
    """From the same bf16 values: the bf16 ``exp`` of a bf16 exponent was 0.10 = 27 u off;
    computed in float32 and rounded once it is within one rounding."""
    torch.manual_seed(0)
    fm = FavorPlus(16, 32)
    x = torch.randn(4, 8, 16).to(torch.bfloat16)
    y = fm(x)
    assert y.dtype == torch.bfloat16
    exact = _favor_by_hand(fm, x)
    rel = ((y.double() - exact).abs() / exact.abs()).max().item()
    assert rel <= U_BF16 * (1 + 1e-3), rel


def test_favor_fp32_fp64_unchanged():
    torch.manual_seed(0)
    fm = FavorPlus(16, 32)
    for dtype in (torch.float32, torch.float64):
        x = torch.randn(4, 8, 16, dtype=dtype)
        w = fm.projection.to(dtype)
        old = (x @ w.T - 0.5 * (x * x).sum(-1, keepdim=True)).exp() / math.sqrt(32)  # the formula before
        assert torch.equal(fm(x), old)


@pytest.mark.parametrize("gate", ["gla", "retnet"])
def test_gla_mixing_map_in_float32(gate):
    """GLA's map ``M_ts = K^{-1/2} Σ_k q_tk k_sk exp(Σ_{s<r≤t} g_rk)`` (``s ≤ t``; RetNet: one
    ``g`` per head) from a bf16 layer's hook values, against the map by hand in float64: float32
    accuracy (the bf16 map was up to 5.0e-3 off, float32 9.9e-8)."""
    torch.manual_seed(0)
    layer = GatedLinearAttention(32, n_heads=2, gate=gate).to(torch.bfloat16)
    acts = layer.mixing_acts(torch.randn(1, 12, 32).to(torch.bfloat16))
    M = layer.mixing(acts).maps
    q, k, g = (acts[n].double() for n in ("hook_q", "hook_k", "hook_g"))  # [B, T, H, K], g [B, T, H(, K)]
    if g.ndim == 3:
        g = g[..., None].expand_as(q)
    T, K = q.shape[1], q.shape[-1]
    exact = torch.zeros(1, 2, T, T, dtype=torch.float64)
    for t in range(T):
        for s in range(t + 1):
            decay = torch.exp(g[:, s + 1 : t + 1].sum(1))  # [B, H, K]
            exact[:, :, t, s] = (q[:, t] * k[:, s] * decay).sum(-1) / math.sqrt(K)
    assert M.dtype == torch.float32
    assert (M.double() - exact).abs().max().item() < 1e-5
