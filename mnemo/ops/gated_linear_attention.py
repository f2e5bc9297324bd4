"""Gated linear attention: a matrix memory with multiplicative decay (RetNet, GLA, Mamba-2 style).

    S_t = diag(exp(g_t)) · S_{t-1} + k_t v_tᵀ          o_t = S_tᵀ (scale · q_t)

``g`` is the log decay, either one value per head (``[B, T, H]``: RetNet when constant, Mamba-2 when
data-dependent) or one per key channel (``[B, T, H, K]``: GLA, Yang et al. 2023, Eq. 3). With
``g = None`` it is plain (un-normalised) linear attention, Katharopoulos et al. 2020.

The three forms below compute exactly the same function:

* ``recurrent`` — the token loop, the reference definition.
* ``parallel``  — the quadratic masked form ``o = (Q Kᵀ ⊙ D) V + (Q ⊙ exp(b)) S_0`` with
  ``D_ts = exp(b_t − b_s)`` for ``s ≤ t``, where ``b`` is the cumulative sum of the log gates.
* ``chunk``     — chunkwise parallel: the intra-chunk part of all chunks at once as batched
  ``[C, C]`` matmuls, the inter-chunk part as one state pass over ``n = T / C`` chunk states.
  While no chunk decays by more than 30 nats (``_SAFE_SPAN``, the usual case) the decays factor
  as row scalings ``q ⊙ e^b``, ``k ⊙ e^{−b}`` (exact in fp32: every factor within ``e^{±30}``)
  and :class:`_GLAChunk` runs the whole form, with a hand-written backward pass, for scalar,
  per-channel and no gates alike; a chunk that decays by more is halved first, down to 16 tokens,
  until none does (:func:`~._chunked.chunks_within_span`). Past that :func:`gla_chunk_autograd`
  (gradients by autograd) forms scalar decays as ``exp`` of *differences* of cumulative log
  gates, masked before the ``exp`` so every factor is ``≤ 1``, and per-channel decays by a
  two-level split of each chunk whose factors are all ``≤ 1`` (see
  :func:`_intra_chunk_channel_scores`), so long chunks and extreme gates (hard resets) cannot
  overflow.
"""

from __future__ import annotations

import torch

from . import _workspace
from . import dispatch as _backends
from ._chunked import (
    autocast_disabled,
    autocast_off,
    chunks_within_span,
    head_groups,
    mm,
    mm_add_,
    native_as_in_forward,
    raw_empty,
    rev_cumsum_rows,
    scan_decay_,
    scan_decay_reverse_,
    to_chunks,
    unchunk,
    unchunk_heads,
)
from ._common import (
    avoid_host_reads,
    causal_mask,
    check_floating,
    check_initial_state,
    check_matrix_op,
    decay_exp,
    decay_matrix,
    default_scale,
    first_order,
    run_matrix_op,
    transformed,
)
from ._layout import rearrange

__all__ = ["gated_linear_attention", "gated_linear_attention_map"]

_SUB_BLOCK = 16
#: Largest decay (in nats) a factorised score may span; ``exp(±30) ≈ 1e±13`` stays far inside fp32.
_SAFE_SPAN = 30.0


# ----------------------------------------------------------------------------------------------
# cores: inputs already validated, in the compute dtype, q already scaled, g clamped (or None)
# ----------------------------------------------------------------------------------------------


def gla_recurrent(q, k, v, g, S0):
    """Token loop. ``q, k: [B,T,H,K]``, ``v: [B,T,H,V]``, ``g``: None | [B,T,H] | [B,T,H,K]."""
    S = S0
    outs = []
    for t in range(q.shape[1]):
        if g is not None:
            a = g[:, t].exp()
            S = S * (a[..., None, None] if a.ndim == 2 else a[..., None])
        S = S + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append((q[:, t, :, None, :] @ S)[:, :, 0])  # Sᵀ q per head (a matmul: cheaper than einsum)
    return torch.stack(outs, 1), S


