"""The chunk form of SSD (Mamba-2) with grouped ``B``/``C`` and a hand-written backward, safe for any
decay (Dao & Gu 2024, "Transformers are SSMs", §6: the chunkwise SSD algorithm).

Per head ``h`` (reading group ``γ = h // (H / G)`` of ``B`` and ``C``):

    S_t = exp(g_t) S_{t−1} + k_t v_tᵀ          o_t = S_tᵀ q_t          (q = C_γ, k = B_γ)

Within a chunk of ``C`` tokens let ``b_t = Σ_{u ≤ t} g_u`` (the inclusive within-chunk cumulative
log gate) and ``b_L`` its value at the chunk's last token. With the state ``S_i`` entering chunk
``i``, the chunkwise SSD algorithm (§6: the diagonal blocks, the chunk states, the state passing
and the state-to-output blocks) is

    M = C Bᵀ (one ``[C, C]`` score matrix per group)     L_ts = exp(b_t − b_s) for s ≤ t, else 0
    A_h = M ⊙ L_h                                         o = A_h v + (C ⊙ e^{b}) S_i
    S_{i+1} = e^{b_L} S_i + (B ⊙ e^{b_L − b})ᵀ v

Why any decay is safe: ``g ≤ 0`` makes ``b`` non-increasing, so every factor ``e^{b_t − b_s}``
(``s ≤ t``), ``e^{b_t}``, ``e^{b_L − b_s}`` and ``e^{b_L}`` is at most ``1``; nothing is ever
divided by a decay (unlike the row-scaling factorisation ``(q e^{b})(k e^{−b})ᵀ``, which overflows
beyond ~80 nats in float32). Factors below ``exp(FLUSH_LOG) = e^{−40}`` are flushed so no
subnormal number reaches a matmul (subnormals are many times slower on CPUs): the per-token factors
``e^{b}``, ``e^{b_L − b}``, ``e^{b_L}`` become exactly ``0`` there (as :func:`~._common.decay_exp`),
the ``[C, C]`` factors ``L`` are floored at ``e^{−40}`` (one pass fewer over ``[C, C]``); each
changed term moves by less than ``4e-18`` times the same term undecayed, below float64's rounding.
Entries above the diagonal may overflow to ``inf`` before the ``tril`` that zeroes them (a write,
never a product, so no ``inf · 0``). (Positive log gates, a growing state, are computed as well,
without the ``≤ 1`` bound: they overflow where the recurrence itself does.)

Cost: ``B`` and ``C`` are never repeated over heads. The ``[C, C]`` scores ``C Bᵀ`` are one matmul
per group and chunk; the per-head work is the decay matrix ``L_h`` (one ``exp`` over ``[C, C]``),
its product with the scores, and the ``[C, C] × [C, P]`` matmuls with ``v`` / ``dO``. The
products with the states (``C S_i``, ``Bᵀ v``, ``Cᵀ dO``, ``B G``, and ``dC``, ``dB``) run once per
group with the group's heads side by side, ``[C, N] @ [N, r·P]``, the per-token decays applied
on the ``P``-wide per-head side. The backward pass is written out (no autograd graph through
``[C, C]`` tensors); saved for it: ``L_h``, ``A_h``, the chunk states and ``O(T·(N + P))`` per
head.
"""

from __future__ import annotations

import torch

from . import _workspace
from ._chunked import (
    autocast_off,
    b3,
    mm,
    mm_add_,
    native_as_in_forward,
    rev_cumsum,
    rowdot,
    scan_decay_,
    scan_decay_reverse_,
    to_chunks,
)
from ._common import (
    FLUSH_LOG,
    _flush_at,
    check_finite,
    clamp_log_gate,
    compute_dtype,
    first_order,
    state_or_zeros,
)

__all__ = ["run_ssd_chunk", "ssd_chunk"]


def _flushed_exp(x: torch.Tensor) -> torch.Tensor:
    """``exp(x)`` with factors at or below ``e^{FLUSH_LOG}`` flushed to ``0`` (a new tensor; the
    others exact): ``exp(max(x, FLUSH_LOG))``, thresholded at ``e^{FLUSH_LOG}``."""
    return torch.nn.functional.threshold_(x.clamp_min(FLUSH_LOG).exp_(), _flush_at(x.dtype), 0.0)


