"""Mutation review (seed 42) of the code changed on the day of commit a737d57..: the sigmoid scores
and float64 bias step of the MoE, the learned affine of the memory's inner layer norm, the gated
RMSNorm's PyTorch form and ``l2_normalize``. Every expected value is computed by hand (float64)
from the formula the docstring states, never by the code under test."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from mnemo.layers.delta import l2_normalize
from mnemo.layers.moe import MoE
from mnemo.layers.norm import gated_rms_norm
from mnemo.memory import neural_memory, preset
from mnemo.memory.objective import memory_apply
from mnemo.memory.state import init_state

D64 = torch.float64


# ---- MoE: DeepSeek-V3's sigmoid affinities -------------------------------------------------------


def _moe(score="sigmoid", norm_topk_prob=True, d=4, E=4, H=3, k=2, seed=0, **kw):
    torch.manual_seed(seed)
    m = MoE(d, n_experts=E, top_k=k, expert_hidden=H, norm_topk_prob=norm_topk_prob, score=score, **kw)
    m = m.double().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p))
    return m


def _hand_moe(m, x):
    """``y = Σ_{e ∈ TopK(s)} w_e SwiGLU_e(x)``, ``s = σ(z)`` or ``softmax(z)``, ``w_e = s_e / Σ_TopK s``
    or ``s_e``; the aux loss ``E Σ_e f_e P_e`` with ``P_e = mean_n s_ne / Σ_e' s_ne'`` (the softmax
    sums to 1 already); loops over tokens and experts."""
    xf = x.reshape(-1, x.shape[-1])
    Wr, w_in, w_out = m.router.weight.detach(), m.w_in.detach(), m.w_out.detach()
    E, k, H = m.n_experts, m.top_k, m.hidden
    ys, counts, P = [], [0] * E, [0.0] * E
    for xn in xf:
        z = [float(Wr[e] @ xn) for e in range(E)]
        if m.score == "sigmoid":  # log σ(z), stable for z ≈ −1000 (where σ(z) itself is 0 in float64)
            ls = [-math.log1p(math.exp(-t)) if t > 0 else t - math.log1p(math.exp(t)) for t in z]
        else:  # log softmax(z)
            zmax = max(z)
            ls = [t - zmax - math.log(sum(math.exp(u - zmax) for u in z)) for t in z]
        s = [math.exp(t) for t in ls]
        top = sorted(range(E), key=lambda e: -z[e])[:k]
        lse = max(ls[e] for e in top)
        tot = sum(math.exp(ls[e] - lse) for e in top)  # s_e / Σ_TopK s = exp(ls_e − lse) / tot
        y = torch.zeros(x.shape[-1], dtype=D64)
        for e in top:
            w = math.exp(ls[e] - lse) / tot if m.norm_topk_prob else s[e]
            gate, up = w_in[e, :H] @ xn, w_in[e, H:] @ xn
            y = y + w * (w_out[e] @ (gate * torch.sigmoid(gate) * up))
            counts[e] += 1
        ys.append(y)
        all_s = sum(s)
        for e in range(E):
            P[e] += (s[e] / all_s if all_s > 0 else 0.0) / len(xf)
    N = len(xf)
    aux = E * sum(counts[e] / (N * k) * P[e] for e in range(E))
    return torch.stack(ys).reshape(x.shape), aux, counts


@pytest.mark.parametrize("score", ["sigmoid", "softmax"])
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_scores_output_and_aux_loss_by_hand(norm_topk_prob, score):
    m = _moe(score=score, norm_topk_prob=norm_topk_prob)
    x = torch.randn(2, 3, 4, dtype=D64)  # N = 6 tokens != E = 4 experts; 3-D input
    want, aux, counts = _hand_moe(m, x)
    y = m(x)
    torch.testing.assert_close(y, want, atol=1e-12, rtol=0)
    assert m.last_counts.tolist() == counts
    assert abs(float(m.last_aux_loss.detach()) - aux) < 1e-12
    # the unnormalised sigmoid scores are not a softmax: the other score gives another output
    other = _moe(score="softmax" if score == "sigmoid" else "sigmoid", norm_topk_prob=norm_topk_prob)
    assert (other(x) - y).abs().max() > 1e-3


def test_sigmoid_aux_loss_finite_when_every_score_of_a_token_underflows():
    """A token with every σ(z_e) = 0 (z ≈ −1000 in float64) adds nothing to P (0 / tiny), not NaN."""
    m = _moe()
    with torch.no_grad():
        m.router.weight.zero_()
        m.router.weight[:, 0] = -1.0
        m.router.weight[:, 1] = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=D64)
    x = torch.tensor([[1000.0, 1.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0], [0.0, -2.0, 0.0, 0.0]], dtype=D64)
    want, aux, counts = _hand_moe(m, x)
    y = m(x)
    assert torch.isfinite(y).all() and math.isfinite(float(m.last_aux_loss.detach()))
    torch.testing.assert_close(y, want, atol=1e-12, rtol=1e-13)  # |y| ~ 1e4 on the first token
    assert abs(float(m.last_aux_loss.detach()) - aux) < 1e-12


def test_update_bias_sign_step_by_hand():
    """``b_e += u · sign(c̄ − c_e)``: a balanced expert (c_e = c̄) gets no step; fp16 counts whose
    sum overflows float16 still step (widened first)."""
    m = _moe(bias_balancing=True, bias_update_rate=0.5)
    m.update_bias(torch.tensor([3, 1, 2, 2]))  # c̄ = 2
    assert m.expert_bias.tolist() == [-0.5, 0.5, 0.0, 0.0]
    m.expert_bias.zero_()
    m.update_bias(torch.tensor([60000.0, 60000.0, 60000.0, 50000.0], dtype=torch.float16))
    assert m.expert_bias.tolist() == [-0.5, -0.5, -0.5, 0.5]


# ---- the inner layer norm's learned affine (TTT) ---------------------------------------------------


def _hand_ln(h, gamma, beta):
    mu = h.mean(-1, keepdim=True)
    var = ((h - mu) ** 2).mean(-1, keepdim=True)
    return gamma * (h - mu) / torch.sqrt(var + 1e-5) + beta


def test_memory_apply_affine_norm_by_hand():
    g = torch.Generator().manual_seed(3)
    spec = preset("ttt_linear", chunk_size=2)
    W = torch.randn(2, 3, 4, 4, generator=g, dtype=D64)  # [B, H, in, out]
    x = torch.randn(2, 3, 5, 4, generator=g, dtype=D64)  # [B, H, L, in]
    gamma = 1.0 + torch.rand(3, 1, 4, generator=g, dtype=D64)
    beta = torch.randn(3, 1, 4, generator=g, dtype=D64)
    y = memory_apply(spec, [W], x, affine=(gamma, beta))[0]
    torch.testing.assert_close(y, x + _hand_ln(x @ W, gamma, beta), atol=1e-12, rtol=0)


def test_ttt_linear_affine_chunk_form_by_hand():
    """Mini-batch GD of TTT-linear with ``f(x) = x + γ ⊙ LN(x W) + β``: gradients at the chunk-start
    weights of ``½‖f(k_t) − v_t‖²`` (written out: ∂/∂W = k_t ⊗ LN'ᵀ(γ ⊙ e_t)), reads after the step."""
    B, T, H, K, C = 1, 5, 2, 4, 2
    g = torch.Generator().manual_seed(5)
    q = F.normalize(torch.randn(B, T, H, K, generator=g, dtype=D64), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=g, dtype=D64), dim=-1)
    v = torch.randn(B, T, H, K, generator=g, dtype=D64)
    theta = 0.2 + 0.5 * torch.rand(B, T, H, generator=g, dtype=D64)
    W0 = 0.5 * torch.randn(B, H, K, K, generator=g, dtype=D64)
    gamma = 1.0 + 0.5 * torch.randn(H, K, generator=g, dtype=D64)
    beta = 0.3 * torch.randn(H, K, generator=g, dtype=D64)
    spec = preset("ttt_linear", chunk_size=C)
    W, outs = W0.clone(), []
    for t in range(T):
        if t % C == 0:
            A = W.clone()
        for h in range(H):
            kt, ht = k[0, t, h], k[0, t, h] @ A[0, h]
            mu, var = ht.mean(), ((ht - ht.mean()) ** 2).mean()
            r = 1.0 / math.sqrt(float(var) + 1e-5)
            xhat = (ht - mu) * r
            e = kt + gamma[h] * xhat + beta[h] - v[0, t, h]
            gy = gamma[h] * e  # ∂ℓ/∂LN(h)
            dh = r * (gy - gy.mean() - xhat * (gy * xhat).mean())  # layer-norm backward
            W[0, h] = W[0, h] - theta[0, t, h] * torch.outer(kt, dh)
        qt = q[0, t]  # [H, K]
        hq = torch.einsum("hi,hio->ho", qt, W[0])
        outs.append(qt + _hand_ln(hq, gamma, beta))
    want = torch.stack(outs)[None]
    o, st = neural_memory(
        spec, q, k, v, theta, initial_state=init_state(spec, [W0]), output_final_state=True,
        mode="chunk", norm_weight=gamma, norm_bias=beta,
    )  # fmt: skip
    torch.testing.assert_close(o, want, atol=1e-12, rtol=0)
    torch.testing.assert_close(st.weights[0], W, atol=1e-12, rtol=0)


