"""Nested-learning pieces against hand computations: a task level absorbing a signal that is not
period-aligned, the projection memories' rewrite rule, their initialisation, M3's defaults (which
the training config mirrors), and the task signal under activation checkpointing."""

from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F

from mnemo.nested import M3, CMSLevel, Level, SelfModifyingProjections
from tests.helpers import assert_close

D = 6


def test_a_task_level_steps_at_the_period_end_and_carries_the_rest():
    """C = 4, six tokens absorbed at once: one step with the first four tokens' summed gradient
    (at the initial weights); the last two accumulate, taken at the stepped weights."""
    torch.manual_seed(0)
    lv = CMSLevel(D, Level(4, expansion=1.0, lr=3.0, objective="task")).double()
    x = torch.randn(1, 6, D, dtype=torch.float64)
    delta = torch.randn(1, 6, D, dtype=torch.float64)
    st = lv.absorb(x, delta, lv.initial_state(1))
    assert (st.updates, st.absorbed) == (1, 6)
    eta = lv.rates(x).detach()

    def grads(W, sl):  # ∇_W Σ_t η_t ⟨δ_t, MLP_W(x_t)⟩ over the tokens sl
        W = [w.detach().clone().requires_grad_(True) for w in W]
        y = F.gelu(x[:, sl] @ W[0]) @ W[1]
        return torch.autograd.grad((eta[:, sl] * delta[:, sl] * y).sum(), W)

    W0 = (lv.W_in.detach(), lv.W_out.detach())
    W1 = tuple(w - g for w, g in zip(W0, grads(W0, slice(0, 4))))
    for got, want in zip(st.weights, W1):
        assert_close(got[0], want, 1e-12)
    for got, want in zip(st.grad, grads(W1, slice(4, 6))):
        assert_close(got[0], want, 1e-12)


def test_projection_memories_take_one_delta_rule_step_per_chunk():
    """M ← α M − (η / C) X̂ᵀ (X̂ − O) M for every projection memory (module docstring)."""
    torch.manual_seed(0)
    C = 4
    m = SelfModifyingProjections(8, n_heads=2, chunk_size=C).double()
    with torch.no_grad():
        m.self_alpha.copy_(torch.tensor([0.5, 1.0, -1.0, 2.0]))
        m.self_eta.copy_(torch.tensor([1.0, -2.0, 0.0, 3.0]))
    x = torch.randn(2, C, 8, dtype=torch.float64)
    st0 = m.initial_state(2)
    seen = {}
    handle = m.hook_o.register_forward_hook(lambda mod, args, out: seen.__setitem__("o", out))
    with torch.no_grad():
        _, st = m(x, st0, mode="recurrent")
    handle.remove()
    o = seen["o"]  # the main memory's read-out O of the chunk
    assert st.offset == C and st.r is None  # the chunk is complete: rewritten, sum cleared
    xh = x / x.norm(dim=-1, keepdim=True)
    R = xh.transpose(1, 2) @ (xh - o.reshape(2, C, 8))
    alpha, eta = torch.sigmoid(m.self_alpha), m.self_lr * torch.sigmoid(m.self_eta)
    for i, name in enumerate(("k", "v", "beta", "alpha")):
        M = st0.proj[name].detach()
        assert_close(st.proj[name], alpha[i] * M - eta[i] / C * (R @ M), 1e-12, what=name)


def test_projection_memories_start_with_unit_variance_outputs():
    torch.manual_seed(0)
    m = SelfModifyingProjections(256, n_heads=4)
    w = m.init["k"].detach()  # N(0, 1/d): x M keeps the scale of x
    assert abs(w.std().item() - 256**-0.5) < 0.05 * 256**-0.5 and abs(w.mean().item()) < 0.01


