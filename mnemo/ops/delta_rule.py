"""The delta rule: a matrix memory trained online on the L2 loss ``½‖Sᵀk − v‖²`` (DeltaNet), with an
optional scalar decay per head (Gated DeltaNet).

    S_t = exp(g_t) · (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ          o_t = S_tᵀ (scale · q_t)

The decay is applied *before* the prediction error is computed: with ``S' = exp(g_t) S_{t−1}``,
``S_t = S' + β_t k_t (v_t − S'ᵀ k_t)ᵀ``. DeltaNet (Schlag et al. 2021; Yang et al. 2024, "Parallelizing
Linear Transformers with the Delta Rule over Sequence Length") is ``g ≡ 0``; Gated DeltaNet (Yang,
Kautz & Hatamizadeh 2024, "Gated Delta Networks: Improving Mamba2 with Delta Rule", Eq. 10) adds
``g``.

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
  instead of as products of many small ones. Decays are formed as ``exp`` of differences masked
  *before* the ``exp`` (``Γ``) or of non-positive cumulative sums (``exp(b)``, ``exp(b_C − b)``,
  ``exp(b_C)``), never ``exp(−b)``, so extreme gates cannot overflow; factors below
  ``exp(−40) ≈ 4e-18`` are set to exactly ``0``, which keeps float32 subnormals (several times
  slower on CPUs) out of the matmuls.
* ``parallel``  — the same algorithm with the whole sequence as one chunk (one ``T × T``
  triangular solve): the quadratic form.

Gradients come from autograd through these tensor operations; what autograd keeps for the backward
pass is ``O(T·(C + K + V) + (T/C)·K·(K + V))`` per head (chunk-level states, never per-token
``K × V`` states).
"""

from __future__ import annotations

import torch
from einops import rearrange

from ._common import (
    check_cu_seqlens,
    check_finite,
    check_initial_state,
    check_mode,
    check_qkv,
    check_shape,
    clamp_log_gate,
    compute_dtype,
    decay_exp,
    run_varlen,
)
from .gated_linear_attention import check_chunk_size

__all__ = ["delta_rule", "gated_delta_rule"]

# ----------------------------------------------------------------------------------------------
# cores: inputs already validated, in the compute dtype, q already scaled, g clamped (or None)
# ----------------------------------------------------------------------------------------------


def delta_recurrent(q, k, v, beta, g, S0):
    """Token loop. ``q, k: [B,T,H,K]``, ``v: [B,T,H,V]``, ``beta: [B,T,H]``, ``g``: None | [B,T,H]."""
    S = S0
    outs = []
    for t in range(q.shape[1]):
        if g is not None:
            S = S * g[:, t].exp()[..., None, None]  # decay first ...
        err = v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S)  # ... then the prediction error
        S = S + (beta[:, t, :, None] * k[:, t])[..., None] * err[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    return torch.stack(outs, 1), S


def _causal_mask(n: int, device, diagonal: int = 0) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).tril(diagonal)


def delta_chunk(q, k, v, beta, g, S0, chunk_size: int):
    """Chunkwise-parallel (WY / UT-transform) form; see the module docstring. ``T ≥ 1``."""
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
    incl = _causal_mask(C, q.device)
    strict = _causal_mask(C, q.device, -1)
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
        b = rearrange(g, "b (n c) h -> b h n c", c=C).cumsum(-1)
        Gam = decay_exp(b[..., :, None] - b[..., None, :], incl)
        A = (bkk * Gam).masked_fill(~strict, 0.0) + eye
        U = torch.linalg.solve_triangular(A, bc * vc, upper=False, unitriangular=True)
        # A = E Ã E⁻¹ with E = diag(exp(b)), so W = A⁻¹ diag(β) (K ⊙ exp(b)) = exp(b) ⊙ W̃ and
        # M = exp(b_C) I − (K ⊙ exp(b_C − b))ᵀ W = exp(b_C) (I − Kᵀ W̃): each decay enters once.
        W_free = torch.linalg.solve_triangular(A_free, bc * kc, upper=False, unitriangular=True)
        eb = decay_exp(b[..., None])  # [B, H, n, C, 1]
        last = b[..., -1:]
        M = decay_exp(last)[..., None] * (eyeK - kt @ W_free)
        D = (kc * decay_exp((last - b)[..., None])).transpose(-1, -2) @ U
        P = qk * Gam
        q_in, W = qc * eb, W_free
    # unbind (not indexing) so the backward pass stacks the per-chunk gradients once
    Ms = rearrange(M, "b h n k j -> n (b h) k j").unbind(0)
    Ds = rearrange(D, "b h n k v -> n (b h) k v").unbind(0)
    S = rearrange(S0, "b h k v -> (b h) k v")
    states = []
    for i in range(n):
        states.append(S)
        S = torch.baddbmm(Ds[i], Ms[i], S)
    states = rearrange(torch.stack(states, 0), "n (b h) k v -> b h n k v", b=B)  # entering each chunk
    S = rearrange(S, "(b h) k v -> b h k v", b=B)
    ws = W @ states
    v_new = U - (ws if eb is None else eb * ws)  # written values U − W S per chunk
    o = q_in @ states + P @ v_new
    o = rearrange(o, "b h n c v -> b (n c) h v")[:, :T]
    return o, S


