"""The chunk form of the memory engine: gradients of a chunk taken at once at its start weights,
the decay and momentum scans as ``[C, C]`` coefficient matrices, dual-form or materialised reads,
and a loop over chunks only (see :mod:`mnemo.memory.engine` for the semantics)."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.utils.checkpoint

from ..ops._common import LOG_GATE_MIN, causal_mask, decay_exp
from .objective import _act, _grad_factors, _ln, memory_apply
from .retention import retention_map, soft_threshold
from .spec import MemorySpec
from .state import MemoryState, _map_state

__all__ = ["memory_chunk"]


def _log(x: torch.Tensor) -> torch.Tensor:
    return torch.log(x.clamp_min(math.exp(LOG_GATE_MIN)))


class _Coefs(NamedTuple):
    """Gate-only coefficients of one or more pieces (leading dims ``[B, H, n]``)."""

    gcum: torch.Tensor | None  # cumulative log decay [..., L] (or [..., L, K] per channel)
    eg: torch.Tensor | None  # exp(gcum)
    Cm: torch.Tensor  # [..., L, L] (or [..., L, L, K]): Σ_r decay(t←r) · momentum(r←s)
    b: torch.Tensor | None  # [..., L] (or [..., L, K]): weight of the incoming momentum in A_t
    s_coef: torch.Tensor | None  # [..., L]: weight of token s in the outgoing momentum
    eS: torch.Tensor | None  # [...]: decay of the incoming momentum over the piece
    channel: bool


def _gate_coefs(spec: MemorySpec, g, eta, lead, L, dtype, device) -> _Coefs:
    """Decay and momentum scans inside pieces of ``L`` tokens, as ``[L, L]`` matrices; all pieces
    of a group at once (``g: [*lead, L(, K)]``, ``eta: [*lead, L]``). Every factor is ``≤ 1``."""
    mask = causal_mask(L, device)
    channel = g is not None and g.ndim == len(lead) + 2
    if g is None:
        gcum = eg = None
        Ld = mask.to(dtype).expand(*lead, L, L)
    elif not channel:
        gcum = g.cumsum(-1)
        Ld = decay_exp(gcum[..., :, None] - gcum[..., None, :], mask)
        eg = decay_exp(gcum)
    else:
        gcum = g.cumsum(-2)
        Ld = decay_exp(gcum[..., :, None, :] - gcum[..., None, :, :], mask[..., None])
        eg = decay_exp(gcum)
    if spec.optimizer != "momentum":
        return _Coefs(gcum, eg, Ld, None, None, None, channel)
    hcum = _log(eta).cumsum(-1)
    Mm = decay_exp(hcum[..., :, None] - hcum[..., None, :], mask)
    eh = decay_exp(hcum)
    if channel:
        Cm = torch.einsum("...trk,...rs->...tsk", Ld, Mm)
        b = torch.einsum("...trk,...r->...tk", Ld, eh)
    else:
        Cm = Ld @ Mm
        b = (Ld @ eh[..., None])[..., 0]
    return _Coefs(gcum, eg, Cm, b, decay_exp(hcum[..., -1:] - hcum), eh[..., -1], channel)


#: per-token weights are materialised in blocks of at most this many numbers (memory bound)
_MATERIALIZE_BUDGET = 1 << 22


def _materialized_read(spec, A, S, eg, b, c, inputs, deltas, q, channel, affine=None):
    """Read ``o_t = M_{N(A_t)}(q_t)`` with every token's weights ``A_t`` formed explicitly (needed
    when ``N`` is not the identity or the decay is per channel). Tokens go in blocks whose weights
    fit :data:`_MATERIALIZE_BUDGET` numbers, each block recomputed in the backward pass
    (activation checkpointing) instead of storing ``[C, in, out]`` weights."""
    BH, L, _ = q.shape
    per_token = BH * max(a.shape[-2] * a.shape[-1] for a in A)
    block = max(1, min(L, _MATERIALIZE_BUDGET // max(per_token, 1)))

    def scaled(M, coef):  # coef [BH,t] or [BH,t,K] times a shared [BH,in,out] matrix
        if coef is None:
            return M[:, None]
        return (coef[..., None] if coef.ndim == 3 else coef[..., None, None]) * M[:, None]

    def read_block(t0: int, t1: int, *tensors):
        n = len(A)
        m = 2 * n if S is not None else n
        A_, S_ = tensors[:n], (tensors[n:m] if S is not None else None)
        eg_, b_, c_, qb = tensors[m:]
        Wt = []
        for i in range(n):
            if channel:
                upd = torch.einsum("ntsk,nsk,nsv->ntkv", c_, inputs[i], deltas[i])
            else:
                upd = torch.einsum("nts,nsi,nso->ntio", c_, inputs[i], deltas[i])
            At = scaled(A_[i], eg_) + upd  # c carries the step's minus sign
            if S_ is not None:
                At = At + scaled(S_[i], b_)
            Wt.append(retention_map(spec, At))
        return memory_apply(spec, Wt, qb, affine=affine)[0]

    outs = []
    for t0 in range(0, L, block):
        t1 = min(L, t0 + block)
        sl = slice(t0, t1)
        args = (
            *A,
            *(S if S is not None else ()),
            None if eg is None else eg[:, sl],
            None if b is None else b[:, sl],
            c[:, sl],
            q[:, sl],
        )
        if torch.is_grad_enabled() and block < L:
            outs.append(torch.utils.checkpoint.checkpoint(read_block, t0, t1, *args, use_reentrant=False))
        else:
            outs.append(read_block(t0, t1, *args))
    return torch.cat(outs, 1)


class _LrCoefs(NamedTuple):
    """Learning-rate-scaled coefficients of one or more pieces (leading dims ``[B·H(, n)]``),
    already shaped for broadcasting against ``[L, ·]`` activations and ``[in, out]`` states. The
    gradient weights carry the minus sign of the descent step, so every update is a plain
    ``baddbmm`` (an ``alpha = −1`` costs an extra multiply per operand in its backward)."""

    c: torch.Tensor  # [..., L, L] (or [..., L, L, K]): −weight of token s's gradient in A_t
    w_row: torch.Tensor  # [..., 1, L] (or [..., K, L]): −weight of token s's gradient in the end A
    sc_row: torch.Tensor | None  # [..., 1, L]: −weight of token s's gradient in the end momentum
    eg_col: torch.Tensor | None  # [..., L, 1]: decay of the incoming A at token t (scalar decay)
    b_col: torch.Tensor | None  # [..., L, 1]: weight of the incoming momentum at token t
    eg_end: torch.Tensor | None  # [..., 1, 1] (or [..., K, 1]): decay of A over the piece
    b_end: torch.Tensor | None  # [..., 1, 1] (or [..., K, 1]): weight of S in the end A
    eS_end: torch.Tensor | None  # [..., 1, 1]: decay of the momentum over the piece


def _lr_coefs(co: _Coefs, th: torch.Tensor) -> _LrCoefs:
    """:class:`_LrCoefs` from the gate coefficients and ``θ [..., L]``; works on one piece or on all
    pieces of a group at once (then every piece costs one ``unbind`` instead of a dozen ops)."""
    ch = co.channel
    th = -th
    c = co.Cm * (th[..., None, :, None] if ch else th[..., None, :])

    def end(x):
        return None if x is None else (x[..., -1, :, None] if ch else x[..., -1, None, None])

    def col(x):
        return None if (x is None or ch) else x[..., None]

    return _LrCoefs(
        c,
        c[..., -1, :, :].transpose(-1, -2) if ch else c[..., -1, None, :],
        None if co.s_coef is None else (co.s_coef * th)[..., None, :],
        col(co.eg),
        col(co.b),
        end(co.eg),
        end(co.b),
        None if co.eS is None else co.eS[..., None, None],
    )


def _clipped_lr(spec: MemorySpec, theta, inputs, deltas):
    """``θ_t · min(1, grad_clip / ‖G_t‖)`` (``θ`` itself without clipping), with
    ``‖G_t‖² = Σ_layers ‖x_t‖² ‖δ_t‖²`` from the per-token gradient factors ``G_t = x_t ⊗ δ_t``."""
    if spec.grad_clip is None:
        return theta
    sq = sum(x.square().sum(-1) * d.square().sum(-1) for x, d in zip(inputs, deltas))
    return theta * (spec.grad_clip / sq.clamp_min(1e-24).sqrt()).clamp(max=1.0)  # no 0·∞ at G = 0


def _piece(
    spec: MemorySpec, state: MemoryState, q, k, v, theta, delta, co: _Coefs, lr: _LrCoefs | None, affine=None
):
    """Advance the stream by ``L`` tokens that lie inside one inner chunk. Inputs ``[B·H, L, ·]``
    and states ``[B·H, in, out]`` (flat batch × heads, so every product is one ``torch.bmm``).
    ``theta`` is already clamped to ``max_lr``; ``lr`` is ``None`` when gradient clipping makes
    the effective ``θ`` depend on this piece's gradients. ``affine``: the inner norm's ``(γ, β)``
    (``[B·H, 1, V]``) or ``None``."""
    A, S, anchor = state.weights, state.momentum, state.anchor
    W0 = [retention_map(spec, a) for a in anchor]
    rho = None
    if spec.decay_first and co.gcum is not None:
        d0 = state.anchor_decay
        gc = co.gcum if d0 is None else co.gcum + (d0[:, None] if co.channel else d0[..., None])
        rho = decay_exp(gc)
    inputs, deltas = _grad_factors(spec, W0, k, v, rho, delta, affine)
    if lr is None:
        lr = _lr_coefs(co, _clipped_lr(spec, theta, inputs, deltas))

    xts = [x.transpose(-1, -2) for x in inputs]

    def new_state(i):  # A_end = e^{Σg} A + b_L S − (x ⊙ w_end)ᵀ δ,  S_end = e^{Ση} S − (x ⊙ w_S)ᵀ δ
        xt = xts[i]
        a = A[i] if lr.eg_end is None else lr.eg_end * A[i]
        if S is not None:
            a = torch.addcmul(a, lr.b_end, S[i])
        a = torch.baddbmm(a, xt * lr.w_row, deltas[i])
        s_new = None
        if S is not None:
            s_new = torch.baddbmm(lr.eS_end * S[i], xt * lr.sc_row, deltas[i])
        return a, s_new

    newA, newS = [], []
    if spec.retention in ("none", "decay") and not co.channel:
        # dual form: z_t = e^{g_t} A x_t + b_t S x_t − Σ_s c_ts (x_t · x_s) δ_s, layer by layer
        # (stacking the read's [C, C] factor and the update's [in, C] factors into one product
        # measured no faster: the concatenation and its backward cost what the product saves).
        h = q
        last = len(A) - 1
        for i in range(len(A)):
            z = torch.bmm(h, A[i])
            if lr.eg_col is not None:
                z = z * lr.eg_col
            if S is not None:
                z = torch.addcmul(z, lr.b_col, torch.bmm(h, S[i]))
            z = torch.baddbmm(z, lr.c * torch.bmm(h, xts[i]), deltas[i])
            a, s_new = new_state(i)
            newA.append(a)
            newS.append(s_new)
            h = _act(spec.activation, z) if i < last else z
        y = _ln(h, affine) if spec.norm else h
        o = q + y if spec.residual else y
    else:
        for i in range(len(A)):
            a, s_new = new_state(i)
            newA.append(a)
            newS.append(s_new)
        o = _materialized_read(spec, A, S, co.eg, co.b, lr.c, inputs, deltas, q, co.channel, affine)
    newS = None if S is None else tuple(newS)
    d_end = None
    if spec.decay_first and co.gcum is not None:
        last = co.gcum[:, -1]
        d_end = last if state.anchor_decay is None else state.anchor_decay + last
    return o, tuple(newA), newS, d_end


def _piece_elastic(spec: MemorySpec, state: MemoryState, q, k, v, theta, g, eta, delta, affine=None):
    """:func:`_piece` for ``"elastic_net"`` retention (Miras Eq. 22). Every gradient of the piece is
    taken at the chunk-start weights in one batched pass (as for every retention); the
    soft-thresholding ``W_t = S_{γ_t}(exp(g_t) W_{t−1} + step_t)`` is not linear in the steps, so the
    weights are then advanced token by token through the piece (elementwise work per token, no
    ``[C, C]`` closed form) and each token reads its own ``W_t``."""
    A, S, anchor = list(state.weights), state.momentum, state.anchor
    inputs, deltas = _grad_factors(spec, list(anchor), k, v, None, delta, affine)
    gamma = spec.l1 * theta  # γ_t = l1 · θ_t (before gradient clipping)
    th = _clipped_lr(spec, theta, inputs, deltas)
    if S is not None:
        S = list(S)
        eta = eta.clamp_min(math.exp(LOG_GATE_MIN))
    outs = []
    for t in range(q.shape[1]):
        step = [
            (-th[:, t, None, None]) * (x[:, t, :, None] * d[:, t, None, :]) for x, d in zip(inputs, deltas)
        ]
        if S is not None:
            S = [eta[:, t, None, None] * s + st for s, st in zip(S, step)]
            step = S
        if g is not None:
            a = g[:, t].exp()
            a = a[..., None] if a.ndim == 2 else a[..., None, None]
            A = [a * ai + st for ai, st in zip(A, step)]
        else:
            A = [ai + st for ai, st in zip(A, step)]
        A = [soft_threshold(ai, gamma[:, t, None, None]) for ai in A]
        outs.append(memory_apply(spec, A, q[:, t : t + 1], affine=affine)[0])
    return torch.cat(outs, 1), tuple(A), None if S is None else tuple(S)


def _flat_heads(x: torch.Tensor | None) -> torch.Tensor | None:
    """``[B, T, H, ·]`` or ``[B, T, H]`` -> ``[B·H, T, ·]`` / ``[B·H, T]``."""
    if x is None:
        return None
    x = x.transpose(1, 2)
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def memory_chunk(spec: MemorySpec, q, k, v, theta, g, eta, delta, state: MemoryState, affine=None):
    """Chunk form over ``[B, T, H, ·]`` inputs; returns ``(o [B, T, H, V], state)``. ``affine``: the
    inner norm's learned ``(γ, β)``, each ``[H, V]`` (``None``: the parameter-free norm).

    The stream is cut at absolute chunk boundaries into pieces (a first piece that completes the
    current chunk, full chunks, a last partial chunk). Gate coefficients are computed for all
    pieces of equal length at once; the loop runs over pieces only. Inside, batch and heads are
    one flat leading dim ``B·H``, so every product is a plain ``torch.bmm`` (a 4-D ``matmul``
    adds expand/reshape nodes whose backward cost more than the small products themselves).
    """
    B, T, H = q.shape[:3]
    if spec.max_lr is not None:
        theta = theta.clamp(max=spec.max_lr)
    qh, kh, vh, th, gh, eh, dh = (_flat_heads(x) for x in (q, k, v, theta, g, eta, delta))
    state = _map_state(state, lambda x: x.reshape(B * H, *x.shape[2:]))
    if affine is not None:  # [H, V] -> [B·H, 1, V] (flat batch × heads)
        affine = tuple(a.expand(B, *a.shape).reshape(B * H, 1, a.shape[-1]) for a in affine)
    C = spec.chunk_size
    if state.position % C == 0:  # at a chunk start the anchor is the current state (as in the token loop)
        state = MemoryState(state.weights, state.momentum, state.weights, None, state.position)
    first = min((C - state.position % C) % C, T)
    n_full = (T - first) // C
    groups = [(first, 1), (n_full * C, n_full), (T - first - n_full * C, 1)]
    groups = [(length, n) for length, n in groups if length > 0]
    sizes = [length // n for length, n in groups for _ in range(n)]

    def pieces(x):  # split (not slice) so the backward pass assembles each gradient once
        return [None] * len(sizes) if x is None else list(torch.split(x, sizes, dim=1))

    qs, ks, vs, ths, ds = (pieces(x) for x in (qh, kh, vh, th, dh))
    elastic = spec.retention == "elastic_net"
    if elastic:
        gs, es = pieces(gh), pieces(eh)
    coefs, lrs = [], []
    start = 0
    for length, n in [] if elastic else groups:
        L = length // n

        def grid(x, start=start, length=length, n=n, L=L):
            if x is None:
                return None
            x = x.narrow(1, start, length)
            return x.reshape(B * H, n, L, *x.shape[2:])

        co = _gate_coefs(spec, grid(gh), grid(eh), (B * H, n), L, qh.dtype, qh.device)
        per = [x.unbind(1) if isinstance(x, torch.Tensor) else [x] * n for x in co]
        coefs.extend(_Coefs(*fields) for fields in zip(*per))
        if spec.grad_clip is None:
            per = [[None] * n if x is None else x.unbind(1) for x in _lr_coefs(co, grid(th))]
            lrs.extend(_LrCoefs(*fields) for fields in zip(*per))
        else:
            lrs.extend([None] * n)
        start += length
    outs = []
    for i, L in enumerate(sizes):
        if elastic:
            o, A, S = _piece_elastic(spec, state, qs[i], ks[i], vs[i], ths[i], gs[i], es[i], ds[i], affine)
            d_end = None
        else:
            o, A, S, d_end = _piece(spec, state, qs[i], ks[i], vs[i], ths[i], ds[i], coefs[i], lrs[i], affine)
        outs.append(o)
        pos = state.position + L
        if pos % C == 0:
            state = MemoryState(A, S, A, None, pos)
        else:
            state = MemoryState(A, S, state.anchor, d_end, pos)
    o = torch.cat(outs, 1)
    o = o.reshape(B, H, *o.shape[1:]).transpose(1, 2)
    return o, _map_state(state, lambda x: x.reshape(B, H, *x.shape[1:]))
