"""Shared argument checking, dtype rules and variable-length (packed) handling for the ops.

Everything here is internal to :mod:`mnemo.ops` (except :func:`finite_checks` and
:func:`set_finite_checks`, exported there); the public ops document the rules they apply.

The prologue every op starts with lives here once: :func:`check_form` (``mode`` and
``chunk_size``), :func:`check_matrix_op` (``q, k, v`` and the packed offsets of the matrix
memories), :func:`check_initial_state`, :func:`check_groups` (the grouped ``B``/``C`` projections
of the state-space ops), and :func:`run_matrix_op` (finite checks, compute dtype, clamped gates,
the initial state and the packed-sequence path around an op's core).

Naming of the chunk forms (one scheme for every op). ``<op>_chunk`` is what ``mode="chunk"``
runs: the fast path, which hands over to its fallback where the fast path does not apply. A
fallback carries the plain name plus a suffix that says what it is: ``<op>_chunk_autograd`` (the
chunk form differentiated by autograd, safe for any decay: ``gla_chunk_autograd``,
``delta_chunk_autograd``) and ``<name>_torch`` (the PyTorch twin of a C kernel of
:mod:`._native`: ``ss_chunk_torch``, ``scan_decay_torch_``, ``unit_lower_inverse_torch_``).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import warnings
from collections.abc import Callable, Iterator, Sequence

import torch

from .._compile_marks import constant_result

#: Log-gates are clamped from below at this value in every form. ``exp(-60) < 1e-26``, so a gate of
#: ``-inf`` (a hard reset) behaves as a reset without producing ``-inf - (-inf) = nan`` inside the
#: cumulative sums, and the cumulative sums stay small enough to keep fp32 precision.
LOG_GATE_MIN = -60.0

#: The forms of the recurrent ops (``mode=``): the token-loop reference, the chunkwise-parallel
#: training form and the quadratic masked form, all computing the same function.
MODES = ("recurrent", "chunk", "parallel")


def check_mode(mode: str, allowed: Sequence[str]) -> None:
    if mode not in allowed:
        raise ValueError(f"mode must be one of {tuple(allowed)}, got {mode!r}")


def check_chunk_size(chunk_size) -> int:
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    return chunk_size


def check_form(mode: str, chunk_size, *, chunk_size_optional: bool = False) -> None:
    """``mode`` one of :data:`MODES`, ``chunk_size`` a positive int (or ``None`` if optional;
    default ``chunk_size_optional=False``)."""
    check_mode(mode, MODES)
    if chunk_size is not None or not chunk_size_optional:
        check_chunk_size(chunk_size)


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float64 if any input is float64, else float32 (bf16/fp16 inputs accumulate in fp32)."""
    for t in tensors:
        if t is not None and t.dtype == torch.float64:
            return torch.float64
    return torch.float32


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def avoid_host_reads(*tensors: torch.Tensor | None) -> bool:
    """Whether a data-dependent decision must be taken without reading a value back to Python:
    while ``torch.compile`` traces (a read breaks the graph), or when a tensor lives on a device
    other than the CPU (a read there is a host synchronisation, and on ``meta`` it raises). The
    callers then take the branch that is right for any data (the one they take while traced);
    on CPU tensors they read the value and pick the faster branch, as before."""
    if torch.compiler.is_compiling():
        return True
    return any(t is not None and t.device.type != "cpu" for t in tensors)


def assert_on_device(condition: torch.Tensor, message: str) -> None:
    """Check a 0-d bool tensor on its own device without reading it back (``torch._assert_async``):
    on CUDA a false ``condition`` fails the stream asynchronously (a device-side assert that the
    next synchronisation reports); on ``meta`` it is a no-op. For non-CPU tensors only: on the
    CPU the callers read the value and raise their own ``ValueError`` with the offending values."""
    torch._assert_async(condition, message)


def unwrapped(t: torch.Tensor) -> torch.Tensor:
    """``t`` without its ``torch.func`` wrappers (vmap's batched tensor, jvp's dual, grad's tracked
    tensor): the values a check may read back (under ``vmap`` all the batch's at once). A plain
    tensor comes back as it is."""
    while torch._C._functorch.is_functorch_wrapped_tensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t


class RangeWarning(UserWarning):
    """An op's input lies outside the range its model produces (a positive log-gate, an SSM ``A > 0``,
    a negative step): computed as given, since interventions may set such values on purpose."""


