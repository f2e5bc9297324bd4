"""CMS levels that learn from the language model's next-token loss (``Level(objective="task")``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from mnemo.layers.cms import ContinuumMemory, Level
from mnemo.models import LanguageModel, build_config
from tests.helpers import assert_close, tiny_titans_mac

V, D = 23, 16


def _model(levels, n_layers=2, seed=0):
    torch.manual_seed(seed)
    cfg = build_config(
        "hope_attention", vocab_size=V, d_model=D, n_layers=n_layers, mlp_options={"levels": levels}
    )
    m = LanguageModel(cfg).double()
    with torch.no_grad():  # fast weights big enough that their steps matter
        for b in m.blocks:
            for lv in b.mlp.levels:
                if lv.W_in is not None:
                    lv.W_in.mul_(3.0)
                    lv.W_out.mul_(30.0)
    return m


def _ids(T, B=2, seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def test_the_step_is_eta_times_the_gradient_of_the_segments_next_token_loss():
    """Rates constant (rate weights 0): after one segment and its next token, every task level's
    weights equal W0 − η ∇_W Σ_t CE(logits_t, x_{t+1}), the gradient taken by plain autograd of a
    fresh forward through both layers (block 0's signal passes through block 1's attention)."""
    S = 4
    m = _model([{"period": S, "objective": "task", "lr": 2.0}])
    levels = [b.mlp.levels[0] for b in m.blocks]
    with torch.no_grad():
        for lv in levels:
            lv.rate.weight.zero_()
    ids = _ids(S + 1, B=1)
    _, st = m(ids)
    m.zero_grad()
    logits, _ = m(ids[:, :S])  # reads of the first segment use the initial weights
    F.cross_entropy(logits[0], ids[0, 1:], reduction="sum").backward()
    for i, lv in enumerate(levels):
        eta = lv.level.lr * torch.sigmoid(lv.rate.bias).item() / D
        s = st[i].mlp.levels[0]
        assert s.updates == 1 and s.absorbed == S
        for w, p in zip(s.weights, (lv.W_in, lv.W_out)):
            assert p.grad.abs().max() > 1e-6
            assert_close(w[0], p.detach() - eta * p.grad, 1e-12, what=f"block {i}")


def test_reads_after_the_step_use_the_stepped_weights():
    """One layer: the logits of the second segment equal those of a model whose (static, lr = 0)
    level holds the stepped weights (attention there sees only embeddings, so only the CMS differs)."""
    S = 3
    m = _model([{"period": S, "objective": "task"}], n_layers=1)
    ids = _ids(2 * S)
    logits, _ = m(ids)
    _, st = m(ids[:, : S + 1])
    W1 = st[0].mlp.levels[0].weights
    static = _model([{"period": S, "lr": 0.0}], n_layers=1)
    static.load_state_dict({k: v for k, v in m.state_dict().items() if "value" not in k}, strict=False)
    twin = []
    for b in range(ids.shape[0]):
        with torch.no_grad():
            static.blocks[0].mlp.levels[0].W_in.copy_(W1[0][b])
            static.blocks[0].mlp.levels[0].W_out.copy_(W1[1][b])
        twin.append(static(ids[b : b + 1])[0])
    twin = torch.cat(twin)
    assert_close(logits[:, S:], twin[:, S:], 1e-12)
    assert (logits[:, :S] - twin[:, :S]).abs().max() > 1e-6  # before the step they differ


@pytest.mark.parametrize("transfer", ["sequential", "independent"])
def test_any_split_equals_one_pass_outputs_and_gradients(transfer):
    levels = [
        {"period": 2, "objective": "task"},
        {"period": 4, "objective": "task", "optimizer": "momentum"},
        {"period": 3},
    ]
    m = _model(levels)
    for b in m.blocks:
        b.mlp.transfer = transfer
        if transfer == "independent":
            b.mlp.weights = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    ids = _ids(15)
    full, st_full = m(ids)
    w = torch.randn_like(full)
    params = list(m.parameters())
    g_full = torch.autograd.grad((full * w).sum(), params)
    for cuts in ((1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), (3, 4, 9, 15), (8, 15)):
        outs, st, a = [], None, 0
        for b in cuts:
            y, st = m(ids[:, a:b], st)
            outs.append(y)
            a = b
        out = torch.cat(outs, 1)
        assert_close(out, full, 1e-12, what=f"outputs {cuts}")
        g = torch.autograd.grad((out * w).sum(), params)
        for (n, _), a_, b_ in zip(m.named_parameters(), g, g_full):
            assert_close(a_, b_, 1e-10, what=f"grad {n} {cuts}")
        for s1, s2 in zip(st[0].mlp.levels, st_full[0].mlp.levels):
            for w1, w2 in zip(s1.weights, s2.weights):
                assert_close(w1, w2, 1e-12)


def test_cached_generation_equals_the_full_pass_and_every_parameter_learns():
    m = _model([{"period": 2, "objective": "task"}, {"period": 4, "objective": "task"}])
    ids = _ids(11)
    full, _ = m(ids)
    with torch.no_grad():
        outs, st = [], None
        logits, st = m(ids[:, :3])
        outs.append(logits)
        for t in range(3, 11):
            logits, st = m(ids[:, t : t + 1], st)
            outs.append(logits)
    assert_close(torch.cat(outs, 1), full, 1e-12)
    F.cross_entropy(full[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    for n, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, n
    g = m.generate(ids[:, :3], 6, temperature=0.0)
    assert g.shape == (2, 9)


def test_task_levels_fail_clearly():
    with pytest.raises(ValueError, match="carry"):
        Level(4, objective="task", partial="flush").validate()
    with pytest.raises(ValueError, match="nested"):
        ContinuumMemory(D, [Level(2, objective="task"), Level(4, objective="task")], transfer="nested")
    with pytest.raises(ValueError, match="multiple of the shortest"):
        _model([{"period": 2, "objective": "task"}, {"period": 3, "objective": "task"}])
    m = _model([{"period": 2, "objective": "task"}])
    _, st = m(_ids(3))
    for s in st:
        s.mlp = dataclasses.replace(s.mlp, pending=None)
    with pytest.raises(ValueError, match="pending segment"):
        m(_ids(1), st)


def test_context_parallel_training_refuses_task_levels(tmp_path, monkeypatch):
    import mnemo.train.trainer as trainer_mod
    from mnemo.train import TrainConfig, Trainer

    monkeypatch.setattr(trainer_mod, "init_from_env", lambda backend=None: (0, 2))
    cfg = TrainConfig(
        model="gated_deltanet",
        model_overrides={
            "d_model": 16,
            "n_layers": 1,
            "mlp": "cms",
            "mlp_options": {"levels": [{"period": 4, "objective": "task"}]},
        },
        seq_len=16,
        batch_size=4,
        steps=2,
        sample_tokens=0,
        context_parallel=True,
    )
    with pytest.raises(ValueError, match="TrainConfig.context_parallel: .*objective 'task'"):
        Trainer(cfg, tmp_path, progress=False)


def test_a_frozen_model_streams_without_building_a_graph():
    """Parameters frozen, gradients enabled: nothing requires grad, so the carried fast weights
    must not hold a growing autograd graph (a reviewer saw 80k nodes after 400 tokens)."""
    m = _model([{"period": 2, "objective": "task"}, {"period": 4, "objective": "task"}])
    m.requires_grad_(False)
    ids = _ids(9)
    st = None
    for t in range(9):
        logits, st = m(ids[:, t : t + 1], st)
    assert not logits.requires_grad
    for w in st[0].mlp.levels[0].weights + st[1].mlp.levels[1].weights:
        assert w.grad_fn is None


def test_task_levels_refuse_inference_mode_and_flushing_neighbours():
    m = _model([{"period": 2, "objective": "task"}])
    with torch.inference_mode(), pytest.raises(RuntimeError, match=r"torch.no_grad\(\)"):
        m(_ids(3))
    with pytest.raises(ValueError, match="Level.partial: block 0 level 1 has partial='flush'"):
        _model([{"period": 2, "objective": "task"}, {"period": 3, "partial": "flush"}])


def test_scaling_the_untied_head_moves_task_levels_and_leaves_reconstruction_levels_bit_identical():
    """Known answer (issue 37): the next-token loss reaches a task level through the LM head, a
    reconstruction level never sees the head. Scale only the untied head by 0.5 and read 33 tokens
    (every level of periods 8/16/32 has stepped): the task levels' fast weights change, the
    reconstruction levels' stay bit-identical."""
    changes = {}
    for name in ("hope_attention", "hope_attention_reconstruction"):
        torch.manual_seed(0)
        cfg = build_config(name, vocab_size=V, d_model=D, n_layers=2, tie_embeddings=False)
        m = LanguageModel(cfg).double()
        ids = _ids(33)
        with torch.no_grad():
            _, before = m(ids)
            m.lm_head.weight.mul_(0.5)
            _, after = m(ids)
        rel = []
        for s0, s1 in zip(before, after):
            for l0, l1 in zip(s0.mlp.levels, s1.mlp.levels):
                assert l1.updates >= 1
                for w0, w1 in zip(l0.weights, l1.weights):
                    rel.append(((w1 - w0).norm() / w0.norm()).item())
        changes[name] = min(rel), max(rel)
    assert changes["hope_attention"][0] > 1e-6, changes  # every task level moved (measured ≥ 5.7e-5)
    assert changes["hope_attention_reconstruction"][1] == 0.0, changes


