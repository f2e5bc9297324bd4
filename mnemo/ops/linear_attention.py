"""Linear attention: the Hebbian matrix memory with a kernel feature map (Katharopoulos et al. 2020)."""

from __future__ import annotations

import math

import torch

from . import dispatch as _backends
from ._common import (
    check_finite,
    check_initial_state,
    check_matrix_op,
    compute_dtype,
    default_scale,
    run_core,
    state_or_zeros,
)
from .feature_maps import identity, resolve_feature_map
from .gated_linear_attention import gated_linear_attention_map, run_gla_core

__all__ = ["linear_attention", "linear_attention_map"]


def linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    feature_map=None,
    normalize: bool = False,
    scale: float | None = None,
    eps: float = 1e-6,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    mode: str = "chunk",
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Linear attention (Katharopoulos et al. 2020, "Transformers are RNNs", Eq. 4–6).

        S_i = S_{i−1} + φ(k_i) v_iᵀ        z_i = z_{i−1} + φ(k_i)
        o_i = φ(q_i)ᵀ S_i                            (normalize=False)
        o_i = φ(q_i)ᵀ S_i / (φ(q_i)ᵀ z_i + eps)       (normalize=True, the paper's Eq. 5)

    ``q`` is multiplied by ``scale`` *before* the feature map, so ``"taylor"`` and
    :class:`~mnemo.ops.feature_maps.FavorPlus` estimate ``exp(scale · qᵀk)`` (softmax attention).

    Args:
        q, k: ``[B, T, H, K]``. v: ``[B, T, H, V]``.
        feature_map: ``None``/``"identity"``, ``"elu"``, ``"relu"``, ``"taylor"`` or a callable
            ``[..., K] -> [..., F]`` (e.g. ``FavorPlus``). The state lives in feature space ``F``.
        normalize: divide by ``φ(q)ᵀ z`` (the normaliser is carried in the state, see below;
            default ``False``).
        scale: multiplies ``q`` before ``φ``; default ``K ** -0.5``; a negative one is computed as
            given with a :class:`~mnemo.ops.RangeWarning`.
        eps: added to the normaliser (``normalize=True`` only; default ``1e-6``).
        initial_state: ``[B, H, F, V]``, or ``[B, H, F, V + 1]`` when ``normalize=True`` (the last
            column is the normaliser ``z``). ``[N, ...]`` rows with ``cu_seqlens``.
        output_final_state, cu_seqlens, mode, chunk_size: as in
            :func:`~mnemo.ops.gated_linear_attention`. Defaults: ``output_final_state=False``,
            ``chunk_size=64``.

    Returns:
        ``o: [B, T, H, V]`` in ``q``'s dtype; ``final_state`` ``[B, H, F, V (+1)]`` in the compute
        dtype (float64 if any input is float64, else float32), or ``None``.

    Raises:
        ValueError / TypeError: shape, dtype, mode or feature-map errors; the message names the
            argument, the expected and the received value.
    """
    B, T, H, K, V, N = check_matrix_op(q, k, v, mode=mode, chunk_size=chunk_size, cu_seqlens=cu_seqlens)
    _backends.check_devices("linear_attention", {"q": q, "k": k, "v": v, "initial_state": initial_state})
    phi = resolve_feature_map(feature_map)
    check_finite({"q": q, "k": k, "v": v, "initial_state": initial_state})
    cd = compute_dtype(q, k, v, initial_state)
    scale = default_scale(scale, K)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0 (added to the normaliser), got {eps!r}")
    dtypes = tuple(t.dtype for t in (q, k, v, initial_state) if t is not None)
    backend = _backends.select(
        _backends.Call(
            "linear_attention",
            q.device,
            dtypes,
            mode,
            T,
            K,
            cu_seqlens is not None,
            V,
            _backends.under_transform(q, k, v, initial_state, scale),
        )
    )
    if backend != "fla":
        with _backends.pure_torch(backend):
            return _linear_attention_own(
                q,
                k,
                v,
                phi,
                normalize,
                scale,
                eps,
                initial_state,
                output_final_state,
                cu_seqlens,
                mode,
                chunk_size,
                cd,
                N,
            )
    from ._peer_ops import fla_linear_attention

    if phi is identity and not normalize:
        qf, kf, vc, sc = q, k, v, scale
    else:  # the feature map (and the normaliser's column of ones) here, the recurrence in fla
        qf, kf, vc, sc = phi(q.to(cd) * scale), phi(k.to(cd)), v.to(cd), 1.0
        _check_features(qf, kf, B, T, H)
        if normalize:
            vc = torch.cat([vc, vc.new_ones(*vc.shape[:-1], 1)], dim=-1)
    check_initial_state(
        initial_state, (N, H, qf.shape[-1], vc.shape[-1]), "H, K, V", varlen=cu_seqlens is not None
    )
    o, S = fla_linear_attention(qf, kf, vc, scale=sc, initial_state=initial_state, cu_seqlens=cu_seqlens)
    if normalize:
        o = o[..., :V] / (o[..., V:] + eps)
    return o.to(q.dtype), (S if output_final_state else None)


def _check_features(qf, kf, B, T, H) -> None:
    if not (isinstance(qf, torch.Tensor) and isinstance(kf, torch.Tensor)):
        raise TypeError(
            f"feature_map must return a tensor [B, T, H, F], got {type(qf).__name__} and {type(kf).__name__}"
        )
    if qf.ndim != 4 or qf.shape != kf.shape or qf.shape[:3] != (B, T, H):
        raise ValueError(
            f"feature_map must map [B, T, H, K] to [B, T, H, F] for q and k alike, got "
            f"{list(qf.shape)} and {list(kf.shape)}"
        )


def _linear_attention_own(
    q,
    k,
    v,
    phi,
    normalize,
    scale,
    eps,
    initial_state,
    output_final_state,
    cu_seqlens,
    mode,
    chunk_size,
    cd,
    N,
):
    """mnemo's own forms of :func:`linear_attention` (the torch and native backends)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if phi is identity and not normalize and cu_seqlens is None:
        # the chunk form converts and scales q itself, in its single layout pass
        check_initial_state(initial_state, (N, H, K, V), "H, K, V", varlen=False)
        S0 = state_or_zeros(initial_state, (N, H, K, V), cd, q)
        o, S = run_gla_core(q, k, v, None, S0, mode, chunk_size, scale)
        return o.to(q.dtype), (S if output_final_state else None)
    qf = phi(q.to(cd) * scale)
    kf = phi(k.to(cd))
    _check_features(qf, kf, B, T, H)
    Fdim = qf.shape[-1]
    vc = v.to(cd)
    if normalize:
        vc = torch.cat([vc, vc.new_ones(*vc.shape[:-1], 1)], dim=-1)
    Vs = vc.shape[-1]
    check_initial_state(initial_state, (N, H, Fdim, Vs), "H, K, V", varlen=cu_seqlens is not None)
    S0 = state_or_zeros(initial_state, (N, H, Fdim, Vs), cd, q)

    def core(q, k, v, scale=1.0):
        return run_gla_core(q, k, v, None, S0, mode, chunk_size, scale)

    o, S = run_core(core, {"q": qf, "k": kf, "v": vc}, scale=1.0, cu_seqlens=cu_seqlens, dtype=cd)
    if normalize:
        o = o[..., :V] / (o[..., V:] + eps)
    return o.to(q.dtype), (S if output_final_state else None)


def linear_attention_map(q, k, feature_map="elu", normalize: bool = True, scale: float | None = None):
    """The ``T × T`` matrix linear attention multiplies the values by, per head: ``M_ts =
    φ(scale · q_t)ᵀ φ(k_s)`` for ``s ≤ t``, divided by its row sum ``+ 1e-6`` when ``normalize``
    (default ``normalize=True``; the op's denominator ``φ(q_t)ᵀ Σ_s φ(k_s)``), so that ``o = M v``.
    ``q, k: [B, T, H, K]``;
    ``feature_map`` as in :func:`linear_attention`. Returns ``[B, H, T, T]``."""
    phi = resolve_feature_map(feature_map)
    scale = default_scale(scale, q.shape[-1])
    qf, kf = phi(q * scale), phi(k)
    _check_features(qf, kf, *q.shape[:3])
    M = gated_linear_attention_map(qf, kf, scale=1.0)
    return M / (M.sum(-1, keepdim=True) + 1e-6) if normalize else M
