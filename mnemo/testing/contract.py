"""The equivalence contract (DESIGN.md §4), written once for every recurrent op.

An :class:`OpSpec` says how to draw inputs, how to call one op and what to compare it against; the
``check_*`` functions each return a :class:`CheckResult`; :func:`run_contract` runs all of them for
one spec and :func:`verify` builds the spec from an op and the recurrence it claims to implement.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from .compare import F32_TOL, F64_TOL, compare

#: What a spec's op can do; a check that needs a feature the op lacks is not run.
FEATURES = frozenset({"initial_state", "final_state", "varlen", "grad", "empty"})


class ContractError(AssertionError):
    """A check of the contract failed (raised by :func:`require` and :meth:`Report.raise_if_failed`)."""


@dataclass
class OpSpec:
    """How to exercise one op.

    Inputs are drawn by ``make(B, T, H, K, V, dtype, gen) -> dict`` of per-token tensors, time in
    dim 1 (``q, k: [B, T, H, K]``, ``v: [B, T, H, V]``, gates ``[B, T, H]`` or ``[B, T, H, K]``;
    other ops map ``(B, H, K, V)`` onto their own shapes). The op is called either through
    ``call(inputs, *, mode, initial_state, output_final_state, cu_seqlens, chunk_size) -> (o, S)``
    or, when ``call`` is ``None``, as ``op(*args, **kwargs, mode=..., initial_state=...,
    output_final_state=..., cu_seqlens=..., chunk_size=...)`` with ``(args, kwargs) =
    arguments(inputs)`` — the calling convention of mnemo's ops, so :meth:`with_op` swaps in any
    op with the same signature (compared with its own recurrent mode unless ``reference`` is set).
    ``state_shape(N, H, K, V)`` is the state's shape.

    The reference is ``reference(inputs, *, initial_state, output_final_state, cu_seqlens,
    chunk_size) -> (o, S)`` or, when ``None``, the op's own ``mode="recurrent"`` (the token loop).
    Every mode in :attr:`fast_modes` is compared against it.

    ``static`` names the inputs without a time dimension (per-op parameters, e.g. ssd's ``A``,
    ``D``, ``dt_bias``): ``make`` draws them like the others but must draw the same values for a
    given shape (a fixed seed), since they are passed whole to every piece of a split, decoded or
    packed run; list them in ``grad_inputs`` to check their gradients too.

    Tolerances (relative RMS): ``f64_tol`` for float64 checks (default ``1e-10``), ``f32_tol`` for
    the float32 check at ``big_dims`` (default ``2e-5``). ``supports`` names the :data:`FEATURES`
    the op has (a third-party reference without ``cu_seqlens`` drops ``"varlen"``, say).
    """

    name: str
    make: Callable
    call: Callable | None = None
    state_shape: Callable | None = None
    modes: tuple[str, ...] = ("recurrent", "chunk", "parallel")
    chunk_size: int = 16
    grad_inputs: tuple[str, ...] = ("q", "k", "v")
    dims: tuple[int, int, int, int] = (2, 3, 8, 6)  # B, H, K, V for float64 checks
    big_dims: tuple[int, int, int, int, int] = (1, 2, 256, 32, 32)  # B, H, T, K, V for float32
    f32_tol: float = F32_TOL
    f64_tol: float = F64_TOL
    op: Callable | None = None
    arguments: Callable | None = None
    reference: Callable | None = None
    supports: frozenset = FEATURES
    static: tuple[str, ...] = ()
    claims: str | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if isinstance(self.modes, str):  # modes="chunk" is one mode, not five one-letter ones
            self.modes = (self.modes,)
        self.modes = tuple(self.modes)
        if not self.modes or not all(isinstance(m, str) and m for m in self.modes):
            raise ValueError(
                f"OpSpec {self.name!r}: modes must be a non-empty tuple of mode names, got {self.modes!r}"
            )
        if self.call is None and (self.op is None or self.arguments is None):
            raise ValueError(f"OpSpec {self.name!r}: give call, or op and arguments")
        if self.state_shape is None:
            raise ValueError(f"OpSpec {self.name!r}: state_shape is required")
        unknown = set(self.supports) - FEATURES
        if unknown:
            raise ValueError(
                f"OpSpec {self.name!r}: unknown features {sorted(unknown)}; known {sorted(FEATURES)}"
            )
        self.supports = frozenset(self.supports)

    # --- drawing inputs ----------------------------------------------------------------------------

    def inputs(self, T, dtype=torch.float64, seed=0, B=None, dims=None):
        """Per-token inputs of length ``T`` (a fixed draw for a given ``seed``)."""
        Bd, H, K, V = dims or self.dims
        gen = torch.Generator().manual_seed(seed)
        return self.make(B or Bd, T, H, K, V, dtype, gen)

    def state(self, N, dtype=torch.float64, seed=1, dims=None):
        """A random state for ``N`` sequences."""
        _, H, K, V = dims or self.dims
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(self.state_shape(N, H, K, V), generator=gen, dtype=dtype)

    # --- running -----------------------------------------------------------------------------------

    def has(self, feature: str) -> bool:
        return feature in self.supports

    @property
    def fast_modes(self) -> tuple[str, ...]:
        """The modes compared against the reference (all but ``"recurrent"`` when the reference is
        the op's own recurrent mode)."""
        if self.reference is None:
            return tuple(m for m in self.modes if m != "recurrent")
        return tuple(self.modes)

    @property
    def decode_mode(self) -> str:
        """The mode of the 1-token decoding steps (``"recurrent"`` when the op has it)."""
        return "recurrent" if "recurrent" in self.modes else self.modes[0]

    def run(
        self, inputs, mode, initial_state=None, cu_seqlens=None, chunk_size=None, output_final_state=True
    ):
        """``(o, final_state)`` of the op in ``mode``. ``mode="recurrent"`` (the token loop, which
        only mnemo's own PyTorch code implements) runs on the ``"torch"`` backend whatever backend
        is forced (``MNEMO_BACKEND``, :func:`~mnemo.ops.dispatch.use_backend`), so the fast forms of
        a forced backend are checked against it rather than refused."""
        if mode == "recurrent":
            from ..ops.dispatch import use_backend

            with use_backend("torch"):
                return self._run(inputs, mode, initial_state, cu_seqlens, chunk_size, output_final_state)
        return self._run(inputs, mode, initial_state, cu_seqlens, chunk_size, output_final_state)

    def _run(self, inputs, mode, initial_state, cu_seqlens, chunk_size, output_final_state):
        kw = dict(
            mode=mode,
            initial_state=initial_state,
            output_final_state=output_final_state,
            cu_seqlens=cu_seqlens,
            chunk_size=chunk_size or self.chunk_size,
        )
        if self.call is not None:
            return self.call(inputs, **kw)
        args, kwargs = self.arguments(inputs)
        return self.op(*args, **kwargs, **kw)

    def run_reference(self, inputs, initial_state=None, cu_seqlens=None):
        """``(o, final_state)`` of the reference."""
        if self.reference is None:
            return self.run(inputs, "recurrent", initial_state, cu_seqlens)
        return self.reference(
            inputs,
            initial_state=initial_state,
            output_final_state=True,
            cu_seqlens=cu_seqlens,
            chunk_size=self.chunk_size,
        )

    def reference_callable(self) -> Callable:
        """This spec's reference as a ``reference=`` callable for another spec."""
        if self.reference is not None:
            return self.reference
        spec = self

        def reference(
            inputs, *, initial_state=None, output_final_state=True, cu_seqlens=None, chunk_size=None
        ):
            return spec.run(inputs, "recurrent", initial_state, cu_seqlens)

        return reference

    def with_op(self, op: Callable, **changes) -> OpSpec:
        """This spec with another op of the same signature (and any other field changed).

        The reference stays what this spec's says: for mnemo's specs (``reference=None``) that is
        the *new* op's own ``mode="recurrent"``, so its forms are checked against each other only,
        and an op wrong in every form alike passes. To check an op against mnemo's recurrence, use
        :func:`~mnemo.testing.claim` / :func:`~mnemo.testing.verify` (``claims=``) instead."""
        return dataclasses.replace(self, op=op, call=None, **changes)


# --- results -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckResult:
    """The outcome of one check: ``error`` is the worst relative RMS error measured (``None`` when
    the check measures none, e.g. gradcheck), ``tol`` the tolerance it was held to, ``message``
    what the worst comparison was (or why the check failed), ``exception`` what was raised."""

    op: str
    check: str
    passed: bool
    error: float | None
    tol: float | None
    message: str = ""
    exception: BaseException | None = field(default=None, repr=False, compare=False)

    def __bool__(self) -> bool:
        return self.passed


def require(result: CheckResult) -> CheckResult:
    """Return ``result``, or raise :class:`ContractError` (chained to what the op raised) if it failed."""
    if not result.passed:
        raise ContractError(_describe(result)) from result.exception
    return result


def _describe(r: CheckResult) -> str:
    text = f"{r.op} {r.check}: {r.message}"
    if r.error is not None and r.tol is not None and math.isfinite(r.error) and r.error > r.tol:
        text += f" (worst relative RMS {r.error:.3e} > {r.tol:.1e})"
    return text


class Report(list):
    """The :class:`CheckResult` rows of one or more runs of the contract."""

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self)

    @property
    def failures(self) -> list[CheckResult]:
        return [r for r in self if not r.passed]

    def table(self) -> str:
        return format_table(self)

    def raise_if_failed(self) -> Report:
        if self.failures:
            raise ContractError("\n".join(_describe(r) for r in self.failures))
        return self


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if math.isinf(x):
        return "inf"
    return "0" if x == 0 else f"{x:.1e}"


