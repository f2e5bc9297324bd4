"""Softmax attention: the non-parametric memory (a KV cache that grows with T)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ._common import (
    _shape,
    check_cu_seqlens,
    check_finite,
    check_floating,
    check_mode,
    compute_dtype,
    default_scale,
    transformed,
)
from ._layout import rearrange, repeat

__all__ = ["softmax_attention", "KVCache", "attention_mask", "softmax_attention_map", "kept_keys"]


class KVCache(NamedTuple):
    """Past keys ``k: [B, P, Hkv, K]`` and values ``v: [B, P, Hkv, V]`` (the attention "state")."""

    k: torch.Tensor
    v: torch.Tensor


def _sdpa(q, k, v, **kw):
    """``F.scaled_dot_product_attention``; under forward-mode AD or a ``torch.func`` transform with
    the math kernel forced (the CPU flash kernel, which serves equal head dims, has no forward-mode
    derivative: ``jvp`` raised ``NotImplementedError``).

    On the CPU, query/key and value head dims that differ (multi-head latent attention: ``d_n +
    d_h^R`` against ``d_v``) send torch 2.13 to its math kernel, which forms every ``T × S`` score
    map (25x slower at 16,384 tokens, ad hoc: 10.0 s against 0.4 s); the narrower side is therefore
    padded with zeros to the wider one, which changes no score (``q·k`` gains ``0·0`` terms; ``kw``
    carries the scale, set by the caller from the unpadded width) and no kept output channel (the
    padded value channels are dropped)."""
    if transformed(q, k, v):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, **kw)
    dk, dv = q.shape[-1], v.shape[-1]
    if dk != dv and q.device.type == "cpu" and kw.get("scale") is not None:
        if dk < dv:
            q, k = F.pad(q, (0, dv - dk)), F.pad(k, (0, dv - dk))
        else:
            return F.scaled_dot_product_attention(q, k, F.pad(v, (0, dk - dv)), **kw)[..., :dv]
    return F.scaled_dot_product_attention(q, k, v, **kw)


def attention_mask(
    T: int,
    S: int,
    *,
    causal: bool = True,
    window: int | None = None,
    segment_ids: torch.Tensor | None = None,
    device=None,
    n_sink: int = 0,
) -> torch.Tensor:
    """Boolean ``[T, S]`` mask (True = may attend) for ``T`` queries over ``S = P + T`` keys.

    Query ``t`` sits at key position ``i = S − T + t``. Causal: keys ``j ≤ i``. A sliding
    ``window`` keeps the ``window`` most recent keys ``i − window < j ≤ i`` (``|i − j| < window``
    when not causal); ``n_sink`` attention sinks (StreamingLLM) keep the first ``n_sink`` keys
    ``j < n_sink`` visible as well (causally). ``segment_ids: [S]`` further restricts attention to
    the same segment. Defaults: ``causal=True``, ``n_sink=0``.

    Raises ``ValueError`` naming the argument: ``T``/``S`` not ints with ``0 <= T <= S``,
    ``window`` not a positive int, ``n_sink`` not an int ``>= 0``, ``segment_ids`` not ``[S]``.
    """
    for name, n in (("T", T), ("S", S), ("n_sink", n_sink)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"attention_mask: {name} must be an int >= 0, got {n!r}")
    if S < T:
        raise ValueError(f"attention_mask: S (keys) must be >= T (queries; S = P + T), got T = {T}, S = {S}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"attention_mask: window must be None or an int >= 1, got {window!r}")
    if segment_ids is not None and tuple(segment_ids.shape) != (S,):
        raise ValueError(
            f"attention_mask: segment_ids must have shape [S] = [{S}], got {_shape(segment_ids)}"
        )
    i = torch.arange(S - T, S, device=device)[:, None]
    j = torch.arange(S, device=device)[None, :]
    mask = torch.ones(T, S, dtype=torch.bool, device=device)
    if causal:
        mask &= j <= i
    if window is not None:
        near = (i - j < window) if causal else ((i - j).abs() < window)
        mask &= (near | (j < n_sink)) if n_sink else near
    if segment_ids is not None:
        mask &= segment_ids[S - T :, None] == segment_ids[None, :]
    return mask


#: query block of the blockwise sliding-window path (keys per block: block + window − 1)
WINDOW_BLOCK = 1024


def kept_keys(S: int, window: int | None, n_sink: int = 0) -> tuple[int, int]:
    """Which of ``S`` keys a cache keeps for the next query: ``(head, tail)`` = the first ``head``
    and the last ``tail`` keys (``head + tail ≤ S``, never overlapping). Full attention keeps all
    ``S``; a ``window`` keeps the ``window − 1`` most recent; with ``n_sink`` attention sinks the
    first ``n_sink`` too, so the cache never exceeds ``n_sink + window − 1`` keys (default
    ``n_sink=0``)."""
    if window is None or S <= n_sink + window - 1:
        return 0, S
    return n_sink, window - 1


def _sink_columns(q, sink_q, kh, n_sink: int):
    """Queries and keys with the channels doubled so that one dot product scores the first
    ``n_sink`` keys with ``sink_q`` and the others with ``q``: ``[sink_q ‖ q] · [k·1(j<n) ‖ k·1(j≥n)]``.
    ``q, sink_q: [B, H, T, K]``, ``kh: [B, H, S, K]`` -> ``[B, H, T, 2K]``, ``[B, H, S, 2K]``."""
    is_sink = (torch.arange(kh.shape[2], device=kh.device) < n_sink)[:, None].to(kh.dtype)
    return torch.cat([sink_q, q], -1), torch.cat([kh * is_sink, kh * (1 - is_sink)], -1)


def sink_window_attention(qh, kh, vh, window: int, n_sink: int, scale: float, block: int = WINDOW_BLOCK):
    """Causal sliding-window attention with ``n_sink`` attention sinks in query blocks,
    ``O(T · (window + n_sink))`` time and memory. ``qh: [B, H, T, D]`` are the last ``T`` of the
    ``S`` keys ``kh: [B, H, S, D]``, ``vh: [B, H, S, V]``; the first ``n_sink`` keys stay visible.
    ``block``: queries per block (default ``block=1024``, :data:`WINDOW_BLOCK`)."""
    T, S = qh.shape[2], kh.shape[2]
    outs = []
    for t0 in range(0, T, block):
        t1 = min(T, t0 + block)
        hi = S - T + t1
        lo = max(0, S - T + t0 - window + 1)
        idx = torch.cat(
            [torch.arange(min(n_sink, lo), device=qh.device), torch.arange(lo, hi, device=qh.device)]
        )
        i = torch.arange(S - T + t0, S - T + t1, device=qh.device)[:, None]
        mask = (idx[None] <= i) & ((i - idx[None] < window) | (idx[None] < n_sink))
        outs.append(_sdpa(qh[:, :, t0:t1], kh[:, :, idx], vh[:, :, idx], attn_mask=mask, scale=scale))
    return torch.cat(outs, 2)


def sliding_window_attention(
    qh, kh, vh, window: int, scale: float, prefix_k=None, prefix_v=None, block: int = WINDOW_BLOCK
):
    """Causal sliding-window attention in query blocks, ``O(T · window)`` time and memory.

    ``qh: [B, H, T, D]`` are the last ``T`` of the ``S`` keys ``kh, vh: [B, H, S, D]``. Optional
    ``prefix_k, prefix_v: [B, H, P, D]`` are keys every query sees (e.g. persistent memory).
    ``block``: queries per block (default ``block=1024``, :data:`WINDOW_BLOCK`).
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
        outs.append(_sdpa(qh[:, :, t0:t1], keys, vals, attn_mask=mask, scale=scale))
    return torch.cat(outs, 2)