# ---- the gated RMSNorm's PyTorch form (bf16, mixed dtypes) ------------------------------------------


@pytest.mark.parametrize("gate_first", [False, True])
def test_gated_rms_norm_bf16_is_the_rounded_exact_value(gate_first):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 2, 8, generator=g, dtype=D64)
    z = torch.randn(3, 2, 8, generator=g, dtype=D64)
    w = 0.5 + torch.rand(8, generator=g, dtype=D64)
    xb, zb, wb = x.bfloat16(), z.bfloat16(), w.bfloat16()
    xd, zd, wd = xb.double(), zb.double(), wb.double()  # the exact inputs the kernel sees
    gate = zd * torch.sigmoid(zd)
    u = xd * gate if gate_first else xd
    rms = u / torch.sqrt((u * u).mean(-1, keepdim=True) + 1e-5) * wd
    want = rms if gate_first else rms * gate
    y = gated_rms_norm(xb, zb, wb, gate_first=gate_first)
    assert y.dtype == torch.bfloat16
    # rounded once: within half a bf16 ulp of the exact value (plus float32's own error)
    ulp = 2.0 ** (torch.floor(torch.log2(want.abs())) - 7)
    assert ((y.double() - want).abs() <= 0.5 * ulp + 1e-6 * want.abs()).all()
    # mixed dtypes: float32 x, bf16 z -> float32 out, the same value to float32 accuracy
    y32 = gated_rms_norm(xd.float(), zb, wb.float(), gate_first=gate_first)
    assert y32.dtype == torch.float32
    torch.testing.assert_close(y32.double(), want, atol=1e-5, rtol=1e-5)


