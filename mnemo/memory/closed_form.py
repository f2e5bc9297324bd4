"""The closed-form members of the design space: specs that a dedicated op computes exactly."""

from __future__ import annotations

import torch

from .spec import MemorySpec
from .state import MemoryState

__all__ = ["closed_form_op"]


def closed_form_op(spec: MemorySpec) -> str | None:
    """The dedicated op that computes ``spec`` exactly, if any.

    Hebbian (``dot``) matrix memories with plain GD are linear attention / gated linear attention
    for every chunk size (their gradient does not depend on the weights); ``l2`` matrix memories with
    plain GD and ``chunk_size = 1`` are the delta rule, and with a decay applied first the gated
    delta rule. Not with ``decay_first`` and a decay inside chunks of more than one token: there the
    stream's state carries the decay accumulated since the chunk start (``anchor_decay``), which the
    dedicated ops do not track, so the engine's own forms run (the state is then the same whichever
    form, or a one-token decoding step, produced it).
    """
    if (
        spec.architecture != "matrix"
        or spec.residual
        or spec.norm
        or spec.optimizer != "gd"
        or spec.grad_clip is not None
        or spec.retention not in ("none", "decay")
        or (spec.decay_first and spec.decays and spec.chunk_size > 1)
    ):
        return None
    if spec.objective == "dot":
        return "gated_linear_attention" if spec.retention == "decay" else "linear_attention"
    if spec.objective == "l2" and spec.chunk_size == 1 and not spec.decay_per_channel:
        if spec.retention == "none":
            return "delta_rule"
        if spec.decay_first:
            return "gated_delta_rule"
    return None


def _run_closed_form(name, spec, q, k, v, theta, g, state: MemoryState):
    """The op over the call, cut at the last inner-chunk boundary inside it, so that the returned
    anchor is the state at that boundary (as the engine's other forms leave it)."""
    T, pos = q.shape[1], state.position
    cut = (pos + T) // spec.chunk_size * spec.chunk_size - pos  # tokens up to the last boundary
    S0 = state.weights[0]
    if cut < 0:  # no boundary in [pos, pos + T]: the anchor stays
        anchor = state.anchor[0]
    elif cut == 0:  # the call starts at a boundary and crosses no other
        anchor = S0
    elif cut < T:
        o1, anchor = _closed_form_piece(name, spec, q, k, v, theta, g, S0, 0, cut)
        o2, S = _closed_form_piece(name, spec, q, k, v, theta, g, anchor, cut, T)
        return torch.cat([o1, o2], 1), MemoryState((S,), None, (anchor,), None, pos + T)
    o, S = _closed_form_piece(name, spec, q, k, v, theta, g, S0, 0, T)
    return o, MemoryState((S,), None, (S if cut == T else anchor,), None, pos + T)


def _closed_form_piece(name, spec, q, k, v, theta, g, S0, a: int, b: int):
    """The op over tokens ``a … b − 1`` from the state ``S0``: ``(o, S)``."""
    from ..ops import delta_rule, gated_delta_rule, gated_linear_attention, linear_attention

    if (a, b) != (0, q.shape[1]):
        q, k, v, theta = (x[:, a:b] for x in (q, k, v, theta))
        g = None if g is None else g[:, a:b]
    th = theta if spec.max_lr is None else theta.clamp(max=spec.max_lr)
    kw = dict(scale=1.0, initial_state=S0, output_final_state=True)
    if name == "linear_attention":
        o, S = linear_attention(q, k * th[..., None], v, **kw)
    elif name == "gated_linear_attention":
        o, S = gated_linear_attention(q, k * th[..., None], v, g, **kw)
    elif name == "delta_rule":
        o, S = delta_rule(q, k, v, th, **kw)
    else:
        o, S = gated_delta_rule(q, k, v, g, th, **kw)
    return o, S.to(S0.dtype)
