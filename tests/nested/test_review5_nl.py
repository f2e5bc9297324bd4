"""Review 5 of the Nested Learning / HOPE area: each test failed before its fix."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mnemo.layers.cms import ContinuumMemory, Level
from mnemo.models import LanguageModel, build_config

V = 23


def _hope(name, n_layers=1, seed=0):
    torch.manual_seed(seed)
    return LanguageModel(build_config(name, vocab_size=V, d_model=16, n_layers=n_layers)).double()


def _ids(T, B=2, seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def _zero_first(st):
    """The edit both hooks make: the state's first weight matrix set to zero."""
    field = "weights" if hasattr(st, "weights") else "memory"
    pair = getattr(st, field)
    return dataclasses.replace(st, **{field: (torch.zeros_like(pair[0]), *pair[1:])})


def _in_place(st, name):
    field = "weights" if hasattr(st, "weights") else "memory"
    getattr(st, field)[0].mul_(0)  # returns nothing: the edit is made on the value shown


def _replace(st, name):
    return _zero_first(st)


@pytest.mark.parametrize(
    ("model", "point"),
    [
        ("hope_attention", "blocks.0.mlp.levels.0.hook_state"),  # a task level, factored in the loop
        ("hope_attention", "blocks.0.mlp.levels.2.hook_state"),  # unstepped: views of the parameters
        ("hope", "blocks.0.mixer.hook_state"),  # a self-modifying Titans mixer, deferred in the loop
    ],
)
def test_an_in_place_edit_of_a_shown_state_in_the_task_signal_loop_takes_effect(model, point):
    # before: the level showed a materialised copy of its factored state and went on from the
    # factored one, dropping the edit; an unstepped level's weights were views of the parameters
    # (torch's leaf-view RuntimeError). hooks.HookPoint.add promises an edit made in place takes effect.
    m = _hope(model)
    ids = _ids(20)
    params = {k: v.detach().clone() for k, v in m.named_parameters()}
    with torch.no_grad():
        want, st_want = m.run_with_hooks(ids, hooks=[(point, _replace)])
        got, st_got = m.run_with_hooks(ids, hooks=[(point, _in_place)])
        plain, _ = m(ids)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert (got - plain).abs().max() > 1e-6  # the edit does change what the model emits
    for a, b in zip(
        [x for x in torch.utils._pytree.tree_leaves(st_got) if isinstance(x, torch.Tensor)],
        [x for x in torch.utils._pytree.tree_leaves(st_want) if isinstance(x, torch.Tensor)],
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    for k, v in m.named_parameters():  # no parameter was written
        assert torch.equal(v.detach(), params[k]), k


@pytest.mark.parametrize("B", [1, 2])
def test_an_in_place_edit_of_a_fresh_level_state_does_not_write_the_parameters(B):
    # before: a fresh state's weights are the parameters expanded over the batch; an edit in place
    # raised torch's view errors (B = 2: "more than one element ... refers to a single memory location")
    torch.manual_seed(0)
    m = ContinuumMemory(4, [Level(8)]).double()
    x = torch.randn(B, 3, 4, dtype=torch.float64)
    W0 = m.levels[0].W_in.detach().clone()
    h = m.levels[0].hook_state.add(_in_place)
    try:
        with torch.no_grad():
            _, st = m(x)
    finally:
        h.remove()
    assert torch.equal(m.levels[0].W_in.detach(), W0)
    assert st.levels[0].weights[0].abs().max() == 0
    # the stream goes on from the edited state as from a replacement's
    h = m.levels[0].hook_state.add(_replace)
    try:
        with torch.no_grad():
            _, st_r = m(x)
    finally:
        h.remove()
    with torch.no_grad():
        y1, _ = m(x, st)
        y2, _ = m(x, st_r)
    torch.testing.assert_close(y1, y2, rtol=0, atol=0)


def test_a_hook_that_only_reads_a_shown_state_leaves_the_stream_unchanged():
    """The guard of the fix above: reading (and copying out of) the shown state changes nothing."""
    m = _hope("hope")
    ids = _ids(20)
    with torch.no_grad():
        want, st_want = m(ids)
        got, st_got = m.run_with_hooks(ids, hooks=[("hook_state", lambda st, n: None)])
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_one_token_decoding_reads_after_a_segments_signal_with_settled_level_states():
    # before: the re-run segment's steps (taken in _absorb, kept as factors of varying rank) reached
    # the next one-token read unsettled, so generate(compile=True) on hope recompiled the block's
    # graph at every segment (applied None / a tuple / another rank) and hit dynamo's recompile
    # limit within 40 new tokens, running eagerly from then on
    m = _hope("hope_attention")
    seen, orig = [], m._forward

    def spy(ids, state, *a, **k):
        if state is not None and ids.shape[1] == 1 and not torch.is_grad_enabled():
            seen.extend(lv.applied is None and lv.current is None for s in state for lv in s.mlp.levels)
        return orig(ids, state, *a, **k)

    m._forward = spy
    ids = _ids(20, B=1)
    with torch.no_grad():
        want, _ = m(ids)
        st, got = None, []
        for t in range(ids.shape[1]):
            lg, st = m(ids[:, t : t + 1], st)
            got.append(lg)
    assert len(seen) > 3 * 8 and all(seen)
    torch.testing.assert_close(torch.cat(got, 1), want, rtol=0, atol=1e-10)