# ---- l2_normalize ----------------------------------------------------------------------------


def test_l2_normalize_eps_form_and_dim_by_hand():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, 3, 5, generator=g, dtype=D64)
    want = x / torch.sqrt((x * x).sum(-1, keepdim=True) + 0.5)
    torch.testing.assert_close(l2_normalize(x, eps=0.5), want, atol=1e-14, rtol=0)
    unit = x / torch.sqrt((x * x).sum(-1, keepdim=True))
    torch.testing.assert_close(l2_normalize(x), unit, atol=1e-14, rtol=0)
    torch.testing.assert_close(l2_normalize(x, eps=0), unit, atol=1e-14, rtol=0)
    assert l2_normalize(torch.zeros(2, 5, dtype=D64)).eq(0).all()  # a padded token: 0, not NaN


@pytest.mark.parametrize("eps", [None, 1e-6])
def test_l2_normalize_bf16_rounded_once(eps):
    g = torch.Generator().manual_seed(13)
    xb = torch.randn(64, 3, 128, generator=g).bfloat16()
    xd = xb.double()
    want = xd / torch.sqrt((xd * xd).sum(-1, keepdim=True) + (eps or 0.0))
    y = l2_normalize(xb, eps=eps)
    assert y.dtype == torch.bfloat16 and y.shape == xb.shape
    ulp = 2.0 ** (torch.floor(torch.log2(want.abs())) - 7)
    assert ((y.double() - want).abs() <= 0.5 * ulp + 1e-6 * want.abs()).all()


@pytest.mark.parametrize("k", [1, 2])
def test_top1_warning_exactly_for_top_k_1_in_training(k):
    """``top_k=1`` with ``norm_topk_prob=True`` makes every routing weight 1 (``s_e / s_e``): the
    first training forward with gradients warns once; ``top_k=2`` weights are not constant: no
    warning."""
    m = _moe(k=k).train()
    x = torch.randn(5, 4, dtype=D64)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        m(x)
        m(x)
    top1 = [w for w in said if "top_k=1" in str(w.message)]
    assert len(top1) == (1 if k == 1 else 0)


def _hand_gated(x, z, w, gate_first, eps=1e-5):
    gate = z * torch.sigmoid(z)
    u = x * gate if gate_first else x
    rms = u / torch.sqrt((u * u).mean(-1, keepdim=True) + eps) * w
    return rms if gate_first else rms * gate


