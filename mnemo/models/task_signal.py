"""The task-loss error signal for CMS levels (``Level(objective="task")``; Nested Learning §7.1).

Eq. 71 steps a level by ``Σ_t η_t f(θ; x_t)`` with ``f`` the error signal of the model's objective;
in the paper's language models that objective is the next-token loss. A level with
``objective="task"`` takes, at the end of each of its periods of ``C`` tokens, the step::

    θ ← θ − Σ_{t in the period} (∂y_t/∂θ)ᵀ (η_t δ_t),      δ_t = ∂L_seg(t) / ∂y_t

where ``y_t = MLP_θ(x_t)`` is the level's read of token ``t`` and
``L_seg = Σ_{s in the segment} CE(logits_s, x_{s+1})`` (nats, summed) is the next-token loss of the
*segment* holding ``t``. Segments are ``S`` tokens long, ``S`` the shortest task period in the model
(every task period must be a multiple of it), counted from the start of the stream. So ``δ_t`` is
the exact gradient of the segment's loss with respect to the level's reads, back-propagated through
every layer above the level (and, in a sequential CMS, through the later levels of its chain); it is
truncated at segment boundaries (a token's signal does not include the losses of later segments) —
our choice, named here. With the rate's weights at zero, ``η_t = η`` and the step is exactly
``η ∇_θ`` of the period's summed next-token loss.

How it runs. Inside a segment no task level changes (reads use the weights of the last step). Once
a segment is complete and the next token has arrived (the label of its last position), its loss is
back-propagated to every task level's reads, and each level absorbs its ``δ`` (accumulates, and
steps at its period ends) before that next token is read. When a whole segment and its next token
arrive in one call (training windows), the gradient is taken on the graph of the read itself: one
forward serves the logits, the signal and (graph retained) the outer loss. A segment whose reads
began in an earlier call (streaming, one-token decoding) is run again from the model state at its
start (``CMSState.pending`` carries that state and the segment's tokens); both paths compute the
same ``δ`` (equal up to float rounding). The steps therefore use only tokens the model has already
seen, and any split of a stream equals one pass.

First order: ``δ`` is a constant for the outer loop (as in first-order MAML); outer gradients still
reach the level's initial weights, its rate ``η_t`` and its inputs ``x_t`` through the other factors
of the step.

Cost. The segments run one after the other (segment ``k + 1`` reads with the weights stepped by
segment ``k``'s signal), each as one forward of ``S`` tokens and one backward of its loss to the
reads, then the outer backward runs over the whole window. On a CPU, where a small model's time is
the per-operation overhead of these many small passes, a training step costs several times the
reconstruction objective's (one forward of the window); docs/benchmarks/hope_task_signal_cpu.txt
has the measured ratios. Segments are often shorter than a mixer's chunk (8-token segments, 16- and
64-token chunks in the self-modifying Titans of ``hope``): mixers that can keep a chunk's steps until
it completes do so inside the loop (:meth:`~mnemo.layers.SelfModifyingTitans.deferring`), so their
per-sample weights move once per chunk, not once per segment.
"""

from __future__ import annotations

import dataclasses
from contextlib import ExitStack

import torch
import torch.nn.functional as F

from .._compile_marks import eager_under_compile
from ..layers.cms import CMSLevel, CMSState, ContinuumMemory, check_state_dtype
from ..layers.hooks import kept_span, replacement_count, set_span
from ..layers.state import detach as detach_state
from ..layers.state import state_dataclass


@state_dataclass
class Pending:
    """The segment being read: the model state at its start (``start``: a list of
    :class:`~mnemo.layers.state.BlockState`, ``None`` for a fresh stream) and its tokens so far
    (``ids [B, n]``, ``n ≤ S``)."""

    start: list | None = None
    ids: torch.Tensor


def _task_levels(model) -> list[tuple[int, int]]:
    return [
        (i, j)
        for i, b in enumerate(model.blocks)
        if isinstance(b.mlp, ContinuumMemory)
        for j, lv in enumerate(b.mlp.levels)
        if lv.level.objective == "task"
    ]


def segment_length(model) -> int | None:
    """``S``, the shortest period of the model's task levels (``None`` when it has none).

    Raises:
        ValueError: a task period is not a multiple of ``S``.
    """
    periods = [model.blocks[i].mlp.levels[j].level.period for i, j in _task_levels(model)]
    if not periods:
        return None
    for i, b in enumerate(model.blocks):
        for j, lv in enumerate(b.mlp.levels if isinstance(b.mlp, ContinuumMemory) else ()):
            if lv.level.partial != "carry":
                raise ValueError(
                    f"Level.partial: block {i} level {j} has partial={lv.level.partial!r}; a model with "
                    "task-signal levels needs 'carry' everywhere (the signal re-runs whole segments, "
                    "which a flush at call ends would make differ from what the model emitted)"
                )
    S = min(periods)
    if any(p % S for p in periods):
        raise ValueError(
            "Level.period: with objective 'task' every task level's period must be a multiple of the "
            f"shortest one ({S}); got periods {sorted(set(periods))}"
        )
    return S