def gla_parallel(q, k, v, g, S0):
    """Quadratic masked form over the whole sequence (per-channel gates: a [T, T, K] tensor).

    The cumulative log gate ``b`` and its differences ``b_t − b_s`` are formed in float64 even for
    float32 inputs (then rounded once): summed in float32, ``b`` over a long sequence reaches
    hundreds of nats and each difference inherits ``|b| · 2^-24`` of error, a relative error of
    ``~1e-5`` in the output at ``T = 2048`` with gates of ``≈ -0.5`` (now ``~3e-7``, as the token loop)."""
    T = q.shape[1]
    mask = causal_mask(T, q.device)
    qh, kh, vh = (rearrange(x, "b t h d -> b h t d") for x in (q, k, v))
    if g is None:
        A = (qh @ kh.transpose(-1, -2)).masked_fill(~mask, 0.0)
        o = A @ vh + qh @ S0
        S = S0 + kh.transpose(-1, -2) @ vh
    elif g.ndim == 3:
        # the cumulative log gate is summed, and differenced, in float64 (see the docstring)
        cd = q.dtype
        b = rearrange(g, "b t h -> b h t").to(torch.float64).cumsum(-1)
        D = (b[..., :, None] - b[..., None, :]).to(cd).masked_fill(~mask, float("-inf")).exp()
        A = (qh @ kh.transpose(-1, -2)) * D
        o = A @ vh + (qh * b[..., None].to(cd).exp()) @ S0
        last = b[..., -1:]
        S = (
            last[..., None].to(cd).exp() * S0
            + (kh * (last - b)[..., None].to(cd).exp()).transpose(-1, -2) @ vh
        )
    else:
        cd = q.dtype
        b = rearrange(g, "b t h k -> b h t k").to(torch.float64).cumsum(-2)
        diff = (b[..., :, None, :] - b[..., None, :, :]).to(cd).masked_fill(~mask[..., None], float("-inf"))
        A = (qh[..., :, None, :] * kh[..., None, :, :] * diff.exp()).sum(-1)
        o = A @ vh + (qh * b.to(cd).exp()) @ S0
        last = b[..., -1:, :]
        S = last.transpose(-1, -2).to(cd).exp() * S0 + (kh * (last - b).to(cd).exp()).transpose(-1, -2) @ vh
    return rearrange(o, "b h t v -> b t h v"), S


def _intra_chunk_channel_scores(q, k, b, sub: int = _SUB_BLOCK, safe_span: float = _SAFE_SPAN):
    """Scores ``A_ts = Σ_k q_tk k_sk exp(b_tk − b_sk)`` (``s ≤ t``, else 0) for per-channel gates.

    ``q, k, b: [..., C, K]`` with ``b`` the inclusive within-chunk cumulative log gate (``≤ 0``,
    non-increasing). The factorisation ``(q_t e^{b_t − r}) · (k_s e^{r − b_s})`` is exact in
    floating point (each term keeps its relative precision) as long as no factor over- or
    underflows, i.e. while the decay accumulated past the reference ``r`` stays below
    ``safe_span`` nats (``e^{±30} ≈ 1e±13``, far inside fp32's range). So:

    1. if no chunk decays by more than ``safe_span``: one ``[C, C]`` matmul per chunk;
    2. otherwise split the chunk into sub-blocks of ``sub`` tokens. Across sub-blocks ``i > j`` the
       decay factors as ``e^{b_t − r_i} · e^{r_i − e_j} · e^{e_j − b_s}`` (``r_i``: cumulative
       gate before sub-block ``i``; ``e_j``: at the end of sub-block ``j``), every factor ``≤ 1``.
       Inside a sub-block: a matmul anchored at its start if its decay stays below ``safe_span``,
       else the exact ``[sub, sub, K]`` tensor of ``e^{b_t − b_s}``.
    """
    *lead, C, K = q.shape
    mask = causal_mask(C, q.device)
    # while torch.compile traces, the decay is not read back (a graph break): the sub-block form
    # with exact diagonal blocks, right for any decay, runs; likewise off the CPU (a host sync)
    traced = avoid_host_reads(q) or transformed(q, k, b)
    if not traced and float(-b[..., -1, :].detach().min()) <= safe_span:
        A = (q * b.exp()) @ (k * (-b).exp()).transpose(-1, -2)
        return A.masked_fill(~mask, 0.0)
    if C % sub:
        sub = C
    m = C // sub
    qb = q.reshape(*lead, m, sub, K)
    kb = k.reshape(*lead, m, sub, K)
    bb = b.reshape(*lead, m, sub, K)
    e = bb[..., -1, :]  # [..., m, K]
    r = torch.cat([torch.zeros_like(e[..., :1, :]), e[..., :-1, :]], dim=-2)
    tri = causal_mask(sub, q.device)
    if not traced and float((r - e).detach().max()) <= safe_span:
        rel = bb - r[..., None, :]
        A_diag = ((qb * rel.exp()) @ (kb * (-rel).exp()).transpose(-1, -2)).masked_fill(~tri, 0.0)
    else:
        decay = decay_exp(bb[..., :, None, :] - bb[..., None, :, :], tri[..., None])
        A_diag = (qb[..., :, None, :] * kb[..., None, :, :] * decay).sum(-1)  # [..., m, sub, sub]
    if m == 1:
        return A_diag.reshape(*lead, C, C)
    q_t = qb * decay_exp(bb - r[..., None, :])
    k_h = kb * decay_exp(e[..., None, :] - bb)
    lower = causal_mask(m, q.device, -1)
    P = decay_exp(r[..., :, None, :] - e[..., None, :, :], lower[..., None])
    A_off = (q_t[..., :, None, :, :] * P[..., :, :, None, :]) @ k_h[..., None, :, :, :].transpose(-1, -2)
    eye = torch.eye(m, dtype=q.dtype, device=q.device)
    A = A_off + eye[:, :, None, None] * A_diag[..., :, None, :, :]
    return rearrange(A, "... i j t s -> ... (i t) (j s)")


