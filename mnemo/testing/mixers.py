"""The checks every token mixer gets for free: give :func:`check_mixer` a registered mixer name.

A mixer (:class:`mnemo.layers.Mixer`) promises: ``forward(x, state) -> (y, state)`` streams — any
split of the sequence, down to one token at a time, gives the one-call result; its typed state
is what ``state_size_bytes`` says; every intermediate passes a hook point once per call (a mixer
that reads its input in segments of its own: once per segment piece, the pieces tiling the call),
and a replaced value changes the result; its implicit attention (``mixing``), where it has one,
reproduces the op's output; gradients reach every parameter; and inside a
:class:`~mnemo.models.LanguageModel` cached decoding equals the full pass. Each check returns a
:class:`~mnemo.testing.CheckResult` (``error`` is the worst relative RMS difference, or ``0`` /
``inf`` for yes/no checks), so tests can ``require`` them and ``mnemo verify`` could print them.

All checks run on the CPU at small sizes, in float64 (``state_size`` in float32, the dtype whose bytes
it counts); the tolerance is ``1e-10`` (relative RMS).
"""

from __future__ import annotations

import math

import torch
from einops import einsum

from ..layers.hooks import HookPoint, _reset_span, kept_span, piece_stop, span
from ..layers.registry import MIXERS
from ..layers.state import nbytes, tensors
from .compare import F64_TOL, rel_rms
from .contract import CheckResult

CHECKS = ("split", "token_steps", "state_size", "hooks", "mixing", "gradients", "cached_decoding")


def _build(name: str, d_model: int, options: dict | None):
    if name not in MIXERS:
        raise KeyError(f"mixer {name!r} is not registered; registered: {sorted(MIXERS)}")
    torch.manual_seed(0)
    return MIXERS[name](d_model, **(options or {})).double().eval()


