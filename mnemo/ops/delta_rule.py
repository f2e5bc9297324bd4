"""The delta rule: a matrix memory trained online on the L2 loss ``½‖Sᵀk − v‖²`` (DeltaNet), with an
optional decay, one per head (Gated DeltaNet) or one per key channel (KDA, Kimi Delta Attention).

    S_t = exp(g_t) · (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ          o_t = S_tᵀ (scale · q_t)
    S_t = (I − β_t k_t k_tᵀ) Diag(exp(g_t)) S_{t−1} + β_t k_t v_tᵀ      (g_t ∈ R^K: KDA)

The decay is applied *before* the prediction error is computed: with ``S' = exp(g_t) S_{t−1}``,
``S_t = S' + β_t k_t (v_t − S'ᵀ k_t)ᵀ``. DeltaNet (Schlag et al. 2021; Yang et al. 2024, "Parallelizing
Linear Transformers with the Delta Rule over Sequence Length") is ``g ≡ 0``; Gated DeltaNet (Yang,
Kautz & Hatamizadeh 2024, "Gated Delta Networks: Improving Mamba2 with Delta Rule", Eq. 10) adds
``g``; Kimi Delta Attention (Kimi Team 2025, "Kimi Linear: An Expressive, Efficient Attention
Architecture", arXiv 2510.26692, §3) makes it per channel, ``g: [B, T, H, K]``: row ``c`` of the
state (key channel ``c``) keeps ``exp(g_tc)``. With ``g`` equal across channels the two coincide.

The three forms below compute exactly the same function:

* ``recurrent`` — the token loop, the reference definition.
* ``chunk``     — chunkwise parallel with the WY representation (UT transform). Inside a chunk of
  ``C`` tokens that starts from state ``S``, let ``b_t = Σ_{s≤t} g_s`` (within the chunk),
  ``Γ_ts = exp(b_t − b_s)`` for ``s ≤ t`` (``0`` above the diagonal) and ``u_t`` the written value
  (``S_t = exp(b_t) S + Σ_{s≤t} Γ_ts k_s u_sᵀ``). The error term of token ``t`` then reads
  ``u_t = β_t (v_t − exp(b_t) Sᵀ k_t − Σ_{s<t} Γ_ts (k_tᵀ k_s) u_s)``, i.e. with

      A = I + strict_tril(diag(β) (K Kᵀ ⊙ Γ))                              (unit lower triangular)
      W = A⁻¹ diag(β) (K ⊙ exp(b))          U = A⁻¹ diag(β) V

  the written values are ``U − W S`` and

      o     = (Q ⊙ exp(b)) S + (Q Kᵀ ⊙ Γ) (U − W S)
      S_new = exp(b_C) S + (K ⊙ exp(b_C − b))ᵀ (U − W S)
            = M S + D,      M = exp(b_C) I − (K ⊙ exp(b_C − b))ᵀ W,   D = (K ⊙ exp(b_C − b))ᵀ U.

  ``A``, the triangular solves for ``W`` and ``U``, ``M``, ``D`` and the output terms are computed
  for all chunks at once (batched ``[C, C]`` / ``[C, K]·[K, V]`` matmuls); only ``S ← M_i S + D_i``
  runs as a loop over the ``n = T / C`` chunks. ``M_i`` is the product of the chunk's per-token
  transitions ``exp(g_t)(I − β_t k_t k_tᵀ)``.

  ``W`` and ``M`` are evaluated through the exact similarity ``A = E Ã E⁻¹`` (``E = diag(exp(b))``,
  ``Ã = I + strict_tril(diag(β) K Kᵀ)`` the ungated matrix): ``W = exp(b) ⊙ W̃`` and
  ``M = exp(b_C) (I − Kᵀ W̃)`` with ``W̃ = Ã⁻¹ diag(β) K``, so every decay enters as one factor
  instead of as products of many small ones.

  Two implementations of this form, same results:

  - :class:`_DeltaChunk` (used whenever no chunk decays by more than ``_SAFE_SPAN = 30`` nats, and
    for ``g = None``; when a chunk of ``chunk_size`` decays by more, the chunk is halved, down to
    16 tokens, until none does, :func:`~._chunked.chunks_within_span`): carries the similarity
    through to the values as well, ``U = exp(b) ⊙ Ã⁻¹ diag(β) (V ⊙ exp(−b))``, so the gated chunk
    is the *ungated* one on rescaled values (outputs times ``exp(b)``, chunk transition times
    ``exp(b_C)``), one ``Ã⁻¹`` (formed by recursive blocking,
    :func:`~._chunked.unit_lower_inverse_`) serves both right-hand sides, and the backward pass is
    written by hand (reverse state recursion, batched matmuls, recomputation instead of per-token
    states).
  - :func:`delta_chunk_autograd` (any decay, gradients by autograd): decays are formed as ``exp`` of
    differences masked *before* the ``exp`` (``Γ``) or of non-positive cumulative sums
    (``exp(b)``, ``exp(b_C − b)``, ``exp(b_C)``), never ``exp(−b)``, so extreme gates cannot
    overflow; factors below ``exp(−40) ≈ 4e-18`` are set to exactly ``0``, which keeps float32
    subnormals (several times slower on CPUs) out of the matmuls. It takes over when gates are
    strong or hard resets (``-inf``) occur.
* ``chunk`` with per-channel gates (KDA). Now ``b_t ∈ R^K`` is the
  within-chunk cumulative log gate per channel and ``S_t = e^{b_t} ⊙ S + Σ_{s≤t} (k_s ⊙
  e^{b_t − b_s}) u_sᵀ`` (``⊙`` scales the rows of a state). Decaying ``S_{t−1}`` by ``e^{g_t}``
  turns every ``e^{b_{t−1}}`` into ``e^{b_t}``, so the error term of token ``t`` is
  ``u_t = β_t (v_t − Sᵀ (k_t ⊙ e^{b_t}) − Σ_{s<t} [Σ_c k_tc k_sc e^{b_tc − b_sc}] u_s)``, i.e. with

      A = I + strict_tril(diag(β) [Σ_c k_tc k_sc e^{b_tc − b_sc}]_ts)
      W = A⁻¹ diag(β) (K ⊙ e^b)            U = A⁻¹ diag(β) V

  the written values are again ``U − W S``, and ``o_t = S_tᵀ q_t``, ``S_new = S_C`` give

      o     = (Q ⊙ e^b) S + tril([Σ_c q_tc k_sc e^{b_tc − b_sc}]_ts) (U − W S)
      S_new = e^{b_C} ⊙ S + (K ⊙ e^{b_C − b})ᵀ (U − W S) = M S + D,
              M = Diag(e^{b_C}) − (K ⊙ e^{b_C − b})ᵀ W,   D = (K ⊙ e^{b_C − b})ᵀ U.

  With ``b`` equal across channels this is the scalar form above. The scalar form's similarity
  ``A = E Ã E⁻¹`` has no per-channel counterpart (``Diag(e^{g})`` does not commute with
  ``k kᵀ``): the two score matrices are ``Σ_c``-sums of decayed products, GLA's per-channel
  scores. All chunks at once; only ``S ← M_i S + D_i`` loops. Two implementations, same results:

  - :class:`_KDAChunk` (while no chunk decays by more than ``_SAFE_SPAN`` nats, halving the chunk
    down to 4 tokens first, ``_KDA_MIN_CHUNK``; scalar gates stop at 16): the scores factor as
    ``(Q ⊙ e^b)(K ⊙ e^{−b})ᵀ`` and ``(K ⊙ e^b)(K ⊙ e^{−b})ᵀ``, every factor within ``e^{±30}``;
    backward written by hand.
  - :func:`kda_chunk_autograd` (any decay, gradients by autograd; strong gates, hard resets,
    ``torch.compile``, ``torch.func``, off the CPU): the scores by
    :func:`~.gated_linear_attention._intra_chunk_channel_scores` (factorised while a chunk decays
    by at most 30 nats, else an exact split into sub-blocks whose factors are all ``≤ 1``), every
    other factor (``e^b``, ``e^{b_C − b}``, ``e^{b_C}``) ``≤ 1``, so nothing can overflow.

  :class:`_KDAChunk` keeps ``O(T·(C + K + V))`` per head plus the chunk states and transitions for
  the backward pass (no per-token state). :func:`kda_chunk_autograd` keeps more where it splits a
  chunk into exact sub-blocks: their ``[16, 16, K]`` decay tensors, ``O(T·16·K)`` per head (measured
  by review 50f at T 4096, K = V = 64: 223 MB against ``_KDAChunk``'s 31.5 MB), and ``O(T·C·K)``
  when ``C`` is not a multiple of 16. Which implementation runs is decided for the whole call: one
  chunk that decays by more than 30 nats within 4 tokens (a ``-inf`` reset, or one channel at
  ``g ≤ −7.5`` a token) sends every chunk to :func:`kda_chunk_autograd` (measured 5–15× slower at
  T 512 when the floor was 16 tokens; a per-chunk choice is not built).
* ``parallel``  — the same algorithm with the whole sequence as one chunk (one ``T × T``
  triangular solve): the quadratic form (:func:`delta_chunk_autograd`, per-channel gates
  :func:`kda_chunk_autograd`, with ``C = T``).

Nothing ``T × K × V`` is kept for the backward pass: ``O(T·(C + K + V) + (T/C)·K·(K + V))`` per head
(chunk-level states, never per-token ``K × V`` states), except the per-channel fallback's exact
sub-block decays (``O(T·16·K)``, above).
"""

