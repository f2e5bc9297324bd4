"""Interventions where a hook fires once per piece of a call (a task-signal model's segments,
Titans MAC's own segments), on maps whose heads are not a value's axis (HOPE's one-head map, Titans'
memory), and the validation of their arguments; each against a hand-written hook that does the
same by its own bookkeeping."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mnemo.interp.interventions import (
    ablate,
    ablate_head,
    ablate_state,
    activation_patching,
    induction_ablation,
    logit_difference,
    mean_activations,
    next_token_loss,
    patch,
    steer,
)
from mnemo.models import LanguageModel, build_config
from tests.helpers import tiny_titans_mac

V = 17


def _model(name, n_layers=1, **kw):
    torch.manual_seed(0)
    return LanguageModel(build_config(name, vocab_size=V, d_model=32, n_layers=n_layers, **kw)).eval()


def _mac(segment=4):
    return tiny_titans_mac(V, segment)


def _keep(store: dict, suffix: str = ""):
    def fn(value, name):
        store[name + suffix] = value  # the last firing; returns None (reads only)

    return fn


def _ids(T, B=1, seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


class _HandRows:
    """A hook that knows where it is by counting: each firing covers the next rows of the call (the
    pieces come in order, none skipped), and ``fn(value, first_row)`` returns the replacement."""

    def __init__(self, fn):
        self.fn, self.seen, self.lengths = fn, 0, []

    def __call__(self, value, name):
        out = self.fn(value, self.seen)
        self.lengths.append(value.shape[1])
        self.seen += value.shape[1]
        return out


def _zero_rows(rows):
    def fn(value, first):
        new = value.clone()
        for r in rows:
            if first <= r < first + value.shape[1]:
                new[:, r - first] = 0
        return new

    return fn


# pieces: hope_attention reads 29 tokens in task segments of 8; Titans MAC (segment 4) reads 11 in 4s
PIECED = [
    ("hope_attention", 29, "blocks.0.mixer.hook_v", [8, 8, 8, 5]),
    ("mac", 11, "blocks.0.mixer.attn.hook_v", [4, 4, 3]),
]


def _pieced(kind):
    return _mac() if kind == "mac" else _model(kind)


@pytest.mark.parametrize("kind,T,hook,pieces", PIECED, ids=["task segments", "mac segments"])
def test_positions_are_the_calls_tokens_on_a_model_read_in_pieces(kind, T, hook, pieces):
    m = _pieced(kind)
    ids = _ids(T)
    with torch.no_grad():
        hand = _HandRows(_zero_rows([2, 9]))
        want, _ = m.run_with_hooks(ids, [(hook, hand)])
        got, _ = m.run_with_hooks(ids, ablate(m, hook, positions=[2, 9]))
        ref, _ = m(ids)
        # steering only token 9 (negative indices count from the call's end)
        d = torch.randn(8)  # the value's last axis
        hand_s = _HandRows(
            lambda v, first: v + (torch.arange(first, first + v.shape[1]) == 9)[None, :, None, None] * d
        )
        want_s, _ = m.run_with_hooks(ids, [(hook, hand_s)])
        got_s, _ = m.run_with_hooks(ids, steer(m, hook, d, positions=[9 - T]))
    assert hand.lengths == pieces
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_s, want_s, rtol=0, atol=0)
    assert torch.equal(got[:, :2], ref[:, :2]) and not torch.allclose(got[:, 2], ref[:, 2])
    with pytest.raises(
        ValueError, match=rf"position {T} out of range: {hook} has {T} positions in a call of {T}"
    ):
        m.run_with_hooks(ids, ablate(m, hook, positions=[T]))


@pytest.mark.parametrize("kind,T,hook,pieces", PIECED, ids=["task segments", "mac segments"])
def test_patching_a_model_with_its_own_cache_reproduces_it_and_a_clean_cache_is_cut_per_piece(
    kind, T, hook, pieces
):
    m = _pieced(kind)
    clean, corrupted = _ids(T, B=2, seed=1), _ids(T, B=2, seed=2)
    with torch.no_grad():
        ref, own = m.run_with_cache(corrupted, names=hook)
        assert own[hook].shape[1] == T  # joined over the pieces
        same, _ = m.run_with_hooks(corrupted, patch(m, own, hook))
        _, cache = m.run_with_cache(clean, names=hook)
        c = cache[hook]

        def from_clean(value, first):
            new = value.clone()
            if first <= 5 < first + value.shape[1]:
                new[:, 5 - first, 1] = c[:, 5, 1]  # token 5, head 1
            return new

        want, _ = m.run_with_hooks(corrupted, [(hook, _HandRows(from_clean))])
        got, _ = m.run_with_hooks(corrupted, patch(m, cache, hook, positions=5, heads=1))
    torch.testing.assert_close(same, ref, rtol=0, atol=0)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # a cache of another length does not match (named, not broadcast or cut silently)
    with torch.no_grad():
        _, short = m.run_with_cache(clean[:, : T - 1], names=hook)
    with pytest.raises(ValueError, match=rf"{hook}: the clean value \[2, {T - 1}, "):
        m.run_with_hooks(corrupted, patch(m, short, hook))


def test_activation_patching_per_position_on_task_segments_equals_patching_each_token_by_hand():
    m = _model("hope_attention")
    clean, corrupted = _ids(19, B=2, seed=1), _ids(19, B=2, seed=2)
    hook = "blocks.0.mixer.hook_o"
    metric = next_token_loss(clean)
    r = activation_patching(m, clean, corrupted, metric, names=hook, per="position")
    with torch.no_grad():
        _, cache = m.run_with_cache(clean, names=hook)
        c = cache[hook]
        for t in (0, 8, 18):

            def put(value, first, t=t):
                new = value.clone()
                if first <= t < first + value.shape[1]:
                    new[:, t - first] = c[:, t]
                return new

            logits, _ = m.run_with_hooks(corrupted, [(hook, _HandRows(put))])
            assert r.values[0, t].item() == pytest.approx(float(metric(logits)), abs=1e-6)
    assert r.values.shape == (1, 19)


def test_mean_ablation_on_pieces_cuts_per_position_means_and_needs_means():
    m = _model("hope_attention")
    ids, ref_ids = _ids(19, B=2, seed=1), _ids(19, B=3, seed=4)
    hook = "blocks.0.mixer.hook_v"
    with pytest.raises(ValueError, match=r"means: blocks\.0\.mixer\.hook_v passes the call in pieces"):
        m.run_with_hooks(ids, ablate(m, hook, how="mean", positions=[3]))
    means = mean_activations(m, ref_ids, hook, over="batch")  # [1, 19, H, D], per position
    mu = means[hook]
    with torch.no_grad():

        def put(value, first):
            new = value.clone()
            if first <= 11 < first + value.shape[1]:
                new[:, 11 - first] = mu[:, 11]
            return new

        want, _ = m.run_with_hooks(ids, [(hook, _HandRows(put))])
        got, _ = m.run_with_hooks(ids, ablate(m, hook, how="mean", means=means, positions=[11]))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_ablating_the_state_of_a_model_read_in_pieces_leaves_the_call_and_replaces_the_last_state():
    """hook_state fires after every task segment, and the next segment continues from it: only the
    state after the call's last segment is replaced (the call's logits are unchanged), as for a
    model read in one pass."""
    m = _model("hope_attention")
    ids = _ids(19)
    states = []
    with torch.no_grad():
        ref, _ = m(ids)
        got, state = m.run_with_hooks(
            ids, ablate_state(m, 0) + [("blocks.0.mixer.hook_state", lambda v, n: states.append(v))]
        )
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert [int(torch.count_nonzero(s.k)) > 0 for s in states] == [True, True, False]
    assert torch.count_nonzero(state[0].mixer.kv.k) == 0 and state[0].mixer.kv.k.shape == (1, 19, 4, 8)


# ----------------------------------------------------------------------------------------- heads


def test_a_one_head_map_ablates_its_head_whole():
    """HOPE's self-modifying Titans: one memory over the whole d_model, a map of one head, and
    hook_o [B, T, d]: head 0 is every channel; head 1 does not exist."""
    m = _model("hope", n_layers=1)
    ids = _ids(12)
    assert m.blocks[0].mixer.map_heads == 1
    seen = {}
    with torch.no_grad():
        got, _ = m.run_with_hooks(ids, ablate_head(m, 0, [0]) + [("blocks.0.mixer.hook_o", _keep(seen))])
        want, _ = m.run_with_hooks(ids, [("blocks.0.mixer.hook_o", lambda v, n: torch.zeros_like(v))])
    assert (
        seen["blocks.0.mixer.hook_o"].shape[-1] == 32
        and torch.count_nonzero(seen["blocks.0.mixer.hook_o"]) == 0
    )
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(
        ValueError, match=r"head 1 out of range: blocks\.0\.mixer\.hook_o has 1 heads \(layer 0's map\)"
    ):
        ablate_head(m, 0, [1])


@pytest.mark.parametrize("name", ["titans_mac", "titans_mag", "titans_mal"])
def test_titans_heads_are_the_memorys_which_the_map_reads(name):
    m = _model(name)
    hooks = ablate_head(m, 0, [1])
    assert [h for h, _ in hooks] == ["blocks.0.mixer.memory.hook_o"]
    ids = _ids(10)
    seen = {}
    with torch.no_grad():
        m.run_with_hooks(ids, hooks + [("blocks.0.mixer.memory.hook_o", _keep(seen))])
        _, clean = m.run_with_cache(ids, names="memory.hook_o")
    o, c = seen["blocks.0.mixer.memory.hook_o"], clean["blocks.0.mixer.memory.hook_o"]
    assert torch.count_nonzero(o[:, :, 1]) == 0 and torch.equal(o[:, :, 0], c[:, :, 0])
    with pytest.raises(
        KeyError,
        match=r"no hook point named 'blocks\.0\.mixer\.hook_nope'; .*'blocks\.0\.mixer\.memory\.hook_o'",
    ):
        ablate_head(m, 0, 0, hook="hook_nope")


def test_induction_ablation_runs_on_titans_mac():
    m = _mac()
    r = induction_ablation(m, 1, draws=1, length=4, batch=2, how="zero")
    assert len(r["top_k"]["heads"]) == 1 and r["hook"] == "hook_o"


def test_heads_need_a_head_axis():
    mamba = _model("mamba")
    ids = _ids(9, B=2)
    with pytest.raises(
        ValueError, match=r"heads: blocks\.0\.hook_resid_pre has no head axis \(value of shape \[2, 9, 32\]\)"
    ):
        mamba.run_with_hooks(ids, ablate(mamba, "blocks.0.hook_resid_pre", heads=0))
    with pytest.raises(
        ValueError, match=r"heads: blocks\.0\.mixer\.hook_B has no head axis .*map has 64 head"
    ):
        mamba.run_with_hooks(ids, ablate(mamba, "blocks.0.mixer.hook_B", heads=0))
    seen = {}
    with torch.no_grad():  # Mamba's channels are its map's heads
        mamba.run_with_hooks(
            ids, ablate(mamba, "hook_o", heads=[3]) + [("blocks.0.mixer.hook_o", _keep(seen))]
        )
    zero = (seen["blocks.0.mixer.hook_o"].abs().sum((0, 1)) == 0).nonzero().flatten().tolist()
    assert zero == [3]
    retnet = _model("retnet")  # a per-head gate [B, T, H]: head h is column h
    with torch.no_grad():
        retnet.run_with_hooks(
            ids, ablate(retnet, "hook_g", heads=1) + [("blocks.0.mixer.hook_g", _keep(seen, "r"))]
        )
    g = seen["blocks.0.mixer.hook_gr"]
    assert torch.count_nonzero(g[..., 1]) == 0 and torch.count_nonzero(g[..., 0]) == g[..., 0].numel()


# -------------------------------------------------------------------------------------- arguments


def test_next_token_loss_takes_target_positions_1_to_T_minus_1():
    ids = _ids(9, B=2)
    logits = torch.randn(2, 9, V)
    hand = F.cross_entropy(logits[:, 2], ids[:, 3])  # target 3 is predicted at position 2
    assert next_token_loss(ids, [3])(logits).item() == pytest.approx(hand.item())
    for bad in ([0], [9], [-1]):
        with pytest.raises(ValueError, match=r"positions: target positions must lie in 1 … 8"):
            next_token_loss(ids, bad)
    with pytest.raises(ValueError, match="positions: expected target positions"):
        next_token_loss(ids, [1.5])


def test_indices_are_integers_and_token_ids_in_the_vocabulary():
    m = _model("transformer", n_layers=2)
    with pytest.raises(ValueError, match=r"head: expected integer indices, got 1\.5"):
        ablate_head(m, 0, 1.5)
    with pytest.raises(ValueError, match=r"head 4 out of range: blocks\.0\.mixer\.hook_o has 4 heads"):
        ablate_head(m, 0, [4])
    logits = torch.randn(2, 9, V)
    with pytest.raises(ValueError, match=rf"correct: token ids must lie in \[0, {V}\)"):
        logit_difference(99, 1)(logits)
    with pytest.raises(ValueError, match=r"position: expected an int in \[-9, 9\)"):
        logit_difference(2, 1, position=9)(logits)
    hand = (logits[:, -1, 2] - logits[:, -1, 1]).mean()
    assert logit_difference(2, 1)(logits).item() == pytest.approx(hand.item())


# ------------------------------------------------------------------ second review (session 33)


def test_a_model_run_from_inside_a_hook_leaves_the_calls_span_as_it_was():
    """A read-only hook that runs another model (with hooks of its own) in the middle of a Titans
    MAC call: the MAC segments after it still see their own spans, so ``positions=[1]`` zeroes
    token 1 only (before the fix every later piece saw ``(0, None)`` and tokens 5 and 9 were zeroed
    too)."""
    from mnemo.layers.hooks import span

    mac, other = _mac(segment=4), _model("transformer")
    ids = torch.randint(0, V, (1, 11), generator=torch.Generator().manual_seed(1))
    seen = []

    def side(v, name):
        other.run_with_hooks(torch.zeros(1, 3, dtype=torch.long), [("hook_q", lambda v, n: None)])

    def zero_rows(v, name):
        seen.append((span(), v[0].abs().sum(-1).eq(0).nonzero().flatten().tolist()))

    B = "blocks.0.mixer.hook_mem_out"
    with torch.no_grad():
        mac.run_with_hooks(
            ids, [("blocks.0.mixer.hook_attn_out", side)] + ablate(mac, B, positions=[1]) + [(B, zero_rows)]
        )
    assert seen == [((0, 11), [1]), ((4, 11), []), ((8, 11), [])]


def test_patching_between_a_task_levels_read_and_the_loss_runs_as_an_intervention():
    """HOPE's task levels learn from the next-token loss inside the forward: a patched value is a
    constant, so the signal through it is cut (zero where nothing else flows) instead of raising
    "not used in the graph". Patching the whole MLP output with the model's own cache gives its
    logits (every later segment reads the clean MLP outputs anyway); residual patching per layer
    runs and equals patching each layer by hand."""
    m = _model("hope_attention")
    x = torch.randint(0, V, (2, 19), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, V, (2, 19), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        clean, cache = m.run_with_cache(x)
        out, _ = m.run_with_hooks(x, patch(m, cache, "blocks.0.hook_mlp_out"))
        torch.testing.assert_close(out, clean, rtol=0, atol=1e-6)
        metric = next_token_loss(x)
        res = activation_patching(m, x, y, metric, names="hook_resid_post", per="layer")
        _, xcache = m.run_with_cache(x, names="hook_resid_post")  # clean x into corrupted y
        by_hand = metric(m.run_with_hooks(y, patch(m, xcache, "blocks.0.hook_resid_post"))[0])
    assert torch.allclose(res.values.flatten()[0], by_hand)


def test_own_mean_ablation_covers_a_titans_memorys_learned_prefix_as_one_pass():
    """``titans_lmm``'s memory reads 4 persistent tokens before the call: its values span tokens
    −4 … T − 1, one pass over the call, not a piece, so ``how="mean"`` without ``means`` takes the
    mean over the batch and every row, as a hand hook does."""
    m = _model("titans_lmm")
    x = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(1))
    name = "blocks.0.mixer.hook_v"
    with torch.no_grad():
        out, _ = m.run_with_hooks(x, ablate(m, name, how="mean"))
        ref, _ = m.run_with_hooks(x, [(name, lambda v, n: v.mean((0, 1), keepdim=True).expand_as(v).clone())])
    assert torch.equal(out, ref)


def test_a_patch_that_selects_nothing_of_a_piece_leaves_it_alone():
    """``hope_attention`` with a state from a 3-token call reads a segment again that starts before
    this call; its key map cannot take the clean map's columns, but ``positions=[10]`` selects
    nothing there, so the patch leaves that piece alone and a self-patch gives the run's logits."""
    m = _model("hope_attention")
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        _, st = m(torch.randint(0, V, (2, 3), generator=g))
        x = torch.randint(0, V, (2, 19), generator=g)
        clean, cache = m.run_with_cache(x, names=["blocks.0.mixer.hook_pattern"], state=st)
        out, _ = m.run_with_hooks(x, patch(m, cache, "blocks.0.mixer.hook_pattern", positions=[10]), st)
    assert torch.equal(out, clean)