class NonFiniteError(ValueError):
    """An op received NaN or infinite inputs (reported instead of propagated silently)."""


def _finite_checks_from_env() -> bool:
    """``MNEMO_CHECK_FINITE``: ``1``/``true``/``on``/``yes`` (or unset) checks, ``0``/``false``/``off``/``no``
    does not (any case); anything else raises ``ValueError`` (as ``MNEMO_NATIVE``: a typo must not leave
    the checks on silently)."""
    raw = os.environ.get("MNEMO_CHECK_FINITE", "1")
    value = raw.strip().lower()
    if value in ("0", "false", "off", "no"):
        return False
    if value not in ("", "1", "true", "on", "yes"):
        raise ValueError(
            "MNEMO_CHECK_FINITE must be one of 1, true, on, yes (the NaN/inf checks on) or "
            f"0, false, off, no (off), got {raw!r}"
        )
    return True


_FINITE_CHECKS = _finite_checks_from_env()


def set_finite_checks(enabled: bool) -> None:
    """Turn the ops' NaN/inf input checks on (default) or off (also: ``MNEMO_CHECK_FINITE=0``, or
    ``false``/``off``/``no``, read at import; another value than those and ``1``/``true``/``on``/``yes``
    raises ``ValueError`` there).
    ``enabled`` must be a bool (``TypeError`` otherwise: ``"no"`` is not read as False)."""
    global _FINITE_CHECKS
    _FINITE_CHECKS = _as_switch(enabled)


def _as_switch(enabled) -> bool:
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be True or False, got {type(enabled).__name__} {enabled!r}")
    return enabled


@contextlib.contextmanager
def finite_checks(enabled: bool) -> Iterator[None]:
    """Inside the ``with`` block the ops' NaN/inf input checks are on or off as ``enabled`` says;
    the previous setting (see :func:`set_finite_checks`) is restored on exit, also on an error."""
    global _FINITE_CHECKS
    was = _FINITE_CHECKS
    _FINITE_CHECKS = _as_switch(enabled)
    try:
        yield
    finally:
        _FINITE_CHECKS = was


def check_finite(values: dict, gates: dict | None = None) -> None:
    """Raise :class:`NonFiniteError` naming the first input with NaN/inf entries. Log-gates may be
    ``-inf`` (a hard reset) but not NaN or ``+inf``; a positive log-gate (a decay above 1: the state
    grows and long sequences overflow) is computed as given and said with a :class:`RangeWarning`.

    Runs on CPU tensors only. Skipped while ``torch.compile`` traces (reading a sum back to Python
    would break the graph at every op call) and for tensors on any other device (CUDA, ``meta``):
    there the check would cost a host synchronisation per op call (3 per layer and forward), so
    NaN/inf is caught once per training step instead, by the trainer's finite check of the loss
    and the gradient norm (:class:`mnemo.train.trainer.TrainingDiverged`, naming the step, and
    the parameters that hold NaN/inf). To find which op's input went bad, rerun the step on CPU."""
    if not _FINITE_CHECKS or torch.compiler.is_compiling():
        return
    if any(t is not None and t.device.type != "cpu" for t in (*values.values(), *(gates or {}).values())):
        return
    # Fast path, one read of each tensor: a sum is NaN/inf whenever any term is (NaN and ±inf
    # propagate; +inf and -inf together give NaN), so a finite sum proves every term finite. A
    # non-finite sum (a bad input, or an overflow of huge finite values) falls through to the
    # exact element-wise check below. For log-gates ``-inf`` is allowed: the sum of a gate is NaN
    # or ``+inf`` whenever it holds a NaN or a ``+inf``, and otherwise finite or ``-inf``.
    ts = [t for t in values.values() if t is not None]
    gs = [g for g in (gates or {}).values() if g is not None]
    # no autograd graph for a check; under torch.func (vmap, jvp, grad) the values read are the
    # unwrapped ones (vmap cannot read a batched value back; the whole batch is checked instead)
    ts, gs = [unwrapped(t.detach()) for t in ts], [unwrapped(g.detach()) for g in gs]
    # A gate's largest value is NaN when it holds a NaN (max propagates it), +inf when it holds a
    # +inf and > 0 when any log-gate is positive: one read checks all three.
    if all(math.isfinite(float(t.sum())) for t in ts) and all(
        g.numel() == 0 or float(g.max()) <= 0 for g in gs
    ):
        return
    values = {name: None if t is None else unwrapped(t.detach()) for name, t in values.items()}
    gates = {name: None if g is None else unwrapped(g.detach()) for name, g in (gates or {}).items()}
    for name, t in values.items():
        if t is not None and not bool(torch.isfinite(t).all()):
            n_nan, n_inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
            raise NonFiniteError(
                f"{name} contains {n_nan} NaN and {n_inf} inf of {t.numel()} values; non-finite inputs are "
                "not propagated silently (find where they come from, or set MNEMO_CHECK_FINITE=0)"
            )
    for name, g in (gates or {}).items():
        if g is not None and bool((torch.isnan(g) | (g == float("inf"))).any()):
            n_nan, n_pinf = int(torch.isnan(g).sum()), int((g == float("inf")).sum())
            raise NonFiniteError(
                f"{name} (a log-gate) contains {n_nan} NaN and {n_pinf} +inf values; log-gates must be <= 0 "
                "(-inf is allowed: a hard reset)"
            )
        if g is not None and g.numel() and bool((g > 0).any()):
            warnings.warn(
                f"{name} (a log-gate) has {int((g > 0).sum())} of {g.numel()} values > 0 (largest "
                f"{float(g.max()):.4g}): a decay exp({name}) above 1 makes the state grow, and long "
                "sequences overflow; a model's gates are <= 0 (-softplus(x), logsigmoid(x)). Computed "
                "as given (an intervention may mean it)",
                RangeWarning,
                stacklevel=3,
            )