from __future__ import annotations

import torch

from . import _workspace
from . import dispatch as _backends
from ._chunked import (
    autocast_disabled,
    autocast_off,
    b3,
    chunks_within_span,
    head_groups,
    mm,
    mm_add_,
    native_as_in_forward,
    raw_empty,
    rev_cumsum,
    rowdot,
    scan_matrix,
    scan_matrix_reverse_,
    to_chunks,
    unchunk,
    unchunk_heads,
    unit_lower_inverse_,
)
from ._common import (
    avoid_host_reads,
    causal_mask,
    check_floating,
    check_initial_state,
    check_interval,
    check_matrix_op,
    check_shape,
    decay_exp,
    decay_matrix,
    default_scale,
    first_order,
    run_matrix_op,
    transformed,
)
from ._layout import rearrange

__all__ = ["delta_rule", "gated_delta_rule", "delta_rule_map"]

#: Largest decay (in nats) inside one chunk for the factorised fast chunk form (``e^{±30}`` stays far
#: inside fp32's range); beyond it the chunk form falls back to products of factors ``≤ 1``.
_SAFE_SPAN = 30.0

# ----------------------------------------------------------------------------------------------
# cores: inputs already validated, in the compute dtype, q already scaled, g clamped (or None)
# ----------------------------------------------------------------------------------------------


def delta_recurrent(q, k, v, beta, g, S0):
    """Token loop. ``q, k: [B,T,H,K]``, ``v: [B,T,H,V]``, ``beta: [B,T,H]``,
    ``g``: None | [B,T,H] | [B,T,H,K] (per key channel: the rows of the state)."""
    S = S0
    outs = []
    for t in range(q.shape[1]):
        if g is not None and g.ndim == 4:
            S = S * g[:, t].exp()[..., None]  # Diag(exp(g_t)) S: row c of the state decays by exp(g_tc)
        elif g is not None:
            S = S * g[:, t].exp()[..., None, None]  # decay first ...
        err = v[:, t] - (k[:, t, :, None, :] @ S)[:, :, 0]  # ... then the prediction error
        S = S + (beta[:, t, :, None] * k[:, t])[..., None] * err[..., None, :]
        outs.append((q[:, t, :, None, :] @ S)[:, :, 0])
    return torch.stack(outs, 1), S