@pytest.mark.parametrize("nlms", [False, True])
def test_the_steps_equal_an_autograd_gradient_through_per_token_copies_of_the_weights(nlms):
    """Independent computation (hand-written, not the module's code path): one layer, a sequential
    chain of two task levels (periods S and 2S), data-dependent rates. The first layer's mixer sees
    only embeddings, so its output is taken from the model; the CMS chain, the head and the loss are
    written here. Each token reads through its own copy of a level's weights, and autograd of the
    segment's summed next-token loss with respect to the copies gives every token's term; the step
    is ``θ − Σ_t η_t ∂L_seg/∂θ_t`` (Eq. 71), summed over the level's period. With ``Level.nlms``
    each matrix has its own rate: ``lr σ_t / (‖x_t‖² + 1)`` for ``W_in``, ``lr σ_t / (‖a_t‖² + 1)``
    for ``W_out`` (``a_t`` the token's hidden activation at its read weights)."""
    S, B = 3, 2
    levels = [
        {"period": S, "objective": "task", "nlms": nlms},
        {"period": 2 * S, "objective": "task", "nlms": nlms},
    ]
    m = _model(levels, n_layers=1)
    with torch.no_grad():
        for lv in m.blocks[0].mlp.levels:
            lv.rate.weight.normal_(0, 0.5)
    ids = _ids(2 * S + 1, B=B)
    logits_model, st = m(ids)
    blk, cms = m.blocks[0], m.blocks[0].mlp
    with torch.no_grad():
        e = m.embed(ids)
        h0 = e + blk.mixer(blk.mixer_norm(e))[0]  # [B, 2S+1, d]
    levels = list(cms.levels)

    def ln(x):
        return F.layer_norm(x, (D,))

    def rate(lv, x, norm_of=None):
        """``lr σ_t / d``, or with nlms ``lr σ_t / (‖norm_of_t‖² + 1)``."""
        norm = D if not nlms else norm_of.square().sum(-1, keepdim=True) + 1.0
        return lv.level.lr * torch.sigmoid(x @ lv.rate.weight.detach().T + lv.rate.bias.detach()) / norm

    def run(W, tok):
        """Reads of tokens ``tok`` with per-token weights ``W[ℓ] = (W_in [B, n, d, h], W_out [B, n, h, d])``;
        returns (logits, the levels' inputs)."""
        x = blk.mlp_norm(h0[:, tok])
        h, xs = x, []
        for Wi, Wo in W:
            u = ln(h)
            xs.append(u)
            h = h + torch.einsum("bnh,bnhd->bnd", F.gelu(torch.einsum("bnd,bndh->bnh", u, Wi)), Wo)
        out = h0[:, tok] + (h - x)
        return m.lm_head(m.norm(out)), xs

    def term(W, tok):
        """Per level: Σ_t η_t ∂L_seg/∂θ_t over the segment ``tok`` (labels: the next tokens)."""
        Wt = [
            tuple(w.unsqueeze(1).expand(-1, len(tok), -1, -1).clone().requires_grad_() for w in p) for p in W
        ]
        logits, xs = run(Wt, tok)
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, [t + 1 for t in tok]].flatten(), reduction="sum")
        grads = torch.autograd.grad(loss, [w for p in Wt for w in p])
        out = []
        for i, lv in enumerate(levels):
            u = xs[i].detach()
            a = F.gelu(torch.einsum("bnd,bdh->bnh", u, W[i][0].detach()))  # the hidden activations
            eta_in = rate(lv, u, u)[..., None]  # [B, n, 1, 1]
            eta_out = rate(lv, u, a)[..., None]
            g_in, g_out = grads[2 * i : 2 * i + 2]
            out.append(((eta_in * g_in).sum(1), (eta_out * g_out).sum(1)))
        return out, logits.detach()

    W0 = [tuple(w.detach().expand(B, -1, -1) for w in (lv.W_in, lv.W_out)) for lv in levels]
    seg1, seg2 = list(range(S)), list(range(S, 2 * S))
    g1, logits1 = term(W0, seg1)
    W1 = [tuple(w - g for w, g in zip(W0[0], g1[0])), W0[1]]  # period S steps; period 2S accumulates
    g2, logits2 = term(W1, seg2)
    W2 = [
        tuple(w - g for w, g in zip(W1[0], g2[0])),
        tuple(w - a - b for w, a, b in zip(W0[1], g1[1], g2[1])),
    ]
    logits_ref = torch.cat([logits1, logits2], 1)
    assert_close(logits_model[:, : 2 * S], logits_ref, 1e-14, what="logits")  # measured 3e-16
    for i in range(2):
        s = st[0].mlp.levels[i]
        assert s.updates == (2 if i == 0 else 1)
        for w, ref, w0 in zip(s.weights, W2[i], W0[i]):
            assert (ref - w0).abs().max() > 1e-4  # the steps are not negligible
            assert_close(w, ref, 1e-14, what=f"level {i}")  # measured ≤ 1e-16


