"""Review 6 (memory area): Titans / Miras / TTT memories."""

from __future__ import annotations

import pytest
import torch

from mnemo.layers import NeuralMemory


def _std_interval(n: int) -> float:
    """A 6-sigma half-width of the sample std of ``n`` normal draws, relative to the std."""
    return 6.0 / (2 * n) ** 0.5


def test_ttt_mlp_starts_its_w1_and_w2_as_the_ttt_reference():
    """TTT-MLP's ``W1`` and ``W2`` were drawn ``N(0, 1/in)``; the TTT authors' code draws both
    ``N(0, 0.02²)`` (its biases start at zero; the memory here has none). TTT-Linear keeps its
    ``0.02``; the other MLP memories (Titans …) keep fan-in scaling."""
    torch.manual_seed(0)
    m = NeuralMemory(64, spec="ttt_mlp", n_heads=2)
    w1, w2 = list(m.init_weights)
    assert w1.shape == (2, 32, 128) and w2.shape == (2, 128, 32)
    for w in (w1, w2):
        n = w.numel()
        assert abs(w.std().item() / 0.02 - 1) < _std_interval(n)
        assert abs(w.mean().item()) < 6 * 0.02 / n**0.5
    (w,) = list(NeuralMemory(64, spec="ttt_linear", n_heads=2).init_weights)
    assert abs(w.std().item() / 0.02 - 1) < _std_interval(w.numel())
    for name in ("titans", "moneta", "yaad", "memora"):
        for w in NeuralMemory(64, spec=name, n_heads=2).init_weights:
            want = w.shape[-2] ** -0.5
            assert abs(w.std().item() / want - 1) < _std_interval(w.numel()), name


def _mixers():
    from mnemo.layers import TitansMAC, TitansMAG, TitansMAL

    return [
        NeuralMemory(16, n_heads=2, chunk_size=4),
        TitansMAG(16, n_heads=2, window=4, chunk_size=4),
        TitansMAL(16, n_heads=2, window=4, chunk_size=4),
        TitansMAC(16, n_heads=2, segment=4),
    ]


@pytest.mark.parametrize("i", range(4))
def test_a_state_of_another_type_is_refused_naming_the_argument(i):
    """Given the engine's ``MemoryState`` (``state.memory_state()``) or another mixer's state, the
    Titans mixers failed with ``AttributeError: 'MemoryState' object has no attribute 'offset'``
    (MAG given a NeuralMemoryState: ``no attribute 'attn_k'``), which names neither the argument nor
    what it expects (the CMS and the self-modifying memories name both)."""
    torch.manual_seed(0)
    mixers = _mixers()
    m = mixers[i]
    x = torch.randn(2, 5, 16)
    _, own = m(x)
    y, _ = m(x[:, :2])
    assert torch.equal(m(x[:, :2], None)[0], y)  # None is a fresh stream
    mem_state = own if i == 0 else own.memory
    others = [mem_state.memory_state(), mixers[(i + 1) % 4](x)[1]]
    for bad in others:
        with pytest.raises(
            ValueError, match=rf"state: expected a {type(own).__name__} .* got {type(bad).__name__}"
        ):
            m(x, bad)
    m(x, own)  # its own state still continues
