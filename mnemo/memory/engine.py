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
        o_t   = M_{W_t}(q_t)   with  W_t = N(A_t)          token t reads *after* its own write

``N`` is the identity, Moneta's ℓq normalisation or Memora's scaled softmax (see ``MemorySpec``).
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


def _act_backward(name: str, dh: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """``dh ⊙ act'(z)`` (fused for GELU; twice differentiable either way)."""
    if name == "gelu":
        return torch.ops.aten.gelu_backward(dh, z)
    return dh * _act_grad(name, z)


def _act_grad(name: str, z: torch.Tensor) -> torch.Tensor:
    if name == "gelu":
        cdf = 0.5 * (1.0 + torch.erf(z * 0.5**0.5))
        pdf = torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
        return cdf + z * pdf
    if name == "silu":
        s = torch.sigmoid(z)
        return s * (1 + z * (1 - s))
    if name == "relu":
        return (z > 0).to(z.dtype)
    return 1 - torch.tanh(z) ** 2


_LN_EPS = 1e-5


def _ln(z: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(z, (z.shape[-1],), eps=_LN_EPS)


def _ln_backward(z: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """Backward of the parameter-free layer norm: ``rstd (dy − mean(dy) − y mean(dy ⊙ y))``."""
    d = z - z.mean(-1, keepdim=True)
    rstd = (d.square().mean(-1, keepdim=True) + _LN_EPS).rsqrt()
    y = d * rstd
    return rstd * (dy - dy.mean(-1, keepdim=True) - y * (dy * y).mean(-1, keepdim=True))


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
    """``M_W(x)`` for ``x: [B, H, L, in]`` and weights ``[B, H, in, out]`` (shared over tokens) or
    ``[B, H, L, in, out]`` (one per token). ``rho`` scales the weights per token (``[B, H, L]``) or
    per key channel (``[B, H, L, K]``, one-layer memories). Returns ``(y, layer_inputs, pre_acts)``.
    """
    h = x
    inputs, zs = [], []
    last = len(weights) - 1
    for i, W in enumerate(weights):
        inputs.append(h)
        hin = h * rho if (rho is not None and rho.ndim == 4) else h
        if W.ndim == 5:
            z = torch.einsum("bhti,bhtio->bhto", hin, W)
        else:
            z = hin @ W
        if rho is not None and rho.ndim == 3:
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
    return torch.minimum(torch.maximum(e, -d), d)


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
    return torch.where(a <= d, 0.5 * e * e, d * (a - 0.5 * d)).sum(-1)


def _grad_factors(spec: MemorySpec, W0, k, v, rho, delta):
    """Per-token, per-layer gradient factors at ``W0``: ``G_s = x_s ⊗ δ_s`` for every layer."""
    y, inputs, zs = memory_apply(spec, W0, k, rho)
    dz = objective_grad(spec, y, v, delta)
    if spec.norm:
        dz = _ln_backward(zs[-1], dz)
    deltas = [dz]
    for i in range(len(W0) - 1, 0, -1):
        dh = dz @ W0[i].transpose(-1, -2)
        if rho is not None and rho.ndim == 3:
            dh = dh * rho[..., None]
        dz = _act_backward(spec.activation, dh, zs[i - 1])
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
    Bsz, H, L, _ = q.shape
    per_token = Bsz * H * max(a.shape[-2] * a.shape[-1] for a in A)
    block = max(1, min(L, _MATERIALIZE_BUDGET // max(per_token, 1)))

    def scaled(M, coef):  # coef [B,H,t] or [B,H,t,K] times a shared [B,H,in,out] matrix
        if coef is None:
            return M[:, :, None]
        return (coef[..., None] if coef.ndim == 4 else coef[..., None, None]) * M[:, :, None]

    def read_block(t0: int, t1: int, *tensors):
        n = len(A)
        m = 2 * n if S is not None else n
        A_, S_ = tensors[:n], (tensors[n:m] if S is not None else None)
        eg_, b_, c_, qb = tensors[m:]
        Wt = []
        for i in range(n):
            if channel:
                upd = torch.einsum("bhtsk,bhsk,bhsv->bhtkv", c_, inputs[i], deltas[i])
            else:
                upd = torch.einsum("bhts,bhsi,bhso->bhtio", c_, inputs[i], deltas[i])
            At = scaled(A_[i], eg_) - upd
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
            None if eg is None else eg[:, :, sl],
            None if b is None else b[:, :, sl],
            c[:, :, sl],
            q[:, :, sl],
        )
        if torch.is_grad_enabled() and block < L:
            outs.append(torch.utils.checkpoint.checkpoint(read_block, t0, t1, *args, use_reentrant=False))
        else:
            outs.append(read_block(t0, t1, *args))
    return torch.cat(outs, 2)


def _piece(spec: MemorySpec, state: MemoryState, q, k, v, theta, delta, co: _Coefs):
    """Advance the stream by ``L`` tokens that lie inside one inner chunk. Inputs ``[B, H, L, ·]``."""
    A, S, anchor = state.weights, state.momentum, state.anchor
    W0 = [retention_map(spec, a) for a in anchor]
    rho = None
    if spec.decay_first and co.gcum is not None:
        d0 = state.anchor_decay
        gc = co.gcum if d0 is None else co.gcum + (d0[:, :, None] if co.channel else d0[..., None])
        rho = decay_exp(gc)
    inputs, deltas = _grad_factors(spec, W0, k, v, rho, delta)
    th = theta if spec.max_lr is None else theta.clamp(max=spec.max_lr)
    if spec.grad_clip is not None:
        sq = sum(x.square().sum(-1) * d.square().sum(-1) for x, d in zip(inputs, deltas))
        th = th * (spec.grad_clip / sq.sqrt().clamp_min(1e-12)).clamp(max=1.0)
    channel, eg, b = co.channel, co.eg, co.b
    c = co.Cm * (th[..., None, :, None] if channel else th[..., None, :])

    eg_L = None if eg is None else eg[:, :, -1]
    b_L = None if b is None else b[:, :, -1]
    sc = None if S is None else co.s_coef * th
    w_end = c[:, :, -1] if channel else c[:, :, -1, :, None]

    def end_rows(i):  # left factors of the state update: Σ_s w_s x_s ⊗ δ_s = (x ⊙ w)ᵀ δ
        rows = [(inputs[i] * w_end).transpose(-1, -2)]
        if S is not None:
            rows.append((inputs[i] * sc[..., None]).transpose(-1, -2))
        return rows

    def new_state(i, upd):  # upd: [(x ⊙ w_A)ᵀ δ, (x ⊙ w_S)ᵀ δ]
        a = A[i]
        if eg_L is not None:
            a = (eg_L[..., None] if channel else eg_L[..., None, None]) * a
        a = a - upd[0]
        s_new = None
        if S is not None:
            a = a + (b_L[..., None] if channel else b_L[..., None, None]) * S[i]
            s_new = co.eS[..., None, None] * S[i] - upd[1]
        return a, s_new

    newA, newS = [], []
    if spec.retention in ("none", "decay") and not channel:
        # dual form: z_t = e^{g_t} A x_t + b_t S x_t − Σ_s c_ts (x_t · x_s) δ_s, layer by layer. The
        # read's [C, C] factor and the state update's [in, C] factors multiply the same δ, so they
        # are stacked into one matmul per layer.
        h = q
        last = len(A) - 1
        for i in range(len(A)):
            z = h @ A[i]
            if eg is not None:
                z = z * eg[..., None]
            if S is not None:
                z = torch.addcmul(z, b[..., None], h @ S[i])
            left = [c * (h @ inputs[i].transpose(-1, -2))] + end_rows(i)
            sizes = [x.shape[-2] for x in left]
            prod = torch.cat(left, -2) @ deltas[i]
            r, *upd = prod.split(sizes, -2)
            z = z - r
            a, s_new = new_state(i, upd)
            newA.append(a)
            newS.append(s_new)
            h = _act(spec.activation, z) if i < last else z
        y = _ln(h) if spec.norm else h
        o = q + y if spec.residual else y
    else:
        for i in range(len(A)):
            a, s_new = new_state(i, [r @ deltas[i] for r in end_rows(i)])
            newA.append(a)
            newS.append(s_new)
        o = _materialized_read(spec, A, S, eg, b, c, inputs, deltas, q, channel)
    newS = None if S is None else tuple(newS)
    d_end = None
    if spec.decay_first and co.gcum is not None:
        last = co.gcum[:, :, -1]
        d_end = last if state.anchor_decay is None else state.anchor_decay + last
    return o, tuple(newA), newS, d_end


def _to_heads(x):
    return None if x is None else x.transpose(1, 2)


def memory_chunk(spec: MemorySpec, q, k, v, theta, g, eta, delta, state: MemoryState):
    """Chunk form over ``[B, T, H, ·]`` inputs; returns ``(o [B, T, H, V], state)``.

    The stream is cut at absolute chunk boundaries into pieces (a first piece that completes the
    current chunk, full chunks, a last partial chunk). Gate coefficients are computed for all
    pieces of equal length at once; the loop runs over pieces only.
    """
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    th, gh, eh, dh = (_to_heads(x) for x in (theta, g, eta, delta))
    C, T = spec.chunk_size, q.shape[1]
    B, H = qh.shape[:2]
    first = min((C - state.position % C) % C, T)
    n_full = (T - first) // C
    groups = [(first, 1), (n_full * C, n_full), (T - first - n_full * C, 1)]
    groups = [(length, n) for length, n in groups if length > 0]
    sizes = [length // n for length, n in groups for _ in range(n)]

    def pieces(x):  # split (not slice) so the backward pass assembles each gradient once
        return [None] * len(sizes) if x is None else list(torch.split(x, sizes, dim=2))

    qs, ks, vs, ths, ds = (pieces(x) for x in (qh, kh, vh, th, dh))
    coefs = []
    start = 0
    for length, n in groups:
        L = length // n

        def grid(x, start=start, length=length, n=n, L=L):
            if x is None:
                return None
            x = x.narrow(2, start, length)
            return x.reshape(B, H, n, L, *x.shape[3:])

        co = _gate_coefs(spec, grid(gh), grid(eh), (B, H, n), L, qh.dtype, qh.device)
        per = [x.unbind(2) if isinstance(x, torch.Tensor) else [x] * n for x in co]
        coefs.extend(_Coefs(*fields) for fields in zip(*per))
        start += length
    outs = []
    for i, L in enumerate(sizes):
        o, A, S, d_end = _piece(spec, state, qs[i], ks[i], vs[i], ths[i], ds[i], coefs[i])
        outs.append(o)
        pos = state.position + L
        if pos % C == 0:
            state = MemoryState(A, S, A, None, pos)
        else:
            state = MemoryState(A, S, state.anchor, d_end, pos)
    o = torch.cat(outs, 2).transpose(1, 2)
    return o, state


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
            if spec.grad_clip is not None:
                norm = torch.sqrt(sum(gi.square().sum((-2, -1)) for gi in G))
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
        delta: ``[B, T, H]`` Huber threshold ``δ_t > 0`` (objective ``"huber"``).
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
