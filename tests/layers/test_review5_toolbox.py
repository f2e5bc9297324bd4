"""Review 5 of softmax attention's efficiency toolbox (RoPE / YaRN / NTK, sinks and windows, GQA,
MoE and its auxiliary losses): what the fifth break-it pass found, each checked against a hand
computation from the source equations where it is about values."""

from __future__ import annotations

import copy
import math

import torch

from mnemo.layers.moe import MoE


def test_moe_module_and_a_moe_model_deepcopy_after_a_training_forward():
    """``copy.deepcopy`` (the evaluation harness copies a caller's model before a cast, an EMA
    keeps a copy) failed after any forward with gradients: the module kept ``last_aux_loss`` /
    ``last_z_loss`` with their graph, and a non-leaf tensor cannot be deep-copied."""
    from mnemo.models import LanguageModel, ModelConfig

    torch.manual_seed(0)
    m = MoE(8, n_experts=4, top_k=2, expert_hidden=6, z_loss_coef=0.1)
    y = m(torch.randn(3, 8))
    twin = copy.deepcopy(m)  # before the backward (the graph is alive) ...
    assert twin.last_aux_loss.grad_fn is None and torch.equal(twin.last_aux_loss, m.last_aux_loss.detach())
    assert torch.equal(twin.last_z_loss, m.last_z_loss.detach())
    (y.sum() + m.loss()).backward()  # ... and after it
    twin = copy.deepcopy(m)
    assert m.last_aux_loss.grad_fn is not None  # the original keeps its graph for the training loss
    x = torch.randn(5, 8)
    assert torch.equal(twin(x), m(x))
    cfg = ModelConfig(vocab_size=11, d_model=16, n_layers=1, mlp="moe", mlp_options={"n_experts": 4})
    model = LanguageModel(cfg)
    ids = torch.randint(0, 11, (2, 7))
    logits, _ = model(ids)
    (logits.sum() + model.aux_loss()).backward()
    clone = copy.deepcopy(model)
    assert torch.equal(clone(ids)[0], model(ids)[0])


def test_aux_loss_ceiling_is_e_over_k_by_hand_and_the_docstring_says_so():
    """Switch's ``E · Σ f_e P_e`` counted over all ``k`` choices: an expert takes at most one of a
    token's choices (``f_e ≤ 1/k``), so the loss is at most ``E / k``; a router certain of expert 0
    for every token reaches it (f = (1/2, ·), P = (1, 0, 0, 0): 4 · 1/2 · 1 = 2 for E = 4, k = 2).
    The module docstring said ``E`` (true for top-1 only)."""
    import mnemo.layers.moe as moe_module

    for k, expected in ((1, 4.0), (2, 2.0), (3, 4 / 3)):
        m = MoE(4, n_experts=4, top_k=k, expert_hidden=3, norm_topk_prob=False).double()
        with torch.no_grad():
            m.router.weight.zero_()
            m.router.weight[0, 0] = 100.0  # logit 100 · x_0 for expert 0, 0 for the others
        x = torch.zeros(6, 4, dtype=torch.float64)
        x[:, 0] = 1.0
        m(x)
        s0 = 1 / (1 + 3 * math.exp(-100.0))
        f0 = 1 / k  # every token's first choice; the other k − 1 choices go to experts of score ≈ 0
        hand = 4 * (f0 * s0 + (1 - f0) * (1 - s0) / 3)
        assert abs(m.last_aux_loss.item() - hand) < 1e-12 and abs(hand - expected) < 1e-12
    doc = " ".join(moe_module.__doc__.split())
    assert "at most ``E / k``" in doc and "``E`` when every token goes to one expert" not in doc