def _group_sum(x: torch.Tensor, G: int) -> torch.Tensor:
    """``[B, H, ...]`` → ``[B, G, ...]``: the sum over the ``H / G`` heads of each group (a view for
    ``G = H``)."""
    B, H = x.shape[:2]
    if G == H:
        return x
    return x.view(B, G, H // G, *x.shape[2:]).sum(2)


def _per_head(xg: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """``xg [B, G, ...]`` (one per group) times ``f [B, H, ...]`` (one per head) → ``[B, H, ...]``
    in one pass, the group's tensor broadcast over its heads (never copied per head)."""
    B, G = xg.shape[:2]
    H = f.shape[1]
    fg = f.view(B, G, H // G, *f.shape[2:])
    if torch.compiler.is_compiling():  # functional while traced (no out= into a view)
        return torch.mul(xg[:, :, None], fg).view(B, H, *xg.shape[2:])
    out = _workspace.empty((B, H, *xg.shape[2:]), xg.dtype, xg.device)
    torch.mul(xg[:, :, None], fg, out=out.view(B, G, H // G, *xg.shape[2:]))
    return out


def _copy_scaled(src: torch.Tensor, f: torch.Tensor | None) -> torch.Tensor:
    """``src`` (a permuted view) copied into a new contiguous tensor of its shape, times ``f``
    (broadcast) if given, in one pass."""
    if torch.compiler.is_compiling():  # functional: inductor gives an ``out=`` result src's strides
        y = src if f is None else (src * f).to(src.dtype)  # (eager's out= keeps src's dtype too)
        return y.clone(memory_format=torch.contiguous_format)
    out = _workspace.empty(src.shape, src.dtype, src.device)
    return out.copy_(src) if f is None else torch.mul(src, f, out=out)


def _stack(x: torch.Tensor, G: int, f: torch.Tensor | None = None) -> torch.Tensor:
    """Per head ``x [B, H, n, X, P]`` (times ``f [B, H, n, X, 1]`` if given) → ``[B, G, n, X, r·P]``:
    the ``r = H / G`` heads of a group side by side along the last dim, in one pass. A group's
    shared ``B`` or ``C`` then meets all its heads in one matmul, ``[C, N] @ [N, r·P]``, instead
    of being repeated per head."""
    B, H, n, X, P = x.shape
    r = H // G
    if r == 1 and f is None:
        return x.view(B, G, n, X, P)
    src = x.view(B, G, r, n, X, P).permute(0, 1, 3, 4, 2, 5)
    fs = None if f is None else f.view(B, G, r, n, X, 1).permute(0, 1, 3, 4, 2, 5)
    return _copy_scaled(src, fs).view(B, G, n, X, r * P)


def _unstack(y: torch.Tensor, H: int, f: torch.Tensor | None = None) -> torch.Tensor:
    """The inverse of :func:`_stack`: ``[B, G, n, X, r·P]`` → per head ``[B, H, n, X, P]``
    (contiguous, a new tensor unless ``r = 1`` and no ``f``), times ``f [B, H, n, X, 1]`` if given."""
    B, G, n, X, rP = y.shape
    r = H // G
    P = rP // r
    if r == 1 and f is None:
        return y.view(B, H, n, X, P)
    src = y.view(B, G, n, X, r, P).permute(0, 1, 4, 2, 3, 5)
    return _copy_scaled(src, None if f is None else f.view(B, G, r, n, X, 1)).view(B, H, n, X, P)


class _SSDChunk(torch.autograd.Function):
    """The chunk form above with a hand-written backward (module docstring for the equations).

    Inputs (in the compute dtype, float32 or float64; ``S0``'s dtype is the compute dtype):
    ``Cg, Bg: [B, T, G, N]``, ``v: [B, T, H, P]``, ``g: [B, T, H]`` (log gates, clamped by the caller),
    ``S0: [B, H, N, P]``, chunk length ``C``. Returns ``o [B, T, H, P]`` (a transposed view) and the
    final state ``[B, H, N, P]``. ``T`` is padded to ``n · C`` (``g = 0``, ``B = C = v = 0``: the
    padding leaves the state unchanged).

    ``B`` and ``C`` are never formed per head: the scores ``M = C Bᵀ`` are one matmul per group, and
    the inter-chunk products run per group on the group's heads side by side (:func:`_stack`), with
    the per-token decays applied to the ``P``-wide per-head side: ``q̃ S_i = e^{b} ⊙ (C S_i)``,
    ``k̃ᵀ v = Bᵀ (e^{b_L − b} ⊙ v)``, where ``q̃ = C ⊙ e^{b}``, ``k̃ = B ⊙ e^{b_L − b}``.

    Backward (per chunk; ``G_{i+1} = ∂L/∂S_{i+1}`` from the reverse state scan
    ``G_i = e^{b_L} G_{i+1} + q̃ᵀ dO``):

        dA_h = dO vᵀ      X_h = dA_h ⊙ L_h      dM = Σ_{h ∈ γ} X_h
        dC = dM B + Σ_h (e^{b} ⊙ dO) S_iᵀ       dB = dMᵀ C + Σ_h (e^{b_L − b} ⊙ v) G_{i+1}ᵀ
        dv = A_hᵀ dO + k̃ G_{i+1}
        ∂L/∂b_t = Σ_s Z_ts − Σ_s Z_st + dO_t · (q̃ S_i)_t − v_t · (k̃ G_{i+1})_t + [t = last] ⟨G_{i+1}, S_{i+1}⟩
        dg_t = Σ_{u ≥ t} ∂L/∂b_u (within the chunk)

    with ``Z = dA_h ⊙ A_h = X_h ⊙ M`` (``∂A_ts/∂b_t = A_ts``, ``∂A_ts/∂b_s = −A_ts``). The middle
    terms are ``q̃_t·∂L/∂q̃_t`` and ``k̃_t·∂L/∂k̃_t`` written with the ``P``-wide products the other
    gradients need anyway (``∂L/∂q̃ = dO S_iᵀ``, so ``q̃_t·∂L/∂q̃_t = dO_t·(q̃ S_i)_t``; likewise for
    ``k̃``). The last term gathers both uses of ``b_L``: ``e^{b_L}`` scaling ``S_i`` and
    ``e^{b_L − b_s}`` in ``k̃``, whose sum is ``⟨G_{i+1}, e^{b_L} S_i + k̃ᵀ v⟩ = ⟨G_{i+1}, S_{i+1}⟩``.
    """

    @staticmethod
    @autocast_off
    @native_as_in_forward
    def forward(ctx, Cg, Bg, v, g, S0, C):
        cd, T = S0.dtype, v.shape[1]
        G, H = Cg.shape[2], v.shape[2]
        b = to_chunks(g, C, cd).cumsum_(-2)  # [B, H, n, C, 1]
        b_last = b[..., -1:, :]  # [B, H, n, 1, 1]
        u, w, lam = _flushed_exp(b), _flushed_exp(b_last - b), _flushed_exp(b_last)
        Cc, Bc, vc = to_chunks(Cg, C, cd), to_chunks(Bg, C, cd), to_chunks(v, C, cd)
        M = mm(Cc, Bc.mT)  # [B, G, n, C, C], once per group
        bt = b[..., 0]
        traced = torch.compiler.is_compiling()  # then functional ops (no out=), as before the cache
        L = None if traced else _workspace.empty((*bt.shape, bt.shape[-1]), cd, bt.device)
        L = torch.sub(bt[..., :, None], bt[..., None, :], out=L).clamp_min_(FLUSH_LOG).exp_().tril_()
        A = _per_head(M, L)
        wv = _stack(vc, G, w)  # e^{b_L − b} ⊙ v, heads side by side: [B, G, n, C, r·P]
        states, S = scan_decay_(S0, _unstack(mm(Bc.mT, wv), H), lam)  # k̃ᵀ v per head
        Ss = _stack(states, G)  # [B, G, n, N, r·P]
        o_in = _unstack(mm(Cc, Ss), H, u)  # q̃ S_i = e^{b} ⊙ (C S_i)
        if traced:
            o = torch.baddbmm(b3(o_in), b3(A), b3(vc)).view(o_in.shape)
        else:
            o = _workspace.empty(o_in.shape, cd, o_in.device)
            torch.baddbmm(b3(o_in), b3(A), b3(vc), out=b3(o))
        ctx.save_for_backward(Cc, Bc, vc, wv, u, w, lam, M, L, A, states, Ss, S, o_in)
        ctx.meta = (T, C, G, *((x.shape, x.dtype) for x in (Cg, Bg, v, g)))
        return o.view(*o.shape[:2], -1, o.shape[-1])[:, :, :T].transpose(1, 2), S

    @staticmethod
    @first_order
    @autocast_off
    @native_as_in_forward
    def backward(ctx, dO, dSf):
        Cc, Bc, vc, wv, u, w, lam, M, L, A, states, Ss, S, o_in = ctx.saved_tensors
        T, C, G, *likes = ctx.meta
        cd = S.dtype
        B, H, n = vc.shape[:3]
        dOc = to_chunks(dO, C, cd)
        want_dg = ctx.needs_input_grad[3]
        udo = _stack(dOc, G, u)  # e^{b} ⊙ dO, heads side by side
        # Gs[:, :, i] = G_{i+1}; dots = Σ_P G_{i+1} ⊙ S_{i+1} (the gradient of b_L, summed over N below)
        Gs, dS0, dots = scan_decay_reverse_(
            dSf.to(cd), _unstack(mm(Cc.mT, udo), H), lam, dots_with=(states, S) if want_dg else None
        )
        Gst = _stack(Gs, G)
        dvc = _unstack(mm(Bc, Gst), H, w)  # k̃ G_{i+1}
        db = None
        if want_dg:
            db = rowdot(dOc, o_in).sub_(rowdot(vc, dvc))  # q̃·∂q̃ − k̃·∂k̃ (see the class docstring)
        mm_add_(dvc, A.mT, dOc)
        dCc, dBc = mm(udo, Ss.mT), mm(wv, Gst.mT)  # the inter-chunk parts, summed over each group's heads
        X = mm(dOc, vc.mT).mul_(L)  # dA ⊙ L (L is lower triangular)
        dM = _group_sum(X, G)
        mm_add_(dCc, dM, Bc)
        mm_add_(dBc, dM.mT, Cc)
        dg = None
        if want_dg:
            Z = X.view(B, G, H // G, n, C, C).mul_(M[:, :, None]).view(B, H, n, C, C)  # dA ⊙ A
            db.add_(Z.sum(-1)).sub_(Z.sum(-2))
            db[..., -1] += dots.sum(-1)
            dg = rev_cumsum(db, -1).view(B, H, n * C)[:, :, :T].transpose(1, 2)
            dg = dg.to(likes[3][1])
        dC, dB, dv = (
            x.view(x.shape[0], x.shape[1], -1, x.shape[-1])[:, :, :T].transpose(1, 2).to(like[1])
            for x, like in zip((dCc, dBc, dvc), likes[:3])
        )
        return dC, dB, dv, dg, dS0, None


def ssd_chunk(Cg, Bg, v, g, S0, chunk_size: int):
    """SSD's chunk form (see the module docstring): ``o_t = S_tᵀ C_t`` with
    ``S_t = exp(g_t) S_{t−1} + B_t v_tᵀ`` per head, ``B``/``C`` per group.

    Args:
        Cg, Bg: ``[B, T, G, N]``, head ``h`` reading group ``h // (H / G)`` (not repeated per head).
        v: ``[B, T, H, P]`` (``dt · x`` for Mamba-2). g: ``[B, T, H]`` log gates (``dt · A``), already
            clamped; any magnitude is safe (module docstring).
        S0: ``[B, H, N, P]`` in the compute dtype (float32, or float64 for float64 inputs); the
            other inputs are cast to it.
        chunk_size: chunk length (clipped to ``T``).

    Returns:
        ``o [B, T, H, P]`` and the final state ``[B, H, N, P]``, both in the compute dtype.
    """
    T = v.shape[1]
    if T == 0:
        return v.new_zeros(v.shape, dtype=S0.dtype), S0
    return _SSDChunk.apply(Cg, Bg, v, g, S0, min(int(chunk_size), T))


def run_ssd_chunk(Cg, Bg, v, g, initial_state, chunk_size: int):
    """:func:`ssd_chunk` behind the prologue the public ops share: NaN/inf input checks
    (:func:`~._common.check_finite`; ``g`` is a log gate, ``-inf`` allowed), the compute dtype
    (:func:`~._common.compute_dtype`: float64 if any input is, else float32), ``g`` clamped at
    :data:`~._common.LOG_GATE_MIN` in it, and the initial state (or zeros) in it.

    ``Cg, Bg: [B, T, G, N]``, ``v: [B, T, H, P]``, ``g: [B, T, H]``, ``initial_state``:
    ``[B, H, N, P]`` or ``None``. Returns ``o [B, T, H, P]`` and the final state, in the compute dtype.
    """
    check_finite({"C": Cg, "B": Bg, "v": v, "initial_state": initial_state}, {"g": g})
    cd = compute_dtype(Cg, Bg, v, g, initial_state)
    Bsz, _, H, P = v.shape
    S0 = state_or_zeros(initial_state, (Bsz, H, Cg.shape[-1], P), cd, v)
    return ssd_chunk(Cg.to(cd), Bg.to(cd), v.to(cd), clamp_log_gate(g.to(cd)), S0, chunk_size)
