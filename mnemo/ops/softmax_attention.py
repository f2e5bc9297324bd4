"""Softmax attention: the non-parametric memory (a KV cache that grows with T)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from einops import rearrange, repeat

from ._common import _shape, check_cu_seqlens, check_finite, check_floating, check_mode, compute_dtype

__all__ = ["softmax_attention", "KVCache", "attention_mask", "softmax_attention_map"]


class KVCache(NamedTuple):
    """Past keys ``k: [B, P, Hkv, K]`` and values ``v: [B, P, Hkv, V]`` (the attention "state")."""

    k: torch.Tensor
    v: torch.Tensor


def attention_mask(
    T: int,
    S: int,
    *,
    causal: bool = True,
    window: int | None = None,
    segment_ids: torch.Tensor | None = None,
    device=None,
) -> torch.Tensor:
    """Boolean ``[T, S]`` mask (True = may attend) for ``T`` queries over ``S = P + T`` keys.

    Query ``t`` sits at key position ``i = S − T + t``. Causal: keys ``j ≤ i``. A sliding
    ``window`` keeps the ``window`` most recent keys ``i − window < j ≤ i`` (``|i − j| < window``
    when not causal). ``segment_ids: [S]`` further restricts attention to the same segment.
    """
    i = torch.arange(S - T, S, device=device)[:, None]
    j = torch.arange(S, device=device)[None, :]
    mask = torch.ones(T, S, dtype=torch.bool, device=device)
    if causal:
        mask &= j <= i
    if window is not None:
        mask &= (i - j < window) if causal else ((i - j).abs() < window)
    if segment_ids is not None:
        mask &= segment_ids[S - T :, None] == segment_ids[None, :]
    return mask


#: query block of the blockwise sliding-window path (keys per block: block + window − 1)
WINDOW_BLOCK = 1024


def sliding_window_attention(
    qh, kh, vh, window: int, scale: float, prefix_k=None, prefix_v=None, block: int = WINDOW_BLOCK
):
    """Causal sliding-window attention in query blocks, ``O(T · window)`` time and memory.

    ``qh: [B, H, T, D]`` are the last ``T`` of the ``S`` keys ``kh, vh: [B, H, S, D]``. Optional
    ``prefix_k, prefix_v: [B, H, P, D]`` are keys every query sees (e.g. persistent memory).
    """
    T, S = qh.shape[2], kh.shape[2]
    P = 0 if prefix_k is None else prefix_k.shape[2]
    outs = []
    for t0 in range(0, T, block):
        t1 = min(T, t0 + block)
        hi = S - T + t1
        lo = max(0, S - T + t0 - window + 1)
        keys, vals = kh[:, :, lo:hi], vh[:, :, lo:hi]
        mask = attention_mask(t1 - t0, hi - lo, causal=True, window=window, device=qh.device)
        if P:
            keys, vals = torch.cat([prefix_k, keys], 2), torch.cat([prefix_v, vals], 2)
            mask = torch.cat([torch.ones(t1 - t0, P, dtype=torch.bool, device=qh.device), mask], 1)
        outs.append(F.scaled_dot_product_attention(qh[:, :, t0:t1], keys, vals, attn_mask=mask, scale=scale))
    return torch.cat(outs, 2)


def _check(q, k, v, window, initial_state):
    check_floating("q", q)
    check_floating("k", k)
    check_floating("v", v)
    if q.ndim != 4:
        raise ValueError(f"q must have shape [B, T, H, K], got {_shape(q)}")
    B, T, H, K = q.shape
    if k.ndim != 4 or k.shape[0] != B or k.shape[1] != T or k.shape[3] != K:
        raise ValueError(f"k must have shape [B, T, Hkv, K] = [{B}, {T}, Hkv, {K}], got {_shape(k)}")
    Hkv = k.shape[2]
    if v.ndim != 4 or tuple(v.shape[:3]) != (B, T, Hkv):
        raise ValueError(f"v must have shape [B, T, Hkv, V] = [{B}, {T}, {Hkv}, V], got {_shape(v)}")
    if Hkv < 1 or H % Hkv:
        raise ValueError(
            f"the number of query heads must be a multiple of the key/value heads (grouped-query "
            f"attention), got H = {H} query heads and Hkv = {Hkv}"
        )
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be None or a positive int, got {window!r}")
    if initial_state is not None:
        if not isinstance(initial_state, tuple) or len(initial_state) != 2:
            raise TypeError("initial_state must be a KVCache(k, v) tuple of past keys and values")
        kc, vc = initial_state
        if kc.ndim != 4 or (kc.shape[0], kc.shape[2], kc.shape[3]) != (B, Hkv, K):
            raise ValueError(
                f"initial_state.k must have shape [B, P, Hkv, K] = [{B}, P, {Hkv}, {K}], got {_shape(kc)}"
            )
        if vc.ndim != 4 or tuple(vc.shape) != (B, kc.shape[1], Hkv, v.shape[3]):
            raise ValueError(
                f"initial_state.v must have shape [B, P, Hkv, V] = [{B}, {kc.shape[1]}, {Hkv}, "
                f"{v.shape[3]}], got {_shape(vc)}"
            )
    return B, T, H, K, Hkv


def softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    window: int | None = None,
    scale: float | None = None,
    initial_state: KVCache | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    mode: str = "parallel",
) -> tuple[torch.Tensor, KVCache | None]:
    """Scaled dot-product softmax attention (Vaswani et al. 2017), with grouped-query heads
    (Ainslie et al. 2023), an optional sliding window and a KV cache for decoding.

        o_i = Σ_j softmax_j(scale · q_iᵀ k_j) v_j     over the keys ``j`` allowed for query ``i``

    Args:
        q: ``[B, T, H, K]``. k: ``[B, T, Hkv, K]``, v: ``[B, T, Hkv, V]`` with ``H % Hkv == 0``;
            query head ``h`` reads key/value head ``h // (H / Hkv)``.
        causal: mask future keys. window: attend only to the ``window`` most recent keys
            (including the query's own position).
        scale: default ``K ** -0.5``.
        initial_state: a :class:`KVCache` of ``P`` past keys/values; the new queries sit at
            positions ``P … P+T−1`` and also attend to them (one-token decoding: ``T = 1``).
        output_final_state: return the cache extended by this call's ``k, v`` (with a window,
            only its last ``window − 1`` entries, all a next token can see).
        cu_seqlens: ``[N + 1]`` offsets of packed sequences (``B = 1``): attention stays inside each
            sequence. No cache in or out in this case.
        mode: ``"parallel"`` (``torch.nn.functional.scaled_dot_product_attention``) or
            ``"recurrent"`` (a token loop with an explicit softmax, the reference).

    Returns:
        ``o: [B, T, H, V]`` in ``q``'s dtype, and the :class:`KVCache` or ``None``.

    Raises:
        ValueError / TypeError: shapes, head counts, window, cache or mode do not match; the
            message names the argument, the expected and the received value.
    """
    check_mode(mode, ("parallel", "recurrent"))
    B, T, H, K, Hkv = _check(q, k, v, window, initial_state)
    check_finite({"q": q, "k": k, "v": v})
    scale = K**-0.5 if scale is None else scale
    segment_ids = None
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, B, T)
        if initial_state is not None or output_final_state:
            raise ValueError(
                "a KV cache (initial_state / output_final_state) is not supported with cu_seqlens"
            )
        lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(device=q.device, dtype=torch.long)
        segment_ids = torch.repeat_interleave(torch.arange(lens.numel(), device=q.device), lens)
    if initial_state is not None:
        k_all = torch.cat([initial_state.k.to(k.dtype), k], dim=1)
        v_all = torch.cat([initial_state.v.to(v.dtype), v], dim=1)
    else:
        k_all, v_all = k, v
    S = k_all.shape[1]
    G = H // Hkv
    qh = rearrange(q, "b t h d -> b h t d")
    kh = repeat(k_all, "b s h d -> b (h g) s d", g=G)
    vh = repeat(v_all, "b s h d -> b (h g) s d", g=G)
    if T == 0:
        o = q.new_zeros(B, 0, H, v.shape[-1])
    elif mode == "parallel":
        if causal and window is None and segment_ids is None and S == T:
            oh = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
        elif causal and window is not None and segment_ids is None and T > WINDOW_BLOCK:
            oh = sliding_window_attention(qh, kh, vh, window, scale)
        else:
            mask = None
            decode_all = causal and T == 1 and segment_ids is None and (window is None or S <= window)
            if not decode_all and (causal or window is not None or segment_ids is not None):
                mask = attention_mask(
                    T, S, causal=causal, window=window, segment_ids=segment_ids, device=q.device
                )
            oh = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
        o = rearrange(oh, "b h t d -> b t h d")
    else:
        cd = compute_dtype(q, k, v)
        mask = attention_mask(T, S, causal=causal, window=window, segment_ids=segment_ids, device=q.device)
        outs = []
        for t in range(T):
            s = torch.einsum("bhd,bhsd->bhs", qh[:, :, t].to(cd) * scale, kh.to(cd))
            s = s.masked_fill(~mask[t], float("-inf"))
            outs.append(torch.einsum("bhs,bhsd->bhd", s.softmax(-1), vh.to(cd)))
        o = torch.stack(outs, 1).to(q.dtype)
    final = None
    if output_final_state:
        keep = S if window is None else min(S, window - 1)
        final = KVCache(k_all[:, S - keep :], v_all[:, S - keep :])
    return o, final


def softmax_attention_map(q, k, window: int | None = None, scale: float | None = None) -> torch.Tensor:
    """The attention pattern (probabilities) ``softmax(scale · q kᵀ + mask)`` per query head,
    causal (and within ``window`` when given), so that ``o = P v``. ``q: [B, T, H, K]``,
    ``k: [B, S, H_kv, K]`` with ``S ≥ T`` (the queries are the last ``T`` positions: ``S − T``
    earlier keys come from a cache) and ``H`` a multiple of ``H_kv`` (grouped-query attention:
    each key head serves ``H / H_kv`` query heads). Returns ``[B, H, T, S]`` in q's dtype."""
    T, S, H, Hk = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    k = repeat(k, "b s h d -> b s (h g) d", g=H // Hk)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.einsum("bthd,bshd->bhts", q, k) * scale
    mask = attention_mask(T, S, window=window, device=q.device)
    return scores.masked_fill(~mask, float("-inf")).softmax(-1)
