"""Regressions of review 4's Titans / Miras fixes (commit 1958f49): MAC's own ``mixing_acts`` and the
piece-aware ``check_hooks``."""

from __future__ import annotations

import pytest
import torch

from mnemo.layers import TitansMAC, TitansMAG
from mnemo.testing.mixers import check_hooks

D = 16


def _x(T, B=2, seed=1):
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("T", [3, 9])
def test_mac_mixing_acts_record_without_autograd_as_every_mixer(T):
    """``Mixer.mixing_acts`` records under ``torch.no_grad``; MAC's override (joining its segments)
    dropped that, so its recorded values carried the call's autograd graph (``.numpy()`` on them
    raised, the graph was kept alive) where every other mixer's, MAG's included, do not."""
    torch.manual_seed(0)
    mac = TitansMAC(D, n_heads=2, segment=4, persistent_tokens=2).double()
    acts = mac.mixing_acts(_x(T))
    grads = {h: a.requires_grad for h, a in acts.items() if isinstance(a, torch.Tensor)}
    assert grads and not any(grads.values()), grads
    assert acts["memory.hook_q"].shape[1] == T
    acts["memory.hook_q"].numpy()  # a plain recorded value
    mag = TitansMAG(D, n_heads=2, window=4).double()
    assert not any(a.requires_grad for a in mag.mixing_acts(_x(T)).values() if isinstance(a, torch.Tensor))


def test_check_hooks_refuses_a_one_pass_value_with_a_prefix_not_placed_in_the_call(monkeypatch):
    """``_tiles`` checks a piece's value holds the piece's tokens, but took any value of a hook
    fired once over the call: a memory whose hooks pass its persistent prefix's rows without
    placing them before token 0 (``enter_piece(-P, …)``; recordings then put token 0 at row P and
    interventions' positions shift by P) passed the check."""
    assert check_hooks("neural_memory", options={"persistent_tokens": 2}).passed
    monkeypatch.setattr("mnemo.layers.titans.enter_piece", lambda start, n, total: None)
    r = check_hooks("neural_memory", options={"persistent_tokens": 2})
    assert not r.passed and "hook_q" in r.message, r.message
    # the same memory without a prefix has T rows: still passes with the piece left undeclared
    assert check_hooks("neural_memory").passed