def _strip(state: list) -> list:
    """The state without pending segments (a snapshot must not hold older snapshots)."""
    return [
        dataclasses.replace(s, mlp=dataclasses.replace(s.mlp, pending=None))
        if isinstance(s.mlp, CMSState)
        else s
        for s in state
    ]


def _with_levels(state: list, i: int, levels: tuple) -> list:
    out = list(state)
    out[i] = dataclasses.replace(state[i], mlp=dataclasses.replace(state[i].mlp, levels=levels))
    return out


def _pending_of(model, state, ids) -> Pending:
    if state is None:
        return Pending(start=None, ids=ids.new_zeros(ids.shape[0], 0))
    i = _task_levels(model)[0][0]
    pending = state[i].mlp.pending if isinstance(state[i].mlp, CMSState) else None
    if pending is None:
        raise ValueError(
            "state: this model has CMS levels with objective 'task', and the state passed in does not "
            "carry their pending segment (pass back the state the model returned, unchanged)"
        )
    shape, S = list(pending.ids.shape), model.task_segment
    if len(shape) != 2 or shape[0] != ids.shape[0] or shape[1] > S:
        raise ValueError(
            f"state: the pending segment's ids must be [B, n] with B = {ids.shape[0]} (input_ids' batch) "
            f"and n <= {S} (this model's segment length), got {shape}: a state of "
            "another batch or another model"
        )
    return pending


def _piece(offset: int, stop: int, length: int, again: bool = False) -> None:
    """Tell the hooks that the next ``_forward`` reads the call's tokens ``offset … stop − 1``, of a
    call of ``length`` tokens (``again``: a segment run again for its signal, which starts in an
    earlier call; :func:`mnemo.layers.hooks.span`)."""
    set_span(offset, length, again, stop)


def _outer(model) -> bool:
    """Outer gradients through the steps (``x``, ``η``) only when the caller builds a graph the step
    can join."""
    return torch.is_grad_enabled() and any(p.requires_grad for p in model.parameters())


def _take_in(model, where, levels, captures, loss, state, outer, intervened: bool = False) -> list:
    """Back-propagate the segment's ``loss`` to every task level's reads (``captures``: per level,
    ``(x, y, (z, a))`` of the read) and let each level absorb its signal into ``state``.

    ``intervened``: a hook returned a replacement while the segment was read
    (:func:`~mnemo.layers.hooks.replacement_count`). A replacement between a level's read and the
    loss (an intervention: :mod:`mnemo.interp`) cuts the loss's dependence on the read through that
    value — the replacement is a constant — so the level's signal is what flows around it, zero
    where nothing does (as the intervention ``do(value = replacement)`` implies). Otherwise a read
    the loss does not depend on is a defect and raises ``RuntimeError``."""
    ys = [c[1] for c in captures]
    deltas = (
        torch.autograd.grad(loss, ys, retain_graph=outer, allow_unused=True)
        if loss.requires_grad
        else (None,) * len(ys)
    )
    if any(d is None for d in deltas):
        if not intervened:
            cut = [f"blocks.{i}.mlp.levels.{j}" for (i, j), d in zip(where, deltas) if d is None]
            raise RuntimeError(
                f"the segment's next-token loss does not depend on the reads of {cut} (no hook replaced "
                "a value on the way; a hook that runs this same model again inside its own call mixes "
                "the two calls' reads: run a copy of the model there)"
            )
        deltas = [torch.zeros_like(y) if d is None else d for d, y in zip(deltas, ys)]
    for (i, j), lv, (x, _, read), delta in zip(where, levels, captures, deltas):
        level_states = list(state[i].mlp.levels)
        if not outer:
            x, read = x.detach(), tuple(r.detach() for r in read)
        level_states[j] = lv.absorb(x, delta.detach(), level_states[j], read)
        state = _with_levels(state, i, tuple(level_states))
    return state


class _Recording:
    """Within ``with``: every task level appends ``(x, y, (z, a))`` of each read to its capture."""

    def __init__(self, levels):
        self.levels = levels

    def __enter__(self):
        for lv in self.levels:
            lv._capture = []
        return self

    def __exit__(self, *exc):
        self.captures = [lv._capture for lv in self.levels]
        for lv in self.levels:
            lv._capture = None


