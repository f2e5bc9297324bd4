"""Claims: an op (or an :class:`~mnemo.testing.contract.OpSpec`) checked against the registered
recurrence it says it implements. This ties the contract (:mod:`mnemo.testing.contract`) to the
registry of mnemo's specs (:mod:`mnemo.testing.specs`), which is built on the contract: a module of
its own, so that neither of those imports the other."""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable, Iterable

from .contract import OpSpec, Report, plan, run_contract
from .specs import get_spec


def claim(
    op: Callable,
    claims: str | OpSpec,
    *,
    name: str | None = None,
    modes: tuple[str, ...] | None = None,
    calling: str = "op",
    **changes,
) -> OpSpec:
    """An :class:`OpSpec` for ``op``, which claims to implement the recurrence ``claims``: a name of
    :data:`mnemo.testing.SPECS` (``"gated_delta_rule"``, ``"gla_scalar"``, ...; see
    :func:`~mnemo.testing.spec_names`) or an :class:`OpSpec`. The claimed spec's reference (for
    mnemo's ops, their ``mode="recurrent"`` token loop) is the reference; its input draws,
    dimensions and tolerances are reused.

    ``calling="op"``: ``op`` has the claimed mnemo op's signature (e.g. ``op(q, k, v, g, beta, *,
    mode, initial_state, output_final_state, cu_seqlens, chunk_size)``). ``calling="inputs"``:
    ``op(inputs: dict, *, mode, initial_state, output_final_state, cu_seqlens, chunk_size) ->
    (o, final_state)`` — an adapter around a callable with other conventions. ``modes``: the
    ``mode=`` values to test (default: the claimed spec's modes); every one is compared against the
    reference. ``changes``: other :class:`OpSpec` fields (``supports``, ``f64_tol``, ``make``, ...).

    Raises:
        KeyError: ``claims`` names no spec. ValueError: unknown ``calling``, or ``calling="op"``
        with a claimed spec that has no ``arguments``.
    """
    base = get_spec(claims) if isinstance(claims, str) else claims
    if calling not in ("op", "inputs"):
        raise ValueError(f"calling must be 'op' or 'inputs', got {calling!r}")
    if calling == "op" and base.arguments is None:
        raise ValueError(f"spec {base.name!r} has no `arguments` to call an op with; use calling='inputs'")
    fields = dict(
        name=name or getattr(op, "__name__", "op"),
        modes=((modes,) if isinstance(modes, str) else tuple(modes)) if modes is not None else base.modes,
        reference=base.reference_callable(),
        claims=base.name,
    )
    if calling == "op":
        fields.update(op=op, call=None)
    else:
        fields.update(call=op, op=None, arguments=None)
    fields.update(changes)
    return dataclasses.replace(base, **fields)


def verify(
    op: Callable | OpSpec,
    claims: str | OpSpec | None = None,
    *,
    quick: bool = False,
    checks: str | Iterable[str] | None = None,
    **claim_options,
) -> Report:
    """Run the contract on ``op`` and return the :class:`Report` (never raises for a failed check;
    call :meth:`Report.raise_if_failed` or :func:`require` in tests).

    ``op`` is an :class:`OpSpec`, or a callable with ``claims`` naming the recurrence it implements
    (see :func:`claim` for ``claims``, ``modes``, ``calling`` and the other options)::

        report = verify(my_gated_delta_rule, claims="gated_delta_rule", modes=("chunk",))
        print(report.table())
        assert report.passed

    ``checks``: glob patterns of the rows to run (``"forms*"``, ``"grad*"``; see :func:`plan`).

    Raises:
        ValueError: a ``checks`` pattern matches no check of the op (a mistyped pattern would
        otherwise give an empty report that passes).
    """
    spec = _spec(op, claims, claim_options)
    pats = [checks] if isinstance(checks, str) else list(checks or [])
    if pats:
        rows = [name for name, _ in plan(spec, quick)]
        names = set(rows) | {r.split("[")[0] for r in rows}
        missing = [p for p in pats if not any(fnmatch.fnmatchcase(n, p) for n in names)]
        if missing:
            raise ValueError(
                f"checks: {', '.join(map(repr, missing))} matches no check of {spec.name!r}; "
                f"known: {', '.join(sorted(names))}"
            )
    return run_contract(spec, quick, pats or None)


def _spec(op, claims, claim_options: dict) -> OpSpec:
    """The :class:`OpSpec` :func:`verify` runs."""
    if isinstance(op, OpSpec):
        if "calling" in claim_options:
            raise TypeError("verify(spec, ...): calling= applies to a callable, not to an OpSpec")
        spec = op
        if claims is not None:
            base = get_spec(claims) if isinstance(claims, str) else claims
            spec = dataclasses.replace(spec, reference=base.reference_callable(), claims=base.name)
        if claim_options:
            spec = dataclasses.replace(spec, **claim_options)
        return spec
    if claims is None:
        raise TypeError("verify(op, claims=...): name the recurrence the op claims to implement")
    return claim(op, claims, **claim_options)
