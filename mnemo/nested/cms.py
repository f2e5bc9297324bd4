"""The Continuum Memory System (Nested Learning, Behrouz et al. 2025, §3 and Eq. 31).

A CMS is a chain of MLP blocks ordered by update frequency: level ``ℓ`` keeps per-sample *fast*
weights that take one optimizer step every ``C^(ℓ)`` tokens on the gradients accumulated over those
tokens, and stay fixed in between::

    y = MLP^(f_k)( … MLP^(f_1)(x) )             (with a residual around every level)
    θ^(ℓ) ← θ^(ℓ) − opt( Σ_{t in the period} η_t ∇ℓ^(ℓ)(θ^(ℓ); x_t) )   every C^(ℓ) tokens

Inner objective of a level (our choice, documented): the level is an associative memory from its
input ``x_t`` (layer-normalised, so ``‖x_t‖² ≈ d``) to a learned *slow* projection of it,
``ℓ_t = (η_t / 2d) ‖MLP(x_t) − W_v x_t‖²`` with a data-dependent rate
``η_t = lr · sigmoid(w_η · x_t)``; a period's step uses the *mean* of its tokens' gradients (the
``1/d`` and the mean keep the step size independent of width and period, like normalised LMS).
Reads inside a period use the period-start weights (the weights change only at period ends), so
with ``C = 1`` and one level the CMS is plain per-token online gradient descent on that loss
(predict, then step).

The fast weights start every stream at the level's learned initial weights (the slow weights, which
the outer loop trains through the unrolled updates) and persist across calls in ``CMSState``.
A partial period at the end of a call is handled by ``Level.partial``:

* ``"carry"`` (default): the gradients of the unfinished period are kept in the state and the step
  is taken when the period completes in a later call, so any split of a stream equals one pass;
* ``"flush"``: the partial period's step is taken at the end of the call (the next call starts a
  fresh period), so the weights are always up to date, at the price of depending on call boundaries.

Inner optimizers (per level, applied to the period's accumulated gradient ``g``):
``"gd"``: ``θ ← θ − g``; ``"momentum"``: ``m ← β m − g``, ``θ ← θ + m``; ``"delta_momentum"``:
the momentum is an associative memory over gradients written by the delta rule keyed on the
normalised gradient ``ĝ`` — it overwrites its component along the new gradient instead of adding to
it: ``m ← β (m − ⟨m, ĝ⟩ ĝ) − g``, ``θ ← θ + m``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

OPTIMIZERS = ("gd", "momentum", "delta_momentum")
PARTIAL = ("carry", "flush")


@dataclass(frozen=True)
class Level:
    """One CMS level.

    Attributes:
        period: ``C``, tokens between two steps of this level (``≥ 1``).
        expansion: hidden width of the level's MLP as a multiple of ``d_model``.
        lr: maximum inner learning rate ``η`` (the data-dependent rate is ``lr · sigmoid(·)``, applied
            per unit of squared input norm: ``η_t / d``).
        optimizer: ``"gd"``, ``"momentum"`` or ``"delta_momentum"``; ``beta`` its momentum.
        partial: ``"carry"`` or ``"flush"`` (see the module docstring).
    """

    period: int
    expansion: float = 2.0
    lr: float = 1.0
    optimizer: str = "gd"
    beta: float = 0.9
    partial: str = "carry"

    def validate(self) -> Level:
        def bad(name, expected):
            raise ValueError(f"Level.{name}: expected {expected}, got {getattr(self, name)!r}")

        if not isinstance(self.period, int) or self.period < 1:
            bad("period", "an int >= 1")
        if self.expansion <= 0:
            bad("expansion", "a positive number")
        if self.lr < 0:
            bad("lr", "a non-negative number")
        if self.optimizer not in OPTIMIZERS:
            bad("optimizer", f"one of {OPTIMIZERS}")
        if not 0 <= self.beta < 1:
            bad("beta", "a number in [0, 1)")
        if self.partial not in PARTIAL:
            bad("partial", f"one of {PARTIAL}")
        return self


class LevelState(NamedTuple):
    """Per-sample fast state of one level: weights ``(W_in [B,d,h], W_out [B,h,d])``, momentum (or
    ``None``), the gradient accumulated in the current period, and tokens consumed."""

    weights: tuple
    momentum: tuple | None
    grad: tuple
    position: int
    updates: int


class CMSLevel(nn.Module):
    """One level: an MLP ``x ↦ W_outᵀ gelu(W_inᵀ x)`` whose weights are fast (see module docstring)."""

    def __init__(self, d_model: int, level: Level):
        super().__init__()
        self.level = level.validate()
        hidden = max(1, int(round(level.expansion * d_model)))
        self.W_in = nn.Parameter(torch.randn(d_model, hidden) * d_model**-0.5)
        self.W_out = nn.Parameter(torch.randn(hidden, d_model) * hidden**-0.5 * 0.1)
        self.value = nn.Linear(d_model, d_model, bias=False)
        self.rate = nn.Linear(d_model, 1, bias=True)

    def initial_state(self, batch_size: int) -> LevelState:
        """Weights start shared (``[d, h]``, broadcast over the batch — no per-sample copies until the
        first step makes them per-sample ``[B, d, h]``); buffers are per sample."""
        w = (self.W_in, self.W_out)
        zeros = tuple(x.new_zeros(batch_size, *x.shape) for x in w)
        mom = zeros if self.level.optimizer != "gd" else None
        return LevelState(w, mom, zeros, 0, 0)

    def _step(self, st: LevelState, count: int) -> LevelState:
        """Apply the mean gradient of the ``count`` tokens of the period with the level's optimizer."""
        lv = self.level
        st = st._replace(grad=tuple(g / count for g in st.grad))
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
        return LevelState(w, mom, zeros, st.position, st.updates + 1)

    def _period(self, x, v, eta, st: LevelState, whole: bool):
        """Tokens ``x [B, L, d]`` of one period (or part of one), with their targets ``v`` and rates
        ``eta [B, L, 1]``: read with the current weights and take (``whole``) or accumulate the
        period's gradient. Returns ``(y, state)``."""
        W_in, W_out = st.weights
        z = x @ W_in
        a = F.gelu(z)
        y = a @ W_out
        err = (y - v) * eta  # ∂ℓ_t/∂y
        dz = torch.ops.aten.gelu_backward(err @ W_out.transpose(-1, -2), z)
        L = x.shape[1]
        st = st._replace(position=st.position + L)
        if whole and self.level.optimizer == "gd":  # fused: θ − mean_t x ⊗ δ, no gradient buffers
            w = (
                torch.baddbmm(
                    W_in.expand(x.shape[0], -1, -1) if W_in.ndim == 2 else W_in,
                    x.transpose(-1, -2),
                    dz,
                    alpha=-1.0 / L,
                ),
                torch.baddbmm(
                    W_out.expand(x.shape[0], -1, -1) if W_out.ndim == 2 else W_out,
                    a.transpose(-1, -2),
                    err,
                    alpha=-1.0 / L,
                ),
            )
            return y, st._replace(weights=w, updates=st.updates + 1)
        grad = (
            torch.baddbmm(st.grad[0], x.transpose(-1, -2), dz),
            torch.baddbmm(st.grad[1], a.transpose(-1, -2), err),
        )
        st = st._replace(grad=grad)
        if whole:
            st = self._step(st, L)
        return y, st

    def forward(self, x: torch.Tensor, state: LevelState | None = None):
        """``x [B, T, d] -> (MLP output [B, T, d], state)``; the loop runs over periods."""
        B, T, _ = x.shape
        st = state if state is not None else self.initial_state(B)
        C = self.level.period
        v = self.value(x)  # slow projections of all tokens at once
        eta = self.level.lr * torch.sigmoid(self.rate(x)) / x.shape[-1]  # η_t / d
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
                st = self._step(st, C)
        if self.level.partial == "flush" and st.position % C != 0:
            st = self._step(st, st.position % C)
            st = LevelState(st.weights, st.momentum, st.grad, 0, st.updates)  # a fresh period starts
        return torch.cat(outs, 1) if outs else x.new_zeros(B, 0, x.shape[-1]), st


