"""Options of the (Gated) DeltaNet layer and of softmax attention needed for released checkpoints
(Qwen3-Next): each against an independent hand loop written from the paper's equation, in float64.

    S_t = α_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ        o_t = S_tᵀ q_t / √K
    (Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks", Eq. 10; α_t = 1 for DeltaNet)
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mnemo.layers import Attention, DeltaNet
from mnemo.layers.rotary import RotaryEmbedding
from mnemo.testing.mixers import check_mixer
from tests.helpers import assert_close

D = 24
TOL = 1e-10

QWEN = dict(conv_bias=False, beta_bias=False, qk_norm_eps=1e-6, norm_eps=1e-6)
CASES = {
    "default": {},
    "qk_norm_eps": dict(qk_norm_eps=1e-6),
    "norm_eps": dict(norm_eps=1e-6),
    "value_width": dict(head_dim=6, value_head_dim=10),
    "grouped_v_heads": dict(n_heads=2, n_v_heads=4, head_dim=6, value_head_dim=4),
    "neg_eigval": dict(allow_neg_eigval=True),
    "no_biases": dict(conv_bias=False, beta_bias=False),
    "qwen3_next": dict(n_heads=2, n_v_heads=6, head_dim=8, value_head_dim=4, **QWEN),
    "grouped_no_conv_no_gate": dict(n_heads=1, n_v_heads=3, head_dim=5, value_head_dim=7, short_conv=False,
                                    output_gate=False),
}  # fmt: skip


def make(gated: bool, opts: dict, seed=0) -> DeltaNet:
    torch.manual_seed(seed)
    kw = dict(n_heads=3, chunk_size=8) | opts
    m = DeltaNet(D, gated=gated, **kw).double()
    with torch.no_grad():
        for p in m.parameters():  # larger than init so every path matters numerically
            p.add_(0.2 * torch.randn_like(p))
    return m


def reference(m: DeltaNet, x: torch.Tensor, S0=None, tail=None):
    """The layer written out token by token from its definition (no mnemo op, no conv module)."""
    B, T, _ = x.shape
    Hk, Hv, K, V = m.n_heads, m.n_v_heads, m.head_dim, m.value_head_dim
    G = Hv // Hk
    u = x @ m.qkv_proj.weight.T  # [B, T, C]
    C = u.shape[-1]
    if m.conv is not None:
        Wc = m.conv.kernel_size
        w = m.conv.weight[:, 0, :]  # [C, W], tap W−1 is the current token
        past = torch.zeros(B, C, Wc - 1, dtype=x.dtype) if tail is None else tail
        seq = torch.cat([past.transpose(1, 2), u], 1)  # [B, W−1+T, C]
        c = torch.stack([sum(w[:, i] * seq[:, t + i] for i in range(Wc)) for t in range(T)], 1)
        if m.conv.bias is not None:
            c = c + m.conv.bias
        u, new_tail = F.silu(c), seq[:, -(Wc - 1) :].transpose(1, 2) if Wc > 1 else None
    else:
        u, new_tail = F.silu(u), None
    q = u[..., : Hk * K].reshape(B, T, Hk, K)
    k = u[..., Hk * K : 2 * Hk * K].reshape(B, T, Hk, K)
    v = u[..., 2 * Hk * K :].reshape(B, T, Hv, V)

    def l2(z):
        if m.qk_norm_eps is None:
            return z / z.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        return z / torch.sqrt((z * z).sum(-1, keepdim=True) + m.qk_norm_eps)

    q, k = l2(q), l2(k)
    b = x @ m.beta_proj.weight.T + (0 if m.beta_proj.bias is None else m.beta_proj.bias)
    beta = torch.sigmoid(b) * (2.0 if m.allow_neg_eigval else 1.0)
    if m.gated:
        a = x @ m.a_proj.weight.T + m.dt_bias
        alpha = torch.exp(-torch.exp(m.A_log) * F.softplus(a))
    else:
        alpha = torch.ones(B, T, Hv, dtype=x.dtype)
    S = torch.zeros(B, Hv, K, V, dtype=x.dtype) if S0 is None else S0.clone()
    o = torch.zeros(B, T, Hv, V, dtype=x.dtype)
    eye = torch.eye(K, dtype=x.dtype)
    for bi in range(B):
        for t in range(T):
            for j in range(Hv):
                h = j // G  # value head j reads key/query head h
                kt, qt, vt, bt = k[bi, t, h], q[bi, t, h], v[bi, t, j], beta[bi, t, j]
                S[bi, j] = alpha[bi, t, j] * (eye - bt * torch.outer(kt, kt)) @ S[bi, j] + bt * torch.outer(
                    kt, vt
                )
                o[bi, t, j] = S[bi, j].T @ qt / math.sqrt(K)
    n = o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + m.norm.eps) * m.norm.weight
    if m.g_proj is not None:
        n = n * F.silu((x @ m.g_proj.weight.T).reshape(B, T, Hv, V))
    return n.reshape(B, T, Hv * V) @ m.o_proj.weight.T, S, new_tail


def _x(T, B=2, seed=1):
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
@pytest.mark.parametrize("case", list(CASES))
def test_layer_equals_hand_loop(case, gated):
    m = make(gated, CASES[case])
    x = _x(11)
    y_ref, S_ref, tail_ref = reference(m, x)
    with torch.no_grad():
        for mode in ("chunk", "recurrent", "parallel"):
            y, st = m(x, mode=mode)
            assert_close(y, y_ref, TOL, what=f"{case} {mode} output")
            assert_close(st.memory, S_ref, TOL, what=f"{case} {mode} state")
        # continuing from a state (memory and conv tail) equals continuing the hand loop
        x2 = _x(5, seed=2)
        y2_ref, S2_ref, _ = reference(m, x2, S_ref, tail_ref)
        y2, st2 = m(x2, st)
        assert_close(y2, y2_ref, TOL, what=f"{case} continued output")
        assert_close(st2.memory, S2_ref, TOL, what=f"{case} continued state")
        spec = m.state_spec(2, 16)
        assert spec.memory.shape == st2.memory.shape
        assert (spec.conv is None) == (st2.conv is None)
        if spec.conv is not None:
            assert spec.conv.shape == st2.conv.shape


@pytest.mark.parametrize("case", ["grouped_v_heads", "qwen3_next", "neg_eigval"])
def test_generic_mixer_checks(case):
    """Streaming splits, token steps, state size, hooks, the implicit attention (mixing), gradients
    and cached decoding inside a LanguageModel, with the option on."""
    results = check_mixer("gated_deltanet", D, dict(CASES[case], chunk_size=4))
    failed = [(r.check, r.error, r.message) for r in results if not r.passed]
    assert not failed, failed
    assert "mixing" in {r.check for r in results}


def test_defaults_are_unchanged():
    m = DeltaNet(32, n_heads=4, gated=True)
    assert m.conv.bias is not None and m.beta_proj.bias is not None
    assert m.qk_norm_eps is None and m.norm.eps == 1e-5 and not m.allow_neg_eigval
    assert m.qkv_proj.weight.shape == (3 * 32, 32) and m.state_spec(1).memory.shape == (1, 4, 8, 8)


def test_bad_grouping_is_refused():
    with pytest.raises(ValueError, match="n_v_heads"):
        DeltaNet(D, n_heads=2, n_v_heads=3)


# ------------------------------------------------------------------------------------------------
# attention: output gate, per-head q/k RMSNorm, partial rotary, biases
# ------------------------------------------------------------------------------------------------


def attention_reference(m: Attention, x: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention written out: q/k RMSNorm per head, partial rotary on the first
    ``R`` channels with pairs ``(i, i + R/2)`` and angle ``pos · θ^(−2i/R)``, GQA, sigmoid gate."""
    B, T, _ = x.shape
    H, Hkv, Dh = m.n_heads, m.n_kv_heads, m.head_dim

    def lin(layer, z):
        return z @ layer.weight.T + (0 if layer.bias is None else layer.bias)

    q = lin(m.q_proj, x).reshape(B, T, H, Dh)
    kv = lin(m.kv_proj, x)
    k = kv[..., : Hkv * Dh].reshape(B, T, Hkv, Dh)
    v = kv[..., Hkv * Dh :].reshape(B, T, Hkv, Dh)
    if m.q_norm is not None:

        def rms(z, norm):
            return z / torch.sqrt(z.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight

        q, k = rms(q, m.q_norm), rms(k, m.k_norm)
    R = m.rotary.rotary_dim
    theta = 1000.0
    freq = torch.tensor([theta ** (-2 * i / R) for i in range(R // 2)], dtype=x.dtype)
    # the layer keeps its frequency table in float32 (one rounding): check it, then use it
    assert_close(m.rotary.inv_freq.double(), freq, 1e-7, what="rotary frequencies")
    freq = m.rotary.inv_freq.double()

    def rope(z):
        z = z.clone()
        for t in range(T):
            c, s = torch.cos(t * freq), torch.sin(t * freq)
            a, b = z[:, t, :, : R // 2].clone(), z[:, t, :, R // 2 : R].clone()
            z[:, t, :, : R // 2], z[:, t, :, R // 2 : R] = a * c - b * s, a * s + b * c
        return z

    q, k = rope(q), rope(k)
    k, v = k.repeat_interleave(H // Hkv, 2), v.repeat_interleave(H // Hkv, 2)
    scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(Dh)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("bhts,bshd->bthd", scores.softmax(-1), v)
    if m.gate_proj is not None:
        o = o * torch.sigmoid(lin(m.gate_proj, x).reshape(B, T, H, Dh))
    return lin(m.o_proj, o.reshape(B, T, H * Dh))


ATTN_CASES = {
    "gate": dict(output_gate=True),
    "qk_norm": dict(qk_norm=True, norm_eps=1e-6),
    "partial_rotary": dict(rotary_dim=4),
    "bias": dict(bias=True),
    "qwen3_next": dict(output_gate=True, qk_norm=True, rotary_dim=6, bias=True, norm_eps=1e-6),
}


@pytest.mark.parametrize("case", list(ATTN_CASES))
def test_attention_options_equal_hand_computation(case):
    torch.manual_seed(0)
    m = Attention(D, n_heads=4, n_kv_heads=2, head_dim=12, rope_theta=1000.0, **ATTN_CASES[case]).double()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.2 * torch.randn_like(p))
    x = _x(9)
    ref = attention_reference(m, x)
    with torch.no_grad():
        for mode in ("parallel", "recurrent"):
            assert_close(m(x, mode=mode)[0], ref, TOL, what=f"{case} {mode}")
        y1, st = m(x[:, :4])
        y2, _ = m(x[:, 4:], st)
        assert_close(torch.cat([y1, y2], 1), ref, TOL, what=f"{case} streamed")
    results = check_mixer("attention", D, dict(n_heads=4, n_kv_heads=2, head_dim=12, **ATTN_CASES[case]))
    failed = [(r.check, r.error, r.message) for r in results if not r.passed]
    assert not failed, failed


def test_partial_rotary_matches_transformers_convention():
    """Pairs ``(i, i + R/2)`` inside the first ``R`` channels (``rotate_half`` on ``x[..., :R]``),
    the rest untouched; ``R = D`` is the full rotary as before."""
    x = torch.randn(1, 5, 2, 8, dtype=torch.float64)
    r = RotaryEmbedding(8, 100.0, rotary_dim=4)
    y = r(x, offset=3)
    assert torch.equal(y[..., 4:], x[..., 4:])
    assert_close(y[..., :4], RotaryEmbedding(4, 100.0)(x[..., :4], offset=3), 1e-15)
    with pytest.raises(ValueError, match="rotary_dim"):
        RotaryEmbedding(8, rotary_dim=3)
