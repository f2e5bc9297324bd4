"""``mnemo.layers.hooks.join_pieces`` on known inputs: a call's hook values read in pieces are
put back into the value of one pass (tensors along time, attention maps with each piece's key
columns at their positions, also with keys cached from an earlier call and a sliding window), and
bad pieces are named."""

from __future__ import annotations

import pytest
import torch

from mnemo.layers.hooks import HookPoint, join_pieces


def _named(point: HookPoint, name: str) -> HookPoint:
    point.name = name
    return point


def test_tensors_are_concatenated_along_time_and_states_keep_the_last_piece():
    x = torch.arange(2 * 5 * 3.0).reshape(2, 5, 3)
    q = _named(HookPoint(), "blocks.0.mixer.hook_q")
    assert torch.equal(join_pieces(q, [x[:, :2], x[:, 2:]], [2, 3]), x)
    state = _named(HookPoint(), "blocks.0.mixer.hook_state")
    assert torch.equal(join_pieces(state, [x[:, :2], x[:, 2:]], [2, 3]), x[:, 2:])
    untimed = _named(HookPoint(time_dim=None), "blocks.0.mixer.hook_pattern")
    assert join_pieces(untimed, ["a", "b"], [2, 3]) == "b"


@pytest.mark.parametrize("cached,window", [(0, None), (2, None), (2, 4)])
def test_pattern_pieces_are_placed_at_their_key_positions(cached, window):
    """The map of one pass over 5 tokens, with ``cached`` keys from an earlier call (absolute key
    positions −cached … 4) and optionally a sliding window of ``window`` keys: a causal random map
    (zero past the query and outside the window). Each piece holds the key columns its cache held:
    from the earliest kept key to its last token. Joined, they equal the one-pass map."""
    g = torch.Generator().manual_seed(0)
    T, S = 5, 5 + cached
    keys = torch.arange(-cached, T)  # absolute key positions, one per column
    queries = torch.arange(T)
    seen = keys[None, :] <= queries[:, None]
    if window is not None:
        seen &= keys[None, :] > queries[:, None] - window
    full = torch.rand(1, 2, T, S, generator=g) * seen
    point = _named(HookPoint(time_dim=2, key_dim=3), "blocks.0.mixer.hook_pattern")
    pieces, values, start = [2, 3], [], 0
    for n in pieces:
        end = start + n
        first = -cached if window is None else max(-cached, end - 1 - (window - 1) - (n - 1))
        cols = (keys >= first) & (keys <= end - 1)
        values.append(full[:, :, start:end][..., cols])
        start = end
    got = join_pieces(point, values, pieces)
    assert got.shape == full.shape
    assert torch.equal(got, full)


def test_bad_pieces_are_named():
    point = _named(HookPoint(), "blocks.1.mixer.hook_k")
    x = torch.zeros(1, 5, 2)
    with pytest.raises(ValueError, match=r"blocks.1.mixer.hook_k: expected one value per piece \(2\), got 1"):
        join_pieces(point, [x], [2, 3])
    with pytest.raises(
        ValueError, match=r"blocks.1.mixer.hook_k: piece 1 covers 3 tokens, but its value \[1, 5, 2\] has 5"
    ):
        join_pieces(point, [x[:, :2], x], [2, 3])
