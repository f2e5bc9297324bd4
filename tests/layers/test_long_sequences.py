"""Every mixer stays finite over very long sequences at initialisation (DESIGN §8, issue 9).

The fast forms run at T = 65,536 in the default suite. The token-loop (recurrent) forms repeat the
same bounded per-token update, so the default suite runs them at T = 8,192 (MAG and MAL, whose
recurrent form is their memory's, through that memory: see ``THROUGH_THEIR_MEMORY``); the full
65,536-token recurrent runs are marked ``slow`` (``python -m pytest -m slow``).
"""

from __future__ import annotations

import pytest
import torch

from mnemo.layers import MIXERS, Attention, MultiHeadLatentAttention
from tests.helpers import assert_close

D = 16
#: softmax attention at T = 65,536 costs one T × T score map per head (its exponentials were most of
#: the time): one head of 16 channels, the same blockwise path as more heads at the same length
OPTIONS = {
    "mamba": {"d_state": 8},
    "mamba2": {"d_state": 8, "head_dim": 8},
    "attention": {"n_heads": 1},
    "mla": {"n_heads": 1},
}
PREFIX = 256
PREFIX_TOL = 1e-6  # float32 (measured: exact, 1.4e-8 for the Titans layers)


def _mixer(name):
    torch.manual_seed(0)
    return MIXERS[name](D, **OPTIONS.get(name, {"n_heads": 2}))


NAMES = sorted(n for n in MIXERS if n not in ("titans_mac",))  # MAC is exercised through its memory
#: multi-head latent attention runs softmax attention's op (at 65,536 tokens in the ``attention`` case)
#: on keys and values expanded from its latents: its own code (latents, the decoupled rotary key,
#: the cache) at 8,192 tokens by default, the full length in the slow suite (~15 s)
SHORTER = {"mla": 8192}


def _check(name, T, mode):
    m = _mixer(name)
    if isinstance(m, (Attention, MultiHeadLatentAttention)) and mode == "recurrent":
        mode = "parallel"  # attention has no recurrent form beyond the reference loop
    x = torch.randn(1, T, D, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        y, state = m(x, mode=mode)
        y_short, _ = m(x[:, :PREFIX], mode=mode)
    assert torch.isfinite(y).all(), f"{name} {mode}: non-finite output at T = {T}"
    # and the long run computes the layer: causal, so its first tokens are those of a short run
    assert_close(y[:, :PREFIX], y_short, PREFIX_TOL, what=f"{name} {mode}: first {PREFIX} tokens")


@pytest.mark.parametrize("name", [n for n in NAMES if n not in SHORTER])
def test_fast_forms_finite_at_65536(name):
    _check(name, 65536, None)


@pytest.mark.parametrize("name", sorted(SHORTER))
def test_fast_forms_of_latent_attention_finite(name):
    _check(name, SHORTER[name], None)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SHORTER))
def test_fast_forms_of_latent_attention_finite_at_65536(name):
    _check(name, 65536, None)


#: MAG and MAL: ``mode`` reaches only their memory branch (a :class:`~mnemo.layers.NeuralMemory`,
#: spec ``titans``, with 4 persistent tokens); their sliding-window attention runs the same code in
#: every mode, at 65,536 tokens above. The memory's token loop is run at 8,192 tokens by the
#: ``neural_memory`` case (the same module and spec), so here, as MAC is exercised through its
#: memory, their recurrent forms run at 2,048 tokens: past ``WINDOW_BLOCK`` (1,024, the blockwise
#: window path of the long run) and 32 memory chunks, for the wiring of the token loop into them.
THROUGH_THEIR_MEMORY = ("titans_mag", "titans_mal")
RECURRENT = [n for n in NAMES if not isinstance(_mixer(n), (Attention, MultiHeadLatentAttention))]


@pytest.mark.parametrize("name", [n for n in RECURRENT if n not in THROUGH_THEIR_MEMORY])
def test_recurrent_forms_finite_at_8192(name):
    _check(name, 8192, "recurrent")


@pytest.mark.parametrize("name", THROUGH_THEIR_MEMORY)
def test_recurrent_forms_of_mag_and_mal_finite_at_2048(name):
    from mnemo.ops.softmax_attention import WINDOW_BLOCK

    memory, alone = _mixer(name).memory, _mixer("neural_memory")  # the module run at 8,192 tokens
    assert type(memory) is type(alone) and memory.spec == alone.spec and 2048 > WINDOW_BLOCK
    _check(name, 2048, "recurrent")


@pytest.mark.slow
@pytest.mark.parametrize("name", RECURRENT)
def test_recurrent_forms_finite_at_65536(name):
    _check(name, 65536, "recurrent")