def chunk_state_pass(S0, dS, decay):
    """States entering each chunk: ``S_{i} = decay_i ⊙ S_{i-1} + dS_i``.

    ``S0: [B,H,K,V]``, ``dS: [B,H,n,K,V]``, ``decay``: None | [B,H,n] | [B,H,n,K].
    Returns ``(states [B,H,n,K,V], final [B,H,K,V])``; the loop runs over chunks, not tokens.
    """
    if decay is None:
        incl = dS.cumsum(2)
        return S0[:, :, None] + incl - dS, S0 + incl[:, :, -1]
    w = decay[..., None, None] if decay.ndim == 3 else decay[..., None]
    # unbind (not indexing) so the backward pass stacks the per-chunk gradients once
    ws, dSs = w.unbind(2), dS.unbind(2)
    S = S0
    states = []
    for i in range(len(dSs)):
        states.append(S)
        S = torch.addcmul(dSs[i], ws[i], S)
    return torch.stack(states, 2), S


def gla_chunk_autograd(q, k, v, g, S0, chunk_size: int):
    """Chunkwise-parallel form differentiated by autograd, safe for any decay (see the module
    docstring); :func:`gla_chunk` uses it when a chunk decays by more than ``_SAFE_SPAN`` nats."""
    B, T, H, K = q.shape
    C = int(chunk_size)
    n = -(-T // C)
    pad = n * C - T
    if pad:  # zeros concatenated, not F.pad: a compiled backward at a second, symbolic length viewed
        # the constant_pad_nd undoing F.pad with strides it did not have (test_review_regressions_47f)
        q, k, v = (torch.cat([x, x.new_zeros(B, pad, *x.shape[2:])], 1) for x in (q, k, v))
        if g is not None:
            g = torch.cat([g, g.new_zeros(B, pad, *g.shape[2:])], 1)
    qc, kc, vc = (rearrange(x, "b (n c) h d -> b h n c d", c=C) for x in (q, k, v))
    mask = causal_mask(C, q.device)
    if g is None:
        A = (qc @ kc.transpose(-1, -2)).masked_fill(~mask, 0.0)
        q_in, k_out, decay = qc, kc, None
    elif g.ndim == 3:
        b = rearrange(g, "b (n c) h -> b h n c", c=C).cumsum(-1)
        D = decay_exp(b[..., :, None] - b[..., None, :], mask)
        A = (qc @ kc.transpose(-1, -2)) * D
        last = b[..., -1:]
        q_in = qc * decay_exp(b[..., None])
        k_out = kc * decay_exp((last - b)[..., None])
        decay = decay_exp(last[..., 0])
    else:
        b = rearrange(g, "b (n c) h k -> b h n c k", c=C).cumsum(-2)
        A = _intra_chunk_channel_scores(qc, kc, b)
        last = b[..., -1:, :]
        q_in = qc * decay_exp(b)
        k_out = kc * decay_exp(last - b)
        decay = decay_exp(last[..., 0, :])
    dS = k_out.transpose(-1, -2) @ vc  # [B, H, n, K, V]
    states, S = chunk_state_pass(S0, dS, decay)
    o = A @ vc + q_in @ states
    o = rearrange(o, "b h n c v -> b (n c) h v")[:, :T]
    return o, S


class _GLAChunk(torch.autograd.Function):
    """Chunk form for decays within ``_SAFE_SPAN`` nats per chunk, with a hand-written backward.

    Takes the per-token tensors as given (``q, k: [B,T,H,K]``, ``v: [B,T,H,V]``, any float dtype;
    ``g`` only to route its gradient) plus ``b``, the within-chunk inclusive cumulative log gate in
    the chunk layout ``[B,H,n,C,G]`` (``G = 1``: one decay per head; ``G = K``: per key channel),
    computed by the caller in the compute dtype. With ``q̃ = scale · q ⊙ e^b``, ``k̃ = k ⊙ e^{−b}``
    and ``λ = e^{b_C}`` (the chunk's total decay; ``k̃ ⊙ λ = k ⊙ e^{b_C − b}``):

        A = tril(q̃ k̃ᵀ)        S_{i+1} = λ_i ⊙ (S_i + k̃_iᵀ v_i)        o = A v + q̃ S_i

    Every factor lies in ``[e^{−30}, e^{30}]``: products keep full relative precision and no
    subnormal appears. Backward: the state recursion runs in reverse
    (``G_i = λ_i ⊙ G_{i+1} + q̃_iᵀ dO_i``, ``G_n = ∂L/∂S_final``) and everything else is batched
    matmuls over all chunks; the log-gate gradient is ``q̃ ⊙ ∂L/∂q̃ − k̃ ⊙ (∂L/∂k̃)_total`` plus, at
    each chunk's last token, ``Σ_v G_{i+1} ⊙ S_{i+1}`` (every term of ``S_{i+1}`` carries
    ``e^{b_C}``), summed from the end of the chunk backwards. No ``[C, C]`` decay matrix and no
    per-token state is formed; saved for backward: ``O(T·(C + K + V))`` per head plus the ``n``
    chunk states.
    """

    @staticmethod
    @autocast_off
    @native_as_in_forward
    def forward(ctx, q, k, v, g, S0, b, scale, C):
        cd, T = S0.dtype, q.shape[1]
        if b is None:
            e = lam = None
            qi, kt = to_chunks(q, C, cd, scale), to_chunks(k, C, cd)
        else:
            e = torch.exp(b, out=_workspace.empty(b.shape, b.dtype, b.device))
            lam = e[..., -1:, :].mT.clone()  # [B, H, n, G, 1]: scales the rows (keys) of the state
            # q̃ = (q ⊙ e^b) · scale in place: no e^b · scale tensor (per-channel gates: [B,H,n,C,K])
            qi, kt = to_chunks(q, C, cd, e), to_chunks(k, C, cd, e, divide=True)  # q̃, k ⊙ e^{−b}
            if scale != 1.0:
                qi.mul_(scale)
        vc = to_chunks(v, C, cd)
        A = mm(qi, kt.mT).tril_()
        dS = mm(kt.mT, vc)
        if lam is not None:
            dS.mul_(lam)
        states, S = scan_decay_(S0, dS, lam)
        o = mm_add_(mm(qi, states), A, vc)
        ctx.save_for_backward(qi, kt, vc, A, states, S, e, lam)
        ctx.meta = (T, C, scale, *((x.shape, x.dtype) if x is not None else None for x in (q, k, v, g)))
        return unchunk(o, T).transpose(1, 2), S

    @staticmethod
    @first_order
    @autocast_off
    @native_as_in_forward
    def backward(ctx, dO, dSf):
        qi, kt, vc, A, states, S, e, lam = ctx.saved_tensors
        T, C, scale, q, k, v, g = ctx.meta
        cd, dev = S.dtype, S.device
        dOc = to_chunks(dO, C, cd)
        want_dg = lam is not None and ctx.needs_input_grad[3]
        # Gsl: λ ⊙ G_{i+1}; db_last: Σ_v G_{i+1} ⊙ S_{i+1}, the gradient of each chunk's total log
        # decay b_C (both formed in the reverse scan)
        Gsl, dS0, db_last = scan_decay_reverse_(
            dSf.to(cd), mm(qi.mT, dOc), lam, dots_with=(states, S) if want_dg else None, scale_out=True
        )
        db_last = None if db_last is None else db_last.flatten(0, 1)
        dq, dq_t = raw_empty(q, dev)
        dk, dk_t = raw_empty(k, dev)
        dv, dv_t = raw_empty(v, dev)
        dg, dg_t = raw_empty(g, dev) if want_dg else (None, None)
        B, H, n = qi.shape[:3]
        fl = [
            t.flatten(0, 1) if isinstance(t, torch.Tensor) else t
            for t in (dOc, vc, qi, kt, A, states, Gsl, e)
        ]
        dOc, vc, qi, kt, A, states, Gsl, e = fl
        per_head = n * C * max(qi.shape[-1], vc.shape[-1], C) * qi.element_size()
        for bi, h0, h1, i0, i1 in head_groups(B, H, per_head):
            sl = slice(i0, i1)
            dOg, vcg, qig, ktg, Ag, stg, Gg = dOc[sl], vc[sl], qi[sl], kt[sl], A[sl], states[sl], Gsl[sl]
            dA = mm(dOg, vcg.mT).tril_()
            Dq = mm_add_(mm(dOg, stg.mT), dA, ktg)  # ∂L/∂q̃
            Dk = mm_add_(mm(dA.mT, qig), vcg, Gg.mT)  # ∂L/∂k̃ (both uses of k̃)
            dvc = mm_add_(mm(ktg, Gg), Ag.mT, dOg)
            # ∂L/∂q = ∂L/∂q̃ ⊙ e^b · scale (the scale in place: no e^b · scale tensor; for a bf16/fp16
            # q the product is formed in the compute dtype and rounded once)
            if e is None:
                torch.mul(unchunk_heads(Dq, T), scale, out=dq_t[bi, h0:h1])
            elif scale == 1.0 or dq_t.dtype == cd:
                torch.mul(unchunk_heads(Dq, T), unchunk_heads(e[sl], T), out=dq_t[bi, h0:h1])
                if scale != 1.0:
                    dq_t[bi, h0:h1].mul_(scale)
            else:
                dq_t[bi, h0:h1].copy_(torch.mul(unchunk_heads(Dq, T), unchunk_heads(e[sl], T)).mul_(scale))
            if e is None:
                dk_t[bi, h0:h1].copy_(unchunk_heads(Dk, T))
            else:
                torch.div(unchunk_heads(Dk, T), unchunk_heads(e[sl], T), out=dk_t[bi, h0:h1])
            dv_t[bi, h0:h1].copy_(unchunk_heads(dvc, T))
            if want_dg:
                db = Dq.mul_(qig).addcmul_(ktg, Dk, value=-1.0)  # q̃ ⊙ ∂L/∂q̃ − k̃ ⊙ ∂L/∂k̃
                dl = db_last[sl]
                if e.shape[-1] == 1:  # one decay per head
                    db, dl = db.sum(-1, keepdim=True), dl.sum(-1, keepdim=True)
                db[..., -1, :] += dl
                dg_t[bi, h0:h1].copy_(unchunk_heads(rev_cumsum_rows(db), T))
        return dq, dk, dv, dg, dS0, None, None, None


def gla_chunk(q, k, v, g, S0, chunk_size: int, scale: float = 1.0):
    """Chunkwise-parallel form; see the module docstring. ``q, k, v`` may be in any float dtype
    and are multiplied by ``scale`` here; ``g`` is clamped, in the compute dtype (``S0``'s).

    Uses :class:`_GLAChunk` (hand-written backward) while no chunk decays by more than
    ``_SAFE_SPAN`` nats; where one does it runs at ``chunk_size / 2``, ``/ 4``, … down to 16 tokens,
    the first size at which none does (:func:`~._chunked.chunks_within_span`), and only past that
    (hard resets, very strong gates) :func:`gla_chunk_autograd`, which keeps every factor ``≤ 1``,
    takes over at ``chunk_size``; it also runs whenever ``torch.compile`` traces the call, and under
    ``torch.func`` transforms (``vmap``, ``jvp``, ``grad``) and forward-mode AD. Default
    ``scale=1.0`` (the inputs are used as given)."""
    T = q.shape[1]
    C = min(int(chunk_size), T)
    if isinstance(scale, torch.Tensor):  # (a tensor scale, e.g. learned: applied here so autograd reaches it)
        q, scale = q.to(S0.dtype) * scale, 1.0
    if avoid_host_reads(q) or transformed(q, k, v, g, S0):
        # traced (or under torch.func / forward-mode AD, which _GLAChunk does not support): the
        # autograd form (no data-dependent branch, no out= writes into views, safe for
        # any decay); inductor fuses its element-wise work and derives the backward. Likewise off
        # the CPU: choosing the form reads the decay back, a host synchronisation per call
        cd = S0.dtype
        return gla_chunk_autograd(q.to(cd) * scale, k.to(cd), v.to(cd), g, S0, chunk_size)
    b = None
    if g is not None:
        with torch.no_grad():
            C, b = chunks_within_span(g, C, S0.dtype, _SAFE_SPAN)
        if C is None:
            cd = S0.dtype
            return gla_chunk_autograd(q.to(cd) * scale, k.to(cd), v.to(cd), g, S0, chunk_size)
    return _GLAChunk.apply(q, k, v, g, S0, b, float(scale), C)


_CORES = {"recurrent": gla_recurrent, "parallel": gla_parallel}


def run_gla_core(q, k, v, g, S0, mode: str, chunk_size: int, scale: float = 1.0):
    """``q, k, v`` in the compute dtype (``S0``'s) for the reference forms; the chunk form also
    takes them in their own dtype and applies ``scale`` itself (one pass instead of two; default
    ``scale=1.0``)."""
    if q.shape[1] == 0:
        return v.new_zeros(v.shape, dtype=S0.dtype), S0
    # every form in the compute dtype under an enclosing autocast too (see run_delta_core)
    with autocast_disabled(q.device.type):
        if mode == "chunk" and q.numel() and v.numel():  # (empty B, H or V: nothing to chunk)
            return gla_chunk(q, k, v, g, S0, chunk_size, scale)
        cd = S0.dtype
        return _CORES["recurrent" if mode == "chunk" else mode](q.to(cd) * scale, k.to(cd), v.to(cd), g, S0)


# ----------------------------------------------------------------------------------------------
# public op
# ----------------------------------------------------------------------------------------------


def gated_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    mode: str = "chunk",
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated linear attention (RetNet / GLA / Mamba-2 decay; Yang et al. 2023, "Gated Linear
    Attention Transformers with Hardware-Efficient Training", Eq. 3).

        S_t = diag(exp(g_t)) S_{t−1} + k_t v_tᵀ        o_t = S_tᵀ (scale · q_t)

    Args:
        q, k: ``[B, T, H, K]``. v: ``[B, T, H, V]``.
        g: log decay (``≤ 0``; ``exp(g)`` is the retained fraction per token), either
            ``[B, T, H]`` (one decay per head) or ``[B, T, H, K]`` (one per key channel), or
            ``None`` for no decay. Values below ``-60`` are clamped to ``-60`` (so ``-inf`` is a
            hard reset with no NaN); the chunked forms treat decay factors below ``exp(-40)`` as
            exactly ``0`` (a gradient that small, e.g. into ``initial_state`` across a strong
            decay, comes back as ``0``).
        scale: multiplies ``q``; default ``K ** -0.5``; a negative one is computed as given with a
            :class:`~mnemo.ops.RangeWarning`.
        initial_state: ``[B, H, K, V]`` (``[N, H, K, V]`` with ``cu_seqlens``); any float dtype,
            used in the compute dtype. Gradients flow into it.
        output_final_state: also return the state after the last token (default ``False``).
        cu_seqlens: ``[N + 1]`` int offsets of ``N`` sequences packed in ``B = 1``; the state is
            reset (to the matching row of ``initial_state``) at every boundary.
        mode: ``"chunk"`` (training, default) | ``"parallel"`` (quadratic) | ``"recurrent"``
            (token-loop reference). All three give the same result.
        chunk_size: chunk length of the chunk form (default ``64``).

    Returns:
        ``o: [B, T, H, V]`` in ``q``'s dtype, and ``final_state: [B, H, K, V]`` (``[N, ...]`` with
        ``cu_seqlens``) in the compute dtype (float64 if any input is float64, else float32), or
        ``None``.

    Raises:
        ValueError / TypeError: a shape, dtype, mode or chunk size does not match; the message
            names the argument, the expected and the received value.
    """
    B, T, H, K, V, N = check_matrix_op(q, k, v, mode=mode, chunk_size=chunk_size, cu_seqlens=cu_seqlens)
    if g is not None:
        check_floating("g", g)
        if g.shape != (B, T, H) and g.shape != (B, T, H, K):
            raise ValueError(
                f"g must have shape [B, T, H] = [{B}, {T}, {H}] or [B, T, H, K] = [{B}, {T}, {H}, {K}], "
                f"got [{', '.join(map(str, g.shape))}]"
            )
    check_initial_state(initial_state, (N, H, K, V), "H, K, V", varlen=cu_seqlens is not None)
    dtypes = tuple(t.dtype for t in (q, k, v, g, initial_state) if t is not None)
    _backends.check_devices(
        "gated_linear_attention", {"q": q, "k": k, "v": v, "g": g, "initial_state": initial_state}
    )
    in_transform = _backends.under_transform(q, k, v, g, initial_state, scale)
    call = _backends.Call(
        "gated_linear_attention", q.device, dtypes, mode, T, K, cu_seqlens is not None, V, in_transform
    )
    backend = _backends.select(call)
    if backend == "fla":
        from ._peer_ops import fla_gated_linear_attention

        return fla_gated_linear_attention(
            q,
            k,
            v,
            g,
            scale=scale,
            initial_state=initial_state,
            output_final_state=output_final_state,
            cu_seqlens=cu_seqlens,
        )

    def core(q, k, v, g=None, *, S0, scale=1.0):
        return run_gla_core(q, k, v, g, S0, mode, chunk_size, scale)

    with _backends.pure_torch(backend):
        return run_matrix_op(
            core,
            {"q": q, "k": k, "v": v},
            {"g": g},
            initial_state,
            (N, H, K, V),
            scale=scale,
            cu_seqlens=cu_seqlens,
            output_final_state=output_final_state,
        )


def gated_linear_attention_map(q, k, g=None, scale: float | None = None) -> torch.Tensor:
    """The ``T × T`` matrix the parallel form multiplies the values by, per head:
    ``M_ts = Σ_k scale · q_tk k_sk Γ_ts(k)`` for ``s ≤ t`` (0 above), so that
    ``o = M v`` (from a zero state). ``q, k: [B, T, H, K]``; ``g``: ``None`` (no decay),
    ``[B, T, H]`` or ``[B, T, H, K]`` log gates. Returns ``[B, H, T, T]`` in q's dtype."""
    scale = default_scale(scale, q.shape[-1])
    qh, kh = rearrange(q * scale, "b t h d -> b h t d"), rearrange(k, "b t h d -> b h t d")
    if g is None:
        return (qh @ kh.transpose(-1, -2)).masked_fill(~causal_mask(q.shape[1], q.device), 0.0)
    D = decay_matrix(g).to(qh.dtype)
    if g.ndim == 3:
        return (qh @ kh.transpose(-1, -2)) * D
    return (qh[..., :, None, :] * kh[..., None, :, :] * D).sum(-1)
