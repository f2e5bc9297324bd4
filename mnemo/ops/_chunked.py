"""Shared pieces of the fast chunk forms: the chunk layout, batched matmul helpers and the
inter-chunk state scans (forward and reverse) used by the hand-written backward passes.

Layout: a per-token tensor ``[B, T, H, D]`` becomes ``[B, H, n, C, D]`` (contiguous, right-padded
with zeros to ``n · C`` tokens), so every chunk of every head is one contiguous ``[C, D]`` block and
``[B, H, n]`` flattens into one batch dimension for ``bmm`` without copies. Chunk states are
``[B, H, n, K, V]``: the state *entering* each chunk. Conversions between the layouts are fused
with a dtype cast and an element-wise factor (one pass over the data).
"""

from __future__ import annotations

import contextlib
import functools

import torch

from ..runtime import malloc_tuned
from . import _native, _workspace


def autocast_off(fn):
    r"""Run a ``forward``/``backward`` of the chunk ``Function``\ s with autocast disabled: they
    compute in the dtype they were given (float32 for float32/bf16/fp16 inputs, float64 for
    float64), so under ``torch.autocast`` states still accumulate in float32. A device without
    autocast (``meta``) has nothing to disable: the function runs as it is."""

    @functools.wraps(fn)
    def wrapper(ctx, *args):
        dev = next(a.device.type for a in args if isinstance(a, torch.Tensor))
        with autocast_disabled(dev):
            return fn(ctx, *args)

    return wrapper


def native_as_in_forward(fn):
    r"""For the ``forward`` *and* the ``backward`` of the chunk ``Function``\ s: the forward records
    whether the C kernels were off (``MNEMO_NATIVE=0``, the ``torch`` backend's
    :class:`~mnemo.ops._native.suppressed` block), and the backward runs without them too, also
    when it runs after the block has ended (a backward runs the backward of what its forward ran).
    A forward that ran with them lets the backward choose by the switch as it is then. While
    ``torch.compile`` traces, nothing is recorded or switched (a traced graph never calls the C
    kernels, and dynamo would run the ``suppressed`` block's entry without its exit)."""

    @functools.wraps(fn)
    def wrapper(ctx, *args):
        if torch.compiler.is_compiling():
            return fn(ctx, *args)
        if fn.__name__ == "forward":
            ctx.native_off = not _native.enabled()
        elif getattr(ctx, "native_off", False):
            with _native.suppressed():
                return fn(ctx, *args)
        return fn(ctx, *args)

    return wrapper


def autocast_disabled(device_type: str):
    r"""A context with ``torch.autocast`` off on ``device_type`` (``"cuda"``, ``"cpu"``; a device
    without autocast, e.g. ``"meta"``: a no-op context). Code that promises float32 accumulation
    (the chunk ``Function``\ s, the test-time-trained memories) runs in it, so an enclosing bf16
    autocast does not turn its matmuls into bfloat16."""
    if not torch.amp.is_autocast_available(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, enabled=False)


