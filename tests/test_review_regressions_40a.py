"""Regression review 40a of 69c42d9 (hook_state shows a copy): each test failed before its fix."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mnemo.layers.cms import ContinuumMemory, Level
from mnemo.models import LanguageModel, build_config

V = 23


def _zero_field(st, name):
    """Edit the record shown by setting a field anew (returns nothing)."""
    field = "weights" if hasattr(st, "weights") else "memory"
    pair = getattr(st, field)
    setattr(st, field, (torch.zeros_like(pair[0]), *pair[1:]))


def _zero_replace(st, name):
    field = "weights" if hasattr(st, "weights") else "memory"
    pair = getattr(st, field)
    return dataclasses.replace(st, **{field: (torch.zeros_like(pair[0]), *pair[1:])})


def _run(m, x, point, fn):
    h = point.add(fn)
    try:
        with torch.no_grad():
            return m(x)
    finally:
        h.remove()


@pytest.mark.parametrize("level", [0, 1])
def test_a_field_set_on_a_shown_level_state_takes_effect(level):
    # before: show_state handed the hook a fresh copy of the record and went on from the original
    # unless a tensor's version moved, so ``st.weights = ...`` (an edit in place of the record, which
    # took effect before 69c42d9 outside the task loop) was dropped silently
    torch.manual_seed(0)
    m = ContinuumMemory(4, [Level(1), Level(2)]).double()
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    _, got = _run(m, x, m.levels[level].hook_state, _zero_field)
    _, want = _run(m, x, m.levels[level].hook_state, _zero_replace)
    assert got.levels[level].weights[0].abs().max() == 0
    with torch.no_grad():
        torch.testing.assert_close(m(x, got)[0], m(x, want)[0], rtol=0, atol=0)


def test_levels_set_on_a_shown_cms_state_take_effect():
    torch.manual_seed(0)
    m = ContinuumMemory(4, [Level(1), Level(2)]).double()
    x = torch.randn(2, 5, 4, dtype=torch.float64)

    def zero_levels(st, name):
        st.levels = tuple(_zero_replace(s, name) for s in st.levels)

    _, st = _run(m, x, m.hook_state, zero_levels)
    assert all(s.weights[0].abs().max() == 0 for s in st.levels)


def test_a_field_set_in_the_task_signal_loop_takes_effect():
    torch.manual_seed(0)
    m = LanguageModel(build_config("hope_attention", vocab_size=V, d_model=16, n_layers=1)).double()
    ids = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(1))
    point = "blocks.0.mlp.levels.0.hook_state"
    with torch.no_grad():
        want, _ = m.run_with_hooks(ids, hooks=[(point, _zero_replace)])
        got, _ = m.run_with_hooks(ids, hooks=[(point, _zero_field)])
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_field_set_with_another_shape_is_refused_naming_the_hook():
    torch.manual_seed(0)
    m = ContinuumMemory(4, [Level(1)]).double()
    m.levels[0].hook_state.name = "levels.0.hook_state"

    def bad(st, name):
        st.weights = (st.weights[0][:, :1], *st.weights[1:])

    with pytest.raises(ValueError, match="levels.0.hook_state"):
        _run(m, torch.randn(2, 3, 4, dtype=torch.float64), m.levels[0].hook_state, bad)


def _in_place(st, name):
    for x in torch.utils._pytree.tree_leaves(st):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            x.mul_(0)


def _zeros(st, name):
    return torch.utils._pytree.tree_map(
        lambda x: torch.zeros_like(x) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, st
    )


@pytest.mark.parametrize("model", ["titans_lmm", "titans_mag", "titans_mal", "titans_mac", "ttt_linear"])
def test_an_in_place_edit_of_a_titans_state_does_not_write_the_parameters(model):
    # before: the sibling mixers 69c42d9 left on a plain hook_state showed the live state, whose
    # anchor at B = 1 is the initial weights parameter itself (expanded): an edit in place of the
    # state wrote the model's parameters
    torch.manual_seed(0)
    m = LanguageModel(build_config(model, vocab_size=V, d_model=16, n_layers=1)).double()
    ids = torch.randint(0, V, (1, 3), generator=torch.Generator().manual_seed(1))
    params = {k: v.detach().clone() for k, v in m.named_parameters()}
    point = "blocks.0.mixer.hook_state"
    with torch.no_grad():
        _, got = m.run_with_hooks(ids, hooks=[(point, _in_place)])
        _, want = m.run_with_hooks(ids, hooks=[(point, _zeros)])
    for k, v in m.named_parameters():
        assert torch.equal(v.detach(), params[k]), k
    nxt = torch.randint(0, V, (1, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(m(nxt, got)[0], m(nxt, want)[0], rtol=0, atol=0)
