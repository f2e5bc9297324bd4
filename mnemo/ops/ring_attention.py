"""Ring attention: causal softmax attention over a sequence split across processes (Liu, Zaharia &
Abbeel 2023, "Ring Attention with Blockwise Transformers for Near-Infinite Context", §3 and Alg. 1).

The sequence of length ``T`` is cut into ``N`` consecutive blocks of ``n = T / N`` tokens; member
``r`` of the ring (a process) holds block ``r`` of the queries, keys and values. The key/value
blocks travel around the ring — each member sends the block it holds to ``r + 1`` and receives the
next one from ``r − 1``, ``N − 1`` times — and every member folds each visiting block into its
output with the online softmax (blockwise attention, Milakov & Gimelshein 2018; Rabe & Staats
2021; FlashAttention, Dao et al. 2022). With the log-sum-exp ``ℓ`` of a query's scores over the
keys seen so far and the normalised output ``o``, a block ``b`` with its own ``(o_b, ℓ_b)`` merges as

    ℓ' = log(exp ℓ + exp ℓ_b)        o' = exp(ℓ − ℓ') · o + exp(ℓ_b − ℓ') · o_b          (1)

which after all blocks equals ``softmax(scale · q Kᵀ + mask) V`` over the whole sequence. Masks
use *global* positions (query ``r·n + t``, key ``s·n + u``): causal blocks from later members
(``s > r``) are skipped, the diagonal block is causally masked, and a sliding window additionally
skips blocks entirely older than the window. Grouped-query heads are kept grouped (a block carries
``H_kv`` heads, never repeated to ``H``), so each message is ``n × H_kv × (K + V)`` numbers.

Backward (FlashAttention-2's recomputation, Dao 2023, Alg. 2): with the saved output ``o`` and
log-sum-exp ``ℓ``, each block's probabilities are recomputed as ``P = exp(scale · q kᵀ − ℓ)``, and

    dV_b += Pᵀ dO     dS = P ⊙ (dO V_bᵀ − rowsum(dO ⊙ O))     dQ += scale · dS K_b     dK_b += scale · dSᵀ Q

The key/value blocks circulate again together with their ``dK_b, dV_b`` accumulators; after ``N``
hops every accumulator is back at its owner holding the sum over all queries. This is a custom
:class:`torch.autograd.Function` rather than autograd through communication because
``torch.distributed.nn.functional`` (torch 2.13) offers differentiable collectives (all-gather,
all-to-all, reduce-scatter …) but no differentiable point-to-point send/recv, and an all-gather
of the keys and values would hold the whole sequence on every process — the memory ring attention
exists to avoid. The backward also stores only ``q, k, v, o, ℓ`` (no ``n × n`` probabilities).

Load balance: with a causal mask member ``r`` computes ``r + 1`` blocks, so the last member does the
most work (the paper's plain ring; striped/zig-zag layouts that balance it are not implemented).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading

import torch
import torch.distributed as dist

from ._chunked import autocast_disabled, autocast_off
from ._common import _shape, check_floating, compute_dtype, default_scale, transformed

__all__ = [
    "Ring",
    "ProcessRing",
    "ThreadRing",
    "ring_attention",
    "blockwise_attention",
    "ring_context",
    "current_ring",
]


# ------------------------------------------------------------------------------------------------
# the ring (transport)
# ------------------------------------------------------------------------------------------------


class Ring:
    """A ring of ``world`` members; this one is ``rank``. :meth:`shift` sends a tensor to member
    ``rank + 1`` and receives one of the same shape and dtype from ``rank − 1`` (indices mod
    ``world``); it returns a zero-argument callable that waits and returns the received tensor, so
    communication overlaps the computation started before the wait."""

    rank: int = 0
    world: int = 1

    def shift(self, tensor: torch.Tensor):  # pragma: no cover - interface
        raise NotImplementedError


class ProcessRing(Ring):
    """The ring over the processes of a ``torch.distributed`` group (``None`` = the default group),
    in group-rank order; messages are ``batch_isend_irecv`` pairs (gloo on CPU, nccl on CUDA).

    Raises:
        RuntimeError: no process group has been initialised.
    """

    def __init__(self, group=None):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("ProcessRing: torch.distributed is not initialised (init_process_group first)")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)

        def glob(r):
            return r if group is None else dist.get_global_rank(group, r)

        self._next, self._prev = glob((self.rank + 1) % self.world), glob((self.rank - 1) % self.world)

    def shift(self, tensor: torch.Tensor):
        tensor = tensor.contiguous()
        out = torch.empty_like(tensor)
        ops = [
            dist.P2POp(dist.isend, tensor, self._next, self.group),
            dist.P2POp(dist.irecv, out, self._prev, self.group),
        ]
        works = dist.batch_isend_irecv(ops)

        def wait():
            for w in works:
                w.wait()
            return out

        return wait


class ThreadRing(Ring):
    """A ring of threads in one process (for tests and single-process checks of the schedule):
    build the members with :meth:`make` and run each one's attention in its own thread. Messages
    are matched in the order they were sent, as point-to-point messages between processes are."""

    def __init__(self, rank: int, world: int, boxes: list, cond: threading.Condition):
        self.rank, self.world, self._boxes, self._cond = rank, world, boxes, cond
        self._sent = self._received = 0

    @classmethod
    def make(cls, world: int) -> list[ThreadRing]:
        cond = threading.Condition()
        boxes = [{} for _ in range(world)]
        return [cls(r, world, boxes, cond) for r in range(world)]

    def shift(self, tensor: torch.Tensor):
        with self._cond:
            self._boxes[(self.rank + 1) % self.world][self._sent] = tensor.detach().clone()
            self._sent += 1
            self._cond.notify_all()
        seq, self._received = self._received, self._received + 1
        box = self._boxes[self.rank]

        def wait():
            with self._cond:
                if not self._cond.wait_for(lambda: seq in box, timeout=60):
                    raise TimeoutError(f"ThreadRing: member {self.rank} got no message {seq}")
                return box.pop(seq)

        return wait


_CURRENT: contextvars.ContextVar[Ring | None] = contextvars.ContextVar("mnemo_ring", default=None)


@contextlib.contextmanager
def ring_context(ring: Ring | None):
    """Inside the ``with`` block, :class:`~mnemo.layers.Attention` layers attend over the whole
    ring (:func:`ring_attention`) instead of their local tokens; ``None`` switches it off."""
    global _OPEN
    with _OPEN_LOCK:
        _OPEN += 1
    token = _CURRENT.set(ring)
    try:
        yield ring
    finally:
        _CURRENT.reset(token)
        with _OPEN_LOCK:
            _OPEN -= 1


#: ring contexts open in any thread; while none is, :func:`current_ring` is ``None`` without reading
#: the context variable (which torch.compile cannot trace: a graph break in every attention layer)
_OPEN = 0
_OPEN_LOCK = threading.Lock()


def current_ring() -> Ring | None:
    """The ring set by the innermost :func:`ring_context` (``None`` outside one)."""
    if _OPEN == 0:
        return None
    return _CURRENT.get()


# ------------------------------------------------------------------------------------------------
# one block, the merge (1), one block's gradients
# ------------------------------------------------------------------------------------------------


def _block_mask(n_q: int, q0: int, n_k: int, k0: int, causal: bool, window: int | None, device):
    """``(skip, mask)``: ``skip`` when no query of the block ``[q0, q0 + n_q)`` sees any key of
    ``[k0, k0 + n_k)``; ``mask [n_q, n_k]`` bool (True = visible) or ``None`` when all are."""
    lo_q, hi_q, lo_k, hi_k = q0, q0 + n_q - 1, k0, k0 + n_k - 1
    if causal and lo_k > hi_q:
        return True, None
    if window is not None and (lo_q - hi_k >= window if causal else max(lo_q - hi_k, lo_k - hi_q) >= window):
        return True, None
    full = (not causal or hi_k <= lo_q) and (
        window is None or (hi_q - lo_k < window and hi_k - lo_q < window)
    )
    if full:
        return False, None
    i = torch.arange(lo_q, hi_q + 1, device=device)[:, None]
    j = torch.arange(lo_k, hi_k + 1, device=device)[None, :]
    mask = torch.ones(n_q, n_k, dtype=torch.bool, device=device)
    if causal:
        mask &= j <= i
    if window is not None:
        mask &= (i - j < window) if causal else ((i - j).abs() < window)
    return False, mask


def _scores(q5, k, scale, mask):
    """``q5 [B, n, Hkv, G, K]``, ``k [B, m, Hkv, K]`` → masked scores ``[B, Hkv, G, n, m]``."""
    s = torch.einsum("btngk,bsnk->bngts", q5, k) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def _finite_or_zero(x):
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def _attend_block(q5, k, v, scale, mask):
    """One block: ``(o [B, n, Hkv, G, V], lse [B, Hkv, G, n])``; fully masked rows have
    ``lse = −inf`` and ``o = 0``."""
    s = _scores(q5, k, scale, mask)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _finite_or_zero(lse)[..., None])
    return torch.einsum("bngts,bsnv->btngv", p, v), lse


def _merge(o, lse, o_b, lse_b):
    """Equation (1): fold a block's ``(o_b, lse_b)`` into the running ``(o, lse)`` (either may be
    ``None`` = nothing seen yet). Rows with ``−inf`` on both sides stay ``(0, −inf)``."""
    if o is None:
        return o_b, lse_b
    new = torch.logaddexp(lse, lse_b)
    ref = _finite_or_zero(new)
    w_a = torch.exp(lse - ref).permute(0, 3, 1, 2)[..., None]  # [B, n, Hkv, G, 1]
    w_b = torch.exp(lse_b - ref).permute(0, 3, 1, 2)[..., None]
    return o * w_a + o_b * w_b, new


def _block_grads(q5, k, v, do5, delta, lse, scale, mask):
    """FlashAttention-2 backward of one block given the *final* ``lse`` and ``delta =
    rowsum(dO ⊙ O)`` (both ``[B, Hkv, G, n]``): ``(dq5, dk, dv)`` of this block's share."""
    s = _scores(q5, k, scale, mask)
    p = torch.exp(s - _finite_or_zero(lse)[..., None])
    dv = torch.einsum("bngts,btngv->bsnv", p, do5)
    dp = torch.einsum("btngv,bsnv->bngts", do5, v)
    ds = p * (dp - delta[..., None])
    dq5 = torch.einsum("bngts,bsnk->btngk", ds, k) * scale
    dk = torch.einsum("bngts,btngk->bsnk", ds, q5) * scale
    return dq5, dk, dv


