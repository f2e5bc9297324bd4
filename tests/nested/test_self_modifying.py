"""Self-modifying Titans (Nested Learning §8.1–8.2, Eq. 83–93): a hand loop written from the
paper's equations against both forms, streaming, gradients, known answers, HOPE decoding; and the
earlier variant, now ``SelfModifyingProjections``."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from mnemo.layers import MIXERS, SelfModifyingProjections, SelfModifyingTitans
from mnemo.models import LanguageModel, build_config
from tests.helpers import assert_close

TOL = 1e-10


def _model(d=8, heads=2, C=4, Cp=3, wa_scale=1.0, **kw):
    """``wa_scale``: multiplies the initial ``W_a`` of every memory; at 3 the hidden inputs
    ``‖σ(k W_a)‖²`` straddle 1 (measured 0.01–11.7 over ``_x()``, 27% above 1), so
    ``hidden_step="nlms"``'s ``max(1, ‖h‖²)`` takes both branches; at 1 they stay below 1
    (measured at most 0.87: the NLMS rate is ``η``)."""
    torch.manual_seed(0)
    m = SelfModifyingTitans(d, n_heads=heads, chunk_size=C, proj_chunk_size=Cp, **kw).double()
    with torch.no_grad():  # larger gates than at init, so the memories really move
        m.eta_bias.fill_(0.5)
        m.alpha_bias.fill_(2.0)
        m.eta_readout.normal_(0, 0.5)
        m.alpha_readout.normal_(0, 0.5)
        m.proj_wb.normal_(0, 0.3)
        m.memory_wb.normal_(0, 0.3)
        m.proj_wa.mul_(wa_scale)
        m.memory_wa.mul_(wa_scale)
    return m


def _x(B=2, T=11, d=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, d, generator=g, dtype=torch.float64)


# ------------------------------------------------------------------------------------------------
# (a) a hand loop written from the paper's equations (column convention, explicit gradients)
# ------------------------------------------------------------------------------------------------


def _gelu_grad(z):
    return 0.5 * (1 + torch.erf(z / math.sqrt(2))) + z * torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)


def paper_loop(m: SelfModifyingTitans, x: torch.Tensor, memory_target: str = "self"):
    """Eq. 83–90 token by token, one sample at a time: memories ``M(x) = x + W1 σ(W2 x)`` as
    ``(W1 [d, h], W2 [h, d])``; chunk-start weights for reads, self-generated values and gradients;
    ``M ← M(αI − η k kᵀ) − η ∇L`` with the rank-one term on ``W2`` (input k) and ``α`` on ``W1``;
    the main memory's target ``M_memory(v_t)`` (Eq. 84/94) or, with ``"value"``, ``v_t``.

    The mixer's choices, as written in its docstring: ``m.v_norm`` — ``v_t = M_v(x_t) / ‖M_v(x_t)‖``;
    ``m.hidden_step == "nlms"`` — ``W1``'s gradient term with the rate ``η / max(1, ‖σ(W2 k)‖²)``
    (``W2`` at the chunk start, where the gradient is taken), ``"plain"`` — with ``η``.
    The mixer's options: ``m.adaptive_q`` — ``q_t = M_q(x_t)`` from a
    fifth projection memory (normalised), rewritten like the others toward ``M_q(v_t)``;
    ``m.momentum = μ`` — dampened momentum on the gradient term, ``G ← μ G − (1 − μ) η ∇L``
    (``η1`` for ``W1``),
    ``W1 ← α W1 + G1``, ``W2 ← W2(αI − η k kᵀ) + G2``."""
    B, T, d = x.shape
    Cp, Cm = m.proj_chunk_size, m.chunk_size
    mu = m.momentum
    n_proj = 5 if m.adaptive_q else 4
    with torch.no_grad():
        xt = m.conv(x)[0] if m.conv is not None else x
        q = None if m.adaptive_q else F.normalize(m.q_proj(xt), dim=-1)
        gate = F.silu(m.g_proj(x))
    I = torch.eye(d, dtype=x.dtype)

    def M(W, z):
        W1, W2 = W
        return z + W1 @ F.gelu(W2 @ z)

    def grad(W, k, vhat):  # ∇ of ½‖M(k) − v̂‖² (v̂ constant)
        W1, W2 = W
        z = W2 @ k
        e = M(W, k) - vhat
        g1 = torch.outer(e, F.gelu(z))
        g2 = torch.outer((W1.T @ e) * _gelu_grad(z), k)
        return g1, g2

    def dgd(W, A, G, k, vhat, alpha, eta):
        g1, g2 = grad(A, k, vhat)
        W1, W2 = W
        hn2 = F.gelu(A[1] @ k).square().sum()  # ‖h‖², the hidden layer's input at the chunk start
        eta1 = eta / max(1.0, hn2.item()) if m.hidden_step == "nlms" else eta
        G = (mu * G[0] - (1 - mu) * eta1 * g1, mu * G[1] - (1 - mu) * eta * g2)  # dampened momentum
        return (alpha * W1 + G[0], W2 @ (alpha * I - eta * torch.outer(k, k)) + G[1]), G

    ys = []
    for b in range(B):
        P = [(m.proj_wb[i].detach().T, m.proj_wa[i].detach().T) for i in range(n_proj)]
        Mm = (m.memory_wb[0].detach().T, m.memory_wa[0].detach().T)
        PG = [(torch.zeros_like(w1), torch.zeros_like(w2)) for w1, w2 in P]
        MG = (torch.zeros_like(Mm[0]), torch.zeros_like(Mm[1]))
        PA, MA = list(P), Mm
        outs = []
        for t in range(T):
            if t % Cp == 0:
                PA = list(P)
            if t % Cm == 0:
                MA = Mm
            xb = xt[b, t]
            k = F.normalize(M(PA[0], xb), dim=0)  # k_t = M_k(x_t), L2-normalised
            v = M(PA[1], xb)  # v_t = M_v(x_t)
            if m.v_norm:
                v = F.normalize(v, dim=0)
            alpha = torch.sigmoid(M(PA[3], xb) @ m.alpha_readout.detach() + m.alpha_bias.detach())
            beta = m.beta_max * torch.sigmoid(M(PA[2], xb) @ m.eta_readout.detach() + m.eta_bias.detach())
            eta = alpha * beta
            qt = F.normalize(M(PA[4], xb), dim=0) if m.adaptive_q else q[b, t]  # q_t = M_q(x_t) | x_t W_q
            outs.append(M(MA, qt))  # o_t = M_memory(q_t) at the chunk start (Eq. 83/90)
            steps = [dgd(P[i], PA[i], PG[i], k, M(PA[i], v), alpha, eta) for i in range(n_proj)]
            P, PG = [s[0] for s in steps], [s[1] for s in steps]  # v̂_□ = M_□(v_t)
            Mm, MG = dgd(Mm, MA, MG, k, M(MA, v) if memory_target == "self" else v, alpha, eta)
        ys.append(torch.stack(outs))
    o = torch.stack(ys)
    with torch.no_grad():
        H = m.n_heads
        o = m.norm(o.reshape(B, T, H, d // H)) * gate.reshape(B, T, H, d // H)
        return m.o_proj(o.reshape(B, T, d))


@pytest.mark.parametrize("wa_scale", [1.0, 3.0])
@pytest.mark.parametrize("C,Cp", [(1, 1), (4, 3), (3, 5)])
@pytest.mark.parametrize("mode", ["recurrent", "chunk"])
@pytest.mark.parametrize("target", ["self", "value"])
def test_matches_a_hand_loop_of_the_papers_equations(C, Cp, mode, target, wa_scale):
    m = _model(C=C, Cp=Cp, memory_target=target, wa_scale=wa_scale)
    x = _x()
    ref = paper_loop(m, x, target)
    with torch.no_grad():
        y, _ = m(x, mode=mode)
    assert_close(y, ref, TOL)
    if mode == "chunk" and target == "self" and wa_scale == 1:  # the two targets differ measurably
        other = paper_loop(m, x, "value")
        rel = ((ref - other).norm() / ref.norm()).item()
        print(f"C={C} Cp={Cp}: self-generated vs v_t target, relative output change {rel:.2%}")
        assert rel > 1e-3


@pytest.mark.parametrize("wa_scale", [1.0, 3.0])
@pytest.mark.parametrize("C,Cp", [(1, 1), (4, 3), (5, 2)])
def test_recurrent_and_chunk_agree_on_outputs_and_states(C, Cp, wa_scale):
    m = _model(C=C, Cp=Cp, wa_scale=wa_scale)
    x = _x(T=13)
    yr, sr = m(x, mode="recurrent")
    yc, sc = m(x, mode="chunk")
    assert_close(yc, yr, TOL)
    for a, b in zip(sc.proj + sc.memory, sr.proj + sr.memory):
        assert_close(a, b, TOL)


# ------------------------------------------------------------------------------------------------
# (b) streaming
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cuts", [(1, 3, 6, 11), (2, 5, 7, 8, 11), tuple(range(1, 12))])
@pytest.mark.parametrize("mode", ["recurrent", "chunk"])
def test_any_split_equals_one_pass(cuts, mode):
    m = _model(C=4, Cp=3)
    x = _x(T=11)
    with torch.no_grad():
        full, st_full = m(x, mode="chunk")
        outs, s, a = [], None, 0
        for b in cuts:
            y, s = m(x[:, a:b], s, mode=mode if b - a > 1 else None)
            outs.append(y)
            a = b
    assert_close(torch.cat(outs, 1), full, TOL)
    assert s.offset == 11
    for u, w in zip(s.proj + s.memory, st_full.proj + st_full.memory):
        assert_close(u, w, TOL)


def test_samples_are_independent_and_fast_weights_per_sample():
    m = _model()
    x = _x()
    y, st = m(x)
    x2 = x.clone()
    x2[1] += 1.0
    y2, _ = m(x2)
    assert torch.equal(y[0], y2[0]) and not torch.allclose(y[1], y2[1])
    assert st.memory[0].shape == (2, 1, 8, 8) and st.proj[1].shape == (2, 4, 8, 8)
    assert not torch.allclose(st.proj[0][0], st.proj[0][1])


# ------------------------------------------------------------------------------------------------
# (c) gradients
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("C,Cp,wa_scale", [(1, 1, 1.0), (4, 3, 1.0), (4, 3, 3.0)])
def test_gradients_agree_between_forms(C, Cp, wa_scale):
    m = _model(C=C, Cp=Cp, wa_scale=wa_scale)
    x = _x(T=9)
    w = torch.randn(2, 9, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    grads = {}
    for mode in ("recurrent", "chunk"):
        m.zero_grad()
        xx = x.clone().requires_grad_(True)
        y, st = m(xx, mode=mode)
        ((y * w).sum() + st.memory[1].sum() + st.proj[0].square().sum()).backward()
        grads[mode] = [xx.grad] + [p.grad.clone() for p in m.parameters()]
    names = ["x"] + [n for n, _ in m.named_parameters()]
    for n, a, b in zip(names, grads["recurrent"], grads["chunk"]):
        assert a is not None and b is not None, n
        assert_close(b, a, TOL)  # measured at most 1.4e-15
    for n, g in zip(names, grads["chunk"]):
        assert g.abs().sum() > 0, f"{n}: zero outer gradient"


def test_recurrent_form_passes_gradcheck():
    m = _model(d=4, heads=1, C=2, Cp=2, expansion=1.0, conv_size=2)
    x = _x(B=1, T=3, d=4).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: m(x, mode="recurrent")[0], (x,), eps=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# (d) known answers
# ------------------------------------------------------------------------------------------------


def test_eta_zero_alpha_one_memories_never_change():
    m = _model(C=3, Cp=2)
    with torch.no_grad():
        m.eta_bias.fill_(-1e4)  # β = 0 → η = 0
        m.alpha_bias.fill_(1e4)  # α = 1
    x = _x()
    for mode in ("recurrent", "chunk"):
        with torch.no_grad():
            y, st = m(x, mode=mode)
        assert torch.equal(st.memory[0][0], m.memory_wa)
        assert torch.equal(st.proj[1][1], m.proj_wb)
        # the output is the static MLP's read: o = q + gelu(q W_a) W_b
        with torch.no_grad():
            q = F.normalize(m.q_proj(m.conv(x)[0]), dim=-1)
            o = q + F.gelu(q @ m.memory_wa[0]) @ m.memory_wb[0]
            o = m.norm(o.reshape(2, 11, 2, 4)) * F.silu(m.g_proj(x)).reshape(2, 11, 2, 4)
            assert_close(y, m.o_proj(o.reshape(2, 11, 8)), TOL)


@pytest.mark.parametrize("mode", ["recurrent", "chunk"])
@pytest.mark.parametrize("target", ["self", "value"])
@pytest.mark.parametrize("wa_scale", [1.0, 6.0])
def test_one_token_with_alpha_one_eta_one_is_the_closed_form(mode, target, wa_scale):
    """α = η = 1, one token, unit k: W_a' = (I − k kᵀ) W_a − k δᵀ, so kᵀ W_a' = −δᵀ (the new
    association overwrites the old one exactly), and W_b' = W_b − hᵀ e / max(1, ‖h‖²) with
    h = σ(k W_a) (the NLMS rate of the hidden layer), e = M(k) − M(v) (self-generated target,
    Eq. 84) or e = M(k) − v, v = M_v(x) / ‖M_v(x)‖. The input is scaled so that ‖M_v(x)‖ is far
    from 1 (measured 6.8, 8.3); ``wa_scale=6`` makes ‖h‖² > 1 (the NLMS branch; measured 12.9),
    1 keeps it below (0.18)."""
    m = _model(C=4, Cp=4, beta_max=1.0, memory_target=target, wa_scale=wa_scale)
    with torch.no_grad():
        m.eta_bias.fill_(1e4)
        m.alpha_bias.fill_(1e4)
        x = 20.0 * _x(B=1, T=1)
        _, st = m(x, mode=mode)
        xt = m.conv(x)[0][0, 0]
        Wa, Wb = m.proj_wa, m.proj_wb
        k = F.normalize(xt + F.gelu(xt @ Wa[0]) @ Wb[0], dim=0)
        v_raw = xt + F.gelu(xt @ Wa[1]) @ Wb[1]
        assert v_raw.norm() > 3  # the normalisation matters
        v = v_raw / v_raw.norm()
        Ma, Mb = m.memory_wa[0], m.memory_wb[0]
        z = k @ Ma
        h = F.gelu(z)
        assert (h.square().sum() > 1) == (wa_scale > 1)
        vhat = v + F.gelu(v @ Ma) @ Mb if target == "self" else v
        e = k + h @ Mb - vhat
        delta = (Mb @ e) * _gelu_grad(z)
        Wa_new, Wb_new = st.memory[0][0, 0], st.memory[1][0, 0]
        assert_close(k @ Wa_new, -delta, TOL)
        assert_close(Wa_new, Ma - torch.outer(k, k @ Ma) - torch.outer(k, delta), TOL)
        assert_close(Wb_new, Mb - torch.outer(h, e) / max(1.0, h.square().sum().item()), TOL)


@pytest.mark.parametrize("mode", ["recurrent", "chunk"])
@pytest.mark.parametrize("momentum", [0.0, 0.6])
def test_hidden_step_known_answer_with_a_large_hidden_input(mode, momentum):
    """The W_b step on a hand-chosen case: d = h = 2, one memory, one token, k = e₁, W_a = diag(3, −3)
    so h = σ(k W_a) = (gelu(3), 0), ‖h‖² = 8.96 > 1; W_b = 0, so M(k) = k and e = k − v̂.
    ``hidden_step="nlms"``: W_b' = α·0 − η hᵀ e / ‖h‖²; ``"plain"``: W_b' = −η hᵀ e, ‖h‖² ≈ 9 times
    larger. With momentum μ from zero momentum both are (1 − μ) times that (dampened)."""
    from mnemo.layers.self_modifying import dgd_chunk, dgd_token

    m = SelfModifyingTitans(2, n_heads=1).double()
    W = (
        torch.tensor([[3.0, 0.0], [0.0, -3.0]], dtype=torch.float64)[None, None],
        torch.zeros(1, 1, 2, 2).double(),
    )
    k = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    vhat = torch.tensor([[[0.25, -0.5]]], dtype=torch.float64)
    la = torch.tensor([-0.1], dtype=torch.float64)
    be = torch.tensor([0.5], dtype=torch.float64)
    eta = math.exp(-0.1) * 0.5
    h = torch.tensor([F.gelu(torch.tensor(3.0, dtype=torch.float64)).item(), 0.0], dtype=torch.float64)
    e = k[0] - vhat[0, 0]
    mom = tuple(torch.zeros_like(w) for w in W) if momentum else None
    for nlms, rate in ((True, eta / h.square().sum().item()), (False, eta)):
        if mode == "recurrent":
            (_, Wb), _ = dgd_token(m.spec, W, W, k, vhat, la, be, mom, momentum, nlms)
        else:
            (_, Wb), _ = dgd_chunk(
                m.spec, W, W, k[:, None], vhat[:, :, None], la[:, None], be[:, None], mom, momentum, nlms
            )
        assert_close(Wb[0, 0], -(1 - momentum) * rate * torch.outer(h, e), TOL)


# ------------------------------------------------------------------------------------------------
# (e) HOPE decodes like the full pass; errors; registry; the renamed variant
# ------------------------------------------------------------------------------------------------


def test_hope_model_decodes_like_the_full_pass():
    torch.manual_seed(0)
    cfg = build_config(
        "hope",
        vocab_size=40,
        d_model=16,
        n_layers=2,
        mlp_options={"levels": [{"period": 2}, {"period": 3}]},
        mixer_options={"self_modifying_titans": {"chunk_size": 4, "proj_chunk_size": 3}},
    )
    assert cfg.mixer == "self_modifying_titans"
    m = LanguageModel(cfg).double()
    ids = torch.randint(0, 40, (2, 13))
    full, _ = m(ids)
    logits, st = m(ids[:, :2])
    outs = [logits]
    for t in range(2, 13):
        logits, st = m(ids[:, t : t + 1], st)
        outs.append(logits)
    assert_close(torch.cat(outs, 1), full, TOL)


def test_errors_and_state_size():
    with pytest.raises(ValueError, match="n_heads"):
        SelfModifyingTitans(10, n_heads=4)
    with pytest.raises(ValueError, match="proj_chunk_size"):
        SelfModifyingTitans(8, n_heads=2, proj_chunk_size=0)
    with pytest.raises(ValueError, match="beta_max"):
        SelfModifyingTitans(8, n_heads=2, beta_max=1.5)
    m = SelfModifyingTitans(8, n_heads=2)
    with pytest.raises(ValueError, match=r"\[B, T, 8\]"):
        m(torch.randn(2, 3, 7))
    _, s = m(torch.randn(2, 3, 8))
    y0, s0 = m(torch.randn(2, 0, 8), s)  # an empty call passes the state through
    assert y0.shape == (2, 0, 8) and s0 is s
    with pytest.raises(ValueError, match="batch size"):
        m(torch.randn(3, 1, 8), s)
    # 5 memories × (running + chunk-start) × 2 layers of 8×8 fp32 + the conv tail 8 × 3
    assert m.state_size_bytes(2) == 2 * (5 * 2 * 2 * 64 * 4 + 8 * 3 * 4)


def test_registry_names():
    assert MIXERS["self_modifying_titans"] is SelfModifyingTitans
    assert MIXERS["self_modifying_projections"] is SelfModifyingProjections


def test_self_modifying_projections_streams_and_rewrites_its_projections():
    torch.manual_seed(0)
    m = SelfModifyingProjections(16, n_heads=2, chunk_size=4).double()
    x = torch.randn(2, 11, 16, dtype=torch.float64)
    full, st = m(x)
    assert not torch.equal(st.proj["k"], m.init["k"].expand(2, -1, -1))
    outs, s, a = [], None, 0
    for b in (1, 3, 6, 11):
        y, s = m(x[:, a:b], s)
        outs.append(y)
        a = b
    assert_close(torch.cat(outs, 1), full, TOL)
    assert_close(m(x, mode="recurrent")[0], full, TOL)


# ------------------------------------------------------------------------------------------------
# (f) the evaluated HOPE's options (issue 37 item 3): adaptive q and DGD with momentum
# ------------------------------------------------------------------------------------------------

OPTIONS = {
    "momentum": {"momentum": 0.6},
    "adaptive_q": {"adaptive_q": True},
    "both": {"adaptive_q": True, "momentum": 0.6},
    # hidden inputs with ‖h‖² on both sides of 1: the NLMS rate of W_b under momentum
    "both_big_h": {"adaptive_q": True, "momentum": 0.6, "wa_scale": 3.0},
    # the steps before the stability fix: unnormalised v, W_b at Eq. 88's rate η
    "earlier_steps": {
        "adaptive_q": True,
        "momentum": 0.6,
        "wa_scale": 3.0,
        "v_norm": False,
        "hidden_step": "plain",
    },
}


def _states(s):
    return s.proj + s.memory + (s.proj_momentum or ()) + (s.memory_momentum or ())


@pytest.mark.parametrize(
    "opts,C,Cp,mode",
    [
        ("momentum", 4, 3, "chunk"),
        ("adaptive_q", 4, 3, "chunk"),
        ("both", 4, 3, "chunk"),
        ("both", 4, 3, "recurrent"),
        ("both", 3, 5, "chunk"),
        ("both", 1, 1, "chunk"),
        ("both", 1, 1, "recurrent"),
        ("both_big_h", 4, 3, "chunk"),
        ("both_big_h", 3, 5, "recurrent"),
        ("both_big_h", 1, 1, "chunk"),
        ("earlier_steps", 4, 3, "chunk"),
        ("earlier_steps", 3, 5, "recurrent"),
    ],
)
def test_options_match_the_hand_loop(opts, C, Cp, mode):
    m = _model(C=C, Cp=Cp, **OPTIONS[opts])
    x = _x()
    with torch.no_grad():
        y, _ = m(x, mode=mode)
    assert_close(y, paper_loop(m, x), TOL)


@pytest.mark.parametrize("C,Cp,opts", [(4, 3, "both"), (5, 2, "both"), (5, 2, "both_big_h")])
def test_options_recurrent_and_chunk_agree_on_outputs_and_states(C, Cp, opts):
    m = _model(C=C, Cp=Cp, **OPTIONS[opts])
    x = _x(T=13)
    yr, sr = m(x, mode="recurrent")
    yc, sc = m(x, mode="chunk")
    assert_close(yc, yr, TOL)
    assert sc.proj[0].shape[1] == 5 and sc.memory_momentum is not None
    for a, b in zip(_states(sc), _states(sr)):
        assert_close(a, b, TOL)


@pytest.mark.parametrize("cuts,mode", [((2, 5, 7, 8, 11), "recurrent"), (tuple(range(1, 12)), "chunk")])
def test_options_any_split_equals_one_pass(cuts, mode):
    m = _model(C=4, Cp=3, **OPTIONS["both"])
    x = _x(T=11)
    with torch.no_grad():
        full, st_full = m(x, mode="chunk")
        outs, s, a = [], None, 0
        for b in cuts:
            y, s = m(x[:, a:b], s, mode=mode if b - a > 1 else None)
            outs.append(y)
            a = b
    assert_close(torch.cat(outs, 1), full, TOL)
    for u, w in zip(_states(s), _states(st_full)):
        assert_close(u, w, TOL)


@pytest.mark.parametrize("C,Cp,opts", [(1, 1, "both"), (4, 3, "both"), (4, 3, "both_big_h")])
def test_options_gradients_agree_between_forms(C, Cp, opts):
    m = _model(C=C, Cp=Cp, **OPTIONS[opts])
    x = _x(T=9)
    w = torch.randn(2, 9, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    s0 = m.initial_state(2)
    m0 = tuple(t.clone().normal_(0, 0.1).requires_grad_(True) for t in s0.memory_momentum)
    grads = {}
    for mode in ("recurrent", "chunk"):
        m.zero_grad()
        xx = x.clone().requires_grad_(True)
        st0 = dataclasses.replace(s0, memory_momentum=m0)  # a nonzero initial momentum, learned
        y, st = m(xx, st0, mode=mode)
        loss = (y * w).sum() + st.memory[1].sum() + st.proj_momentum[0].square().sum()
        gm = torch.autograd.grad(loss, [xx, *m0, *m.parameters()])
        grads[mode] = gm
    names = ["x", "m0_a", "m0_b"] + [n for n, _ in m.named_parameters()]
    for n, a, b in zip(names, grads["recurrent"], grads["chunk"]):
        assert_close(b, a, TOL, what=n)
    for n, g in zip(names, grads["chunk"]):
        assert g.abs().sum() > 0, f"{n}: zero gradient"


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_options_gradients_equal_finite_differences(mode):
    """Independent of the two forms' agreement: torch.autograd.gradcheck (central differences in
    float64) of the output and the final momentum with respect to the input and the initial
    momentum, momentum 0.6 and adaptive q, chunks of 2 and 3 over 5 tokens."""
    m = _model(d=4, C=2, Cp=3, momentum=0.6, adaptive_q=True)
    x = _x(B=1, T=5, d=4)
    s0 = m.initial_state(1)
    m0 = tuple(t.clone().normal_(0, 0.1) for t in s0.memory_momentum)

    def f(xx, ma, mb):
        y, st = m(xx, dataclasses.replace(s0, memory_momentum=(ma, mb)), mode=mode)
        return y, st.memory_momentum[0], st.proj_momentum[1]

    inputs = (x.requires_grad_(True), *(t.requires_grad_(True) for t in m0))
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-7, rtol=1e-5)


def test_momentum_zero_is_the_plain_step_and_momentum_changes_the_reads():
    """The momentum forms at μ = 0 (zero buffers) equal the plain DGD step bit for bit up to
    rounding, through a different computation (the chunk form's momentum solve against the gated
    delta rule's WY form); at μ = 0.6 the reads change measurably."""
    from mnemo.layers.self_modifying import dgd_chunk, dgd_token

    m = _model(C=5, Cp=5)
    g = torch.Generator().manual_seed(3)
    B, G, L, d = 2, 2, 5, 8
    W = tuple(torch.randn(B, G, *s, generator=g, dtype=torch.float64) * 0.3 for s in ((d, d), (d, d)))
    A = tuple(w + 0.1 for w in W)
    k = F.normalize(torch.randn(B, L, d, generator=g, dtype=torch.float64), dim=-1)
    vhat = torch.randn(B, G, L, d, generator=g, dtype=torch.float64)
    la = -torch.rand(B, L, generator=g, dtype=torch.float64) * 0.5
    be = torch.rand(B, L, generator=g, dtype=torch.float64)
    zero = tuple(torch.zeros_like(w) for w in W)
    plain, none = dgd_chunk(m.spec, W, A, k, vhat, la, be)
    with_mom, mom = dgd_chunk(m.spec, W, A, k, vhat, la, be, zero, 0.0)
    assert none is None
    for a, b in zip(plain, with_mom):
        assert_close(b, a, 1e-13)
    t_plain, _ = dgd_token(m.spec, W, A, k[:, 0], vhat[:, :, 0], la[:, 0], be[:, 0])
    t_mom, t_m = dgd_token(m.spec, W, A, k[:, 0], vhat[:, :, 0], la[:, 0], be[:, 0], zero, 0.0)
    for a, b in zip(t_plain, t_mom):
        assert_close(b, a, 1e-14)
    # one token: the momentum is exactly the gradient step −η ∇ (W_new − (α W − η k kᵀ W) for W_b)
    alpha = la[:, 0].exp()[:, None, None, None]
    assert_close(t_m[1], t_mom[1] - alpha * W[1], 1e-14)
    x = _x(T=11)
    with torch.no_grad():
        y0, _ = _model(C=4, Cp=3)(x)
        y6, _ = _model(C=4, Cp=3, momentum=0.6)(x)
    rel = ((y6 - y0).norm() / y0.norm()).item()
    print(f"momentum 0.6 vs 0: relative output change {rel:.2%}")
    assert rel > 1e-3


def test_adaptive_q_starts_as_the_identity_query_and_then_adapts():
    """With ``M_q``'s initial ``W_b = 0`` it is the identity, so over the first projection chunk
    ``q_t = normalize(x̃_t)``: the outputs equal a fixed-q model whose ``W_q = I`` (every other
    weight copied). After the chunk ``M_q`` has been rewritten by DGD and the outputs differ."""
    fixed = _model(C=4, Cp=3)
    ada = _model(C=4, Cp=3, adaptive_q=True)
    with torch.no_grad():
        for name, p in fixed.named_parameters():
            if name in ("proj_wa", "proj_wb"):
                getattr(ada, name)[:4].copy_(p)
            elif name != "q_proj.weight":
                dict(ada.named_parameters())[name].copy_(p)
        fixed.q_proj.weight.copy_(torch.eye(8))
        ada.proj_wb[4].zero_()
        x = _x(T=11)
        yf, _ = fixed(x)
        ya, sa = ada(x)
    assert_close(ya[:, :3], yf[:, :3], TOL)
    assert not torch.allclose(sa.proj[1][:, 4], torch.zeros_like(sa.proj[1][:, 4]))
    assert ((ya[:, 3:] - yf[:, 3:]).norm() / yf[:, 3:].norm()).item() > 1e-3


def test_option_errors_and_state_size():
    with pytest.raises(ValueError, match=r"momentum must be a number in \[0, 1\), got 1.0"):
        SelfModifyingTitans(8, n_heads=2, momentum=1.0)
    with pytest.raises(ValueError, match="adaptive_q must be a bool"):
        SelfModifyingTitans(8, n_heads=2, adaptive_q=1)
    m = SelfModifyingTitans(8, n_heads=2, momentum=0.5, adaptive_q=True)
    assert m.q_proj is None
    _, s = m(torch.randn(2, 3, 8))
    plain = SelfModifyingTitans(8, n_heads=2)
    _, sp = plain(torch.randn(2, 3, 8))
    with pytest.raises(ValueError, match="momentum=0.0 needs a state without momentum"):
        plain(torch.randn(2, 1, 8), s)
    with pytest.raises(ValueError, match="momentum=0.5 needs a state with momentum"):
        m(torch.randn(2, 1, 8), sp)
    # 6 memories (k, v, η, α, q, main) × (running + chunk-start + momentum) × 2 layers of 8×8 fp32
    # + the conv tail 8 × 3
    assert m.state_size_bytes(2) == 2 * (6 * 3 * 2 * 64 * 4 + 8 * 3 * 4)
    spec = m.state_spec(2, 3)
    for a, b in zip(_states(s), _states(spec)):
        assert a.shape == b.shape and a.dtype == b.dtype


def test_hope_paper_trains_on_the_bundled_corpus_and_every_parameter_learns():
    """hope_paper (Table 6's full model: adaptive q, DGD momentum, self-generated targets, task
    objective) takes three AdamW steps on tinyshakespeare (the main job's bundled data, char
    tokens): every parameter gets a finite, nonzero gradient at every step and the loss stays
    finite."""
    from mnemo.data.text import load_text
    from mnemo.data.tokenizer import CharTokenizer

    cfg = build_config("hope_paper", vocab_size=65, d_model=16, n_layers=1)
    smt = cfg.mixer_options["self_modifying_titans"]
    assert smt["adaptive_q"] is True and smt["momentum"] > 0 and smt["memory_target"] == "self"
    assert all(lv["objective"] == "task" for lv in cfg.mlp_options["levels"])
    text = load_text("tinyshakespeare")[:4000]
    tok = CharTokenizer.from_text(text)
    ids = tok.encode(text).long()
    cfg = build_config("hope_paper", vocab_size=tok.vocab_size, d_model=16, n_layers=1)
    torch.manual_seed(0)
    m = LanguageModel(cfg)
    assert m.blocks[0].mixer.adaptive_q and m.blocks[0].mixer.momentum == 0.9
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    losses = []
    for step in range(3):
        starts = torch.randint(0, len(ids) - 42, (2,), generator=g)
        batch = torch.stack([ids[s : s + 41] for s in starts.tolist()])
        opt.zero_grad()
        loss = m.loss(batch[:, :-1], batch[:, 1:])
        loss.backward()
        for n, p in m.named_parameters():
            assert p.grad is not None, f"step {step}: {n} has no gradient"
            assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, f"step {step}: {n}"
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses), losses
    print("hope_paper losses", [round(x, 3) for x in losses])