#: Under ``torch.compile`` the two places that take the signal (:func:`_absorb`, :func:`_read_with_signal`)
#: run eagerly (a graph break each): dynamo (torch 2.13) traces a read made under ``enable_grad`` and
#: the ``autograd.grad`` after it into a graph whose loss is not connected to the captured reads, and
#: the gradient call then fails ("appears to not have been used in the graph"), in a compiled training
#: forward and in ``generate(compile=True)`` alike. What still compiles is the rest of a call: the
#: reads of partial segments (decoding's one-token steps between two signals), the settling of the
#: kept steps; a training window, read almost entirely in whole segments, runs nearly eagerly.
_eager = eager_under_compile


@_eager
def _absorb(
    model, pending: Pending, nxt: torch.Tensor, state: list, mode, at: tuple = (0, None, None)
) -> list:
    """Run the complete pending segment again from its start state, back-propagate its next-token
    loss (labels: the segment shifted by one and ``nxt [B, 1]``) to every task level's reads, and let
    each level absorb its signal into ``state`` (the state after reading the segment). Used when the
    segment's reads were made in earlier calls (their graph is not kept). ``at``: where the segment
    sits in the call, for the hooks (``(offset, stop, call length)``; it starts before the call)."""
    outer = _outer(model)
    ids = torch.cat([pending.ids, nxt], 1)
    where = _task_levels(model)
    levels = [model.blocks[i].mlp.levels[j] for i, j in where]
    _piece(*at, again=True)
    replaced = replacement_count()
    with torch.enable_grad():
        with _Recording(levels) as rec:
            logits, _ = model._forward(ids[:, :-1], pending.start, mode, allow_checkpoint=False)
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten().long(), reduction="sum")
    captures = [c[0] for c in rec.captures]
    return _take_in(model, where, levels, captures, loss, state, outer, replacement_count() > replaced)


#: The settling of the kept steps (:func:`_settle`, :func:`_settle_levels`) runs eagerly under
#: ``torch.compile`` too: it is called only from frames dynamo cannot compile (:func:`forward`'s
#: ``ExitStack``, :func:`_segments`' loop with the eager signal in it), so its work runs between
#: graphs either way, and traced on its own it cost ``generate(compile=True)`` of ``hope`` a
#: graph per combination of kept factors: a decode step usually has none (the walk is a no-op),
#: the prompt and a completed segment a few (dynamo traced :func:`~mnemo.layers.cms._add_outer`
#: alone, once per shape and sign: 5 graphs and 4 recompiles of 28 and 19 at d_model 16, one layer).
@_eager
def _settle(model, state: list | None) -> list | None:
    """``state`` with the kept steps taken: the mixers' (:meth:`SelfModifyingTitans.deferring`) and
    the CMS levels' (:meth:`~mnemo.layers.cms.CMSLevel.deferring`)."""
    if state is None:
        return None
    out = list(state)
    for i, b in enumerate(model.blocks):  # (an object with nothing to settle is kept, not copied)
        settle = getattr(b.mixer, "settle", None)
        if settle is not None and out[i].mixer is not None:
            mixer = settle(out[i].mixer)
            if mixer is not out[i].mixer:
                out[i] = dataclasses.replace(out[i], mixer=mixer)
        mlp = out[i].mlp
        if isinstance(mlp, CMSState):
            levels = tuple(CMSLevel.settle(s) for s in mlp.levels)
            if any(new is not old for new, old in zip(levels, mlp.levels)):
                out[i] = dataclasses.replace(out[i], mlp=dataclasses.replace(mlp, levels=levels))
    return out


@_eager
def _settle_levels(state: list) -> list:
    """``state`` with the CMS levels' kept steps taken (:meth:`~mnemo.layers.cms.CMSLevel.settle`)."""
    return [
        dataclasses.replace(
            s, mlp=dataclasses.replace(s.mlp, levels=tuple(CMSLevel.settle(x) for x in s.mlp.levels))
        )
        if isinstance(s.mlp, CMSState)
        else s
        for s in state
    ]


def _deferrable(model):
    """The modules that keep their steps inside the segment loop."""
    for b in model.blocks:
        if hasattr(b.mixer, "deferring"):
            yield b.mixer
        if isinstance(b.mlp, ContinuumMemory) and b.mlp.transfer != "nested":
            yield from b.mlp.levels


def _check_dtypes(model, state) -> None:
    """Raise ``ValueError`` naming the entry, the expected and the received dtype for a mixer or
    CMS level state of another dtype than its module's (:func:`~mnemo.layers.cms.check_state_dtype`),
    e.g. a state kept from before ``model.double()``."""
    for i, (b, s) in enumerate(zip(model.blocks, state)):
        if hasattr(b.mixer, "deferring") and getattr(s, "mixer", None) is not None:
            check_state_dtype(s.mixer, b.mixer, f"state[{i}].mixer", fast_weights=True)
        mlp = getattr(s, "mlp", None)
        if isinstance(b.mlp, ContinuumMemory) and isinstance(mlp, CMSState):
            for j, (level, ls) in enumerate(zip(b.mlp.levels, mlp.levels)):
                check_state_dtype(ls, level, f"state[{i}].mlp.levels[{j}]")