def test_rotary_built_on_meta_and_materialised_with_to_empty_has_its_frequencies():
    """The usual large-model build (``with torch.device("meta")``, ``to_empty``, ``load_state_dict``)
    left the rotary frequencies as uninitialised memory: they are non-persistent buffers, which
    ``load_state_dict`` never fills, so the attention computed silently wrong values."""
    from mnemo.layers import Attention

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 2.0}
    torch.manual_seed(0)
    ref = Attention(16, n_heads=2, n_kv_heads=1, rope_scaling=yarn, rotary_dim=6)
    with torch.device("meta"):
        att = Attention(16, n_heads=2, n_kv_heads=1, rope_scaling=yarn, rotary_dim=6)
    att.to_empty(device="cpu")
    att.load_state_dict(ref.state_dict())
    # the frequencies of the equation: θ_i = 10000^{−2i/6}, then YaRN's h(θ) (L = 16, α = 1, β = 2)
    theta = [10000 ** (-2 * i / 6) for i in range(3)]
    r = [16 * t / (2 * math.pi) for t in theta]
    gamma = [min(max(r_ - 1.0, 0.0), 1.0) for r_ in r]  # (r − α) / (β − α), clamped
    hand = torch.tensor([(1 - g) * t / 4 + g * t for g, t in zip(gamma, theta)])
    assert torch.allclose(att.rotary.inv_freq, hand, rtol=1e-6, atol=0)
    assert torch.allclose(att.rotary.base_inv_freq, torch.tensor(theta), rtol=1e-6, atol=0)
    x = torch.randn(2, 9, 16)
    assert torch.equal(att(x)[0], ref(x)[0])


def test_normalised_routing_weights_stay_finite_when_the_bias_chooses_experts_of_score_zero():
    """Auxiliary-loss-free balancing chooses by ``s + b`` (``b`` grows by ``u`` per step, past 1
    after a thousand steps of imbalance), so it may choose experts whose softmax score underflowed
    to 0 (a logit gap > ~104 in float32); ``s_e / Σ_TopK s`` was then 0 / 0 = NaN for the whole
    token. The weights equal the softmax of the chosen logits, computed so: by hand (logits 120,
    0, 0, 0; experts 1 and 2 chosen) they are 1/2 each."""
    m = MoE(4, n_experts=4, top_k=2, expert_hidden=3, bias_balancing=True)
    with torch.no_grad():
        m.router.weight.zero_()
        m.router.weight[0, 0] = 120.0
        m.expert_bias.copy_(torch.tensor([0.0, 1.5, 1.2, 0.0]))
    x = torch.zeros(2, 4)
    x[:, 0] = 1.0
    seen = {}
    m.hook_topk_indices.add(lambda v, name: seen.setdefault("idx", v))
    m.hook_topk_weights.add(lambda v, name: seen.setdefault("w", v))
    y = m(x)
    assert seen["idx"].tolist() == [[1, 2], [1, 2]]
    assert torch.equal(seen["w"], torch.full((2, 2), 0.5))
    assert torch.isfinite(y).all()
    hand = 0.5 * (m._expert(x, 1) + m._expert(x, 2))
    assert torch.allclose(y, hand, rtol=1e-6, atol=1e-9)
    # elsewhere the same values as s_e / Σ s (float64, by hand from the softmax)
    torch.manual_seed(0)
    m = MoE(6, n_experts=5, top_k=3, expert_hidden=4).double()
    x = torch.randn(7, 6, dtype=torch.float64)
    m.hook_topk_weights.add(lambda v, name: seen.__setitem__("w2", v))
    m(x)
    s = (x @ m.router.weight.T).softmax(-1)
    top = s.topk(3, -1)
    assert torch.allclose(seen["w2"], top.values / top.values.sum(-1, keepdim=True), rtol=0, atol=1e-15)


def test_yarn_docstring_states_the_range_of_transformers_frequencies_over_the_papers():
    """The docstring said transformers' frequencies are *higher* inside the ramp; one dimension
    (the fast end, rounded down) is lower. The ratio's range for its example, computed here from
    both equations by hand (no mnemo code): ramp linear in r (paper, eq. 18) vs in the index."""
    import mnemo.layers.rotary as rotary

    s, L, R, base = 4.0, 4096, 128, 10000.0
    theta = [base ** (-2 * i / R) for i in range(R // 2)]
    paper = []
    for t in theta:
        g = min(max((L * t / (2 * math.pi) - 1.0) / (32.0 - 1.0), 0.0), 1.0)
        paper.append((1 - g) * t / s + g * t)

    def dim(n):
        return R * math.log(L / (n * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = max(math.floor(dim(32.0)), 0), min(math.ceil(dim(1.0)), R - 1)
    hf = []
    for i, t in enumerate(theta):
        g = min(max((i - lo) / (hi - lo), 0.0), 1.0)
        hf.append(g * t / s + (1 - g) * t)
    ratios = [h / p for h, p in zip(hf, paper)]
    assert round(max(ratios), 2) == 1.73 and round(min(ratios), 3) == 0.977
    doc = " ".join(rotary.yarn_inv_freq.__doc__.split())
    assert "up to 1.73×" in doc and "0.977×" in doc