def _check(q, k, v, window, initial_state, n_sink=0, sink_q=None, causal=True):
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
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be None or a positive int, got {window!r}")
    if not isinstance(n_sink, int) or isinstance(n_sink, bool) or n_sink < 0:
        raise ValueError(f"n_sink must be an int >= 0, got {n_sink!r}")
    if n_sink and (window is None or not causal):
        raise ValueError(
            f"n_sink (attention sinks) needs causal attention with a window, got n_sink = {n_sink}, "
            f"window = {window!r}, causal = {causal}"
        )
    if sink_q is not None:
        if not n_sink:
            raise ValueError("sink_q is only used with attention sinks (n_sink > 0), got n_sink = 0")
        if tuple(sink_q.shape) != tuple(q.shape):
            raise ValueError(f"sink_q must have q's shape {_shape(q)}, got {_shape(sink_q)}")
    if initial_state is not None:
        if not isinstance(initial_state, tuple) or len(initial_state) != 2:
            raise TypeError("initial_state must be a KVCache(k, v) tuple of past keys and values")
        kc, vc = initial_state
        check_floating("initial_state.k", kc)
        check_floating("initial_state.v", vc)
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
    n_sink: int = 0,
    sink_q: torch.Tensor | None = None,
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
        causal: mask future keys (default ``causal=True``). window: attend only to the ``window``
            most recent keys (including the query's own position).
        n_sink: attention sinks (StreamingLLM, Xiao et al. 2023): with a ``window``, the first
            ``n_sink`` keys (of the cache and this call together) stay visible to every later
            query, and the cache keeps them: at most ``n_sink + window − 1`` keys. Default ``0``.
        sink_q: ``[B, T, H, K]``, the queries that score the ``n_sink`` sink keys (default ``q``):
            with rotary positions counted *in the cache*, a query scores its window keys at its
            own position and the sinks at ``min(i, n_sink + window − 1)``
            (:class:`~mnemo.layers.Attention` passes both rotations; the op knows no positions).
        scale: default ``K ** -0.5``; a negative one is computed as given with a
            :class:`~mnemo.ops.RangeWarning`.
        initial_state: a :class:`KVCache` of ``P`` past keys/values; the new queries sit at
            positions ``P … P+T−1`` and also attend to them (one-token decoding: ``T = 1``).
        output_final_state: return the cache extended by this call's ``k, v`` (with a window,
            only its last ``window − 1`` entries, all a next token can see, and with sinks its
            first ``n_sink`` too: :func:`kept_keys`). Default ``False``.
        cu_seqlens: ``[N + 1]`` offsets of packed sequences (``B = 1``): attention stays inside each
            sequence. No cache in or out in this case.
        mode: ``"parallel"`` (``torch.nn.functional.scaled_dot_product_attention``; its math kernel
            under forward-mode AD or a ``torch.func`` transform) or ``"recurrent"`` (a token loop
            with an explicit softmax, the reference).

    Returns:
        ``o: [B, T, H, V]`` in ``q``'s dtype, and the :class:`KVCache` or ``None``.

    Raises:
        ValueError / TypeError: shapes, head counts, window, cache or mode do not match; the
            message names the argument, the expected and the received value.
    """
    check_mode(mode, ("parallel", "recurrent"))
    B, T, H, K, Hkv = _check(q, k, v, window, initial_state, n_sink, sink_q, causal)
    if initial_state is not None and not isinstance(initial_state, KVCache):
        initial_state = KVCache(*initial_state)  # a plain (k, v) pair
    check_finite({"q": q, "k": k, "v": v})
    scale = default_scale(scale, K)
    segment_ids = None
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, B, T)
        if initial_state is not None or output_final_state:
            raise ValueError(
                "a KV cache (initial_state / output_final_state) is not supported with cu_seqlens"
            )
        if n_sink:
            raise ValueError(
                f"n_sink (attention sinks) is not supported with cu_seqlens, got n_sink = {n_sink}"
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
    if mode == "parallel":
        if not q.dtype == k_all.dtype == v_all.dtype:  # SDPA takes one dtype: the compute dtype
            cd = compute_dtype(q, k_all, v_all)
            qh, kh, vh = qh.to(cd), kh.to(cd), vh.to(cd)
            sink_q = None if sink_q is None else sink_q.to(cd)
        if isinstance(scale, torch.Tensor):  # SDPA takes a float scale: a tensor one (learned) scales q
            qh, sink_q, scale = qh * scale, None if sink_q is None else sink_q * scale, 1.0
    if T == 0:
        o = q.new_zeros(B, 0, H, v.shape[-1])
    elif mode == "parallel" and n_sink:
        if sink_q is not None:  # two query rotations: one dot product over doubled channels
            qh, kh = _sink_columns(qh, rearrange(sink_q, "b t h d -> b h t d"), kh, n_sink)
        if T > WINDOW_BLOCK:
            oh = sink_window_attention(qh, kh, vh, window, n_sink, scale)
        else:
            mask = attention_mask(T, S, window=window, n_sink=n_sink, device=q.device)
            oh = _sdpa(qh, kh, vh, attn_mask=mask, scale=scale)
        o = rearrange(oh, "b h t d -> b t h d").to(q.dtype)
    elif mode == "parallel":
        if causal and window is None and segment_ids is None and S == T:
            if scale > 0:
                oh = _sdpa(qh, kh, vh, is_causal=True, scale=scale)
            else:  # the CPU kernel's is_causal gives NaN for a scale <= 0 (torch 2.13): folded into q
                oh = _sdpa(qh * scale, kh, vh, is_causal=True, scale=1.0)
        elif causal and window is not None and segment_ids is None and T > WINDOW_BLOCK:
            oh = sliding_window_attention(qh, kh, vh, window, scale)
        else:
            mask = None
            decode_all = causal and T == 1 and segment_ids is None and (window is None or S <= window)
            if not decode_all and (causal or window is not None or segment_ids is not None):
                mask = attention_mask(
                    T, S, causal=causal, window=window, segment_ids=segment_ids, device=q.device
                )
            oh = _sdpa(qh, kh, vh, attn_mask=mask, scale=scale)
        o = rearrange(oh, "b h t d -> b t h d").to(q.dtype)
    else:
        cd = compute_dtype(q, k, v)
        mask = attention_mask(
            T, S, causal=causal, window=window, segment_ids=segment_ids, device=q.device, n_sink=n_sink
        )
        sq = None if sink_q is None else rearrange(sink_q, "b t h d -> b h t d")
        sink_cols = torch.arange(S, device=q.device) < n_sink
        outs = []
        for t in range(T):
            s = torch.einsum("bhd,bhsd->bhs", qh[:, :, t].to(cd) * scale, kh.to(cd))
            if sq is not None:  # the sink keys, scored by the query at its capped cache position
                s_sink = torch.einsum("bhd,bhsd->bhs", sq[:, :, t].to(cd) * scale, kh.to(cd))
                s = torch.where(sink_cols, s_sink, s)
            s = s.masked_fill(~mask[t], float("-inf"))
            outs.append(torch.einsum("bhs,bhsd->bhd", s.softmax(-1), vh.to(cd)))
        o = torch.stack(outs, 1).to(q.dtype)
    final = None
    if output_final_state:
        final = KVCache(*(keep_cache(x, window, n_sink) for x in (k_all, v_all)))
    return o, final


def keep_cache(x: torch.Tensor, window: int | None, n_sink: int = 0) -> torch.Tensor:
    """The entries ``x: [B, S, ...]`` (keys or values along dim 1) that a cache keeps
    (:func:`kept_keys`): all, the last ``window − 1``, or the first ``n_sink`` and the last ``window − 1``
    (default ``n_sink=0``)."""
    head, tail = kept_keys(x.shape[1], window, n_sink)
    S = x.shape[1]
    if head == 0:
        return x[:, S - tail :]
    return torch.cat([x[:, :head], x[:, S - tail :]], 1)


def softmax_attention_map(
    q, k, window: int | None = None, scale: float | None = None, *, n_sink: int = 0, sink_q=None
) -> torch.Tensor:
    """The attention pattern (probabilities) ``softmax(scale · q kᵀ + mask)`` per query head,
    causal (and within ``window`` when given, plus the first ``n_sink`` keys — attention sinks,
    scored with ``sink_q`` when given, as in :func:`softmax_attention`), so that ``o = P v``.
    ``q, sink_q: [B, T, H, K]``, ``k: [B, S, H_kv, K]`` with ``S ≥ T`` (the queries are the last
    ``T`` positions: ``S − T`` earlier keys come from a cache) and ``H`` a multiple of ``H_kv``
    (grouped-query attention: each key head serves ``H / H_kv`` query heads). Returns
    ``[B, H, T, S]`` in q's dtype; the sink columns are ordinary columns ``0 … n_sink − 1``
    (default ``n_sink=0``)."""
    T, S, H, Hk = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    k = repeat(k, "b s h d -> b s (h g) d", g=H // Hk)
    scale = default_scale(scale, q.shape[-1])
    scores = torch.einsum("bthd,bshd->bhts", q, k) * scale
    if sink_q is not None and n_sink:
        sink_scores = torch.einsum("bthd,bshd->bhts", sink_q, k) * scale
        scores = torch.where(torch.arange(S, device=q.device) < n_sink, sink_scores, scores)
    mask = attention_mask(T, S, window=window, device=q.device, n_sink=n_sink)
    return scores.masked_fill(~mask, float("-inf")).softmax(-1)