def forward(model, input_ids: torch.Tensor, state, mode):
    """``LanguageModel.forward`` for a model with task levels (see the module docstring).

    Mixers that can defer their in-chunk steps (:meth:`SelfModifyingTitans.deferring`) do so while
    the segments are read — a segment is often shorter than their chunks — and so do the task
    levels (:meth:`~mnemo.layers.cms.CMSLevel.deferring`: their steps kept as low-rank factors);
    the state returned (with the pending segment's start state in it) has every step taken."""
    if isinstance(state, (list, tuple)) and len(state) == len(model.blocks):
        _check_dtypes(model, state)  # the segment loop's absorb would meet them before the modules' checks
    with ExitStack() as stack:
        for m in _deferrable(model):
            stack.enter_context(m.deferring())
        with kept_span():  # the pieces' spans end with the call (restored also on error)
            logits, state = _segments(model, input_ids, state, mode)
    state = _settle(model, state)
    where = sorted({i for i, _ in _task_levels(model)})
    pending = state[where[0]].mlp.pending  # one record, shared by the task blocks
    pending = dataclasses.replace(pending, start=_settle(model, pending.start))
    for i in where:
        state[i] = dataclasses.replace(state[i], mlp=dataclasses.replace(state[i].mlp, pending=pending))
    return logits, state


@_eager
def _read_with_signal(model, ids: torch.Tensor, state: list, mode, outer: bool, at: tuple = (0, None, None)):
    """Read the segment ``ids[:, :-1]`` (a whole one), back-propagate its next-token loss (labels
    ``ids[:, 1:]``) to every task level's reads on the read's own graph, and let each level absorb
    its signal: ``(logits, state)``. ``at``: ``(offset, stop, call length)`` of the segment, for
    the hooks."""
    where = _task_levels(model)
    levels = [model.blocks[i].mlp.levels[j] for i, j in where]
    _piece(*at)
    replaced = replacement_count()
    with torch.enable_grad(), _Recording(levels) as rec:
        logits, state = model._forward(ids[:, :-1], state, mode, allow_checkpoint=False)
    with torch.enable_grad():
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten().long(), reduction="sum")
    captures = [c[0] for c in rec.captures]
    state = _take_in(model, where, levels, captures, loss, state, outer, replacement_count() > replaced)
    if not outer:  # the graph served the signal only
        logits, state = logits.detach(), detach_state(state)
    return logits, state


def _segments(model, input_ids: torch.Tensor, state, mode):
    S = model.task_segment
    B, T = input_ids.shape
    if T == 0:
        raise ValueError("input_ids: a model with task-signal CMS levels needs T >= 1 tokens, got 0")
    if torch.is_inference_mode_enabled():
        raise RuntimeError(
            "CMS levels with objective 'task' take a gradient of the next-token loss, which "
            "torch.inference_mode() forbids; run the model under torch.no_grad() instead"
        )
    pending = _pending_of(model, state, input_ids)
    outer = _outer(model)
    where = _task_levels(model)
    outs, t = [], 0
    while t < T:
        if pending.ids.shape[1] == S:  # the segment is complete and its last label has arrived
            state = _absorb(model, pending, input_ids[:, t : t + 1], state, mode, (t - S, t, T))
            # the levels' new steps folded in now (a call's end would): the reads after a re-run
            # segment (decoding's one-token calls, compiled) then always see settled level states,
            # not factors of varying rank, which made torch.compile recompile at each segment
            state = _settle_levels(state)
            pending = Pending(start=_strip(state), ids=input_ids.new_zeros(B, 0))
        n = min(S - pending.ids.shape[1], T - t)
        if n == S and t + S < T:
            # a whole segment and its next token in this call: the read's graph gives the signal
            # (one forward for the read and the signal)
            logits, state = _read_with_signal(
                model, input_ids[:, t : t + S + 1], state, mode, outer, (t, t + S, T)
            )
            outs.append(logits)
            pending = Pending(start=_strip(state), ids=input_ids.new_zeros(B, 0))
            t += S
            continue
        _piece(t, t + n, T)
        logits, state = model._forward(input_ids[:, t : t + n], state, mode)
        outs.append(logits)
        pending = dataclasses.replace(pending, ids=torch.cat([pending.ids, input_ids[:, t : t + n]], 1))
        t += n
    for i in sorted({i for i, _ in where}):
        state = list(state)
        state[i] = dataclasses.replace(state[i], mlp=dataclasses.replace(state[i].mlp, pending=pending))
    return torch.cat(outs, 1), state