def format_table(results: Iterable[CheckResult]) -> str:
    """A plain-text table: op, check, pass/FAIL, worst error, tolerance, and the message of each
    failed check."""
    rows = [("op", "check", "result", "worst err", "tol", "")]
    for r in results:
        rows.append(
            (
                r.op,
                r.check,
                "pass" if r.passed else "FAIL",
                _fmt(r.error),
                _fmt(r.tol),
                "" if r.passed else r.message,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = []
    for i, row in enumerate(rows):
        cells = [row[j].ljust(widths[j]) if j < 2 else row[j].rjust(widths[j]) for j in range(5)]
        lines.append(("  ".join(cells) + ("  " + row[5] if row[5] else "")).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


class _Worst:
    """Collects comparisons of one check and keeps the worst."""

    def __init__(self, spec: OpSpec, check: str, tol: float):
        self.spec, self.check, self.tol = spec, check, tol
        self.error, self.message = 0.0, ""

    def close(self, actual, expected, what: str) -> None:
        err, problem = compare(actual, expected)
        if math.isnan(err):  # (NaN > worst is False: it would be dropped, and the check pass)
            err, problem = math.inf, problem or "the error is NaN"
        if err > self.error or not self.message:
            self.error = err
            self.message = f"{what}: {problem}" if problem else what

    def fail(self, message: str) -> None:
        self.error, self.message = float("inf"), message

    def result(self) -> CheckResult:
        passed = self.error <= self.tol
        return CheckResult(self.spec.name, self.check, passed, self.error, self.tol, self.message)


def _guarded(check: str) -> Callable:
    """Run a check body; an exception becomes a failed result naming it."""

    def wrap(body):
        def checked(spec: OpSpec, *args, **kwargs) -> CheckResult:
            name = check(spec, *args, **kwargs) if callable(check) else check
            try:
                return body(spec, *args, **kwargs)
            except Exception as e:  # the op under test may raise anything
                msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")
                return CheckResult(spec.name, name, False, float("inf"), None, msg, e)

        checked.__doc__ = body.__doc__
        checked.__name__ = body.__name__
        checked.__wrapped__ = body
        return checked

    return wrap


def _slice(spec: OpSpec, inputs: dict, a: int, b: int) -> dict:
    return {n: t if n in spec.static else t[:, a:b] for n, t in inputs.items()}


def _cat(spec: OpSpec, parts: list[dict]) -> dict:
    return {n: parts[0][n] if n in spec.static else torch.cat([p[n] for p in parts], dim=1) for n in parts[0]}


def _batch(spec: OpSpec, x: dict) -> int:
    return next(t for n, t in x.items() if n not in spec.static).shape[0]


def _modes(spec: OpSpec, mode) -> tuple[str, ...]:
    return spec.fast_modes if mode is None else (mode,)


def _tag(base: str, mode) -> str:
    return base if mode is None else f"{base}[{mode}]"


# --- the checks ----------------------------------------------------------------------------------


@_guarded(lambda spec, T, with_state, mode=None: _tag("forms+S0" if with_state else "forms", mode))
def check_forms_agree(spec: OpSpec, T: int, with_state: bool, mode: str | None = None) -> CheckResult:
    """§4.1: every fast form (or just ``mode``) equals the reference — outputs and final states, in
    float64, for length ``T``, from a zero or a random initial state; the output also when no final
    state is asked for (``output_final_state=False``, the training call). The op must leave its
    inputs and the initial state unchanged. Tolerance ``spec.f64_tol``."""
    w = _Worst(spec, _tag("forms+S0" if with_state else "forms", mode), spec.f64_tol)
    x = spec.inputs(T)
    S0 = spec.state(_batch(spec, x)) if with_state else None
    o_ref, s_ref = spec.run_reference(x, S0)
    given = {n: t.clone() for n, t in x.items()}
    if S0 is not None:
        given["initial_state"] = S0.clone()
    for m in _modes(spec, mode):
        o, s = spec.run(x, m, S0)
        w.close(o, o_ref, f"{m} output T={T}")
        if spec.has("final_state"):
            w.close(s, s_ref, f"{m} final state T={T}")
            o, _ = spec.run(x, m, S0, output_final_state=False)
            w.close(o, o_ref, f"{m} output T={T} (output_final_state=False)")
        now = {**x, "initial_state": S0}
        changed = [n for n, t in given.items() if not torch.equal(now[n], t)]
        if changed:
            w.fail(f"{m} modified {', '.join(changed)} in place (T={T})")
            break
    return w.result()


@_guarded(lambda spec, T, a, mode: f"split[{mode}]")
def check_split(spec: OpSpec, T: int, a: int, mode: str) -> CheckResult:
    """§4.2: ``x[:, :a]`` then ``x[:, a:]`` from the carried state equals one run on ``x`` (outputs
    and final state, float64, ``spec.f64_tol``)."""
    w = _Worst(spec, f"split[{mode}]", spec.f64_tol)
    x = spec.inputs(T)
    S0 = spec.state(_batch(spec, x))
    o_full, s_full = spec.run(x, mode, S0)
    o1, s1 = spec.run(_slice(spec, x, 0, a), mode, S0)
    o2, s2 = spec.run(_slice(spec, x, a, T), mode, s1)
    w.close(torch.cat([o1, o2], 1), o_full, f"split@{a} of T={T} output")
    w.close(s2, s_full, f"split@{a} of T={T} state")
    return w.result()


@_guarded(lambda spec, T, prefill, mode: f"decode[{mode}]")
def check_token_steps_after_prefill(spec: OpSpec, T: int, prefill: int, mode: str) -> CheckResult:
    """§4.2 with 1-token steps: prefill ``prefill`` tokens with ``mode``, then decode one token at a
    time with ``spec.decode_mode`` from the carried state; equals one run of ``mode`` on all ``T``."""
    w = _Worst(spec, f"decode[{mode}]", spec.f64_tol)
    x = spec.inputs(T)
    o_full, s_full = spec.run(x, mode)
    outs = []
    o, s = spec.run(_slice(spec, x, 0, prefill), mode)
    outs.append(o)
    for t in range(prefill, T):
        o, s = spec.run(_slice(spec, x, t, t + 1), spec.decode_mode, s)
        outs.append(o)
    w.close(torch.cat(outs, 1), o_full, f"decode after prefill {prefill} output")
    w.close(s, s_full, f"decode after prefill {prefill} state")
    return w.result()


def _loss_grads(spec: OpSpec, x: dict, S0, runner: Callable) -> dict:
    x = {n: t.detach().clone().requires_grad_(n in spec.grad_inputs) for n, t in x.items()}
    if S0 is not None:
        S0 = S0.detach().clone().requires_grad_(True)
    o, s = runner(x, S0)
    gen = torch.Generator().manual_seed(7)
    wo = torch.randn(o.shape, generator=gen, dtype=torch.float64)
    loss = (o.double() * wo).sum()
    if spec.has("final_state"):
        ws = torch.randn(s.shape, generator=gen, dtype=torch.float64)
        loss = loss + (s.double() * ws).sum()
    loss.backward()
    grads = {n: x[n].grad for n in spec.grad_inputs}
    if S0 is not None:
        grads["initial_state"] = S0.grad
    return grads


@_guarded(lambda spec, T, mode=None: _tag("grad", mode))
def check_gradients_agree(spec: OpSpec, T: int, mode: str | None = None) -> CheckResult:
    """§4.3: gradients of a random linear function of ``o`` and the final state w.r.t. every input
    in ``spec.grad_inputs`` and the initial state agree with the reference's (float64,
    ``spec.f64_tol``)."""
    w = _Worst(spec, _tag("grad", mode), spec.f64_tol)
    x = spec.inputs(T)
    S0 = spec.state(_batch(spec, x)) if spec.has("initial_state") else None
    ref = _loss_grads(spec, x, S0, lambda xi, s: spec.run_reference(xi, s))
    for m in _modes(spec, mode):
        got = _loss_grads(spec, x, S0, lambda xi, s, m=m: spec.run(xi, m, s))
        for n, g in ref.items():
            if g is None:
                w.fail(f"no gradient reached {n} in the reference")
            elif got[n] is None:
                w.fail(f"{m}: no gradient reached {n}")
            else:
                w.close(got[n], g, f"{m} d/d{n}")
    return w.result()


@_guarded("gradcheck")
def check_gradcheck_reference(spec: OpSpec, fast: bool = False) -> CheckResult:
    """§4.3: ``torch.autograd.gradcheck`` of the reference (float64, tiny sizes, ``eps=1e-6``,
    ``atol=1e-6``); measures no relative error (``error`` is ``None``). ``fast`` (``mnemo verify
    --quick``): gradcheck's fast mode, which compares one random projection ``uᵀ J v`` of the
    analytical and numerical Jacobians (two finite differences per input instead of one per
    element: a wrong gradient is caught unless it is orthogonal to the random vectors)."""
    dims = (1, 2, 3, 2)
    x = spec.inputs(5, dims=dims)
    names = list(spec.grad_inputs)
    with_state = spec.has("initial_state")

    def f(*args):
        xi = dict(x)
        xi.update(dict(zip(names, args)))
        o, s = spec.run_reference(xi, args[len(names)] if with_state else None)
        return (o, s) if spec.has("final_state") else o

    args = [x[n].detach().clone().requires_grad_(True) for n in names]
    if with_state:
        args.append(spec.state(1, dims=dims).requires_grad_(True))
    torch.autograd.gradcheck(f, tuple(args), eps=1e-6, atol=1e-6, fast_mode=fast)
    detail = "eps 1e-6, atol 1e-6" + (", fast mode" if fast else "")
    return CheckResult(spec.name, "gradcheck", True, None, None, detail)


@_guarded(lambda spec, lengths, mode, with_state: f"varlen{'+S0' if with_state else ''}[{mode}]")
def check_varlen(spec: OpSpec, lengths: list[int], mode: str, with_state: bool) -> CheckResult:
    """§4.4: sequences packed with ``cu_seqlens`` (``B = 1``) equal running each one alone
    (outputs and the ``[N, ...]`` final states, float64, ``spec.f64_tol``)."""
    w = _Worst(spec, f"varlen{'+S0' if with_state else ''}[{mode}]", spec.f64_tol)
    seqs = [spec.inputs(L, B=1, seed=10 + i) for i, L in enumerate(lengths)]
    seqs = [{**x, **{n: seqs[0][n] for n in spec.static}} for x in seqs]  # one set of parameters
    S0 = spec.state(len(lengths)) if with_state else None
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    o, s = spec.run(_cat(spec, seqs), mode, S0, cu_seqlens=cu)
    outs, states = [], []
    for i, xi in enumerate(seqs):
        oi, si = spec.run(xi, mode, S0[i : i + 1] if S0 is not None else None)
        outs.append(oi)
        states.append(si)
    w.close(o, torch.cat(outs, 1), f"lengths {lengths} output")
    if spec.has("final_state"):
        w.close(s, torch.cat(states, 0), f"lengths {lengths} states")
    return w.result()


@_guarded(lambda spec, mode: f"float32[{mode}]")
def check_float32_realistic(spec: OpSpec, mode: str) -> CheckResult:
    """float32 at a realistic size (``spec.big_dims``, chunk 64): ``mode`` returns a float32 output
    (and final state) within ``spec.f32_tol`` of the float64 reference on the same (upcast) inputs."""
    w = _Worst(spec, f"float32[{mode}]", spec.f32_tol)
    B, H, T, K, V = spec.big_dims
    dims = (B, H, K, V)
    x = spec.inputs(T, dtype=torch.float32, dims=dims)
    S0 = spec.state(B, dtype=torch.float32, dims=dims) if spec.has("initial_state") else None
    o_ref, s_ref = spec.run_reference(
        {n: t.double() for n, t in x.items()}, None if S0 is None else S0.double()
    )
    o, s = spec.run(x, mode, S0, chunk_size=64)
    if o.dtype != torch.float32:
        w.fail(f"output dtype {o.dtype} for float32 inputs")
        return w.result()
    if spec.has("final_state") and s is not None and s.dtype != torch.float32:
        w.fail(f"final state dtype {s.dtype} for float32 inputs")
        return w.result()
    w.close(o, o_ref, f"B={B} H={H} T={T} K={K} V={V} output")
    if spec.has("final_state"):
        w.close(s, s_ref, f"B={B} H={H} T={T} K={K} V={V} state")
    return w.result()


@_guarded(lambda spec, mode: f"empty[{mode}]")
def check_empty(spec: OpSpec, mode: str) -> CheckResult:
    """``T = 0`` returns an empty output and passes the initial state through unchanged (exactly)."""
    x = spec.inputs(0)
    S0 = spec.state(_batch(spec, x))
    given = S0.clone()  # compare with the state as drawn: an op may write into the one it was given
    o, s = spec.run(x, mode, S0)
    if o.shape[1] != 0:
        return CheckResult(
            spec.name, f"empty[{mode}]", False, float("inf"), 0.0, f"output length {o.shape[1]}"
        )
    err, problem = compare(s, given)
    ok = not problem and torch.equal(s, given) and torch.equal(S0, given)
    if not problem and not torch.equal(S0, given):
        problem = "the op modified initial_state in place"
    msg = problem or ("" if ok else "final state differs from the initial state")
    return CheckResult(spec.name, f"empty[{mode}]", ok, err, 0.0, msg)


# --- running the contract ------------------------------------------------------------------------


def merge(results: list[CheckResult], check: str | None = None) -> CheckResult:
    """One row for several results of the same check: passed if all passed, the worst error, the
    message of the first failure (or of the worst comparison)."""
    first = results[0]
    errs = [r.error for r in results if r.error is not None]
    worst = max(results, key=lambda r: -1.0 if r.error is None else r.error)
    failed = [r for r in results if not r.passed]
    pick = failed[0] if failed else worst
    return CheckResult(
        first.op,
        check or first.check,
        not failed,
        max(errs) if errs else None,
        next((r.tol for r in results if r.tol is not None), None),
        pick.message,
        pick.exception,
    )


def plan(spec: OpSpec, quick: bool = False) -> list[tuple[str, list[Callable[[], CheckResult]]]]:
    """The checks :func:`run_contract` runs for ``spec``: ``(row name, [thunks])`` pairs, one row
    per check and mode. The lengths are those of ``tests/ops/test_contract.py``: forms at
    ``T = 1, c−1, c, c+1, 2c+5, 37`` (``c = spec.chunk_size``), splits of ``T = 2c+7`` at ``1, c−1,
    c, c+1, T−1``, decoding ``c+6`` tokens after prefills of ``1, c−1, c+2``, gradients at
    ``2c+3``, packed lengths ``[c+3, 0, 1, 2c−1]``. ``quick`` keeps one or two of each and runs
    gradcheck in its fast mode."""
    c = spec.chunk_size
    rows: list[tuple[str, list[Callable[[], CheckResult]]]] = []
    lengths = (c + 1, 37) if quick else (1, c - 1, c, c + 1, 2 * c + 5, 37)
    T_split = 2 * c + 7
    splits = (c + 1,) if quick else (1, c - 1, c, c + 1, T_split - 1)
    prefills = (c - 1,) if quick else (1, c - 1, c + 2)
    state_options = (False, True) if spec.has("initial_state") else (False,)
    carry = spec.has("initial_state") and spec.has("final_state")
    for with_state in state_options:
        for m in spec.fast_modes:
            rows.append(
                (
                    _tag("forms+S0" if with_state else "forms", m),
                    [lambda T=T, m=m, s=with_state: check_forms_agree(spec, T, s, m) for T in lengths],
                )
            )
    if carry:
        for m in spec.fast_modes:
            rows.append((f"split[{m}]", [lambda a=a, m=m: check_split(spec, T_split, a, m) for a in splits]))
        for m in spec.fast_modes:
            rows.append(
                (
                    f"decode[{m}]",
                    [lambda p=p, m=m: check_token_steps_after_prefill(spec, c + 6, p, m) for p in prefills],
                )
            )
    if spec.has("grad"):
        for m in spec.fast_modes:
            rows.append((f"grad[{m}]", [lambda m=m: check_gradients_agree(spec, 2 * c + 3, m)]))
        if spec.reference is None:
            rows.append(("gradcheck", [lambda: check_gradcheck_reference(spec, fast=quick)]))
    if spec.has("varlen"):
        for with_state in state_options:
            for m in spec.modes:
                name = f"varlen{'+S0' if with_state else ''}[{m}]"
                rows.append(
                    (name, [lambda m=m, s=with_state: check_varlen(spec, [c + 3, 0, 1, 2 * c - 1], m, s)])
                )
    for m in spec.fast_modes:
        rows.append((f"float32[{m}]", [lambda m=m: check_float32_realistic(spec, m)]))
    if spec.has("empty") and spec.has("initial_state") and spec.has("final_state"):
        for m in spec.modes:
            rows.append((f"empty[{m}]", [lambda m=m: check_empty(spec, m)]))
    return rows


def run_contract(
    spec: OpSpec,
    quick: bool = False,
    checks: str | Iterable[str] | None = None,
    progress: Callable | None = None,
) -> Report:
    """Run every check of the contract that applies to ``spec``; one :class:`CheckResult` per
    check and mode (see :func:`plan`). ``checks`` keeps rows whose name matches one of these glob
    patterns (``"forms*"``, ``"grad*"``); ``progress(result)`` is called after each row."""
    pats = [checks] if isinstance(checks, str) else list(checks or [])
    report = Report()
    for name, thunks in plan(spec, quick):
        if pats and not any(
            fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name.split("[")[0], p) for p in pats
        ):
            continue
        row = merge([t() for t in thunks], name)
        report.append(row)
        if progress is not None:
            progress(row)
    return report
