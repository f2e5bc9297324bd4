"""Continuum Memory System, self-modifying Titans, M3, HOPE."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mnemo.models import LanguageModel, build_config
from mnemo.nested import M3, CMSLevel, ContinuumMemory, Level, SelfModifyingTitans
from tests.helpers import assert_close

D = 8


def _level(period, seed=0, **kw):
    torch.manual_seed(seed)
    lv = CMSLevel(D, Level(period, expansion=2.0, lr=4.0, **kw)).double()
    with torch.no_grad():
        for p in lv.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return lv


def _x(T, B=2, seed=1):
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_update_cadence():
    """Periods 2 and 4 over 9 tokens give 4 and 2 updates; the leftover token waits (carry)."""
    cms = ContinuumMemory(D, [Level(2), Level(4)]).double()
    _, st = cms(_x(9))
    assert [s.updates for s in st.levels] == [4, 2]
    assert [s.position for s in st.levels] == [9, 9]
    _, st2 = cms(_x(3, seed=2), st)  # 3 more tokens: 12 in all
    assert [s.updates for s in st2.levels] == [6, 3]


def test_period_one_is_online_gradient_descent():
    """C = 1, one level: predict with the current weights, then one GD step on
    (η_t / 2d) ‖MLP(x_t) − W_v x_t‖² (gradients by autograd, independent of the level's own backward)."""
    lv = _level(1)
    x = _x(7)
    y, _ = lv(x)
    W_in = lv.W_in.detach().expand(2, -1, -1).clone()
    W_out = lv.W_out.detach().expand(2, -1, -1).clone()
    for t in range(7):
        xt = x[:, t : t + 1]
        W_in.requires_grad_(True)
        W_out.requires_grad_(True)
        out = F.gelu(xt @ W_in) @ W_out
        assert_close(y[:, t : t + 1], out, 1e-12, what=f"token {t}")
        eta = lv.level.lr * torch.sigmoid(lv.rate(xt)).detach() / D
        loss = (eta * 0.5 * (out - lv.value(xt).detach()).square().sum(-1, keepdim=True)).sum()
        g_in, g_out = torch.autograd.grad(loss, (W_in, W_out))
        W_in, W_out = (W_in - g_in).detach(), (W_out - g_out).detach()


@pytest.mark.parametrize("optimizer", ["gd", "momentum", "delta_momentum"])
def test_streaming_in_pieces_equals_full_pass(optimizer):
    cms = ContinuumMemory(D, [Level(3, optimizer=optimizer), Level(5, optimizer=optimizer)]).double()
    x = _x(23)
    full, st_full = cms(x)
    outs, st, a = [], None, 0
    for b in (1, 4, 5, 11, 23):
        y, st = cms(x[:, a:b], st)
        outs.append(y)
        a = b
    assert_close(torch.cat(outs, 1), full, 1e-12)
    for s1, s2 in zip(st.levels, st_full.levels):
        for w1, w2 in zip(s1.weights, s2.weights):
            assert_close(w1, w2, 1e-12)


def test_flush_policy_steps_at_every_call_end():
    lv = _level(4, partial="flush")
    x = _x(6)
    _, st = lv(x)
    assert st.updates == 2 and st.position == 0  # one full period + the flushed partial one
    carry = _level(4)
    _, st_c = carry(x)
    assert st_c.updates == 1 and st_c.position == 6
    assert not torch.allclose(st.weights[0], st_c.weights[0])


def test_delta_momentum_overwrites_along_the_gradient():
    lv = _level(1, optimizer="delta_momentum", beta=0.5)
    st = lv.initial_state(1)
    g = (torch.ones(1, D, 16, dtype=torch.float64), torch.zeros(1, 16, D, dtype=torch.float64))
    m = (2.0 * g[0] + 1.0, torch.zeros_like(g[1]))  # momentum with a component along g
    st = st._replace(momentum=m, grad=g)
    new = lv._step(st, 1)
    ghat = g[0] / g[0].norm()
    proj = (m[0] * ghat).sum()
    assert_close(new.momentum[0], 0.5 * (m[0] - proj * ghat) - g[0], 1e-12)


def test_samples_are_independent_and_gradients_reach_the_slow_weights():
    lv = _level(3)
    x = _x(10)
    y, _ = lv(x)
    x2 = x.clone()
    x2[1] += 1.0
    y2, _ = lv(x2)
    assert torch.equal(y[0], y2[0]) and not torch.allclose(y[1], y2[1])
    y.square().sum().backward()
    for name, p in lv.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_self_modifying_titans_streams_and_rewrites_its_projections():
    torch.manual_seed(0)
    m = SelfModifyingTitans(16, n_heads=2, chunk_size=4).double()
    x = torch.randn(2, 11, 16, dtype=torch.float64)
    full, st = m(x)
    assert not torch.equal(st.memory.proj["k"], m.init["k"].expand(2, -1, -1))  # rewritten twice
    outs, s, a = [], None, 0
    for b in (1, 3, 6, 11):
        y, s = m(x[:, a:b], s)
        outs.append(y)
        a = b
    assert_close(torch.cat(outs, 1), full, 1e-10)
    assert_close(m(x, mode="recurrent")[0], full, 1e-10)
    full.square().sum().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_m3_without_slow_momentum_is_adam():
    torch.manual_seed(0)
    w1 = torch.randn(5, requires_grad=True)
    w2 = w1.detach().clone().requires_grad_(True)
    o1 = M3([w1], lr=0.1, betas=(0.9, 0.99, 0.9), slow_weight=0.0)
    o2 = torch.optim.Adam([w2], lr=0.1, betas=(0.9, 0.99))
    for step in range(6):
        for w, o in ((w1, o1), (w2, o2)):
            o.zero_grad()
            ((w - step) ** 2).sum().backward()
            o.step()
    assert torch.allclose(w1, w2, atol=1e-6)


def test_m3_slow_momentum_updates_every_f_steps():
    w = torch.zeros(3, requires_grad=True)
    opt = M3([w], lr=0.01, slow_every=3)
    for i in range(5):
        opt.zero_grad()
        w.grad = torch.ones(3)
        opt.step()
        slow = opt.state[w]["m2"]
        assert torch.count_nonzero(slow) == (3 if i >= 2 else 0)
    with pytest.raises(ValueError, match="slow_every"):
        M3([w], slow_every=0)


@pytest.mark.parametrize("name", ["hope", "hope_attention"])
def test_hope_models_decode_like_the_full_pass(name):
    torch.manual_seed(0)
    cfg = build_config(
        name,
        vocab_size=40,
        d_model=16,
        n_layers=2,
        mlp_options={"levels": [{"period": 2}, {"period": 3}]},
        **({"mixer_options": {"self_modifying_titans": {"chunk_size": 4}}} if name == "hope" else {}),
    )
    m = LanguageModel(cfg).double()
    ids = torch.randint(0, 40, (2, 13))
    full, _ = m(ids)
    logits, st = m(ids[:, :2])
    outs = [logits]
    for t in range(2, 13):
        logits, st = m(ids[:, t : t + 1], st)
        outs.append(logits)
    assert_close(torch.cat(outs, 1), full, 1e-10)


def test_hope_trains_on_tinyshakespeare_without_nan(tmp_path):
    from mnemo.train import TrainConfig, Trainer

    cfg = TrainConfig(
        model="hope",
        model_overrides={"d_model": 32, "n_layers": 1},
        seq_len=64,
        batch_size=4,
        steps=12,
        eval_interval=6,
        eval_batches=1,
        sample_tokens=0,
        optimizer="m3",
    )
    rec = Trainer(cfg, tmp_path, progress=False).fit()
    assert rec["step"] == 12 and torch.isfinite(torch.tensor(rec["val_loss"]))
    assert rec["train_loss"] < 4.2  # below the uniform-guess loss ln(66)


def test_continual_demo_runs_and_reports_forgetting(tmp_path, capsys):
    from mnemo.cli import main

    assert (
        main(
            [
                "continual",
                "--steps",
                "4",
                "--d-model",
                "16",
                "--n-layers",
                "1",
                "--seq-len",
                "16",
                "--batch-size",
                "2",
                "--levels",
                "1,2",
                "--out",
                str(tmp_path),
                "--no-progress",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "| 1-level |" in out and "| 2-level |" in out and "forgetting on A" in out
    assert (tmp_path / "continual.json").exists() and (tmp_path / "continual.png").exists()


def test_permuted_text_is_a_new_alphabet():
    from mnemo.nested.continual import permuted_text

    t = "abcab cc"
    p = permuted_text(t, seed=3)
    assert len(p) == len(t) and sorted(set(p)) == sorted(set(t)) and p != t
    assert [t.index(c) for c in t] == [p.index(c) for c in p]  # same structure
