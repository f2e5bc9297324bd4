"""SSD: the state-space dual of Mamba-2, computed as gated linear attention.

    h_t = exp(dt_t A) · h_{t−1} + B_t (dt_t x_t)ᵀ          y_t = h_tᵀ C_t + D x_t

With a scalar ``A`` per head, the decay ``exp(dt_t A)`` is one number per head and token, so the
recurrence is exactly :func:`~mnemo.ops.gated_linear_attention` with ``q = C``, ``k = B``,
``v = dt · x``, log gate ``g = dt · A`` (one per head) and ``scale = 1`` (Dao & Gu 2024,
"Transformers are SSMs", §3–§6: the quadratic "attention" form and the chunkwise SSD algorithm are
GLA's ``parallel`` and ``chunk`` forms). This module maps arguments and adds the skip ``D x``; the
chunk form runs :func:`~mnemo.ops._ssd_chunk.ssd_chunk` (``B``/``C`` per group, never repeated over
heads; every decay factor ``≤ 1``), the other forms, variable-length handling and the log-gate
clamp (``-60``) come from gated linear attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import dispatch as _backends
from ._common import (
    _shape,
    check_finite,
    check_form,
    check_groups,
    check_initial_state,
    check_ndim,
    check_shape,
    check_sign,
    compute_dtype,
    num_sequences,
    transformed,
)
from ._layout import repeat
from ._ssd_chunk import run_ssd_chunk
from .gated_linear_attention import gated_linear_attention, gated_linear_attention_map

__all__ = ["ssd", "ssd_map"]


def ssd(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    *,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    mode: str = "chunk",
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Mamba-2 SSD layer recurrence (Dao & Gu 2024, "Transformers are SSMs: Generalized Models and
    Efficient Algorithms Through Structured State Space Duality", Eq. 1 with scalar-times-identity A).

        dt_t ← softplus(dt_t + dt_bias) if dt_softplus else dt_t + dt_bias
        h_t = exp(dt_t A) h_{t−1} + B_t (dt_t x_t)ᵀ        y_t = h_tᵀ C_t + D x_t

    per head; head ``h`` reads group ``h // (H / G)`` of ``B`` and ``C``. Computes
    ``gated_linear_attention(q=C, k=B, v=dt·x, g=dt·A, scale=1)``: ``mode="chunk"`` (without
    ``cu_seqlens``) by its own grouped chunk form (:mod:`mnemo.ops._ssd_chunk`: the score matrix
    ``C Bᵀ`` once per group, a hand-written backward, safe for any decay), every other case by
    gated linear attention with ``B``, ``C`` repeated over heads.

    Args:
        x: ``[B, T, H, P]``. dt: ``[B, T, H]`` step size (before bias / softplus).
        A: ``[H]`` one scalar per head, normally negative (``A = −exp(A_log)``); the log decay
            ``dt · A`` is clamped from below at ``-60``.
        B, C: ``[B, T, N]`` (one group) or ``[B, T, G, N]`` with ``H % G == 0``.
        D: ``[H]`` skip connection, or ``None``.
        dt_bias: ``[H]`` added to ``dt``, or ``None``. dt_softplus: apply softplus to ``dt``
            (default ``dt_softplus=False``).
        initial_state: ``[B, H, N, P]`` (``[num_seqs, H, N, P]`` with ``cu_seqlens``); any float
            dtype, used in the compute dtype. Gradients flow into it and into every input.
        output_final_state: also return the state after the last token (default ``False``).
        cu_seqlens: ``[num_seqs + 1]`` int offsets of sequences packed in ``B = 1``; the state is
            reset (to the matching row of ``initial_state``) at every boundary.
        mode: ``"chunk"`` (training, default) | ``"parallel"`` (quadratic) | ``"recurrent"``
            (token-loop reference). All three give the same result.
        chunk_size: chunk length of the chunk form (default ``64``).

    Returns:
        ``y: [B, T, H, P]`` in ``x``'s dtype, and ``final_state: [B, H, N, P]`` (``[num_seqs, ...]``
        with ``cu_seqlens``) in the compute dtype (float64 if any input is float64, else float32),
        or ``None``. ``T = 0`` passes the state through.

    Raises:
        ValueError / TypeError: a shape, dtype, mode or chunk size does not match; the message
            names the argument, the expected and the received value.
    """
    check_form(mode, chunk_size)
    check_ndim("x", x, 4, "[B, T, H, P]")
    Bsz, T, H, P = x.shape
    check_shape("dt", dt, (Bsz, T, H), "[B, T, H]")
    check_shape("A", A, (H,), "[H]")
    B4 = check_groups("B", B, Bsz, T, None, H, "H")
    N = B4.shape[-1]
    if N == 0:
        raise ValueError(f"B and C need a state size N >= 1, got B of shape {_shape(B)}")
    C4 = check_groups("C", C, Bsz, T, N, H, "H")
    if C4.shape[2] != B4.shape[2]:
        raise ValueError(f"C must have the same number of groups as B = {B4.shape[2]}, got {_shape(C)}")
    if D is not None:
        check_shape("D", D, (H,), "[H]")
    if dt_bias is not None:
        check_shape("dt_bias", dt_bias, (H,), "[H]")
    tensors = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, dt_bias=dt_bias, initial_state=initial_state)
    _backends.check_devices("ssd", tensors)
    nseq = num_sequences(cu_seqlens, Bsz, T)
    check_initial_state(
        initial_state, (nseq, H, N, P), "H, N, P", varlen=cu_seqlens is not None, seqs="num_seqs"
    )
    # NaN/inf named as given (the forms below see only dt·x and dt·A, and never D)
    check_finite(
        {"x": x, "dt": dt, "A": A, "B": B, "C": C, "D": D, "dt_bias": dt_bias, "initial_state": initial_state}
    )
    cd = compute_dtype(x, dt, A, B, C, D, dt_bias, initial_state)
    dtypes = tuple(t.dtype for t in (x, dt, A, B, C, D, dt_bias, initial_state) if t is not None)
    in_transform = _backends.under_transform(x, dt, A, B, C, D, dt_bias, initial_state)
    backend = _backends.select(
        _backends.Call("ssd", x.device, dtypes, mode, T, N, cu_seqlens is not None, P, in_transform)
    )
    xc = x.to(cd)
    dtc = dt.to(cd)
    if dt_bias is not None:
        dtc = dtc + dt_bias.to(cd)
    if dt_softplus:
        dtc = F.softplus(dtc)
    check_sign("A", A, "<= 0", "the decay exp(dt * A) must be at most 1 (A = -exp(A_log))")
    check_sign(
        "dt" if dt_bias is None else "dt + dt_bias",
        dtc,
        ">= 0",
        "a step size is not negative (pass dt_softplus=True to map any value there)",
    )
    if backend == "mamba_ssm":
        from ._peer_ops import mamba_ssd

        return mamba_ssd(
            x,
            dtc,
            A,
            B4,
            C4,
            D,
            initial_state=initial_state,
            output_final_state=output_final_state,
            chunk_size=chunk_size,
        )
    with _backends.pure_torch(backend):
        return _ssd_own(
            x,
            xc,
            dtc,
            A,
            B4,
            C4,
            D,
            initial_state,
            output_final_state,
            cu_seqlens,
            mode,
            chunk_size,
            cd,
            backend,
        )


