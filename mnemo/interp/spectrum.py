"""The memory spectrum: the long-run rates at which a memory forgets, per direction (DESIGN §7).

A memory written as ``S_t = A_t S_{t−1} + B_t`` forgets a direction ``u`` of ``S`` at the rate at
which the product ``A_t ⋯ A_1`` shrinks it. Along a real input those rates are the **Lyapunov
exponents** ``λ_1 ≥ … ≥ λ_n`` (nats per token) of the product, estimated by the standard QR
iteration (Benettin et al. 1980): ``Q_t R_t = A_t Q_{t−1}``, ``λ_i = (1/T) Σ_t log |R_t[i, i]|``
(:func:`lyapunov_spectrum`). An exponent ``λ < 0`` halves its direction every ``ln 2 / −λ``
tokens (its half-life).

What ``A_t`` is, per kind of memory (read from each mixer's hook points, as the rest of
:mod:`mnemo.interp`; nothing here reaches into a mixer's internals):

- **diagonal gates** (``hook_g`` only: GLA per (head, key channel), RetNet / Mamba-2 one scalar
  per head, Mamba ``Δ A`` per (channel, state)): ``A_t = diag(exp(g_t))``, so ``λ = mean_t g_t``
  exactly — the time average of the log decays that :mod:`~mnemo.interp.timescales` reads (on a
  fixed gate, its half-lives). A per-head scalar is one exponent per head.
- **delta rules** (``hook_k``, ``hook_beta`` and, gated, ``hook_g``: DeltaNet, Gated DeltaNet):
  ``A_t = exp(g_t) (I − β_t k_t k_tᵀ)`` on the key dimension of each head (the memory is
  ``K × V``; ``A`` acts on the left, so every exponent holds for all ``V`` value columns): ``K``
  exponents per head by the QR iteration (``mean g`` added exactly).
- **test-time-trained memories** (a memory module with ``hook_theta``: Titans LMM, TTT, Moneta,
  Yaad, Memora, the memory branch of Titans MAG/MAL): the update is nonlinear, and ``A_t`` is its
  Jacobian with respect to the memory's state (the accumulators of every layer and, with momentum,
  the momentum buffers) along the trajectory of the input. The engine takes every gradient of an
  inner chunk at the chunk's start weights, so one step of the iteration is one chunk: the
  Jacobian of the state at the chunk's end with respect to the state at its start, applied to the
  ``directions`` columns of ``Q`` by forward-mode AD (a JVP through the engine's token-loop
  reference, :func:`mnemo.memory.recurrent.memory_recurrent`, in float64); exponents are per
  token (the sum of a chunk's logs over its tokens). Only the leading ``directions`` exponents of
  each head are computed (``n`` = all parameters of the memory is thousands); the others are
  ``≤`` the last computed one. The exponents are finite-length estimates from the memory's
  initial state, so a first-chunk transient counts once over ``T`` tokens: TTT-Linear (``LN(W x)``,
  whose gain grows as ``W`` shrinks) stretches in its first chunk by ``~e^10`` from zero weights and
  by ``~e^5`` from a fresh layer's ``W_0 ~ N(0, 0.02²)``, so its exponents read ``≈ 5/T``, all
  "relevant"; :func:`memory_jvp_spectrum` with ``burn_in=1`` gives its long-run rate, ``≈ 0``.
- **memories known only as code** (HOPE's self-modifying Titans, the self-modifying projections,
  the levels of a Continuum Memory System): ``A_t`` is the Jacobian of the module's own state
  after one step with respect to the state before it, applied by central differences through the
  module itself run in float64 (:func:`state_spectrum`). One step spans the common multiple of the
  module's chunks (a self-modifying mixer) or of the levels' periods (a CMS), where the state is
  exactly its running weights; one exponent list per mixer (all its memories together: their
  coupling goes both ways in the self-modifying projections) and one per CMS level (key
  ``"{layer}.cms{level}"``; the levels feed one way, so together they are the CMS's spectrum).
- softmax attention keeps its KV cache (no transition); linear attention without a gate has
  ``A = I`` (every exponent 0).

Classes of directions (:func:`classify`; the renormalisation-group names): **irrelevant** —
forgotten within a few tokens, half-life ``< irrelevant_half_life`` (default 4 tokens, i.e.
``λ < −ln 2 / 4 ≈ −0.17``); **marginal** — ``|λ| < ln 2 / context``: neither halved nor doubled
over the whole context (``context`` = the tokens measured, unless given); **relevant** —
``λ ≥ ln 2 / context``, amplified (doubles within the context); **intermediate** — the rest: kept
for between ``irrelevant_half_life`` tokens and the context, the memory's working range.

The exponents of each kind live in :mod:`mnemo.interp.lyapunov` (re-exported here); this module
reads them from a model's layers (:func:`memory_spectrum`) and draws them (:func:`figure`).
"""

