"""MoE as DeepSeek-V3 runs it (session 43, area F): the routed scaling factor and group-limited
(node-limited) routing of DeepSeek-V3 (arXiv 2412.19437, §2.1.2, eq. 12–16; config
``routed_scaling_factor``, ``n_group``, ``topk_group``), and the router z-loss under sigmoid scores.

Every expected value is computed here by hand from the equations (a Python loop over tokens and
groups, the SwiGLU written out), in float64; tolerance 1e-12 (measured ~1e-16)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mnemo.layers import MoE
from mnemo.layers.moe import moe_reference
from mnemo.models import LanguageModel, ModelConfig

TOL = 1e-12


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


# 8 experts in 4 groups of 2 (sigmoid affinities). Group scores = sum of the top-2 affinities:
# g0 = 0.9 + 0.1 = 1.0, g1 = 0.65 + 0.6 = 1.25, g2 = 0.55 + 0.5 = 1.05, g3 = 0.2 + 0.15 = 0.35.
# topk_group=2 keeps g1, g2, so expert 0 (the best single affinity) is out of reach; top-3 = {2, 3, 4}.
# (Ungrouped top-3: {0, 2, 3}; DeepSeek-V2's max-per-group rule would keep g0, g1: {0, 2, 3} too.)
AFFINITY = [0.9, 0.1, 0.65, 0.6, 0.55, 0.5, 0.2, 0.15]


def _hand_case(gamma=2.5, bias=None, d=16, H=8, S=6):
    """A one-token MoE whose router logits are ``logit(AFFINITY)`` (x = e_0), with a shared expert."""
    torch.manual_seed(0)
    m = MoE(
        d,
        n_experts=8,
        top_k=3,
        expert_hidden=H,
        shared_expert_hidden=S,
        score="sigmoid",
        routed_scaling_factor=gamma,
        n_group=4,
        topk_group=2,
        bias_balancing=bias is not None,
    ).double()
    with torch.no_grad():
        m.router.weight.zero_()
        m.router.weight[:, 0] = torch.tensor([_logit(p) for p in AFFINITY], dtype=torch.float64)
        m.router.weight[:, 1:] = 1e-3 * torch.randn(8, d - 1, dtype=torch.float64)  # x[1:] = 0 anyway
        if bias is not None:
            m.expert_bias.copy_(torch.tensor(bias, dtype=torch.float64))
    x = torch.zeros(1, 1, d, dtype=torch.float64)
    x[..., 0] = 1.0
    return m, x.requires_grad_()


def _hand_output(m, x, chosen, gamma):
    """eq. 12–15 written out: y = shared(x) + γ Σ_{e ∈ chosen} (s_e / Σ_chosen s) · E_e(x), with
    s = σ(W_r x) and E_e(x) = W_out[e] (silu(W_gate[e] x) ⊙ W_up[e] x)."""
    xv = x.reshape(-1)
    s = torch.sigmoid(m.router.weight @ xv)
    total = sum(s[e] for e in chosen)
    H = m.hidden
    y = torch.zeros_like(xv)
    for e in chosen:
        gate = m.w_in[e, :H] @ xv
        up = m.w_in[e, H:] @ xv
        y = y + gamma * (s[e] / total) * (m.w_out[e] @ (F.silu(gate) * up))
    S = m.shared_expert.w_out.weight.shape[1]
    h = m.shared_expert.w_in.weight @ xv
    y = y + m.shared_expert.w_out.weight @ (F.silu(h[:S]) * h[S:])
    return y


@pytest.mark.parametrize("dispatch", ["sorted", "fixed", "reference"])
def test_group_limit_and_scaling_hand_case_with_gradients(dispatch):
    m, x = _hand_case()
    m.dispatch = dispatch
    y = m(x).reshape(-1)
    assert m.last_counts.tolist() == [0, 0, 1, 1, 1, 0, 0, 0]  # experts 2, 3, 4: expert 0 unreachable
    ref = _hand_output(m, x, [2, 3, 4], 2.5)
    assert (y - ref).abs().max() < TOL
    # gradient path: the router learns through the chosen affinities' weights, experts through
    # their outputs, nothing flows to the excluded experts
    params = [x, m.router.weight, m.w_in, m.w_out]
    probe = torch.linspace(-1, 1, y.numel(), dtype=y.dtype)
    g = torch.autograd.grad((y * probe).sum(), params)
    g_ref = torch.autograd.grad((ref * probe).sum(), params)
    for a, b in zip(g, g_ref):
        assert (a - b).abs().max() < TOL
    assert g[2][[0, 1, 5, 6, 7]].abs().max() == 0  # w_in of experts not chosen
    assert g[1][[2, 3, 4], 0].abs().min() > 0  # the chosen experts' router rows do learn


def test_group_scores_use_the_biased_selection_scores_weights_do_not():
    # bias +1 on expert 6: biased g3 = 1.2 + 0.15 = 1.35 > g1 = 1.25 > g2 = 1.05 > g0 = 1.0; kept g3, g1
    # -> chosen by s + b among {2, 3, 6, 7}: 6 (1.2), 2 (0.65), 3 (0.6); weighted by the unbiased s
    bias = [0.0] * 8
    bias[6] = 1.0
    m, x = _hand_case(bias=bias)
    y = m(x).reshape(-1)
    assert m.last_counts.tolist() == [0, 0, 1, 1, 0, 0, 1, 0]
    assert (y - _hand_output(m, x, [2, 3, 6], 2.5)).abs().max() < TOL


def _hand_routing(sel, n_group, topk_group, top_k):
    """Per token: groups of consecutive experts scored by the sum of their two largest selection
    scores, the best ``topk_group`` groups kept, the top_k experts among them (a plain loop)."""
    out = []
    for row in sel.tolist():
        m = len(row) // n_group
        groups = [row[g * m : (g + 1) * m] for g in range(n_group)]
        gscore = [sum(sorted(gr, reverse=True)[:2]) for gr in groups]
        kept = sorted(range(n_group), key=lambda g: -gscore[g])[:topk_group]
        allowed = [e for e in range(len(row)) if e // m in kept]
        out.append(set(sorted(allowed, key=lambda e: -row[e])[:top_k]))
    return out


@pytest.mark.parametrize("score", ["sigmoid", "softmax"])
@pytest.mark.parametrize("n_group,topk_group,top_k", [(4, 2, 2), (4, 1, 2), (2, 1, 3), (4, 3, 4)])
def test_group_limited_choice_matches_a_hand_loop(score, n_group, topk_group, top_k):
    torch.manual_seed(1)
    m = MoE(
        16, n_experts=8, top_k=top_k, expert_hidden=8, score=score, n_group=n_group, topk_group=topk_group
    )
    m = m.double()
    with torch.no_grad():
        m.router.weight.mul_(5)
    x = torch.randn(3, 7, 16, dtype=torch.float64)
    logits, scores, idx = m.route(x)
    want = _hand_routing(scores, n_group, topk_group, top_k)
    got = [set(r) for r in idx.tolist()]
    assert got == want
    size = 8 // n_group
    assert all(len({e // size for e in r}) <= topk_group for r in got)
    # the limit binds on this data: some token's ungrouped top-k leaves its kept groups
    free = [set(r) for r in scores.topk(top_k, dim=-1).indices.tolist()]
    assert free != want


def test_scaling_multiplies_routed_part_only_and_not_the_losses():
    torch.manual_seed(2)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    out = {}
    for gamma in (1.0, 2.5):
        torch.manual_seed(3)
        m = MoE(16, n_experts=4, expert_hidden=8, shared_expert_hidden=8, routed_scaling_factor=gamma)
        m = m.double()
        shared = m.shared_expert(x)
        out[gamma] = (m(x) - shared, m.last_aux_loss.detach(), m.last_z_loss.detach())
    assert (out[2.5][0] - 2.5 * out[1.0][0]).abs().max() < TOL
    assert out[2.5][0].abs().max() > 1e-5  # the routed part is not zero (init std 0.02: ~1e-4)
    assert torch.equal(out[2.5][1], out[1.0][1]) and torch.equal(out[2.5][2], out[1.0][2])


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_neutral_values_change_nothing_bitwise(score):
    torch.manual_seed(4)
    x = torch.randn(2, 6, 16)
    res = []
    for kw in (
        {},
        {"routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1},
        {"n_group": 4, "topk_group": 4},
    ):
        torch.manual_seed(5)
        m = MoE(16, n_experts=8, expert_hidden=8, score=score, bias_balancing=True, **kw).train()
        with torch.no_grad():
            m.expert_bias.copy_(torch.linspace(-0.01, 0.01, 8))
        y = m(x)
        (g,) = torch.autograd.grad(y.square().sum() + m.loss(), [m.router.weight])
        res.append((y, g, m.last_counts, sorted(m.state_dict())))
    for y, g, c, keys in res[1:]:
        assert torch.equal(y, res[0][0]) and torch.equal(g, res[0][1]) and torch.equal(c, res[0][2])
        assert keys == res[0][3]


def test_dispatch_forms_agree_with_groups_scaling_and_capacity():
    torch.manual_seed(6)
    m = MoE(16, n_experts=8, top_k=2, expert_hidden=8, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    m = m.double().train()
    m.capacity_factor = 1.0
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    ref = moe_reference(m, x)
    for d in ("sorted", "padded", "fixed"):
        m.dispatch = d
        assert (m(x) - ref).abs().max() < TOL


def test_options_validated_and_plumbed_through_the_config():
    for opts, match in [
        ({"n_experts": 8, "n_group": 3}, "n_group: expected a divisor of n_experts = 8, got 3"),
        ({"n_experts": 8, "n_group": 4, "topk_group": 5}, r"topk_group: expected an int in \[1, 4\], got 5"),
        (
            {"n_experts": 8, "top_k": 3, "n_group": 4, "topk_group": 1},
            "top_k: expected at most topk_group · n_experts / n_group = 2",
        ),
        ({"routed_scaling_factor": 0.0}, "routed_scaling_factor: expected a finite number > 0, got 0.0"),
        ({"routed_scaling_factor": float("nan")}, "routed_scaling_factor: expected a finite number"),
        ({"n_group": 1.0}, "n_group: expected an int"),
    ]:
        with pytest.raises(ValueError, match=match):
            ModelConfig(mlp="moe", mlp_options=opts).validate()
    cfg = ModelConfig(
        vocab_size=20,
        d_model=16,
        n_layers=1,
        mixer="gla",
        mixer_options={"gla": {"n_heads": 2}},
        mlp="moe",
        mlp_options={
            "n_experts": 8,
            "expert_hidden": 8,
            "routed_scaling_factor": 2.5,
            "n_group": 4,
            "topk_group": 2,
        },
    )
    moe = LanguageModel(cfg).blocks[0].mlp
    assert (moe.routed_scaling_factor, moe.n_group, moe.topk_group) == (2.5, 4, 2)
    assert "n_group=4, topk_group=2" in repr(moe)


def test_z_loss_under_sigmoid_is_the_logit_penalty_documented():
    # L_z = mean_n lse(z_n)²; ∂L_z/∂z_e = (2/N) lse(z) softmax(z)_e, independent of the sigmoid scores
    m = MoE(4, n_experts=3, top_k=1, expert_hidden=4, score="sigmoid", norm_topk_prob=False).double()
    z_rows = [[1.0, -2.0, 0.5], [0.0, 0.0, 0.0]]
    with torch.no_grad():
        m.router.weight.zero_()
        m.router.weight[:, :2] = torch.tensor(z_rows, dtype=torch.float64).t()
    x = torch.eye(4, dtype=torch.float64)[:2].requires_grad_()  # token n has logits z_rows[n]
    m(x)
    lse = [math.log(sum(math.exp(v) for v in r)) for r in z_rows]
    assert abs(m.last_z_loss.item() - (lse[0] ** 2 + lse[1] ** 2) / 2) < TOL
    (g,) = torch.autograd.grad(m.last_z_loss, [m.router.weight])
    for n, r in enumerate(z_rows):
        for e, v in enumerate(r):
            want = 2 / 2 * lse[n] * math.exp(v - lse[n])  # times x_n[n] = 1
            assert abs(g[e, n].item() - want) < TOL
            assert want > 0  # lse > 0 here: every logit is pushed down
