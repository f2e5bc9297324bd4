"""Fourth break-it review of the Titans / Miras memories: the mixer checks on MAC's segment-wise hooks,
MAC continuing from a state made under ``torch.inference_mode`` …"""

from __future__ import annotations

import pytest
import torch

from mnemo.layers import TitansMAC
from mnemo.testing.mixers import check_hooks
from tests.helpers import assert_close

D = 16
TOL = 1e-10


def _x(T, B=2, seed=1, dtype=torch.float64):
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@pytest.mark.parametrize("segment", [1, 2, 4])
def test_check_hooks_accepts_mac_s_segment_pieces_that_tile_the_call(segment):
    """MAC fires its hooks once per segment piece (each placed in the call): the check counted
    firings and failed every MAC whose segment is shorter than the call (T=6)."""
    r = check_hooks("titans_mac", options={"segment": segment})
    assert r.passed, r.message


def test_check_hooks_still_refuses_a_hook_fired_twice_over_the_same_tokens():
    from mnemo.layers.registry import MIXERS

    class Twice(TitansMAC):
        def forward(self, x, state=None, *, mode=None):
            self.hook_gate(x)  # an extra firing over the whole call
            return super().forward(x, state, mode=mode)

    MIXERS["_review4_twice"] = Twice
    try:
        r = check_hooks("_review4_twice", options={"segment": 64})
    finally:
        del MIXERS["_review4_twice"]
    assert not r.passed and "hook_gate" in r.message


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_mac_continues_with_autograd_from_a_state_made_under_inference_mode(mode):
    """A prefix run under ``torch.inference_mode`` then a training-mode continuation: MAC's
    read-before saved the inference-made anchor for backward (torch raised "Inference tensors cannot
    be saved for backward"); it reads from copies now, with the values of a no-grad-made state."""
    torch.manual_seed(0)
    m = TitansMAC(D, n_heads=2, segment=4, persistent_tokens=2).double()
    x = _x(10)
    with torch.inference_mode():
        _, s_inf = m(x[:, :6])
    with torch.no_grad():
        _, s_ref = m(x[:, :6])
        want, _ = m(x[:, 6:], s_ref, mode=mode)
    y, _ = m(x[:, 6:], s_inf, mode=mode)
    y.square().sum().backward()
    assert_close(y.detach(), want, TOL, what="continuation from the inference-made state")
    assert m.memory.in_proj.weight.grad is not None and m.memory.in_proj.weight.grad.abs().sum() > 0


def test_mac_map_over_several_segments_reproduces_the_memory_read():
    """``mixing_acts`` kept each hook's last segment only, so ``mixing`` raised for any MAC call
    longer than a segment (``mnemo.interp.maps`` too). The joined map of a linear memory
    (zero initial weights, so the writes' part of the read is the read) times the written values
    is the memory's read ``memory.hook_o`` over the whole stream."""
    torch.manual_seed(0)
    m = TitansMAC(D, n_heads=2, segment=4, persistent_tokens=2, spec="linear_attention").double()
    x = _x(11)
    reads = []
    h = m.memory.hook_o.register_forward_hook(lambda mod, i, out: reads.append(out))
    with torch.no_grad():
        m(x)
    h.remove()
    read = torch.cat(reads, 1)
    mx = m.mixing(m.mixing_acts(x))
    assert mx.maps.shape == (2, 2, 11, 11)
    got = torch.einsum("bhts,bshv->bthv", mx.maps, mx.values)
    assert_close(got, read, TOL, what="maps @ values vs the memory's read")
    assert_close(mx.output, read, TOL, what="the map's output vs the memory's read")


def test_mac_attribution_refuses_a_recording_of_the_last_segment_only():
    """``attribution`` took the last segment's values as a fresh stream (a silent 2 × 2 map of a
    6-token call: the check_mixer attribution row passed on it); it now refuses as ``mixing`` does."""
    torch.manual_seed(0)
    m = TitansMAC(D, n_heads=2, segment=4).double()
    x = _x(6)
    att = m.attribution(m.mixing_acts(x), steps=1)
    assert att.maps.shape[-2:] == (6, 6)
    last = {}
    handles = [
        m.get_submodule(n).register_forward_hook(lambda mod, i, out, n=n: last.__setitem__(n, out))
        for n in m.mixing_hooks
    ]
    with torch.no_grad():
        m(x)
    for h in handles:
        h.remove()
    with pytest.raises(NotImplementedError, match="2 of the stream's 6 tokens"):
        m.attribution(last, steps=1)


@pytest.mark.parametrize("cls", ["NeuralMemory", "TitansMAC", "TitansMAG", "TitansMAL"])
def test_a_bad_mode_is_refused_when_the_mixer_is_built(cls):
    """The Titans mixers took any ``mode`` (``"parallel"``, a typo) and failed only at the first call
    of more than one token (one-token decoding ran): the other mixers refuse it when built."""
    import mnemo.layers as layers

    with pytest.raises(ValueError, match=r"mode must be one of \('chunk', 'recurrent'\), got 'parallel'"):
        getattr(layers, cls)(D, 2, mode="parallel")
