"""Seventh break-it review of the hooks and mnemo.interp: a global module hook sees the live state
(documented; a hook of the point's own sees a copy whose edits never reach the parameters), the
circuit tracker's spectrum takes the ``burn_in`` of ``memory_spectrum`` / ``probe spectrum``, and
further checks of the interventions and probes against hand computations."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.utils._pytree as pytree

import mnemo.layers.hooks as hooks_module
from mnemo.interp import CircuitTracker, circuit_callbacks
from mnemo.layers.titans import NeuralMemory
from mnemo.models import LanguageModel, build_config

F64 = torch.float64
ROOT = Path(__file__).resolve().parents[2]


def _model(name, n_layers=1, vocab=20, **kw):
    torch.manual_seed(0)
    cfg = build_config(name, vocab_size=vocab, d_model=16, n_layers=n_layers, **kw)
    return LanguageModel(cfg).double().eval()


def _ids(T=12, seed=0, B=1, vocab=20):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


# --- part 1a: global hooks see the live state (documented); a point's own hook sees a copy ---------


def _memory():
    torch.manual_seed(0)
    return NeuralMemory(d_model=16, n_heads=2).double()


def _add_one(state):
    for leaf in pytree.tree_leaves(state):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            leaf.add_(1.0)


@pytest.mark.parametrize("grad", [False, True])
def test_an_in_place_edit_by_a_hook_of_the_point_never_reaches_the_parameters(grad):
    """A 3-token call leaves a fresh memory's weights at its initial ones (the parameters, expanded
    over the batch): a hook attached to ``hook_state`` that adds 1 in place edits the state the
    stream goes on from (each weight is the unhooked one + 1) but not the parameters."""
    m, x = _memory(), torch.randn(1, 3, 16, dtype=F64)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    with torch.no_grad():
        _, plain = m(x)
    h = m.hook_state.add(lambda st, name: _add_one(st))
    try:
        with torch.set_grad_enabled(grad):
            _, edited = m(x)
    finally:
        h.remove()
    assert all(torch.equal(p, before[n]) for n, p in m.named_parameters())
    for a, b in zip(plain.memory_state().weights, edited.memory_state().weights):
        assert torch.equal(b.detach(), a + 1.0)


def test_a_global_hook_sees_the_live_state_as_documented():
    """The documented behaviour: a global module hook is shown the state's own tensors (no copy);
    the hooks module's docstring and the circuits guide say to read it, not edit it in place."""
    from torch.nn.modules import module as torch_module

    m, x = _memory(), torch.randn(1, 3, 16, dtype=F64)
    seen = []

    def glob(module, inputs, output):
        if module is m.hook_state:
            seen.append(output)

    h = torch_module.register_module_forward_hook(glob)
    try:
        with torch.no_grad():
            _, st = m(x)
    finally:
        h.remove()
    assert len(seen) == 1 and seen[0] is st  # the live state itself
    doc = " ".join(hooks_module.__doc__.split())
    assert "Global hooks see the live values." in doc and "do not edit them in place" in doc
    guide = " ".join((ROOT / "docs/guides/circuits.md").read_text().split())
    assert "sees the live state" in guide and "do not edit it in place" in guide


# --- part 1b: the tracker's spectrum takes burn_in ------------------------------------------------


def _transient(g, name):
    """The closed form of review 6: a start-of-text gate ``g_0 = −5``, then ``g_t = −0.1``."""
    out = torch.full_like(g, -0.1)
    out[:, 0] = -5.0
    return out


def test_tracker_spectrum_burn_in_is_the_half_life_after_the_start_transient():
    """Over 10 tokens the mean log decay is ``(−5 − 0.9) / 10``, half-life ``ln 2 / 0.59``; with
    ``spectrum_burn_in=1`` it is ``−0.1``, half-life ``ln 2 / 0.1`` (the same as
    ``memory_spectrum(burn_in=1)`` and ``mnemo probe spectrum --burn-in 1``)."""
    model = _model("gla")
    h = dict(model.named_modules())["blocks.0.mixer.hook_g"].add(_transient)
    try:
        got = {}
        for b in (0, 1):
            tracker = CircuitTracker(length=4, batch=1, spectrum=True, spectrum_tokens=10, spectrum_burn_in=b)
            got[b] = tracker._spectrum(model)["spectrum_median_half_life_by_layer"][0]
    finally:
        h.remove()
    assert got[0] == pytest.approx(math.log(2) / 0.59, rel=1e-12)
    assert got[1] == pytest.approx(math.log(2) / 0.1, rel=1e-12)


@pytest.mark.parametrize("bad", [-1, 10, 1.0, True, None])
def test_tracker_spectrum_burn_in_out_of_range_is_named_when_built(bad):
    with pytest.raises(ValueError, match=r"spectrum_burn_in: expected an int number of tokens in \[0, 10\)"):
        CircuitTracker(spectrum=True, spectrum_tokens=10, spectrum_burn_in=bad)


def test_circuit_callbacks_pass_a_configured_spectrum_burn_in_and_default_to_zero():
    class Cfg:
        track_circuits, track_spectrum, circuit_length = False, True, 8

    (tracker,) = circuit_callbacks(Cfg())
    assert tracker.spectrum_burn_in == 0
    Cfg.spectrum_burn_in = 5
    (tracker,) = circuit_callbacks(Cfg())
    assert tracker.spectrum and tracker.spectrum_burn_in == 5


# --- part 2: steering per position where the value has rows outside the call ----------------------


def test_steer_per_position_scale_over_a_learned_prefix_is_the_per_token_sum():
    """Titans LMM prepends 4 persistent tokens, so ``hook_q`` passes ``T + 4`` rows whose first 4
    lie before the call. A scale ``[1, T, 1, 1]`` over the call's ``T`` tokens (documented "also
    where the hook passes the call in pieces") steers token ``t`` by ``s_t`` and leaves the prefix:
    the same logits as ``T`` steers with ``positions=[t]``, ``scale=s_t`` composed (it raised a
    ``ValueError`` calling the scale's shape wrong)."""
    from mnemo.interp import compose, steer

    model, T = _model("titans_lmm"), 6
    ids = _ids(T=T, B=2)
    hook = "blocks.0.mixer.hook_q"
    d = torch.randn(4, generator=torch.Generator().manual_seed(3), dtype=F64)
    s = torch.linspace(-1.0, 2.0, T, dtype=F64)
    with torch.no_grad():
        got = model.run_with_hooks(ids, steer(model, hook, d, scale=s.view(1, T, 1, 1)))[0]
        hand = model.run_with_hooks(
            ids, compose(*[steer(model, hook, d, scale=float(s[t]), positions=[t]) for t in range(T)])
        )[0]
        plain = model(ids)[0]
    assert torch.equal(got, hand)
    assert not torch.allclose(got, plain)  # it did steer
