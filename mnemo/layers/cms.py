"""The Continuum Memory System (Nested Learning, Behrouz et al. 2025; arXiv 2512.24695 §7.1, Eq. 70–74).

A CMS is a set of MLP blocks ordered by update frequency. Level ``ℓ`` keeps per-sample *fast*
weights ``θ^(ℓ)`` that change only at the end of each of its periods of ``C^(ℓ)`` tokens, by the sum
over the period of its tokens' error signals (Eq. 71)::

    θ^(ℓ)_{i+1} = θ^(ℓ)_i − Σ_{t=i−C^(ℓ)+1}^{i} η^(ℓ)_t f(θ^(ℓ)_i; x_t)     if i ≡ 0 (mod C^(ℓ))
    θ^(ℓ)_{i+1} = θ^(ℓ)_i                                                  otherwise

with ``f`` the gradient of the level's inner objective at the period-start weights (the weights do
not move inside a period, so every term of the sum is taken at ``θ^(ℓ)_i``). Reading of the sum's
range, named: the paper writes ``Σ_{t=i−C^(ℓ)}^{i}`` (``C + 1`` indices, the last token of the
previous period included); mnemo sums the ``C`` tokens of the period that ends at ``i``,
``t = i−C+1 … i``, so every token enters exactly one step (the reading
:mod:`mnemo.train.m3` takes for Algorithm 1's slow sum). Reads inside a period
use the period-start weights; with ``C = 1`` and one level the CMS is plain per-token online gradient
descent (predict, then step).

Inner objective (``Level.objective``; the error signal ``f``):

* ``"task"`` (the paper's: the language model's next-token loss): ``f`` is the gradient of the
  model's next-token loss with respect to the level's output, back-propagated through the layers
  above it, times the rate ``η_t``; computed by the language model once the next token is known
  (:mod:`mnemo.models.task_signal` gives the exact definition, its segment truncation and cost).
  Only inside a :class:`~mnemo.models.LanguageModel`; a task level alone only reads.
* ``"reconstruction"`` (default; a named self-supervised alternative): the level is an
  associative memory from its input ``x_t`` (layer-normalised, ``‖x_t‖² ≈ d``) to a learned *slow*
  projection of it, ``ℓ_t = ½ ‖MLP(x_t) − W_v x_t‖²``. It needs no labels and no backward pass at
  read time, so it is cheaper and works in any block.

Both scale the error by a data-dependent rate ``η_t = lr · sigmoid(w_η · x_t + b_η) / d`` (the
``1/d`` makes one token's step size independent of the width, as in normalised LMS, for the hidden
matrix, whose input ``x_t`` is layer-normalised; ``Level.nlms`` normalises each matrix by its own
input's squared norm instead, the output matrix's included, whose input can grow).

Rates and the sum. Eq. 71 sums the period's terms (it does not average them), so a level of period
``C`` moves ``C`` tokens' worth of gradient at once. The rate bias ``b_η`` is initialised so that
``sigmoid(b_η) = 1 / (2C)``: at initialisation the summed step of a period equals one token's step
at the rate ``lr / 2d`` (the same size for every period); the rates are learned from there, per
token and per level. ``Level.rate_init`` overrides that starting value (a control that gives a
period-1 level a slow level's small rate, to tell the period from the rate's initialisation).

Knowledge transfer between levels (``ContinuumMemory(transfer=...)``), fastest level first:

* ``"sequential"`` (Eq. 73, default): a chain, ``h_ℓ = h_{ℓ−1} + MLP_ℓ(LN(h_{ℓ−1}))``; output
  ``h_k − h_0`` (the block adds its own residual). Every level's initial weights are slow weights
  trained by the outer loop through the unrolled inner updates. The residual around every level is
  our choice (the paper writes the bare composition ``MLP^(f_k)(… MLP^(f_1)(x))``).
  The chain's direction is ``ContinuumMemory(order=...)``: ``"fastest_first"`` (default) passes the
  input through the level with the shortest period first, ``"slowest_first"`` through the longest
  first (the levels sorted by period, whatever their list order; before issue 37 the chain
  followed the list order, the same for the presets, which list their levels fastest first); the
  levels keep their list indices (``levels.{i}``, ``CMSState.levels[i]``) either way. The paper
  leaves the direction open (Eq. 70 composes ``MLP^(f_k)(… MLP^(f_1)(x))`` without saying whether
  ``f_1`` is the highest frequency). The default, fastest first, is
  mnemo's reading, for three reasons: (1) it reads Eq. 70 with ``f_1`` the highest frequency, as
  the public transcriptions of §7.1 do ("level 1: high frequency"; not stated in the paper's text
  as we could check it); (2) the slow levels then read features the fast levels have already
  adapted to the current context, so what they consolidate at their rare steps is the
  in-context-adapted representation (our argument, not the paper's); (3) it is the chain every
  mnemo result so far was measured with. ``"slowest_first"`` is the other reading, kept as an
  option to compare.
* ``"independent"`` (Eq. 74, head-wise): the levels read the same input in parallel and their
  outputs are aggregated by a learned weighted sum, ``y = Σ_ℓ w_ℓ MLP_ℓ(LN(x))`` (``w_ℓ`` start
  at 1).
* ``"nested"`` (Eq. 72): the slower level is the faster level's initial state. Levels must have
  equal widths and each period must be a multiple of the next faster one. Every level reads the
  same input ``LN(x)``; the output is the fastest level's read, ``y = MLP_1(LN(x))``, and the
  fastest level learns by Eq. 71 on its own loss. Whenever level ``ℓ+1`` completes a period (after
  its step), level ``ℓ`` restarts from level ``ℓ+1``'s new weights (momentum and accumulated
  gradient cleared; the paper: "re-initialized after ⌈C^(s)/C^(s+1)⌉ steps"), and at the start of a
  stream every level starts from the slowest level's initial weights (only the slowest level owns
  initial weights). How a slower level learns (``ContinuumMemory(meta=...)``):

  - ``"unrolled"`` (default): Eq. 72, ``θ^(ℓ)_0 = argmin_Φ E_T ℓ(Θ, T; Φ)``, as meta-learning:
    at the end of each of its periods ``P`` the slower level (weights ``Φ``, constant over ``P``)
    takes the Eq. 71 step (its rate ``η^(ℓ+1)_t``, its optimizer) with the error signal

        g = ∂/∂Φ Σ_{t∈P} η^(ℓ+1)_t · ½‖MLP_θ(Φ)(x_t) − W_v^(ℓ) x_t‖²

    where ``θ(Φ)`` is the faster level's weights after its adaptation over ``P`` from ``Φ`` (its
    ``C^(ℓ+1)/C^(ℓ)`` steps, the last one at ``P``'s end) and ``W_v^(ℓ)`` the faster level's target:
    the faster level's loss on the slower level's context after learning it. The adaptation is
    replayed from ``Φ`` on the period's inputs (kept, with the fastest level's targets and rates,
    in :attr:`LevelState.inputs`) and
    differentiated through (``create_graph``; a slower level's adaptation contains its own meta
    steps, so three levels take third derivatives). Choices where the paper is silent, named here:
    the task ``T`` is the slower level's period (the faster level's context between two restarts);
    the loss after adaptation is taken on the same tokens the faster level learned from (no
    support/query split: causal, it uses only tokens already read); the slowest level of a chain
    has no target of its own (its loss is never taken).
  - ``"first_order"``: the same loss's gradient at the adapted weights, ``g = ∇_θ(...)`` at
    ``θ = θ(Φ)`` (first-order MAML; no replay).
  - ``"none"``: the level-local reading — each slower level learns by its own Eq. 71 step on its
    own reconstruction loss and hands its weights down (mnemo's rule before issue 37; the slow step
    does not depend on the faster level's learning).

  :func:`meta_gradient` is the rule's one gradient, for any adaptation and loss.

  Under ``torch.compile`` (e.g. ``TrainConfig.compile``) a slower level's step direction (the
  replay and its gradient, ``ContinuumMemory._meta_grad``) runs eagerly, a graph break at every
  slower level's period end: the gradient is taken with ``create_graph`` so that the outer loss
  trains through it, and the outer backward through it is a double backward, which the graphs
  AOTAutograd compiles do not support (torch raises "torch.compile with aot_autograd does not
  currently support double backward"). The rest of the forward compiles.

  Hooks: the replay runs on the fastest level's inputs, targets and rates as its hook points
  (``levels.0.hook_in``, ``hook_v``, ``hook_eta``) passed them, so a replacement there reaches the
  slower levels' meta-gradient as it reaches the fastest level's own steps (the period's values are
  kept in :attr:`LevelState.inputs`); the slower levels never read, so only their ``hook_state``
  fires.

A partial period at the end of a call is handled by ``Level.partial``:

* ``"carry"`` (default): the gradients of the unfinished period are kept in the state and the step
  is taken when the period completes in a later call, so any split of a stream equals one pass;
* ``"flush"``: the partial period's step is taken at the end of the call (the next call starts a
  fresh period), so the weights are always up to date, at the price of depending on call
  boundaries (not with ``transfer="nested"``).

Inner optimizers (per level, applied to the period's summed gradient ``g``):
``"gd"``: ``θ ← θ − g``; ``"momentum"``: ``m ← β m − g``, ``θ ← θ + m``; ``"delta_momentum"``:
the momentum is an associative memory over gradients written by the delta rule keyed on the
normalised gradient ``ĝ`` — it overwrites its component along the new gradient instead of adding to
it: ``m ← β (m − ⟨m, ĝ⟩ ĝ) − g``, ``θ ← θ + m``.

Training. A level's step is seen by a training loss only if it happens inside the training window
(``period < seq_len``); :meth:`ContinuumMemory.window_problems` lists the levels that never step
within a window of a given length (the trainer warns about them): such a level's rate and target
projections get no gradient and it would step at evaluation with untrained settings.
"""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from .._compile_marks import eager_under_compile
from ..ops._common import inference_involved
from .base import autocast_on, check_input_dtype, check_state_dtype
from .base import batch_mm as _mm
from .hooks import HookPoint, enter_piece, leave_pieces, show_state
from .state import nbytes, spec, state_dataclass

