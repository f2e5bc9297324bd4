"""Maps for test-time-trained memories: how much the read at ``t`` owes to the value written at ``s``.

A memory written by an online learner (:func:`~mnemo.memory.neural_memory`) reads
``o_t = M_{W_t}(q_t)`` where ``W_t`` is the result of every earlier write ``(k_s, v_s)``. Viewed as a
function of the written values (queries, keys and gates held at their recorded values),
``o = f(v)``. This module attributes ``o_t`` to each ``v_s``.

**The attribution: gradient × input through the unrolled updates.** ::

    c_ts = J_ts v_s,      J_ts = ∂o_t / ∂v_s  (a V × V Jacobian, taken through every update
                          between s and t: decay, momentum, the delta rule's key removal,
                          mini-batch gradients at chunk-start weights, the MLP, N(A), …)

and the scalar map is the coefficient of ``v_s`` in its contribution,
``m_ts = ⟨c_ts, v_s⟩ / ‖v_s‖²``.

Why this one and not the linearisation of the read around the current weights
(``o_t ≈ M_{W_t}(q_t) + ∂M/∂W · Δθ_s``, one term per weight increment): a weight increment
``Δθ_s = −θ_s ∇ℓ(W⁰; k_s, v_s)`` is not the write of ``v_s`` alone — for the delta rule it holds the
removal ``−θ_s k_s k_sᵀ W_{s−1}`` of *earlier* values, and later writes keep rewriting it — so a split
by increments moves mass between tokens and does not reproduce the delta rule's exact map. The
Jacobian with respect to the *values* follows every later update of what ``v_s`` put in the memory,
so:

- for every memory that is **linear in the values** (matrix memory, ``dot``/``l2`` objective,
  ``none``/``decay`` retention, GD or momentum, any chunk size, ``decay_first``, per-channel decay;
  no gradient clipping, no norm/residual) ``J_ts = M_ts I`` exactly (value channels never mix), so
  ``c_ts = M_ts v_s`` and ``m_ts = M_ts`` *is* the exact mixing matrix — linear attention, GLA,
  Mamba-2/RetNet, the delta rule with its key-removal term, the gated delta rule, and the
  momentum/mini-batch variants nobody has an op map for. Such memories get the exact map directly
  (:func:`exact_value_map`, one run of the memory with the identity as values; no Jacobian).
- for a **nonlinear** memory (MLP, ℓp/Huber objectives, ℓq/KL/elastic-net retention, clipping) it
  is an *attribution*, not a mixing matrix. What holds instead of ``M v = o``:

  * ``Σ_s c_ts`` is the first-order (Euler) reconstruction of the writes' part of the read,
    ``o_t − b_t`` with the baseline ``b_t`` = the read of the memory written with zero values
    (the learned initial weights and anything before ``start`` kept). Its error is measured and
    returned (:class:`ValueAttribution.completeness_error`).
  * ``steps = n > 1`` integrates ``J`` along the path ``α v``, ``α ∈ [0, 1]``, from the zero-value
    baseline — integrated gradients (Sundararajan et al. 2017, who take a Riemann sum; any quadrature
    of the same path integral is integrated gradients) — as ``c_ts = Σ_i w_i J_ts(α_i v) v_s``
    (:func:`quadrature_nodes`): then ``Σ_s c_ts → o_t − b_t`` as ``n`` grows (complete
    attribution). ``rule="midpoint"`` (the default; ``α_i = (i − ½)/n``, ``i = 1 … n``, ``w_i = 1/n``, error
    ``O(1/n²)``) or ``"gauss_legendre"`` (exact when the read is a polynomial of degree ``≤ 2n`` in
    the values). Midpoint is the default because Gauss–Legendre is not better at every ``n``: on
    the five nonlinear presets (``T = 10``, 20 draws of the initial weights, ``n = 4, 8, 16``) it
    cut the median completeness error at ``n = 16`` by 3× (memora) to 10⁷× (ttt_linear), but its
    median was worse for moneta at ``n = 8, 16``, memora at ``n = 4, 8``, titans and ttt_mlp at
    ``n = 4``, and its worst draw worse in 10 of the 15 cases. A draw whose read nearly jumps
    along the path (titans, one draw: ``|d o/dα|`` 300× its median at one ``α``) defeats both rules.
    ``steps = 1`` is gradient × input at ``α = 1`` (weight 1) under either rule — not the
    one-node Gauss–Legendre rule at ``α = ½``.
  * ``Σ_s m_ts v_s`` keeps only the part of each contribution along its own value
    (``map_error``); circuit scores read ``|m_ts|`` row-normalised, as for every implicit map.

Cost: one forward-mode (JVP) pass per written token ``s`` (and per integration step): the tangent
``v_s`` at ``s`` gives ``J_ts v_s`` for every ``t``; the passes run as copies of the batch in a few
calls of the memory's token-loop reference (forward-over-reverse through its inner gradients).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.autograd.forward_ad as fwAD

from .engine import MemoryState, neural_memory
from .spec import MemorySpec

__all__ = [
    "ValueAttribution",
    "linear_in_values",
    "exact_value_map",
    "value_attribution",
    "attribute_read",
    "attribution_of_read",
    "project",
    "quadrature_nodes",
    "RULES",
]


class ValueAttribution(NamedTuple):
    """The read at ``t`` attributed to each written value ``v_s`` (sequence positions only).

    Attributes:
        maps: ``[B, H, T, T]`` scalar map ``m_ts`` (causal; exact mixing matrix when ``exact``).
        values: ``[B, T, H, V]`` the written values ``v_s``.
        output: ``[B, T, H, V]`` the writes' part of the read, ``o − baseline``.
        contributions: ``[B, H, T, T, V]`` ``c_ts = J_ts v_s`` (``maps[..., None] · v_s`` when
            ``exact``; ``None`` when not computed).
        baseline: ``[B, T, H, V]`` the read with every attributed value set to zero.
        exact: ``True`` when the memory is linear in the values (``maps @ values == output``).
    """

    maps: torch.Tensor
    values: torch.Tensor
    output: torch.Tensor
    contributions: torch.Tensor | None
    baseline: torch.Tensor
    exact: bool

    def reconstruction(self) -> torch.Tensor:
        """``Σ_s m_ts v_s`` ``[B, T, H, V]``."""
        return torch.einsum("bhts,bshv->bthv", self.maps, self.values)

    def map_error(self) -> float:
        """``‖Σ_s m_ts v_s − output‖ / ‖output‖`` (0 up to rounding when ``exact``)."""
        return _rel(self.reconstruction(), self.output)

    def completeness_error(self) -> float:
        """``‖Σ_s c_ts − output‖ / ‖output‖``: how far the attribution is from complete."""
        if self.contributions is None:
            return self.map_error()
        return _rel(self.contributions.sum(3).transpose(1, 2), self.output)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def linear_in_values(spec: MemorySpec) -> bool:
    """Whether the memory's read is linear in the written values with value channels that never
    mix (``∂o_t/∂v_s = M_ts I``): matrix memories with the ``dot`` or ``l2`` objective, ``none`` or
    ``decay`` retention, GD or momentum (any chunk size, decay order or per-channel decay), without
    gradient clipping, norm or residual."""
    return (
        spec.architecture == "matrix"
        and not spec.residual
        and not spec.norm
        and spec.objective in ("dot", "l2")
        and spec.retention in ("none", "decay")
        and spec.grad_clip is None
    )


def exact_value_map(
    spec: MemorySpec, q, k, theta, *, g=None, eta=None, delta=None, mode: str = "chunk"
) -> torch.Tensor:
    """The exact ``T × T`` mixing matrix ``M [B, H, T, T]`` of a memory linear in its values
    (:func:`linear_in_values`): the memory run from a zero state with the identity as values
    (``v_s = e_s ∈ R^T``), so ``o_t = Σ_s M_ts e_s`` is row ``t``. It equals the ops' maps
    (:func:`~mnemo.ops.delta_rule_map`, :func:`~mnemo.ops.gated_linear_attention_map`) where they
    exist, and covers momentum and mini-batch (chunked) variants that have none. From any initial
    state ``o = (read of the initial state) + M v``."""
    if not linear_in_values(spec):
        raise ValueError(f"exact_value_map: the memory {spec} is not linear in its values")
    B, T, H, _ = q.shape
    eye = torch.eye(T, dtype=q.dtype, device=q.device).expand(B, H, T, T).transpose(1, 2)
    with torch.no_grad():
        o, _ = neural_memory(spec, q, k, eye, theta, g=g, eta=eta, delta=delta, mode=mode)
    return o.detach().transpose(1, 2).tril()  # [B, H, t, s]; entries above the diagonal are 0 already


def _replicate(x, R: int):
    """``x`` repeated ``R`` times along the batch (rows ``r·B + b``); ``None`` stays ``None``."""
    if x is None:
        return None
    return x.repeat(R, *([1] * (x.ndim - 1)))


def attribute_read(
    read: Callable[[torch.Tensor], torch.Tensor],
    v: torch.Tensor,
    *,
    start: int = 0,
    steps: int = 1,
    rule: str = "midpoint",
    max_rows: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradient × input of a causal read with respect to the values, for any memory.

    ``read(v_rep)`` maps values ``[R·B, T, H, V]`` (the batch of ``v`` repeated ``R`` times, rows
    ``r·B + b``) to the read ``[R·B, T, H, V']``, each row independent of the others and each head
    of the others, and must support forward-mode AD (:mod:`torch.autograd.forward_ad`; the
    memories' token-loop references do, gradients inside them included). Values before ``start``
    are constants (not attributed).

    Returns ``(contributions [B, H, T', T', V'], output [B, T', H, V'], baseline [B, T', H, V'])``
    over the positions ``start …`` (``T' = T − start``): ``c_ts = Σ_i w_i J_ts(v(α_i)) v_s``, where
    ``v(α)`` scales the attributed values, with ``α_1 = w_1 = 1`` when ``steps = 1`` (gradient ×
    input, under either ``rule``) and otherwise the ``steps``-point quadrature ``rule`` on
    ``[0, 1]`` (:func:`quadrature_nodes`; integrated gradients from the zero-value baseline):
    ``"midpoint"`` (the default, ``α_i = (i − ½)/steps``, ``i = 1 … steps``, ``w_i = 1/steps``) or
    ``"gauss_legendre"`` (see the module docstring for why midpoint is the default);
    ``output`` is the read minus ``baseline`` (the read with the attributed values zeroed).
    One forward-mode pass per seed ``(α_i, s)`` — a tangent ``v_s`` at position ``s`` gives
    ``J_ts v_s`` for every ``t`` at once — batched as copies of the batch, at most ``max_rows``
    rows ``R·B`` per pass (at least one seed). Defaults: ``start=0``, ``steps=1``,
    ``rule="midpoint"``, ``max_rows=1024``.

    Raises:
        ValueError: ``steps`` or ``max_rows`` not an int ``>= 1``; ``start`` not an int in
            ``[0, T]``; ``rule`` not one of :data:`RULES`."""
    steps = _as_int("steps", steps, 1)
    rule = _as_rule(rule)
    max_rows = _as_int("max_rows", max_rows, 1)
    B, T, H, _ = v.shape
    start = _as_int("start", start, 0, T)
    v = v.detach()
    mask = torch.zeros(1, T, 1, 1, dtype=v.dtype, device=v.device)
    mask[:, start:] = 1
    with torch.no_grad():
        o = read(v)
        base = read(v * (1 - mask))
    Vo = o.shape[-1]
    Tn = T - start
    alphas, weights = ([1.0], [1.0]) if steps == 1 else [x.tolist() for x in quadrature_nodes(steps, rule)]
    seeds = [(a, w, s) for a, w in zip(alphas, weights) for s in range(start, T)]
    per_block = max(1, max_rows // B)
    contrib = v.new_zeros(B, H, Tn, Tn, Vo)
    for i0 in range(0, len(seeds), per_block):
        block = seeds[i0 : i0 + per_block]
        R = len(block)
        scale = torch.tensor([a for a, _, _ in block], dtype=v.dtype, device=v.device)
        scale = scale.repeat_interleave(B)[:, None, None, None]
        # a primal that requires grad: every tensor its tangent reaches then requires grad too, so
        # the references' fresh aliases of the weights (``view_as``) keep the tangents
        primal = (_replicate(v, R) * (1 - mask + mask * scale)).requires_grad_(True)
        tangent = torch.zeros_like(primal)
        for r, (_, _, s) in enumerate(block):
            tangent[r * B : (r + 1) * B, s] = v[:, s]
        with torch.enable_grad(), fwAD.dual_level():
            out = read(fwAD.make_dual(primal, tangent))
            jv = fwAD.unpack_dual(out).tangent
        if jv is None:  # the read does not depend on the values at all (e.g. a constant step)
            continue
        jv = jv.detach()[:, start:].reshape(R, B, Tn, H, Vo)
        for r, (_, w, s) in enumerate(block):
            contrib[:, :, :, s - start] += jv[r].transpose(1, 2) * w
    return _causal(contrib), (o - base)[:, start:], base[:, start:]


#: the quadrature rules of the integrated-gradients path integral (:func:`quadrature_nodes`)
RULES = ("gauss_legendre", "midpoint")


def _as_rule(rule) -> str:
    """``rule`` if it is one of :data:`RULES`, else a ValueError naming the argument, the allowed
    values and the value."""
    if not isinstance(rule, str) or rule not in RULES:
        want = " or ".join(repr(r) for r in RULES)
        raise ValueError(f"rule must be {want}, got {rule!r}")
    return rule


def _legendre(n: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(P_n(x), P_n'(x))`` by the three-term recurrence (``|x| < 1``)."""
    p0, p1 = torch.ones_like(x), x
    for k in range(1, n):
        p0, p1 = p1, ((2 * k + 1) * x * p1 - k * p0) / (k + 1)
    return p1, n * (x * p1 - p0) / (x * x - 1)


def quadrature_nodes(n: int, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Nodes ``α_i`` and weights ``w_i`` (float64 ``[n]`` each, ``Σ w_i = 1``, nodes increasing in
    ``(0, 1)`` and symmetric about ``½``) of an ``n``-point rule for ``∫_0^1 f(α) dα ≈ Σ w_i f(α_i)``.

    ``"gauss_legendre"``: ``α_i = (x_i + 1)/2``, ``w_i = ω_i/2`` from the ``n``-point Gauss–Legendre
    rule ``(x_i, ω_i)`` on ``[−1, 1]`` (exact for polynomials of degree ``≤ 2n − 1``): the ``x_i`` are
    the eigenvalues of the Legendre polynomials' Jacobi matrix (off-diagonal ``k/√(4k² − 1)``;
    Golub & Welsch 1969), polished by two Newton steps on ``P_n``, and ``ω_i = 2/((1 − x_i²)
    P_n'(x_i)²)``, all in float64. ``"midpoint"``: ``α_i = (i − ½)/n``, ``i = 1 … n``,
    ``w_i = 1/n`` (exact for degree ``≤ 1``; error ``O(1/n²)``).

    Raises:
        ValueError: ``n`` not an int ``>= 1``; ``rule`` not one of :data:`RULES`.
    """
    n = _as_int("n", n, 1)
    rule = _as_rule(rule)
    f64 = torch.float64
    if rule == "midpoint":
        return (torch.arange(n, dtype=f64) + 0.5) / n, torch.full((n,), 1.0 / n, dtype=f64)
    k = torch.arange(1, n, dtype=f64)
    off = k / torch.sqrt(4 * k * k - 1)
    x = torch.linalg.eigvalsh(torch.diag(off, 1) + torch.diag(off, -1))
    for _ in range(2):
        p, dp = _legendre(n, x)
        x = x - p / dp
    _, dp = _legendre(n, x)
    w = 2 / ((1 - x * x) * dp * dp)
    x, w = (x - x.flip(0)) / 2, (w + w.flip(0)) / 2  # exactly symmetric
    return (x + 1) / 2, w / 2


def _as_int(name: str, x, lo: int, hi: int | None = None) -> int:
    """``x`` as an int in ``[lo, hi]`` (no upper bound when ``hi`` is ``None``), else a ValueError
    naming ``name``, the range and the value."""
    try:
        i = None if isinstance(x, bool) else operator.index(x)
    except TypeError:
        i = None
    if i is None or i < lo or (hi is not None and i > hi):
        want = f"an int >= {lo}" if hi is None else f"an int in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {want}, got {x!r}")
    return i


def _causal(c: torch.Tensor) -> torch.Tensor:
    """Zero ``c[..., t, s, :]`` for ``s > t`` (exact zeros already up to the engine's masking)."""
    T = c.shape[2]
    keep = torch.ones(T, T, dtype=torch.bool, device=c.device).tril()
    return c * keep[:, :, None].to(c.dtype)


def attribution_of_read(
    read: Callable[[torch.Tensor], torch.Tensor],
    v: torch.Tensor,
    *,
    start: int = 0,
    steps: int = 1,
    rule: str = "midpoint",
    max_rows: int = 1024,
    exact: bool = False,
) -> ValueAttribution:
    """:func:`attribute_read` packed as a :class:`ValueAttribution` (the scalar map
    ``m_ts = ⟨c_ts, v_s⟩ / ‖v_s‖²``), for a memory given as a read function (e.g. HOPE's
    self-modifying memory). ``exact`` is the caller's statement that the read is linear in ``v``.
    ``start, steps, rule, max_rows`` as in :func:`attribute_read`. Defaults: ``start=0``,
    ``steps=1``, ``rule="midpoint"``, ``max_rows=1024``, ``exact=False``."""
    contrib, out, base = attribute_read(read, v, start=start, steps=steps, rule=rule, max_rows=max_rows)
    vs = v.detach()[:, start:]
    return ValueAttribution(project(contrib, vs), vs, out, contrib, base, exact)


def project(contrib: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``m_ts = ⟨c_ts, v_s⟩ / ‖v_s‖²`` (``0`` where ``v_s = 0``)."""
    vv = values.transpose(1, 2)  # [B, H, S, V]
    num = torch.einsum("bhtsv,bhsv->bhts", contrib, vv)
    den = vv.square().sum(-1)[:, :, None, :]
    tiny = torch.finfo(den.dtype).tiny
    return torch.where(den > tiny, num / den.clamp_min(tiny), torch.zeros_like(num))


def value_attribution(
    spec: MemorySpec,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    theta: torch.Tensor,
    *,
    g: torch.Tensor | None = None,
    eta: torch.Tensor | None = None,
    delta: torch.Tensor | None = None,
    initial_weights=None,
    start: int = 0,
    steps: int = 1,
    rule: str = "midpoint",
    method: str = "auto",
    mode: str = "chunk",
    max_rows: int = 1024,
    norm_weight: torch.Tensor | None = None,
    norm_bias: torch.Tensor | None = None,
) -> ValueAttribution:
    """The read of :func:`~mnemo.memory.neural_memory` attributed to each written value (see the
    module docstring). Inputs as :func:`~mnemo.memory.neural_memory` takes them (``[B, T, H, ·]``);
    ``initial_weights``: the memory's initial weights (``[H, in, out]`` learned parameters or
    ``[B, H, in, out]``; zeros when ``None``). Positions before ``start`` (e.g. a persistent
    prefix) are part of the memory's starting point: they are written but not attributed, and the
    returned tensors cover positions ``start …`` only.

    ``method``: ``"exact"`` (the exact map of a memory linear in its values;
    :func:`exact_value_map`), ``"jacobian"`` (gradient × input, any memory) or ``"auto"``
    (``"exact"`` where it applies). ``mode`` is the engine form of the exact map and of the
    output/baseline reads; the Jacobian always runs the token-loop reference (forward-mode AD).
    ``steps, rule, max_rows``: as in :func:`attribute_read` (the Jacobian method only).
    ``norm_weight, norm_bias``: the inner norm's learned ``[H, V]`` scale and shift, as
    :func:`~mnemo.memory.neural_memory` takes them (held at their values, not attributed).
    Computation runs in float32 (float64 for float64 inputs). Defaults: ``start=0``, ``steps=1``,
    ``rule="midpoint"``, ``max_rows=1024``, ``norm_weight=None``, ``norm_bias=None`` (the
    parameter-free norm).

    Raises:
        ValueError: ``method`` unknown, or ``"exact"`` for a memory not linear in its values;
            ``start`` not an int in ``[0, T]``; ``steps`` or ``max_rows`` not an int ``>= 1``;
            ``rule`` not one of :data:`RULES`; the inputs' shapes (from
            :func:`~mnemo.memory.neural_memory`).
    """
    if method not in ("auto", "exact", "jacobian"):
        raise ValueError(f"method must be 'auto', 'exact' or 'jacobian', got {method!r}")
    exact = linear_in_values(spec)
    if method == "exact" and not exact:
        raise ValueError("method='exact' needs a memory linear in its values (linear_in_values)")
    start = _as_int("start", start, 0, q.shape[1])
    steps = _as_int("steps", steps, 1)
    rule = _as_rule(rule)
    max_rows = _as_int("max_rows", max_rows, 1)
    cd = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v, theta, g, eta, delta, norm_weight, norm_bias = (
        None if x is None else x.detach().to(cd)
        for x in (q, k, v, theta, g, eta, delta, norm_weight, norm_bias)
    )
    B = q.shape[0]

    def state(rows: int) -> MemoryState | None:
        if initial_weights is None:
            return None
        from .state import init_state

        ws = [w.detach().to(cd) for w in initial_weights]
        if ws[0].ndim == 4:
            ws = [_replicate(w, rows // w.shape[0]) for w in ws]
            return init_state(spec, ws)
        return init_state(spec, ws, rows)

    def read(vr: torch.Tensor, mode: str = mode) -> torch.Tensor:
        R = vr.shape[0] // B
        args = [_replicate(x, R) for x in (q, k, theta, g, eta, delta)]
        o, _ = neural_memory(
            spec, args[0], args[1], vr, args[2], g=args[3], eta=args[4], delta=args[5],
            initial_state=state(vr.shape[0]), mode=mode, norm_weight=norm_weight, norm_bias=norm_bias,
        )  # fmt: skip
        return o

    if method == "jacobian" or (method == "auto" and not exact):
        return attribution_of_read(
            lambda vr: read(vr, "recurrent"), v, start=start, steps=steps, rule=rule, max_rows=max_rows,
            exact=exact,
        )  # fmt: skip
    M = exact_value_map(spec, q, k, theta, g=g, eta=eta, delta=delta, mode=mode)[..., start:, start:]
    vs = v[:, start:]
    with torch.no_grad():  # output and baseline from two runs of the memory (not from M)
        o = read(v)[:, start:]
        zeroed = v.clone()
        zeroed[:, start:] = 0
        base = read(zeroed)[:, start:]
    return ValueAttribution(M, vs, o - base, None, base, True)
