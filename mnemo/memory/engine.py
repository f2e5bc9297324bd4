"""The test-time-trained memory: one engine for every :class:`~mnemo.memory.MemorySpec`.

Semantics (the same in the token-loop reference, the chunked form, streaming and decoding)::

    at a chunk start (position % chunk_size == 0):  anchor ← A
    for token t:
        W⁰    = N(anchor)                                  weights the gradient is taken at
        G_t   = ∇_W ℓ(M_W(k_t), v_t) at W = ρ_t ⊙ W⁰         ρ_t = decay since the anchor if
                                                            decay_first, else 1
        G_t  ← G_t · min(1, grad_clip / ‖G_t‖)            (optional)
        step  = −θ_t G_t                 or   S_t = η_t S_{t−1} − θ_t G_t, step = S_t   (momentum)
        A_t   = exp(g_t) ⊙ A_{t−1} + step                 (g = 0 without retention decay)
        A_t  ← S_{γ_t}(A_t),  γ_t = l1 · θ_t               (elastic_net only; Miras Eq. 22)
        o_t   = M_{W_t}(q_t)   with  W_t = N(A_t)          token t reads *after* its own write

``N`` is the identity, Moneta's ℓq normalisation or Memora's scaled softmax (see ``MemorySpec``);
``S_γ`` is the soft-thresholding of elastic-net retention (its chunk form advances the weights
token by token inside the chunk, from gradients all taken at once at the chunk-start weights).
With ``chunk_size = 1`` this is plain online learning (exact delta rule, …); with larger chunks it
is mini-batch GD inside each chunk (Titans §3.2, TTT). Because every gradient of a chunk is taken at
the same weights, the chunk form computes all of them in one batched forward/backward of the memory
and expresses ``A_t`` for every token of the chunk as
``A_t = e^{Σg} A + b_t S − Σ_s c_ts x_s ⊗ δ_s`` (per layer: input ``x_s`` and output-gradient
``δ_s`` of token ``s``), with ``[C, C]`` coefficient matrices from the decay and momentum scans.
Reads then use the dual form (matmuls with ``[C, C]`` scores, no per-token weights) when ``N`` is the
identity with a scalar decay, and materialise the per-token weights of the chunk otherwise. The only
loop over time is over chunks.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.autograd.function import once_differentiable

from ..ops._common import LOG_GATE_MIN, check_finite, check_floating, decay_exp
from .spec import MemorySpec

__all__ = ["MemoryState", "neural_memory", "memory_forward", "init_state", "closed_form_op"]


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


# ------------------------------------------------------------------------------------------------
# the memory function M_W, its inner objective and a hand-written backward (for the chunk form)
# ------------------------------------------------------------------------------------------------


def _act(name: str, z: torch.Tensor) -> torch.Tensor:
    if name == "gelu":
        return F.gelu(z)
    if name == "silu":
        return F.silu(z)
    if name == "relu":
        return F.relu(z)
    return torch.tanh(z)


def _act_grad(name: str, z: torch.Tensor) -> torch.Tensor:
    """``act'(z)`` for the activations other than GELU (see :class:`_GeluWithGrad`)."""
    if name == "silu":
        s = torch.sigmoid(z)
        return s * (1 + z * (1 - s))
    if name == "relu":
        return (z > 0).to(z.dtype)
    return 1 - torch.tanh(z) ** 2


_LN_EPS = 1e-5


