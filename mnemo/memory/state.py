"""The state of a memory stream (:class:`MemoryState`) and the helpers that build and map it."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .spec import MemorySpec

__all__ = ["MemoryState", "init_state"]


class MemoryState(NamedTuple):
    """The state of a memory stream (one entry per memory layer, shapes ``[B, H, in, out]``).

    Attributes:
        weights: the accumulators ``A`` (the weights are ``N(A)``; equal for ``none``/``decay``).
        momentum: the momentum buffers ``S`` (optimizer ``"momentum"``) or ``None``.
        anchor: the accumulators at the start of the current inner chunk (gradients are taken at
            ``N(anchor)`` until the chunk ends).
        anchor_decay: log decay accumulated since the anchor (``[B, H]`` or ``[B, H, K]``), used
            with ``decay_first``; ``None`` otherwise.
        position: tokens consumed since the stream started (chunk boundaries are absolute).
    """

    weights: tuple
    momentum: tuple | None
    anchor: tuple
    anchor_decay: torch.Tensor | None
    position: int


def init_state(spec: MemorySpec, weights, batch_size: int | None = None) -> MemoryState:
    """A fresh stream state from initial weights: a list of ``[H, in, out]`` (shared, e.g. learned
    parameters; expanded over ``batch_size``) or ``[B, H, in, out]`` tensors."""
    ws = []
    for w in weights:
        if w.ndim == 3:
            if batch_size is None:
                raise ValueError("init_state: batch_size is needed for [H, in, out] weights")
            w = w.unsqueeze(0).expand(batch_size, *w.shape)
        ws.append(w)
    ws = tuple(ws)
    mom = tuple(torch.zeros_like(w) for w in ws) if spec.optimizer == "momentum" else None
    return MemoryState(ws, mom, ws, None, 0)


def _map_state(state: MemoryState, fn) -> MemoryState:
    def each(xs):
        return None if xs is None else tuple(fn(x) for x in xs)

    d = None if state.anchor_decay is None else fn(state.anchor_decay)
    return MemoryState(each(state.weights), each(state.momentum), each(state.anchor), d, state.position)


def _detach_state(s: MemoryState) -> MemoryState:
    def d(xs):
        return None if xs is None else tuple(x.detach() for x in xs)

    return MemoryState(
        d(s.weights),
        d(s.momentum),
        d(s.anchor),
        None if s.anchor_decay is None else s.anchor_decay.detach(),
        s.position,
    )
