"""Selective scan: the input-dependent diagonal state-space model of Mamba (S6).

    Δ_t = softplus(δ_t + δ_bias)   (or δ_t + δ_bias without softplus)
    h_t = exp(Δ_t A) ⊙ h_{t−1} + Δ_t B_t u_t          y_t = C_t h_t + D u_t     (y ← y · silu(z))

Every channel ``d`` of ``u`` owns a diagonal state ``h[d] ∈ R^N`` with its own decays
``exp(Δ_{t,d} A_{d,n})``; ``B_t, C_t`` are shared by the channels of a group (Gu & Dao 2023,
"Mamba: Linear-Time Sequence Modeling with Selective State Spaces", Alg. 2; the state is
``[B, D, N]``). Per channel it is gated linear attention with per-channel gates and ``V = 1``
(``q = C``, ``k = Δ B``, ``v = u``, ``g = Δ A``), which the tests use as a cross-check.

The three forms below compute exactly the same function:

* ``recurrent`` — the token loop, the reference definition.
* ``parallel``  — the quadratic "implicit attention" form (Ali et al. 2024, "The Hidden Attention
  of Mamba Models"): ``y_t = Σ_{s≤t} α_{ts} u_s + C_t (exp(b_t) ⊙ h_0)`` with
  ``α_{ts}[d] = Σ_n C_{tn} exp(b_{t,dn} − b_{s,dn}) B_{sn} Δ_{s,d}``. The exponent is an exact
  segment sum ``Σ_{s<r≤t} Δ_r A`` (a masked cumulative sum, never a difference of two long
  cumulative sums), so it is ``≤ 0`` for ``A ≤ 0`` and precise in float32. It builds
  ``[B, D, T, T]`` maps (one state channel at a time; autograd keeps ``O(N · B · D · T²)``
  numbers): the implicit-attention view for analysis and short sequences, not for training.
* ``chunk``     — the training form: a ``torch.autograd.Function`` that walks the sequence in
  blocks of ``chunk_size`` tokens so that every ``[block, D, N]`` intermediate stays in cache.
  Per block it forms the decays ``exp(Δ A)`` and inputs ``Δ B u`` at once, runs the diagonal scan
  as one fused multiply-add per token on the whole ``[B, D, N]`` state, and reads ``y`` out with
  one batched contraction. Only the ``T / chunk_size`` block-entry states are saved; the backward
  pass walks the blocks in reverse, recomputes each block's states from its entry state and runs
  the hand-written reverse scan ``g_t = ∂y_t/∂h_t + exp(Δ_{t+1} A) ⊙ g_{t+1}``, so no
  ``[T, D, N]`` tensor is ever stored. A matmul-based chunked form does not pay off here: with
  per-channel, per-state decays and ``V = 1`` there is no ``[C×K]·[K×V]`` block to multiply; and
  running the within-chunk loop over all chunks of the sequence at once (whole ``[T, D, N]``
  intermediates) measured about 10x slower on CPU than these cache-sized blocks.

On the CPU (float32/float64), ``chunk`` runs the same blocked algorithm as a C kernel
(:mod:`mnemo.ops._native`, built on first use with the system compiler). A tile of W channels (one
SIMD register of floats: 16 with AVX-512, 8 with AVX2) keeps its ``[N, W]`` states in registers/L1
for the whole sequence, so a token costs ``N`` vector updates instead of ~6 PyTorch dispatches; the
backward recomputes each block of ``chunk_size`` tokens from the saved block-entry states, as
above. ``Δ = softplus(δ + δ_bias)``, ``v = Δ u``, the skip ``D u`` and the gate ``silu(z)`` are
fused in (timings: ``docs/benchmarks/notes.md``). ``MNEMO_NATIVE=0`` (or no C compiler) selects
the PyTorch form; both are tested against the token loop.

Log decays ``Δ A`` are clamped from below at ``-60`` in every form (as ``clamp_log_gate``), so a
huge step ``Δ`` acts as a reset of the state and never produces overflow or NaN.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _native, _workspace
from ._chunked import autocast_disabled
from ._common import (
    LOG_GATE_MIN,
    _shape,
    avoid_host_reads,
    causal_mask,
    check_finite,
    check_form,
    check_groups,
    check_initial_state,
    check_ndim,
    check_shape,
    check_sign,
    clamp_log_gate,
    compute_dtype,
    first_order,
    num_sequences,
    run_varlen,
    state_or_zeros,
    transformed,
)
from ._layout import rearrange, repeat

__all__ = ["selective_scan", "selective_scan_map"]

# ----------------------------------------------------------------------------------------------
# cores: inputs validated and in the compute dtype. delta is Δ (after bias/softplus), u, delta:
# [B, T, D]; A: [D, N]; B, C: [B, T, G, N]; h0: [B, D, N]. They return (C·h part of y, h_T).
# ----------------------------------------------------------------------------------------------


def _per_channel(X: torch.Tensor, D: int) -> torch.Tensor:
    """``[B, T, G, N] -> [B, T, D, N]``: channel ``d`` reads group ``d // (D / G)``."""
    return repeat(X, "b t g n -> b t (g r) n", r=D // X.shape[2])


def ss_recurrent(delta, u, A, B, C, h0):
    """Token loop (the reference). Returns ``(y [B,T,D], h_T [B,D,N])``."""
    D = u.shape[-1]
    Bd, Cd = _per_channel(B, D), _per_channel(C, D)
    h = h0
    ys = []
    for d_t, u_t, B_t, C_t in zip(delta.unbind(1), u.unbind(1), Bd.unbind(1), Cd.unbind(1)):
        decay = clamp_log_gate(d_t[..., None] * A).exp()
        h = decay * h + (d_t * u_t)[..., None] * B_t
        ys.append((h * C_t).sum(-1))
    return torch.stack(ys, 1), h


def ss_parallel(delta, u, A, B, C, h0):
    """Quadratic implicit-attention form (see the module docstring)."""
    Bsz, T, D = u.shape
    N = A.shape[-1]
    Bd = rearrange(_per_channel(B, D), "b t d n -> b d n t")
    Cd = rearrange(_per_channel(C, D), "b t d n -> b d n t")
    a = clamp_log_gate(rearrange(delta, "b t d -> b d t")[:, :, None, :] * A[None, :, :, None])  # [B,D,N,T]
    strict = causal_mask(T, u.device, -1)
    incl = causal_mask(T, u.device)
    dT = rearrange(delta, "b t d -> b d t")
    uT = rearrange(u, "b t d -> b d t")
    alpha = u.new_zeros(Bsz, D, T, T)
    y0 = u.new_zeros(Bsz, D, T)
    hT = []
    for n in range(N):
        an = a[:, :, n]  # [B, D, T]
        # seg[t, s] = Σ_{s < r ≤ t} a_r, an exact masked cumulative sum (0 on the diagonal)
        seg = (an[..., :, None] * strict).cumsum(-2).masked_fill(~incl, float("-inf"))
        alpha = alpha + Cd[:, :, n, :, None] * seg.exp() * Bd[:, :, n, None, :]
        b = an.cumsum(-1)  # b_t = Σ_{r ≤ t} a_r (≤ 0 for A ≤ 0): decay from h_0 to t
        y0 = y0 + Cd[:, :, n] * b.exp() * h0[:, :, n, None]
        last = seg[..., -1, :]  # decay from s to T
        hT.append(b[..., -1].exp() * h0[:, :, n] + (last.exp() * Bd[:, :, n] * dT * uT).sum(-1))
    y = (alpha * dT[:, :, None, :]) @ uT[..., None]
    y = y[..., 0] + y0
    return rearrange(y, "b d t -> b t d"), torch.stack(hT, -1)


class _ChunkScan(torch.autograd.Function):
    """Blocked selective scan with a hand-written reverse-scan backward (see module docstring).

    Internal layout, time first and the channels of a group last so that every broadcast runs over
    contiguous rows: ``delta, v: [T, B, G, 1, Dg]`` (``v = Δ u``, ``D = G · Dg``),
    ``B: [T, B, G, N, 1]``, ``C: [T, B, G, 1, N]``, ``A: [G, N, Dg]``, states ``[B, G, N, Dg]``.
    Returns ``y: [T, B, G, 1, Dg]`` and the final state.
    """

    @staticmethod
    def _block_states(delta, v, A, B, h, clamp, e, x, es, xs):
        """Fill ``e = exp(Δ A)`` and ``x = h_t`` (``[l, B, G, N, Dg]``) for one block.

        ``es``/``xs`` are the per-token views (``unbind(0)``) of the full-length block buffers.
        """
        torch.mul(delta, A, out=e)
        if clamp:
            e.clamp_(min=LOG_GATE_MIN)
        e.exp_()
        torch.mul(v, B, out=x)
        xs[0].addcmul_(es[0], h)
        for j in range(1, delta.shape[0]):
            xs[j].addcmul_(es[j], xs[j - 1])

    @staticmethod
    def forward(ctx, delta, v, A, B, C, h0, chunk_size: int):
        T = delta.shape[0]
        L = min(chunk_size, T)
        nb = -(-T // L)
        # clamping is needed only if some Δ·A can fall below the floor (cheap [G, N, Dg] bound)
        # (while torch.compile traces, always: a clamp that changes nothing is exact, and reading
        # the bound back would break the graph; off the CPU too: the read is a host sync)
        if avoid_host_reads(delta):
            clamp = True
        else:
            dmax, dmin = delta.amax((0, 1)), delta.amin((0, 1))
            clamp = bool((torch.minimum(dmax * A, dmin * A) < LOG_GATE_MIN).any())
        e = delta.new_empty((L,) + h0.shape)
        x = delta.new_empty((L,) + h0.shape)
        es, xs = e.unbind(0), x.unbind(0)
        y = delta.new_empty(delta.shape)
        starts = delta.new_empty((nb,) + h0.shape)
        blocks = zip(delta.split(L), v.split(L), B.split(L), C.split(L), y.split(L))
        h = h0
        for i, (db, vb, Bb, Cb, yb) in enumerate(blocks):
            l = db.shape[0]
            starts[i] = h  # a copy: h is a view of the block buffer that is overwritten next
            _ChunkScan._block_states(db, vb, A, Bb, starts[i], clamp, e[:l], x[:l], es, xs)
            torch.matmul(Cb, x[:l], out=yb)
            h = xs[l - 1]
        hT = h.clone()
        ctx.save_for_backward(delta, v, A, B, C, starts)
        ctx.chunk, ctx.clamp = L, clamp
        return y, hT

    @staticmethod
    @first_order
    def backward(ctx, dy, dhT):
        delta, v, A, B, C, starts = ctx.saved_tensors
        L, clamp = ctx.chunk, ctx.clamp
        sshape = starts.shape[1:]
        dy = delta.new_zeros(delta.shape) if dy is None else dy.contiguous()
        gh = delta.new_zeros(sshape) if dhT is None else dhT.clone()
        e, x, g = (delta.new_empty((L,) + sshape) for _ in range(3))
        es, xs, gs = e.unbind(0), x.unbind(0), g.unbind(0)
        ddelta, dv = delta.new_empty(delta.shape), delta.new_empty(delta.shape)
        dB, dC = B.new_empty(C.shape), C.new_empty(C.shape)  # both [T, B, G, 1, N]
        dA = A.new_zeros(A.shape)
        blocks = list(
            zip(
                delta.split(L),
                v.split(L),
                B.split(L),
                C.split(L),
                dy.split(L),
                ddelta.split(L),
                dv.split(L),
                dB.split(L),
                dC.split(L),
            )
        )
        for i in reversed(range(len(blocks))):
            db, vb, Bb, Cb, dyb, ddb, dvb, dBb, dCb = blocks[i]
            l = db.shape[0]
            ei, xi, gi = e[:l], x[:l], g[:l]
            _ChunkScan._block_states(db, vb, A, Bb, starts[i], clamp, ei, xi, es, xs)
            # g_t = ∂L/∂h_t: the direct part C_t dy_t, then the reverse scan through the decays
            torch.mul(Cb.transpose(-1, -2), dyb, out=gi)
            gs[l - 1].add_(gh)
            for j in range(l - 2, -1, -1):
                gs[j].addcmul_(es[j + 1], gs[j + 1])
            gh = es[0] * gs[0]
            torch.matmul(Bb.transpose(-1, -2), gi, out=dvb)
            torch.matmul(vb, gi.transpose(-1, -2), out=dBb)
            torch.matmul(dyb, xi.transpose(-1, -2), out=dCb)
            # w_t = ∂L/∂(Δ A)_t = g_t ⊙ exp(Δ_t A) ⊙ h_{t−1} (zero where the clamp was active)
            gi.mul_(ei)
            gi[1:].mul_(xi[:-1])
            gs[0].mul_(starts[i])
            if clamp:
                gi.masked_fill_(db * A < LOG_GATE_MIN, 0.0)
            dA += torch.mul(gi, db, out=ei).sum((0, 1))
            torch.sum(torch.mul(gi, A, out=ei), 3, keepdim=True, out=ddb)
        return ddelta, dv, dA, dB.transpose(-1, -2), dC, gh, None


def _auto_chunk(Bsz: int, D: int, N: int) -> int:
    """Block length whose ``[block, B, D, N]`` buffers hold about 128K numbers per CPU thread, so
    a block's working set stays in the per-core caches (measured: 16 tokens for ``B = 1``,
    ``D = 512``, ``N = 16`` on one thread, 32 on two)."""
    threads = 1 if torch.compiler.is_compiling() else torch.get_num_threads()  # (traced: not read)
    budget = 131072 * max(1, min(threads, 4))
    L = 4
    while L < 64 and 2 * L * Bsz * D * N <= budget:
        L *= 2
    return L


class _Saved:
    """A stand-in for ``ctx`` when :class:`_ChunkScan`'s forward and backward run as custom ops."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


@torch.library.custom_op("mnemo::selective_scan_blocks", mutates_args=())
def _scan_op(
    delta: torch.Tensor,
    v: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    h0: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:class:`_ChunkScan`'s forward as one opaque op for ``torch.compile``: ``(y, h_T, entry
    states)``, run eagerly (its ``out=`` writes into block views, which inductor mis-compiles,
    stay out of the graph, and the token loop is not unrolled into it)."""
    ctx = _Saved()
    y, hT = _ChunkScan.forward(ctx, delta, v, A, B, C, h0, chunk_size)
    return y, hT, ctx.saved_tensors[-1]


@_scan_op.register_fake
def _(delta, v, A, B, C, h0, chunk_size):
    nb = -(-delta.shape[0] // max(1, min(chunk_size, delta.shape[0])))
    return delta.new_empty(delta.shape), h0.new_empty(h0.shape), h0.new_empty((nb,) + h0.shape)


@torch.library.custom_op("mnemo::selective_scan_blocks_backward", mutates_args=())
def _scan_op_backward(
    dy: torch.Tensor,
    dhT: torch.Tensor,
    delta: torch.Tensor,
    v: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    starts: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:class:`_ChunkScan`'s backward as one opaque op: ``(dΔ, dv, dA, dB, dC, dh_0)``."""
    ctx = _Saved()
    ctx.save_for_backward(delta, v, A, B, C, starts)
    T = delta.shape[0]
    ctx.chunk = min(chunk_size, T)
    ctx.clamp = True  # as traced: a clamp that changes nothing is exact
    with torch.no_grad():
        grads = _ChunkScan.backward(ctx, dy, dhT)
    # fresh, contiguous outputs (as the fake kernel declares them; dB comes back as a transposed view)
    return tuple(g.clone() if any(g is t for t in (dy, dhT)) else g.contiguous() for g in grads[:6])


@_scan_op_backward.register_fake
def _(dy, dhT, delta, v, A, B, C, starts, chunk_size):
    return tuple(t.new_empty(t.shape) for t in (delta, v, A, B, C, starts[0]))


def _scan_op_setup(ctx, inputs, output):
    delta, v, A, B, C, _, chunk_size = inputs
    ctx.save_for_backward(delta, v, A, B, C, output[2])
    ctx.chunk_size = chunk_size


def _scan_op_grad(ctx, dy, dhT, _dstarts):
    delta, v, A, B, C, starts = ctx.saved_tensors
    dy = torch.zeros_like(delta) if dy is None else dy
    dhT = torch.zeros_like(starts[0]) if dhT is None else dhT
    return (*_scan_op_backward(dy, dhT, delta, v, A, B, C, starts, ctx.chunk_size), None)


_scan_op.register_autograd(_scan_op_grad, setup_context=_scan_op_setup)


def ss_chunk_torch(delta, u, A, B, C, h0, chunk_size):
    """Blocked form with the hand-written backward (:class:`_ChunkScan`), the PyTorch twin of the C
    kernel (:func:`ss_native`); public layout in and out. While ``torch.compile`` traces, the
    forward and the backward each enter the graph as one opaque custom op
    (``mnemo::selective_scan_blocks``), computed eagerly."""
    Bsz, T, D = u.shape
    G, N = B.shape[-2:]
    Dg = D // G
    if chunk_size is None:
        chunk_size = _auto_chunk(Bsz, D, N)
    v = delta * u
    d_, v_ = (rearrange(t, "b t (g d) -> t b g 1 d", g=G).contiguous() for t in (delta, v))
    B_ = rearrange(B, "b t g n -> t b g n 1").contiguous()
    C_ = rearrange(C, "b t g n -> t b g 1 n").contiguous()
    A_ = rearrange(A, "(g d) n -> g n d", g=G).contiguous()
    h0_ = rearrange(h0, "b (g d) n -> b g n d", g=G).contiguous()
    if torch.compiler.is_compiling():
        y, hT, _ = _scan_op(d_, v_, A_, B_, C_, h0_, int(chunk_size))
    else:
        y, hT = _ChunkScan.apply(d_, v_, A_, B_, C_, h0_, chunk_size)
    return rearrange(y, "t b g 1 d -> b t (g d)"), rearrange(hT, "b g n d -> b (g d) n", d=Dg)


_NATIVE_BLOCK = 16  # tokens per backward block: its [2 block + 1, N, W] buffer (33 KB at W=16) stays in L2


class _NativeScan(torch.autograd.Function):
    """The selective scan by the C kernel of :mod:`mnemo.ops._native` (CPU, float32/float64),
    with the step ``Δ = softplus(δ + bias)`` (or ``δ + bias``), ``v = Δ u``, the skip ``D u`` and
    the gate ``silu(z)`` fused in.

    Kernel layout (contiguous, channels zero-padded per group to a multiple of ``W`` so that a tile
    of ``W`` channels, one SIMD register of floats, never straddles two groups): ``delta, u, z:
    [B, T, Dp]``, ``At: [N, Dp]``, ``B, C: [B, T, G, N]``, ``h0: [B, N, Dp]``, ``bias, D: [Dp]``;
    ``Dgp`` channels per group. ``bias``, ``D`` and ``z`` may be ``None``. A tile keeps its
    ``[N, W]`` states in L1 for the whole sequence; the forward saves the state before every block
    of ``L`` tokens (``[B, ceil(T / L), N, Dp]``). The backward walks the blocks from the last,
    recomputes a block's states, decays, steps and pre-gate outputs from its saved state into a
    per-thread buffer (L2-sized) and runs the reverse scan through it, so nothing of size
    ``[T, D, N]`` is ever stored. ``dB``/``dC`` (sums over a group's channels) are accumulated per
    SIMD lane within a block and added up per thread; the threads' partial sums are added here.
    """

    @staticmethod
    def forward(ctx, delta, bias, u, At, B, C, h0, Dsk, z, Dgp: int, L: int, softplus: bool):
        Bsz, T, Dp = delta.shape
        G, N = B.shape[2], At.shape[0]
        W = _native.simd_width()  # channels per tile
        jobs = Bsz * Dp // W
        nt = _native.slots(jobs)
        y, hT = _workspace.empty(delta.shape, delta.dtype, delta.device), h0.new_empty(h0.shape)
        starts = _workspace.empty((Bsz, -(-T // L), N, Dp), delta.dtype, delta.device)
        work = delta.new_empty(nt, N, W)
        _native.call(
            "ss_fwd",
            delta.dtype,
            jobs,
            nt,
            [T, Dp, Dgp, G, N, L, delta, bias, int(softplus), u, At, B, C, h0, Dsk, z, y, hT, starts, work],
        )
        ctx.save_for_backward(delta, bias, u, At, B, C, starts, Dsk, z)
        ctx.Dgp, ctx.L, ctx.softplus = Dgp, L, softplus
        return y, hT

    @staticmethod
    @first_order
    def backward(ctx, dy, dhT):
        delta, bias, u, At, B, C, starts, Dsk, z = ctx.saved_tensors
        Bsz, T, Dp = delta.shape
        G, N, L = B.shape[2], At.shape[0], ctx.L
        W = _native.simd_width()
        jobs = Bsz * Dp // W
        nt = _native.slots(jobs)
        dy = delta.new_zeros(delta.shape) if dy is None else dy.contiguous()
        hshape = (Bsz, N, Dp)
        dhT = delta.new_zeros(hshape) if dhT is None else dhT.contiguous()
        ddelta, du = (_workspace.empty(delta.shape, delta.dtype, delta.device) for _ in range(2))
        dA, dh0 = delta.new_empty(hshape), delta.new_empty(hshape)
        dD = None if Dsk is None else delta.new_empty(Bsz, Dp)
        dz = None if z is None else _workspace.empty(delta.shape, delta.dtype, delta.device)
        # per-slot partial sums
        dB, dC = (_workspace.empty((nt,) + B.shape, B.dtype, B.device) for _ in range(2))
        per_slot = _native.query("ss_bwd_work", delta.dtype, jobs, nt, ctx.Dgp, N, L)  # scratch vectors
        work = delta.new_empty(nt, per_slot, W)
        _native.call(
            "ss_bwd",
            delta.dtype,
            jobs,
            nt,
            [Bsz, T, Dp, ctx.Dgp, G, N, L, delta, bias, int(ctx.softplus), u, At, B, C, starts, Dsk, z]
            + [dy, dhT, ddelta, du, dA, dD, dz, dB, dC, dh0, work, per_slot],
        )
        return (
            ddelta,
            None if bias is None else ddelta.sum((0, 1)),
            du,
            dA.sum(0),
            dB.sum(0),
            dC.sum(0),
            dh0,
            None if dD is None else dD.sum(0),
            dz,
            None,
            None,
            None,
        )


def _no_tensor(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """An absent gradient as a custom op may return it: an empty tensor (``None`` is not allowed)."""
    return like.new_empty(0) if t is None else t


@torch.library.custom_op("mnemo::selective_scan_native", mutates_args=())
def _native_op(
    delta: torch.Tensor,
    bias: torch.Tensor | None,
    u: torch.Tensor,
    At: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    h0: torch.Tensor,
    Dsk: torch.Tensor | None,
    z: torch.Tensor | None,
    Dgp: int,
    L: int,
    softplus: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:class:`_NativeScan`'s forward as one opaque op for ``torch.compile`` (a ctypes call cannot
    be traced): ``(y, h_T, block-entry states)``, all freshly allocated and contiguous."""
    ctx = _Saved()
    y, hT = _NativeScan.forward(ctx, delta, bias, u, At, B, C, h0, Dsk, z, Dgp, L, softplus)
    return y, hT, ctx.saved_tensors[6]


@_native_op.register_fake
def _(delta, bias, u, At, B, C, h0, Dsk, z, Dgp, L, softplus):
    Bsz, T, Dp = delta.shape
    nb = -(-T // L)
    return delta.new_empty(delta.shape), h0.new_empty(h0.shape), delta.new_empty((Bsz, nb, At.shape[0], Dp))


@torch.library.custom_op("mnemo::selective_scan_native_backward", mutates_args=())
def _native_op_backward(
    dy: torch.Tensor,
    dhT: torch.Tensor,
    delta: torch.Tensor,
    bias: torch.Tensor | None,
    u: torch.Tensor,
    At: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    starts: torch.Tensor,
    Dsk: torch.Tensor | None,
    z: torch.Tensor | None,
    Dgp: int,
    L: int,
    softplus: bool,
) -> tuple[
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
]:
    """:class:`_NativeScan`'s backward as one opaque op: ``(dδ, dbias, du, dAt, dB, dC, dh_0, dD,
    dz)``; the gradient of an absent ``bias``/``Dsk``/``z`` is an empty tensor."""
    ctx = _Saved()
    ctx.save_for_backward(delta, bias, u, At, B, C, starts, Dsk, z)
    ctx.Dgp, ctx.L, ctx.softplus = Dgp, L, softplus
    with torch.no_grad():
        g = _NativeScan.backward(ctx, dy, dhT)
    return tuple(_no_tensor(d, delta) for d in g[:9])


@_native_op_backward.register_fake
def _(dy, dhT, delta, bias, u, At, B, C, starts, Dsk, z, Dgp, L, softplus):
    Bsz, _, N, Dp = starts.shape
    like = (delta, bias, u, At, B, C, None, Dsk, z)
    out = [delta.new_empty(0) if t is None else t.new_empty(t.shape) for t in like]
    out[6] = delta.new_empty((Bsz, N, Dp))
    return tuple(out)


def _native_op_setup(ctx, inputs, output):
    delta, bias, u, At, B, C, _, Dsk, z, Dgp, L, softplus = inputs
    ctx.save_for_backward(delta, bias, u, At, B, C, output[2], Dsk, z)
    ctx.Dgp, ctx.L, ctx.softplus = Dgp, L, softplus


def _native_op_grad(ctx, dy, dhT, _dstarts):
    delta, bias, u, At, B, C, starts, Dsk, z = ctx.saved_tensors
    dy = torch.zeros_like(delta) if dy is None else dy
    dhT = torch.zeros_like(starts[:, 0]) if dhT is None else dhT
    g = _native_op_backward(dy, dhT, delta, bias, u, At, B, C, starts, Dsk, z, ctx.Dgp, ctx.L, ctx.softplus)
    given = (delta, bias, u, At, B, C, starts, Dsk, z)  # an empty gradient: the input was None
    return (*(None if t is None else d for d, t in zip(g, given)), None, None, None)


_native_op.register_autograd(_native_op_grad, setup_context=_native_op_setup)


def ss_native(
    delta, u, A, B, C, h0, chunk_size: int | None = None, D=None, z=None, delta_bias=None, softplus=False
):
    """The C-kernel form (see :class:`_NativeScan`); public layout in and out. ``delta`` is the raw
    step: ``Δ = softplus(delta + delta_bias)`` if ``softplus``, else ``delta + delta_bias``
    (``delta_bias`` may be ``None``; default ``softplus=False``). With ``D`` / ``z`` the returned
    ``y`` already includes the skip ``D u`` and the gate ``silu(z)``."""
    Bsz, T, Dm = u.shape
    G = B.shape[2]
    Dg = Dm // G
    pad = -Dg % _native._lanes()  # (a plain global read when traced: see _native.usable_opaque)

    def chan(x, pattern):  # split the channel axis by group and zero-pad each group to Dgp
        x = rearrange(x, pattern, g=G)
        return F.pad(x, (0, pad)) if pad else x

    def tokens(x):
        return (
            None
            if x is None
            else rearrange(chan(x, "b t (g d) -> b t g d"), "b t g d -> b t (g d)").contiguous()
        )

    def per_channel(x):
        return None if x is None else rearrange(chan(x, "(g d) -> g d"), "g d -> (g d)").contiguous()

    At = rearrange(chan(A, "(g d) n -> n g d"), "n g d -> n (g d)").contiguous()
    h0_ = rearrange(chan(h0, "b (g d) n -> b n g d"), "b n g d -> b n (g d)").contiguous()
    args = (
        tokens(delta),
        per_channel(delta_bias),
        tokens(u),
        At,
        B.contiguous(),
        C.contiguous(),
        h0_,
        per_channel(D),
        tokens(z),
        Dg + pad,
        max(1, min(chunk_size or _NATIVE_BLOCK, T)),  # a block longer than T only costs memory
        bool(softplus),
    )
    if torch.compiler.is_compiling():
        y, hT, _ = _native_op(*args)  # (the block-entry states are for the backward)
    else:
        y, hT = _NativeScan.apply(*args)
    y = rearrange(y, "b t (g d) -> b t g d", g=G)[..., :Dg]
    hT = rearrange(hT, "b n (g d) -> b g d n", g=G)[:, :, :Dg]
    return rearrange(y, "b t g d -> b t (g d)"), rearrange(hT, "b g d n -> b (g d) n")


def _native_ok(*tensors: torch.Tensor) -> bool:
    """Whether the C kernel runs on these tensors: eagerly through :class:`_NativeScan`
    (:func:`_native.usable`), and while ``torch.compile`` traces as the opaque custom ops
    ``mnemo::selective_scan_native`` / ``..._backward`` (:func:`_native.usable_opaque`); never under
    ``torch.func`` transforms or forward-mode AD (:class:`_NativeScan` has no ``jvp``/``vmap`` rule)."""
    if transformed(*tensors):
        return False
    if torch.compiler.is_compiling():
        return _native.usable_opaque(*tensors)
    return _native.usable(*tensors)


def ss_chunk(delta, u, A, B, C, h0, chunk_size):
    """The chunk form: the C kernel (:func:`ss_native`) where it can run, else its PyTorch twin
    :func:`ss_chunk_torch`. Under ``torch.func`` transforms (``vmap``, ``jvp``, ``grad``) and
    forward-mode AD, which neither ``autograd.Function`` supports, the token loop
    :func:`ss_recurrent` (same function, differentiated by autograd)."""
    if transformed(delta, u, A, B, C, h0):
        return ss_recurrent(delta, u, A, B, C, h0)
    if _native_ok(delta, u, A, B, C, h0):
        return ss_native(delta, u, A, B, C, h0, chunk_size)
    return ss_chunk_torch(delta, u, A, B, C, h0, chunk_size)


def run_ss_core(delta, u, A, B, C, h0, mode: str, chunk_size: int):
    r"""One form of the scan; every form with an enclosing autocast off (the parallel form's
    matmuls would otherwise run in bf16), as the chunk ``Function``\ s do themselves."""
    if u.numel() == 0 or A.shape[-1] == 0:  # nothing to scan (T, B or D is 0), or no state (N = 0)
        return u.new_zeros(u.shape), h0
    with autocast_disabled(u.device.type):
        if mode == "chunk":
            return ss_chunk(delta, u, A, B, C, h0, chunk_size)
        if mode == "parallel":
            return ss_parallel(delta, u, A, B, C, h0)
        return ss_recurrent(delta, u, A, B, C, h0)


# ----------------------------------------------------------------------------------------------
# public op
# ----------------------------------------------------------------------------------------------


def selective_scan(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    *,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    mode: str = "chunk",
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Selective scan (Mamba / S6; Gu & Dao 2023, "Mamba: Linear-Time Sequence Modeling with
    Selective State Spaces", Alg. 2), time-major.

        Δ_t = softplus(δ_t + δ_bias) if delta_softplus else δ_t + δ_bias
        h_t = exp(Δ_t A) ⊙ h_{t−1} + Δ_t B_t u_t        y_t = C_t h_t + D ⊙ u_t
        y_t ← y_t ⊙ silu(z_t)                                   (if z is given)

    with ``h_t[d, n]``, decay ``exp(Δ_{t,d} A_{d,n})``, input ``Δ_{t,d} B_{t,g(d),n} u_{t,d}`` and
    read-out ``Σ_n C_{t,g(d),n} h_t[d, n]``, where channel ``d`` uses group ``g(d) = d // (D / G)``.

    Args:
        u: ``[B, T, D]`` input. delta: ``[B, T, D]`` step size ``δ`` (before bias / softplus).
        A: ``[D, N]`` state matrix (diagonal per channel), real, typically negative
            (``A = −exp(A_log)``). ``Δ A`` is clamped from below at ``-60``.
        B, C: ``[B, T, N]`` (one group) or ``[B, T, G, N]`` with ``D % G == 0``, the same ``G`` for both.
        D: ``[D]`` skip connection, or ``None``. z: ``[B, T, D]`` output gate, or ``None``.
        delta_bias: ``[D]`` added to ``δ``, or ``None``. delta_softplus: apply softplus to get Δ.
            Defaults: ``delta_softplus=False``, ``output_final_state=False``.
        initial_state: ``[B, D, N]`` (``[num_seqs, D, N]`` with ``cu_seqlens``); any float dtype,
            used in the compute dtype. Gradients flow into it and into every input.
        output_final_state: also return the state after the last token.
        cu_seqlens: ``[num_seqs + 1]`` int offsets of sequences packed in ``B = 1``; the state is
            reset (to the matching row of ``initial_state``) at every boundary. Padding inside uses
            ``Δ = 0`` (applied after the bias / softplus), which leaves the state unchanged.
        mode: ``"chunk"`` (training, default; the C kernel on the CPU when it is available,
            see the module docstring) | ``"recurrent"`` (token-loop reference) |
            ``"parallel"`` (quadratic ``[B, D, T, T]`` implicit-attention form; short sequences and
            analysis only). All three give the same result.
        chunk_size: block length of the chunk form (the tokens whose states the backward
            recomputes from one saved state); ``None`` picks 16 for the C kernel and, for the
            PyTorch form, a block whose ``[block, B, D, N]`` buffers hold about 128K numbers per
            CPU thread, so each block's work stays in cache (16 tokens for ``B = 1, D = 512,
            N = 16`` on one thread; measured fastest on CPU).

    Returns:
        ``y: [B, T, D]`` in ``u``'s dtype, and ``final_state: [B, D, N]`` (``[num_seqs, D, N]``
        with ``cu_seqlens``) in the compute dtype (float64 if any input is float64, else float32;
        bf16/fp16 inputs accumulate in float32), or ``None``. ``T = 0`` passes the state through.

    Raises:
        ValueError / TypeError: a shape, dtype, mode or chunk size does not match; the message
            names the argument, the expected and the received value.
    """
    check_form(mode, chunk_size, chunk_size_optional=True)
    check_ndim("u", u, 3, "[B, T, D]")
    Bsz, T, Dm = u.shape
    check_shape("delta", delta, (Bsz, T, Dm), "[B, T, D]")
    check_ndim("A", A, 2, "[D, N]")
    if A.shape[0] != Dm:
        raise ValueError(f"A must have shape [D, N] = [{Dm}, N], got {_shape(A)}")
    N = A.shape[1]
    B4 = check_groups("B", B, Bsz, T, N, Dm, "D")
    C4 = check_groups("C", C, Bsz, T, N, Dm, "D")
    if C4.shape[2] != B4.shape[2]:  # (the chunk forms read one group index for both)
        raise ValueError(f"C must have the same number of groups as B = {B4.shape[2]}, got {_shape(C)}")
    if D is not None:
        check_shape("D", D, (Dm,), "[D]")
    if z is not None:
        check_shape("z", z, (Bsz, T, Dm), "[B, T, D]")
    if delta_bias is not None:
        check_shape("delta_bias", delta_bias, (Dm,), "[D]")
    nseq = num_sequences(cu_seqlens, Bsz, T)
    check_initial_state(initial_state, (nseq, Dm, N), "D, N", varlen=cu_seqlens is not None, seqs="num_seqs")
    check_finite(
        {
            "u": u,
            "delta": delta,
            "A": A,
            "B": B,
            "C": C,
            "D": D,
            "z": z,
            "delta_bias": delta_bias,
            "initial_state": initial_state,
        }
    )
    check_sign("A", A, "<= 0", "the decay exp(delta * A) must be at most 1 (A = -exp(A_log))")
    if not delta_softplus:  # softplus makes any value a valid step
        check_sign(
            "delta" if delta_bias is None else "delta + delta_bias",
            delta if delta_bias is None else delta + delta_bias,
            ">= 0",
            "a step size is not negative (pass delta_softplus=True to map any value there)",
        )
    cd = compute_dtype(u, delta, A, B, C, D, z, delta_bias, initial_state)
    uc, Ac, Bc, Cc = u.to(cd), A.to(cd), B4.to(cd), C4.to(cd)
    dt = delta.to(cd)
    bias = None if delta_bias is None else delta_bias.to(cd)
    h0 = state_or_zeros(initial_state, (nseq, Dm, N), cd, u)
    Dc = None if D is None else D.to(cd)
    zc = None if z is None else z.to(cd)
    if mode == "chunk" and cu_seqlens is None and T > 0 and _native_ok(dt, uc, Ac, Bc, Cc, h0):
        # the C kernel forms the step and applies the skip and the gate itself (one pass, not six)
        y, h = ss_native(
            dt, uc, Ac, Bc, Cc, h0, chunk_size, D=Dc, z=zc, delta_bias=bias, softplus=delta_softplus
        )
        return y.to(u.dtype), (h if output_final_state else None)
    if bias is not None:
        dt = dt + bias
    if delta_softplus:
        dt = F.softplus(dt)
    if cu_seqlens is None:
        y, h = run_ss_core(dt, uc, Ac, Bc, Cc, h0, mode, chunk_size)
    else:

        def fn(delta, u, B, C):
            return run_ss_core(delta, u, Ac, B, C, h0, mode, chunk_size)

        y, h = run_varlen(fn, cu_seqlens, {"delta": dt, "u": uc, "B": Bc, "C": Cc})
    if Dc is not None:
        y = y + uc * Dc
    if zc is not None:
        y = y * F.silu(zc)
    return y.to(u.dtype), (h if output_final_state else None)


def selective_scan_map(delta, A, B, C) -> torch.Tensor:
    """The ``T × T`` matrix of the selective scan per channel ``d`` (Mamba), from a zero state and
    without the ``D`` skip: ``M^(d)_ts = Σ_n C_tn exp(Σ_{r=s+1..t} Δ_rd A_dn) B_sn Δ_sd`` for
    ``s ≤ t``, so that ``y_d = M^(d) u_d``. ``delta [Bt, T, D]`` (after softplus and bias),
    ``A [D, N]``, ``B, C [Bt, T, N]`` or, as the op takes them, ``[Bt, T, G, N]`` (channel ``d``
    reads group ``d // (D / G)``). Returns ``[Bt, D, T, T]``."""
    Bt, T, Dm = delta.shape
    N = A.shape[-1]
    Bd = _per_channel(check_groups("B", B, Bt, T, N, Dm, "D"), Dm)  # [Bt, T, D, N]
    Cd = _per_channel(check_groups("C", C, Bt, T, N, Dm, "D"), Dm)
    # (the cumulative sum and its differences in float64, rounded once: see decay_matrix)
    L = torch.einsum("btd,dn->bdnt", delta, A).clamp(min=-60.0).to(torch.float64).cumsum(-1)  # [Bt,D,N,T]
    mask = causal_mask(T, delta.device)
    diff = (L[..., :, None] - L[..., None, :]).to(delta.dtype)
    decay = diff.masked_fill(~mask, float("-inf")).exp()  # [Bt, D, N, T, T]
    M = torch.einsum("btdn,bdnts,bsdn->bdts", Cd, decay, Bd)
    return M * rearrange(delta, "b s d -> b d 1 s")