# --------------------------------------------------------------------------------------------
# run_with_cache on a task-signal model: the hooks fire once per segment, the cache joins them
# --------------------------------------------------------------------------------------------


def _presets(name, d_model=8, n_layers=2, seed=0):
    torch.manual_seed(seed)
    return LanguageModel(build_config(name, vocab_size=V, d_model=d_model, n_layers=n_layers)).double().eval()


@pytest.mark.parametrize("name", ["hope", "hope_attention"])
def test_run_with_cache_on_task_presets_holds_the_whole_call(name):
    """21 tokens read in segments of 8, 8 and 5: every tensor hook holds all 21 positions (the keys
    and shapes of the *_reconstruction preset, less the reconstruction levels' own target and rate
    hooks), and the joined values are the values of the call: block 0's mixer (before any CMS)
    run alone over the whole call equals the cached hooks, each task level's cached read equals its
    MLP at the weights it had in that segment (initial weights in the first, the returned state's in
    the last), and the joined attention pattern is softmax(q kᵀ) of the joined queries and keys."""
    m, recon = _presets(name), _presets(name + "_reconstruction")
    ids = _ids(21)
    with torch.no_grad():
        logits, cache = m.run_with_cache(ids)
        want, state = m(ids)
        _, rcache = recon.run_with_cache(ids)
    assert_close(logits, want, 1e-12)  # with hook_pattern recorded, attention runs as pattern @ v
    extra = {k for k in rcache if k.endswith(("hook_v", "hook_eta")) and ".mlp.levels." in k}
    assert set(cache) == set(rcache) - extra
    for k, v in rcache.items():
        if isinstance(v, torch.Tensor) and k in cache:
            assert cache[k].shape == v.shape, (k, cache[k].shape, v.shape)
    assert cache["blocks.0.mixer.hook_q"].shape[1] == 21  # before the fix: 5 (the last segment)
    # block 0's mixer sees no CMS: one pass of it alone over the 21 tokens
    b0 = m.blocks[0]
    x = cache["blocks.0.hook_resid_pre"]
    assert torch.equal(x, m.embed(ids))
    with torch.no_grad():
        y, _ = b0.mixer(b0.mixer_norm(x))
    assert_close(cache["blocks.0.hook_mixer_out"], y, 1e-12)
    # each task level's read: its MLP at the weights of the segment (levels read LN of their input)
    for i, blk in enumerate(m.blocks):
        for j, lv in enumerate(blk.mlp.levels):
            xin = cache[f"blocks.{i}.mlp.levels.{j}.hook_in"]
            out = cache[f"blocks.{i}.mlp.levels.{j}.hook_out"]

            def mlp(w, x):
                return F.gelu(x @ w[0]) @ w[1]

            assert_close(out[:, :8], mlp((lv.W_in, lv.W_out), xin[:, :8]), 1e-12)
            assert_close(out[:, 16:], mlp(state[i].mlp.levels[j].weights, xin[:, 16:]), 1e-12)
    assert state[0].mlp.levels[0].updates == 2  # the level-0 steps (period 8) did happen in between
    if name == "hope_attention":
        with torch.no_grad():
            _, pc = m.run_with_cache(ids, names="hook_pattern")
        q, k = cache["blocks.1.mixer.hook_q"], cache["blocks.1.mixer.hook_k"]
        s = torch.einsum("bthd,bshd->bhts", q, k) * q.shape[-1] ** -0.5
        s = s.masked_fill(torch.ones(21, 21, dtype=torch.bool).triu(1), float("-inf"))
        assert pc["blocks.1.mixer.hook_pattern"].shape == (2, m.blocks[1].mixer.n_heads, 21, 21)
        assert_close(pc["blocks.1.mixer.hook_pattern"], s.softmax(-1), 1e-12)


