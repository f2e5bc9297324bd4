"""DeepSeek-V3's complementary sequence-wise balance loss in :class:`mnemo.layers.MoE` (Liu et al.
2024, §2.1.2, eq. 17–20; ``seq_aux_loss_coef``), against hand loops over the equations:

    L_Bal = α Σ_i f_i P_i                                   (17)
    f_i = E / (k T) Σ_t 1{s_{i,t} ∈ TopK({s_{j,t}}_j, k)}   (18)
    s'_{i,t} = s_{i,t} / Σ_j s_{j,t}                        (19)
    P_i = (1/T) Σ_t s'_{i,t}                                (20)

``last_seq_aux_loss`` is the mean over sequences (rows of ``x [B, T, d]``) of ``Σ_i f_i P_i``.
The router is the identity (``d_model = E``), so ``x`` holds the router logits. Tolerances: float64,
relative 1e-12 (measured ~1e-16)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from mnemo.layers import MoE
from mnemo.layers.moe import check_moe_options
from mnemo.models import ModelConfig
from mnemo.train import TrainConfig, Trainer
from tests.helpers import rel_rms

REL = 1e-12


def _moe(E=4, k=1, **kw) -> MoE:
    """``d_model = E`` with the identity router: the input is the router logits."""
    torch.manual_seed(0)
    m = MoE(E, n_experts=E, top_k=k, expert_hidden=4, **kw).double()
    with torch.no_grad():
        m.router.weight.copy_(torch.eye(E, dtype=torch.float64))
    return m


def _scores(row, score):
    if score == "sigmoid":
        return [1 / (1 + math.exp(-z)) for z in row]
    tot = sum(math.exp(z) for z in row)
    return [math.exp(z) / tot for z in row]


def _hand_seq_loss(logits, k, score="softmax", bias=None):
    """Eq. 17–20 as plain loops (without α), averaged over the sequences; the top-k of eq. 18 is
    over the unbiased scores (``bias`` only checks that it is ignored)."""
    total = 0.0
    for seq in logits:
        T, E = len(seq), len(seq[0])
        f, P = [0.0] * E, [0.0] * E
        for row in seq:
            s = _scores(row, score)
            top = sorted(range(E), key=lambda j: -s[j])[:k]  # eq. 18: unbiased affinities
            for i in top:
                f[i] += E / (k * T)
            norm = sum(s)  # eq. 19
            for i in range(E):
                P[i] += s[i] / norm / T  # eq. 20
        total += sum(f[i] * P[i] for i in range(E))  # eq. 17 (α apart)
    return total / len(logits)


def test_seq_loss_by_hand_softmax_top1():
    # B = 2 sequences of T = 2 tokens, E = 4, k = 1; chosen experts: (0, 1) and (2, 2)
    L = [[[2.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.5]], [[0.0, 0.0, 3.0, 0.0], [0.5, 0.0, 2.5, 0.0]]]
    m = _moe(E=4, k=1, norm_topk_prob=False)
    m(torch.tensor(L, dtype=torch.float64))
    want = _hand_seq_loss(L, 1)
    assert m.last_seq_aux_loss.item() == pytest.approx(want, rel=REL)
    # closed form of the second sequence (both tokens to expert 2): f = (0, 0, E/(kT) · 2 = 4, 0)
    s = [_scores(r, "softmax") for r in L[1]]
    assert want == pytest.approx((_hand_seq_loss(L[:1], 1) + 4 * (s[0][2] + s[1][2]) / 2) / 2, rel=1e-15)
    assert m.last_seq_aux_loss.dim() == 0 and m.last_seq_aux_loss.requires_grad


def test_seq_loss_sigmoid_normalises_scores_eq19():
    L = [[[1.0, -0.5, 0.25, 2.0], [0.0, 1.5, -1.0, 0.5], [-2.0, 0.3, 0.9, 0.1]]]
    m = _moe(E=4, k=2, score="sigmoid")
    m(torch.tensor(L, dtype=torch.float64))
    want = _hand_seq_loss(L, 2, score="sigmoid")
    assert m.last_seq_aux_loss.item() == pytest.approx(want, rel=REL)
    # without eq. 19 (P from the raw sigmoid affinities) the value would be different
    raw = [[sum(_scores(r, "sigmoid")[i] for r in L[0]) / 3 for i in range(4)]]
    top = [sorted(range(4), key=lambda j: -_scores(r, "sigmoid")[j])[:2] for r in L[0]]
    f = [sum(i in t for t in top) * 4 / (2 * 3) for i in range(4)]
    unnormalised = sum(f[i] * raw[0][i] for i in range(4))
    assert abs(unnormalised - want) > 0.1


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_one_sequence_equals_batchwise_aux_loss(score):
    torch.manual_seed(1)
    x = torch.randn(1, 7, 4, dtype=torch.float64) * 3
    m = _moe(E=4, k=2, score=score)
    m(x)
    assert m.last_seq_aux_loss.item() == pytest.approx(m.last_aux_loss.item(), rel=REL)
    assert m.last_seq_aux_loss.item() == pytest.approx(_hand_seq_loss(x.tolist(), 2, score), rel=REL)
    # no sequence axis (x [T, d]): one sequence of T tokens, the same value
    m(x[0])
    assert m.last_seq_aux_loss.item() == pytest.approx(m.last_aux_loss.item(), rel=REL)


def test_opposite_imbalance_batchwise_one_sequencewise_high():
    # sequence 0 sends every token to expert 0, sequence 1 to expert 1: balanced over the batch
    L = [[[5.0, -5.0]] * 4, [[-5.0, 5.0]] * 4]
    m = _moe(E=2, k=1, norm_topk_prob=False)
    m(torch.tensor(L, dtype=torch.float64))
    assert m.last_aux_loss.item() == pytest.approx(1.0, rel=REL)  # f uniform -> exactly 1
    want = _hand_seq_loss(L, 1)
    assert want == pytest.approx(2 * (1 / (1 + math.exp(-10))), rel=1e-15)  # ≈ E / k = 2
    assert m.last_seq_aux_loss.item() == pytest.approx(want, rel=REL)
    assert m.last_seq_aux_loss.item() > 1.99


def test_counts_unbiased_topk_not_the_biased_routing():
    """Eq. 18 as the paper writes it: the top-k of s, not of s + b (the routing's choice)."""
    L = [[[2.0, 1.0, 0.0, -1.0], [0.5, 1.5, 0.0, 0.2]], [[0.0, 0.1, 3.0, 0.0], [1.0, 0.0, 0.0, 0.4]]]
    m = _moe(E=4, k=1, bias_balancing=True, norm_topk_prob=False)
    with torch.no_grad():
        m.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 5.0]))  # routing: always expert 3
    m(torch.tensor(L, dtype=torch.float64))
    assert m.last_counts.tolist() == [0, 0, 0, 4]
    assert m.last_seq_aux_loss.item() == pytest.approx(_hand_seq_loss(L, 1), rel=REL)