def _chunk_states(S0, M, D):
    """The autograd chunk forms' one loop, ``S_{i+1} = M_i S_i + D_i`` over the ``n`` chunks
    (``S0: [B,H,K,V]``, ``M: [B,H,n,K,K]``, ``D: [B,H,n,K,V]``): the states entering each chunk
    ``[B,H,n,K,V]`` and the final state ``[B,H,K,V]``."""
    B, H = S0.shape[:2]
    # unbind (not indexing) so the backward pass stacks the per-chunk gradients once
    Ms = rearrange(M, "b h n k j -> n (b h) k j").unbind(0)
    Ds = rearrange(D, "b h n k v -> n (b h) k v").unbind(0)
    S = rearrange(S0, "b h k v -> (b h) k v")
    states = []
    for i in range(len(Ms)):
        states.append(S)
        S = torch.baddbmm(Ds[i], Ms[i], S)
    # entering each chunk (unflatten, not rearrange's b=B: that divides by B, and B may be 0)
    states = rearrange(torch.stack(states, 0).unflatten(1, (B, H)), "n b h k v -> b h n k v")
    return states, S.unflatten(0, (B, H))


def delta_chunk_autograd(q, k, v, beta, g, S0, chunk_size: int):
    """Chunkwise-parallel (WY / UT-transform) form differentiated by autograd, safe for any decay
    (see the module docstring); :func:`delta_chunk` uses it when a chunk decays by more than
    ``_SAFE_SPAN`` nats, :func:`delta_parallel` with the whole sequence as one chunk. ``T ≥ 1``."""
    B, T, H, K = q.shape
    C = min(int(chunk_size), T)
    n = -(-T // C)
    pad = n * C - T
    if pad:  # padding tokens (k = v = 0, beta = 0, g = 0) leave the state unchanged
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        beta = torch.nn.functional.pad(beta, (0, 0, 0, pad))
        if g is not None:
            g = torch.nn.functional.pad(g, (0, 0, 0, pad))
    qc, kc, vc = (rearrange(x, "b (n c) h d -> b h n c d", c=C) for x in (q, k, v))
    bc = rearrange(beta, "b (n c) h -> b h n c", c=C)[..., None]  # [B, H, n, C, 1]
    incl = causal_mask(C, q.device)
    strict = causal_mask(C, q.device, -1)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    eyeK = torch.eye(K, dtype=q.dtype, device=q.device)
    kt = kc.transpose(-1, -2)
    bkk = bc * (kc @ kt)  # diag(β) K Kᵀ, [B, H, n, C, C]
    qk = qc @ kt
    # Ã = I + strict_tril(diag(β) K Kᵀ): the ungated WY matrix; W̃ = Ã⁻¹ diag(β) K
    A_free = bkk.masked_fill(~strict, 0.0) + eye
    if g is None:
        WU = torch.linalg.solve_triangular(
            A_free, torch.cat([bc * kc, bc * vc], -1), upper=False, unitriangular=True
        )
        W, U = WU[..., :K], WU[..., K:]
        M = eyeK - kt @ W  # [B, H, n, K, K]
        D = kt @ U  # [B, H, n, K, V]
        P = qk.masked_fill(~incl, 0.0)
        q_in, eb = qc, None
    else:
        # the cumulative log gate summed and differenced in float64, then rounded once: in float32 a
        # long chunk (the parallel form's C = T) gives each difference |b| · 2^-24 of error
        b64 = rearrange(g, "b (n c) h -> b h n c", c=C).to(torch.float64).cumsum(-1)
        Gam = decay_exp((b64[..., :, None] - b64[..., None, :]).to(q.dtype), incl)
        b = b64.to(q.dtype)
        A = (bkk * Gam).masked_fill(~strict, 0.0) + eye
        U = torch.linalg.solve_triangular(A, bc * vc, upper=False, unitriangular=True)
        # A = E Ã E⁻¹ with E = diag(exp(b)), so W = A⁻¹ diag(β) (K ⊙ exp(b)) = exp(b) ⊙ W̃ and
        # M = exp(b_C) I − (K ⊙ exp(b_C − b))ᵀ W = exp(b_C) (I − Kᵀ W̃): each decay enters once.
        W_free = torch.linalg.solve_triangular(A_free, bc * kc, upper=False, unitriangular=True)
        eb = decay_exp(b[..., None])  # [B, H, n, C, 1]
        last = b[..., -1:]
        M = decay_exp(last)[..., None] * (eyeK - kt @ W_free)
        D = (kc * decay_exp((b64[..., -1:] - b64).to(q.dtype)[..., None])).transpose(-1, -2) @ U
        P = qk * Gam
        q_in, W = qc * eb, W_free
    states, S = _chunk_states(S0, M, D)
    ws = W @ states
    v_new = U - (ws if eb is None else eb * ws)  # written values U − W S per chunk
    o = q_in @ states + P @ v_new
    o = rearrange(o, "b h n c v -> b (n c) h v")[:, :T]
    return o, S


#: the per-channel form halves its chunks down to 4 tokens (the scalar form: 16) before the autograd
#: fallback takes over: one fast channel (a decay of 2–7 nats a token, which KDA's gate reaches at
#: init) otherwise sent every chunk of the call to the exact sub-block path (review 50f: 4.2x faster
#: at 2.5 nats a token, T 2048, H 2, K = V = 64; 1.7x at 5 nats)
_KDA_MIN_CHUNK = 4


def kda_chunk_autograd(q, k, v, beta, g, S0, chunk_size: int):
    """The chunk form for per-channel log gates ``g: [B,T,H,K]`` (KDA; see the module docstring),
    differentiated by autograd. ``q, k, v, beta`` in the compute dtype (``q`` already scaled),
    ``g`` clamped. Both within-chunk score matrices come from GLA's
    :func:`~.gated_linear_attention._intra_chunk_channel_scores` (exact for any decay: factorised
    while a chunk decays by at most ``30`` nats, else split into sub-blocks whose factors are all
    ``≤ 1``); every other decay is ``exp`` of a non-positive difference of cumulative sums.
    Saved for backward: ``O(T·(C + K + V))`` per head plus the ``n`` chunk states and
    transitions, and, where chunks are split, the sub-blocks' exact ``[16, 16, K]`` decays
    (``O(T·16·K)``; see the module docstring). ``T ≥ 1``."""
    from .gated_linear_attention import _intra_chunk_channel_scores

    B, T, H, K = q.shape
    if q.numel() == 0:  # no batch row or head (the parallel form's call): nothing to compute, but
        # the output stays linked to every input (zero gradients, as the other forms give)
        return v.new_zeros(v.shape) + sum(x.sum() for x in (q, k, v, beta, g)) * 0, S0
    C = min(int(chunk_size), T)
    n = -(-T // C)
    pad = n * C - T
    if pad:  # padding tokens (k = v = 0, beta = 0, g = 0) leave the state unchanged
        q, k, v, g = (torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
        beta = torch.nn.functional.pad(beta, (0, 0, 0, pad))
    qc, kc, vc = (rearrange(x, "b (n c) h d -> b h n c d", c=C) for x in (q, k, v))
    bc = rearrange(beta, "b (n c) h -> b h n c", c=C)[..., None]  # [B, H, n, C, 1]
    # the cumulative log gate per channel, summed and differenced in float64, rounded once
    b64 = rearrange(g, "b (n c) h k -> b h n c k", c=C).to(torch.float64).cumsum(-2)
    b = b64.to(q.dtype)
    strict = causal_mask(C, q.device, -1)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    # [Σ_c q_tc k_sc e^{b_tc − b_sc}]_{s ≤ t} and the same with k for q
    P = _intra_chunk_channel_scores(qc, kc, b)
    A = (bc * _intra_chunk_channel_scores(kc, kc, b)).masked_fill(~strict, 0.0) + eye
    eb = decay_exp(b)  # e^{b} ≤ 1, [B, H, n, C, K]
    WU = torch.linalg.solve_triangular(
        A, torch.cat([bc * (kc * eb), bc * vc], -1), upper=False, unitriangular=True
    )
    W, U = WU[..., :K], WU[..., K:]  # W = A⁻¹ diag(β)(K ⊙ e^b), U = A⁻¹ diag(β) V
    last = b64[..., -1:, :]
    k_out = kc * decay_exp((last - b64).to(q.dtype))  # K ⊙ e^{b_C − b}
    M = torch.diag_embed(decay_exp(last[..., 0, :].to(q.dtype))) - k_out.mT @ W  # [B, H, n, K, K]
    D = k_out.mT @ U  # [B, H, n, K, V]
    states, S = _chunk_states(S0, M, D)
    o = (qc * eb) @ states + P @ (U - W @ states)  # written values U − W S per chunk
    o = rearrange(o, "b h n c v -> b (n c) h v")[:, :T]
    return o, S


class _KDAChunk(torch.autograd.Function):
    """The per-channel chunk form (KDA) with a hand-written backward, for decays within
    ``_SAFE_SPAN`` nats per chunk (then every factor ``e^{±b}`` lies in ``[e^{−30}, e^{30}]``).

    Takes ``b``, the within-chunk cumulative log gate ``[B,H,n,C,K]``. With ``q̃ = scale · q ⊙ e^b``,
    ``k̂ = k ⊙ e^b``, ``k̃ = k ⊙ e^{−b}`` and ``λ = e^{b_C}`` (per channel) the scores factor as
    ``P = tril(q̃ k̃ᵀ)``, ``A = I + strict_tril(diag(β) k̂ k̃ᵀ)``, and per chunk, all at once,

        [W | U] = A⁻¹ [diag(β) k̂ | diag(β) V]      v̂ = U − W S      o = q̃ S + P v̂
        S_next = M S + D,   M = Diag(λ) (I − k̃ᵀ W),   D = Diag(λ) k̃ᵀ U

    with ``S ← M_i S + D_i`` the only loop. Backward: ``G_i = M_iᵀ G_{i+1} + q̃ᵀ dO − Wᵀ Pᵀ dO`` in
    reverse, then batched matmuls; the log-gate gradient is ``q̃ ⊙ ∂q̃ + k̂ ⊙ ∂k̂ − k̃ ⊙ ∂k̃`` plus,
    at each chunk's last token, ``Σ_v G_{i+1} ⊙ S_{i+1}`` (the ``λ`` of every row of ``S_{i+1}``),
    summed from the end of the chunk backwards. Saved: ``O(T·(C + K + V))`` per head plus the
    chunk states and transitions.
    """

    @staticmethod
    @autocast_off
    @native_as_in_forward
    def forward(ctx, q, k, v, beta, g, S0, b, scale, C):
        cd, T, K = S0.dtype, q.shape[1], q.shape[-1]
        e = b.exp()  # [B, H, n, C, K]
        qe = to_chunks(q, C, cd, e)  # q̃ (times scale below)
        if scale != 1.0:
            qe.mul_(scale)
        ke, ki = to_chunks(k, C, cd, e), to_chunks(k, C, cd, e, divide=True)  # k̂, k̃
        vc, bc = to_chunks(v, C, cd), to_chunks(beta, C, cd)
        lam = e[..., -1:, :].mT  # [B, H, n, K, 1]: scales the rows of a state
        P = (qe @ ki.mT).tril_()
        Akk = (ke @ ki.mT).tril_(-1)
        A = (bc * Akk).contiguous()
        A.diagonal(dim1=-2, dim2=-1).fill_(1.0)
        Ai = unit_lower_inverse_(A)
        X = Ai @ torch.cat([bc * ke, bc * vc], -1)  # [W | U]
        W, U = X[..., :K], X[..., K:]
        MD = ki.mT @ X  # [k̃ᵀ W | k̃ᵀ U] → [M | D]
        MD[..., :K].neg_().diagonal(dim1=-2, dim2=-1).add_(1.0)
        MD.mul_(lam)
        M = MD[..., :K]
        states, S = scan_matrix(S0, MD[..., K:], M)
        vn = U - W @ states
        o = qe @ states + P @ vn
        ctx.save_for_backward(qe, ke, ki, vc, bc, Ai, X, M, states, S, vn, P, Akk, e, lam)
        ctx.meta = (T, C, scale, *((x.shape, x.dtype) for x in (q, k, v, beta, g)))
        return unchunk(o, T).transpose(1, 2), S

    @staticmethod
    @first_order
    @autocast_off
    @native_as_in_forward
    def backward(ctx, dO, dSf):
        qe, ke, ki, vc, bc, Ai, X, M, states, S, vn, P, Akk, e, lam = ctx.saved_tensors
        T, C, scale, q_, k_, v_, beta_, g_ = ctx.meta
        cd, K = S.dtype, qe.shape[-1]
        W, U = X[..., :K], X[..., K:]
        want_dg = ctx.needs_input_grad[4]
        dOc = to_chunks(dO, C, cd)
        dvn = P.mT @ dOc  # ∂L/∂v̂
        R = (qe.mT @ dOc).sub_(W.mT @ dvn)
        Gs, dS0, dots = scan_matrix_reverse_(
            dSf.to(cd).contiguous(), R, M, dots_with=(states, S) if want_dg else None
        )
        Gl = Gs * lam  # ∂L/∂(S_next / λ): the rows of G_{i+1} times λ
        GlS = Gl @ states.mT  # −∂L/∂(k̃ᵀ W)
        dP = (dOc @ vn.mT).tril_()
        d_qe = dOc @ states.mT + dP @ ki
        d_ki = dP.mT @ qe + U @ Gl.mT - W @ GlS.mT
        dR = Ai.mT @ torch.cat([-(dvn @ states.mT) - ki @ GlS, dvn + ki @ Gl], -1)  # Aᵀ⁻¹ [∂W | ∂U]
        dA = (dR @ X.mT).neg_().tril_(-1)  # ∂L/∂A, strict lower part
        dAkk = bc * dA
        dRk, dRv = dR[..., :K], dR[..., K:]
        dbeta = (dA * Akk).sum(-1) + rowdot(dRk, ke) + rowdot(dRv, vc)
        d_ke = dAkk @ ki + bc * dRk
        d_ki += dAkk.mT @ ke

        def back(x, like):  # [B, H, n, C, D] -> [B, T, H, D] (D = 1 dropped for [B, T, H])
            y = unchunk(x, T).transpose(1, 2)
            return (y[..., 0] if len(like[0]) == 3 else y).to(like[1])

        dq = back(d_qe * e * scale, q_)
        dk = back(d_ke * e + d_ki / e, k_)
        dv = back(bc * dRv, v_)
        dbeta_t = back(dbeta[..., None], beta_)
        dg = None
        if want_dg:
            db = qe * d_qe + ke * d_ke - ki * d_ki
            db[..., -1, :] += dots
            dg = back(rev_cumsum(db, -2), g_)
        return dq, dk, dv, dbeta_t, dg, dS0, None, None, None


class _DeltaChunk(torch.autograd.Function):
    """The chunk form with a hand-written backward pass, for decays within ``_SAFE_SPAN`` nats per
    chunk (and for ``g = None``).

    Inside a chunk the state factors as ``S_t = e^{b_t} S̃_t`` (``b``: within-chunk cumulative log
    gate), and ``S̃`` follows the *ungated* delta rule on the values ``ṽ0_t = e^{−b_t} v_t``:
    ``S̃_t = (I − β_t k_t k_tᵀ) S̃_{t−1} + β_t k_t ṽ0_tᵀ``, ``o_t = e^{b_t} S̃_tᵀ q_t``, and the chunk
    leaves ``λ S̃_C`` (``λ = e^{b_C}``). So every decay is a row scaling, and one unit lower-
    triangular ``Ã = I + strict_tril(diag(β) K Kᵀ)`` serves both solves, done as one:
    ``[W̃ | Ũ] = Ã⁻¹ [diag(β) K | diag(β) Ṽ0]``. Per chunk, all chunks at once:

        ṽ = Ũ − W̃ S          õ = Q S + tril(Q Kᵀ) ṽ          o = e^b ⊙ õ
        S_next = M S + D,    M = λ (I − Kᵀ W̃),   D = λ Kᵀ Ũ

    with ``S ← M_i S + D_i`` the only loop. All factors lie in ``[e^{−30}, e^{30}]``, so no
    product loses relative precision or becomes subnormal. Backward: ``G_i = M_iᵀ G_{i+1} + R_i``
    in reverse (``R_i = Qᵀ dõ − W̃ᵀ Pᵀ dõ``, ``dõ = e^b ⊙ dO``), then batched matmuls and one
    transposed solve per right-hand side; the log-gate gradient is
    ``⟨õ_t, dõ_t⟩ − β_t ⟨ṽ0_t, ∂L/∂(β ṽ0)_t⟩`` plus ``⟨G_{i+1}, S_{i+1}⟩`` at each chunk's last
    token, summed from the end of the chunk backwards. Saved for backward: ``O(T·(C + K + V))``
    per head plus the ``n`` chunk states and transitions; nothing ``T × K × V``.
    """

    @staticmethod
    @autocast_off
    @native_as_in_forward
    def forward(ctx, q, k, v, beta, g, S0, b, scale, C):
        cd, T, dev = S0.dtype, q.shape[1], S0.device
        K = q.shape[-1]
        qc = to_chunks(q, C, cd, scale)
        kc = to_chunks(k, C, cd)
        bc = to_chunks(beta, C, cd)  # [B, H, n, C, 1]
        if b is None:
            e = lam = None
            v0 = to_chunks(v, C, cd)
        else:
            e = b.exp()[..., None]  # [B, H, n, C, 1]
            lam = e[..., -1:, :].clone()  # [B, H, n, 1, 1]
            v0 = to_chunks(v, C, cd, b.neg().exp()[..., None])
        At = mm(kc, kc.mT).mul_(bc).tril_(-1)  # Ã = I + strict_tril(diag(β) K Kᵀ)
        At.diagonal(dim1=-2, dim2=-1).fill_(1.0)
        Ai = unit_lower_inverse_(At)  # Ã⁻¹ (At is overwritten)
        KV = _workspace.empty((*kc.shape[:-1], K + v0.shape[-1]), cd, dev)
        X = mm(Ai, torch.cat([kc, v0], -1, out=KV).mul_(bc))  # [W̃ | Ũ] = Ã⁻¹ [diag(β) K | diag(β) Ṽ0]
        Wt, Ut = X[..., :K], X[..., K:]
        MD = mm(kc.mT, X)  # [Kᵀ W̃ | Kᵀ Ũ] → [M | D]
        MD[..., :K].neg_().diagonal(dim1=-2, dim2=-1).add_(1.0)
        if lam is not None:
            MD.mul_(lam)
        M = MD[..., :K]
        states, S = scan_matrix(S0, MD[..., K:], M)
        vt = _workspace.empty(Ut.shape, cd, dev)
        torch.baddbmm(b3(Ut), b3(Wt), b3(states), alpha=-1.0, out=b3(vt))  # ṽ = Ũ − W̃ S
        P = mm(qc, kc.mT).tril_()
        ot = mm_add_(mm(qc, states), P, vt)  # õ
        if e is None:
            o = unchunk(ot, T).transpose(1, 2)
        else:
            o, o_t = raw_empty((v.shape, cd), dev)
            torch.mul(unchunk(ot, T), unchunk(e, T), out=o_t)
        ctx.save_for_backward(qc, kc, bc, v0, Ai, X, M, states, S, vt, P, ot, e, lam)
        ctx.meta = (T, C, scale, *((x.shape, x.dtype) if x is not None else None for x in (q, k, v, beta, g)))
        return o, S

    @staticmethod
    @first_order
    @autocast_off
    @native_as_in_forward
    def backward(ctx, dO, dSf):
        qc, kc, bc, v0, Ai, X, M, states, S, vt, P, ot, e, lam = ctx.saved_tensors
        T, C, scale, q_, k_, v_, beta_, g_ = ctx.meta
        cd, dev, K = S.dtype, S.device, kc.shape[-1]
        Wt, Ut = X[..., :K], X[..., K:]
        gated = e is not None
        want_dg = gated and ctx.needs_input_grad[4]
        dot = to_chunks(dO, C, cd, e)  # ∂L/∂õ = e^b ⊙ dO
        dvt = mm(P.mT, dot)  # ∂L/∂ṽ
        R = mm(qc.mT, dot)
        b3(R).baddbmm_(b3(Wt.mT), b3(dvt), alpha=-1.0)
        Gs, dS0, dlast = scan_matrix_reverse_(dSf.to(cd), R, M, dots_with=(states, S) if want_dg else None)
        dlast = None if dlast is None else dlast.sum(-1).flatten(0, 1)  # λ ∂L/∂λ
        dq, dq_t = raw_empty(q_, dev)
        dk_, dk_t = raw_empty(k_, dev)
        dv, dv_t = raw_empty(v_, dev)
        dbeta, dbeta_t = raw_empty(beta_, dev)
        dg, dg_t = raw_empty(g_, dev) if want_dg else (None, None)
        B, H, n = qc.shape[:3]
        tensors = (qc, kc, bc, v0, Ai, Wt, Ut, states, vt, P, ot, e, lam, dot, dvt, Gs)
        qc, kc, bc, v0, Ai, Wt, Ut, states, vt, P, ot, e, lam, dot, dvt, Gs = (
            None if t is None else t.flatten(0, 1) for t in tensors
        )
        per_head = n * C * max(K, vt.shape[-1], C) * qc.element_size()
        # the rest, head group by head group (see head_groups)
        for bi, h0, h1, i0, i1 in head_groups(B, H, per_head):
            sl = slice(i0, i1)
            qg, kg, bg, v0g, Aig, Wg, Ug, stg = (
                qc[sl],
                kc[sl],
                bc[sl],
                v0[sl],
                Ai[sl],
                Wt[sl],
                Ut[sl],
                states[sl],
            )
            dotg, dvtg, Gg = dot[sl], dvt[sl], Gs[sl]
            dP = mm(dotg, vt[sl].mT).tril_()
            dqc = mm_add_(mm(dotg, stg.mT), dP, kg)
            torch.mul(unchunk_heads(dqc, T), scale, out=dq_t[bi, h0:h1])
            dk = mm(dP.mT, qg)
            dM = mm(Gg, stg.mT)
            if gated:
                Gl, dZ = Gg.mul_(lam[sl]), dM.mul_(-lam[sl])  # ∂L/∂(Kᵀ Ũ) and ∂L/∂(Kᵀ W̃)
            else:
                Gl, dZ = Gg, dM.neg_()
            b3(dk).baddbmm_(b3(Wg), b3(dZ.mT)).baddbmm_(b3(Ug), b3(Gl.mT))
            dWt = mm(kg, dZ, out=dqc)  # (dqc's buffer is free again)
            b3(dWt).baddbmm_(b3(dvtg), b3(stg.mT), alpha=-1.0)
            dUt = mm_add_(dvtg, kg, Gl)  # dvt is consumed
            dBk = mm(Aig.mT, dWt)  # ∂L/∂(diag(β) K) = Ã⁻ᵀ ∂L/∂W̃
            dBv = mm(Aig.mT, dUt)  # ∂L/∂(diag(β) Ṽ0) = Ã⁻ᵀ ∂L/∂Ũ
            Hm = mm(dBk, Wg.mT, out=dP)
            b3(Hm).baddbmm_(b3(dBv), b3(Ug.mT))
            Hm.tril_(-1).neg_()  # ∂L/∂(diag(β) K Kᵀ), strict lower part
            Hk = mm(Hm, kg)
            bv = rowdot(dBv, v0g)
            dbeta_c = rowdot(kg, Hk).add_(rowdot(dBk, kg)).add_(bv)
            dk.addcmul_(Hk.add_(dBk), bg)
            b3(dk).baddbmm_(b3(Hm.mul_(bg).mT), b3(kg))
            dk_t[bi, h0:h1].copy_(unchunk_heads(dk, T))
            vfac = bg / e[sl] if gated else bg  # ∂(β ṽ0)/∂v = β e^{−b}
            torch.mul(unchunk_heads(dBv, T), unchunk_heads(vfac, T), out=dv_t[bi, h0:h1])
            dbeta_t[bi, h0:h1].copy_(unchunk_heads(dbeta_c[..., None], T))
            if want_dg:
                db = rowdot(ot[sl], dotg)  # the e^b factor of the output ...
                db.sub_(bv.mul_(bg[..., 0]))  # ... and the e^{−b} factor of the values
                db[..., -1] += dlast[sl]
                dg_t[bi, h0:h1].copy_(unchunk_heads(rev_cumsum(db, -1)[..., None], T))
        return dq, dk_, dv, dbeta, dg, dS0, None, None, None


def delta_chunk(q, k, v, beta, g, S0, chunk_size: int, scale: float = 1.0):
    """Chunk form. ``q, k, v, beta`` in any float dtype (``scale`` is applied here), ``g`` clamped,
    ``S0`` in the compute dtype. Uses :class:`_DeltaChunk` (hand-written backward) while no chunk
    decays by more than ``_SAFE_SPAN`` nats; where one does (strong gates) it runs at ``chunk_size
    / 2``, ``/ 4``, … down to 16 tokens, the first size at which none does (the same function;
    :func:`~._chunked.chunks_within_span`), and only past that (hard resets, decays of ≳ 2 nats a
    token) the autograd form :func:`delta_chunk_autograd`, whose decay factors are all ``≤ 1``,
    takes over at ``chunk_size`` (as it does whenever ``torch.compile`` traces the call, and under
    ``torch.func`` transforms and forward-mode AD, which the Function does not support). Default
    ``scale=1.0`` (the inputs are used as given). Per-channel gates ``[B,T,H,K]`` take the same
    route with :class:`_KDAChunk` and :func:`kda_chunk_autograd`."""
    C = min(int(chunk_size), q.shape[1])
    if isinstance(scale, torch.Tensor):  # (a tensor scale, e.g. learned: applied here so autograd reaches it)
        q, scale = q.to(S0.dtype) * scale, 1.0
    if g is not None and g.ndim == 4:  # per-channel decays (KDA)
        cd = S0.dtype
        if not (avoid_host_reads(q) or transformed(q, k, v, beta, g, S0)):
            with torch.no_grad():
                Cs, b = chunks_within_span(g, C, cd, _SAFE_SPAN, min_chunk=_KDA_MIN_CHUNK)
            if Cs is not None:
                return _KDAChunk.apply(q, k, v, beta, g, S0, b, float(scale), Cs)
        return kda_chunk_autograd(q.to(cd) * scale, k.to(cd), v.to(cd), beta.to(cd), g, S0, chunk_size)
    # traced, or off the CPU (reading the decay back would be a host sync): the autograd form
    if avoid_host_reads(q) or transformed(q, k, v, beta, g, S0):  # (see gla_chunk)
        cd = S0.dtype
        return delta_chunk_autograd(q.to(cd) * scale, k.to(cd), v.to(cd), beta.to(cd), g, S0, chunk_size)
    b = None
    if g is not None:
        with torch.no_grad():
            C, b = chunks_within_span(g, C, S0.dtype, _SAFE_SPAN)
        if C is None:
            cd = S0.dtype
            return delta_chunk_autograd(q.to(cd) * scale, k.to(cd), v.to(cd), beta.to(cd), g, S0, chunk_size)
        b = b[..., 0]
    return _DeltaChunk.apply(q, k, v, beta, g, S0, b, float(scale), C)


def delta_parallel(q, k, v, beta, g, S0):
    """Quadratic form: the chunk algorithm with the whole sequence as one chunk."""
    if g is not None and g.ndim == 4:
        return kda_chunk_autograd(q, k, v, beta, g, S0, q.shape[1])
    return delta_chunk_autograd(q, k, v, beta, g, S0, q.shape[1])


def run_delta_core(q, k, v, beta, g, S0, mode: str, chunk_size: int, scale: float = 1.0):
    """``q, k, v, beta`` in the compute dtype (``S0``'s) for the reference forms; the chunk form
    also takes them in their own dtype and applies ``scale`` itself (default ``scale=1.0``)."""
    if q.shape[1] == 0:
        return v.new_zeros(v.shape, dtype=S0.dtype), S0
    # every form in the compute dtype under an enclosing autocast too: the hand-written chunk
    # Functions disable it themselves, but the autograd chunk form (strong decays, torch.compile,
    # CUDA), the parallel and the recurrent forms would run their matmuls in bf16 and return a
    # bf16 state
    with autocast_disabled(q.device.type):
        if mode == "chunk" and q.numel() and v.numel():  # (empty B, H or V: nothing to chunk)
            return delta_chunk(q, k, v, beta, g, S0, chunk_size, scale)
        cd = S0.dtype
        q, k, v, beta = q.to(cd) * scale, k.to(cd), v.to(cd), beta.to(cd)
        if mode == "parallel":
            return delta_parallel(q, k, v, beta, g, S0)
        return delta_recurrent(q, k, v, beta, g, S0)


def _delta(
    q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, mode, chunk_size, *, gated: bool
):
    B, T, H, K, V, N = check_matrix_op(q, k, v, mode=mode, chunk_size=chunk_size, cu_seqlens=cu_seqlens)
    check_shape("beta", beta, (B, T, H), "[B, T, H]")
    if gated:
        check_floating("g", g)
        if g.shape != (B, T, H) and g.shape != (B, T, H, K):
            raise ValueError(
                f"g must have shape [B, T, H] = [{B}, {T}, {H}] or [B, T, H, K] = [{B}, {T}, {H}, {K}], "
                f"got [{', '.join(map(str, g.shape))}]"
            )
    check_initial_state(initial_state, (N, H, K, V), "H, K, V", varlen=cu_seqlens is not None)
    op = "gated_delta_rule" if gated else "delta_rule"
    _backends.check_devices(
        op, {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": initial_state}
    )
    check_interval(
        "beta",
        beta,
        0.0,
        2.0,
        "with unit-norm keys the transition I − beta k kᵀ is a contraction only for beta in [0, 2] "
        "(beyond it the state can grow without bound; a model's beta is sigmoid(x), or 2·sigmoid(x) "
        "with allow_neg_eigval)",
    )
    dtypes = tuple(t.dtype for t in (q, k, v, beta, g, initial_state) if t is not None)
    in_transform = _backends.under_transform(q, k, v, g, beta, initial_state, scale)
    backend = _backends.select(
        _backends.Call(op, q.device, dtypes, mode, T, K, cu_seqlens is not None, V, in_transform)
    )
    if backend == "fla":
        from ._peer_ops import fla_gated_delta_rule

        return fla_gated_delta_rule(
            q,
            k,
            v,
            g,
            beta,
            scale=scale,
            initial_state=initial_state,
            output_final_state=output_final_state,
            cu_seqlens=cu_seqlens,
        )

    def core(q, k, v, beta, g=None, *, S0, scale=1.0):
        return run_delta_core(q, k, v, beta, g, S0, mode, chunk_size, scale)

    with _backends.pure_torch(backend):
        return run_matrix_op(
            core,
            {"q": q, "k": k, "v": v, "beta": beta},
            {"g": g},
            initial_state,
            (N, H, K, V),
            scale=scale,
            cu_seqlens=cu_seqlens,
            output_final_state=output_final_state,
        )


# ----------------------------------------------------------------------------------------------
# public ops
# ----------------------------------------------------------------------------------------------


def delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    mode: str = "chunk",
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Delta rule (DeltaNet; Schlag et al. 2021, Yang et al. 2024, "Parallelizing Linear
    Transformers with the Delta Rule over Sequence Length", Eq. 3): one online gradient step on
    ``½‖Sᵀk_t − v_t‖²`` with learning rate ``β_t`` per token.

        S_t = (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ        o_t = S_tᵀ (scale · q_t)

    ``gated_delta_rule`` with ``g = 0``. Keys are used as given; the update is a contraction (the
    usual setting) when ``β_t ‖k_t‖² ∈ [0, 2]``, e.g. L2-normalised keys and ``β ∈ (0, 1]``.

    Args:
        q, k: ``[B, T, H, K]``. v: ``[B, T, H, V]``.
        beta: ``[B, T, H]``, write strength in ``(0, 1]`` (``(0, 2)`` with negative eigenvalues);
            values outside ``[0, 2]`` are computed as given with a :class:`~mnemo.ops.RangeWarning`.
        scale, initial_state, output_final_state, cu_seqlens, mode, chunk_size: as in
            :func:`~mnemo.ops.gated_linear_attention` (state ``[B, H, K, V]``). Defaults:
            ``output_final_state=False``, ``chunk_size=64``.

    Returns / Raises: as :func:`~mnemo.ops.gated_linear_attention`.
    """
    return _delta(
        q,
        k,
        v,
        None,
        beta,
        scale,
        initial_state,
        output_final_state,
        cu_seqlens,
        mode,
        chunk_size,
        gated=False,
    )


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    mode: str = "chunk",
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule (Gated DeltaNet; Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks:
    Improving Mamba2 with Delta Rule", Eq. 10), and with per-channel decays Kimi Delta Attention
    (KDA; Kimi Team 2025, "Kimi Linear", arXiv 2510.26692, §3).

        S_t = exp(g_t) · (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ        o_t = S_tᵀ (scale · q_t)
        S_t = (I − β_t k_t k_tᵀ) Diag(exp(g_t)) S_{t−1} + β_t k_t v_tᵀ    (g_t ∈ R^K, KDA)

    The decay is applied before the prediction error: ``S' = exp(g_t) S_{t−1}`` (per channel: row
    ``c`` of ``S_{t−1}`` times ``exp(g_tc)``), ``S_t = S' + β_t k_t (v_t − S'ᵀ k_t)ᵀ``. With
    ``g = 0`` this is ``delta_rule``; a per-channel ``g`` equal across ``K`` is the scalar one.

    Args:
        q, k: ``[B, T, H, K]``. v: ``[B, T, H, V]``.
        g: ``[B, T, H]`` (one decay per head) or ``[B, T, H, K]`` (one per key channel), log
            decay (``≤ 0``; ``exp(g)`` is the retained fraction per token). Values below ``-60``
            are clamped to ``-60`` (so ``-inf`` is a hard reset with no NaN); the chunked forms
            treat decay factors below ``exp(-40)`` as exactly ``0``.
        beta: ``[B, T, H]``, write strength in ``(0, 1]`` (``(0, 2)`` with negative eigenvalues);
            values outside ``[0, 2]`` are computed as given with a :class:`~mnemo.ops.RangeWarning`.
        scale, initial_state, output_final_state, cu_seqlens, mode, chunk_size: as in
            :func:`~mnemo.ops.gated_linear_attention` (state ``[B, H, K, V]``). Defaults:
            ``output_final_state=False``, ``chunk_size=64``.

    Returns / Raises: as :func:`~mnemo.ops.gated_linear_attention`.
    """
    return _delta(
        q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, mode, chunk_size, gated=True
    )


def delta_rule_map(q, k, beta, g=None, scale: float | None = None) -> torch.Tensor:
    """The ``T × T`` matrix the (gated) delta rule's parallel (WY) form multiplies the values by:
    ``o = P A⁻¹ diag(β) V`` with ``P = (scale · Q Kᵀ) ⊙ Γ`` (causal) and
    ``A = I + strict_tril(diag(β) (K Kᵀ) ⊙ Γ)``, so ``M = P A⁻¹ diag(β)`` (from a zero state).
    ``q, k: [B, T, H, K]``, ``beta: [B, T, H]``, ``g``: ``None`` or log gates ``[B, T, H]`` or
    ``[B, T, H, K]`` (per channel: ``(Q Kᵀ) ⊙ Γ`` becomes ``Σ_c q_tc k_sc Γ_ts(c)``, likewise
    ``K Kᵀ``). Returns ``[B, H, T, T]``."""
    T = q.shape[1]
    scale = default_scale(scale, q.shape[-1])
    qh, kh = rearrange(q * scale, "b t h d -> b h t d"), rearrange(k, "b t h d -> b h t d")
    bh = rearrange(beta, "b t h -> b h t")
    if g is not None and g.ndim == 4:
        Gam = decay_matrix(g).to(q.dtype)  # [B, H, T, T, K]
        kk = (kh[..., :, None, :] * kh[..., None, :, :] * Gam).sum(-1)
        qk = (qh[..., :, None, :] * kh[..., None, :, :] * Gam).sum(-1)
    else:
        Gam = decay_matrix(g).to(q.dtype) if g is not None else causal_mask(T, q.device).to(q.dtype)
        kk, qk = (kh @ kh.transpose(-1, -2)) * Gam, (qh @ kh.transpose(-1, -2)) * Gam
    A = torch.eye(T, dtype=q.dtype, device=q.device) + (bh[..., :, None] * kk).masked_fill(
        ~causal_mask(T, q.device, -1), 0.0
    )
    P = qk
    return P @ torch.linalg.solve_triangular(A, torch.diag_embed(bh), upper=False, unitriangular=True)