def test_run_with_cache_streaming_leaves_out_the_signal_replay():
    """A call whose first segment began in the previous call runs that segment again to take its
    signal; the cache holds this call's tokens only, equal to those positions of one whole pass."""
    m = _presets("hope")
    ids = _ids(13)
    with torch.no_grad():
        _, whole = m.run_with_cache(ids, names=["hook_q", "hook_out"])
        _, state = m(ids[:, :8])  # one full segment, its signal waits for token 8
        _, part = m.run_with_cache(ids[:, 8:], names=["hook_q", "hook_out"], state=state)
    assert set(part) == set(whole)
    for k, v in part.items():
        assert v.shape[1] == 5, k
        assert_close(v, whole[k][:, 8:], 1e-12)


def test_run_with_cache_joins_a_hook_fired_per_mixer_segment_within_task_segments():
    """Titans MAC fires its memory hooks once per MAC segment, inside each task segment: each firing
    is placed in the call (the MAC segment's offset within the task segment's), so such a hook is
    joined over the whole call too, as in one pass of the same model with reconstruction levels
    (the same keys and shapes)."""
    shapes = {}
    for objective in ("task", "reconstruction"):
        levels = {"levels": [{"period": 8, "objective": objective}]}
        with torch.no_grad():
            _, cache = tiny_titans_mac(V, mlp="cms", mlp_options=levels).run_with_cache(_ids(21))
        shapes[objective] = {k: v.shape for k, v in cache.items() if isinstance(v, torch.Tensor)}
    task, recon = shapes["task"], shapes["reconstruction"]
    assert all(task[k] == recon[k] for k in task), {
        k: (task[k], recon[k]) for k in task if task[k] != recon[k]
    }
    assert task["blocks.0.hook_mixer_out"][1] == 21 and task["blocks.0.mixer.memory.hook_q"][1] == 21