def to_chunks(x: torch.Tensor, C: int, dtype: torch.dtype, factor=None, divide: bool = False) -> torch.Tensor:
    """``[B, T, H, *D]`` (``D`` empty for scalar gates) → ``[B, H, n, C, D or 1]`` in ``dtype``,
    times (or, with ``divide``, divided by) ``factor`` (a number, or a tensor broadcastable to
    ``[B, H, n, C, D]``), in one pass. Default ``divide=False``."""
    if x.ndim == 3:
        x = x[..., None]
    B, T, H, D = x.shape
    n = -(-T // C)
    if torch.compiler.is_compiling():  # the functional form: inductor mis-strides ``out=`` into a slice
        y = x.transpose(1, 2).to(dtype)
        if isinstance(factor, torch.Tensor):
            factor = unchunk(factor, T)
        if factor is not None and not (not isinstance(factor, torch.Tensor) and factor == 1.0):
            y = y / factor if divide else y * factor
        if n * C != T:
            y = torch.nn.functional.pad(y, (0, 0, 0, n * C - T))
        # always a new tensor, as in eager (callers update it in place, e.g. ``cumsum_``)
        return y.clone(memory_format=torch.contiguous_format).view(B, H, n, C, D)
    out = _workspace.empty((B, H, n * C, D), dtype, x.device)
    if n * C != T:
        out[:, :, T:].zero_()
    src, dst = x.transpose(1, 2), out[:, :, :T]
    if factor is None or (not isinstance(factor, torch.Tensor) and factor == 1.0):
        dst.copy_(src)
    elif not isinstance(factor, torch.Tensor) and src.dtype != dtype:
        # a number times a bf16/fp16 tensor is computed (and rounded) in that dtype: convert first
        dst.copy_(src)
        dst.div_(factor) if divide else dst.mul_(factor)
    else:
        if isinstance(factor, torch.Tensor):
            factor = unchunk(factor, T)
        (torch.div if divide else torch.mul)(src, factor, out=dst)
    return out.view(B, H, n, C, D)


#: The smallest chunk :func:`chunks_within_span` halves ``chunk_size`` down to: below 16 tokens the
#: batched ``[C, C]`` products get small enough that the autograd form at the full chunk size is
#: the better choice again (docs/benchmarks/notes.md, "Strong gates and the chunk size").
MIN_SPLIT_CHUNK = 16


def chunks_within_span(
    g: torch.Tensor, C: int, dtype: torch.dtype, safe_span: float, min_chunk: int = MIN_SPLIT_CHUNK
) -> tuple[int | None, torch.Tensor | None]:
    """The chunk size the factorised (hand-written backward) chunk forms can run a gated call at.

    ``g``: log gates ``[B, T, H]`` (one per head) or ``[B, T, H, K]`` (one per key channel), ``≤ 0``.
    Tries ``C``, then ``C // 2``, ``C // 4``, … while the size stays ``≥ min_chunk`` (default
    ``min_chunk=16``, :data:`MIN_SPLIT_CHUNK`), and returns the first size at which no chunk decays
    by more than ``safe_span`` nats, with ``b``, the gates' inclusive cumulative sum within each
    chunk in the chunk layout ``[B, H, n, C', G]`` (``G`` = 1 or ``K``) and ``dtype``. Every size
    computes the same function (the chunk form is exact for any chunk size): halving only trades
    larger batched products for a decay range the factorised form can represent
    (``e^{±safe_span}``). ``(None, None)`` when even the smallest size decays too much (strong
    gates; a hard reset ``-inf`` at once): the caller's autograd form, safe for any decay, takes
    over. (The public ops refuse NaN gates before this point; a NaN here keeps the first size.)
    Reads the decay back to the host (one ``float`` per size tried): CPU eager calls only."""
    while True:
        b = to_chunks(g, C, dtype).cumsum_(-2)
        span = float(b[..., -1, :].min())
        if not span < -safe_span:
            return C, b
        if C // 2 < min_chunk or span == float("-inf"):  # a hard reset fits no chunk size
            return None, None
        C //= 2


def unchunk(y: torch.Tensor, T: int) -> torch.Tensor:
    """``[B, H, n, C, D]`` → ``[B, H, T, D]`` (a view, padding dropped)."""
    B, H, n, C, D = y.shape
    return y.view(B, H, n * C, D)[:, :, :T]


def raw_empty(like: tuple, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A new ``[B, T, H, *D]`` tensor (``like = (shape, dtype)``) and its ``[B, H, T, D]`` view."""
    shape, dtype = like
    out = _workspace.empty(shape, dtype, device)
    view = out[..., None] if out.ndim == 3 else out
    return out, view.transpose(1, 2)


#: Per-group budget (bytes of one ``[heads, n, C, max(K, V, C)]`` temporary) for :func:`head_groups`,
#: with glibc's default allocator and after :func:`mnemo.runtime.tune_malloc`.
GROUP_BYTES = 1 << 21
GROUP_BYTES_TUNED = 1 << 23


def head_groups(B: int, H: int, per_head: int):
    """Split the ``B · H`` heads into groups of ``hg`` heads of one batch row (``hg`` the largest
    divisor of ``H`` whose temporaries stay within the budget; ``per_head`` bytes each).
    Yields ``(b, h0, h1, i0, i1)`` (``i`` indexes the flattened ``B · H`` dim).

    The backward passes handle their post-scan work group by group. With glibc's default
    allocator the budget is :data:`GROUP_BYTES` (2 MiB): each group's temporaries are small and the
    same size as the last group's, so the allocator recycles them instead of mapping fresh pages
    (whose first touch costs page faults). Once freed memory is kept anyway (by the ops' buffer
    cache, :mod:`._workspace`, or by :func:`mnemo.runtime.tune_malloc`), fewer and larger groups
    (:data:`GROUP_BYTES_TUNED`, 8 MiB) save per-operator overhead (timings:
    ``docs/benchmarks/notes.md``)."""
    budget = GROUP_BYTES_TUNED if malloc_tuned() or _workspace.enabled() else GROUP_BYTES
    # (a list with a fallback, not ``max(..., default=1)``, which torch.compile cannot trace)
    hg = max([d for d in range(1, H + 1) if H % d == 0 and d * per_head <= budget] or [1])
    for b in range(B):
        for h0 in range(0, H, hg):
            yield b, h0, h0 + hg, b * H + h0, b * H + h0 + hg


def unchunk_heads(y: torch.Tensor, T: int) -> torch.Tensor:
    """``[G, n, C, D]`` → ``[G, T, D]`` (a view, padding dropped)."""
    return y.reshape(y.shape[0], -1, y.shape[-1])[:, :T]


def b3(x: torch.Tensor) -> torch.Tensor:
    """``[..., m, p]`` → ``[N, m, p]``; a view for the layouts used here (leading dims contiguous)."""
    return x.reshape(-1, x.shape[-2], x.shape[-1])


def mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Batched ``a @ b`` over identical leading dims (one ``bmm``; transposed views cost nothing),
    into ``out`` (contiguous, of the result's shape: reusing a dead buffer saves a fresh
    allocation, whose first touch costs page faults) or else a buffer of :mod:`._workspace`. For
    the chunk forms' own forward and backward passes (no autograd graph through it)."""
    if out is None:
        if torch.compiler.is_compiling():  # traced (SSD's Function): functional, no out= into views
            return torch.bmm(b3(a), b3(b)).view(*a.shape[:-1], b.shape[-1])
        out = _workspace.empty((*a.shape[:-1], b.shape[-1]), a.dtype, a.device)
    torch.bmm(b3(a), b3(b), out=b3(out))
    return out


def mm_add_(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``c += a @ b`` in place (one ``baddbmm_``, no new buffer; ``c`` contiguous); returns ``c``."""
    b3(c).baddbmm_(b3(a), b3(b))
    return c


def rev_cumsum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``y_t = Σ_{u ≥ t} x_u`` along ``dim``."""
    return x.flip(dim).cumsum(dim).flip(dim)


def rev_cumsum_rows(x: torch.Tensor) -> torch.Tensor:
    """``y[..., t, :] = Σ_{u ≥ t} x[..., u, :]`` for ``x: [..., C, G]``. For wide rows one
    ``[C, C]`` matmul per block with an upper-triangular matrix of ones (several times faster on
    CPUs than ``flip``/``cumsum``/``flip`` along a non-innermost dim)."""
    C, G = x.shape[-2], x.shape[-1]
    if G < 8:
        return rev_cumsum(x, -2)
    ones = torch.ones(C, C, dtype=x.dtype, device=x.device).triu_()
    if (torch.is_grad_enabled() and x.requires_grad) or torch.compiler.is_compiling():
        return torch.matmul(ones, x)
    return torch.matmul(ones, x, out=_workspace.empty(x.shape, x.dtype, x.device))


def _native_scan_ok(*tensors) -> bool:
    """Whether a chunk-scan kernel of :mod:`._native` may run: CPU float32/float64 tensors, no
    autograd graph to build through them (the kernels are used inside the ops' own backward)."""
    ts = [t for t in tensors if t is not None]
    if torch.is_grad_enabled() and any(t.requires_grad for t in ts):
        return False
    return _native.usable(*ts)


def scan_decay_(S0: torch.Tensor, dS: torch.Tensor, lam: torch.Tensor | None):
    """States entering each chunk for ``S_{i+1} = lam_i ⊙ S_i + dS_i`` (``lam`` None: 1),
    written over ``dS`` (which is consumed). On the CPU the C kernel ``scan_dec_fwd`` of
    :mod:`._native` (one call for all chunks); else a loop over chunks: ``cumsum`` along the chunk
    axis (stride ``K·V``) is several times slower on CPUs than ``n`` small adds.

    ``S0: [B, H, K, V]``, ``dS: [B, H, n, K, V]``, ``lam: [B, H, n, K or 1, 1]``.
    Returns ``(states [B, H, n, K, V], final [B, H, K, V])``.
    """
    B, H, n, K, V = dS.shape
    if dS.is_contiguous() and _native_scan_ok(S0, dS, lam):
        Sf = dS.new_empty(B, H, K, V)
        nt = _native.slots(B * H)
        lam_ = None if lam is None else lam.contiguous()
        Kl = 1 if lam is None else lam.shape[-2]
        work = dS.new_empty(nt, K * V)
        _native.call("scan_dec_fwd", dS.dtype, B * H, nt, [n, K, V, Kl, S0.contiguous(), dS, lam_, Sf, work])
        return dS, Sf
    return scan_decay_torch_(S0, dS, lam)


def scan_decay_torch_(S0: torch.Tensor, dS: torch.Tensor, lam: torch.Tensor | None):
    """The PyTorch form of :func:`scan_decay_` (a loop over chunks)."""
    S = S0
    for i in range(dS.shape[2]):
        d = dS[:, :, i]
        S_next = d + S if lam is None else torch.addcmul(d, lam[:, :, i], S)
        d.copy_(S)
        S = S_next
    return dS, S


def scan_decay_reverse_(
    dSf: torch.Tensor,
    R: torch.Tensor,
    lam: torch.Tensor | None,
    dots_with: tuple[torch.Tensor, torch.Tensor] | None = None,
    scale_out: bool = False,
):
    """Reverse pass of :func:`scan_decay_`: ``G_i = lam_i ⊙ G_{i+1} + R_i`` with ``G_n = dSf``
    (the C kernel ``scan_dec_bwd`` on the CPU).

    ``R: [B, H, n, K, V]`` is the gradient reaching each entering state from its own chunk; it is
    consumed. Returns ``(Gs, dS0, dots)``: ``Gs[:, :, i] = G_{i+1}`` (the gradient of the state
    leaving chunk ``i``; ``lam_i ⊙ G_{i+1}`` with ``scale_out``, default ``scale_out=False``),
    written over ``R``, ``dS0 = G_0``
    and, given ``dots_with = (states, S_final)``, ``dots = next_state_dots(G, states, S_final)``
    (``[B, H, n, K]``, of the unscaled ``G``), else ``None``.
    """
    B, H, n, K, V = R.shape
    states, Sf = dots_with if dots_with is not None else (None, None)
    if R.is_contiguous() and _native_scan_ok(dSf, R, lam, states, Sf):
        dS0 = R.new_empty(B, H, K, V)
        dots = None if dots_with is None else R.new_empty(B, H, n, K)
        nt = _native.slots(B * H)
        lam_ = None if lam is None else lam.contiguous()
        Kl = 1 if lam is None else lam.shape[-2]
        work = R.new_empty(nt, K * V)
        st = None if states is None else states.contiguous()
        sf = None if Sf is None else Sf.contiguous()
        args = [n, K, V, Kl, dSf.contiguous(), R, lam_, dS0, st, sf, dots, int(scale_out), work]
        _native.call("scan_dec_bwd", R.dtype, B * H, nt, args)
        return R, dS0, dots
    Gs, dS0 = scan_decay_reverse_torch_(dSf, R, lam)
    dots = None if dots_with is None else next_state_dots(Gs, states, Sf)
    if scale_out and lam is not None:
        Gs.mul_(lam)
    return Gs, dS0, dots


def scan_decay_reverse_torch_(dSf: torch.Tensor, R: torch.Tensor, lam: torch.Tensor | None):
    """The PyTorch form of :func:`scan_decay_reverse_`."""
    G = dSf
    for i in range(R.shape[2] - 1, -1, -1):
        r = R[:, :, i]
        G_prev = r + G if lam is None else torch.addcmul(r, lam[:, :, i], G)
        r.copy_(G)
        G = G_prev
    return R, G


def scan_matrix(S0: torch.Tensor, D: torch.Tensor, M: torch.Tensor):
    """States entering each chunk for ``S_{i+1} = M_i S_i + D_i``: on the CPU the C kernel
    ``scan_mat_fwd`` of :mod:`._native` (a head's whole pass in one call, its state in cache), else
    a loop over chunks.

    ``S0: [B, H, K, V]``, ``D: [B, H, n, K, V]``, ``M: [B, H, n, K, K]`` (views with any row
    stride). Returns ``(states [B, H, n, K, V], final [B, H, K, V])``.
    """
    B, H, n, K, V = D.shape
    if D.stride(-1) == 1 and M.stride(-1) == 1 and _native_scan_ok(S0, D, M):
        states, Sf = D.new_empty(B, H, n, K, V), D.new_empty(B, H, K, V)
        strides = [*M.stride()[:4], _native.Strided(D), *D.stride()[:4]]
        args = [H, n, K, V, S0.contiguous(), _native.Strided(M), *strides, states, Sf]
        _native.call("scan_mat_fwd", D.dtype, B * H, _native.slots(B * H), args)
        return states, Sf
    return scan_matrix_torch(S0, D, M)


def scan_matrix_torch(S0: torch.Tensor, D: torch.Tensor, M: torch.Tensor):
    """The PyTorch form of :func:`scan_matrix` (a loop over chunks)."""
    B, H, n, K, V = D.shape
    states = torch.empty(B, H, n, K, V, dtype=D.dtype, device=D.device)
    S = S0.reshape(B * H, K, V)
    for i in range(n):
        states[:, :, i] = S.view(B, H, K, V)
        S = torch.baddbmm(D[:, :, i].reshape(B * H, K, V), M[:, :, i].reshape(B * H, K, K), S)
    return states, S.view(B, H, K, V)


def scan_matrix_reverse_(
    dSf: torch.Tensor,
    R: torch.Tensor,
    M: torch.Tensor,
    dots_with: tuple[torch.Tensor, torch.Tensor] | None = None,
):
    """Reverse pass of :func:`scan_matrix`: ``G_i = M_iᵀ G_{i+1} + R_i``, ``G_n = dSf``; ``R`` is
    consumed (the C kernel ``scan_mat_bwd`` on the CPU). Returns ``(Gs, dS0, dots)`` with
    ``Gs[:, :, i] = G_{i+1}`` written over ``R``, ``dS0 = G_0`` and ``dots`` as in
    :func:`scan_decay_reverse_`."""
    B, H, n, K, V = R.shape
    states, Sf = dots_with if dots_with is not None else (None, None)
    if R.is_contiguous() and M.stride(-1) == 1 and _native_scan_ok(dSf, R, M, states, Sf):
        dS0 = R.new_empty(B, H, K, V)
        dots = None if dots_with is None else R.new_empty(B, H, n, K)
        nt = _native.slots(B * H)
        work = R.new_empty(nt, 2 * K * V)
        st = None if states is None else states.contiguous()
        sf = None if Sf is None else Sf.contiguous()
        args = [H, n, K, V, dSf.contiguous(), R, _native.Strided(M), *M.stride()[:4], dS0, st, sf, dots, work]
        _native.call("scan_mat_bwd", R.dtype, B * H, nt, args)
        return R, dS0, dots
    Gs, dS0 = scan_matrix_reverse_torch_(dSf, R, M)
    return Gs, dS0, None if dots_with is None else next_state_dots(Gs, states, Sf)


def scan_matrix_reverse_torch_(dSf: torch.Tensor, R: torch.Tensor, M: torch.Tensor):
    """The PyTorch form of :func:`scan_matrix_reverse_`."""
    B, H, n, K, V = R.shape
    G = dSf.reshape(B * H, K, V)
    for i in range(n - 1, -1, -1):
        r = R[:, :, i]
        G_prev = torch.baddbmm(r.reshape(B * H, K, V), M[:, :, i].reshape(B * H, K, K).mT, G)
        r.copy_(G.view(B, H, K, V))
        G = G_prev
    return R, G.view(B, H, K, V)


def next_state_dots(Gs: torch.Tensor, states: torch.Tensor, S_final: torch.Tensor) -> torch.Tensor:
    """``⟨G_{i+1}, S_{i+1}⟩`` summed over ``V`` → ``[B, H, n, K]``: ``Gs[:, :, i]`` against the state
    leaving chunk ``i`` (``states[:, :, i + 1]``, the final state for the last chunk)."""
    out = Gs.new_empty(Gs.shape[:-1])
    out[:, :, :-1] = torch.linalg.vecdot(Gs[:, :, :-1], states[:, :, 1:])
    out[:, :, -1] = torch.linalg.vecdot(Gs[:, :, -1], S_final)
    return out


def unit_lower_inverse_(A: torch.Tensor) -> torch.Tensor:
    """``A⁻¹`` for unit lower-triangular ``A: [..., C, C]`` (contiguous; ones on the diagonal and
    zeros above it). On the CPU the C kernel ``unit_lower_inv`` of :mod:`._native` overwrites ``A``
    (forward substitution, row by row); else :func:`unit_lower_inverse_torch_`."""
    if A.is_contiguous() and A.numel() and _native_scan_ok(A):
        C = A.shape[-1]
        jobs = A.numel() // (C * C)
        nt = _native.slots(jobs)
        _native.call("unit_lower_inv", A.dtype, jobs, nt, [C, A, A.new_empty(nt, C)])
        return A
    return unit_lower_inverse_torch_(A)


def unit_lower_inverse_torch_(A: torch.Tensor) -> torch.Tensor:
    """``A⁻¹`` for unit lower-triangular ``A: [..., C, C]`` (contiguous; overwritten when ``C`` is a
    power of two, else padded with an identity block to one), by recursive 2×2 blocking:

        [[A11, 0], [A21, A22]]⁻¹ = [[A11⁻¹, 0], [−A22⁻¹ A21 A11⁻¹, A22⁻¹]]

    applied bottom-up (diagonal blocks of 2, 4, … rows), each level one batched matmul pair over
    all blocks of all matrices: ``log2 C`` levels and ``2C³/3`` flops per matrix (a third of a
    ``C × C`` product). Batched LAPACK solves instead loop over the matrices one call at a time,
    which is slow for many small matrices and stalls badly when threads are oversubscribed.
    """
    *lead, C, _ = A.shape
    P2 = 1 << max(C - 1, 0).bit_length()
    if P2 == C:
        X = A
    else:
        X = torch.zeros(*lead, P2, P2, dtype=A.dtype, device=A.device)
        X[..., :C, :C] = A
        X[..., C:, C:].diagonal(dim1=-2, dim2=-1).fill_(1.0)
    Xf = X.view(-1, P2, P2)
    m = 1
    while m < P2:
        nb = P2 // (2 * m)
        # the nb diagonal blocks of size 2m of every matrix: [N, nb, 2m, 2m] (a strided view)
        D = torch.diagonal(Xf.view(-1, nb, 2 * m, nb, 2 * m), dim1=1, dim2=3).permute(0, 3, 1, 2)
        if m == 1:  # 1×1 diagonal blocks are 1
            D[..., 1:, :1].neg_()
        else:
            Dc = D.reshape(-1, 2 * m, 2 * m)  # a compact copy of the blocks
            D[..., m:, :m].copy_(
                torch.bmm(torch.bmm(Dc[:, m:, m:], Dc[:, m:, :m]), Dc[:, :m, :m])
                .neg_()
                .view(D.shape[0], nb, m, m)
            )
        m *= 2
    return X if P2 == C else X[..., :C, :C]


def rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``Σ_j a[..., i, j] b[..., i, j]`` → ``[..., i]`` as a batch of 1×1 matmuls (no product
    tensor is materialised)."""
    m = a.shape[-1]
    return torch.bmm(a.reshape(-1, 1, m), b.reshape(-1, m, 1)).view(a.shape[:-1])