def _ssd_own(
    x, xc, dtc, A, B4, C4, D, initial_state, output_final_state, cu_seqlens, mode, chunk_size, cd, backend
):
    """:func:`ssd` on mnemo's own forms (torch, native), or (``backend="fla"``) on gated linear
    attention's fla kernel with ``B``, ``C`` repeated over heads."""
    H = xc.shape[2]
    v = xc * dtc[..., None]
    g = dtc * A.to(cd)
    grouped = backend != "fla" and mode == "chunk" and cu_seqlens is None and x.numel() and B4.numel()
    # (under torch.func transforms / forward-mode AD, which _SSDChunk does not support: GLA's chunk
    # form, which runs its autograd form there)
    if grouped and not transformed(v, g, B4, C4, initial_state):
        # the grouped chunk form: B, C never repeated over heads, safe for any decay
        y, S = run_ssd_chunk(C4, B4, v, g, initial_state, chunk_size)
        if D is not None:
            y = y + xc * D.to(cd)[:, None]
        return y.to(x.dtype), (S if output_final_state else None)
    r = H // B4.shape[2]
    q = repeat(C4.to(cd), "b t g n -> b t (g r) n", r=r)
    k = repeat(B4.to(cd), "b t g n -> b t (g r) n", r=r)
    y, S = gated_linear_attention(
        q,
        k,
        v,
        g,
        scale=1.0,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        mode=mode,
        chunk_size=chunk_size,
    )
    if D is not None:
        y = y + xc * D.to(cd)[:, None]
    return y.to(x.dtype), S


def ssd_map(dt, A, B, C) -> torch.Tensor:
    """The ``T × T`` matrix of SSD (Mamba-2) per head, from a zero state and without the ``D``
    skip: ``M_ts = (C_t · B_s) exp(Σ_{r=s+1..t} dt_r A_h) dt_s`` for ``s ≤ t``, so that
    ``y = M x``. ``dt [B, T, H]`` (after softplus and bias), ``A [H]`` (negative), ``B, C`` as the
    op takes them: ``[B, T, N]`` or ``[B, T, G, N]`` (head ``h`` reads group ``h // (H / G)``; ``G = H``:
    per head). Returns ``[B, H, T, T]``."""
    Bsz, T, H = dt.shape
    B4 = check_groups("B", B, Bsz, T, None, H, "H")
    C4 = check_groups("C", C, Bsz, T, B4.shape[-1], H, "H")
    q, k = (repeat(X, "b t g n -> b t (g r) n", r=H // X.shape[2]) for X in (C4, B4))
    return gated_linear_attention_map(q, k, dt * A, scale=1.0) * dt.transpose(1, 2)[:, :, None, :]