# ------------------------------------------------------------------------------------------------
# the ring
# ------------------------------------------------------------------------------------------------


class _RingAttention(torch.autograd.Function):
    @staticmethod
    @autocast_off  # the einsums accumulate in float32 under a bf16 autocast too
    def forward(ctx, q, k, v, ring: Ring, causal: bool, window, scale: float):
        B, n, H, K = q.shape
        Hkv, V = k.shape[2], v.shape[3]
        cd = compute_dtype(q, k, v)
        q5 = q.to(cd).reshape(B, n, Hkv, H // Hkv, K)
        r, N = ring.rank, ring.world
        kv = torch.cat([k, v], dim=-1)  # one message per hop, in the activation dtype
        o = lse = None
        for step in range(N):
            src = (r - step) % N
            pending = ring.shift(kv) if step < N - 1 else None  # overlaps this block's compute
            skip, mask = _block_mask(n, r * n, n, src * n, causal, window, q.device)
            if not skip:
                kb, vb = kv[..., :K].to(cd), kv[..., K:].to(cd)
                o, lse = _merge(o, lse, *_attend_block(q5, kb, vb, scale, mask))
            if pending is not None:
                kv = pending()
        if o is None:  # every block skipped: only with n = 0 tokens per member
            o = q5.new_zeros(B, n, Hkv, H // Hkv, V)
            lse = q5.new_full((B, Hkv, H // Hkv, n), float("-inf"))
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.ring, ctx.causal, ctx.window, ctx.scale = ring, causal, window, scale
        return o.reshape(B, n, H, V).to(q.dtype)

    @staticmethod
    @autocast_off
    def backward(ctx, do):
        if torch.is_grad_enabled():  # (every member raises here, before any message is sent)
            raise RuntimeError(
                "ring_attention: its backward (the FlashAttention-2 recomputation, a second trip around "
                "the ring) is first order, so a graph of its gradient (create_graph=True) would miss the "
                "second-order terms; use softmax_attention or blockwise_attention for higher-order gradients"
            )
        q, k, v, o5, lse = ctx.saved_tensors
        ring, causal, window, scale = ctx.ring, ctx.causal, ctx.window, ctx.scale
        B, n, H, K = q.shape
        Hkv = k.shape[2]
        cd = o5.dtype
        q5 = q.to(cd).reshape(B, n, Hkv, H // Hkv, K)
        do5 = do.to(cd).reshape(o5.shape)
        delta = (do5 * o5).sum(-1).permute(0, 2, 3, 1)  # [B, Hkv, G, n]
        r, N = ring.rank, ring.world
        kv = torch.cat([k, v], dim=-1)
        dkv = torch.zeros(kv.shape, dtype=cd, device=kv.device)  # travels with its block
        dq5 = torch.zeros_like(q5)
        for step in range(N):
            src = (r - step) % N
            pending = ring.shift(kv) if step < N - 1 else None
            skip, mask = _block_mask(n, r * n, n, src * n, causal, window, q.device)
            if not skip:
                kb, vb = kv[..., :K].to(cd), kv[..., K:].to(cd)
                dq_b, dk_b, dv_b = _block_grads(q5, kb, vb, do5, delta, lse, scale, mask)
                dq5 += dq_b
                dkv = dkv + torch.cat([dk_b, dv_b], dim=-1)
            if N > 1:  # after N hops the accumulator is back with the block's owner
                dkv = ring.shift(dkv)()
            if pending is not None:
                kv = pending()
        dk, dv = dkv[..., :K], dkv[..., K:]
        return (
            dq5.reshape(q.shape).to(q.dtype),
            dk.to(k.dtype).contiguous(),
            dv.to(v.dtype).contiguous(),
            None,
            None,
            None,
            None,
        )


def _check(q, k, v, window, scale, *, learned: bool = False):
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_floating(name, t)
        if t.ndim != 4:
            raise ValueError(f"{name} must have shape [B, n, heads, dim], got {_shape(t)}")
    B, n, H, K = q.shape
    if k.shape[0] != B or k.shape[1] != n or k.shape[3] != K:
        raise ValueError(f"k must have shape [B, n, Hkv, K] = [{B}, {n}, Hkv, {K}], got {_shape(k)}")
    Hkv = k.shape[2]
    if tuple(v.shape[:3]) != (B, n, Hkv):
        raise ValueError(f"v must have shape [B, n, Hkv, V] = [{B}, {n}, {Hkv}, V], got {_shape(v)}")
    if Hkv < 1 or H % Hkv:
        raise ValueError(
            "the number of query heads must be a multiple of the key/value heads, "
            f"got H = {H} and Hkv = {Hkv}"
        )
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ValueError(f"window must be None or a positive int, got {window!r}")
    scale = default_scale(scale, K)  # a number: finite (else ValueError), a negative one warned
    if learned and isinstance(scale, torch.Tensor):  # (blockwise: autograd reaches it)
        return scale.reshape(())
    if isinstance(scale, torch.Tensor) and scale.requires_grad:
        raise TypeError(
            "scale: the ring takes a number (its backward gives no gradient to the scale), got a tensor "
            "that requires grad; pass float(scale), or use softmax_attention for a learned scale"
        )
    return float(scale)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    ring: Ring | None = None,
    causal: bool = True,
    window: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Softmax attention over a sequence held in equal blocks by the members of a ring (module
    docstring: Liu et al. 2023, Alg. 1; merge (1); FlashAttention-2 backward).

        o_i = Σ_j softmax_j(scale · q_iᵀ k_j) v_j     over all keys ``j`` of the ring allowed for ``i``

    Args:
        q: ``[B, n, H, K]`` this member's queries (global positions ``rank·n … rank·n + n − 1``).
        k: ``[B, n, Hkv, K]``, v: ``[B, n, Hkv, V]`` its keys and values, ``H % Hkv == 0`` (query
            head ``h`` reads key/value head ``h // (H / Hkv)``). Every member passes the same
            ``B, n, Hkv, K, V`` and dtype (the messages have fixed shapes).
        ring: a :class:`Ring`; default the ring of :func:`ring_context`, else
            :class:`ProcessRing` over the default process group.
        causal: mask future keys (default ``causal=True``). window: the ``window`` most recent
            keys only (itself included), as :func:`~mnemo.ops.softmax_attention`. scale: default
            ``K ** -0.5``; a finite number (a negative one is computed with a
            :class:`~mnemo.ops.RangeWarning`), or a one-value tensor that needs no gradient.

    Returns:
        ``o: [B, n, H, V]`` in ``q``'s dtype (accumulated in float32, float64 for float64 inputs).
        Differentiable with respect to ``q, k, v`` (gradients computed by a second trip around
        the ring; every member must call backward), first order only: a backward with
        ``create_graph=True`` raises ``RuntimeError``.

    Raises:
        ValueError / TypeError: a shape, dtype, head count, window or scale is wrong (named,
            expected, got).
        RuntimeError: no ring given or set and no process group initialised; a backward with
            ``create_graph=True`` (second-order gradients); forward-mode AD or a ``torch.func``
            transform (``vmap``, ``grad``, ``jvp``, …): :func:`blockwise_attention` takes those.
    """
    scale = _check(q, k, v, window, scale)
    if transformed(q, k, v):  # (every member raises here, before any message is sent)
        raise RuntimeError(
            "ring_attention: forward-mode AD and torch.func transforms (vmap, grad, jvp, jacrev, ...) are "
            "not supported (its messages and its backward run on plain tensors); use blockwise_attention "
            "(the same computation in one process) or softmax_attention under a transform"
        )
    if ring is None:
        ring = current_ring() or ProcessRing()
    return _RingAttention.apply(q, k, v, ring, causal, window, scale)


def blockwise_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    n_blocks: int,
    *,
    causal: bool = True,
    window: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """The ring's forward computation in one process: ``q, k, v`` (``[B, T, H|Hkv, ·]``) cut into
    ``n_blocks`` blocks; each query block folds the key/value blocks in the order the ring
    delivers them (its own, then ``r − 1, r − 2, …``) with merge (1). Equals
    :func:`~mnemo.ops.softmax_attention` (a check of the blockwise accumulation; differentiable
    by autograd). ``T`` must be a multiple of ``n_blocks``. Returns ``[B, T, H, V]`` in ``q``'s dtype.
    ``causal, window, scale`` as in :func:`ring_attention` (default ``causal=True``), except that a
    one-value tensor scale may need a gradient here (autograd reaches it, as in softmax attention).

    Raises:
        ValueError: ``n_blocks`` is not a positive divisor of ``T``, or a shape/window is wrong.
    """
    scale = _check(q, k, v, window, scale, learned=True)
    B, T, H, K = q.shape
    if isinstance(n_blocks, bool) or not isinstance(n_blocks, int) or n_blocks < 1 or T % n_blocks:
        raise ValueError(f"n_blocks must be a positive divisor of T = {T}, got {n_blocks!r}")
    with autocast_disabled(q.device.type):  # float32 accumulation under a bf16 autocast too
        return _blockwise(q, k, v, n_blocks, causal, window, scale)


def _blockwise(q, k, v, n_blocks, causal, window, scale):
    B, T, H, K = q.shape
    n, Hkv, V = T // n_blocks, k.shape[2], v.shape[3]
    cd = compute_dtype(q, k, v)
    outs = []
    for r in range(n_blocks):
        q5 = q[:, r * n : (r + 1) * n].to(cd).reshape(B, n, Hkv, H // Hkv, K)
        o = lse = None
        for step in range(n_blocks):
            s = (r - step) % n_blocks
            skip, mask = _block_mask(n, r * n, n, s * n, causal, window, q.device)
            if not skip:
                kb, vb = k[:, s * n : (s + 1) * n].to(cd), v[:, s * n : (s + 1) * n].to(cd)
                o, lse = _merge(o, lse, *_attend_block(q5, kb, vb, scale, mask))
        if o is None:  # non-causal windows always see their own block; kept for completeness
            o = q5.new_zeros(B, n, Hkv, H // Hkv, V)
        outs.append(o.reshape(B, n, H, V))
    return torch.cat(outs, 1).to(q.dtype)