# ------------------------------------------------------------------------------------------------
# kept steps (deferring): a stream read in pieces shorter than a chunk, as a task-signal model reads
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("opts", ["none", "both"])
@pytest.mark.parametrize("cuts", [(2, 5, 7, 8, 11), (1, 3, 6, 11), (3, 6, 9, 11)])
def test_deferred_steps_equal_one_pass_outputs_states_and_gradients(cuts, opts):
    """Inside ``deferring()`` a call that ends inside a chunk keeps that chunk's steps as inputs and
    its state's weights are the weights before them (here checked against the one pass's state at
    the last chunk start); settled, the stream equals one pass: outputs, every weight and momentum,
    and the gradients of both with respect to the input and every parameter."""
    m = _model(C=4, Cp=3, **({} if opts == "none" else OPTIONS[opts]))
    x = _x(T=11)
    w = torch.randn(2, 11, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(5))

    def loss(y, st):
        return (y * w).sum() + sum(t.square().sum() for t in _states(st))

    xx = x.clone().requires_grad_(True)
    full, st_full = m(xx, mode="chunk")
    want = torch.autograd.grad(loss(full, st_full), [xx, *m.parameters()])
    xx = x.clone().requires_grad_(True)
    outs, s, a, kept = [], None, 0, 0
    with m.deferring():
        for b in cuts:
            y, s = m(xx[:, a:b], s, mode="chunk" if b - a > 1 else None)
            outs.append(y)
            kept += s.memory_pending is not None
            if s.memory_pending is not None:
                n = s.memory_pending[0].shape[1]  # a one-token call steps at once (the token loop)
                assert 0 < n <= b % 4
                if n == b % 4:  # every step of the chunk kept: the weights are the chunk start's
                    for u, v in zip(s.memory, s.memory_anchor):
                        assert torch.equal(u, v)
            a = b
    assert s.memory_pending is not None  # 11 tokens end inside the third 4-token chunk
    s = m.settle(s)
    assert s.memory_pending is None and s.proj_pending is None
    y = torch.cat(outs, 1)
    assert_close(y, full, TOL)
    for u, v in zip(_states(s), _states(st_full)):
        assert_close(u, v, TOL)
    got = torch.autograd.grad(loss(y, s), [xx, *m.parameters()])
    names = ["x"] + [n for n, _ in m.named_parameters()]
    for n, g, h in zip(names, got, want):
        assert_close(g, h, TOL, what=n)
    assert kept >= 2  # the kept path really ran