OPTIMIZERS = ("gd", "momentum", "delta_momentum")
PARTIAL = ("carry", "flush")
OBJECTIVES = ("reconstruction", "task")
#: ``ε`` of ``Level.nlms``'s normalisation ``‖input‖² + ε`` (the inputs' squared norms are ``≈ d``
#: for the layer-normalised ``x_t`` and of the same order for ``a_t``; ε keeps a near-zero input
#: from taking an unbounded step)
NLMS_EPS = 1.0
TRANSFERS = ("sequential", "independent", "nested")
ORDERS = ("fastest_first", "slowest_first")
METAS = ("unrolled", "first_order", "none")


def meta_gradient(phi: tuple, adapt, loss, order: str = "unrolled", create_graph: bool = False) -> tuple:
    """The gradient of a post-adaptation loss with respect to the initial state (Eq. 72's inner
    problem ``argmin_Φ E_T ℓ(Θ, T; Φ)``, one gradient of it).

    ``"unrolled"``: ``∂/∂Φ loss(adapt(Φ))``, back-propagated through the adaptation (MAML);
    ``"first_order"``: ``∇_θ loss(θ)`` at ``θ = adapt(Φ)``, the adaptation's Jacobian taken as the
    identity (first-order MAML; an adapted tensor broadcast from its initial one — one copy per
    task — sums its copies' gradients).

    Args:
        phi: the initial state, a tuple of tensors (any shapes).
        adapt: ``adapt(phi) -> theta``, a tuple of tensors, each shaped like its ``phi`` tensor or a
            shape that tensor broadcasts to (the adapted state, built from ``phi`` by
            differentiable operations).
        loss: ``loss(theta) -> 0-d tensor``, the loss after the adaptation.
        order: ``"unrolled"`` or ``"first_order"`` (default ``"unrolled"``).
        create_graph: keep the graph of the gradient (for a higher-order or an outer gradient;
            default ``False``).
    Returns:
        a tuple shaped like ``phi``; outside a graph (``create_graph=False``) detached.
    Raises:
        ValueError: an unknown ``order``; (``"first_order"``) ``adapt`` returns another number of
            tensors than ``phi`` holds, or a tensor its ``phi`` tensor does not broadcast to.
    """
    if order not in ("unrolled", "first_order"):
        raise ValueError(f"order: expected 'unrolled' or 'first_order', got {order!r}")
    with torch.enable_grad():
        if order == "unrolled":
            # the gradient is taken at fresh leaves, carried back to Φ's own graph by an identity
            # path: taken at Φ itself, autograd would also run every node between the loss and Φ
            # (under torch.compile one node is a whole graph: one that read Φ's level, with
            # create_graph, which compiled graphs refuse)
            inputs = tuple(p.detach().requires_grad_() for p in phi)
            start = tuple(q + (p - p.detach()) if p.requires_grad else q for q, p in zip(inputs, phi))
            value = loss(adapt(start))
        else:  # θ plus an identity path from a fresh Φ: the gradient of loss(θ), carried back to Φ
            inputs = tuple(p.detach().requires_grad_() for p in phi)
            adapted = tuple(adapt(phi))
            shapes = [list(w.shape) for w in adapted]
            fits = len(adapted) == len(inputs) and all(
                p.ndim <= w.ndim and all(a in (1, b) for a, b in zip(p.shape[::-1], w.shape[::-1]))
                for p, w in zip(inputs, adapted)
            )
            if not fits:
                raise ValueError(
                    f"adapt: expected a tuple of {len(inputs)} tensors, each of a shape its phi tensor "
                    f"broadcasts to ({[list(p.shape) for p in inputs]}), got shapes {shapes}"
                )
            theta = tuple(w + (p - p.detach()).expand_as(w) for w, p in zip(adapted, inputs))
            value = loss(theta)
        grads = torch.autograd.grad(value, inputs, create_graph=create_graph, allow_unused=True)
    grads = tuple(torch.zeros_like(p) if g is None else g for p, g in zip(inputs, grads))
    return grads if create_graph else tuple(g.detach() for g in grads)