def _x(B, T, d, seed=1):
    return torch.randn(B, T, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _worst(*errors: float) -> float:
    """The largest error, a NaN counting as ``inf`` (``max`` would keep whichever came first)."""
    return max((math.inf if math.isnan(e) else e for e in errors), default=0.0)


def _state_error(a, b) -> float:
    ta, tb = tensors(a), tensors(b)
    if len(ta) != len(tb) or any(x.shape != y.shape for x, y in zip(ta, tb)):
        return math.inf
    return _worst(*(rel_rms(x.double(), y.double()) for x, y in zip(ta, tb)))


def _result(name, check, error, tol, message="") -> CheckResult:
    passed = bool(error <= tol)
    return CheckResult(name, check, passed, float(error), tol, message if not passed else "")


def check_split(name, d_model=32, options=None, T=13, splits=(1, 5, 12)) -> CheckResult:
    """``x[:, :a]`` then ``x[:, a:]`` from the returned state == one call (outputs and states)."""
    m = _build(name, d_model, options)
    x = _x(2, T, d_model)
    with torch.no_grad():
        y, s = m(x)
        worst = 0.0
        for a in splits:
            y1, s1 = m(x[:, :a])
            y2, s2 = m(x[:, a:], s1)
            worst = _worst(worst, rel_rms(torch.cat([y1, y2], 1), y), _state_error(s2, s))
    return _result(name, "split", worst, F64_TOL, f"splits {splits} of T={T} differ from one call")


def check_token_steps(name, d_model=32, options=None, T=9) -> CheckResult:
    """One token at a time from the carried state == one call."""
    m = _build(name, d_model, options)
    x = _x(2, T, d_model)
    with torch.no_grad():
        y, s = m(x)
        st, outs = None, []
        for t in range(T):
            yt, st = m(x[:, t : t + 1], st)
            outs.append(yt)
    err = _worst(rel_rms(torch.cat(outs, 1), y), _state_error(st, s))
    return _result(name, "token_steps", err, F64_TOL, "token-by-token decoding differs from one call")


def check_state_size(name, d_model=32, options=None, T=7) -> CheckResult:
    """``state_size_bytes(B, T)`` equals the bytes of the state a call on ``T`` tokens returns."""
    m = _build(name, d_model, options).float()
    with torch.no_grad():
        _, s = m(_x(3, T, d_model).float())
    said, real = m.state_size_bytes(3, T), nbytes(s)
    return _result(
        name,
        "state_size",
        0.0 if said == real else math.inf,
        0.0,
        f"state_size_bytes(3, {T}) = {said}, the returned state holds {real} bytes",
    )


def _tiles(name: str, point: HookPoint, fired: list, T: int) -> bool:
    """Whether hook ``name``'s firings ``[(offset, stop, value)]`` are one firing over the call, or pieces
    that tile it in stream order: the first starts at or before token 0 (a learned prefix comes
    first), each starts where the previous stopped, the last stops at ``T``, and a tensor value
    with a time axis holds its piece's tokens there (one firing over the call: the call's ``T``; more
    rows, a prefix, must be placed in the call as a piece, :func:`~mnemo.layers.hooks.enter_piece`)."""
    td = point.time_dim

    def holds(value, n: int) -> bool:  # a per-token tensor value has the n tokens it covers
        per_token = isinstance(value, torch.Tensor) and td is not None and value.ndim > td
        return not per_token or name.rsplit(".", 1)[-1] == "hook_state" or value.shape[td] == n

    if len(fired) == 1 and fired[0][1] is None:
        return holds(fired[0][2], T)
    if any(stop is None for _, stop, _ in fired):
        return False  # a firing over the whole call beside others
    for i, (offset, stop, value) in enumerate(fired):
        if i == 0 and offset > 0 or i > 0 and offset != fired[i - 1][1]:
            return False
        if not holds(value, stop - offset):
            return False
    return fired[-1][1] == T


def check_hooks(name, d_model=32, options=None, T=6) -> CheckResult:
    """Every hook point fires exactly once per call — or, for a mixer that reads its input in
    segments of its own (Titans MAC, the self-modifying projections; :mod:`mnemo.layers.hooks`),
    once per piece, each placed in the call (:func:`~mnemo.layers.hooks.span`) so that the pieces
    tile the call in stream order; a tensor value has the call's (the piece's) tokens along its time
    axis, a learned prefix's rows in a piece placed before token 0; zeroing
    ``hook_o`` (or, without it, the first tensor hook) changes the output — the hooked value is the
    one used downstream (default ``T=6``)."""
    m = _build(name, d_model, options)
    points = {n: p for n, p in m.named_modules() if isinstance(p, HookPoint)}
    if not points:
        return _result(name, "hooks", math.inf, 0.0, "the mixer has no hook points")
    calls: dict[str, list] = {}  # name -> [(offset, stop, value)] in firing order
    values: dict[str, object] = {}

    def seen(n, out):
        offset, length = span()
        stop = piece_stop() if length is not None else None
        calls.setdefault(n, []).append((offset, stop, out))
        values[n] = out

    handles = [p.register_forward_hook(lambda mod, i, out, n=n: seen(n, out)) for n, p in points.items()]
    x = _x(2, T, d_model)
    try:
        with torch.no_grad(), kept_span():
            _reset_span()  # one call read in one pass until the mixer says it reads pieces
            y, _ = m(x)
    finally:
        for h in handles:
            h.remove()
    wrong = {n: len(f) for n, f in calls.items() if not _tiles(n, points[n], f, T)}
    silent = sorted(set(points) - set(calls))
    if wrong or silent:
        return _result(
            name,
            "hooks",
            math.inf,
            0.0,
            f"hooks fired {wrong or ''} times (not once per call, nor once per piece of a tiling of the "
            f"call's {T} tokens, each value holding its tokens along its time axis) never: {silent}",
        )
    target = (
        "hook_o"
        if "hook_o" in points
        else next((n for n in points if isinstance(values[n], torch.Tensor)), None)
    )
    if target is None:
        return _result(name, "hooks", math.inf, 0.0, "no hook carries a tensor")
    h = points[target].register_forward_hook(lambda mod, i, out: torch.zeros_like(out))
    with torch.no_grad():
        y0, _ = m(x)
    h.remove()
    changed = not torch.equal(y0, y)
    return _result(
        name, "hooks", 0.0 if changed else math.inf, 0.0, f"zeroing {target} did not change the output"
    )


def check_mixing(name, d_model=32, options=None, T=11) -> CheckResult | None:
    """``maps @ values == output`` for the implicit attention (``None`` if the mixer has none).

    For a mixer whose map is an attribution rather than an exact mixing matrix
    (``mixing_exact`` false: test-time-trained MLP memories), the maps must be causal and the
    attribution complete to 10 %: the contributions of the writes sum to the read minus the read
    with every value zeroed (``ValueAttribution.completeness_error() < 0.1``)."""
    m = _build(name, d_model, options)
    if not m.mixing_hooks:
        return None
    acts = m.mixing_acts(_x(2, T, d_model))
    if not getattr(m, "mixing_exact", True):
        att = m.attribution(acts)
        causal = bool(torch.all(att.maps.triu(1) == 0))
        err = att.completeness_error() if causal else math.inf
        return _result(name, "mixing", err, 0.1, "the attribution is not causal or not complete (10 %)")
    with torch.no_grad():
        mx = m.mixing(acts)
    got = einsum(mx.maps, mx.values, "b h t s, b s h v -> b t h v")
    causal = bool(torch.all(mx.maps.triu(1) == 0))
    err = rel_rms(got, mx.output) if causal else math.inf
    return _result(
        name, "mixing", err, F64_TOL, "maps @ values differs from the output, or maps are not causal"
    )


def check_gradients(name, d_model=32, options=None, T=None) -> CheckResult:
    """A loss on the output sends a non-zero gradient to every parameter. The sequence spans two
    chunks and one token (``2 · chunk_size + 1``, at least 8) so that parameters acting only at a
    chunk boundary (a memory's own update rates) are reached too."""
    m = _build(name, d_model, options).train()
    T = T or max(8, 2 * (getattr(m, "chunk_size", None) or 0) + 1)
    y, _ = m(_x(2, T, d_model))
    (y * _x(2, T, d_model, seed=3)).sum().backward()
    dead = [
        n
        for n, p in m.named_parameters()
        if p.requires_grad and (p.grad is None or not p.grad.abs().sum() > 0)
    ]
    return _result(name, "gradients", 0.0 if not dead else math.inf, 0.0, f"no gradient reaches {dead}")


def check_cached_decoding(name, d_model=32, options=None, T=10, prefill=3) -> CheckResult:
    """In a two-layer :class:`LanguageModel`: prefill, then one token at a time with the cache,
    gives the full pass's logits."""
    from ..models import LanguageModel, ModelConfig

    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=23, d_model=d_model, n_layers=2, mixer=name, mixer_options={name: dict(options or {})}
    )
    model = LanguageModel(cfg).double().eval()
    ids = torch.randint(0, 23, (2, T), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full, _ = model(ids)
        out, state = model(ids[:, :prefill])
        outs = [out]
        for t in range(prefill, T):
            o, state = model(ids[:, t : t + 1], state)
            outs.append(o)
    err = rel_rms(torch.cat(outs, 1), full)
    return _result(name, "cached_decoding", err, F64_TOL, "cached decoding differs from the full pass")


def check_mixer(name: str, d_model: int = 32, options: dict | None = None) -> list[CheckResult]:
    """Run every check of this module on the registered mixer ``name`` (built with
    ``MIXERS[name](d_model, **options)``); returns one result per check that applies. Raises
    ``KeyError`` naming the registered mixers when ``name`` is not one of them (a mistyped name is
    not a broken mixer)."""
    if name not in MIXERS:
        raise KeyError(f"mixer {name!r} is not registered; registered: {sorted(MIXERS)}")
    runs = [
        check_split,
        check_token_steps,
        check_state_size,
        check_hooks,
        check_mixing,
        check_gradients,
        check_cached_decoding,
    ]
    results = []
    for fn in runs:
        try:
            r = fn(name, d_model, options)
        except Exception as e:  # a broken mixer is a failed row, not a crash of the whole run
            r = CheckResult(name, fn.__name__.removeprefix("check_"), False, math.inf, 0.0, repr(e), e)
        if r is not None:
            results.append(r)
    return results
