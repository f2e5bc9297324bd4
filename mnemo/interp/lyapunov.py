"""The exponents of a memory's transitions: the QR iteration for the Lyapunov spectrum of a product
of transitions (Benettin et al. 1980), the spectra of each kind of memory (diagonal gates, delta
rules, test-time-trained memories by forward-mode AD, memories known only as code by central
differences), half-lives and the classes of directions. :mod:`mnemo.interp.spectrum` explains what
each kind's transition ``A_t`` is and applies these to every layer of a model.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Callable

import torch

LN2 = math.log(2.0)
IRRELEVANT_HALF_LIFE = 4.0  # tokens
CLASSES = ("irrelevant", "intermediate", "marginal", "relevant")

# ------------------------------------------------------------------------------------------------
# the QR iteration
# ------------------------------------------------------------------------------------------------


def _real_0d(x) -> bool:
    """Whether ``x`` is a 0-d real (not bool, not complex) tensor."""
    return isinstance(x, torch.Tensor) and x.ndim == 0 and x.dtype != torch.bool and not x.dtype.is_complex


def lyapunov_spectrum(
    step: Callable[[int, torch.Tensor], torch.Tensor],
    T: int,
    n: int,
    k: int | None = None,
    *,
    batch_shape: tuple = (),
    q0: str | torch.Tensor | None = None,
    tokens: float | None = None,
    burn_in: int = 0,
    sort: bool = True,
    dtype: torch.dtype = torch.float64,
    device=None,
    seed: int = 0,
) -> torch.Tensor:
    """The ``k`` leading Lyapunov exponents ``[*batch_shape, k]`` of ``A_{T−1} ⋯ A_0``.

    ``step(t, Q)`` returns ``A_t Q`` for ``Q [*batch_shape, n, k]`` with orthonormal columns; it is
    called once per ``t = 0 … T−1`` in order (it may carry state, e.g. a trajectory). Each step
    re-orthonormalises ``Q_t R_t = A_t Q_{t−1}`` and accumulates ``log |R_t[i, i]|`` (``−inf`` where
    ``A_t`` annihilates a direction exactly). The sums are divided by ``tokens`` (default: the
    steps averaged, ``T − burn_in``; give the token count when a step spans several tokens), after
    skipping the first ``burn_in`` steps (default ``burn_in=0``).

    ``q0``: the starting basis — ``"identity"`` (the first ``k`` unit vectors; the default when
    ``k = n``), ``"random"`` (a seeded random orthonormal basis; the default when ``k < n``, where
    the leading exponents need a generic start) or a tensor ``[*batch_shape, n, k]`` (orthonormalised
    by its QR: any basis of full rank gives the exponents of the nested spans of its columns; its
    batch axes broadcast with ``batch_shape``; ``ValueError`` naming ``q0`` for another shape).
    ``sort``: exponents in descending order (the QR iteration yields them ordered only for a
    generic start; default ``sort=True``). ``seed``: the seed of the ``"random"`` basis (default
    ``seed=0``). Raises ``ValueError`` for a ``burn_in`` outside ``[0, T)`` (no step left to
    average), a ``T`` below 1 (no transition: no exponent, rather than zeros), a ``k`` that is not
    an int ``>= 1`` (one above ``n`` computes all ``n``) or a ``tokens`` that is not a finite
    number ``> 0`` (a negative count would flip every exponent's sign)."""
    if isinstance(T, bool) or not isinstance(T, numbers.Integral) or T < 1:
        raise ValueError(f"T: expected at least one step (transition) to average, got {T!r}")
    if isinstance(burn_in, bool) or not isinstance(burn_in, numbers.Integral) or not 0 <= burn_in < T:
        raise ValueError(
            f"burn_in: expected an int number of steps in [0, {T}) (of T = {T}), got {burn_in!r}"
        )
    if k is not None:  # (a numpy or 0-d tensor integer too, as int(k) took it before the check)
        given = k
        try:
            bool_like = isinstance(k, bool) or (isinstance(k, torch.Tensor) and k.dtype == torch.bool)
            k = None if bool_like else operator.index(k)
        except TypeError:
            k = None
        if k is None or k < 1:
            raise ValueError(
                f"k: expected an int >= 1 (exponents to compute) or None (all {n}), got {given!r}"
            )
    if _real_0d(tokens):  # a 0-d tensor count, as the division took it before the check
        tokens = float(tokens)
    if tokens is not None and (
        isinstance(tokens, bool) or not isinstance(tokens, numbers.Real) or not 0 < tokens < math.inf
    ):
        raise ValueError(
            f"tokens: expected a finite number of tokens > 0 (the sums' divisor), got {tokens!r}"
        )
    k = n if k is None else min(int(k), n)
    if q0 is None:
        q0 = "identity" if k == n else "random"
    if isinstance(q0, torch.Tensor):
        want = (*batch_shape, n, k)
        try:
            if q0.ndim < 2 or tuple(q0.shape[-2:]) != (n, k):
                raise RuntimeError
            # (a batched q0 with the default batch_shape=() runs per row, as step's Q)
            want = (*torch.broadcast_shapes(tuple(q0.shape[:-2]), tuple(batch_shape)), n, k)
            q0 = q0.to(dtype=dtype, device=device).expand(want)
        except RuntimeError:
            raise ValueError(
                f"q0: expected a starting basis of shape [*batch_shape, n, k] = {list(want)} (or one "
                f"that broadcasts to it), got {list(q0.shape)}"
            ) from None
        # orthonormal columns spanning the same nested subspaces (a scaled or skewed basis would add
        # its own log-stretch to the first step's R)
        Q = torch.linalg.qr(q0)[0]
    elif q0 == "identity":
        Q = torch.eye(n, k, dtype=dtype, device=device).expand(*batch_shape, n, k).clone()
    elif q0 == "random":
        gen = torch.Generator().manual_seed(seed)
        Q = torch.linalg.qr(torch.randn(*batch_shape, n, k, generator=gen, dtype=dtype))[0].to(device)
    else:
        raise ValueError(f"q0: 'identity', 'random' or a tensor, got {q0!r}")
    total = torch.zeros(*Q.shape[:-2], k, dtype=dtype, device=Q.device)
    for t in range(T):
        Q, R = torch.linalg.qr(step(t, Q).to(dtype))
        if t >= burn_in:
            total = total + R.diagonal(dim1=-2, dim2=-1).abs().log()
    lam = total / (tokens if tokens is not None else max(T - burn_in, 1))
    return lam.sort(dim=-1, descending=True).values if sort else lam


def matrix_spectrum(A: torch.Tensor, k: int | None = None, **kwargs) -> torch.Tensor:
    """Lyapunov exponents of explicit transitions ``A [*batch, T, n, n]`` (``A_t`` applied in order
    ``t = 0 …``): :func:`lyapunov_spectrum` with ``step = A_t @ Q``."""
    *batch, T, n, _ = A.shape
    return lyapunov_spectrum(
        lambda t, Q: A[..., t, :, :].to(Q.dtype) @ Q,
        T,
        n,
        k,
        batch_shape=tuple(batch),
        device=A.device,
        **kwargs,
    )


# ------------------------------------------------------------------------------------------------
# per kind of memory
# ------------------------------------------------------------------------------------------------


def _check_burn_in(burn_in, steps: int, what: str) -> None:
    """Raise ``ValueError`` unless ``burn_in`` is an int in ``[0, steps)`` (a step left to average)."""
    if isinstance(burn_in, bool) or not isinstance(burn_in, numbers.Integral) or not 0 <= burn_in < steps:
        raise ValueError(f"burn_in: expected an int number of {what} in [0, {steps}), got {burn_in!r}")


def diagonal_spectrum(g: torch.Tensor, *, burn_in: int = 0) -> torch.Tensor:
    """Exponents of diagonal transitions ``exp(g_t)`` for log decays ``g [B, T, *units]``: the time
    average ``mean_t g_t`` over ``t ≥ burn_in`` (exact: the QR iteration of a diagonal product is
    the product of the diagonals), averaged over the batch; ``[*units]``, float64. ``burn_in``:
    the first tokens left out, as in :func:`lyapunov_spectrum` (default ``burn_in=0``; ``ValueError``
    outside ``[0, T)``)."""
    if g.ndim < 2 or g.shape[1] < 1:
        raise ValueError(f"g: expected log decays [B, T, *units] with T >= 1, got shape {list(g.shape)}")
    _check_burn_in(burn_in, int(g.shape[1]), "tokens")
    return g.double()[:, burn_in:].mean(dim=(0, 1))


def delta_rule_spectrum(
    k: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    *,
    q0: str | torch.Tensor | None = None,
    burn_in: int = 0,
) -> torch.Tensor:
    """Exponents ``[H, K]`` (descending, averaged over the batch) of the delta-rule transitions
    ``A_t = (I − β_t k_t k_tᵀ) Diag(exp(g_t))`` for keys ``k [B, T, H, K]``, write strengths
    ``beta [B, T, H]`` and optional log decays ``g``: per head ``[B, T, H]`` (Gated DeltaNet) or per
    key channel ``[B, T, H, K]`` (Kimi Delta Attention: the decay acts before the delta step).

    A scalar decay commutes with everything, so its time average is added to every exponent
    exactly (no underflow of ``exp(g)`` products) and the QR iteration runs on ``I − β k kᵀ``; a
    per-channel decay does not commute with ``k kᵀ`` and enters each step's product (the iteration
    re-orthonormalises every step, so products over tokens cannot underflow; log decays below
    ``-60`` are taken as ``-60``, as :func:`mnemo.ops.gated_delta_rule` clamps them, so a ``-inf``
    reset is a finite, very fast decay rather than an exact zero). ``q0``, ``burn_in``: as in
    :func:`lyapunov_spectrum` (default ``burn_in=0``). Raises ``ValueError`` naming ``g`` for
    another shape."""
    k, beta = k.double(), beta.double()
    B, T, H, K = k.shape
    channel = g is not None and g.ndim == 4
    if g is not None and tuple(g.shape) not in ((B, T, H), (B, T, H, K)):
        raise ValueError(
            f"g: expected log decays [B, T, H] = {[B, T, H]} or [B, T, H, K] = {[B, T, H, K]}, "
            f"got shape {list(g.shape)}"
        )
    decay = g.double().clamp(min=-60.0).exp() if channel else None  # (the op's clamp)

    def step(t, Q):  # Q [B, H, K, K]
        kt = k[:, t]  # [B, H, K]
        if channel:
            Q = decay[:, t, :, :, None] * Q
        return Q - beta[:, t, :, None, None] * kt[..., :, None] * (kt[..., None, :] @ Q)

    lam = lyapunov_spectrum(step, T, K, batch_shape=(B, H), q0=q0, burn_in=burn_in, device=k.device)
    if g is not None and not channel:
        lam = lam + g.double()[:, burn_in:].mean(1)[..., None]
    return lam.mean(0)


def _check_directions(directions) -> None:
    """Raise ``ValueError`` unless ``directions`` (exponents to compute per head) is an int ``>= 1``."""
    if isinstance(directions, bool) or not isinstance(directions, numbers.Integral) or directions < 1:
        raise ValueError(f"directions: expected an int >= 1 (exponents to compute), got {directions!r}")


def memory_jvp_spectrum(
    spec,
    state,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    theta: torch.Tensor,
    g: torch.Tensor | None = None,
    eta: torch.Tensor | None = None,
    delta: torch.Tensor | None = None,
    *,
    directions: int = 32,
    method: str = "central",
    eps: float = 1e-6,
    seed: int = 0,
    burn_in: int = 0,
    norm_weight: torch.Tensor | None = None,
    norm_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int]:
    """Leading exponents ``[H, directions]`` (descending, nats/token, batch-averaged) of a
    test-time-trained memory, and ``n``, the dimension of its state per head.

    ``spec``: the :class:`~mnemo.memory.MemorySpec`; ``state``: its
    :class:`~mnemo.memory.MemoryState` at position 0 (a fresh stream) or at another chunk boundary
    (a multiple of ``chunk_size``: a memory after whole chunks, continued); ``q … delta``: the
    engine's inputs from there on, as the memory's hook points record them (``[B, T, H, …]``).

    One step of the iteration is one inner chunk (the engine's gradients of a chunk are all taken
    at the chunk's start weights): the Jacobian of (accumulators, momentum) at the chunk's end with
    respect to their values at its start, applied to the ``directions`` columns of ``Q`` at once
    (each tangent rides on its own copy of the batch) through the engine's token-loop reference
    :func:`~mnemo.memory.recurrent.memory_recurrent`, in float64. A trailing partial chunk is one
    step too.

    A finite-length estimate: the logs are summed from ``state`` on and divided by the tokens, so
    a transient of the first chunks counts once and fades only as ``1/T``. TTT-Linear
    (``x + LN(W x)``, scale-invariant in ``W``, so its Jacobian grows as ``1/‖W‖``) started from
    zero weights (``state`` of zeros) has there the Jacobian ``I − (Σ_t θ_t k_t k_tᵀ) ⊗ P / ε``
    (``P`` the centring projector, ``ε = 1e-5`` the layer norm's epsilon): its first chunk
    stretches by ``~θ|k|²/ε`` (``≈ e^10``), the later ones by ``≈ 1`` (no retention), so its
    leading exponents read ``≈ 10/T`` — "relevant" at ``context = T`` whatever ``T``. From the
    layer's own start (:class:`~mnemo.layers.NeuralMemory`: ``W_0 ~ N(0, 0.02²)``) the stretch is
    smaller (``λ·T ≈ 5`` for a fresh ``ttt_linear`` model, d_model 32, at ``T`` 32 and 128) but of
    the same kind. A true property of the map at small ``W``, not a rate of forgetting: ``burn_in``
    (whole inner chunks to skip, default ``0``; the divisor is then the tokens after them) gives
    the long-run rate.

    ``method``: ``"forward"`` — exact Jacobian-vector products by forward-mode AD (dual tensors
    through the engine's inner ``autograd.grad``; exact but slow, ~40× the plain update, because
    several ops of the engine fall back to Python decompositions under forward AD); ``"central"``
    (default) — the central difference ``(F(x + εv) − F(x − εv)) / 2ε`` with ``eps`` (unit tangents;
    error ``O(ε²)`` plus ``~1e-16/ε`` of rounding, ``≈ 1e-10`` relative at the default, far below
    what moves an exponent), about twice the cost of the plain update. ``seed``: the seed of the
    random starting basis of :func:`lyapunov_spectrum`. ``norm_weight, norm_bias``: the inner
    norm's learned ``[H, V]`` scale ``γ`` and shift ``β``, as :func:`~mnemo.memory.neural_memory`
    takes them (:meth:`~mnemo.layers.NeuralMemory.inner_norm_affine`; held fixed). Defaults:
    ``directions=32``, ``eps=1e-6``, ``burn_in=0``, ``seed=0``, ``norm_weight=None``,
    ``norm_bias=None`` (the parameter-free norm). Raises ``ValueError`` naming ``method``,
    ``directions`` (an int ``>= 1``), ``burn_in`` (an int in ``[0, chunks)``), ``state`` (not at a
    chunk boundary) or ``norm_weight``/``norm_bias`` (not ``[H, V]``, or no inner norm)."""
    from ..memory.engine import _check_affine
    from ..memory.recurrent import memory_recurrent
    from ..memory.state import MemoryState

    if method not in ("central", "forward"):
        raise ValueError(f"method: 'central' or 'forward', got {method!r}")
    _check_directions(directions)
    C = spec.chunk_size
    # chunk boundaries are absolute (position mod C), and at one the anchor is the weights: the
    # chunks below continue a state there exactly; inside a chunk (anchored elsewhere) they would not
    if int(state.position) % C != 0:
        raise ValueError(
            f"state: expected the memory's state at position 0 (a fresh stream) or at another chunk "
            f"boundary (a multiple of chunk_size {C}), got a state at position {int(state.position)}"
        )
    f64 = torch.float64

    def d(x):
        return None if x is None else x.detach().to(f64)

    q, k, v, theta, g, eta, delta = map(d, (q, k, v, theta, g, eta, delta))
    B, Tp, H = q.shape[:3]
    _check_affine(spec, norm_weight, norm_bias, H, v.shape[-1])
    affine = None
    if norm_weight is not None or norm_bias is not None:  # as the engine: a missing one is 1 or 0
        w = q.new_ones(H, v.shape[-1]) if norm_weight is None else d(norm_weight)
        affine = (w, torch.zeros_like(w) if norm_bias is None else d(norm_bias))

    def batch(x):
        x = d(x)
        return x.expand(B, *x.shape[1:]) if x.shape[0] != B else x

    cur = [batch(a) for a in state.weights]
    momentum = state.momentum is not None
    if momentum:
        cur += [batch(s) for s in state.momentum]
    n_layers = len(state.weights)
    shapes = [tuple(a.shape[-2:]) for a in cur]
    sizes = [i * o for i, o in shapes]
    n = sum(sizes)
    kd = min(int(directions), n)
    starts = list(range(0, Tp, C))
    if (
        isinstance(burn_in, bool)
        or not isinstance(burn_in, numbers.Integral)
        or not 0 <= burn_in < max(len(starts), 1)
    ):
        raise ValueError(
            f"burn_in: expected an int number of inner chunks in [0, {len(starts)}) "
            f"({Tp} tokens in chunks of {C}), got {burn_in!r}"
        )
    copies = kd if method == "forward" else 2 * kd + 1  # central: +εv, −εv and the primal

    def rep(x, sl):
        return None if x is None else x[:, sl].repeat(copies, *([1] * (x.ndim - 1)))

    def run(parts, t0, t1):
        sl = slice(t0, t1)
        A, S = tuple(parts[:n_layers]), (tuple(parts[n_layers:]) if momentum else None)
        _, st = memory_recurrent(
            spec,
            rep(q, sl),
            rep(k, sl),
            rep(v, sl),
            rep(theta, sl),
            rep(g, sl),
            rep(eta, sl),
            rep(delta, sl),
            MemoryState(A, S, A, None, t0),
            affine=affine,
        )
        return list(st.weights) + (list(st.momentum) if momentum else [])

    def step(c, Q):  # Q [B, H, n, kd] -> J Q
        t0, t1 = starts[c], min(starts[c] + C, Tp)
        flat = Q.permute(3, 0, 1, 2).reshape(kd * B, H, n).split(sizes, -1)
        tang = [t.reshape(kd * B, H, *shape) for t, shape in zip(flat, shapes)]
        if method == "forward":
            import torch.autograd.forward_ad as fwAD

            with fwAD.dual_level():
                duals = [
                    fwAD.make_dual(p.repeat(kd, 1, 1, 1).requires_grad_(True), t) for p, t in zip(cur, tang)
                ]
                unpacked = [fwAD.unpack_dual(o) for o in run(duals, t0, t1)]
                new = [u.primal.detach()[:B] for u in unpacked]
                jv = [
                    (u.tangent if u.tangent is not None else torch.zeros_like(u.primal)).detach()
                    for u in unpacked
                ]
        else:
            stacked = []
            for p, t in zip(cur, tang):
                pk = p.repeat(kd, 1, 1, 1)
                stacked.append(torch.cat([pk + eps * t, pk - eps * t, p]))
            outs = [o.detach() for o in run(stacked, t0, t1)]
            new = [o[2 * kd * B :] for o in outs]
            jv = [(o[: kd * B] - o[kd * B : 2 * kd * B]) / (2 * eps) for o in outs]
        cur[:] = new
        Z = torch.cat([t.reshape(kd, B, H, -1) for t in jv], -1)  # [kd, B, H, n]
        return Z.permute(1, 2, 3, 0)

    lam = lyapunov_spectrum(
        step,
        len(starts),
        n,
        kd,
        batch_shape=(B, H),
        tokens=Tp - C * burn_in,
        burn_in=burn_in,
        seed=seed,
        device=q.device,
    )
    return lam.mean(0), n


def state_spectrum(
    step: Callable,
    state,
    x: torch.Tensor,
    *,
    period: int,
    get: Callable,
    put: Callable,
    directions: int = 32,
    eps: float = 1e-6,
    seed: int = 0,
    burn_in: int = 0,
) -> tuple[torch.Tensor, int]:
    """Leading exponents ``[directions]`` (descending, nats/token, batch-averaged) of a stateful
    module's own transition, and ``n``, the dimension of the perturbed state per sample.

    For a memory whose update is known only as code (the self-modifying memories of HOPE, the levels
    of a Continuum Memory System), ``A_t`` is the Jacobian of the state after one step with respect
    to the state before it. ``step(state, x_chunk) -> state`` runs the module on ``x_chunk
    [B, period, d]``; ``get(state)`` lists the tensors ``[B, …]`` that form the perturbed state;
    ``put(state, tensors)`` returns ``state`` with them replaced (and whatever must stay equal to
    them at a step boundary, e.g. chunk-start copies of the weights). The iteration runs over the
    ``T // period`` whole periods of ``x [B, T, d]`` (a trailing partial period is left out: a step
    boundary must be a boundary of every chunk of the module, where its state is exactly ``get``'s
    tensors); the other state fields ride along on their unperturbed trajectory.

    Each step applies the Jacobian to the ``directions`` columns of ``Q`` at once by central
    differences ``(F(s + εu) − F(s − εu)) / 2ε`` (each tangent on its own copy of the batch, with
    the primal as the last copy), so ``step`` must be a float64 computation (error ``O(ε²)`` plus
    ``~1e-16/ε`` rounding, about ``1e-10`` relative at the default ``eps``). ``burn_in``: whole
    periods whose logs are left out (a transient from the module's initial state), the divisor then
    the tokens of the periods after them, as in :func:`lyapunov_spectrum`.

    Raises:
        ValueError: fewer than ``period`` tokens, ``get`` lists no tensor, ``directions`` is not
            an int ``>= 1``, or ``burn_in`` is not an int in ``[0, T // period)``.

    Defaults: ``directions=32``, ``eps=1e-6``, ``seed=0``, ``burn_in=0``."""
    from ..layers.state import map_tensors

    _check_directions(directions)
    B, T = int(x.shape[0]), int(x.shape[1])
    steps = T // int(period)
    if steps < 1:
        raise ValueError(f"x: expected at least period = {period} tokens, got {T}")
    _check_burn_in(burn_in, steps, f"periods of {period} tokens ({T} tokens)")
    first = get(state)
    if not first:
        raise ValueError("get: expected at least one state tensor, got none")
    shapes = [tuple(t.shape[1:]) for t in first]
    sizes = [math.prod(s) for s in shapes]
    n = sum(sizes)
    kd = min(int(directions), n)
    copies = 2 * kd + 1
    cur = [state]

    def one(c, Q):  # Q [B, n, kd] -> J Q
        xs = x[:, c * period : (c + 1) * period]
        big = map_tensors(lambda t: t.repeat(copies, *([1] * (t.ndim - 1))), cur[0])
        base = [t.expand(B, *shape).reshape(B, -1) for t, shape in zip(get(cur[0]), shapes)]
        tang = Q.permute(2, 0, 1).split(sizes, -1)  # per tensor [kd, B, size]
        stacked = [
            torch.cat([(b + eps * u).flatten(0, 1), (b - eps * u).flatten(0, 1), b]).reshape(
                copies * B, *shape
            )
            for b, u, shape in zip(base, tang, shapes)
        ]
        with torch.no_grad():
            new = step(put(big, stacked), xs.repeat(copies, *([1] * (xs.ndim - 1))))
        outs = [t.reshape(copies * B, -1) for t in get(new)]
        cur[0] = map_tensors(lambda t: t[2 * kd * B :], new)
        jv = [(o[: kd * B] - o[kd * B : 2 * kd * B]).reshape(kd, B, -1) / (2 * eps) for o in outs]
        return torch.cat(jv, -1).permute(1, 2, 0)

    lam = lyapunov_spectrum(
        one,
        steps,
        n,
        kd,
        batch_shape=(B,),
        tokens=(steps - burn_in) * period,
        burn_in=burn_in,
        seed=seed,
        device=x.device,
    )
    return lam.mean(0), n


# ------------------------------------------------------------------------------------------------
# half-lives and classes
# ------------------------------------------------------------------------------------------------


def half_lives(exponents: torch.Tensor) -> torch.Tensor:
    """``ln 2 / −λ`` tokens for ``λ < 0`` (``0`` for ``−inf``: gone at once), ``inf`` for ``λ ≥ 0``."""
    lam = torch.as_tensor(exponents, dtype=torch.float64)
    return torch.where(lam < 0, LN2 / (-lam), torch.full_like(lam, math.inf))


def check_irrelevant_half_life(irrelevant_half_life: float) -> None:
    """Raise ``ValueError`` unless ``irrelevant_half_life`` is a finite number of tokens > 0."""
    v = irrelevant_half_life
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
        raise ValueError(f"irrelevant_half_life: expected a finite number of tokens > 0, got {v!r}")


def classify(
    exponents,
    context: float,
    n: int | None = None,
    irrelevant_half_life: float = IRRELEVANT_HALF_LIFE,
) -> dict:
    """Shares of irrelevant / intermediate / marginal / relevant directions (module docstring) among
    the exponents ``[H, m]`` (or ``[m]``: one head), and the median half-life.

    ``n``: the full dimension per head when only the leading ``m < n`` exponents were computed; the
    ``n − m`` others are ``≤`` the head's last computed exponent, so they count as irrelevant when
    that one is, and as ``"unresolved"`` otherwise. The quantiles (``median`` … , tokens; ``inf``
    = never halves) are over the computed exponents. ``irrelevant_half_life``: the half-life
    (tokens) below which a direction is irrelevant (default ``irrelevant_half_life=4.0``,
    :data:`IRRELEVANT_HALF_LIFE`; ``ValueError`` unless a finite number > 0). When it is not
    shorter than ``context`` (a context of a few tokens) the irrelevant and marginal bands meet:
    irrelevant wins, so the shares stay disjoint and sum to 1 and no direction is intermediate.
    ``context``: the tokens the marginal band ``|λ| < ln 2 / context`` is drawn for; ``ValueError``
    unless a finite number > 0 (as :func:`~mnemo.interp.spectrum.memory_spectrum` asks)."""
    check_irrelevant_half_life(irrelevant_half_life)
    if isinstance(context, bool) or not isinstance(context, numbers.Real) or not 0 < context < math.inf:
        raise ValueError(f"context: expected a finite number of tokens > 0, got {context!r}")
    lam = torch.as_tensor(exponents, dtype=torch.float64)
    lam = lam.reshape(1, -1) if lam.ndim <= 1 else lam.reshape(-1, lam.shape[-1])
    H, m = lam.shape
    n = m if n is None else max(int(n), m)
    irr, marg = -LN2 / irrelevant_half_life, LN2 / context
    counts = {
        "irrelevant": (lam < irr).sum(),
        "relevant": (lam >= marg).sum(),
        "marginal": ((lam >= irr) & (lam > -marg) & (lam < marg)).sum(),
    }
    counts["intermediate"] = lam.numel() - sum(counts.values())
    counts = {c: int(counts[c]) for c in CLASSES}
    unresolved = 0
    if n > m:
        tail_irrelevant = lam.min(-1).values < irr  # per head
        counts["irrelevant"] += int(tail_irrelevant.sum()) * (n - m)
        unresolved = int((~tail_irrelevant).sum()) * (n - m)
    total = H * n
    out = {c: counts[c] / total for c in CLASSES}
    out["unresolved"] = unresolved / total
    # an exponent of −inf (a direction annihilated exactly) as the lowest float: quantiles then
    # interpolate instead of giving nan (−inf + inf), and a quantile down there is a half-life of 0
    low = torch.finfo(torch.float64).min
    qs = torch.quantile(lam.flatten().clamp_min(low), torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64))
    hl = half_lives(qs)  # the half-life grows with λ: λ's quantiles are the half-lives' ones
    hl = torch.where(qs < low / 2, torch.zeros_like(hl), hl)
    out.update(
        directions=total,
        computed=H * m,
        median_half_life=float(hl[1]),
        p10_half_life=float(hl[0]),
        p90_half_life=float(hl[2]),
        max_exponent=float(lam.max()),
        min_exponent=float(lam.min()),
        irrelevant_half_life=irrelevant_half_life,
        context=context,
    )
    return out