@dataclass(frozen=True)
class Level:
    """One CMS level.

    Attributes:
        period: ``C``, tokens between two steps of this level (``≥ 1``).
        expansion: hidden width of the level's MLP as a multiple of ``d_model`` (default ``2.0``).
        lr: maximum inner learning rate ``η`` per token (the data-dependent rate is
            ``lr · sigmoid(·) / d``; a period's step sums its tokens' terms, Eq. 71; default
            ``1.0``).
        optimizer: ``"gd"``, ``"momentum"`` or ``"delta_momentum"``; ``beta`` its momentum
            (default ``beta=0.9``).
        partial: ``"carry"`` or ``"flush"`` (see the module docstring).
        objective: the inner objective, ``"reconstruction"`` or ``"task"`` (the next-token loss;
            see the module docstring).
        outer_lr_scale: multiplier of the outer optimizer's learning rate for this level's slow
            parameters (the trainer puts them in their own parameter group); default ``1.0``.
        rate_init: ``sigmoid(b_η)`` at initialisation, in ``(0, 1)``; default ``rate_init=None``,
            which means ``1 / (2C)`` (the module docstring's "Rates and the sum"), or ``1/2`` with
            ``rate_per_period``.
        rate_per_period: ``True`` divides the rate's ceiling by the period, ``η_t = lr ·
            sigmoid(·) / (d C)``, with ``sigmoid(b_η)`` starting at 1/2 (the same starting rate as
            the default's): a period's summed step can then never exceed one token's largest, a
            bound the default lacks (its learned per-token rates can sum to ``C`` tokens' worth,
            which is what made the slow levels' inner step diverge in docs/results/continual.md).
            mnemo's choice, not the paper's (Eq. 71 leaves the rates' form open); default
            ``rate_per_period=False``.
        nlms: ``True`` divides each fast matrix's step by its own input's squared norm instead of
            the width ``d`` (normalised least mean squares, Nagumo & Noda 1967; the step a delta
            rule with L2-normalised keys takes): the hidden matrix's rate is ``lr · sigmoid(·) /
            (‖x_t‖² + ε)``, the output matrix's ``lr · sigmoid(·) / (‖a_t‖² + ε)`` with ``a_t =
            gelu(W_inᵀ x_t)`` its input and ``ε =`` :data:`NLMS_EPS` (both ``/ C`` more with
            ``rate_per_period``). One token's step on the output matrix then shrinks that token's
            reconstruction error by the factor ``1 − lr σ_t ‖a_t‖² / (‖a_t‖² + ε)``, inside ``(1 −
            lr, 1]`` however large ``a_t`` grows, where the default's ``1 − lr σ_t ‖a_t‖² / d``
            overshoots once ``‖a_t‖² > 2d / (lr σ_t)`` (the divergence of the tuned chains in
            docs/results/continual.md). The hidden matrix's curvature also depends on ``W_out``,
            which no input normalisation bounds. Not with ``transfer="nested"`` (its meta-learned
            loss weights each token by one rate). mnemo's choice, not the paper's; default
            ``nlms=False``.
    """

    period: int
    expansion: float = 2.0
    lr: float = 1.0
    optimizer: str = "gd"
    beta: float = 0.9
    partial: str = "carry"
    objective: str = "reconstruction"
    outer_lr_scale: float = 1.0
    rate_init: float | None = None
    rate_per_period: bool = False
    nlms: bool = False

    def validate(self) -> Level:
        def bad(name, expected):
            raise ValueError(f"Level.{name}: expected {expected}, got {getattr(self, name)!r}")

        def number(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        if not isinstance(self.period, int) or isinstance(self.period, bool) or self.period < 1:
            bad("period", "an int >= 1")
        if not number(self.expansion) or self.expansion <= 0:
            bad("expansion", "a finite positive number")
        if not number(self.lr) or self.lr < 0:
            bad("lr", "a finite non-negative number")
        if self.optimizer not in OPTIMIZERS:
            bad("optimizer", f"one of {OPTIMIZERS}")
        if not number(self.beta) or not 0 <= self.beta < 1:
            bad("beta", "a number in [0, 1)")
        if self.partial not in PARTIAL:
            bad("partial", f"one of {PARTIAL}")
        if self.objective not in OBJECTIVES:
            bad("objective", f"one of {OBJECTIVES}")
        if not number(self.outer_lr_scale) or not self.outer_lr_scale > 0:
            bad("outer_lr_scale", "a finite positive number")
        if self.rate_init is not None and not (number(self.rate_init) and 0 < self.rate_init < 1):
            bad("rate_init", "None or a number in (0, 1)")
        if not isinstance(self.rate_per_period, bool):
            bad("rate_per_period", "a bool")
        if not isinstance(self.nlms, bool):
            bad("nlms", "a bool")
        if self.objective == "task" and self.partial != "carry":
            bad("partial", "'carry' with objective 'task' (its steps wait for the next token)")
        return self


@state_dataclass
class LevelState:
    """Per-sample fast state of one level.

    Attributes:
        weights: the fast weights ``(W_in [B, d, h], W_out [B, h, d])`` (the parameters' dtype; a
            fresh state holds the initial weights expanded over the batch, no copies, until the
            first step makes them per sample).
        momentum: the momentum buffers, shaped like ``weights`` (optimizers ``"momentum"`` and
            ``"delta_momentum"``), or ``None``.
        grad: the gradient accumulated in the current period, shaped like ``weights``.
        position: tokens read (default ``0``); with ``Level(partial="flush")`` the tokens read
            since the last flush (a flush restarts it at ``0``: the next call starts a fresh period).
        updates: steps taken (default ``0``).
        absorbed: (task objective) tokens whose error signal has been absorbed (default ``0``).
        inputs: (nested transfer with a meta-learning rule, every level but the fastest) the
            fastest level's reads of the level's current period so far, ``[B, n, 2d + 1]``: per
            token its input ``x_t``, its target ``W_v x_t`` and its rate ``η_t``, as its hook
            points passed them (the level's step replays the faster levels on them), else ``None``.
        applied, current: ``None`` (default) outside a task-signal model's segment loop. Inside it
            (:meth:`CMSLevel.deferring`, a ``"task"`` level with the ``"gd"`` optimizer) the steps
            are kept as their factors ``(X [B, r, d], DZ [B, r, h], A [B, r, h], E [B, r, d])``:
            ``applied`` for the completed periods — the weights are ``(W_in − Xᵀ DZ, W_out − Aᵀ E)`` —
            and ``current`` for the period so far — the gradient is ``grad + (Xᵀ DZ, Aᵀ E)``;
            :meth:`CMSLevel.settle` materialises them. A state a model returns never has them.
    """

    weights: tuple
    momentum: tuple | None = None
    grad: tuple
    position: int = 0
    updates: int = 0
    absorbed: int = 0
    inputs: torch.Tensor | None = None
    applied: tuple | None = None
    current: tuple | None = None


def _cat_factors(a: tuple | None, b: tuple) -> tuple:
    return b if a is None else tuple(torch.cat([u, v], 1) for u, v in zip(a, b))


def _check_width(owner: str, d_model) -> None:
    if not isinstance(d_model, int) or isinstance(d_model, bool) or d_model < 1:
        raise ValueError(f"{owner}.d_model: expected an int >= 1, got {d_model!r}")


def no_autocast(t: torch.Tensor):
    """A context with autocast off on ``t``'s device type where it is on (else a no-op): state
    arithmetic that must keep its own dtype inside a bf16 autocast forward."""
    return torch.autocast(t.device.type, enabled=False) if autocast_on(t) else nullcontext()


def _add_outer(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0, beta: float = 1.0):
    """``beta · base + alpha · aᵀ b`` (batched: ``a [B, L, i]``, ``b [B, L, o]``, ``base [B, i, o]``)
    in ``base``'s dtype, outside autocast: a fast weight or a period's gradient sum accumulates in
    its own dtype (float32 for float32 parameters) even when the tokens' factors ``a, b`` come from
    a bf16 autocast forward (autocast would run the ``baddbmm`` in bf16 and return the weights in
    bf16, rounding every later small step away)."""
    a, b = a.transpose(-1, -2).to(base.dtype), b.to(base.dtype)
    with no_autocast(base):
        return torch.baddbmm(base, a, b, alpha=alpha, beta=beta)


def check_dtype(x: torch.Tensor, module: nn.Module, name: str = "x") -> None:
    """Raise ``ValueError`` (naming ``name``, the expected and the received dtype) unless ``x`` can
    meet ``module``'s parameters: the same floating dtype, or, under autocast on ``x``'s device,
    any pair without float64 (:func:`~mnemo.layers.base.check_input_dtype`, the mixers' rule,
    against the dtype of ``module``'s first floating parameter; none: nothing checked)."""
    pd = next((p.dtype for p in module.parameters() if p.is_floating_point()), None)
    if pd is not None:
        check_input_dtype(x, pd, name, owner=f"{type(module).__name__}'s parameters")


def _as_levels(levels) -> list:
    """``levels`` as a list of :class:`Level` (each a ``Level`` or a dict of its fields)."""
    if isinstance(levels, (Level, dict, str)) or not hasattr(levels, "__iter__"):
        raise ValueError(
            f"ContinuumMemory.levels: expected a sequence of Level (or dicts of its fields), got {levels!r}"
        )
    fields = set(Level.__dataclass_fields__)
    out = []
    for i, lv in enumerate(levels):
        if isinstance(lv, dict):
            unknown = sorted(set(lv) - fields)
            if unknown:
                raise ValueError(
                    f"ContinuumMemory.levels[{i}]: unknown Level field(s) {unknown}; expected some of "
                    f"{sorted(fields)}"
                )
            lv = Level(**lv)
        elif not isinstance(lv, Level):
            raise ValueError(
                f"ContinuumMemory.levels[{i}]: expected a Level or a dict of its fields, got "
                f"{type(lv).__name__} {lv!r}"
            )
        out.append(lv)
    return out


class CMSLevel(nn.Module):
    """One level: an MLP ``x ↦ W_outᵀ gelu(W_inᵀ x)`` whose weights are fast (see module docstring).

    Args:
        d_model: width ``d``. level: its :class:`Level`.
        own_weights: create the slow initial weights ``W_in [d, h]``, ``W_out [h, d]`` (``False``
            for the faster levels of a nested CMS, which start from a slower level's weights;
            default ``True``).
        target: create the reconstruction target ``W_v`` (a reconstruction level whose objective
            is never evaluated — the slowest level of a meta-learned nested CMS — has none; default
            ``True``).

    Hook points (``[B, T, d]`` unless named; each as the level's reads and steps consume it):

    * ``hook_in``: the level's input ``x_t`` (layer-normalised by the CMS);
    * ``hook_v`` (reconstruction objective): the target ``W_v x_t``;
    * ``hook_eta`` ``[B, T, 1]`` (reconstruction objective): the rates ``η_t`` (with
      ``Level.nlms`` the hidden matrix's; a task level's rates and error signal enter with
      :meth:`absorb`, outside ``forward``);
    * ``hook_out``: the level's read ``MLP_θ(x_t)`` with the period-start weights (what the next
      level or the aggregate receives);
    * ``hook_state``: the :class:`LevelState` after the call.

    State: :class:`LevelState`.
    """

    def __init__(self, d_model: int, level: Level, own_weights: bool = True, target: bool = True):
        super().__init__()
        _check_width("CMSLevel", d_model)
        if not isinstance(level, Level):
            raise ValueError(f"CMSLevel.level: expected a Level, got {type(level).__name__} {level!r}")
        self.level = level.validate()
        self.outer_lr_scale = float(level.outer_lr_scale)
        hidden = max(1, int(round(level.expansion * d_model)))
        self.hidden = hidden
        if own_weights:
            self.W_in = nn.Parameter(torch.randn(d_model, hidden) * d_model**-0.5)
            self.W_out = nn.Parameter(torch.randn(hidden, d_model) * hidden**-0.5 * 0.1)
        else:
            self.W_in = self.W_out = None
        # the reconstruction target W_v x (unused by the task objective, whose target is the LM's)
        self.value = nn.Linear(d_model, d_model, bias=False) if level.objective != "task" and target else None
        self.rate = nn.Linear(d_model, 1, bias=True)
        self._capture: list | None = None  # (x, y, probe) of every read while the task signal records
        self.hook_in = HookPoint()
        # the target and the rates of a reconstruction level (a task level's come with its signal)
        self.hook_v = HookPoint() if self.value is not None else None
        self.hook_eta = HookPoint() if self.value is not None else None
        self.hook_out, self.hook_state = HookPoint(), HookPoint()
        self._init_special()

    def _init_special(self) -> None:
        """Rate bias with ``sigmoid(b) = 1 / (2C)`` (see the module docstring), or ``Level.rate_init``.
        The language model calls this again after its generic re-initialisation (which zeroes biases)."""
        r = self.level.rate_init
        if r is None:
            b = 0.0 if self.level.rate_per_period else -math.log(2 * self.level.period - 1)
        else:
            b = math.log(r / (1 - r))
        with torch.no_grad():
            self.rate.bias.fill_(b)

    def initial_state(self, batch_size: int, weights: tuple | None = None) -> LevelState:
        """Weights start shared (``[d, h]``, broadcast over the batch — no per-sample copies until the
        first step makes them per-sample ``[B, d, h]``); buffers are per sample. ``weights``
        overrides the level's own initial weights (nested transfer)."""
        w = weights if weights is not None else (self.W_in, self.W_out)
        if w[0] is None:
            raise ValueError("CMSLevel.initial_state: this level has no weights of its own; pass weights")
        w = tuple(x.expand(batch_size, *x.shape) if x.ndim == 2 else x for x in w)
        zeros = tuple(x.new_zeros(batch_size, *x.shape[-2:]) for x in w)
        mom = zeros if self.level.optimizer != "gd" else None
        return LevelState(weights=w, momentum=mom, grad=zeros)

    def check_state(self, st, batch_size: int, name: str = "state") -> None:
        """Raise ``ValueError`` unless ``st`` is a :class:`LevelState` this level can continue: fast
        weights (and gradient buffers) ``[batch_size, d, h]`` and ``[batch_size, h, d]`` of this level's
        widths, momentum buffers exactly when its optimizer keeps them, and every tensor in the level's
        dtype (``name``: the state's name in the message)."""
        if not isinstance(st, LevelState):
            raise ValueError(f"{name}: expected a LevelState, got {type(st).__name__}")
        d, h = self.rate.in_features, self.hidden
        want = ([batch_size, d, h], [batch_size, h, d])
        for what, pair in (("weights", st.weights), ("grad", st.grad), ("momentum", st.momentum)):
            if pair is None:
                continue
            got = [list(w.shape) for w in pair]
            if got != list(want):
                raise ValueError(
                    f"{name}.{what}: expected shapes {list(want)} (batch, d_model = {d}, hidden = {h}), "
                    f"got {got} (a state from another configuration?)"
                )
        check_state_dtype(st, self, name)
        needs = self.level.optimizer != "gd"
        if needs != (st.momentum is not None):
            raise ValueError(
                f"{name}.momentum: the level's optimizer {self.level.optimizer!r} needs "
                f"{'momentum buffers' if needs else 'none'}, got "
                f"{'none' if st.momentum is None else 'momentum buffers'} (pass back the state this "
                "module returned)"
            )

    def _step(self, st: LevelState) -> LevelState:
        """Apply the period's summed gradient (Eq. 71) with the level's optimizer."""
        lv = self.level
        if lv.optimizer == "gd":
            w = tuple(a - g for a, g in zip(st.weights, st.grad))
            mom = None
        else:
            if lv.optimizer == "delta_momentum":
                norm = torch.sqrt(sum(g.square().sum((-2, -1)) for g in st.grad)).clamp_min(1e-12)
                ghat = [g / norm[:, None, None] for g in st.grad]
                proj = sum((m * gh).sum((-2, -1)) for m, gh in zip(st.momentum, ghat))
                base = [m - proj[:, None, None] * gh for m, gh in zip(st.momentum, ghat)]
            else:
                base = st.momentum
            mom = tuple(lv.beta * m - g for m, g in zip(base, st.grad))
            w = tuple(a + m for a, m in zip(st.weights, mom))
        zeros = tuple(torch.zeros_like(g) for g in st.grad)
        return replace(st, weights=w, momentum=mom, grad=zeros, updates=st.updates + 1)

    def restart(self, st: LevelState, weights: tuple) -> LevelState:
        """Restart from ``weights`` (nested transfer): momentum and accumulated gradient cleared."""
        zeros = tuple(torch.zeros_like(g) for g in st.grad)
        mom = zeros if st.momentum is not None else None
        return replace(st, weights=tuple(weights), momentum=mom, grad=zeros)

    def _period(self, x, v, eta, st: LevelState, whole: bool):
        """Tokens ``x [B, L, d]`` of one period (or part of one), with their targets ``v`` and rates
        ``eta [B, L, 1]``: read with the current weights and take (``whole``) or accumulate the
        period's summed gradient. Returns ``(y, state)``."""
        W_in, W_out = st.weights
        z = _mm(x, W_in)
        a = F.gelu(z)
        y = _mm(a, W_out)
        err = (y - v) * eta  # η_t ∂ℓ_t/∂y
        dz = torch.ops.aten.gelu_backward(_mm(err, W_out.transpose(-1, -2)), z)
        err = self._out_err(err, x, a)  # the output matrix's own rate (Level.nlms)
        L = x.shape[1]
        st = replace(st, position=st.position + L)
        if whole and self.level.optimizer == "gd":  # fused: θ − Σ_t x ⊗ δ, no gradient buffers
            w = (
                _add_outer(W_in, x, dz, alpha=-1.0),
                _add_outer(W_out, a, err, alpha=-1.0),
            )
            return y, replace(st, weights=w, updates=st.updates + 1)
        grad = (
            _add_outer(st.grad[0], x, dz),
            _add_outer(st.grad[1], a, err),
        )
        st = replace(st, grad=grad)
        if whole:
            st = self._step(st)
        return y, st

    #: set by :meth:`deferring`
    _defer_steps: bool = False

    @contextmanager
    def deferring(self):
        """Within ``with`` (a ``"task"`` level with the ``"gd"`` optimizer; otherwise a no-op): the
        steps are kept as low-rank factors (:class:`LevelState` ``applied``/``current``) and the reads
        use them, ``x W = x W_0 − (x Xᵀ) DZ``, instead of writing the per-sample weights at every
        period end (the dual form of the same steps: equal up to float rounding). Factors of at most
        ``min(d, h)`` tokens are kept before they are folded into the weights. States made inside
        must pass through :meth:`settle` before they leave (the task-signal loop does)."""
        on = self.level.objective == "task" and self.level.optimizer == "gd"
        prev, self._defer_steps = self._defer_steps, on or self._defer_steps
        try:
            yield self
        finally:
            self._defer_steps = prev

    @staticmethod
    def settle(st: LevelState | None) -> LevelState | None:
        """The state with its kept factors folded into the weights and the gradient (see
        :meth:`deferring`); unchanged without them."""
        if st is None or (st.applied is None and st.current is None):
            return st
        w, g = st.weights, st.grad
        if st.applied is not None:
            X, DZ, A, E = st.applied
            w = (
                _add_outer(w[0], X, DZ, alpha=-1.0),
                _add_outer(w[1], A, E, alpha=-1.0),
            )
        if st.current is not None:
            X, DZ, A, E = st.current
            g = (_add_outer(g[0], X, DZ), _add_outer(g[1], A, E))
        return replace(st, weights=w, grad=g, applied=None, current=None)

    def _fold_period(self, st: LevelState) -> LevelState:
        """A period ends while its steps are kept (gd): its factors join the applied ones."""
        cur = st.current
        if cur[0].shape[1] < self.level.period:
            # the period began before the factors (its first part is in the gradient buffers):
            # materialise and step as without deferral
            st = self.settle(st)
            w = tuple(a - g for a, g in zip(st.weights, st.grad))
            zeros = tuple(torch.zeros_like(g) for g in st.grad)
            return replace(st, weights=w, grad=zeros, updates=st.updates + 1)
        applied = _cat_factors(st.applied, cur)
        st = replace(st, applied=applied, current=None, updates=st.updates + 1)
        if applied[0].shape[1] >= min(cur[0].shape[-1], cur[1].shape[-1]):  # bound the reads' rank
            st = self.settle(st)
        return st

    @staticmethod
    def _read(x: torch.Tensor, st: LevelState):
        """``(z, a, y)`` of the MLP at the current weights, factored ones included."""
        W_in, W_out = st.weights
        z = _mm(x, W_in)
        if st.applied is not None:
            X, DZ, A, E = st.applied
            z = z - (x @ X.transpose(-1, -2)) @ DZ
        a = F.gelu(z)
        y = _mm(a, W_out)
        if st.applied is not None:
            y = y - (a @ A.transpose(-1, -2)) @ E
        return z, a, y

    @staticmethod
    def _back_out(err: torch.Tensor, st: LevelState) -> torch.Tensor:
        """``err W_outᵀ`` at the current weights, factored ones included."""
        g = _mm(err, st.weights[1].transpose(-1, -2))
        if st.applied is not None:
            X, DZ, A, E = st.applied
            g = g - (err @ E.transpose(-1, -2)) @ A
        return g

    def absorb(
        self, x: torch.Tensor, delta: torch.Tensor, st: LevelState, read: tuple | None = None
    ) -> LevelState:
        """Objective ``"task"``: take in the error signal ``delta = ∂L/∂y [B, L, d]`` of ``L`` tokens
        already read (inputs ``x [B, L, d]``), in order: accumulate ``Σ_t x_t ⊗ backprop(η_t δ_t)``
        (the gradient of ``Σ_t η_t ⟨δ_t, MLP_θ(x_t)⟩`` at the period-start weights) and step at every
        period end (Eq. 71). ``read``: the read's pre-activation and activation ``(z, a)`` (``[B, L,
        h]`` each, at the current weights), reused when the ``L`` tokens lie in one period."""
        C = self.level.period
        err_all = self.rates(x) * delta
        t, L = 0, x.shape[1]
        while t < L:
            n = min(C - st.absorbed % C, L - t)
            xs, err = x[:, t : t + n], err_all[:, t : t + n]
            W_in, W_out = st.weights
            if read is not None and n == L:
                z, a = read
            else:
                z, a, _ = self._read(xs, st)
            dz = torch.ops.aten.gelu_backward(self._back_out(err, st), z)
            err = self._out_err(err, xs, a)  # the output matrix's own rate (Level.nlms)
            fresh = st.absorbed % C == 0  # a period starts here: its gradient buffers hold zeros
            ends = (st.absorbed + n) % C == 0
            if self._defer_steps:  # keep the step as factors (see deferring)
                cur = _cat_factors(st.current, (xs, dz, a, err))
                st = replace(st, current=cur, absorbed=st.absorbed + n)
                if ends:
                    st = self._fold_period(st)
                t += n
                continue
            if fresh and ends and self.level.optimizer == "gd":
                # a whole period in one piece: θ − Σ_t x_t ⊗ δ_t fused, the zero buffers untouched
                w = (
                    _add_outer(W_in, xs, dz, alpha=-1.0),
                    _add_outer(W_out, a, err, alpha=-1.0),
                )
                st = replace(st, weights=w, absorbed=st.absorbed + n, updates=st.updates + 1)
                t += n
                continue
            if fresh:  # nothing to add to
                grad = (_add_outer(st.grad[0], xs, dz, beta=0.0), _add_outer(st.grad[1], a, err, beta=0.0))
            else:
                grad = (
                    _add_outer(st.grad[0], xs, dz),
                    _add_outer(st.grad[1], a, err),
                )
            st = replace(st, grad=grad, absorbed=st.absorbed + n)
            if ends:
                st = self._step(st)
            t += n
        return st

    def rates(self, x: torch.Tensor) -> torch.Tensor:
        """``η_t = lr · sigmoid(w_η · x_t + b_η) / d`` (``/ (d C)`` with ``Level.rate_per_period``;
        ``‖x_t‖² + ε`` in place of ``d`` with ``Level.nlms``: then the hidden matrix's rate) for
        ``x [B, T, d]`` → ``[B, T, 1]``."""
        norm = x.square().sum(-1, keepdim=True) + NLMS_EPS if self.level.nlms else x.shape[-1]
        scale = norm * (self.level.period if self.level.rate_per_period else 1)
        return self.level.lr * torch.sigmoid(self.rate(x)) / scale

    def _out_err(self, err: torch.Tensor, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """The output matrix's error factor from ``err = η_t ∂ℓ_t/∂y`` (the hidden matrix's rate):
        unchanged by default; with ``Level.nlms`` rescaled from the hidden matrix's normalisation
        ``‖x_t‖² + ε`` to the output matrix's own, ``‖a_t‖² + ε`` (``x [B, L, d]``, ``a [B, L, h]``)."""
        if not self.level.nlms:
            return err
        return err * (
            (x.square().sum(-1, keepdim=True) + NLMS_EPS) / (a.square().sum(-1, keepdim=True) + NLMS_EPS)
        )

    def forward(
        self,
        x: torch.Tensor,
        state: LevelState | None = None,
        *,
        restarts: dict | None = None,
        record: list | None = None,
        initial_weights: tuple | None = None,
        emit: bool = True,
        seen: list | None = None,
    ):
        """``x [B, T, d] -> (MLP output [B, T, d], state)``; the loop runs over periods.

        ``restarts`` (nested transfer): ``{position: weights}``; after the period that ends at that
        stream position the level restarts from those weights. ``record``: a list that receives
        ``(position, weights)`` at every period end (after the step and any restart).
        ``initial_weights``: the weights a fresh state starts from (default: the level's own).
        ``emit``: ``hook_state`` fires on the returned state (default ``emit=True``); ``False`` keeps
        it from firing (the caller changes the state further and passes it itself; a reconstruction
        level only). ``seen``: a list that receives ``(x, v, eta)``, the input, target and rates as
        the level read them (after its hooks; a reconstruction level only: a meta-learned nested CMS
        replays the fastest level on them).
        """
        B, T, _ = x.shape
        st = state if state is not None else self.initial_state(B, initial_weights)
        x = self.hook_in(x)
        if self.level.objective == "task":  # read only: the steps come with the error signal (absorb)
            z, a, y = self._read(x, st)
            y = self.hook_out(y)
            if self._capture is not None:  # the tensor the signal's gradient ∂L/∂y is taken against
                if not y.requires_grad:  # nothing upstream needs a gradient: a zero to take it against
                    y = y + torch.zeros_like(y, requires_grad=True)
                self._capture.append((x, y, (z, a)))
            st = replace(st, position=st.position + T)
            # kept factors: a hook sees the materialised state; unless it replaces or edits it, the
            # stream goes on from the factored one
            return y, show_state(self.hook_state, st, self.settle(st) if self.hook_state.active else st)
        C = self.level.period
        v = self.hook_v(self.value(x))  # slow projections of all tokens at once
        eta = self.hook_eta(self.rates(x))
        if seen is not None:
            seen.append((x, v, eta))
        outs, t = [], 0
        while t < T:
            start = st.position % C
            L = min(C - start, T - t)
            sl = slice(t, t + L)
            whole = start == 0 and L == C
            y, st = self._period(x[:, sl], v[:, sl], eta[:, sl], st, whole)
            outs.append(y)
            t += L
            if not whole and st.position % C == 0:
                st = self._step(st)
            if st.position % C == 0:
                if restarts and st.position in restarts:
                    st = self.restart(st, restarts[st.position])
                if record is not None:
                    record.append((st.position, st.weights))
        if self.level.partial == "flush" and st.position % C != 0:
            st = self._step(st)
            st = replace(st, position=0)  # a fresh period starts
        y = torch.cat(outs, 1) if outs else x.new_zeros(B, 0, x.shape[-1])
        return self.hook_out(y), (show_state(self.hook_state, st) if emit else st)

    def state_spec(
        self, batch_size: int = 1, seq_len: int = 0, dtype: torch.dtype | None = None
    ) -> LevelState:
        """The level's state after ``seq_len`` tokens as ``meta`` tensors (``dtype``: default the
        parameters'): fast weights, accumulated gradient and (momentum optimizers) momentum. The
        counters are those of a ``"carry"`` level that read ``seq_len`` tokens. Defaults:
        ``batch_size=1``, ``seq_len=0``."""
        if dtype is None:
            dtype = self.rate.weight.dtype
        d, h = self.rate.in_features, self.hidden

        def pair():
            return (spec((batch_size, d, h), dtype), spec((batch_size, h, d), dtype))

        return LevelState(
            weights=pair(),
            momentum=pair() if self.level.optimizer != "gd" else None,
            grad=pair(),
            position=seq_len,
            updates=seq_len // self.level.period,
        )


@state_dataclass
class CMSState:
    """The state of a :class:`ContinuumMemory` (the ``mlp`` field of its block's
    :class:`~mnemo.layers.state.BlockState`).

    Attributes:
        levels: one :class:`LevelState` per level, fastest first.
        pending: the task signal's unfinished segment (a :class:`mnemo.models.task_signal.Pending`,
            set by the language model for levels with ``objective="task"``), else ``None``.
    """

    levels: tuple
    pending: object = None


class ContinuumMemory(nn.Module):
    """A Continuum Memory System that can replace the MLP of any block; returns the block's update
    ``y [B, T, d]`` (the block adds its own residual) and the per-level fast state.

    Args:
        d_model: width. levels: a sequence of :class:`Level` (or dicts of its fields), fastest first.
        transfer: how knowledge passes between levels: ``"sequential"`` (Eq. 73, default),
            ``"independent"`` (Eq. 74) or ``"nested"`` (Eq. 72); see the module docstring.
        order: (sequential transfer) the chain's direction, ``"fastest_first"`` (default) or
            ``"slowest_first"``: the chain visits the levels sorted by period, ascending or
            descending (stable: equal periods keep their list order), whatever their list order
            (see the module docstring for the default's justification).
        meta: (nested transfer only) the slower levels' rule: ``"unrolled"`` (default; Eq. 72 as
            meta-learning: the gradient of the faster level's loss after its adaptation,
            back-propagated through the adaptation), ``"first_order"`` (the same loss's gradient at
            the adapted weights) or ``"none"`` (each level steps on its own reconstruction loss and
            hands its weights down); see the module docstring.

    Hook points: ``hook_state`` (the :class:`CMSState` after the call) and each level's
    (``levels.{i}.hook_in`` …, see :class:`CMSLevel`); in a model, e.g.
    ``blocks.0.mlp.levels.1.hook_out``.

    State: :class:`CMSState` (``levels``: one :class:`LevelState` per level).

    Raises:
        ValueError: ``d_model`` not an int ``≥ 1``; ``levels`` not a sequence of :class:`Level` (or
            dicts of its fields) or empty; an unknown ``transfer``, ``order`` or ``meta``; ``meta`` without
            nested transfer; ``order="slowest_first"`` without sequential transfer; for
            ``"nested"``: unequal widths, a period that is not a multiple of the next faster
            level's, ``partial="flush"``, ``objective="task"`` or ``Level.nlms``.
    """

    def __init__(
        self,
        d_model: int,
        levels=(Level(8), Level(16), Level(32)),
        transfer: str = "sequential",
        meta: str | None = None,
        order: str = "fastest_first",
    ):
        super().__init__()
        _check_width("ContinuumMemory", d_model)
        levels = _as_levels(levels)
        if not levels:
            raise ValueError("ContinuumMemory: levels must hold at least one Level, got none")
        if transfer not in TRANSFERS:
            raise ValueError(f"ContinuumMemory.transfer: expected one of {TRANSFERS}, got {transfer!r}")
        if order not in ORDERS:
            raise ValueError(f"ContinuumMemory.order: expected one of {ORDERS}, got {order!r}")
        if order != "fastest_first" and transfer != "sequential":
            raise ValueError(
                f"ContinuumMemory.order: {order!r} only with transfer='sequential' (a chain), got "
                f"transfer={transfer!r}"
            )
        self.order = order
        # the chain (sequential transfer): level indices sorted by period, stably (equal periods keep
        # their list order), ascending or descending
        sign = 1 if order == "fastest_first" else -1
        self._chain = sorted(range(len(levels)), key=lambda i: sign * levels[i].period)
        if meta is not None and transfer != "nested":
            raise ValueError(f"ContinuumMemory.meta: only with transfer='nested', got transfer={transfer!r}")
        if transfer == "nested":
            meta = "unrolled" if meta is None else meta
            if meta not in METAS:
                raise ValueError(f"ContinuumMemory.meta: expected one of {METAS}, got {meta!r}")
        if transfer == "nested":
            for i, (fast, slow) in enumerate(zip(levels, levels[1:])):
                if slow.expansion != fast.expansion:
                    raise ValueError(
                        f"ContinuumMemory(transfer='nested'): every level needs the same expansion; "
                        f"level {i} has {fast.expansion}, level {i + 1} has {slow.expansion}"
                    )
                if slow.period % fast.period or slow.period == fast.period:
                    raise ValueError(
                        f"ContinuumMemory(transfer='nested'): each period must be a multiple of the "
                        f"next faster one, and larger (with equal periods the faster level's every "
                        f"step is overwritten); level {i + 1} has period {slow.period}, "
                        f"level {i} has {fast.period}"
                    )
            if any(lv.objective == "task" for lv in levels):
                raise ValueError(
                    "ContinuumMemory(transfer='nested'): objective 'task' is not supported with nested "
                    "transfer (use 'sequential' or 'independent')"
                )
            if any(lv.nlms for lv in levels):
                raise ValueError(
                    "ContinuumMemory(transfer='nested'): Level.nlms is not supported with nested transfer "
                    "(its meta-learned loss weights each token by one rate; use 'sequential' or "
                    "'independent')"
                )
            for i, lv in enumerate(levels):
                if lv.partial != "carry":
                    raise ValueError(
                        f"ContinuumMemory(transfer='nested'): level {i} has partial={lv.partial!r}; "
                        "nested transfer needs 'carry'"
                    )
        self.d_model = d_model
        self.transfer = transfer
        self.meta = meta
        last = len(levels) - 1
        learned = meta in ("unrolled", "first_order")  # the slowest level's own loss is never taken
        self.levels = nn.ModuleList(
            [
                CMSLevel(
                    d_model,
                    lv,
                    own_weights=transfer != "nested" or i == last,
                    target=not (learned and i == last and i > 0),
                )
                for i, lv in enumerate(levels)
            ]
        )
        self.norms = nn.ModuleList([nn.LayerNorm(d_model, elementwise_affine=False) for _ in levels])
        self.weights = nn.Parameter(torch.ones(len(levels))) if transfer == "independent" else None
        self.hook_state = HookPoint()

    def _init_special(self) -> None:
        for lv in self.levels:
            lv._init_special()
        if self.weights is not None:
            with torch.no_grad():
                self.weights.fill_(1.0)

    @property
    def periods(self) -> list[int]:
        """Update period ``C^(ℓ)`` (tokens) of each level, fastest first: the levels' time scales."""
        return [lv.level.period for lv in self.levels]

    def forward(self, x: torch.Tensor, state: CMSState | None = None):
        """``x [B, T, d_model] -> (y [B, T, d_model], CMSState)``.

        Raises:
            ValueError: ``x`` is not ``[B, T, d_model]`` or not of the parameters' dtype (under
                autocast: float64 on one side only); ``state`` is not a :class:`CMSState` or
                ``None``, holds another number of levels,
                another batch size, or a level state this module cannot continue (weights of other
                widths, momentum buffers missing for a momentum optimizer or present for ``"gd"``,
                kept period inputs :attr:`LevelState.inputs` not those of this configuration).
        """
        if x.ndim != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x: expected [B, T, {self.d_model}], got {list(x.shape)}")
        check_dtype(x, self)
        if state is not None:
            if not isinstance(state, CMSState):
                raise ValueError(
                    f"state: expected a CMSState (the state this module returned) or None, got "
                    f"{type(state).__name__}"
                )
            if len(state.levels) != len(self.levels):
                raise ValueError(
                    f"state: expected the state of {len(self.levels)} levels, got {len(state.levels)}"
                )
            batch = state.levels[0].grad[0].shape[0]
            if batch != x.shape[0]:
                raise ValueError(f"state: it holds {batch} samples, but x has batch size {x.shape[0]}")
            for i, (level, s) in enumerate(zip(self.levels, state.levels)):
                level.check_state(s, x.shape[0], f"state.levels[{i}]")
                self._check_inputs(i, s, x.shape[0])
        prev = state.levels if state is not None else [None] * len(self.levels)
        if self.transfer == "sequential":
            h, new = x, [None] * len(self.levels)
            for i in self._chain:  # the state and the hooks keep the levels' list indices
                y, new[i] = self.levels[i](self.norms[i](h), prev[i])
                h = h + y
            return h - x, self._emit(CMSState(levels=tuple(new)))
        if self.transfer == "independent":
            out, new = 0, []
            for i, (level, norm, s) in enumerate(zip(self.levels, self.norms, prev)):
                y, s = level(norm(x), s)
                out = out + self.weights[i] * y
                new.append(s)
            return out, self._emit(CMSState(levels=tuple(new)))
        if self.meta != "none":
            return self._nested_meta(self.norms[0](x), prev)
        # nested: slowest first; each faster level restarts from the next slower one's weights
        xn = self.norms[0](x)
        slowest = self.levels[-1]
        init = (slowest.W_in, slowest.W_out)
        new = [None] * len(self.levels)
        restarts = None
        for i in range(len(self.levels) - 1, -1, -1):
            record = [] if i > 0 else None
            y, new[i] = self.levels[i](xn, prev[i], restarts=restarts, record=record, initial_weights=init)
            restarts = dict(record) if record is not None else None
        return y, show_state(self.hook_state, CMSState(levels=tuple(new)))

    def _check_inputs(self, i: int, st: LevelState, batch: int) -> None:
        """Raise ``ValueError`` unless level ``i``'s kept period inputs fit this module (:attr:`LevelState.
        inputs`): ``[batch, position % period, 2 d_model + 1]`` for a slower level of a meta-learned
        nested CMS (its step replays the faster level on the whole period), ``None`` otherwise (a
        state of a meta-learned nested CMS given to another one would replay part of a period)."""
        name = f"state.levels[{i}].inputs"
        if self.transfer == "nested" and self.meta != "none" and i > 0:
            n = st.position % self.levels[i].level.period
            want = [batch, n, 2 * self.d_model + 1]
            got = None if st.inputs is None else list(st.inputs.shape)
            if got != want:
                raise ValueError(
                    f"{name}: expected the fastest level's reads (x, W_v x, η) of the level's current "
                    f"period, shape {want} (position {st.position}, period {self.levels[i].level.period}), "
                    f"got {'None' if got is None else got} (a state of another configuration?)"
                )
        elif st.inputs is not None:
            raise ValueError(
                f"{name}: expected None (only the slower levels of a nested CMS with meta='unrolled' or "
                f"'first_order' keep their period's inputs), got a tensor {list(st.inputs.shape)} "
                "(a state of another configuration?)"
            )

    def _emit(self, st: CMSState) -> CMSState:
        """``hook_state``: a hook sees the levels with their kept factors folded in
        (:meth:`CMSLevel.deferring`); unless it replaces the state, the stream goes on unchanged."""
        if not self.hook_state.active:
            return self.hook_state(st)
        return show_state(
            self.hook_state, st, replace(st, levels=tuple(CMSLevel.settle(s) for s in st.levels))
        )

    def _nested_meta(self, xn: torch.Tensor, prev):
        """Nested transfer with a meta-learned rule (Eq. 72): the fastest level reads and learns by
        Eq. 71; at the end of each of its periods a slower level steps by :meth:`_meta_grad`; then
        each faster level restarts from the next slower one's weights. The fastest level reads the
        call in pieces (one per period), so its hooks fire once per piece, each placed in the call
        (:func:`~mnemo.layers.hooks.span`; a recording joins them)."""
        levels = self.levels
        k = len(levels)
        B, T, d = xn.shape
        init = (levels[-1].W_in, levels[-1].W_out)
        sts = [s if s is not None else lv.initial_state(B, init) for lv, s in zip(levels, prev)]
        for i in range(1, k):
            if sts[i].inputs is None:
                sts[i] = replace(sts[i], inputs=xn.new_zeros(B, 0, 2 * d + 1))
        outer = torch.is_grad_enabled() and (
            xn.requires_grad or any(p.requires_grad for p in self.parameters())
        )
        C0 = levels[0].level.period
        outs, t = [], 0
        while t < T:
            L = min(C0 - sts[0].position % C0, T - t)
            seg = xn[:, t : t + L]
            piece = enter_piece(t, L, T)  # the fastest level's hooks: tokens t … t + L − 1 of the call
            try:
                # the piece's input, target and rates as the fastest level read them (after its
                # hooks): what the slower levels' replays of it see
                read = []
                y, sts[0] = levels[0](seg, sts[0], emit=False, seen=read)
                outs.append(y)
                read = torch.cat(read[0], -1)
                for i in range(1, k):
                    inputs = torch.cat([sts[i].inputs, read], 1)
                    sts[i] = replace(sts[i], inputs=inputs, position=sts[i].position + L)
                pos = sts[0].position
                for i in range(1, k):  # faster first: a slower level's step sees the faster one's last step
                    if pos % levels[i].level.period == 0:
                        g = self._meta_grad(i, sts[i].weights, sts[i].inputs, outer, sts[i - 1].weights)
                        sts[i] = levels[i]._step(replace(sts[i], grad=g, inputs=sts[i].inputs[:, :0]))
                for i in range(k - 2, -1, -1):  # then the restarts, slowest first
                    if pos % levels[i + 1].level.period == 0:
                        sts[i] = levels[i].restart(sts[i], sts[i + 1].weights)
                # the fastest level's state after the piece's restarts: what the next piece (or call)
                # continues from
                sts[0] = show_state(levels[0].hook_state, sts[0])
            finally:
                leave_pieces(piece)
            t += L
        for i in range(1, k):
            sts[i] = show_state(levels[i].hook_state, sts[i])
        y = torch.cat(outs, 1) if outs else xn.new_zeros(B, 0, d)
        return y, show_state(self.hook_state, CMSState(levels=tuple(sts)))

    # eager under torch.compile (a graph break): the gradient is taken with create_graph, and an outer
    # backward through it is a double backward, which AOTAutograd's compiled graphs do not support
    @eager_under_compile
    def _meta_grad(self, i: int, phi: tuple, x: torch.Tensor, create_graph: bool, adapted: tuple) -> tuple:
        """Level ``i``'s step direction at the end of one of its periods (the fastest level's reads
        ``x [B, C_i, 2d + 1]``, :attr:`LevelState.inputs`; weights ``phi`` over the period): the
        gradient with respect to ``phi`` of the faster level's loss after its adaptation over the
        period from ``phi``, ``Σ_t η^(i)_t ½‖MLP_θ(x_t) − W_v^(i−1) x_t‖²`` with ``θ`` the faster
        level's weights after its last step in the period (``adapted``; the unrolled rule recomputes
        them from ``phi``); the target ``W_v^(0) x_t`` of the fastest level is the one it read. Under
        ``torch.inference_mode`` (no autograd there), or given tensors made under it, it runs outside
        inference mode on copies. Under ``torch.compile`` it runs eagerly (a graph break; see the
        module docstring)."""
        inference, involved = inference_involved((*phi, x, *(adapted or ())))
        if involved:
            grad = torch.is_grad_enabled() and not inference
            with torch.inference_mode(False), torch.set_grad_enabled(grad):
                phi, x = tuple(w.clone() for w in phi), x.clone()
                adapted = None if adapted is None else tuple(w.clone() for w in adapted)
                return self._meta_grad(i, phi, x, create_graph and grad, adapted)
        fast, slow = self.levels[i - 1], self.levels[i]
        d = self.d_model
        reads, x = x, x[..., :d]
        # the faster level's target: the fastest level's as it read it, a slower level's (never read) anew
        v = reads[..., d : 2 * d] if i == 1 else fast.value(x)
        eta = slow.rates(x)

        def loss(theta):
            y = _mm(F.gelu(_mm(x, theta[0])), theta[1])
            return (eta * 0.5 * (y - v).square().sum(-1, keepdim=True)).sum()

        if self.meta == "first_order":
            return meta_gradient(phi, lambda _: adapted, loss, "first_order", create_graph)
        phi = tuple(w.contiguous() if w.stride(0) == 0 else w for w in phi)  # per-sample gradients
        return meta_gradient(phi, lambda p: self._adapt(i - 1, p, reads), loss, "unrolled", create_graph)

    def _adapt(self, j: int, W: tuple, x: torch.Tensor) -> tuple:
        """Level ``j``'s weights after learning, from a restart at ``W``, on the fastest level's
        reads ``x [B, n·C_j, 2d + 1]`` (whole periods; :attr:`LevelState.inputs`): Eq. 71 on its own
        loss, with the targets and rates it read, for the fastest level, meta steps (with their
        graph) for a slower one."""
        lv = self.levels[j]
        st = lv.initial_state(x.shape[0], W)
        C = lv.level.period
        if j == 0:
            d = self.d_model
            x, v, eta = x[..., :d], x[..., d : 2 * d], x[..., 2 * d :]
            for c in range(0, x.shape[1], C):
                _, st = lv._period(x[:, c : c + C], v[:, c : c + C], eta[:, c : c + C], st, True)
            return st.weights
        for c in range(0, x.shape[1], C):
            xc = x[:, c : c + C]
            g = self._meta_grad(j, st.weights, xc, True, None)
            st = lv._step(replace(st, grad=g))
        return st.weights

    def window_problems(self, seq_len: int) -> list[str]:
        """Levels that never step inside a window of ``seq_len`` tokens starting at a fresh state
        (``period ≥ seq_len``): no loss on such a window sees their update, so their rate and
        target projections get no gradient. Returns one message per such level.

        Raises:
            ValueError: ``seq_len < 1``.
        """
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len: expected an int >= 1, got {seq_len!r}")
        return [
            f"CMS level {i} has period {lv.level.period} >= the window of {seq_len} tokens: it never "
            "steps inside a window, so no training loss sees its update (its rate and target "
            "projections get no gradient) and it would step at evaluation with untrained settings"
            for i, lv in enumerate(self.levels)
            if lv.level.period >= seq_len
        ]

    def state_spec(self, batch_size: int = 1, seq_len: int = 0, dtype: torch.dtype | None = None) -> CMSState:
        """The state after ``seq_len`` tokens as ``meta`` tensors (``dtype``: default the
        parameters'): per level, the fast weights, the accumulated gradient and (momentum
        optimizers) the momentum, independent of ``seq_len``; with a meta-learned nested transfer
        also every slower level's kept reads of its current period (``seq_len % period`` tokens of
        ``2 d_model + 1`` numbers: :attr:`LevelState.inputs`). (A
        task level's pending segment is not counted: it holds a snapshot of the model state and
        the segment's tokens.) Defaults:
        ``batch_size=1``, ``seq_len=0``."""
        specs = [lv.state_spec(batch_size, seq_len, dtype) for lv in self.levels]
        if self.transfer == "nested" and self.meta != "none":  # the slower levels' period inputs
            for i in range(1, len(specs)):
                n = seq_len % self.levels[i].level.period
                specs[i] = replace(
                    specs[i], inputs=spec((batch_size, n, 2 * self.d_model + 1), specs[i].grad[0].dtype)
                )
        return CMSState(levels=tuple(specs))

    def state_size_bytes(
        self, batch_size: int = 1, seq_len: int = 0, dtype: torch.dtype | None = None
    ) -> int:
        """Bytes of :meth:`state_spec` (weights, accumulated gradient, momentum per level; a
        meta-learned nested CMS's kept period inputs). Defaults: ``batch_size=1``, ``seq_len=0``."""
        return nbytes(self.state_spec(batch_size, seq_len, dtype))