@pytest.mark.parametrize("gate_first", [False, True])
def test_gated_rms_norm_transposed_rows_by_hand(gate_first):
    """A transposed ``[R, D]`` input (rows 1 apart, channels R apart: not contiguous channels) must be
    copied before the native kernel, which reads each row's channels contiguously."""
    g = torch.Generator().manual_seed(17)
    x = torch.randn(6, 5, generator=g, dtype=D64).t()  # [5, 6], strides (1, 5)
    z = torch.randn(6, 5, generator=g, dtype=D64).t()
    w = 0.5 + torch.rand(6, generator=g, dtype=D64)
    assert x.stride() == (1, 5)
    want = _hand_gated(x, z, w, gate_first)
    torch.testing.assert_close(gated_rms_norm(x, z, w, gate_first=gate_first), want, atol=1e-12, rtol=0)


def test_gated_rms_norm_second_derivative_by_hand():
    """``create_graph=True`` through the kernel's backward: the gradient of a gradient matches the
    hand formula's (float64, autograd of the formula above)."""
    g = torch.Generator().manual_seed(19)
    args = [torch.randn(3, 8, generator=g, dtype=D64) for _ in range(2)] + [
        0.5 + torch.rand(8, generator=g, dtype=D64)
    ]
    c = torch.randn(3, 8, generator=g, dtype=D64)
    out = []
    for fn in (lambda x, z, w: gated_rms_norm(x, z, w), lambda x, z, w: _hand_gated(x, z, w, False)):
        x, z, w = (a.clone().requires_grad_(True) for a in args)
        (gx,) = torch.autograd.grad((fn(x, z, w) * c).sum(), x, create_graph=True)
        out.append(torch.autograd.grad((gx * gx).sum(), (x, z, w)))
    for a, b in zip(*out):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_gated_rms_norm_weight_grad_summed_over_thread_slots():
    """The kernel's backward writes one partial weight gradient per thread slot and sums them: with
    two slots (``torch.set_num_threads(2)``, 4 rows) ``∂/∂w`` is still the hand formula's."""
    g = torch.Generator().manual_seed(23)
    x, z, c = (torch.randn(4, 8, generator=g, dtype=D64) for _ in range(3))
    w = (0.5 + torch.rand(8, generator=g, dtype=D64)).requires_grad_(True)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        (dw,) = torch.autograd.grad((gated_rms_norm(x, z, w) * c).sum(), w)
    finally:
        torch.set_num_threads(before)
    (want,) = torch.autograd.grad((_hand_gated(x, z, w, False) * c).sum(), w)
    torch.testing.assert_close(dw, want, atol=1e-12, rtol=1e-12)


def test_objective_pieces_by_hand():
    """Activation slopes, the GELU pair, the ℓp and coordinate-Huber values and a per-token decay of
    the pre-activation, each against its formula."""
    from mnemo.memory.objective import _act_grad, _GeluWithGrad, _pre_activation, objective_value

    z = torch.linspace(-3.0, 3.0, 13, dtype=D64)
    s = 1.0 / (1.0 + torch.exp(-z))
    torch.testing.assert_close(_act_grad("silu", z), s + z * s * (1 - s), atol=1e-14, rtol=0)
    torch.testing.assert_close(_act_grad("tanh", z), 1.0 / torch.cosh(z) ** 2, atol=1e-14, rtol=0)
    h, d1 = _GeluWithGrad.apply(z)
    Phi = torch.tensor([0.5 * (1 + math.erf(t / math.sqrt(2))) for t in z.tolist()], dtype=D64)
    phi = torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
    torch.testing.assert_close(h, z * Phi, atol=1e-14, rtol=0)
    torch.testing.assert_close(d1, Phi + z * phi, atol=1e-14, rtol=0)
    e = torch.tensor([[0.3, -1.2, 2.0], [0.0, 0.5, -0.1]], dtype=D64)
    v = torch.zeros_like(e)
    lp = preset("ttt_linear", objective="lp", p=3.0, lp_eps=0.1)
    torch.testing.assert_close(
        objective_value(lp, e, v, None), ((e * e + 0.01) ** 1.5 / 3).sum(-1), atol=1e-14, rtol=0
    )
    hub = preset("ttt_linear", objective="huber", huber_mode="coordinate")
    d = torch.tensor([0.4, 0.4], dtype=D64)
    a = e.abs()
    want = torch.where(a <= 0.4, 0.5 * e * e, 0.4 * (a - 0.2)).sum(-1)
    torch.testing.assert_close(objective_value(hub, e, v, d), want, atol=1e-14, rtol=0)
    hh, W = torch.randn(2, 5, 3, dtype=D64), torch.randn(2, 3, 4, dtype=D64)
    rho = torch.rand(2, 5, dtype=D64)  # one decay per token: scales the output
    got = _pre_activation(hh, W, rho, 3, torch.matmul)
    torch.testing.assert_close(got, (hh @ W) * rho[..., None], atol=1e-14, rtol=0)