def test_projection_memories_rewrite_with_their_documented_initial_rates():
    """At init ``α_□ = sigmoid(4) ≈ 0.98`` (the documented slow forgetting) and ``η_□ = self_lr ·
    sigmoid(0)`` with the default ``self_lr = 0.1``: one chunk rewrites every projection memory
    to ``0.9820 M − (0.05 / C) R M``, the constants written out here."""
    assert inspect.signature(SelfModifyingProjections).parameters["self_lr"].default == 0.1
    torch.manual_seed(0)
    C = 4
    m = SelfModifyingProjections(8, n_heads=2, chunk_size=C).double()
    x = torch.randn(2, C, 8, dtype=torch.float64)
    st0 = m.initial_state(2)
    seen = {}
    handle = m.hook_o.register_forward_hook(lambda mod, args, out: seen.__setitem__("o", out))
    with torch.no_grad():
        _, st = m(x, st0, mode="recurrent")
    handle.remove()
    xh = x / x.norm(dim=-1, keepdim=True)
    R = xh.transpose(1, 2) @ (xh - seen["o"].reshape(2, C, 8))
    alpha, eta = 1 / (1 + math.exp(-4.0)), 0.1 * 0.5
    assert round(alpha, 2) == 0.98
    for name in ("k", "v", "beta", "alpha"):
        M = st0.proj[name].detach()
        assert_close(st.proj[name], alpha * M - eta / C * (R @ M), 1e-12, what=name)


def test_self_modifying_titans_memories_start_near_the_identity():
    """``M(x) = x + gelu(x W_a) W_b`` starts near the identity: ``W_a ~ N(0, 1/d)`` keeps the
    scale of x, ``W_b ~ N(0, (0.1)² / h)`` is a tenth of that scale, so the residual branch adds
    about a tenth; checked on the weights (d = h = 64, at least 4096 draws each: the sample
    standard deviation is within 5 %)."""
    from mnemo.nested import SelfModifyingTitans

    torch.manual_seed(0)
    m = SelfModifyingTitans(64, n_heads=4)  # expansion 1: h = d
    h = m.hidden
    assert h == 64
    scales = {"memory_wa": 64**-0.5, "proj_wa": 64**-0.5, "memory_wb": 0.1 / h**0.5, "proj_wb": 0.1 / h**0.5}
    for name, std in scales.items():
        w = getattr(m, name).detach()
        assert abs(w.std().item() - std) < 0.05 * std and abs(w.mean().item()) < 0.1 * std, name


def test_m3_defaults_and_the_training_config_mirrors_them():
    from mnemo.train import TrainConfig

    p = inspect.signature(M3).parameters
    defaults = {n: p[n].default for n in ("lr", "betas", "alpha", "eps", "ns_steps", "slow_every")}
    # Muon's five quintic Newton–Schulz steps; Adam's β1, β2 and ε; β3 = 0.99; α = 0.5; f = 10
    assert defaults == {
        "lr": 1e-3, "betas": (0.9, 0.999, 0.99), "alpha": 0.5, "eps": 1e-8, "ns_steps": 5, "slow_every": 10
    }  # fmt: skip
    cfg = TrainConfig()
    assert (cfg.m3_beta3, cfg.m3_alpha, cfg.m3_ns_steps, cfg.m3_slow_every) == (0.99, 0.5, 5, 10)
    assert cfg.m3_eps == 1e-2  # documented departure from M3's own 1e-8


def test_task_signal_is_the_same_with_activation_checkpointing():
    """A training forward under activation checkpointing gives the same task-level steps (the
    signal's own re-run of the segment never checkpoints: its reads are captured)."""
    from mnemo.models import LanguageModel, build_config

    levels = [{"period": 4, "objective": "task", "lr": 2.0}]
    cfg = build_config("hope_attention", vocab_size=11, d_model=8, n_layers=1, mlp_options={"levels": levels})
    ids = torch.randint(0, 11, (2, 9), generator=torch.Generator().manual_seed(1))
    results = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        m = LanguageModel(cfg).double().train()
        m.activation_checkpointing = ckpt
        logits, st = m(ids)
        results.append((logits.detach(), st[0].mlp.levels[0]))
    (l0, s0), (l1, s1) = results
    assert s0.updates == s1.updates == 2
    assert_close(l1, l0, 1e-12)
    for a, b in zip(s1.weights, s0.weights):
        assert_close(a, b, 1e-12)


