"""Session 43, area A: the dtype rules of the layers.

* A mixer's input of another dtype than its weights, outside autocast, is refused with a
  ``ValueError`` naming ``x``, the expected and the received dtype (it failed inside the first matmul
  with torch's unnamed "expected m1 and m2 to have the same dtype"); under autocast it is legal, and
  on the meta device (where ``torch.is_autocast_enabled("meta")`` raises) a model still runs.
* bf16 rounds once: SwiGLU's gate, Mamba-2's gated norm input and linear attention's implicit map
  (FAVOR+'s ``exp``) are computed in float32 and rounded once; float32 / float64 results unchanged.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mnemo.layers.linear_attention import LinearAttention
from mnemo.layers.mlp import swiglu
from mnemo.layers.registry import MIXERS
from mnemo.layers.ssm import Mamba2

MIXER_NAMES = [
    "attention",
    "linear_attention",
    "gla",
    "retnet",
    "deltanet",
    "gated_deltanet",
    "mamba",
    "mamba2",
]
U_BF16 = 2.0**-8  # bf16's unit roundoff: one rounding is off by at most this, relative


def _build(name: str, dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    kw = {"d_state": 8, "head_dim": 8} if name == "mamba2" else {}
    return MIXERS[name](16, **kw).to(dtype)


@pytest.mark.parametrize("name", MIXER_NAMES)
def test_input_of_another_dtype_is_refused_by_name(name):
    for layer_dtype, x_dtype in (
        (torch.float32, torch.float64),
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.float32),
    ):
        layer = _build(name, layer_dtype)
        x = torch.randn(1, 3, 16).to(x_dtype)
        with pytest.raises(ValueError, match=rf"x: expected dtype {layer_dtype}.*got {x_dtype}"):
            layer(x)


@pytest.mark.parametrize("name", MIXER_NAMES)
def test_input_of_another_dtype_is_legal_under_autocast(name):
    """Under autocast every use of ``x`` is a projection autocast casts to bf16: a bf16 input gives
    what the float32 input of the same values gives."""
    layer = _build(name)
    x = torch.randn(1, 3, 16).to(torch.bfloat16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        y_bf16, _ = layer(x)
        y_fp32, _ = layer(x.float())
    assert torch.equal(y_bf16, y_fp32)


def test_meta_device_runs_and_is_checked():
    """On ``meta`` autocast cannot be asked about (``torch.is_autocast_enabled("meta")`` raises):
    a matching input runs, a mismatched one is named."""
    with torch.device("meta"):
        layer = MIXERS["gated_deltanet"](16)
        y, _ = layer(torch.empty(1, 3, 16))
        assert y.shape == (1, 3, 16) and y.is_meta
        with pytest.raises(ValueError, match="x: expected dtype torch.float32.*got torch.float64"):
            layer(torch.empty(1, 3, 16, dtype=torch.float64))


def test_swiglu_bf16_rounds_once_and_fp32_is_unchanged():
    torch.manual_seed(0)
    h = (torch.randn(64, 256) * 2).to(torch.bfloat16)
    a, b = h.double().chunk(2, dim=-1)
    exact = a * torch.sigmoid(a) * b  # silu(a) ⊙ b on the same (bf16) values
    y = swiglu(h).double()
    keep = exact.abs() > 1e-6
    rel = ((y - exact).abs()[keep] / exact.abs()[keep]).max().item()
    assert rel <= U_BF16 * (1 + 1e-3), rel  # (two roundings: 7.1e-3 = 1.8 u)
    for dtype in (torch.float32, torch.float64):
        hd = h.to(dtype)
        g, u = hd.chunk(2, dim=-1)
        assert torch.equal(swiglu(hd), F.silu(g) * u)  # the formula it always ran


def test_swiglu_bf16_gradient_rounds_once_and_keeps_only_h():
    """With a gradient, bf16 SwiGLU computes ``∂/∂a = dy · b · σ(a)(1 + a(1 − σ(a)))``, ``∂/∂b = dy ·
    silu(a)`` in float32 and rounds once (the bf16 autograd of the PyTorch form: 7.2e-3 = 1.9 u),
    and keeps only ``h`` for the backward (the PyTorch form kept silu's input and the product's two
    operands: 1.5x the bytes of ``h``; a float32 form would keep 2x)."""
    torch.manual_seed(0)
    h = (torch.randn(64, 256) * 2).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(64, 128).to(torch.bfloat16)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(t.numel() * t.element_size()) or t, lambda t: t
    ):
        y = swiglu(h)
    assert sum(saved) == h.numel() * h.element_size()
    (dh,) = torch.autograd.grad(y, h, dy)
    a, b = h.detach().double().chunk(2, dim=-1)
    sig, g = torch.sigmoid(a), dy.double()
    exact = torch.cat([g * b * sig * (1 + a * (1 - sig)), g * a * sig], dim=-1)  # by hand, float64
    keep = exact.abs() > 1e-3
    rel = ((dh.double() - exact).abs()[keep] / exact.abs()[keep]).max().item()
    assert rel <= U_BF16 * (1 + 1e-3), rel
    (g2,) = torch.autograd.grad(swiglu(h), h, dy, create_graph=True)  # twice differentiable
    assert g2.requires_grad and torch.equal(g2, dh)


def _mamba2_parts(dtype):
    """A Mamba-2 layer's ``hook_o``, ``hook_v``, the norm's gate ``z`` and the ``o_proj`` input."""
    torch.manual_seed(0)
    m = Mamba2(32, d_state=8, head_dim=8)
    with torch.no_grad():
        m.norm.weight.uniform_(0.5, 1.5)
        m.D.uniform_(0.5, 1.5)
    m = m.to(dtype)
    got = {}
    hooks = [
        m.hook_o.register_forward_hook(lambda mod, a, out: got.__setitem__("o", out)),
        m.hook_v.register_forward_hook(lambda mod, a, out: got.__setitem__("xs", out)),
        m.norm.register_forward_hook(lambda mod, a, out: got.__setitem__("z", a[1])),
        m.o_proj.register_forward_pre_hook(lambda mod, a: got.__setitem__("y", a[0])),
    ]
    with torch.no_grad():
        m(torch.randn(2, 16, 32).to(dtype))
    for h in hooks:
        h.remove()
    return m, got


def test_mamba2_bf16_gated_norm_rounds_once():
    """``out = RMSNorm(y ⊙ silu(z)) · w`` with ``y = o + D x`` (Dao & Gu 2024 §7), from the same
    ``o``, ``x``, ``z`` in float64: one bf16 rounding (y rounded first: 7.7e-3 = 2 u)."""
    m, got = _mamba2_parts(torch.bfloat16)
    D = m.D.double()[:, None]
    y = (got["o"].double() + got["xs"].double() * D).flatten(-2)
    g = y * F.silu(got["z"].double())
    exact = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + m.norm.eps) * m.norm.weight.double()
    out = got["y"]
    assert out.dtype == torch.bfloat16
    keep = exact.abs() > 1e-6
    rel = ((out.double() - exact).abs()[keep] / exact.abs()[keep]).max().item()
    assert rel <= U_BF16 * (1 + 1e-3), rel


def test_mamba2_fp32_gated_norm_unchanged():
    m, got = _mamba2_parts(torch.float32)
    D = m.D[:, None]
    y_old = (got["o"] + got["xs"] * D).to(got["z"].dtype)  # the formula before: y rounded to z's dtype
    assert torch.equal(got["y"], m.norm.gated(y_old.flatten(-2), got["z"], gate_first=True))


def test_favor_mixing_map_in_float32():
    """Linear attention's map with FAVOR+ ``φ(x) = exp(W x − ‖x‖²/2) / √m`` (Choromanski et al. 2021)
    from a bf16 layer's hook values, against the map by hand in float64: float32 accuracy (bf16
    ``exp`` and map: up to 1.1e-2 off, 6x one rounding)."""
    torch.manual_seed(0)
    layer = LinearAttention(32, n_heads=2, feature_map="favor").to(torch.bfloat16)
    x = torch.randn(1, 12, 32).to(torch.bfloat16)
    acts = layer.mixing_acts(x)
    M = layer.mixing(acts).maps
    W = layer.feature_map.projection.double()  # [m, K]

    def phi(t):
        return torch.exp(t @ W.T - 0.5 * (t * t).sum(-1, keepdim=True)) / math.sqrt(W.shape[0])

    q, k = acts["hook_q"].double(), acts["hook_k"].double()  # [B, T, H, K]
    qf, kf = phi(q / math.sqrt(q.shape[-1])), phi(k)
    T = q.shape[1]
    raw = torch.einsum("bthf,bshf->bhts", qf, kf) * torch.tril(torch.ones(T, T, dtype=torch.float64))
    exact = raw / (raw.sum(-1, keepdim=True) + 1e-6)
    assert M.dtype == torch.float32
    assert (M.double() - exact).abs().max().item() < 1e-5


def test_linear_attention_mixing_fp32_unchanged():
    from mnemo.ops.linear_attention import linear_attention_map

    torch.manual_seed(0)
    layer = LinearAttention(32, n_heads=2, feature_map="favor")
    acts = layer.mixing_acts(torch.randn(1, 6, 32))
    mix = layer.mixing(acts)
    assert torch.equal(mix.maps, linear_attention_map(acts["hook_q"], acts["hook_k"], layer.feature_map))
    assert mix.values is acts["hook_v"] and mix.output is acts["hook_o"]