def delta_parallel(q, k, v, beta, g, S0):
    """Quadratic form: the chunk algorithm with the whole sequence as one chunk."""
    return delta_chunk(q, k, v, beta, g, S0, q.shape[1])


def run_delta_core(q, k, v, beta, g, S0, mode: str, chunk_size: int):
    if q.shape[1] == 0:
        return v.new_zeros(v.shape), S0
    if mode == "chunk":
        return delta_chunk(q, k, v, beta, g, S0, chunk_size)
    if mode == "parallel":
        return delta_parallel(q, k, v, beta, g, S0)
    return delta_recurrent(q, k, v, beta, g, S0)


def _delta(
    q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, mode, chunk_size, *, gated: bool
):
    check_mode(mode, ("recurrent", "chunk", "parallel"))
    check_chunk_size(chunk_size)
    B, T, H, K, V = check_qkv(q, k, v)
    check_shape("beta", beta, (B, T, H), "[B, T, H]")
    if gated:
        check_shape("g", g, (B, T, H), "[B, T, H]")
    N = check_cu_seqlens(cu_seqlens, B, T) if cu_seqlens is not None else B
    check_initial_state(initial_state, N, H, K, V, varlen=cu_seqlens is not None)
    check_finite({"q": q, "k": k, "v": v, "beta": beta, "initial_state": initial_state}, {"g": g})
    cd = compute_dtype(q, k, v, g, beta, initial_state)
    scale = K**-0.5 if scale is None else scale
    qc = q.to(cd) * scale
    kc, vc, bc = k.to(cd), v.to(cd), beta.to(cd)
    gc = None if g is None else clamp_log_gate(g.to(cd))
    S0 = initial_state.to(cd) if initial_state is not None else q.new_zeros(N, H, K, V, dtype=cd)
    if cu_seqlens is None:
        o, S = run_delta_core(qc, kc, vc, bc, gc, S0, mode, chunk_size)
    else:
        tensors = {"q": qc, "k": kc, "v": vc, "beta": bc}
        if gc is not None:
            tensors["g"] = gc

        def fn(q, k, v, beta, g=None):
            return run_delta_core(q, k, v, beta, g, S0, mode, chunk_size)

        o, S = run_varlen(fn, cu_seqlens, tensors)
    return o.to(q.dtype), (S if output_final_state else None)


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
        beta: ``[B, T, H]``, write strength in ``(0, 1]``.
        scale: multiplies ``q``; default ``K ** -0.5``.
        initial_state: ``[B, H, K, V]`` (``[N, H, K, V]`` with ``cu_seqlens``); any float dtype,
            used in the compute dtype. Gradients flow into it.
        output_final_state: also return the state after the last token.
        cu_seqlens: ``[N + 1]`` int offsets of ``N`` sequences packed in ``B = 1``; the state is
            reset (to the matching row of ``initial_state``) at every boundary.
        mode: ``"chunk"`` (training, default) | ``"parallel"`` (quadratic) | ``"recurrent"``
            (token-loop reference). All three give the same result.
        chunk_size: chunk length of the chunk form.

    Returns:
        ``o: [B, T, H, V]`` in ``q``'s dtype, and ``final_state: [B, H, K, V]`` (``[N, ...]`` with
        ``cu_seqlens``) in the compute dtype (float64 if any input is float64, else float32), or
        ``None``.

    Raises:
        ValueError / TypeError: a shape, dtype, mode or chunk size does not match; the message
            names the argument, the expected and the received value.
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
    Improving Mamba2 with Delta Rule", Eq. 10).

        S_t = exp(g_t) · (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ        o_t = S_tᵀ (scale · q_t)

    The decay is applied before the prediction error: ``S' = exp(g_t) S_{t−1}``,
    ``S_t = S' + β_t k_t (v_t − S'ᵀ k_t)ᵀ``. With ``g = 0`` this is ``delta_rule``.

    Args:
        q, k: ``[B, T, H, K]``. v: ``[B, T, H, V]``.
        g: ``[B, T, H]``, log decay (``≤ 0``; ``exp(g)`` is the retained fraction per token).
            Values below ``-60`` are clamped to ``-60`` (so ``-inf`` is a hard reset with no NaN);
            the chunked forms treat decay factors below ``exp(-40)`` as exactly ``0``.
        beta: ``[B, T, H]``, write strength in ``(0, 1]``.
        scale: multiplies ``q``; default ``K ** -0.5``.
        initial_state: ``[B, H, K, V]`` (``[N, H, K, V]`` with ``cu_seqlens``); any float dtype,
            used in the compute dtype. Gradients flow into it.
        output_final_state: also return the state after the last token.
        cu_seqlens: ``[N + 1]`` int offsets of ``N`` sequences packed in ``B = 1``; the state is
            reset (to the matching row of ``initial_state``) at every boundary.
        mode: ``"chunk"`` (training, default) | ``"parallel"`` (quadratic) | ``"recurrent"``
            (token-loop reference). All three give the same result.
        chunk_size: chunk length of the chunk form.

    Returns:
        ``o: [B, T, H, V]`` in ``q``'s dtype, and ``final_state: [B, H, K, V]`` (``[N, ...]`` with
        ``cu_seqlens``) in the compute dtype (float64 if any input is float64, else float32), or
        ``None``.

    Raises:
        ValueError / TypeError: a shape, dtype, mode or chunk size does not match; the message
            names the argument, the expected and the received value.
    """
    return _delta(
        q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, mode, chunk_size, gated=True
    )