def test_state_sizes_default_to_one_sequence_and_scale_with_the_batch():
    from mnemo.nested import ContinuumMemory, SelfModifyingTitans

    mixers = (SelfModifyingProjections(8, n_heads=2, chunk_size=4), SelfModifyingTitans(8, n_heads=2))
    for m in (*mixers, ContinuumMemory(8)):
        one = m.state_size_bytes()
        assert one > 0 and m.state_size_bytes(1) == one and m.state_size_bytes(3) == 3 * one


def test_projection_mixer_state_size_is_the_bytes_of_its_state():
    """Projections (per sample after the first rewrite), the chunk's one d × d sum R, the main
    memory's weights and anchor, and the conv tail (measured mid-chunk, when R exists)."""

    def nbytes(o):
        if isinstance(o, torch.Tensor):
            return o.numel() * o.element_size()
        if isinstance(o, dict):
            return sum(nbytes(v) for v in o.values())
        if isinstance(o, (list, tuple)):
            return sum(nbytes(v) for v in o)
        return 0

    m = SelfModifyingProjections(8, n_heads=2, chunk_size=4)
    with torch.no_grad():
        _, st = m(torch.randn(2, 6, 8))  # one rewrite done, two tokens into the next chunk
    parts = (st.proj, st.r, st.memory_weights, st.memory_momentum, st.memory_anchor, st.memory_anchor_decay)
    assert m.state_size_bytes(2, 6) == nbytes((*parts, st.conv))


def test_cms_state_spec_defaults_to_the_fresh_state_of_one_sequence():
    """``state_spec()`` with its defaults is the state before any token (batch 1): each level's
    fresh state (no tokens read, no step taken) with the same tensor shapes and dtypes."""
    from mnemo.nested import ContinuumMemory

    cm = ContinuumMemory(8, levels=(Level(1), Level(3, optimizer="momentum")))
    spec = cm.state_spec()
    assert len(spec.levels) == 2 and spec.pending is None
    for lv, s in zip(cm.levels, spec.levels):
        fresh = lv.initial_state(1)
        assert (
            (s.position, s.updates, s.absorbed)
            == (fresh.position, fresh.updates, fresh.absorbed)
            == (0, 0, 0)
        )
        for name in ("weights", "momentum", "grad"):
            a, b = getattr(s, name), getattr(fresh, name)
            assert (a is None) == (b is None), name
            for x, y in zip(a or (), b or ()):
                assert x.shape == y.shape and x.dtype == y.dtype, name


def test_a_task_level_after_another_level_streams_like_one_pass():
    """The only task level is the second level of the block (index ``(block 0, level 1)``): a
    stream split in calls — each call picks the pending segment up from that block's state — gives
    the one-pass logits and steps (module docstring: any split of a stream equals one pass)."""
    from mnemo.models import LanguageModel, build_config

    levels = [{"period": 1}, {"period": 4, "objective": "task", "lr": 2.0}]
    cfg = build_config("hope_attention", vocab_size=11, d_model=8, n_layers=1, mlp_options={"levels": levels})
    torch.manual_seed(0)
    m = LanguageModel(cfg).double()
    ids = torch.randint(0, 11, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole, st_whole = m(ids)
        parts, st = [], None
        for a, b in ((0, 5), (5, 6), (6, 11)):
            logits, st = m(ids[:, a:b], st)
            parts.append(logits)
    task_whole, task_split = st_whole[0].mlp.levels[1], st[0].mlp.levels[1]
    assert task_whole.updates == task_split.updates == 2  # periods of 4 done: tokens 0-3 and 4-7
    assert_close(torch.cat(parts, 1), whole, 1e-12)
    for a, b in zip(task_split.weights, task_whole.weights):
        assert_close(a, b, 1e-12)