def check_sign(name: str, t: torch.Tensor | None, sign: str, meaning: str) -> None:
    """Say (a :class:`RangeWarning`) when ``t`` has a value of the wrong sign: ``sign="<= 0"`` (e.g.
    an SSM's ``A``, so that ``exp(Δ A) <= 1``) or ``">= 0"`` (a step size ``Δ``/``dt`` after its
    bias and softplus); ``meaning`` ends the message (why the sign matters). The op computes the
    values as given: a hook that patches or steers may mean them. Like :func:`check_finite` (and
    switched with it): on CPU tensors only, not while ``torch.compile`` traces; one read (the
    extreme value)."""
    if t is None or t.numel() == 0 or not _FINITE_CHECKS or torch.compiler.is_compiling():
        return
    if t.device.type != "cpu":
        return
    t = unwrapped(t.detach())
    extreme = float(t.max() if sign == "<= 0" else t.min())
    if (extreme <= 0) if sign == "<= 0" else (extreme >= 0):
        return
    if math.isnan(extreme):
        return  # NaN is check_finite's to report
    wrong = int((t > 0).sum() if sign == "<= 0" else (t < 0).sum())
    warnings.warn(
        f"{name} should be {sign}: {wrong} of {t.numel()} values are not (the most extreme is "
        f"{extreme:.4g}); {meaning}. Computed as given (an intervention may mean it)",
        RangeWarning,
        stacklevel=3,
    )


def check_interval(name: str, t: torch.Tensor | None, lo: float, hi: float, meaning: str) -> None:
    """Say (a :class:`RangeWarning`) when ``t`` has values outside ``[lo, hi]`` (e.g. the delta
    rule's ``beta`` outside ``[0, 2]``); ``meaning`` ends the message (why the range matters). The
    op computes the values as given. Like :func:`check_sign` (and switched with the finite checks):
    on CPU tensors only, not while ``torch.compile`` traces; one read (the extremes)."""
    if t is None or t.numel() == 0 or not _FINITE_CHECKS or torch.compiler.is_compiling():
        return
    if t.device.type != "cpu":
        return
    t = unwrapped(t.detach())
    least, most = (float(x) for x in torch.aminmax(t))
    if math.isnan(least) or math.isnan(most) or (least >= lo and most <= hi):
        return  # (NaN is check_finite's to report)
    wrong = int(((t < lo) | (t > hi)).sum())
    worst = most if most - hi >= lo - least else least
    warnings.warn(
        f"{name} should be in [{lo:g}, {hi:g}]: {wrong} of {t.numel()} values are not (the most extreme "
        f"is {worst:.4g}); {meaning}. Computed as given (an intervention may mean it)",
        RangeWarning,
        stacklevel=4,
    )