def test_deferred_state_settles_before_a_token_step_and_is_untouched_outside_deferring():
    """A one-token (recurrent) call on a state with kept steps takes them first; outside
    ``deferring()`` no call keeps steps; ``settle`` of a state without kept steps returns it as is."""
    m = _model(C=4, Cp=3)
    x = _x(T=6)
    with torch.no_grad():
        full, st_full = m(x, mode="chunk")
        with m.deferring():
            y1, s = m(x[:, :5], mode="chunk")  # chunks 4 and 3: one and two tokens kept
        assert s.proj_pending[0].shape[1] == 2 and s.memory_pending[0].shape[1] == 1
        y2, s = m(x[:, 5:6], s)  # T = 1: the token loop
        assert s.memory_pending is None and s.proj_pending is None
        _, plain = m(x[:, :5], mode="chunk")
        assert plain.memory_pending is None and plain.proj_pending is None
        assert m.settle(plain) is plain
    assert_close(torch.cat([y1, y2], 1), full, TOL)
    for u, v in zip(_states(s), _states(st_full)):
        assert_close(u, v, TOL)


def test_hope_returns_settled_states_and_keeps_steps_inside_its_segments():
    """The task-signal loop defers the mixers' in-chunk steps (segments of 8 tokens, memory chunks
    of 16): every state the model returns, and the pending segment's start state in it, has every
    step taken, and the stream in 8 + 13 tokens equals the 21 tokens in one call."""
    torch.manual_seed(0)
    m = LanguageModel(build_config("hope", vocab_size=17, d_model=16, n_layers=2)).double()
    seen = []
    mixer = m.blocks[1].mixer
    orig = mixer.forward

    def spy(*a, **k):
        out = orig(*a, **k)
        seen.append(out[1].memory_pending is not None)
        return out

    mixer.forward = spy
    ids = torch.randint(0, 17, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full, st = m(ids)
        a, s = m(ids[:, :8])
        b, s = m(ids[:, 8:], s)
    assert any(seen)  # 8-token segments inside a 16-token chunk: steps kept
    for state in (st, s, st[0].mlp.pending.start, s[1].mlp.pending.start):
        for blk in state:
            assert blk.mixer.memory_pending is None and blk.mixer.proj_pending is None
    assert_close(torch.cat([a, b], 1), full, 1e-10)
    for u, v in zip(_states(s[1].mixer), _states(st[1].mixer)):
        assert_close(u, v, 1e-10)