class CMSState(NamedTuple):
    levels: tuple


class ContinuumMemory(nn.Module):
    """A CMS chain that can replace the MLP of any block: ``h_ℓ = h_{ℓ−1} + MLP_ℓ(h_{ℓ−1})``;
    returns ``h_k − h_0`` (the block adds its own residual) and the per-level fast state.

    Args:
        d_model: width. levels: a sequence of :class:`Level` (or dicts of its fields), fastest first.
    """

    def __init__(self, d_model: int, levels=(Level(16), Level(64), Level(256))):
        super().__init__()
        levels = [lv if isinstance(lv, Level) else Level(**lv) for lv in levels]
        if not levels:
            raise ValueError("ContinuumMemory needs at least one Level")
        self.d_model = d_model
        self.levels = nn.ModuleList([CMSLevel(d_model, lv) for lv in levels])
        self.norms = nn.ModuleList([nn.LayerNorm(d_model, elementwise_affine=False) for _ in levels])

    def forward(self, x: torch.Tensor, state: CMSState | None = None):
        h = x
        new = []
        for i, (level, norm) in enumerate(zip(self.levels, self.norms)):
            y, s = level(norm(h), state.levels[i] if state is not None else None)
            h = h + y
            new.append(s)
        return h - x, CMSState(tuple(new))

    def state_size_bytes(self, batch_size: int = 1) -> int:
        n = 0
        for lv in self.levels:
            w = lv.W_in.numel() + lv.W_out.numel()
            n += w * (2 + (lv.level.optimizer != "gd"))  # weights, accumulated gradient, momentum
        return batch_size * n * 4