def check_floating(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")


def check_ndim(name: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    check_floating(name, t)
    if t.ndim != ndim:
        raise ValueError(f"{name} must have shape {layout} ({ndim} dims), got {_shape(t)}")


def check_shape(name: str, t: torch.Tensor, expected: Sequence[int], layout: str) -> None:
    check_floating(name, t)
    if tuple(t.shape) != tuple(expected):
        exp = "[" + ", ".join(str(s) for s in expected) + "]"
        raise ValueError(f"{name} must have shape {layout} = {exp}, got {_shape(t)}")


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int, int]:
    """Check ``q, k: [B, T, H, K]`` and ``v: [B, T, H, V]``; return ``(B, T, H, K, V)``."""
    check_ndim("q", q, 4, "[B, T, H, K]")
    B, T, H, K = q.shape
    if K == 0:
        raise ValueError(f"q and k need a head dimension K >= 1, got q of shape {_shape(q)}")
    check_shape("k", k, (B, T, H, K), "[B, T, H, K]")
    check_ndim("v", v, 4, "[B, T, H, V]")
    if tuple(v.shape[:3]) != (B, T, H):
        raise ValueError(f"v must have shape [B, T, H, V] = [{B}, {T}, {H}, V], got {_shape(v)}")
    return B, T, H, K, v.shape[-1]


def check_initial_state(
    initial_state: torch.Tensor | None, shape: Sequence[int], dims: str, *, varlen: bool, seqs: str = "N"
) -> None:
    """``initial_state`` (if given) of ``shape``: ``[B, <dims>]``, or with packed sequences
    ``[<seqs>, <dims>]`` (one row per sequence); ``dims`` names the other axes, e.g. ``"H, K, V"``."""
    if initial_state is None:
        return
    layout = f"[{seqs}, {dims}] (one row per packed sequence)" if varlen else f"[B, {dims}]"
    check_shape("initial_state", initial_state, shape, layout)


def check_matrix_op(q, k, v, *, mode: str, chunk_size, cu_seqlens) -> tuple[int, int, int, int, int, int]:
    """The checks every matrix-memory op (linear attention, GLA, the delta rule) starts with: the
    form, the chunk size, ``q, k: [B, T, H, K]``, ``v: [B, T, H, V]`` and the packed offsets.
    Returns ``(B, T, H, K, V, N)``, ``N`` the rows of the state (:func:`num_sequences`)."""
    check_form(mode, chunk_size)
    B, T, H, K, V = check_qkv(q, k, v)
    return B, T, H, K, V, num_sequences(cu_seqlens, B, T)


def check_groups(
    name: str, X: torch.Tensor, Bsz: int, T: int, N: int | None, heads: int, heads_name: str
) -> torch.Tensor:
    """A grouped projection (``B``/``C`` of the state-space ops): ``[B, T, N]`` (one group) or
    ``[B, T, G, N]`` with ``heads % G == 0`` (``N = None``: any state size); returns it 4-D."""
    check_floating(name, X)
    n = X.shape[-1] if N is None else N
    if X.ndim == 3 and tuple(X.shape) == (Bsz, T, n):
        return X[:, :, None, :]
    if (
        X.ndim == 4
        and tuple(X.shape[:2]) == (Bsz, T)
        and X.shape[3] == n
        and X.shape[2] > 0
        and heads % X.shape[2] == 0
    ):
        return X
    shown = "N" if N is None else str(N)
    raise ValueError(
        f"{name} must have shape [B, T, N] = [{Bsz}, {T}, {shown}] or "
        f"[B, T, G, N] = [{Bsz}, {T}, G, {shown}] with {heads_name} = {heads} divisible by G, got {_shape(X)}"
    )


def num_sequences(cu_seqlens: torch.Tensor | None, B: int, T: int) -> int:
    """The rows of the state: the number of packed sequences (checked) with ``cu_seqlens``, else ``B``."""
    return B if cu_seqlens is None else check_cu_seqlens(cu_seqlens, B, T)


def check_cu_seqlens(cu_seqlens: torch.Tensor, B: int, T: int) -> int:
    """Validate packed-sequence offsets; return the number of sequences ``N``."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.ndim != 1:
        got = _shape(cu_seqlens) if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor [N + 1] of sequence offsets, got {got}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    if B != 1:
        raise ValueError(f"with cu_seqlens the batch must be packed into B = 1, got B = {B}")
    if cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens must hold at least two offsets [0, T]")
    c = cu_seqlens.tolist()
    if c[0] != 0 or c[-1] != T:
        raise ValueError(f"cu_seqlens must start at 0 and end at T = {T}, got {c[0]} ... {c[-1]}")
    if any(b < a for a, b in zip(c[:-1], c[1:])):
        raise ValueError("cu_seqlens must be non-decreasing")
    return len(c) - 1


def varlen_index(cu_seqlens: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Gather index ``[N, Tmax]`` into the packed time axis, a validity mask, and ``Tmax``."""
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    lens = cu[1:] - cu[:-1]
    tmax = int(lens.max().item()) if lens.numel() else 0
    t = torch.arange(tmax, device=device)
    valid = t[None, :] < lens[:, None]
    idx = (cu[:-1, None] + t[None, :]).clamp(max=max(int(cu[-1].item()) - 1, 0))
    return idx, valid, tmax


def pad_packed(x: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``x: [1, T, ...]`` packed -> ``[N, Tmax, ...]`` right-padded with zeros."""
    out = x[0][idx]
    mask = valid.reshape(valid.shape + (1,) * (out.ndim - 2))
    return torch.where(mask, out, torch.zeros((), dtype=out.dtype, device=out.device))


def unpad_packed(y: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``y: [N, Tmax, ...]`` -> packed ``[1, T, ...]``."""
    return y[valid].unsqueeze(0)


def run_varlen(
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
    cu_seqlens: torch.Tensor,
    per_token: dict[str, torch.Tensor],
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run a recurrent op on packed sequences by right-padding them into a batch.

    Padding tokens are zeros (``k = v = 0``, log-gate ``0``, ``beta = 0``), which leave every memory
    state unchanged, so the state after the padding equals the state at each sequence's end and
    each sequence starts from its own row of ``initial_state`` (or zeros).
    """
    first = next(iter(per_token.values()))
    idx, valid, tmax = varlen_index(cu_seqlens, first.device)
    padded = {name: pad_packed(t, idx, valid) for name, t in per_token.items()}
    o, state = fn(**padded, **kwargs)
    return unpad_packed(o, valid), state


def inference_involved(tensors) -> tuple[bool, bool]:
    """``(inference mode on, any of tensors made under it)`` — what decides whether a step that
    takes autograd gradients inside a forward must run on copies outside ``torch.inference_mode``.
    Both ``False`` while ``torch.compile`` traces (dynamo cannot trace these queries: a graph break
    in every training forward; a compiled graph runs outside inference mode). ``None`` entries are
    skipped."""
    if torch.compiler.is_compiling():
        return False, False
    on = torch.is_inference_mode_enabled()
    return on, on or any(t is not None and t.is_inference() for t in tensors)


def _default_text(K: int) -> str:
    """The default scale as the messages of :func:`default_scale` show it (none for ``K = 0``)."""
    return f"K ** -0.5 = {K**-0.5:.4g}" if K >= 1 else f"K ** -0.5, which needs K >= 1, got K = {K}"


def default_scale(scale: float | None, K: int) -> float:
    """The query scale: ``K ** -0.5`` unless given; a given one must be a finite real number
    (``TypeError`` / ``ValueError`` naming ``scale`` otherwise). A tensor (e.g. a learned scale, so
    that its gradient flows) must hold one value (``ValueError`` naming its shape: the forms
    broadcast a larger one differently) and is taken as a 0-d tensor of its value (any shape of one
    value, so it never adds dimensions to ``q``); NaN/inf in it raise ``ValueError``
    as for a number (on the CPU, with the finite checks on, as :func:`check_finite`). A negative
    one is computed as given and said with a :class:`RangeWarning` (for a tensor: on the CPU, with
    the finite checks on, as :func:`check_sign`). With ``scale=None`` and ``K = 0`` (no default
    exists) it raises ``ValueError`` naming ``scale`` and ``K``."""
    if scale is None:
        if K < 1:  # (0 ** -0.5 would raise a bare ZeroDivisionError)
            raise ValueError(
                f"scale: the default K ** -0.5 needs a head dimension K >= 1, got K = {K}; pass a scale"
            )
        return K**-0.5
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(
                f"scale must be a number or a tensor of one value, got a tensor of shape {_shape(scale)}"
            )
        if (
            _FINITE_CHECKS
            and not torch.compiler.is_compiling()
            and scale.device.type == "cpu"
            and not math.isfinite(float(scale.detach()))
        ):
            raise ValueError(
                f"scale must be a finite number (or None for {_default_text(K)}), got {float(scale.detach())}"
            )
        check_sign("scale", scale, ">= 0", "a negative scale turns the scores q·k around")
        return scale.reshape(())  # (one value of any shape, e.g. [1, 1, 1, 1, 1], scales as a scalar)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__} {scale!r}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number (or None for {_default_text(K)}), got {scale}")
    if scale < 0:
        warnings.warn(
            f"scale should be >= 0 (None for {_default_text(K)}), got {scale}: a negative scale "
            "turns the scores q·k around (softmax attention then prefers the least similar keys; a "
            "linear memory's read changes sign). Computed as given (an intervention may mean it)",
            RangeWarning,
            stacklevel=3,
        )
    return scale


def state_or_zeros(
    initial_state: torch.Tensor | None, shape: Sequence[int], dtype: torch.dtype, like: torch.Tensor
) -> torch.Tensor:
    """``initial_state`` in ``dtype``, or zeros of ``shape`` (on ``like``'s device)."""
    return initial_state.to(dtype) if initial_state is not None else like.new_zeros(shape, dtype=dtype)


def run_core(
    core: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
    per_token: dict[str, torch.Tensor | None],
    *,
    scale: float,
    cu_seqlens: torch.Tensor | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run an op's core as ``core(**per_token, scale=...)`` (``None`` entries left out): on the
    tensors as given (the core converts them and applies ``scale`` to ``q`` itself, in its chunk
    form's one layout pass), or for packed sequences through :func:`run_varlen`, after converting
    every tensor to ``dtype`` and scaling ``q`` here (the core then runs with ``scale = 1``)."""
    tensors = {name: t for name, t in per_token.items() if t is not None}
    if cu_seqlens is None:
        return core(**tensors, scale=scale)
    tensors = {name: t.to(dtype) for name, t in tensors.items()}
    if scale != 1.0:
        tensors["q"] = tensors["q"] * scale
    return run_varlen(core, cu_seqlens, tensors)


def run_matrix_op(
    core: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
    per_token: dict[str, torch.Tensor],
    gates: dict[str, torch.Tensor | None],
    initial_state: torch.Tensor | None,
    state_shape: Sequence[int],
    *,
    scale: float | None,
    cu_seqlens: torch.Tensor | None,
    output_final_state: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The common body of the matrix-memory ops once their shapes are checked: NaN/inf checks
    (:func:`check_finite`; ``gates`` are log-gates), the compute dtype (:func:`compute_dtype`),
    gates clamped to :data:`LOG_GATE_MIN` in it, the initial state (or zeros of ``state_shape``)
    in it, the default ``scale`` (:func:`default_scale`), and
    ``core(S0=..., scale=..., **per_token, **gates)`` through :func:`run_core`. Returns what the
    public ops return: ``o`` in ``q``'s dtype and the final state (``None`` unless
    ``output_final_state``)."""
    q = per_token["q"]
    check_finite({**per_token, "initial_state": initial_state}, gates)
    cd = compute_dtype(*per_token.values(), *gates.values(), initial_state)
    clamped = {name: None if g is None else clamp_log_gate(g.to(cd)) for name, g in gates.items()}
    S0 = state_or_zeros(initial_state, state_shape, cd, q)
    scale = default_scale(scale, q.shape[-1])
    tensors = {**per_token, **clamped}
    o, S = run_core(functools.partial(core, S0=S0), tensors, scale=scale, cu_seqlens=cu_seqlens, dtype=cd)
    return o.to(q.dtype), (S if output_final_state else None)


def clamp_log_gate(g: torch.Tensor) -> torch.Tensor:
    return g.clamp(min=LOG_GATE_MIN)


def causal_mask(n: int, device, diagonal: int = 0) -> torch.Tensor:
    """Boolean ``[n, n]`` mask, True on and below the diagonal (``diagonal = -1``: strictly
    below; default ``diagonal=0``)."""
    return torch.ones(n, n, dtype=torch.bool, device=device).tril(diagonal)


#: Decay factors below ``exp(-40) ≈ 4e-18`` (under float64's epsilon) are flushed to exactly 0.
FLUSH_LOG = -40.0
_FLUSH = math.exp(FLUSH_LOG)


def _flush_at(dtype: torch.dtype) -> float:
    """The ``threshold`` that flushes ``exp(FLUSH_LOG)`` as rounded in ``dtype`` (bf16's ``4.2555e-18``
    lies above the float64 ``4.2484e-18``): ``exp(FLUSH_LOG)`` raised by ``4`` units of ``dtype``'s
    epsilon, while the ``exp`` of the next exponent above ``FLUSH_LOG`` that ``dtype`` holds is ``32``
    epsilons above it, so still kept."""
    return _FLUSH * (1.0 + 4.0 * torch.finfo(dtype).eps)


#: Upper clamp of :func:`decay_exp`'s exponent: ``exp(60) ≈ 1e26`` fits float32, so a masked entry
#: (any finite value) still gives an exact 0 after the mask, while a positive log-gate given on
#: purpose (a :class:`RangeWarning`) is computed as given, as the hand-written chunk forms do.
DECAY_EXP_MAX = 60.0


class _DecayExp(torch.autograd.Function):
    """``exp(clamp(x, FLUSH_LOG, DECAY_EXP_MAX)) · mask``, with factors at or below ``exp(FLUSH_LOG)``
    set to ``0`` (one ``threshold``, as cheap as ``clamp``), and the exp-like backward ``grad · out``.
    Written out because on CPU ``masked_fill`` with ``-inf``, ``where`` and ``clamp``'s own backward
    cost several times the ``exp`` itself: ``exp(-inf)`` alone runs ~8x slower than ``exp`` of
    finite numbers."""

    @staticmethod
    def forward(ctx, log_decay, mask):
        e = _decay_exp_values(log_decay, mask)
        ctx.save_for_backward(e)
        return e

    @staticmethod
    def backward(ctx, grad):
        (e,) = ctx.saved_tensors
        return grad * e, None


@constant_result
def _decay_exp_bounds(dtype: torch.dtype) -> tuple[float, float, float]:
    """``(FLUSH_LOG, DECAY_EXP_MAX, _flush_at(dtype))``: :func:`decay_exp`'s clamp and flush
    threshold in ``dtype``, which ``torch.compile`` puts in its graphs as constants. Read as module
    globals inside :class:`_DecayExp`'s forward, ``torch.compile(dynamic=True)`` made each float a
    symbolic graph input created in the subgraph where dynamo traced that forward; the next call's
    subgraph reused that (finished) subgraph's value and dynamo failed ("lift_tracked_freevar_to_input
    should not be called on root SubgraphTracer"; test_review_regressions_47f)."""
    return FLUSH_LOG, DECAY_EXP_MAX, _flush_at(dtype)


def _decay_exp_values(log_decay, mask):
    low, high, flush = _decay_exp_bounds(log_decay.dtype)  # (constants under torch.compile)
    e = log_decay.clamp(low, high).exp()
    e = torch.nn.functional.threshold_(e, flush, 0.0)  # (e's dtype is log_decay's)
    return e if mask is None else e * mask


class _DecayExpTransformable(torch.autograd.Function):
    """:class:`_DecayExp` for forward-mode AD (``jvp``: ``tangent · out``) and ``torch.func``
    transforms (``setup_context`` and a generated ``vmap`` rule); a separate class because
    ``torch.compile`` cannot trace a Function with a custom ``jvp``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(log_decay, mask):
        return _decay_exp_values(log_decay, mask)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)
        ctx.save_for_forward(output)

    @staticmethod
    def backward(ctx, grad):
        (e,) = ctx.saved_tensors
        return grad * e, None

    @staticmethod
    def jvp(ctx, tangent, _mask_tangent):
        (e,) = ctx.saved_tensors
        return None if tangent is None else tangent * e


def decay_exp(log_decay: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``exp(log_decay)``; exactly ``0`` where ``mask`` (bool, broadcast against ``log_decay``) is
    False or where the factor is at most ``exp(FLUSH_LOG) ≈ 4e-18``. A model's decays are ``≤ 0``
    in log space; a positive one (an intervention's, said by :class:`RangeWarning`) is computed as
    given up to ``exp(DECAY_EXP_MAX)``.

    Computed as ``exp(clamp(log_decay, FLUSH_LOG, DECAY_EXP_MAX))`` with the factors at or below
    ``exp(FLUSH_LOG)`` then set to ``0``, so nothing overflows (masked entries may hold any finite
    value), a factor above ``exp(FLUSH_LOG)`` is exact and a flushed one moves by at most ``4e-18``
    in absolute terms: each changed term is ``< 4e-18`` times the same term undecayed, below
    float64's rounding error. Flushing keeps float32 subnormals (``< 1.2e-38``, several times
    slower on CPUs) out of the matmuls, including products of two decay factors. The gradient is
    ``grad · out``: exact where the factor is kept, ``0`` where it is flushed or masked.
    """
    m = None if mask is None else mask.to(log_decay.dtype)
    if transformed(log_decay):
        return _DecayExpTransformable.apply(log_decay, m)
    return _DecayExp.apply(log_decay, m)


def first_order(backward):
    """Decorator for the hand-written ``backward`` of a chunk-form ``autograd.Function`` (first order
    only, and wrapped in ``once_differentiable`` here): raise when a graph of the gradient is asked
    for (``create_graph=True``: a gradient penalty, a second derivative). Without this, a gradient
    whose incoming cotangent needs no grad would come back as a constant and its dependence on the
    inputs (the second-order terms) would be silently dropped.

    Raises:
        RuntimeError: ``backward`` runs under grad mode (``create_graph=True``).
    """
    from torch.autograd.function import once_differentiable

    inner = once_differentiable(backward)

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"{type(ctx).__name__}: the chunk form's hand-written backward is first order, so a graph "
                "of its gradient (create_graph=True) would miss the second-order terms; use "
                "mode='recurrent' for higher-order gradients"
            )
        return inner(ctx, *grads)

    return wrapper


def decay_matrix(g: torch.Tensor) -> torch.Tensor:
    """``Γ_ts = exp(Σ_{r=s+1..t} g_r)`` for ``s ≤ t`` and ``0`` above the diagonal: log gates
    ``g [B, T, H]`` -> ``[B, H, T, T]``; per-channel ``g [B, T, H, K]`` -> ``[B, H, T, T, K]``.
    The sums are differences of cumulative sums of the clamped log gates (no products), both formed
    in float64 and rounded once to ``g``'s dtype: a float32 cumulative sum of hundreds of nats would
    give every difference ``|b| · 2^-24`` of error.
    Raises ``ValueError`` when ``g`` is not 3-D or 4-D (``TypeError`` when not a float tensor)."""
    check_floating("g", g)
    if g.ndim not in (3, 4):
        raise ValueError(f"g must have shape [B, T, H] or [B, T, H, K], got {_shape(g)}")
    check_sign("g", g, "<= 0", "a log-gate's decay exp(g) is at most 1")
    mask = causal_mask(g.shape[1], g.device)
    if g.ndim == 3:
        b = clamp_log_gate(g).transpose(1, 2).to(torch.float64).cumsum(-1)  # [B, H, T]
        diff = (b[..., :, None] - b[..., None, :]).to(g.dtype)
        return diff.masked_fill(~mask, float("-inf")).exp()
    b = clamp_log_gate(g).permute(0, 2, 1, 3).to(torch.float64).cumsum(-2)  # [B, H, T, K]
    diff = (b[..., :, None, :] - b[..., None, :, :]).to(g.dtype)
    return diff.masked_fill(~mask[..., None], float("-inf")).exp()


def transformed(*values) -> bool:
    """Whether forward-mode AD (a dual tensor) or a ``torch.func`` transform (``grad``, ``vjp``,
    ``jacrev``, ``jvp``, ``jacfwd``, ``vmap``) sees any tensor of ``values`` (others, ``None``
    included, are ignored), or a ``torch.func`` transform is active at all: a native kernel's or a
    chunk form's ``autograd.Function`` has neither a ``jvp`` nor a batching rule (and raises under
    an active transform even on plain tensors, e.g. a log-gate that ``vmap`` does not batch), its
    PyTorch twin has both (callers run the twin then). ``False`` while dynamo traces (it cannot
    trace the check: a graph break at every op)."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._are_functorch_transforms_active() or seen_by_transform(*values)


def seen_by_transform(*values) -> bool:
    """Whether forward-mode AD or a ``torch.func`` transform sees any tensor of ``values`` itself (a
    dual or a ``torch.func``-wrapped tensor; others, ``None`` included, are ignored): the peers'
    custom ops run on plain tensors under a transform, not on those
    (:func:`mnemo.ops.dispatch.under_transform`). ``False`` while dynamo traces."""
    if torch.compiler.is_compiling():
        return False
    import torch.autograd.forward_ad as fwAD

    return any(
        isinstance(t, torch.Tensor)
        and (fwAD.unpack_dual(t).tangent is not None or torch._C._functorch.is_functorch_wrapped_tensor(t))
        for t in values
    )