from __future__ import annotations

import copy
import math
import numbers
from pathlib import Path

import torch

from ..plotting import legend
from .lyapunov import (  # noqa: F401  (the exponents themselves, re-exported; applied to a model here)
    CLASSES,
    IRRELEVANT_HALF_LIFE,
    LN2,
    check_irrelevant_half_life,
    classify,
    delta_rule_spectrum,
    diagonal_spectrum,
    half_lives,
    lyapunov_spectrum,
    matrix_spectrum,
    memory_jvp_spectrum,
    state_spectrum,
)
from .maps import layer_indices

__all__ = [
    "lyapunov_spectrum",
    "matrix_spectrum",
    "diagonal_spectrum",
    "delta_rule_spectrum",
    "memory_jvp_spectrum",
    "state_spectrum",
    "memory_spectrum",
    "half_lives",
    "classify",
    "to_json",
    "figure",
    "plot",
    "IRRELEVANT_HALF_LIFE",
]


# ------------------------------------------------------------------------------------------------
# a model
# ------------------------------------------------------------------------------------------------

_SUFFIXES = (
    "hook_g",
    "hook_k",
    "hook_beta",
    "hook_theta",
    "hook_q",
    "hook_v",
    "hook_eta",
    "hook_delta",
    "hook_state",
)


def _test_time_memory(mixer):
    """``(path, module)`` of the test-time-trained memory inside ``mixer`` (the mixer itself or a
    submodule with ``hook_theta``, a ``spec`` and ``initial_state``), or ``None``."""
    for path, mod in mixer.named_modules():
        if (
            getattr(mod, "hook_theta", None) is not None
            and hasattr(mod, "spec")
            and hasattr(mod, "initial_state")
        ):
            return path, mod
    return None


