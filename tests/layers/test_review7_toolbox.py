"""Review 7 (toolbox: attention, rotary/YaRN/NTK, MoE, auxiliary losses, sinks): each test failed
on the code before its fix."""

from __future__ import annotations

import math

import pytest
import torch

from mnemo.layers.moe import MoE, check_moe_options

F64 = torch.float64


def _sig(v):
    return 1.0 / (1.0 + math.exp(-v))


def test_moe_sigmoid_scores_route_as_deepseek_v3_by_hand():
    """Leftover: the auxiliary-loss-free bias was only available on softmax scores. DeepSeek-V3
    (§2.1.2, eq. 12–16): ``s_i = σ(u·e_i)``, top-k of ``s_i + b_i``, weights ``s_i / Σ_TopK s_j``
    (unbiased), and ``b_i += γ · sign(mean load − load_i)`` after the step."""
    torch.manual_seed(0)
    m = MoE(2, n_experts=4, top_k=2, expert_hidden=3, score="sigmoid", bias_balancing=True,
            bias_update_rate=0.25, dispatch="reference").to(F64)  # fmt: skip
    m.train()
    W = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.5], [0.5, 0.5]], dtype=F64)
    with torch.no_grad():
        m.router.weight.copy_(W)
        m.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.9, 0.0], dtype=F64))
    x = torch.tensor([[[2.0, 1.0], [0.2, -0.3], [-1.0, 2.0]]], dtype=F64)
    y = m(x)
    b = [0.0, 0.0, 0.9, 0.0]
    want = torch.zeros(3, 2, dtype=F64)
    counts = [0, 0, 0, 0]
    for n, xn in enumerate(x[0].tolist()):
        s = [_sig(W[e, 0].item() * xn[0] + W[e, 1].item() * xn[1]) for e in range(4)]
        chosen = sorted(range(4), key=lambda e: -(s[e] + b[e]))[:2]
        tot = sum(s[e] for e in chosen)
        for e in chosen:
            counts[e] += 1
            want[n] += s[e] / tot * m._expert(x[0, n], e)
    torch.testing.assert_close(y[0], want, rtol=1e-12, atol=1e-14)
    assert m.last_counts.tolist() == counts
    # P of L_aux: the sigmoid scores normalised over all experts (DeepSeek-V3 eq. 19–20)
    s_all = torch.sigmoid(x[0] @ W.t())
    P = (s_all / s_all.sum(-1, keepdim=True)).mean(0)
    f = torch.tensor(counts, dtype=F64) / 6
    torch.testing.assert_close(m.last_aux_loss, 4 * (f * P).sum(), rtol=1e-12, atol=0)
    m.update_bias()
    mean = sum(counts) / 4
    expect = [b[e] + 0.25 * ((mean > counts[e]) - (mean < counts[e])) for e in range(4)]
    assert m.expert_bias.tolist() == pytest.approx(expect, abs=1e-12)


def test_moe_sigmoid_score_is_an_option_checked_by_name():
    check_moe_options({"score": "sigmoid"})
    with pytest.raises(ValueError, match=r"score: expected one of \('softmax', 'sigmoid'\), got 'tanh'"):
        check_moe_options({"score": "tanh"})


def test_moe_sigmoid_all_dispatches_agree_and_normalised_weights_never_nan():
    torch.manual_seed(1)
    m = MoE(4, n_experts=5, top_k=2, expert_hidden=3, score="sigmoid", bias_balancing=True).double()
    x = torch.randn(2, 7, 4, dtype=F64)
    with torch.no_grad():
        m.router.weight.mul_(200.0)  # sigmoid scores underflowing to 0 for some experts
        m.expert_bias.copy_(torch.tensor([3.0, 3.0, 0.0, 0.0, 0.0], dtype=F64))
    outs = []
    for d in ("sorted", "padded", "fixed", "reference"):
        m.dispatch = d
        outs.append(m(x))
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], rtol=1e-12, atol=1e-14)
    assert torch.isfinite(outs[0]).all()


@pytest.mark.parametrize("eps", [-1.0, float("nan"), "1e-5"])
def test_attention_bad_norm_eps_is_named_as_the_argument_given(eps):
    """``Attention(qk_norm=True, norm_eps=-1)`` raised about ``eps`` (the inner RMSNorm's name),
    not the ``norm_eps`` the caller passed."""
    from mnemo.layers.attention import Attention

    with pytest.raises(ValueError, match=r"^norm_eps: expected a finite number >= 0"):
        Attention(16, n_heads=4, qk_norm=True, norm_eps=eps)


def test_bias_update_sign_is_exact_for_counts_above_float32_precision():
    """``update_bias`` compared the counts with their mean in float32: above 2²⁴ assignments per
    step (a large batch × top-k) an expert 1 over the mean rounded onto it and got no step."""
    m = MoE(4, n_experts=4, top_k=2, expert_hidden=3, bias_balancing=True, bias_update_rate=0.5)
    c = 2**24
    m.update_bias(torch.tensor([c + 1, c - 1, c, c]))
    assert m.expert_bias.tolist() == [-0.5, 0.5, 0.0, 0.0]
    m.update_bias(torch.tensor([c + 1, c - 1, c, c], dtype=F64))  # the trainer's summed counts
    assert m.expert_bias.tolist() == [-1.0, 1.0, 0.0, 0.0]


def test_moe_sigmoid_with_bias_equals_transformers_deepseek_v3_moe():
    """``score="sigmoid", norm_topk_prob=True, bias_balancing=True`` with a shared expert is
    ``transformers``' ``DeepseekV3MoE`` (one group, ``routed_scaling_factor = 1``), bias included."""
    pytest.importorskip("transformers")
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    torch.manual_seed(0)
    cfg = DeepseekV3Config(hidden_size=8, moe_intermediate_size=4, n_routed_experts=4, num_experts_per_tok=2,
                           n_group=1, topk_group=1, n_shared_experts=1, routed_scaling_factor=1.0,
                           norm_topk_prob=True)  # fmt: skip
    hf = DeepseekV3MoE(cfg).eval()
    m = MoE(8, n_experts=4, top_k=2, expert_hidden=4, shared_expert_hidden=4, score="sigmoid",
            bias_balancing=True).eval()  # fmt: skip
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(std=0.5)
        hf.gate.e_score_correction_bias.copy_(torch.tensor([0.3, -0.2, 0.1, 0.0]))
        m.router.weight.copy_(hf.gate.weight)
        m.expert_bias.copy_(hf.gate.e_score_correction_bias)
        m.w_in.copy_(hf.experts.gate_up_proj)
        m.w_out.copy_(hf.experts.down_proj)
        sh = hf.shared_experts
        m.shared_expert.w_in.weight.copy_(torch.cat([sh.gate_proj.weight, sh.up_proj.weight]))
        m.shared_expert.w_out.weight.copy_(sh.down_proj.weight)
        x = torch.randn(2, 7, 8)
        torch.testing.assert_close(m(x), hf(x), rtol=1e-5, atol=1e-5)