def _ln(z: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(z, (z.shape[-1],), eps=_LN_EPS)


def soft_threshold(x: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """``S_γ(x) = sign(x) · max(|x| − γ, 0)`` (elementwise; ``gamma`` broadcasts against ``x``)."""
    return torch.sign(x) * torch.relu(x.abs() - gamma)


def retention_map(spec: MemorySpec, A: torch.Tensor) -> torch.Tensor:
    """``W = N(A)``: identity, ``A / ‖A‖_q^{q−2}`` (norm over each layer's matrix) or
    ``kl_scale · softmax(A)`` over the input axis (dim ``-2``)."""
    if spec.retention == "lq":
        norm = A.abs().pow(spec.q).sum((-2, -1), keepdim=True).pow(1.0 / spec.q)
        return A / (norm + 1e-6).pow(spec.q - 2)
    if spec.retention == "kl":
        return spec.kl_scale * torch.softmax(A, dim=-2)
    return A


def memory_apply(spec: MemorySpec, weights, x: torch.Tensor, rho: torch.Tensor | None = None):
    """``M_W(x)`` for ``x: [*lead, L, in]`` and weights ``[*lead, in, out]`` (shared over tokens) or
    ``[*lead, L, in, out]`` (one per token), ``lead`` being ``[B, H]`` or the flat ``[B·H]`` of the
    chunk form. ``rho`` scales the weights per token (``[*lead, L]``) or per key channel
    (``[*lead, L, K]``, one-layer memories). Returns ``(y, layer_inputs, pre_acts)``.
    """
    h = x
    inputs, zs = [], []
    last = len(weights) - 1
    for i, W in enumerate(weights):
        inputs.append(h)
        hin = h * rho if (rho is not None and rho.ndim == x.ndim) else h
        if W.ndim == x.ndim + 1:
            z = torch.einsum("...ti,...tio->...to", hin, W)
        else:
            z = hin @ W
        if rho is not None and rho.ndim == x.ndim - 1:
            z = z * rho[..., None]
        zs.append(z)
        h = _act(spec.activation, z) if i < last else z
    y = _ln(h) if spec.norm else h
    if spec.residual:
        y = x + y
    return y, inputs, zs


def objective_grad(spec: MemorySpec, y, v, delta):
    """``∂ℓ/∂y`` of the attentional bias at the memory output ``y``."""
    if spec.objective == "dot":
        return -v
    e = y - v
    if spec.objective == "l2":
        return e
    if spec.objective == "lp":
        return e * (e * e + spec.lp_eps**2).pow(0.5 * spec.p - 1.0)
    d = delta[..., None]
    if spec.huber_mode == "token":  # Miras Eq. 16: ∇ℓ₂ if ‖e‖₂ ≤ δ, else δ ∇ℓ₁ (one switch per token)
        small = torch.linalg.vector_norm(e, dim=-1, keepdim=True) <= d
        return torch.where(small, e, d * torch.sign(e))
    return torch.minimum(torch.maximum(e, -d), d)  # coordinate-wise Huber (Miras Eq. 14)


def objective_value(spec: MemorySpec, y, v, delta):
    """``ℓ(y, v)`` summed over the value dim (the reference differentiates this with autograd)."""
    if spec.objective == "dot":
        return -(y * v).sum(-1)
    e = y - v
    if spec.objective == "l2":
        return 0.5 * (e * e).sum(-1)
    if spec.objective == "lp":
        return ((e * e + spec.lp_eps**2).pow(0.5 * spec.p) / spec.p).sum(-1)
    d = delta[..., None]
    a = e.abs()
    if spec.huber_mode == "token":
        # ½‖e‖² if ‖e‖₂ ≤ δ else δ‖e‖₁: the piecewise objective whose gradient is Miras Eq. 16's step
        small = torch.linalg.vector_norm(e, dim=-1) <= d[..., 0]
        return torch.where(small, 0.5 * (e * e).sum(-1), d[..., 0] * a.sum(-1))
    return torch.where(a <= d, 0.5 * e * e, d * (a - 0.5 * d)).sum(-1)


class _GeluWithGrad(torch.autograd.Function):
    """``(gelu(z), gelu'(z))`` from one ``erf`` and one ``exp`` (exact, erf-based GELU). The chunk
    form needs both (the memory's forward and its inner backward); autograd of the separate ops
    would evaluate ``erf``/``exp`` four more times. Backward:
    ``∂/∂z = g_h · gelu'(z) + g_d · gelu''(z)`` with ``gelu''(z) = φ(z)(2 − z²)``."""

    @staticmethod
    def forward(ctx, z):
        cdf = torch.erf(z * 0.5**0.5).add_(1.0).mul_(0.5)
        pdf = torch.exp(-0.5 * z * z).mul_(1.0 / math.sqrt(2.0 * math.pi))
        h = z * cdf
        d1 = torch.addcmul(cdf, z, pdf)
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(d1, pdf.mul_(2.0 - z * z))
        return h, d1

    @staticmethod
    @once_differentiable
    def backward(ctx, g_h, g_d):
        d1, d2 = ctx.saved_tensors
        out = None
        if g_h is not None:
            out = g_h * d1
        if g_d is not None:
            out = g_d * d2 if out is None else out.addcmul_(g_d, d2)
        return out


def _act_with_grad(name: str, z: torch.Tensor):
    """``(act(z), act'(z))``."""
    if name == "gelu":
        return _GeluWithGrad.apply(z)
    return _act(name, z), _act_grad(name, z)


def _grad_factors(spec: MemorySpec, W0, k, v, rho, delta):
    """Per-token, per-layer gradient factors at ``W0``: ``G_s = x_s ⊗ δ_s`` for every layer.

    The same function as :func:`memory_apply` followed by the backward of the objective, written
    for the chunk form's flat ``[B·H, L, ·]`` layout (``torch.bmm``, fused activation value and
    slope, the fused layer-norm backward); the token-loop reference differentiates
    :func:`memory_apply` with autograd instead."""
    h = k
    inputs, slopes = [], []
    last = len(W0) - 1
    for i, W in enumerate(W0):
        inputs.append(h)
        hin = h * rho if (rho is not None and rho.ndim == k.ndim) else h
        z = torch.bmm(hin, W)
        if rho is not None and rho.ndim == k.ndim - 1:
            z = z * rho[..., None]
        if i < last:
            h, slope = _act_with_grad(spec.activation, z)
            slopes.append(slope)
        else:
            h = z
    shape = [h.shape[-1]]
    if spec.norm:
        y, mean, rstd = torch.ops.aten.native_layer_norm(h, shape, None, None, _LN_EPS)
    else:
        y = h
    if spec.residual:
        y = k + y
    dz = objective_grad(spec, y, v, delta)
    if spec.norm:
        dz = torch.ops.aten.native_layer_norm_backward(
            dz, h, shape, mean, rstd, None, None, [True, False, False]
        )[0]
    deltas = [dz]
    for i in range(last, 0, -1):
        dh = torch.bmm(dz, W0[i].transpose(-1, -2))
        if rho is not None and rho.ndim == k.ndim - 1:
            dh = dh * rho[..., None]
        dz = dh * slopes[i - 1]
        deltas.append(dz)
    return inputs, deltas[::-1]


# ------------------------------------------------------------------------------------------------
# chunk form
# ------------------------------------------------------------------------------------------------


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
    mask = torch.ones(L, L, dtype=torch.bool, device=device).tril()
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


def _materialized_read(spec, A, S, eg, b, c, inputs, deltas, q, channel):
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
        return memory_apply(spec, Wt, qb)[0]

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


def _piece(spec: MemorySpec, state: MemoryState, q, k, v, theta, delta, co: _Coefs, lr: _LrCoefs | None):
    """Advance the stream by ``L`` tokens that lie inside one inner chunk. Inputs ``[B·H, L, ·]``
    and states ``[B·H, in, out]`` (flat batch × heads, so every product is one ``torch.bmm``).
    ``theta`` is already clamped to ``max_lr``; ``lr`` is ``None`` when gradient clipping makes
    the effective ``θ`` depend on this piece's gradients."""
    A, S, anchor = state.weights, state.momentum, state.anchor
    W0 = [retention_map(spec, a) for a in anchor]
    rho = None
    if spec.decay_first and co.gcum is not None:
        d0 = state.anchor_decay
        gc = co.gcum if d0 is None else co.gcum + (d0[:, None] if co.channel else d0[..., None])
        rho = decay_exp(gc)
    inputs, deltas = _grad_factors(spec, W0, k, v, rho, delta)
    if lr is None:
        th = theta
        if spec.grad_clip is not None:
            sq = sum(x.square().sum(-1) * d.square().sum(-1) for x, d in zip(inputs, deltas))
            th = th * (spec.grad_clip / sq.clamp_min(1e-24).sqrt()).clamp(max=1.0)  # no 0·∞ at G = 0
        lr = _lr_coefs(co, th)

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
        y = _ln(h) if spec.norm else h
        o = q + y if spec.residual else y
    else:
        for i in range(len(A)):
            a, s_new = new_state(i)
            newA.append(a)
            newS.append(s_new)
        o = _materialized_read(spec, A, S, co.eg, co.b, lr.c, inputs, deltas, q, co.channel)
    newS = None if S is None else tuple(newS)
    d_end = None
    if spec.decay_first and co.gcum is not None:
        last = co.gcum[:, -1]
        d_end = last if state.anchor_decay is None else state.anchor_decay + last
    return o, tuple(newA), newS, d_end


def _piece_elastic(spec: MemorySpec, state: MemoryState, q, k, v, theta, g, eta, delta):
    """:func:`_piece` for ``"elastic_net"`` retention (Miras Eq. 22). Every gradient of the piece is
    taken at the chunk-start weights in one batched pass (as for every retention); the
    soft-thresholding ``W_t = S_{γ_t}(exp(g_t) W_{t−1} + step_t)`` is not linear in the steps, so the
    weights are then advanced token by token through the piece (elementwise work per token, no
    ``[C, C]`` closed form) and each token reads its own ``W_t``."""
    A, S, anchor = list(state.weights), state.momentum, state.anchor
    inputs, deltas = _grad_factors(spec, list(anchor), k, v, None, delta)
    gamma = spec.l1 * theta  # γ_t = l1 · θ_t (before gradient clipping)
    th = theta
    if spec.grad_clip is not None:
        sq = sum(x.square().sum(-1) * d.square().sum(-1) for x, d in zip(inputs, deltas))
        th = th * (spec.grad_clip / sq.clamp_min(1e-24).sqrt()).clamp(max=1.0)  # no 0·∞ at G = 0
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
        outs.append(memory_apply(spec, A, q[:, t : t + 1])[0])
    return torch.cat(outs, 1), tuple(A), None if S is None else tuple(S)


def _flat_heads(x: torch.Tensor | None) -> torch.Tensor | None:
    """``[B, T, H, ·]`` or ``[B, T, H]`` -> ``[B·H, T, ·]`` / ``[B·H, T]``."""
    if x is None:
        return None
    x = x.transpose(1, 2)
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _map_state(state: MemoryState, fn) -> MemoryState:
    def each(xs):
        return None if xs is None else tuple(fn(x) for x in xs)

    d = None if state.anchor_decay is None else fn(state.anchor_decay)
    return MemoryState(each(state.weights), each(state.momentum), each(state.anchor), d, state.position)


def memory_chunk(spec: MemorySpec, q, k, v, theta, g, eta, delta, state: MemoryState):
    """Chunk form over ``[B, T, H, ·]`` inputs; returns ``(o [B, T, H, V], state)``.

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
    C = spec.chunk_size
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
            o, A, S = _piece_elastic(spec, state, qs[i], ks[i], vs[i], ths[i], gs[i], es[i], ds[i])
            d_end = None
        else:
            o, A, S, d_end = _piece(spec, state, qs[i], ks[i], vs[i], ths[i], ds[i], coefs[i], lrs[i])
        outs.append(o)
        pos = state.position + L
        if pos % C == 0:
            state = MemoryState(A, S, A, None, pos)
        else:
            state = MemoryState(A, S, state.anchor, d_end, pos)
    o = torch.cat(outs, 1)
    o = o.reshape(B, H, *o.shape[1:]).transpose(1, 2)
    return o, _map_state(state, lambda x: x.reshape(B, H, *x.shape[1:]))


# ------------------------------------------------------------------------------------------------
# token-loop reference (gradients by autograd, independent of the hand-written backward)
# ------------------------------------------------------------------------------------------------


def memory_recurrent(spec: MemorySpec, q, k, v, theta, g, eta, delta, state: MemoryState):
    """The definition, one token at a time (see the module docstring)."""
    A, S, anchor, d0, pos = state
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
            y, _, _ = memory_apply(spec, W_eff, k[:, t, :, None, :])
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
            o, _, _ = memory_apply(spec, Wt, q[:, t, :, None, :])
            outs.append(o[:, :, 0])
            pos += 1
    o = torch.stack(outs, 1)
    if pos % C == 0:
        anchor, d0 = A, None
    return o, MemoryState(A, S, anchor, d0, pos)


# ------------------------------------------------------------------------------------------------
# dedicated ops for the closed-form members of the design space
# ------------------------------------------------------------------------------------------------


def closed_form_op(spec: MemorySpec) -> str | None:
    """The dedicated op that computes ``spec`` exactly, if any.

    Hebbian (``dot``) matrix memories with plain GD are linear attention / gated linear attention
    for every chunk size (their gradient does not depend on the weights); ``l2`` matrix memories with
    plain GD and ``chunk_size = 1`` are the delta rule, and with a decay applied first the gated
    delta rule.
    """
    if (
        spec.architecture != "matrix"
        or spec.residual
        or spec.norm
        or spec.optimizer != "gd"
        or spec.grad_clip is not None
        or spec.retention not in ("none", "decay")
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
    from ..ops import delta_rule, gated_delta_rule, gated_linear_attention, linear_attention

    th = theta if spec.max_lr is None else theta.clamp(max=spec.max_lr)
    S0 = state.weights[0]
    kw = dict(scale=1.0, initial_state=S0, output_final_state=True)
    if name == "linear_attention":
        o, S = linear_attention(q, k * th[..., None], v, **kw)
    elif name == "gated_linear_attention":
        o, S = gated_linear_attention(q, k * th[..., None], v, g, **kw)
    elif name == "delta_rule":
        o, S = delta_rule(q, k, v, th, **kw)
    else:
        o, S = gated_delta_rule(q, k, v, g, th, **kw)
    S = S.to(S0.dtype)
    pos = state.position + q.shape[1]
    return o, MemoryState((S,), None, (S,), None, pos)


# ------------------------------------------------------------------------------------------------
# public entry point
# ------------------------------------------------------------------------------------------------


def _check(spec, q, k, v, theta, g, eta, delta, state):
    for name, t in (("q", q), ("k", k), ("v", v), ("theta", theta)):
        check_floating(name, t)
    if q.ndim != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must have shape [B, T, H, K], got {list(q.shape)} and {list(k.shape)}")
    B, T, H, K = q.shape
    if v.ndim != 4 or tuple(v.shape[:3]) != (B, T, H):
        raise ValueError(f"v must have shape [B, T, H, V] = [{B}, {T}, {H}, V], got {list(v.shape)}")
    if theta.shape != (B, T, H):
        raise ValueError(f"theta must have shape [B, T, H] = [{B}, {T}, {H}], got {list(theta.shape)}")
    if spec.retention != "none":
        if g is None:
            raise ValueError(
                f"retention {spec.retention!r} needs the log decay g ([B, T, H] or [B, T, H, K])"
            )
        want = (B, T, H, K) if spec.decay_per_channel else (B, T, H)
        if tuple(g.shape) != want:
            raise ValueError(f"g must have shape {list(want)}, got {list(g.shape)}")
    elif g is not None:
        raise ValueError("g was given but the retention is 'none'")
    if spec.optimizer == "momentum":
        if eta is None or eta.shape != (B, T, H):
            got = None if eta is None else list(eta.shape)
            raise ValueError(
                f"optimizer 'momentum' needs eta of shape [B, T, H] = [{B}, {T}, {H}], got {got}"
            )
    if spec.objective == "huber" and (delta is None or delta.shape != (B, T, H)):
        got = None if delta is None else list(delta.shape)
        raise ValueError(f"objective 'huber' needs delta of shape [B, T, H] = [{B}, {T}, {H}], got {got}")
    dims = spec.layer_dims(K, v.shape[-1])
    if spec.residual and K != v.shape[-1]:
        raise ValueError(f"a residual memory needs K == V, got K = {K}, V = {v.shape[-1]}")
    if state is None:
        return
    if len(state.weights) != len(dims):
        raise ValueError(f"initial_state has {len(state.weights)} layers, the spec has {len(dims)}")
    for i, (w, (din, dout)) in enumerate(zip(state.weights, dims)):
        if tuple(w.shape) != (B, H, din, dout):
            raise ValueError(
                f"initial_state.weights[{i}] must have shape [B, H, in, out] = [{B}, {H}, {din}, {dout}], "
                f"got {list(w.shape)}"
            )


def neural_memory(
    spec: MemorySpec,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    theta: torch.Tensor,
    *,
    g: torch.Tensor | None = None,
    eta: torch.Tensor | None = None,
    delta: torch.Tensor | None = None,
    initial_state: MemoryState | None = None,
    output_final_state: bool = False,
    mode: str = "chunk",
    use_closed_form: bool = True,
) -> tuple[torch.Tensor, MemoryState | None]:
    """Run a test-time-trained memory over a sequence (Titans / Miras / TTT; see module docstring).

    Args:
        spec: the :class:`MemorySpec`.
        q, k: ``[B, T, H, K]`` reads and keys. v: ``[B, T, H, V]`` values.
        theta: ``[B, T, H]`` inner learning rate ``θ_t`` (> 0; clamped to ``spec.max_lr``).
        g: log retention ``[B, T, H]`` (``[B, T, H, K]`` with ``decay_per_channel``), ``≤ 0``; needed
            unless the retention is ``"none"`` (``exp(g) = 1 − α`` in Titans' notation).
        eta: ``[B, T, H]`` momentum ``η_t ∈ [0, 1)`` (optimizer ``"momentum"``).
        delta: ``[B, T, H]`` Huber threshold ``δ_t > 0`` (objective ``"huber"``; compared with the
            error norm ``‖M(k_t) − v_t‖₂`` with ``huber_mode="token"``, with each coordinate otherwise).
        initial_state: a :class:`MemoryState` (see :func:`init_state`); zeros when ``None``.
        mode: ``"chunk"`` (training; the closed-form op when one exists and ``use_closed_form``)
            or ``"recurrent"`` (the token-loop reference).

    Returns:
        ``o: [B, T, H, V]`` in ``q``'s dtype and the :class:`MemoryState` (``None`` unless
        ``output_final_state``). Computation runs in float32 (float64 for float64 inputs).

    Raises:
        ValueError: shapes or missing per-token inputs for the spec; the message names the argument.
    """
    spec.validate()
    if mode not in ("chunk", "recurrent"):
        raise ValueError(f"mode must be one of ('chunk', 'recurrent'), got {mode!r}")
    _check(spec, q, k, v, theta, g, eta, delta, initial_state)
    check_finite({"q": q, "k": k, "v": v, "theta": theta, "eta": eta, "delta": delta}, {"g": g})
    cd = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, T, H, K = q.shape
    V = v.shape[-1]
    if initial_state is None:
        zeros = [q.new_zeros(B, H, i, o, dtype=cd) for i, o in spec.layer_dims(K, V)]
        initial_state = init_state(spec, zeros)
    st = MemoryState(
        tuple(w.to(cd) for w in initial_state.weights),
        None if initial_state.momentum is None else tuple(s.to(cd) for s in initial_state.momentum),
        tuple(w.to(cd) for w in initial_state.anchor),
        None if initial_state.anchor_decay is None else initial_state.anchor_decay.to(cd),
        initial_state.position,
    )
    args = [None if x is None else x.to(cd) for x in (q, k, v, theta, g, eta, delta)]
    if args[4] is not None:
        args[4] = args[4].clamp(min=LOG_GATE_MIN)
    if T == 0:
        o, st_out = v.new_zeros(B, 0, H, V), st
    elif mode == "recurrent":
        o, st_out = memory_recurrent(spec, *args, st)
        if not torch.is_grad_enabled():
            o = o.detach()
            st_out = _detach_state(st_out)
    else:
        op = closed_form_op(spec) if use_closed_form else None
        if op is not None:
            o, st_out = _run_closed_form(op, spec, args[0], args[1], args[2], args[3], args[4], st)
        else:
            o, st_out = memory_chunk(spec, *args, st)
    return o.to(q.dtype), (st_out if output_final_state else None)


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


memory_forward = neural_memory