def test_gradient_reaches_router_only_through_P():
    """d L_seq / d z_{t,j} = 1/(S T) · s_{j,t} (f_j − Σ_i f_i s_{i,t}) for softmax scores, with ``f``
    held constant (eq. 18 is a count)."""
    torch.manual_seed(2)
    x = (torch.randn(2, 3, 4, dtype=torch.float64) * 2).requires_grad_(True)
    m = _moe(E=4, k=2)
    m(x)
    (g,) = torch.autograd.grad(m.last_seq_aux_loss, x)
    S, T, E, k = 2, 3, 4, 2
    want = torch.zeros_like(x)
    for b in range(S):
        s = [_scores(r, "softmax") for r in x[b].tolist()]
        f = [0.0] * E
        for t in range(T):
            for i in sorted(range(E), key=lambda j: -s[t][j])[:k]:
                f[i] += E / (k * T)
        for t in range(T):
            mean_f = sum(f[i] * s[t][i] for i in range(E))
            for j in range(E):
                want[b, t, j] = s[t][j] * (f[j] - mean_f) / (S * T)
    assert rel_rms(g, want) < REL
    # the router's weight gets it: x is the identity router's input
    m.zero_grad()
    m(x.detach())
    m.last_seq_aux_loss.backward()
    assert m.router.weight.grad.abs().sum() > 0