def _multiplicity(state, heads: int, n: int) -> int:
    """Memory entries per exponent: the entries of a head's state ``[B, H, …]`` over its ``n``
    exponents (1 when the state is not such a tensor)."""
    if isinstance(state, torch.Tensor) and state.ndim >= 3 and state.shape[1] == heads:
        return max(1, math.prod(state.shape[2:]) // max(n, 1))
    return 1


def _layer_entry(
    kind: str, lam: torch.Tensor, n: int, mult: int, context: float, irr: float, **extra
) -> dict:
    lam = lam.reshape(-1, lam.shape[-1]) if lam.ndim > 1 else lam.reshape(-1, 1)
    entry = {
        "kind": kind,
        "heads": int(lam.shape[0]),
        "dim": int(n),
        "multiplicity": int(mult),
        **extra,
        "exponents": lam.tolist(),
        "half_lives": half_lives(lam).tolist(),
        "summary": classify(lam, context, n, irr),
        "per_head": [
            {c: v for c, v in classify(row, context, n, irr).items() if c in CLASSES + ("median_half_life",)}
            for row in lam
        ],
    }
    return entry


def _self_modifying_transition(mixer, state):
    """``(period, get, put, what)`` of a self-modifying mixer's state (its public fields): the
    running weights of every memory it rewrites; the chunk-start copies are tied to them (equal at
    a step boundary), and the short-conv tail (the last ``W − 1`` inputs, which no memory feeds)
    rides along on its trajectory. ``None`` for another state."""
    from dataclasses import replace

    if hasattr(state, "proj_anchor"):  # SelfModifyingTitansState: M_k, M_v, M_η, M_α (M_q) and M_memory
        period = math.lcm(int(mixer.chunk_size), int(mixer.proj_chunk_size))
        momentum = state.memory_momentum is not None  # DGD with momentum: the buffers are state too

        def get(st):
            return [*st.proj, *st.memory, *(st.proj_momentum or ()), *(st.memory_momentum or ())]

        def put(st, ts):
            proj, mem = tuple(ts[:2]), tuple(ts[2:4])
            st = replace(st, proj=proj, proj_anchor=proj, memory=mem, memory_anchor=mem)
            if momentum:
                st = replace(st, proj_momentum=tuple(ts[4:6]), memory_momentum=tuple(ts[6:8]))
            return st

        what = "the projection memories and the main memory"
        return period, get, put, what + (" (weights and momentum)" if momentum else "")
    if hasattr(state, "memory_weights"):  # SelfModifyingProjectionsState: P and the main memory
        period = math.lcm(int(mixer.chunk_size), int(mixer.spec.chunk_size))
        keys = sorted(state.proj)
        n_mem = len(state.memory_weights)

        def get(st):
            return [st.proj[k] for k in keys] + [*st.memory_weights, *(st.memory_momentum or ())]

        def put(st, ts):
            proj = dict(zip(keys, ts[: len(keys)]))
            w = tuple(ts[len(keys) : len(keys) + n_mem])
            mom = tuple(ts[len(keys) + n_mem :]) if st.memory_momentum is not None else None
            return replace(st, proj=proj, memory_weights=w, memory_momentum=mom, memory_anchor=w)

        return period, get, put, "the projection weights and the main memory"
    return None


def _cms_levels(cms, x, state_fn, directions, context, irr, seed, burn_in=0):
    """Per level of a Continuum Memory System: its own transition's spectrum (the diagonal block of
    the Jacobian; the other levels ride along on their trajectories). Levels feed one way in all
    three transfers (sequential: along the chain, in its order; independent: not at all; nested: slower into
    faster restarts), so the Jacobian over the whole CMS state is block-triangular and the levels'
    spectra together are the spectrum of the whole state."""
    from dataclasses import replace

    period = math.lcm(*(int(lv.level.period) for lv in cms.levels))
    out = []
    for li, lv in enumerate(cms.levels):
        entry = {"mixer": f"CMS level {li}", "period": int(lv.level.period)}
        if lv.level.objective == "task":
            entry.update(
                kind="unsupported",
                reason="a task-objective level steps on the training loss's error signal, not on its input",
            )
            out.append(entry)
            continue
        if x.shape[1] < period:
            entry.update(
                kind="unsupported", reason=f"needs at least {period} tokens (the periods' common multiple)"
            )
            out.append(entry)
            continue
        skip = _whole_steps(burn_in, period)
        if skip >= x.shape[1] // period:
            entry.update(kind="unsupported", reason=_burnt_reason(burn_in, period, x.shape[1], "period"))
            out.append(entry)
            continue

        def get(st, li=li):
            level = st.levels[li]
            return [*level.weights, *(level.momentum or ())]

        def put(st, ts, li=li):
            level = st.levels[li]
            w = tuple(ts[:2])
            mom = tuple(ts[2:]) if level.momentum is not None else None
            levels = list(st.levels)
            levels[li] = replace(level, weights=w, momentum=mom)
            return replace(st, levels=tuple(levels))

        lam, n = state_spectrum(
            lambda st, xs: cms(xs, st)[1],
            state_fn(),
            x,
            period=period,
            get=get,
            put=put,
            directions=directions,
            seed=seed,
            burn_in=skip,
        )
        extra = {"burn_in": skip * period} if burn_in else {}
        entry.update(
            _layer_entry(
                "test-time (state JVP)", lam[None], n, 1, context, irr, memory=f"level {li}", **extra
            )
        )
        out.append(entry)
    return out


def _whole_steps(burn_in: int, step: int) -> int:
    """The whole steps of ``step`` tokens that cover the first ``burn_in`` tokens."""
    return -(-int(burn_in) // int(step))


def _burnt_reason(burn_in: int, step: int, T: int, what: str) -> str:
    return (
        f"burn_in={burn_in} tokens leave no whole {what} of {step} tokens to average ({T} tokens): "
        "a shorter burn_in or more tokens"
    )


def memory_spectrum(
    model,
    input_ids: torch.Tensor,
    *,
    directions: int = 32,
    irrelevant_half_life: float = IRRELEVANT_HALF_LIFE,
    context: float | None = None,
    layers=None,
    method: str = "central",
    burn_in: int = 0,
) -> dict:
    """``{layer: entry}`` for every block of ``model`` on ``input_ids`` ``[B, T]``, plus
    ``{"{layer}.cms{level}": entry}`` for each level of a block whose MLP is a Continuum Memory
    System. The keys are str (``"0"``, ``"0.cms0"``: a sub-layer needs one, and
    :func:`~mnemo.interp.probe.circuit_scores` keys by str as well;
    :func:`~mnemo.interp.maps.capture_maps` keys by the int index).

    An entry holds ``"mixer"``, ``"kind"`` (``"diagonal"``, ``"delta"``, ``"test-time (JVP)"``,
    ``"test-time (state JVP)"`` (:func:`state_spectrum`: self-modifying mixers, CMS levels),
    ``"identity"``, ``"attention"``, ``"unsupported"``), and for a memory with transitions:
    ``"heads"``, ``"dim"`` (exponents per head in full), ``"multiplicity"`` (memory directions
    each exponent stands for: the value columns a left-acting transition treats alike),
    ``"exponents"`` ``[heads][computed]`` (row ``h`` is head ``h``; nats/token, descending within
    the row), ``"half_lives"`` (tokens),
    ``"summary"`` (:func:`classify` over all heads) and ``"per_head"`` (the shares and median
    half-life of each head). ``context`` (default the tokens measured, ``T − burn_in``) sets the
    marginal band ``|λ| < ln 2 / context``; ``directions`` (default ``32``) and ``method``: the
    exponents computed per head of a test-time-trained memory (the leading ``min(directions, dim)``) and how
    (:func:`memory_jvp_spectrum`). ``layers``: the blocks to read (an int or ints, numpy or 0-d tensor
    integers too; default all).

    ``burn_in``: the first tokens whose transitions are left out of every layer's average (the
    divisor is then the tokens after them), so that a transient from the memories' initial state
    (a first chunk's stretch of TTT-Linear from small weights, a start-of-text gate) does not bias a
    finite-length estimate of the long-run rate: a diagonal or delta-rule layer skips ``burn_in``
    tokens, a layer that steps by chunks or periods (a test-time-trained memory, a self-modifying
    mixer, a CMS level) the whole steps that cover them (``burn_in=1`` with ``chunk_size`` 16 skips
    one chunk, 16 tokens; such a layer's entry then says ``"burn_in"``: the tokens it skipped). The
    tokens are those of the memory's own stream: a memory that reads persistent tokens first
    (Titans) counts them among the first. A layer left with no whole step is ``"unsupported"`` with
    the reason.
    Defaults: ``directions=32``, ``burn_in=0``, ``irrelevant_half_life=4.0`` (:func:`classify`).

    Raises:
        ValueError: naming the argument: a layer out of range, ``directions`` not an int ``≥ 1``,
            ``context`` not a finite number ``> 0``, ``method`` not ``"central"`` or ``"forward"``,
            ``irrelevant_half_life`` not a finite number ``> 0``, ``burn_in`` not an int in
            ``[0, T)``, ``input_ids`` not ``[B, T]`` with ``T ≥ 1``."""
    n_blocks = len(model.blocks)
    if layers is not None:
        layers = layer_indices(layers, n_blocks)  # (a numpy or 0-d tensor integer too)
    if isinstance(directions, bool) or not isinstance(directions, int) or directions < 1:
        raise ValueError(f"directions: expected an int >= 1, got {directions!r}")
    if method not in ("central", "forward"):
        raise ValueError(f"method: 'central' or 'forward', got {method!r}")
    if context is not None and (
        isinstance(context, bool) or not isinstance(context, (int, float)) or not 0 < context < math.inf
    ):
        raise ValueError(f"context: expected a finite number of tokens > 0, got {context!r}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2 or input_ids.shape[1] < 1:
        got = list(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(
            f"input_ids: expected token ids [B, T] with T >= 1 (a transition to read), got {got}"
        )
    param = next(model.parameters(), None)
    if param is not None:
        input_ids = input_ids.to(param.device)
    T = int(input_ids.shape[1])
    if isinstance(burn_in, bool) or not isinstance(burn_in, numbers.Integral) or not 0 <= burn_in < T:
        raise ValueError(
            f"burn_in: expected an int number of tokens in [0, {T}) (of T = {T}), got {burn_in!r}"
        )
    burn_in = int(burn_in)
    context = float(context if context is not None else T - burn_in)
    check_irrelevant_half_life(irrelevant_half_life)
    irr = irrelevant_half_life
    wanted = [i for i in range(n_blocks) if layers is None or i in layers]
    prefixes = tuple(f"blocks.{i}.mixer." for i in wanted)
    names = [nm for nm in model.hook_points if nm.startswith(prefixes) and nm.rsplit(".", 1)[-1] in _SUFFIXES]
    # the inputs of the memories whose update is known only as code (run again in float64 below)
    for i in wanted:
        if hasattr(model.blocks[i].mixer, "spec") and _test_time_memory(model.blocks[i].mixer) is None:
            names.append(f"blocks.{i}.hook_resid_pre")
        if getattr(model.blocks[i].mlp, "periods", None) is not None:
            names.append(f"blocks.{i}.hook_resid_mid")
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            cache = model.run_with_cache(input_ids, names=names)[1] if names else {}
    finally:
        model.train(was)
    out = {}
    for i in wanted:
        mixer = model.blocks[i].mixer
        base = f"blocks.{i}.mixer."
        entry = {"mixer": type(mixer).__name__}

        def hook(name, root="", base=base):
            return cache.get(base + (root + "." if root else "") + name)

        ttm = _test_time_memory(mixer)
        g, kk, beta = hook("hook_g"), hook("hook_k"), hook("hook_beta")
        if ttm is not None:
            path, mem = ttm
            q, kq, v, theta = (hook(h, path) for h in ("hook_q", "hook_k", "hook_v", "hook_theta"))
            if q is None:
                entry.update(kind="unsupported", reason="the memory's hook points did not fire")
            elif _whole_steps(burn_in, mem.spec.chunk_size) >= -(-q.shape[1] // mem.spec.chunk_size):
                entry.update(
                    kind="unsupported",
                    reason=_burnt_reason(burn_in, mem.spec.chunk_size, q.shape[1], "inner chunk"),
                )
            else:
                C = mem.spec.chunk_size
                skip = _whole_steps(burn_in, C)
                state = mem.initial_state(q.shape[0]).memory_state()
                affine = getattr(mem, "inner_norm_affine", None)  # a NeuralMemory's learned γ, β
                norm_weight, norm_bias = affine() if callable(affine) else (None, None)
                lam, n = memory_jvp_spectrum(
                    mem.spec,
                    state,
                    q,
                    kq,
                    v,
                    theta,
                    hook("hook_g", path),
                    hook("hook_eta", path),
                    hook("hook_delta", path),
                    directions=directions,
                    method=method,
                    burn_in=skip,
                    norm_weight=norm_weight,
                    norm_bias=norm_bias,
                )
                entry.update(
                    _layer_entry(
                        "test-time (JVP)",
                        lam,
                        n,
                        1,
                        context,
                        irr,
                        memory=path or "mixer",
                        chunk_size=C,
                        **({"burn_in": skip * C} if burn_in else {}),
                    )
                )
        elif hasattr(mixer, "spec"):
            m64 = copy.deepcopy(mixer).double()
            x = copy.deepcopy(model.blocks[i].mixer_norm).double()(
                cache[f"blocks.{i}.hook_resid_pre"].double()
            )
            st = m64.initial_state(x.shape[0])
            period, get, put, what = _self_modifying_transition(m64, st)
            if x.shape[1] < period:
                entry.update(
                    kind="unsupported", reason=f"needs at least {period} tokens (its chunks' common multiple)"
                )
            elif _whole_steps(burn_in, period) >= x.shape[1] // period:
                entry.update(kind="unsupported", reason=_burnt_reason(burn_in, period, x.shape[1], "period"))
            else:
                skip = _whole_steps(burn_in, period)
                with torch.no_grad():
                    lam, n = state_spectrum(
                        lambda st, xs, m64=m64: m64(xs, st)[1],
                        st,
                        x,
                        period=period,
                        get=get,
                        put=put,
                        directions=directions,
                        burn_in=skip,
                    )
                extra = {"burn_in": skip * period} if burn_in else {}
                entry.update(
                    _layer_entry(
                        "test-time (state JVP)",
                        lam[None],
                        n,
                        1,
                        context,
                        irr,
                        memory=what,
                        period=period,
                        **extra,
                    )
                )
        elif beta is not None and kk is not None and beta.ndim == 3 and kk.ndim == 4 and kk.shape[1] == T:
            lam = delta_rule_spectrum(
                kk, beta, g if g is not None and g.ndim in (3, 4) else None, burn_in=burn_in
            )
            mult = _multiplicity(hook("hook_state"), lam.shape[0], kk.shape[-1])
            entry.update(_layer_entry("delta", lam, kk.shape[-1], mult, context, irr))
        elif g is not None and g.ndim in (3, 4) and g.shape[1] == T:
            lam = diagonal_spectrum(g, burn_in=burn_in)  # [H] (one scalar per head) or [H, K] (per channel)
            per_head = g.ndim == 3  # RetNet, Mamba-2: one exponent per head, row h = head h
            # per channel: each head's exponents in descending order (never across heads)
            lam = lam[:, None] if per_head else lam.sort(-1, descending=True).values
            mult = _multiplicity(hook("hook_state"), lam.shape[0], lam.shape[1])
            entry.update(
                _layer_entry(
                    "diagonal",
                    lam,
                    lam.shape[1],
                    mult,
                    context,
                    irr,
                    gate="per-head" if per_head else "per-channel",
                )
            )
        elif getattr(mixer, "hook_pattern", None) is not None:
            entry.update(kind="attention", reason="softmax attention keeps its KV cache (no transition)")
        elif kk is not None and kk.ndim == 4 and getattr(mixer, "hook_state", None) is not None:
            lam = torch.zeros(kk.shape[2], kk.shape[3], dtype=torch.float64)
            mult = _multiplicity(hook("hook_state"), kk.shape[2], kk.shape[3])
            entry.update(_layer_entry("identity", lam, kk.shape[3], mult, context, irr))
        else:
            entry.update(kind="unsupported", reason="no transition found in the mixer's hook points")
        out[str(i)] = entry
        cms = model.blocks[i].mlp
        if getattr(cms, "periods", None) is not None:
            c64 = copy.deepcopy(cms).double()
            x = copy.deepcopy(model.blocks[i].mlp_norm).double()(cache[f"blocks.{i}.hook_resid_mid"].double())
            with torch.no_grad():
                levels = _cms_levels(
                    c64, x, lambda c64=c64, x=x: c64(x[:, :0])[1], directions, context, irr, 0, burn_in
                )
            for li, level in enumerate(levels):
                out[f"{i}.cms{li}"] = level
    return out


def to_json(record: dict) -> dict:
    """``record`` (e.g. :func:`memory_spectrum`'s result) as strict JSON (RFC 8259) as every command
    writes it (:func:`mnemo.train.sinks.dumps_record`): each non-finite float (an infinite half-life,
    a ``-inf`` exponent) is ``None`` and the field ``"nonfinite"`` maps where it was (``"layers/0/
    half_lives/0/1": "Infinity"``); :func:`mnemo.train.sinks.loads_record` restores the floats. (Files
    of before hold ``"inf"`` strings, which ``loads_record`` leaves as they are; ``float(s)`` reads
    them.) Raises ``TypeError``
    naming ``record`` for a value that is not a dict (a list has no place for the map)."""
    import json

    from ..train.sinks import dumps_record

    if not isinstance(record, dict):
        raise TypeError(
            f"record: expected a dict (its non-finite floats are mapped under its 'nonfinite' field), "
            f"got {type(record).__name__}"
        )
    return json.loads(dumps_record(record))


def summary_line(result: dict) -> dict:
    """``{layer: {irrelevant, intermediate, marginal, relevant, median_half_life}}``: the per-layer
    numbers a training record or a report carries (layers with a spectrum only)."""
    keep = CLASSES + ("median_half_life",)
    return {layer: {c: e["summary"][c] for c in keep} for layer, e in result.items() if "summary" in e}


# ------------------------------------------------------------------------------------------------
# figure
# ------------------------------------------------------------------------------------------------

_COLORS = {
    "irrelevant": "tab:gray",
    "intermediate": "tab:blue",
    "marginal": "tab:green",
    "relevant": "tab:red",
    "unresolved": "0.85",
}


def figure(result: dict, title: str | None = None):
    """Left: each layer's spectrum (all heads pooled, descending) as half-lives against the
    direction's rank (log axis; ``inf`` drawn at the top, ``0`` at the bottom), with the
    irrelevant threshold and the context marked. Right: the shares of the classes per layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .figure_text import fit_text

    layers = [(k, e) for k, e in result.items() if "summary" in e]
    width = 11.0
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(width, 4.4), layout="constrained", width_ratios=[3, 2])
    context = irr = None
    hi_all, lo_all = [], []
    for layer, e in layers:
        context, irr = e["summary"]["context"], e["summary"]["irrelevant_half_life"]
        lam = torch.tensor([x for row in e["exponents"] for x in row], dtype=torch.float64)
        lam = lam.sort(descending=True).values
        hl = half_lives(lam)
        finite = hl[torch.isfinite(hl) & (hl > 0)]
        if finite.numel():
            hi_all.append(float(finite.max()))
            lo_all.append(float(finite.min()))
        rank = (torch.arange(lam.numel(), dtype=torch.float64) + 0.5) / lam.numel()
        ax.plot(rank.numpy(), hl.numpy(), ".-", ms=3, lw=1, label=f"L{layer} {e['mixer'][:20]} ({e['kind']})")
    top = max(hi_all + [context or 10.0]) * 4
    bottom = min(lo_all + [irr or 1.0]) / 4
    for line in ax.get_lines():  # inf (never halves) at the top, 0 (gone at once) at the bottom
        y = torch.tensor(line.get_ydata(), dtype=torch.float64)
        line.set_ydata(y.clamp(bottom, top).numpy())
    ax.set_yscale("log")
    ax.set_ylim(bottom / 1.5, top * 1.5)
    ax.set_xlim(0, 1)  # (autoscaling skips the infinite half-lives it was given)
    ax.annotate(
        "never halves (λ ≥ 0)",
        (0.99, top),
        xycoords=("axes fraction", "data"),
        fontsize=8,
        ha="right",
        va="bottom",
    )
    if irr:
        ax.axhline(irr, color="tab:gray", ls=":", lw=1)
        ax.annotate(
            f"irrelevant < {irr:g} tok", (0.01, irr), xycoords=("axes fraction", "data"), fontsize=8, va="top"
        )
    if context:
        ax.axhline(context, color="tab:green", ls=":", lw=1)
        ax.annotate(
            f"marginal > context ({context:g} tok)",
            (0.01, context),
            xycoords=("axes fraction", "data"),
            fontsize=8,
            va="bottom",
        )
    ax.set_xlabel("direction rank (fraction of the computed exponents, slowest first)")
    ax.set_ylabel("half-life ln2/−λ (tokens, log scale)")
    legend(ax, fontsize=7, loc="best")
    ax.set_title("memory spectrum (Lyapunov exponents as half-lives)", fontsize=9)
    names = [f"L{layer}" for layer, _ in layers]
    left = [0.0] * len(layers)
    for c in CLASSES + ("unresolved",):
        vals = [e["summary"][c] for _, e in layers]
        if c == "unresolved" and not any(vals):
            continue
        bx.bar(names, vals, bottom=left, color=_COLORS[c], label=c)
        left = [a + b for a, b in zip(left, vals)]
    bx.set_ylim(0, 1)
    if len(names) > 4:  # CMS levels add entries: keep their names apart
        bx.tick_params(axis="x", labelrotation=45, labelsize=7)
    bx.set_ylabel("share of directions")
    legend(bx, fontsize=7, loc="upper right", framealpha=0.8)
    bx.set_title("classes per layer", fontsize=9)
    if not layers:
        ax.text(0.5, 0.5, "no layer with a spectrum", transform=ax.transAxes, ha="center")
    fig.suptitle(fit_text("Memory spectrum" + (f" · {title}" if title else ""), width, 11), fontsize=11)
    return fig


def plot(result: dict, path, title: str | None = None):
    """Write :func:`figure` to ``path`` (a PNG); returns the path."""
    import matplotlib.pyplot as plt

    fig = figure(result, title)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