def test_a_read_only_hook_does_not_hide_a_level_cut_off_from_the_loss():
    """The zero-signal rule for a cut read applies only where a hook returned a replacement: a
    level whose read the loss does not depend on (a defect, simulated by a plain torch hook that
    detaches the level's output) raises with and without read-only hooks (``run_with_cache``)."""
    from mnemo.models.task_signal import _task_levels

    m = _model("hope_attention")
    i, j = _task_levels(m)[0]
    m.blocks[i].mlp.levels[j].register_forward_hook(lambda mod, inp, out: (out[0].detach(), out[1]))
    x = torch.randint(0, V, (2, 19), generator=torch.Generator().manual_seed(1))
    for run in (lambda: m(x), lambda: m.run_with_cache(x, names="hook_embed")):
        with torch.no_grad(), pytest.raises(RuntimeError, match=f"levels.{j}'.*no hook replaced"):
            run()


def test_a_call_interrupted_inside_a_segment_leaves_no_span_behind():
    """An exception in the second MAC segment (from a hook added with ``HookPoint.add``) leaves the
    span at one pass, so a later hook on another model reads positions as that call's tokens."""
    from mnemo.layers.hooks import span

    mac, gpt = _mac(segment=4), _model("transformer")
    x = torch.randint(0, V, (1, 11), generator=torch.Generator().manual_seed(1))
    calls = []

    def boom(v, name):
        calls.append(span())
        if len(calls) == 2:
            raise KeyboardInterrupt

    handle = mac.hook_points["blocks.0.mixer.hook_mem_out"].add(boom)
    with torch.no_grad(), pytest.raises(KeyboardInterrupt):
        mac(x)
    handle.remove()
    assert calls == [(0, 11), (4, 11)] and span() == (0, None)
    name = "blocks.0.hook_resid_post"
    ((_, fn),) = ablate(gpt, name, positions=[1])
    seen = {}
    handles = [
        gpt.hook_points[name].add(fn),
        gpt.hook_points[name].add(
            lambda v, n: seen.update(rows=v[0].abs().sum(-1).eq(0).nonzero().flatten())
        ),
    ]
    with torch.no_grad():
        gpt(x)
    for h in handles:
        h.remove()
    assert seen["rows"].tolist() == [1]