def test_loss_includes_seq_term_with_its_coefficient():
    torch.manual_seed(3)
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    m = _moe(E=4, k=2, aux_loss_coef=0.01, z_loss_coef=0.1, seq_aux_loss_coef=0.3)
    m(x)
    want = 0.01 * m.last_aux_loss.item() + 0.1 * m.last_z_loss.item() + 0.3 * _hand_seq_loss(x.tolist(), 2)
    assert m.loss().item() == pytest.approx(want, rel=REL)
    off = _moe(E=4, k=2, aux_loss_coef=0.01, z_loss_coef=0.1)  # default 0: no term
    off(x)
    assert off.loss().item() == 0.01 * off.last_aux_loss.item() + 0.1 * off.last_z_loss.item()
    # a module pickled before the option existed: no term, as before
    del off.__dict__["seq_aux_loss_coef"]
    off(x)
    assert off.loss().item() == 0.01 * off.last_aux_loss.item() + 0.1 * off.last_z_loss.item()
    assert "seq_aux_loss_coef" not in repr(off) and "seq_aux_loss_coef=0.3" in repr(m)
    # a copy keeps the value, not the graph (a non-leaf tensor cannot be deep-copied)
    c = copy.deepcopy(m)
    assert c.last_seq_aux_loss.grad_fn is None and c.last_seq_aux_loss.item() == m.last_seq_aux_loss.item()


@pytest.mark.parametrize(
    "value, msg",
    [
        (-1e-4, "seq_aux_loss_coef: expected a finite number >= 0, got -0.0001"),
        ("1e-4", "seq_aux_loss_coef: expected a finite number >= 0, got '1e-4'"),
        (float("nan"), "seq_aux_loss_coef: expected a finite number >= 0, got nan"),
        (True, "seq_aux_loss_coef: expected a finite number >= 0, got True"),
    ],
)
def test_option_errors_name_key_expected_received(value, msg):
    with pytest.raises(ValueError, match=msg):
        check_moe_options({"seq_aux_loss_coef": value})
    with pytest.raises(ValueError, match=msg):
        MoE(8, n_experts=4, seq_aux_loss_coef=value)
    with pytest.raises(ValueError, match=msg):
        ModelConfig(d_model=16, mlp="moe", mlp_options={"seq_aux_loss_coef": value}).validate()


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_trainer_objective_includes_seq_loss(tmp_path):
    """One train step's gradient is that of mean CE + Σ_layers (aux · L_aux + 1e-4 · L_seq)."""
    cfg = TrainConfig(
        model="gated_deltanet_attention_moe",
        model_overrides={
            "d_model": 16,
            "n_layers": 1,
            "pattern": ["attention"],
            "mixer_options": {"attention": {"n_heads": 2}},
            "mlp_options": {"n_experts": 4, "top_k": 2, "expert_hidden": 8, "seq_aux_loss_coef": 1e-4},
        },
        seq_len=8,
        batch_size=2,
        steps=1,
        eval_interval=1,
        eval_batches=1,
        warmup_steps=0,
        sample_tokens=0,
        grad_clip=0.0,
    )
    tr = Trainer(cfg, tmp_path, progress=False)
    moe = tr.model.blocks[0].mlp
    assert moe.seq_aux_loss_coef == 1e-4
    tr.optimizer.step = lambda *a, **k: None  # keep the weights: p.grad is the step's gradient
    state = tr.generator.get_state()
    tr.train_step()
    got = tr.model.blocks[0].mlp.router.weight.grad.clone()
    tr.generator.set_state(state)
    x, y = tr.train_data.sample(cfg.batch_size, tr.generator)
    w = moe.router.weight
    logits, _ = tr.model(x)
    ce = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    g_base = torch.autograd.grad(ce + moe.aux_loss_coef * moe.last_aux_loss, w, retain_graph=True)[0]
    g_seq = torch.autograd.grad(moe.last_seq_aux_loss, w)[0]
    assert rel_rms(got, g_base + 1e-4 * g_seq) < 1e-6
    # the term is there: without it the router's gradient differs by more than the match above
    assert rel_rms(got, g_base) > 1e-3
