"""The token-loop reference of the memory engine: the definition one token at a time, gradients
by autograd (independent of the chunk form's hand-written backward)."""

from __future__ import annotations

import math

import torch

from ..ops._common import LOG_GATE_MIN
from .objective import memory_apply, objective_value
from .retention import retention_map, soft_threshold
from .spec import MemorySpec
from .state import MemoryState

__all__ = ["memory_recurrent"]


def memory_recurrent(spec: MemorySpec, q, k, v, theta, g, eta, delta, state: MemoryState, affine=None):
    """The definition, one token at a time (see the module docstring). ``affine``: the inner norm's
    learned ``(γ, β)``, each ``[H, V]`` (``None``: the parameter-free norm); the inner loss is taken
    through it, ``ℓ(k + γ ⊙ LN(f(k)) + β, v)``."""
    A, S, anchor, d0, pos = state
    if affine is not None:  # [H, V] -> [H, 1, V], against the [B, H, 1, V] of one token
        affine = tuple(a[:, None, :] for a in affine)
    C = spec.chunk_size
    outs = []
    with torch.enable_grad():
        for t in range(q.shape[1]):
            if pos % C == 0:
                anchor, d0 = A, None
            W0 = [retention_map(spec, a) for a in anchor]
            scale = None
            if spec.decay_first and g is not None:
                d0 = g[:, t] if d0 is None else d0 + g[:, t]
                scale = d0.exp()
            if scale is None:
                W_eff = W0
            elif scale.ndim == 3:  # per key channel: scale the rows of the single layer
                W_eff = [W0[0] * scale[..., None]]
            else:
                W_eff = [w * scale[..., None, None] for w in W0]
            # a fresh alias per token: the gradient must count only the paths through this use of
            # the weights, not others (e.g. a read of the same weights that produced k_t or v_t)
            W_eff = [w.view_as(w) if w.requires_grad else w.detach().requires_grad_(True) for w in W_eff]
            y, _, _ = memory_apply(spec, W_eff, k[:, t, :, None, :], affine=affine)
            dl = None if delta is None else delta[:, t, :, None]
            loss = objective_value(spec, y, v[:, t, :, None, :], dl).sum()
            G = torch.autograd.grad(loss, W_eff, create_graph=True)
            th = theta[:, t] if spec.max_lr is None else theta[:, t].clamp(max=spec.max_lr)
            gamma = spec.l1 * th if spec.retention == "elastic_net" else None
            if spec.grad_clip is not None:
                norm = torch.sqrt(sum(gi.square().sum((-2, -1)) for gi in G).clamp_min(1e-24))
                th = th * (spec.grad_clip / norm.clamp_min(1e-12)).clamp(max=1.0)
            step = [-th[..., None, None] * gi for gi in G]
            if S is not None:
                et = eta[:, t].clamp_min(math.exp(LOG_GATE_MIN))
                S = tuple(et[..., None, None] * s + st for s, st in zip(S, step))
                step = list(S)
            if g is not None:
                a = g[:, t].exp()
                a = a[..., None] if a.ndim == 3 else a[..., None, None]
                A = tuple(a * ai + st for ai, st in zip(A, step))
            else:
                A = tuple(ai + st for ai, st in zip(A, step))
            if gamma is not None:  # elastic net (Miras Eq. 22): W_t = S_γ(λ_t W_{t−1} + step_t)
                A = tuple(soft_threshold(ai, gamma[..., None, None]) for ai in A)
            Wt = [retention_map(spec, ai) for ai in A]
            o, _, _ = memory_apply(spec, Wt, q[:, t, :, None, :], affine=affine)
            outs.append(o[:, :, 0])
            pos += 1
    o = torch.stack(outs, 1)
    if pos % C == 0:
        anchor, d0 = A, None
    return o, MemoryState(A, S, anchor, d0, pos)
