"""Regression review of the MoE commit "routed_scaling_factor and group-limited routing" (session 43,
area F). No defect was found in the change; these tests close gaps its own tests left open: each one
fails on a plausible wrong implementation that the commit's tests accept (checked by mutation).

* the excluded experts are set to ``−inf`` (the docstring's claim), not to 0 as DeepSeek-V3's
  Hugging Face modeling code does: with a negative balancing bias the kept experts' selection scores
  are below 0 and a 0-fill would route to the excluded groups;
* a module pickled before the options existed (no ``routed_scaling_factor`` / ``n_group`` /
  ``topk_group`` attributes) still loads and routes as before;
* group limit, scaling, bias and shared expert together equal ``transformers``' ``DeepseekV3MoE``
  (an implementation independent of ours) with ``n_group > topk_group`` and ``γ ≠ 1``."""

from __future__ import annotations

import io
import math

import pytest
import torch
import torch.nn.functional as F

from mnemo.layers import MoE

F64 = torch.float64
TOL = 1e-12


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


def test_excluded_experts_lose_to_kept_experts_with_negative_selection_scores():
    # 8 experts in 4 groups of 2, affinities s; bias −1 on every expert: s + b in (−1, 0) everywhere.
    # Group scores (sum of the top-2 s + b): g0 = −1.0, g1 = −0.75, g2 = −0.95, g3 = −1.65: kept
    # g1, g2 (topk_group = 2); top-3 of s + b among experts 2..5: {2, 3, 4}. Excluded experts filled
    # with 0 (instead of −inf) would beat every kept one: the choice would be three excluded experts.
    s = [0.9, 0.1, 0.65, 0.6, 0.55, 0.5, 0.2, 0.15]
    d, H, gamma = 8, 4, 2.5
    torch.manual_seed(0)
    m = MoE(d, n_experts=8, top_k=3, expert_hidden=H, score="sigmoid", bias_balancing=True,
            routed_scaling_factor=gamma, n_group=4, topk_group=2).double()  # fmt: skip
    with torch.no_grad():
        m.router.weight.zero_()
        m.router.weight[:, 0] = torch.tensor([_logit(p) for p in s], dtype=F64)
        m.expert_bias.fill_(-1.0)
    x = torch.zeros(1, d, dtype=F64)
    x[0, 0] = 1.0
    y = m(x)[0]
    assert m.last_counts.tolist() == [0, 0, 1, 1, 1, 0, 0, 0]
    chosen = [2, 3, 4]
    total = sum(s[e] for e in chosen)
    want = torch.zeros(d, dtype=F64)
    for e in chosen:  # eq. 13 with the unbiased affinities, times γ; E_e(x) = W_out (silu(W_g x) ⊙ W_u x)
        h = m.w_in[e] @ x[0]
        want = want + gamma * (s[e] / total) * (m.w_out[e] @ (F.silu(h[:H]) * h[H:]))
    assert (y - want).abs().max() < TOL


def test_module_pickled_before_the_options_existed_routes_as_before():
    torch.manual_seed(1)
    m = MoE(16, n_experts=4, top_k=2, expert_hidden=8, bias_balancing=True).double().train()
    x = torch.randn(2, 3, 16, dtype=F64)
    y0 = m(x)
    for name in ("routed_scaling_factor", "n_group", "topk_group"):  # as an older mnemo pickled it
        del m.__dict__[name]
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    old = torch.load(buf, weights_only=False)
    assert torch.equal(old(x), y0)
    assert "n_group" not in repr(old) and "routed_scaling_factor" not in repr(old)
    old.update_bias()
    assert old.expert_bias.abs().max() > 0


def test_group_limit_scaling_bias_and_shared_expert_equal_transformers_deepseek_v3_moe():
    pytest.importorskip("transformers")
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    torch.manual_seed(2)
    cfg = DeepseekV3Config(hidden_size=8, moe_intermediate_size=4, n_routed_experts=8, num_experts_per_tok=3,
                           n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5,
                           norm_topk_prob=True)  # fmt: skip
    hf = DeepseekV3MoE(cfg).eval()
    m = MoE(8, n_experts=8, top_k=3, expert_hidden=4, shared_expert_hidden=4, score="sigmoid",
            bias_balancing=True, routed_scaling_factor=2.5, n_group=4, topk_group=2).eval()  # fmt: skip
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(std=0.5)
        bias = torch.tensor([0.3, -0.2, 0.1, 0.0, 0.05, -0.1, 0.2, 0.0])
        hf.gate.e_score_correction_bias.copy_(bias)
        m.router.weight.copy_(hf.gate.weight)
        m.expert_bias.copy_(bias)
        m.w_in.copy_(hf.experts.gate_up_proj)
        m.w_out.copy_(hf.experts.down_proj)
        sh = hf.shared_experts
        m.shared_expert.w_in.weight.copy_(torch.cat([sh.gate_proj.weight, sh.up_proj.weight]))
        m.shared_expert.w_out.weight.copy_(sh.down_proj.weight)
    x = torch.randn(2, 9, 8)
    _, _, idx_hf = hf.gate(x)
    _, scores, idx = m.route(x)
    assert [set(r) for r in idx.tolist()] == [set(r) for r in idx_hf.tolist()]
    # the limit binds here: some token's unlimited top-3 of s + b leaves its kept groups
    free = (scores + bias).topk(3, dim=-1).indices
    assert [set(r) for r in free.tolist()] != [set(r) for r in idx.tolist()]
    torch.testing.assert_close(m(x), hf(x), rtol=1e-5, atol=1e-5)