@pytest.mark.parametrize(
    "d,nlms", [(8, False), (16, False), (16, True)]
)  # nlms: the output matrix's factor E carries its own rate
@pytest.mark.parametrize("cuts", [(40,), (8, 21, 40), (5, 13, 29, 40)])
def test_factored_steps_equal_materialised_steps(cuts, d, nlms):
    """Inside the segment loop a task level keeps its steps as low-rank factors and reads through
    them (``CMSLevel.deferring``); the same stream with the factors turned off (every step written
    into the weights) gives the same logits, states and gradients w.r.t. every parameter, over
    calls that end inside periods (the materialising branch of a period begun in an earlier call)
    and past the rank bound ``min(d, h)`` (8: folded after every period of 8; 16: reads through two
    periods' factors before they are folded)."""
    import contextlib

    ids = _ids(41)
    runs = {}
    for factored in (True, False):
        m = _presets("hope_attention", d_model=d).double()
        if nlms:
            for b in m.blocks:
                for lv in b.mlp.levels:
                    lv.level = dataclasses.replace(lv.level, nlms=True)
        if not factored:
            for b in m.blocks:
                for lv in b.mlp.levels:
                    lv.deferring = contextlib.nullcontext
        outs, state, a = [], None, 0
        for b in cuts:
            y, state = m(ids[:, a:b], state)
            outs.append(y)
            a = b
        logits = torch.cat(outs, 1)
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss = loss + sum(s.weights[0].square().sum() for s in state[1].mlp.levels)
        grads = torch.autograd.grad(loss, list(m.parameters()))
        for blk in state:  # what leaves the model is materialised
            assert all(s.applied is None and s.current is None for s in blk.mlp.levels)
        runs[factored] = (logits, state, grads, [n for n, _ in m.named_parameters()])
    (l1, s1, g1, names), (l0, s0, g0, _) = runs[True], runs[False]
    assert_close(l1, l0, 1e-10)
    for b1, b0 in zip(s1, s0):
        for u, v in zip(b1.mlp.levels, b0.mlp.levels):
            assert u.updates == v.updates and u.absorbed == v.absorbed
            for x, y in zip(u.weights + u.grad, v.weights + v.grad):
                assert_close(x, y, 1e-10)
    for n, x, y in zip(names, g1, g0):
        assert_close(x, y, 1e-10, what=n)
    assert any(s.updates > 0 for s in s1[0].mlp.levels)


def test_factored_state_is_kept_inside_the_loop_and_shown_materialised_to_hooks():
    """The factors exist inside the loop (a spy on a level's absorb sees them), a ``hook_state``
    sees the materialised state, and the stream's logits do not change when the hook is attached."""
    m = _presets("hope_attention", d_model=16).double()  # rank bound 16: two periods of factors
    lv = m.blocks[0].mlp.levels[0]
    seen, orig = [], lv.absorb

    def spy(*a, **k):
        st = orig(*a, **k)
        seen.append(st.applied is not None)
        return st

    lv.absorb = spy
    ids = _ids(33)
    with torch.no_grad():
        want, _ = m(ids)
        got, cache = m.run_with_cache(ids)
    assert any(seen)
    assert_close(got, want, 1e-12)
    st = cache["blocks.0.mlp.levels.0.hook_state"]
    assert st.applied is None and st.current is None
