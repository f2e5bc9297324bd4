"""``mnemo continual``: does a multi-frequency Continuum Memory System forget less *in context*?

The Nested Learning claim under test (Behrouz et al. 2025, §7.1): a CMS whose levels update at
several frequencies (level ``ℓ`` takes one inner step every ``C^(ℓ)`` tokens) keeps old in-context
knowledge longer than a single-frequency memory. Every experiment here is an *in-context* task:
each stream draws fresh random associations, so nothing about them can be stored in the slow
(outer-loop) weights, and the models have **no attention** — the only thing that can carry a
stream's earlier content to its end is the CMS fast weights.

The model (:class:`ContinualNet`), identical for every task::

    h_t = E[x_t] + P[x_{t−1}] (+ U f_t + V f_{t−1} for vector inputs)     one-token lag, no mixer
    y, state = ContinuumMemory(h)                                           the only memory
    logits_t = head(LayerNorm(h_t + y_t))

The one-token lag lets a key and its value meet in one position: at a value token ``v`` preceded by
its key ``k``, ``h = E[v] + P[k]``; a query is written ``k ?`` so that at ``?``, ``h = E[?] + P[k]``
— the same ``P[k]`` under which the pair was written — and the answer is predicted there.

Models compared (defaults: ``d_model = 16``, per-level expansion ``e = 1``, periods ``1, 4, 16, 64``):

* ``cms-1`` … ``cms-4``: the first 1…4 levels of that chain (learned inner rates, ``lr = 1``);
* ``static-4``: ``cms-4`` with every level's ``lr = 0`` (its fast weights never move: a static MLP
  chain; no in-context learning — chance level is the floor);
* ``flat-4``: ``cms-4``'s levels, every one at period 1 (the equal-capacity single-frequency
  control: the same chain, the same widths and parameters, one frequency);
* ``flat-4-rates``: ``flat-4`` with each level's inner rate starting where its ``cms-4``
  counterpart's does (``sigmoid(b_η) = 1/(2C)``: 1/2, 1/8, 1/32, 1/128; ``Level.rate_init``) and
  trained with the slow levels' outer rate (``--slow-rate-lr-scale``): the control in which only
  the period differs from ``cms-4`` (``flat-4``'s levels all start at 1/2, so against ``cms-4`` it
  changes the rates' starting point as well as the period). With ``--rate-per-period`` (the
  chain's ``η_t = lr · σ_t / (d C)``, ``σ`` starting at 1/2) each stand-in instead gets the inner
  rate ``lr / C``: the same per-token rate function as its counterpart, start and ceiling;
* ``hope-3``: three levels at the periods of the ``hope`` presets' CMS (8/16/32,
  :mod:`mnemo.models.registry`), at this chain's width and with the reconstruction objective (the
  presets' task-loss objective runs only inside a language model);
* ``wide-1``: one period-1 level whose hidden width is chosen so its parameter count matches
  ``cms-4`` (the capacity control: same parameters, one frequency, one level).

Tasks (all positions unsupervised except the query answers; ``?`` is the query marker):

``abab`` (in-context A → B → A): keys and values are tokens (32 keys, 16 values). Each stream takes
a random permutation of the keys: the first ``n_a = 8`` form map A, the next ``n_b = 24`` map B (**disjoint
key sets**), values drawn uniformly (with replacement). Two stream types of equal length, half of
every batch each:

* *interference*: ``A pairs | B pairs | queries of all A keys and n_a random B keys, shuffled``;
* *baseline*: ``A pairs | queries of A | B pairs | queries of the same n_a B keys``.

Metrics: ``A_after_B`` (A queries of the interference stream), ``B`` (its B queries) and
``A_before_B`` (A queries of the baseline stream — the capacity baseline: what the memory recalls of
A with no B in between), ``forgetting = A_before_B − A_after_B``.

``forgetting_mqar``: ``n = 16`` keys with values, then ``m = 8`` of them reassigned to a new value
(``≠`` the old one), then queries of all ``n`` keys (shuffled); the target is the *latest* value.
Metrics: ``reassigned`` and ``untouched`` accuracy, and ``reassigned_old`` (the fraction of
reassigned queries answered with the stale value).

``class_incremental`` (in-context, within one stream): ``P`` phases, each introducing ``k`` new
classes whose labels are drawn without replacement from 16 label tokens (label sets disjoint across
phases, never seen before in the stream). A class is a random Gaussian prototype in ``R^16`` drawn
per stream; an example is ``prototype + σ·noise`` presented as a vector input followed by its label
token. Phase ``p`` shows ``s`` examples per class, then ``q`` queries per class of that phase
(``x ?``: accuracy just after learning phase ``p``, ``R[p, p]``); after the last phase ``q_final``
queries per class of every phase (final accuracy ``R[P, p]``). Metrics: ``avg_acc = mean_p R[P, p]`` and
``BWT = mean_{p<P} (R[P, p] − R[p, p])``. Defaults: ``P = 4, k = 2, s = 3, q = 1, q_final = 2, σ = 1``.

``retention`` (recall graded by age): ``n = 24`` key–value pairs with distinct keys (of 64; 16
values), then ``per_bin = 2`` queries from each of ``bins = 4`` age bins (the pairs cut into four
consecutive groups in the order shown), shuffled; the pairs start after a random ``0 … 8`` extra
``BOS`` pairs, so that the slow levels' period boundaries fall on different pairs per stream.
Metrics: ``age_0`` (the newest group) … ``age_3`` (the oldest), ``oldest``, ``newest``, ``recall``
(all queries) and ``age_drop = newest − oldest``: a memory that forgets by age has ``age_drop >
0``. The claims are judged on ``oldest`` (the multi-frequency chain keeps the oldest pairs better
than its equal-capacity single-frequency control) and on forgetting *by age* ("forgets less by age":
the share of its newest recall above chance that a model keeps at the oldest age,
:func:`retained_share`, higher better): the second tells a chain that keeps old pairs from one that
is better everywhere, which ``age_drop`` alone does not (it favours a memory that holds little). 8
queries against 24 pairs keep the queries' own writes few (``class_incremental``'s final block
writes 2 queries per class: 16 at the defaults). At 24 pairs a ``d_model = 16`` memory recalls its
newest pairs well enough for an age slope to show (at 48 the newest were already at 0.2–0.35 in a
smoke run; ``docs/results/continual.md``). Its evaluation uses 2,048 streams (an age bin's recall
then has a standard error of ~0.008, against ~0.02 at 256).

Training: every model is trained on its task by AdamW (:func:`mnemo.train.optim.make_optimizer`,
warm-up + cosine schedule, gradient clipping at 1.0), the same streams for every model of a seed.
Evaluation: ``eval_streams`` held-out streams per seed. A seed fixes the model initialisation, the
training streams and the evaluation streams. Results: mean ± 95% t-interval over seeds.

The recipe standard (issue 39, :mod:`mnemo.sweep.recipe`): ``--lr-grid`` chooses each model's outer
learning rate on a held-out seed (:func:`run_experiment`); every run records its training-loss curve
and how much the loss still fell over its last fifth (``loss_fall_last_fifth``: near 0 once it has
converged); the claims "each multi-level chain beats its equal-capacity ``flat`` control and the
single level ``cms-1``" get a paired verdict (:func:`judge_claims`). ``--slow-rate-lr-scale`` gives
the slow levels' inner rates their own outer learning rate.

    mnemo continual --experiment all --seeds 3 --out runs/continual
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from .. import argtypes as kinds
from ..data.tasks.continual import (  # noqa: F401  (the streams, also this module's names)
    BOS,
    EXPERIMENTS,
    QUERY,
    ABABTask,
    Batch,
    ClassIncrementalTask,
    ForgettingMQARTask,
    RetentionTask,
    make_task,
)
from ..layers.cms import ContinuumMemory
from ..plotting import legend
from ..sweep.stats import mean_interval, t_quantile

# --------------------------------------------------------------------------------------------
# statistics


def t_quantile_975(df: int) -> float:
    """``t_{0.975}`` with ``df`` degrees of freedom: :func:`mnemo.sweep.stats.t_quantile` (exact;
    a table rounded to 3 decimals and a Cornish–Fisher tail stood here before)."""
    return t_quantile(0.975, df)


def mean_ci95(values) -> dict:
    """Mean and half-width of the 95% t-interval, ``t_{0.975, n−1} · s / √n`` (``s``: sample standard
    deviation); non-finite values are dropped (and counted). ``ci95`` is ``nan`` for fewer than 2."""
    vals = [float(v) for v in values]
    good = [v for v in vals if math.isfinite(v)]
    n = len(good)
    if n == 0:
        return {"mean": float("nan"), "ci95": float("nan"), "n": 0, "dropped": len(vals)}
    # mnemo.sweep.stats.mean_interval: an exact sum, so n equal values give that value and a spread
    # of 0 (sum(good) / n gave 0.9899999999999999 ± 3e-16 for three seeds at 0.99)
    r = mean_interval(good, 0.95)
    half = float("nan") if n < 2 else r["half_width"]
    return {"mean": r["mean"], "ci95": half, "n": n, "dropped": len(vals) - n}


def backward_transfer(acc) -> float:
    """BWT of an accuracy matrix ``acc[i][j]`` (accuracy on phase ``j`` after learning phase ``i``):
    ``mean_{j < P−1} (acc[P−1][j] − acc[j][j])`` (Lopez-Paz & Ranzato 2017). Negative = forgetting."""
    P = len(acc)
    if P < 2:
        raise ValueError(f"acc: expected at least 2 phases, got {P}")
    return sum(acc[P - 1][j] - acc[j][j] for j in range(P - 1)) / (P - 1)


# --------------------------------------------------------------------------------------------
# models


class ContinualNet(nn.Module):
    """Embeddings with a one-token lag, a :class:`ContinuumMemory`, a head (module docstring).
    No attention or other mixer: the CMS fast weights are the only memory of the stream."""

    def __init__(
        self, vocab_size: int, d_model: int, levels, feat_dim: int = 0, slow_rate_lr_scale: float = 1.0
    ):
        """``slow_rate_lr_scale`` multiplies the outer learning rate of the rate parameters
        (``w_η``, ``b_η``: the inner step size) of every slow level — ``period > 1``, or a period-1
        level standing in for one in the ``flat-k-rates`` control: a ``rate_init`` below ``1/2``
        (a slow level's starting rate) or an inner ``lr`` below the largest of the model's levels (a
        slow level's capped rate, ``rate_per_period``) — so that a slow level's rate, which starts
        small, can move as far as the outer loop needs; its weights keep the common rate."""
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.prev = nn.Embedding(vocab_size, d_model)
        self.feat = nn.Linear(feat_dim, d_model, bias=False) if feat_dim else None
        self.feat_prev = nn.Linear(feat_dim, d_model, bias=False) if feat_dim else None
        self.cms = ContinuumMemory(d_model, levels)
        if slow_rate_lr_scale != 1.0:
            top = max(lv.level.lr for lv in self.cms.levels)
            for lv in self.cms.levels:
                r = lv.level.rate_init
                if lv.level.period > 1 or (r is not None and r < 0.5) or lv.level.lr < top:
                    lv.rate.outer_lr_scale = float(slow_rate_lr_scale)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, ids: torch.Tensor, feats: torch.Tensor | None = None, state=None):
        prev = F.pad(ids[:, :-1], (1, 0), value=BOS)
        h = self.embed(ids) + self.prev(prev)
        if self.feat is not None and feats is not None:
            h = h + self.feat(feats) + self.feat_prev(F.pad(feats[:, :-1], (0, 0, 1, 0)))
        y, state = self.cms(h, state)
        return self.head(self.norm(h + y)), state

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def _period_sums(t: torch.Tensor, C: int) -> torch.Tensor:
    """``t [B, T]`` summed over each period of ``C`` tokens from the first → ``[B, ⌈T/C⌉]`` (the
    last, partial period: zeros add nothing to its sum)."""
    return F.pad(t, (0, (-t.shape[1]) % C)).reshape(t.shape[0], -1, C).sum(-1)


@torch.no_grad()
def inner_step_stats(model: ContinualNet, ids: torch.Tensor) -> list[dict]:
    """How close each level's inner gradient step comes to gradient descent's stability limit on
    the streams ``ids [B, T]`` (fresh fast state; the model's ``sequential`` chain of levels).

    A level of period ``C`` takes, at each period end, the sum of its ``C`` tokens' steps at one
    set of weights (Eq. 71), each scaled by ``η_t = lr · σ_t / d`` (``/ (d C)`` with
    ``Level.rate_per_period``; the output matrix's ``lr · σ_t / (‖a_t‖² + ε)`` with ``Level.nlms``)
    with ``σ_t = sigmoid(w_η · x_t + b_η)``. On the output matrix
    alone the reconstruction loss ``½‖W_outᵀ a_t − v_t‖²`` has the Hessian ``a_t a_tᵀ`` (``a_t``
    the level's hidden activation), so a period's step multiplies
    the error along a direction by ``1 − λ`` for the eigenvalues ``λ`` of ``Σ_t η_t a_t a_tᵀ``: it
    overshoots and grows the error once ``λ > 2``. ``bound``, the largest ``Σ_t η_t ‖a_t‖²`` over
    periods and streams, is an upper bound of ``λ`` (equal to it when the ``a_t`` are parallel).

    Returns per level, in the chain's order: ``{"level" (its index in the model's list),
    "period", "sigma_mean", "sigma_max", "summed_sigma_max" (the largest Σ_t σ_t of a period),
    "a2_max" (the largest ‖a_t‖²), "bound"}``; the last, partial period counts as it is.

    Raises:
        ValueError: a CMS whose levels are not a sequential chain.
    """
    prev = F.pad(ids[:, :-1], (1, 0), value=BOS)
    h = model.embed(ids) + model.prev(prev)
    cms = model.cms
    if cms.transfer != "sequential":
        raise ValueError(f"model: expected a sequential CMS chain, got transfer {cms.transfer!r}")
    out = []
    for i in cms._chain:  # the chain's order (fastest first by default), as its forward runs it
        lv, x = cms.levels[i], cms.norms[i](h)
        sigma = torch.sigmoid(lv.rate(x)).squeeze(-1)  # [B, T]
        a = F.gelu(x @ lv.W_in)
        a2 = a.square().sum(-1)  # [B, T]
        C = lv.level.period
        # the output matrix's rate: lr · σ_t / d (/ C with Level.rate_per_period; Level.nlms: ‖a_t‖² + ε)
        eta = lv._out_err(lv.rates(x), x, a).squeeze(-1)
        out.append(
            {
                "level": i,
                "period": C,
                "sigma_mean": float(sigma.mean()),
                "sigma_max": float(sigma.max()),
                "summed_sigma_max": float(_period_sums(sigma, C).max()),
                "a2_max": float(a2.max()),
                "bound": float(_period_sums(eta * a2, C).max()),
            }
        )
        y, _ = lv(x)
        h = h + y
    return out


def _cms_params(d_model: int, levels) -> int:
    return sum(p.numel() for p in ContinuumMemory(d_model, levels).parameters())


#: HOPE's CMS periods (the ``hope`` presets of :mod:`mnemo.models.registry`)
HOPE_PERIODS = (8, 16, 32)


def model_specs(
    d_model: int = 16,
    expansion: float = 1.0,
    periods=(1, 4, 16, 64),
    lr: float = 1.0,
    rate_per_period: bool = False,
    nlms: bool = False,
) -> dict:
    """The compared models: name -> list of level dicts (see the module docstring);
    ``rate_per_period`` sets :class:`~mnemo.layers.cms.Level`'s of every level (a period's summed
    inner rate capped at one token's: ``η_t = lr · σ_t / (d C)``, ``σ`` starting at 1/2). The
    ``flat-k-rates`` control then gives its period-1 stand-in for a level of period ``C`` the inner
    rate ``lr / C`` (``σ`` starting at 1/2 too), so its per-token rate is the same function of
    ``σ_t`` as its counterpart's, start and ceiling alike: only the period differs. (Without the
    cap the stand-in starts at ``σ = 1/(2C)`` through ``rate_init``, as its counterpart does.)
    ``nlms`` sets ``Level.nlms`` of every level (each fast matrix's step normalised by its own
    input's squared norm instead of ``d``; the stand-ins keep their counterparts' rates the same
    way, the norm replacing ``d`` in both)."""

    def level(p, e=expansion):
        return {
            "period": p,
            "expansion": e,
            "lr": lr,
            **({"rate_per_period": True} if rate_per_period else {}),
            **({"nlms": True} if nlms else {}),
        }

    chain = [level(p) for p in periods]
    specs = {f"cms-{n}": chain[:n] for n in range(1, len(chain) + 1)}
    deepest = chain
    specs[f"static-{len(chain)}"] = [dict(lv, lr=0.0) for lv in deepest]
    # the equal-capacity single-frequency control: the deepest chain's levels, every one at period 1
    specs[f"flat-{len(chain)}"] = [level(1) for _ in deepest]
    # the same, each level's per-token rate that of its chain counterpart: period alone differs
    if rate_per_period:  # the counterpart's lr·σ/(dC) as (lr/C)·σ/d, σ starting at 1/2 in both
        specs[f"flat-{len(chain)}-rates"] = [dict(level(1), lr=lr / p) for p in periods]
    else:  # the counterpart's lr·σ/d with σ starting at 1/(2C)
        specs[f"flat-{len(chain)}-rates"] = [dict(level(1), rate_init=1 / (2 * p)) for p in periods]
    specs["hope-3"] = [level(p) for p in HOPE_PERIODS]
    target = _cms_params(d_model, deepest)
    per_hidden = _cms_params(d_model, [{"period": 1, "expansion": 2.0}]) - _cms_params(
        d_model, [{"period": 1, "expansion": 1.0}]
    )  # parameters per d_model hidden units
    base = _cms_params(d_model, [{"period": 1, "expansion": 1.0}]) - per_hidden
    hidden = max(1, round((target - base) / per_hidden * d_model))
    specs["wide-1"] = [level(periods[0], hidden / d_model)]
    return specs


# --------------------------------------------------------------------------------------------
# training and evaluation


@dataclass
class Settings:
    """One experiment's sizes (the defaults are small CPU-sized runs; docs/results/continual.md
    gives their wall times)."""

    steps: int = 200
    batch_size: int = 32
    lr: float = 1e-2
    warmup: int = 20
    eval_streams: int = 256
    d_model: int = 16
    expansion: float = 1.0
    periods: tuple = (1, 4, 16, 64)
    task: dict = field(default_factory=dict)
    #: the outer optimizer: "adamw" or "m3" (:func:`mnemo.train.optim.make_optimizer`), and M3's ε
    optimizer: str = "adamw"
    m3_eps: float = 1e-2
    #: outer-lr multiplier of the rate parameters (``w_η``, ``b_η``) of the slow levels: period > 1,
    #: or a ``flat-k-rates`` level standing in for one (:class:`ContinualNet`)
    slow_rate_lr_scale: float = 1.0
    #: every level's :class:`~mnemo.layers.cms.Level` ``rate_per_period`` (a period's summed inner
    #: rate capped at one token's; :func:`model_specs`)
    rate_per_period: bool = False
    #: every level's :class:`~mnemo.layers.cms.Level` ``nlms`` (each fast matrix's step normalised by
    #: its own input's squared norm; :func:`model_specs`)
    nlms: bool = False


DEFAULTS = {
    "abab": Settings(),
    "forgetting_mqar": Settings(),
    "class_incremental": Settings(),
    "retention": Settings(eval_streams=2048),
}


def _loss(model, b: Batch):
    logits, _ = model(b.ids, b.feats)
    return F.cross_entropy(logits.flatten(0, 1), b.targets.flatten(), ignore_index=-100), logits


@torch.no_grad()
def evaluate(model, task, gen: torch.Generator, n_streams: int, batch_size: int) -> dict:
    """Accuracy per metric over ``n_streams`` fresh streams (``alt`` rates as ``<metric>_old``);
    ``nan`` for a metric none of the streams queries (e.g. ``untouched`` with every key reassigned)."""
    model.eval()
    hit, alt, cnt = {}, {}, {}
    done = 0
    while done < n_streams:
        b = task.batch(min(batch_size, n_streams - done), gen)
        done += b.ids.shape[0]
        pred = model(b.ids, b.feats)[0].argmax(-1)
        for name, tag in task.metrics.items():
            m = b.tags == tag
            cnt[name] = cnt.get(name, 0) + int(m.sum())
            hit[name] = hit.get(name, 0) + int((pred[m] == b.targets[m]).sum())
            am = m & (b.alt >= 0)
            if am.any():
                alt[name] = alt.get(name, 0) + int((pred[am] == b.alt[am]).sum())
    model.train()
    out = {name: hit[name] / cnt[name] if cnt[name] else float("nan") for name in task.metrics}
    out.update({f"{name}_old": alt[name] / cnt[name] for name in alt})  # (alt: cnt[name] > 0)
    return out


def _derived(experiment: str, task, acc: dict) -> dict:
    """Experiment-level metrics from the per-tag accuracies."""
    if experiment == "abab":
        return {**acc, "forgetting": acc["A_before_B"] - acc["A_after_B"]}
    if experiment == "retention":
        newest, oldest = acc["age_0"], acc[f"age_{task.bins - 1}"]
        recall = sum(acc[f"age_{j}"] for j in range(task.bins)) / task.bins  # equal queries per bin
        return {"oldest": oldest, "newest": newest, "recall": recall, "age_drop": newest - oldest}
    if experiment != "class_incremental":
        return acc
    P = task.phases
    R = [[float("nan")] * P for _ in range(P)]
    for p in range(P):
        R[p][p] = acc[f"just_after_{p}"]
        R[P - 1][p] = acc[f"final_{p}"]
    return {
        "avg_acc": sum(R[P - 1]) / P,
        "BWT": backward_transfer(R),
        # (the raw tags: R[P, P] took the last phase's just-after value's place in R)
        "just_after": [acc[f"just_after_{p}"] for p in range(P)],
        "final": list(R[P - 1]),
    }


def train_one(experiment: str, task, levels, s: Settings, seed: int, bar=None) -> dict:
    """Train one model for one seed; returns its metrics, parameter count, loss and timing.

    A non-finite loss stops training; ``diverged_at_step`` names the step (1-based; the last step
    when its own update left non-finite weights, which no later loss would show), the metrics are
    ``nan`` (the means drop them and count them) and ``metrics_at_divergence`` holds the evaluation of
    the weights of the last finite step."""
    from ..train.config import TrainConfig
    from ..train.optim import lr_factor, make_optimizer

    t0 = time.time()
    torch.manual_seed(seed)
    model = ContinualNet(
        task.vocab_size,
        s.d_model,
        levels,
        getattr(task, "feat_dim", 0) if experiment == "class_incremental" else 0,
        s.slow_rate_lr_scale,
    )
    tcfg = TrainConfig(
        lr=s.lr,
        steps=s.steps,
        warmup_steps=min(s.warmup, s.steps),
        weight_decay=0.0,
        optimizer=s.optimizer,
        m3_eps=s.m3_eps,
    )
    opt = make_optimizer(model, tcfg)
    gen = torch.Generator().manual_seed(seed)  # the same training streams for every model of a seed
    diverged, losses = None, []
    base_lrs = [g["lr"] for g in opt.param_groups]  # per-group (outer_lr_scale) rates
    for step in range(s.steps):
        for g, base in zip(opt.param_groups, base_lrs):
            g["lr"] = base * lr_factor(step, tcfg.warmup_steps, s.steps, tcfg.min_lr_ratio)
        loss, _ = _loss(model, task.batch(s.batch_size, gen))
        if not math.isfinite(loss.item()):
            diverged = step + 1
            if bar is not None:
                bar.write(f"{experiment} seed {seed}: loss {loss.item()} at step {step + 1}; stopped")
                bar.update(s.steps - step)
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if step == s.steps - 1:  # the last finite weights, should this last update leave non-finite ones
            last_finite = {k: v.clone() for k, v in model.state_dict().items()}
        opt.step()
        losses.append(loss.item())
        if bar is not None:
            bar.update(1)
    if diverged is None and s.steps and not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
        diverged = s.steps  # (a finite loss with a non-finite gradient at the last step)
        model.load_state_dict(last_finite)  # what metrics_at_divergence evaluates
    acc = evaluate(model, task, torch.Generator().manual_seed(10_000 + seed), s.eval_streams, 64)
    tail = losses[-max(1, len(losses) // 10) :] if losses else [float("nan")]
    every = max(1, s.steps // CURVE_POINTS)
    curve = [
        {
            "step": i + len(losses[i : i + every]),
            "loss": sum(losses[i : i + every]) / len(losses[i : i + every]),
        }
        for i in range(0, len(losses), every)
    ]
    metrics = _derived(experiment, task, acc)
    if diverged is not None:  # reported as NaN (dropped from the means, counted); kept for the record
        at_divergence, metrics = metrics, {k: float("nan") for k in metrics}
        metrics["metrics_at_divergence"] = at_divergence
    return {
        "seed": seed,
        **metrics,
        "accuracy_by_tag": acc,
        "final_train_loss": sum(tail) / len(tail),
        "loss_curve": curve,
        "loss_fall_last_fifth": _still_falling(curve),
        # sigmoid(b_η) per level after training over its start (1/(2C), or Level.rate_init): 1 = unmoved
        "rate_scale": [torch.sigmoid(lv.rate.bias).item() / _rate_start(lv.level) for lv in model.cms.levels],
        "rate_sigmoid_bias": [torch.sigmoid(lv.rate.bias).item() for lv in model.cms.levels],
        "lr": s.lr,
        **({"m3_eps": s.m3_eps} if s.optimizer == "m3" else {}),
        "diverged_at_step": diverged,
        "wall_s": time.time() - t0,
    }


def _rate_start(level) -> float:
    """``sigmoid(b_η)`` of a level at initialisation (:meth:`mnemo.layers.cms.CMSLevel._init_special`)."""
    if level.rate_init is not None:
        return level.rate_init
    return 0.5 if level.rate_per_period else 1 / (2 * level.period)


#: points of a run's training-loss curve (``loss_curve``: the mean loss of each window of steps)
CURVE_POINTS = 40


def _still_falling(curve: list[dict]) -> float:
    """The training loss's relative fall over the last fifth of the run, ``(L(0.8) − L(1)) / L(0.8)``
    from the loss curve (``nan`` for fewer than 5 points): near 0 once the run has converged."""
    if len(curve) < 5:
        return float("nan")
    a, b = curve[(4 * len(curve)) // 5 - 1]["loss"], curve[-1]["loss"]
    return (a - b) / a if a else float("nan")


#: the held-out seed that chooses the learning rate when ``select_seed`` is not given
SELECT_SEED = 1000

#: the metric a learning rate is chosen on and the claims are judged on, per experiment
PRIMARY = {
    "abab": "A_after_B",
    "forgetting_mqar": "reassigned",
    "class_incremental": "avg_acc",
    "retention": "oldest",
}


def _scalar_metrics(experiment: str, task) -> list[str]:
    if experiment == "abab":
        return ["A_after_B", "B", "A_before_B", "forgetting", "final_train_loss"]
    if experiment == "forgetting_mqar":
        return ["reassigned", "untouched", "reassigned_old", "final_train_loss"]
    if experiment == "retention":
        return ["oldest", "newest", "recall", "age_drop", "final_train_loss"]
    return ["avg_acc", "BWT", "final_train_loss"]


def stop_pool(pool) -> None:
    """An interrupted experiment: the worker processes are terminated, so that none outlives the
    command (each would otherwise finish a run whose result nobody reads: a ``kill`` of the command
    alone left them training); the broken pool then starts no queued run."""
    import contextlib

    # (no future is cancelled: with a worker killed as it starts, CPython 3.11's pool manager can then
    # raise InvalidStateError, gh-107219; a terminated worker breaks the pool, which fails the rest)
    procs = list((getattr(pool, "_processes", None) or {}).values())
    for proc in procs:
        with contextlib.suppress(ProcessLookupError, OSError):
            proc.terminate()
    for proc in procs:
        proc.join(timeout=10)


def _worker(experiment, task, levels, s, seed):
    torch.set_num_threads(1)
    return train_one(experiment, task, levels, s, seed)


#: the modules whose code decides a run's numbers: a cached run is reused only while they are unchanged
_RUN_SOURCES = (
    "layers/cms.py",
    "data/tasks/continual.py",
    "commands/continual.py",
    "train/optim.py",
    "train/m3.py",
    "train/config.py",  # TrainConfig's defaults: AdamW's and M3's betas, the schedule's floor
)


def _source_md5() -> str:
    """md5 over the files of :data:`_RUN_SOURCES` (mnemo's own, as imported)."""
    import hashlib

    package = Path(__file__).resolve().parents[1]
    h = hashlib.md5()
    for rel in _RUN_SOURCES:
        h.update((package / rel).read_bytes())
    return h.hexdigest()


#: :class:`Settings` fields that reach a run only through its levels or its task (:func:`run_key`)
_KEYED_ELSEWHERE = ("periods", "expansion", "rate_per_period", "nlms", "task")


def run_key(experiment: str, name: str, task, levels, s: Settings, seed: int, sources: str) -> str:
    """The file name of one finished run in a cache (:func:`run_experiment`'s ``cache_dir``):
    readable parts, then 16 hex digits of a SHA-256 over everything the run's numbers depend on —
    the experiment, the task's sizes, the model's levels, the :class:`Settings` the training reads
    (learning rate, steps, the warm-up it takes, M3's ε with M3, …), the seed and ``sources``
    (:func:`_source_md5`). Settings that reach a run only through its levels or its task (``periods``,
    ``expansion``, ``rate_per_period``, ``nlms``, ``task``) are left to those: a run whose levels and
    task are the same is the same run (``cms-1`` under ``--periods 1,4`` and ``1,4,16``)."""
    import hashlib

    read = {k: v for k, v in asdict(s).items() if k not in _KEYED_ELSEWHERE}
    read["warmup"] = min(s.warmup, s.steps)  # (train_one's)
    if s.optimizer != "m3":
        read.pop("m3_eps")
    blob = json.dumps([experiment, asdict(task), levels, read, seed, sources], sort_keys=True, default=repr)
    digest = hashlib.sha256(blob.encode()).hexdigest()[:16]
    eps = f"-eps{s.m3_eps:g}" if s.optimizer == "m3" else ""
    return f"{name}-seed{seed}-lr{s.lr:g}{eps}-{digest}.json"


def _stale(path: Path, fresh: bool | float | Callable[[Path], bool]) -> bool:
    """Whether the kept run ``path`` trains again under ``fresh`` (:func:`run_experiment`)."""
    if isinstance(fresh, bool):
        return fresh
    if callable(fresh):
        return fresh(path)
    return path.stat().st_mtime < fresh


def run_experiment(
    experiment: str,
    seeds: int = 3,
    settings: Settings | None = None,
    progress: bool = True,
    models=None,
    workers: int = 1,
    lr_grid=None,
    select_seed: int | None = None,
    eps_grid=None,
    cache_dir: str | Path | None = None,
    fresh: bool | float | Callable[[Path], bool] = False,
) -> dict:
    """Every model of :func:`model_specs` on ``experiment`` for seeds ``0 … seeds−1``, ``workers``
    runs at a time (separate single-threaded processes when ``workers > 1``).

    With ``cache_dir`` every finished run is kept there as ``<experiment>/<model>-seed<S>-lr<LR>
    [-eps<ε>]-<key>.json`` (written atomically as soon as the run ends), and a run whose file is
    already there is read instead of trained: an interrupted experiment resumes where it stopped,
    with the numbers it would have had (a run is a deterministic function of what the key hashes,
    :func:`run_key`). Each finished run prints one line to stderr (model, seed, rate, the
    :data:`PRIMARY` metric, seconds). ``fresh``: every run of this call trains again, none is read
    (its kept file is replaced as it ends); kept runs of other models, seeds or settings stay. A
    ``fresh`` time (``time.time()``'s) reads only the kept runs written since then; a callable
    ``fresh(path)`` says which kept runs train again (:func:`run`'s: all but those an interrupted
    ``fresh`` call finished).

    With ``lr_grid`` (the recipe standard, :mod:`mnemo.sweep.recipe`: at least 3 outer learning
    rates spanning 10×) each model first trains on the held-out seed ``select_seed`` (not reported;
    default ``1000``) at every rate of the grid — with ``settings.optimizer == "m3"`` and
    ``eps_grid``, at every (rate, M3 ε) pair, since M3's effective step is set by ε as much as by
    the rate; the values with the best :data:`PRIMARY` metric on that seed's evaluation streams
    (ties: the smaller rate, then the smaller ε) are the model's for the reported seeds. Without
    it every model uses ``settings.lr`` (and ``settings.m3_eps``).

    Raises:
        ValueError: unknown ``models``; an ``lr_grid`` that does not meet the standard; a
            ``select_seed`` among the reported seeds; an ``eps_grid`` without ``lr_grid`` or
            with another optimizer than M3.
    """
    from dataclasses import replace

    from ..sweep.recipe import recipe_problems

    _check_experiments([experiment], seeds)
    s = settings or DEFAULTS[experiment]
    task = make_task(experiment, **s.task)
    specs = model_specs(s.d_model, s.expansion, s.periods, rate_per_period=s.rate_per_period, nlms=s.nlms)
    if models is not None:
        unknown = set(models) - set(specs)
        if unknown:
            raise ValueError(f"models: expected names from {sorted(specs)}, got {sorted(unknown)}")
        specs = {k: v for k, v in specs.items() if k in models}
    length = task.batch(1, torch.Generator().manual_seed(0)).ids.shape[1]  # every stream's length
    for name, levels in specs.items():
        for i, lv in enumerate(levels):
            if lv["period"] >= length:
                warnings.warn(
                    f"{experiment}: model {name!r}: CMS level {i} has period {lv['period']} >= the "
                    f"stream's {length} tokens, so it never steps inside a stream (its fast weights "
                    "stay at their initial value and its rate gets no gradient); use shorter --periods "
                    "or a longer stream (--task)",
                    stacklevel=2,
                )
    if lr_grid is not None:
        lr_grid = sorted(float(x) for x in lr_grid)
        select_seed = SELECT_SEED if select_seed is None else select_seed
        problems = recipe_problems(lr_grid, [*range(seeds), select_seed], select_seed, where="lr_grid")
        if select_seed < seeds:
            problems.append(
                f"select_seed: expected a seed outside the reported 0..{seeds - 1}, got {select_seed}"
            )
        if problems:
            raise ValueError("; ".join(problems))
    if eps_grid is not None:
        if lr_grid is None or s.optimizer != "m3":
            raise ValueError(
                f"eps_grid: M3's ε is tuned with lr_grid and optimizer 'm3'; got lr_grid {lr_grid}, "
                f"optimizer {s.optimizer!r}"
            )
        eps_grid = sorted(float(x) for x in eps_grid)
    points = [
        {"lr": lr, "m3_eps": eps} for lr in (lr_grid or []) for eps in (eps_grid or [s.m3_eps])
    ]  # the held-out seed's grid, in tie-break order
    cms_md5 = _git()["cms_md5"]
    t0 = time.time()
    n_select = len(specs) * len(points) * s.steps
    bar = tqdm(
        total=len(specs) * seeds * s.steps + n_select, disable=not progress, desc=f"continual {experiment}"
    )
    if workers > 1:  # one single-threaded process per run: results do not depend on the scheduling
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        pool = ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"))
    else:
        pool = None

    cache = None if cache_dir is None else Path(cache_dir) / experiment
    sources = _source_md5()

    def cached(key, job) -> Path | None:
        if cache is None:
            return None
        levels, js, seed = job
        return cache / run_key(experiment, key[0], task, levels, js, seed, sources)

    def finished(key, job, result) -> None:
        levels, js, seed = job
        path = cached(key, job)
        if path is not None:
            from ..train.checkpoint import atomic_write_text

            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, json.dumps(result))
        v = result[metric]
        step = result["diverged_at_step"]
        how = f"diverged at step {step}" if step else f"{metric} {v:.3f}"
        eps = f", eps {js.m3_eps:g}" if js.optimizer == "m3" else ""
        what = f"{key[0]} seed {seed} lr {js.lr:g}{eps}"
        bar.write(f"continual {experiment}: {what}: {how} ({result['wall_s']:.0f} s)", file=sys.stderr)

    def train_all(jobs):  # jobs: key -> (levels, settings, seed)
        done = {}
        for key, job in jobs.items():
            path = cached(key, job)
            if path is not None and path.is_file() and not _stale(path, fresh):
                try:
                    done[key] = json.loads(path.read_text())
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise ValueError(
                        f"kept run {path} is damaged ({e}): delete it to train that run again, "
                        "or pass --force"
                    ) from e
                bar.update(s.steps)
        if done:
            bar.write(
                f"continual {experiment}: {len(done)} of {len(jobs)} run(s) read from {cache}",
                file=sys.stderr,
            )
        todo = {key: job for key, job in jobs.items() if key not in done}
        if pool is None:
            for key, (levels, js, seed) in todo.items():
                bar.set_postfix_str(f"{key[0]} seed {seed} lr {js.lr:g}")
                done[key] = train_one(experiment, task, levels, js, seed, bar)
                finished(key, todo[key], done[key])
            return done
        from concurrent.futures import as_completed

        futs = {pool.submit(_worker, experiment, task, *job): key for key, job in todo.items()}
        for f in as_completed(futs):
            key = futs[f]
            done[key] = f.result()
            finished(key, todo[key], done[key])
            bar.set_postfix_str(f"{key[0]} seed {todo[key][2]} done")
            bar.update(s.steps)
        return done

    metric = PRIMARY[experiment]
    selection = {}
    # SIGTERM (`kill`, a scheduler's) takes Ctrl-C's path: the kept runs stay, the workers stop too
    import signal
    import threading

    from ..sweep.runner import _raise_interrupt

    main = pool is not None and threading.current_thread() is threading.main_thread()
    old_term = signal.signal(signal.SIGTERM, _raise_interrupt) if main else None
    try:
        chosen = {name: {"lr": s.lr, "m3_eps": s.m3_eps} for name in specs}
        if points:
            runs = train_all(
                {
                    (n, i): (specs[n], replace(s, **pt), select_seed)
                    for n in specs
                    for i, pt in enumerate(points)
                }
            )
            for n in specs:
                vals = [runs[n, i][metric] for i in range(len(points))]
                finite = [(v, -i) for i, v in enumerate(vals) if math.isfinite(v)]
                chosen[n] = points[-max(finite)[1]] if finite else points[0]
                selection[n] = {
                    "seed": select_seed,
                    "metric": metric,
                    "lr": chosen[n]["lr"],
                    **({"m3_eps": chosen[n]["m3_eps"]} if eps_grid else {}),
                    "values": {_point(pt, eps_grid): v for pt, v in zip(points, vals)},
                    "runs": [runs[n, i] for i in range(len(points))],
                }
        done = train_all(
            {(n, seed): (specs[n], replace(s, **chosen[n]), seed) for n in specs for seed in range(seeds)}
        )
    except BaseException:
        if pool is not None:
            stop_pool(pool)
        raise
    finally:
        if pool is not None:
            pool.shutdown()
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
    results = {}
    for name, levels in specs.items():
        per_seed = [done[name, seed] for seed in range(seeds)]
        probe = ContinualNet(
            task.vocab_size,
            s.d_model,
            levels,
            getattr(task, "feat_dim", 0) if experiment == "class_incremental" else 0,
        )
        metrics = _scalar_metrics(experiment, task)
        results[name] = {
            "levels": levels,
            "lr": chosen[name]["lr"],
            **({"m3_eps": chosen[name]["m3_eps"]} if s.optimizer == "m3" else {}),
            "parameters": probe.num_parameters(),
            "cms_parameters": sum(p.numel() for p in probe.cms.parameters()),
            "fast_weights_per_stream": sum(lv.W_in.numel() + lv.W_out.numel() for lv in probe.cms.levels),
            "per_seed": per_seed,
            "summary": summarise(per_seed, metrics + ["loss_fall_last_fifth"]),
            "diverged": [
                {"seed": r["seed"], "step": r["diverged_at_step"]}
                for r in per_seed
                if r["diverged_at_step"] is not None
            ],
            "wall_s": sum(r["wall_s"] for r in per_seed),
        }
        if name in selection:
            results[name]["selection"] = selection[name]
    bar.close()
    return {
        "experiment": experiment,
        "seeds": list(range(seeds)),
        "settings": asdict(s),
        "task": asdict(task),
        "chance": _chance(experiment, task),
        "lr_grid": lr_grid,
        "eps_grid": eps_grid,
        "models": results,
        "claims": judge_claims(experiment, results, _chance(experiment, task)),
        "workers": workers,
        "cms_md5": cms_md5,  # the cms.py the runs of this experiment imported (checked at its start)
        "wall_s": time.time() - t0,
    }


def summarise(per_seed: list[dict], metrics) -> dict:
    """Per metric, :func:`mean_ci95` of the seeds' values and the values themselves. A seed that
    diverged counts in none, its training loss and its curve's fall included (they stop at the
    divergence: averaged with finished runs', they would mix runs of other lengths); a value
    missing or ``null`` (read from ``continual.json``) counts as ``nan``."""
    out = {}
    for m in metrics:
        vals = [
            float("nan") if r.get("diverged_at_step") is not None or r.get(m) is None else r[m]
            for r in per_seed
        ]
        out[m] = {**mean_ci95(vals), "values": vals}
    return out


def _check_experiments(experiments, seeds) -> None:
    """Raise ``ValueError`` naming an unknown experiment, or ``seeds`` not an int >= 1."""
    unknown = [e for e in experiments if e not in DEFAULTS]
    if unknown:
        raise ValueError(f"experiment: expected one of {EXPERIMENTS}, got {unknown}")
    if not isinstance(seeds, int) or isinstance(seeds, bool) or seeds < 1:
        raise ValueError(f"seeds: expected an int >= 1, got {seeds!r}")


def _point(pt: dict, eps_grid) -> str:
    """The label of a grid point: ``"0.01"``, or ``"0.01, eps 0.1"`` with an ε grid."""
    return f"{pt['lr']:g}" + (f", eps {pt['m3_eps']:g}" if eps_grid else "")


#: a query accuracy at or above this is the ceiling: two models both there cannot be told apart
CEILING = 0.95


def claim_pairs(models) -> list[tuple[str, str]]:
    """The claims judged: every multi-level model (``cms-k``, ``k ≥ 2``, and ``hope-3``) beats the
    equal-capacity single-frequency control with as many levels (``flat-k``) and the single level
    ``cms-1``; ``cms-k`` also beats ``flat-k-rates`` (the control whose levels start at the chain's
    rates: only the period differs)."""
    pairs = []
    for name in models:
        if name.startswith(("cms-", "hope-")) and name != "cms-1":
            k = int(name.split("-")[1])
            others = [f"flat-{k}", *([f"flat-{k}-rates"] if name.startswith("cms-") else []), "cms-1"]
            pairs += [(name, other) for other in others if other in models]
    return pairs


#: a model whose newest recall is less than this above chance holds too little for its share
#: retained with age to mean anything (:func:`judge_claims`)
FLOOR = 0.1


def retained_share(newest: float, oldest: float, chance: float) -> float:
    """The share of a memory's recall above chance at the newest age that it keeps at the oldest,
    ``(oldest − chance) / (newest − chance)``: 1 for no forgetting by age, 0 for oldest at chance,
    above 1 when the oldest pairs are recalled better than the newest; ``nan`` when the newest are
    at or below chance. Unlike ``age_drop`` it does not reward a memory for holding little: at
    chance 1/16, one falling from 0.3 to 0.25 drops less (0.05) than one falling from 0.9 to 0.8
    (0.1) but keeps a smaller share (0.79 against 0.88); two flat curves both give 1."""
    held = newest - chance
    return (oldest - chance) / held if held > 0 else float("nan")


def judge_claims(experiment: str, results: dict, chance: float | None = None) -> list[dict]:
    """Paired verdicts (:func:`mnemo.sweep.recipe.judge_claim`) on the :data:`PRIMARY` metric for
    :func:`claim_pairs`, then, for retention with ``chance`` given, the claim about forgetting *by
    age* (``"a forgets less by age than b"``) on :func:`retained_share`, higher better: ``oldest``
    alone mixes forgetting by age with how much a memory holds at all, and ``age_drop`` favours a
    memory that holds little. A seed whose training loss never fell 5% below its first half's
    level is on the plateau (:func:`mnemo.sweep.recipe.left_plateau` of the loss curve); a diverged
    seed has no value (its pair is dropped). The share claim is not testable when a run of either
    model recalls its newest pairs less than :data:`FLOOR` above chance (nothing to keep), or when
    every run of both recalls even its oldest pairs at :data:`CEILING` or above (no room to
    forget)."""
    from ..sweep.recipe import judge_claim, left_plateau

    def cell(name, metric):
        # (a diverged seed's value: nan in memory, null once written to continual.json)
        rows = [r for r in results[name]["per_seed"] if r[metric] is not None and math.isfinite(r[metric])]
        return {
            "seeds": [r["seed"] for r in rows],
            "values": [r[metric] for r in rows],
            "newest": [r.get("newest") for r in rows],
            "plateau": [
                left_plateau(  # (results written before runs kept their curve: unknown)
                    [{"step": c["step"], "val_loss": c["loss"]} for c in r.get("loss_curve") or []],
                    "val_loss",
                )
                for r in rows
            ],
        }

    metric = PRIMARY[experiment]
    pairs = claim_pairs(results)
    out = [
        judge_claim(
            {"name": f"{a} > {b}", "better": a, "than": b},
            cell(a, metric),
            cell(b, metric),
            metric=metric,
            threshold=CEILING,
        )
        for a, b in pairs
    ]
    if experiment != "retention" or chance is None:
        return out

    def share_cell(c):  # seeds whose newest recall is above chance (else the share is undefined)
        keep = [i for i, n in enumerate(c["newest"]) if n - chance > 0]
        return {
            "seeds": [c["seeds"][i] for i in keep],
            "values": [retained_share(c["newest"][i], c["values"][i], chance) for i in keep],
            "plateau": [c["plateau"][i] for i in keep],
        }

    for a, b in pairs:
        ca, cb = cell(a, metric), cell(b, metric)
        c = judge_claim(
            {"name": f"{a} forgets less by age than {b}", "better": a, "than": b},
            share_cell(ca),
            share_cell(cb),
            metric="retained_share",
            threshold=None,
        )
        c["metric"] = "retained share (oldest − chance) / (newest − chance)"
        if c["verdict"] != "not testable here":
            shared = sorted(set(ca["seeds"]) & set(cb["seeds"]))  # every seed that pairs on `oldest`
            newest = {n: dict(zip(x["seeds"], x["newest"])) for n, x in ((a, ca), (b, cb))}
            oldest = {n: dict(zip(x["seeds"], x["values"])) for n, x in ((a, ca), (b, cb))}
            low = [n for n in (a, b) if any(newest[n][seed] - chance < FLOOR for seed in shared)]
            full = [oldest[n][seed] >= CEILING for n in (a, b) for seed in shared]
            if low:
                c["verdict"] = "not testable here"
                c["why"] = (
                    f"{' and '.join(low)}: newest recall less than {FLOOR:g} above chance on some seed: "
                    "too little held to measure what is kept"
                )
            elif full and all(full):
                c["verdict"] = "not testable here"
                c["why"] = (
                    f"every run of both recalls its oldest pairs at ≥ {CEILING:g}: no room to forget by age"
                )
        out.append(c)
    return out


def _chance(experiment, task) -> float:
    return 1.0 / (task.n_values if experiment != "class_incremental" else task.n_labels)


# --------------------------------------------------------------------------------------------
# reporting

_TITLES = {
    "abab": "In-context A → B → A (disjoint keys): recall of A after B",
    "forgetting_mqar": "Forgetting-MQAR: reassigned keys must return the latest value",
    "class_incremental": "In-context class-incremental learning",
    "retention": "Recall graded by age: the oldest pairs against the newest",
}


def table(result: dict) -> str:
    """A markdown table: mean ± 95% t-interval half-width over the seeds, per model and metric; with a
    learning-rate grid, each model's rate and its held-out seed's values; then the claims' verdicts."""
    exp = result["experiment"]
    models = result["models"]
    metrics = list(next(iter(models.values()))["summary"])
    n = len(result["seeds"])
    s = result["settings"]
    grid = result.get("lr_grid")
    eps_grid = result.get("eps_grid")
    opt = s.get("optimizer", "adamw")
    how = (
        f"{opt}; outer lr{' and ε' if eps_grid else ''} per model chosen on held-out seed "
        f"{next(iter(models.values()))['selection']['seed']} from lr {', '.join(f'{x:g}' for x in grid)}"
        + (f" × ε {', '.join(f'{x:g}' for x in eps_grid)}" if eps_grid else "")
        + f" by {PRIMARY[exp]}"
        if grid
        else f"{opt}, outer lr {s['lr']:g}" + (f", ε {s['m3_eps']:g}" if opt == "m3" else "")
    )
    workers = result.get("workers", 1)
    lines = [
        f"**{exp}** — {n} seeds, mean ± 95% t-interval half-width; chance {result['chance']:.3f}; "
        f"wall time {result['wall_s']:.0f} s ({workers} worker process{'es' if workers != 1 else ''}; "
        "the runs' own "
        f"{run_seconds(result) / 60:.1f} min summed); "
        f"{s['steps']} outer steps (warm-up {s['warmup']}) × batch {s['batch_size']}; {how}"
        + (
            f"; slow levels' rate parameters at {s['slow_rate_lr_scale']:g}× the outer lr"
            if s.get("slow_rate_lr_scale", 1.0) != 1.0
            else ""
        ),
        "",
        "| model | levels (period×expansion, lr) | params | outer lr | "
        + " | ".join(metrics)
        + " | diverged |",
        "|---|---|---|---|" + "---|" * len(metrics) + "---|",
    ]
    for name, r in models.items():
        lv = ", ".join(
            f"{v['period']}×{v['expansion']:.3g}"
            + (f" (rate₀ {v['rate_init']:.3g})" if v.get("rate_init") is not None else "")
            for v in r["levels"]
        )
        lrs = sorted({v.get("lr", 1.0) for v in r["levels"]})
        cells = []
        for m in metrics:
            sm = r["summary"][m]
            cells.append(
                f"{_num(sm['mean'])} ± {_num(sm['ci95'])}" + (f" (n={sm['n']})" if sm["n"] != n else "")
            )
        div = ", ".join(f"seed {d['seed']} at step {d['step']}" for d in r["diverged"]) or "—"
        lines.append(
            f"| {name} | {lv} (lr {'/'.join(f'{x:g}' for x in lrs)}) | {r['parameters']:,} | "
            f"{r.get('lr', s['lr']):g} | " + " | ".join(cells) + f" | {div} |"
        )
    if grid:
        lines += ["", f"Held-out seed's {PRIMARY[exp]} per outer lr (bold: chosen):", ""]
        lines += ["| model | " + " | ".join(f"{x:g}" for x in grid) + " |", "|---|" + "---|" * len(grid)]
        for name, r in models.items():
            vals = r["selection"]["values"]
            for eps in eps_grid or [None]:
                cells = []
                for x in grid:
                    pt = {"lr": x, "m3_eps": eps}
                    mine = x == r["lr"] and (eps is None or eps == r.get("m3_eps"))
                    v = _num(vals[_point(pt, eps_grid)])
                    cells.append(f"**{v}**" if mine else v)
                label = name + (f" (ε {eps:g})" if eps is not None else "")
                lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if result.get("claims"):
        lines += [
            "",
            "Claims (paired over seeds; 95% t-interval of the difference, positive favours the claim):",
            "",
        ]
        lines += ["| claim | metric | n | difference [95% interval] | verdict |", "|---|---|---|---|---|"]
        for c in result["claims"]:
            lines.append(
                f"| {c['claim']} | {c.get('metric', PRIMARY[exp])} | {c['n']} | {_num(c['mean'], '+.3f')} "
                f"[{_num(c['low'], '+.3f')}, {_num(c['high'], '+.3f')}] | {c['verdict']} ({c['why']}) |"
            )
    return "\n".join(lines)


def run_seconds(result: dict) -> float:
    """The training time of every run of an experiment's result, summed (the reported seeds' and the
    held-out seed's, s): what it costs to train, whether this call trained them or read them kept."""
    total = 0.0
    for m in result["models"].values():
        total += sum(r.get("wall_s") or 0.0 for r in m["per_seed"])
        total += sum(r.get("wall_s") or 0.0 for r in m.get("selection", {}).get("runs", []))
    return total


def _num(x, fmt=".3f") -> str:
    return format(x, fmt) if isinstance(x, (int, float)) and math.isfinite(x) else "n/a"


def _plot_title(result: dict) -> str:
    """The figure's title: the experiment, the seeds, and which models lost seeds to divergence."""
    lost = [f"{n} {len(r['diverged'])}" for n, r in result["models"].items() if r.get("diverged")]
    tail = f"; diverged seeds left out: {', '.join(lost)}" if lost else ""
    return f"{_TITLES[result['experiment']]}\n({len(result['seeds'])} seeds, 95% t-intervals{tail})"


def _tag_means(result: dict, series: dict) -> dict:
    """Per model, each of ``series`` (``{key: [tag names]}``) as the mean of those raw
    ``accuracy_by_tag`` entries over the seeds that did not diverge, and ``n`` those seeds; models
    with no such seed are left out."""
    out = {}
    for name, m in result["models"].items():
        rows = [r["accuracy_by_tag"] for r in m["per_seed"] if r.get("diverged_at_step") is None]
        if rows:
            out[name] = {
                key: [sum(acc[t] for acc in rows) / len(rows) for t in tags] for key, tags in series.items()
            }
            out[name]["n"] = len(rows)
    return out


def phase_curves(result: dict) -> dict:
    """Class-incremental only: per model, the accuracy of each phase's classes just after the phase
    (``R[p, p]``) and at the end (``R[P, p]``), each the mean over the seeds that did not diverge
    (``{model: {"just_after": [P], "final": [P], "n": seeds}}``; models with no such seed are left
    out). Shows whether the loss from ``R[p, p]`` to ``R[P, p]`` grows with a phase's age."""
    P = result["task"]["phases"]
    # (the raw tags: ``R[P, P]`` replaces the last phase's just-after value in ``just_after``)
    return _tag_means(result, {key: [f"{key}_{p}" for p in range(P)] for key in ("just_after", "final")})


def age_curves(result: dict) -> dict:
    """Retention only: per model, the recall of each age bin (``age_0`` the newest pairs …), the mean
    over the seeds that did not diverge (``{model: {"recall": [bins], "n": seeds}}``; models with no
    such seed are left out). A memory that forgets by age draws a falling curve."""
    return _tag_means(result, {"recall": [f"age_{j}" for j in range(result["task"]["bins"])]})


def plot(result: dict, path: Path) -> None:
    """Grouped bars (one group per model, one bar per metric) with 95% t-interval error bars; for
    the class-incremental task a second panel draws :func:`phase_curves` (accuracy per phase just
    after it and at the end), for the retention task :func:`age_curves` (recall per age bin)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = result["models"]
    names = list(models)
    metrics = [
        m
        for m in next(iter(models.values()))["summary"]
        if m not in ("final_train_loss", "loss_fall_last_fifth")
    ]
    curves = phase_curves(result) if result["experiment"] == "class_incremental" else {}
    ages = age_curves(result) if result["experiment"] == "retention" else {}
    if ages:
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(1.3 * len(names) + 7, 4))
        for i, (name, c) in enumerate(ages.items()):
            ax2.plot(
                range(len(c["recall"])), c["recall"], "-o", color=f"C{i}", ms=3, label=f"{name} (n={c['n']})"
            )
        ax2.axhline(result["chance"], color="grey", lw=0.8, ls=":", label="chance")
        ax2.set_xlabel(f"age bin (0 = the newest {result['task']['n'] // result['task']['bins']} pairs)")
        ax2.set_ylabel("recall")
        ax2.set_ylim(0, 1)
        ax2.set_xticks(range(result["task"]["bins"]))
        legend(ax2, fontsize=7)
    elif curves:
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(1.3 * len(names) + 7, 4))
        for i, (name, c) in enumerate(curves.items()):
            color = f"C{i}"
            phases = range(1, len(c["final"]) + 1)
            ax2.plot(phases, c["just_after"], "--", color=color, lw=1)
            ax2.plot(phases, c["final"], "-o", color=color, ms=3, label=f"{name} (n={c['n']})")
        ax2.axhline(result["chance"], color="grey", lw=0.8, ls=":", label="chance")
        ax2.set_xlabel("phase (1 = oldest)")
        ax2.set_ylabel("accuracy on the phase's classes")
        ax2.set_ylim(0, 1)
        ax2.set_title("dashed: just after the phase; solid: at the end", fontsize=9)
        legend(ax2, fontsize=7)
    else:
        fig, ax = plt.subplots(figsize=(1.3 * len(names) + 2, 4))
    width = 0.8 / len(metrics)
    for i, m in enumerate(metrics):
        means = [models[n]["summary"][m]["mean"] for n in names]
        errs = [models[n]["summary"][m]["ci95"] for n in names]
        errs = [e if e is not None and math.isfinite(e) else 0.0 for e in errs]  # (None: read from JSON)
        xs = [j + (i - (len(metrics) - 1) / 2) * width for j in range(len(names))]
        ax.bar(xs, means, width, yerr=errs, capsize=3, label=m)
        for j, n in enumerate(names):  # per-seed points
            vals = models[n]["summary"][m]["values"]
            ax.plot([xs[j]] * len(vals), vals, "k.", ms=3)
    if result["experiment"] != "class_incremental":
        ax.axhline(result["chance"], color="grey", lw=0.8, ls="--", label="chance")
    ax.axhline(0, color="black", lw=0.5)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel(
        "accuracy" + {"class_incremental": " / BWT", "retention": " / age_drop"}.get(result["experiment"], "")
    )
    ax.set_title(_plot_title(result), fontsize=10)
    legend(ax, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _git() -> dict:
    package = Path(__file__).resolve().parents[1]  # mnemo/

    def sh(*cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=10, cwd=package).stdout.strip()
        except Exception:  # pragma: no cover - git missing
            return ""

    import hashlib
    import sys

    cms = Path(sys.modules[ContinuumMemory.__module__].__file__).resolve()  # the cms.py the runs use
    return {
        "head": sh("git", "rev-parse", "HEAD"),
        "cms_diff_stat": sh("git", "diff", "--stat", "--", str(cms.relative_to(package))),
        "cms_md5": hashlib.md5(cms.read_bytes()).hexdigest(),
    }


#: the folder under ``--out`` that keeps each finished run (resuming an interrupted command)
RUNS_DIR = "runs"


def run(
    experiments=EXPERIMENTS,
    seeds: int = 3,
    out: str | Path | None = None,
    progress: bool = True,
    overrides: dict | None = None,
    models=None,
    workers: int = 1,
    lr_grid=None,
    select_seed: int | None = None,
    eps_grid=None,
    fresh: bool = False,
) -> dict:
    """Run ``experiments``; write ``continual.json``, ``continual.md`` and ``<experiment>.png`` under
    ``out``, and every finished run under ``out/runs/`` as it ends (:func:`run_experiment`'s
    ``cache_dir``: running the same call again after an interrupt trains only the runs that are
    missing). ``overrides`` replaces :class:`Settings` fields of every experiment (e.g. ``steps``);
    ``lr_grid``, ``select_seed``, ``eps_grid`` and ``fresh`` as in :func:`run_experiment`. With
    ``fresh`` and ``out``, ``out/runs/.fresh.json`` records the runs kept when the call began
    (removed once it ends): the same call again after an interrupt retrains only those of them the
    interrupted call did not replace, not those it finished. ``out`` is this call's while it runs:
    a second call (another process) on it is refused: ``out/.continual.lock`` is taken as
    ``mnemo train`` takes its run folder's lock (:func:`~mnemo.train.run_folder.take_lock_file`;
    released, and removed, when the call ends; a killed call's lock is free again)."""
    _check_experiments(experiments, seeds)
    call = (experiments, seeds, out, progress, overrides, models, workers, lr_grid, select_seed, eps_grid)
    if out is None:
        return _run(*call, fresh)
    with _lock_out(Path(out)):
        return _run(*call, fresh)


#: the lock of a ``mnemo continual --out`` folder (not ``.lock``: that marks a training run's folder)
LOCK_NAME = ".continual.lock"


@contextlib.contextmanager
def _lock_out(out: Path):
    """Hold ``out/.continual.lock`` (created with ``out``) while the block runs; refuse (ValueError
    naming the holder's pid) while another process holds it."""
    from ..train.run_lock import RunLock, take_lock_file

    try:
        import fcntl  # noqa: F401  (take_lock_file's)
    except ImportError:  # pragma: no cover - not POSIX: no lock
        yield
        return
    existed = out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out: {out} cannot be created: {e.strerror}") from None
    f = take_lock_file(
        out / LOCK_NAME,
        lambda holder: (
            f"--out: {out} is in use by another mnemo continual process (pid {holder}); wait for it "
            "to finish, or pick another --out"
        ),
    )
    with RunLock(f, out / LOCK_NAME, remove_empty=not existed):
        yield


def _run(
    experiments, seeds, out, progress, overrides, models, workers, lr_grid, select_seed, eps_grid, fresh
):
    marker = None
    if fresh is True and out is not None:
        marker, fresh = _fresh_since(
            Path(out) / RUNS_DIR, experiments, seeds, overrides, models, lr_grid, select_seed, eps_grid
        )
    results = {
        "git": _git(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "experiments": {},
    }
    for exp in experiments:
        s = Settings(**{**asdict(DEFAULTS[exp]), **(overrides or {})})
        results["experiments"][exp] = run_experiment(
            exp,
            seeds,
            s,
            progress,
            models,
            workers,
            lr_grid,
            select_seed,
            eps_grid,
            cache_dir=None if out is None else Path(out) / RUNS_DIR,
            fresh=fresh,
        )
    if out is not None:
        from ..bench import dumps_json
        from ..train.checkpoint import atomic_write_text

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        paths = [out / "continual.json", out / "continual.md"]
        atomic_write_text(paths[0], dumps_json(results))  # a NaN: null, named in "nonfinite"
        md = [
            "# mnemo continual",
            "",
            f"git HEAD `{results['git']['head']}`; cms.py md5 `{results['git']['cms_md5']}` "
            f"(uncommitted diff: {results['git']['cms_diff_stat'] or 'none'}); torch {results['torch']}",
            "",
        ]
        for exp, r in results["experiments"].items():
            md += [table(r), ""]
            try:
                plot(r, out / f"{exp}.png")
                paths.append(out / f"{exp}.png")
            except ImportError:  # pragma: no cover - matplotlib is an optional extra
                pass
        atomic_write_text(paths[1], "\n".join(md))
        results["paths"] = [str(p) for p in paths]
    if marker is not None:
        marker.unlink(missing_ok=True)
    return results


def _fresh_since(cache: Path, *command) -> tuple[Path, Callable[[Path], bool]]:
    """``run(fresh=True)``: ``(the marker file, which kept runs train again)``: those kept when a
    ``fresh`` call of the same arguments began and not replaced since (an interrupted call's finished
    runs are read), else all kept now (recorded in the marker by content: file times travel badly —
    ``cp`` renews them, another machine's clock may be ahead)."""
    import hashlib

    from ..train.checkpoint import atomic_write_text

    marker = cache / ".fresh.json"
    key = json.loads(json.dumps(command, sort_keys=True, default=repr))

    def digest(path: Path) -> str:
        return hashlib.sha256(path.read_bytes()).hexdigest()

    try:
        held = json.loads(marker.read_text())
        if held["command"] != key:
            raise KeyError("command")
        kept = dict(held["kept"])
    except (OSError, ValueError, KeyError, TypeError):
        kept = {p.relative_to(cache).as_posix(): digest(p) for p in sorted(cache.glob("*/*.json"))}
        cache.mkdir(parents=True, exist_ok=True)
        atomic_write_text(marker, json.dumps({"command": key, "since": time.time(), "kept": kept}))

    def stale(path: Path) -> bool:
        was = kept.get(path.relative_to(cache).as_posix())
        return was is not None and digest(path) == was

    return marker, stale


def add_commands(sub) -> None:
    p = sub.add_parser(
        "continual",
        help="in-context continual learning of the CMS: A→B→A recall, forgetting-MQAR, class-incremental, "
        "recall graded by age",
    )
    p.add_argument(
        "--experiment",
        default="all",
        choices=(*EXPERIMENTS, "all"),
        help="which experiment to run (default all: every one, tens of minutes on 2 cores)",
    )
    p.add_argument(
        "--seeds", type=kinds.Int(1, 1000), default=3, help="seeds 0..N-1 (model init + data; default 3)"
    )
    p.add_argument(
        "--steps", type=kinds.positive_int, help="outer-loop steps per model (default: per experiment)"
    )
    p.add_argument(
        "--eval-streams",
        type=kinds.Int(1, 100_000),
        help="held-out streams per seed, at most 100,000 (default 256; 2,048 for retention)",
    )
    p.add_argument(
        "--models",
        type=kinds.Text("comma-separated model names"),
        help="comma-separated subset of "
        + ", ".join(model_specs())
        + " (the numbers for the default 4 --periods; N levels: cms-1..cms-N, static-N, flat-N, "
        "flat-N-rates) (default: all)",
    )
    p.add_argument(
        "--workers",
        type=kinds.Int(1, 256),
        default=2,
        help="runs in parallel (one process per run; default 2)",
    )
    p.add_argument(
        "--out",
        default="runs/continual",
        type=kinds.OutDir(not_a_run=True),
        help="folder for the results (default runs/continual)",
    )
    p.add_argument(
        "--lr", type=kinds.positive_float, help="outer learning rate of every model (default 1e-2)"
    )
    p.add_argument(
        "--lr-grid",
        type=kinds.FloatList(),
        help="comma-separated outer learning rates (>= 3 spanning 10x): each model's is chosen on "
        "--select-seed, e.g. 3e-3,1e-2,3e-2",
    )
    p.add_argument(
        "--optimizer",
        choices=("adamw", "m3"),
        help="the outer optimizer (default adamw; m3: Nested Learning's Multi-scale Momentum Muon)",
    )
    p.add_argument("--m3-eps", type=kinds.positive_float, help="M3's ε (default 1e-2)")
    p.add_argument(
        "--eps-grid",
        type=kinds.FloatList(),
        help="comma-separated M3 ε values chosen with --lr-grid on --select-seed (with --optimizer m3)",
    )
    p.add_argument(
        "--select-seed",
        type=kinds.Int(0, 1_000_000),
        help="the held-out seed that chooses the learning rate (default 1000; with --lr-grid)",
    )
    p.add_argument(
        "--periods",
        type=kinds.IntList(),
        help="the CMS chain's periods, fastest first (default 1,4,16,64)",
    )
    p.add_argument(
        "--slow-rate-lr-scale",
        type=kinds.positive_float,
        help="outer-lr multiplier of the inner-rate parameters of the slow levels: period > 1, or a "
        "flat-k-rates level standing in for one (default 1)",
    )
    p.add_argument(
        "--rate-per-period",
        action="store_true",
        help="cap each CMS level's summed inner rate over a period at one token's: eta_t = lr * "
        "sigmoid(.) / (d C) (Level.rate_per_period; default: the per-token cap lr / d)",
    )
    p.add_argument(
        "--nlms",
        action="store_true",
        help="normalise each fast matrix's step by its own input's squared norm instead of d "
        "(Level.nlms: normalised LMS; the output matrix's step then cannot overshoot a token's error)",
    )
    p.add_argument(
        "--warmup",
        type=kinds.nonneg_int,
        help="outer warm-up steps (default: 20, or a tenth of --steps when that is fewer)",
    )
    p.add_argument(
        "--task",
        action="append",
        type=kinds.Text("KEY=INT"),
        default=[],
        metavar="KEY=INT",
        help="a task size, e.g. --task n_keys=64 --task n_a=16 --task n_b=48 (repeatable)",
    )
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--force",
        action="store_true",
        help="replace the results already in --out; this command's runs train again (other kept runs stay)",
    )
    p.set_defaults(func=_cmd)


class _Refusal(ValueError):
    """A command line that :func:`parse_command` refuses (argparse's message)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print the usage and exit the process
        raise _Refusal(message)


def parse_command(argv: list[str]) -> argparse.Namespace:
    """The arguments of ``mnemo continual ARGV`` (a results page's ``<!-- mnemo:continual ARGV
    -->`` line, :mod:`mnemo.sweep.reproduce`), checked as the CLI checks them.

    Raises:
        ValueError: what the CLI would refuse, with argparse's message.
    """
    if {"-h", "--help"} & set(argv):
        raise ValueError("-h/--help: a command line to run, not to print its help, is expected")
    parser = _Parser(prog="mnemo")
    add_commands(parser.add_subparsers(dest="command"))
    return parser.parse_args(["continual", *argv])


def run_arguments(args) -> tuple[tuple[str, ...], dict]:
    """``(experiments, keyword arguments of :func:`run`)`` of parsed ``mnemo continual`` arguments.

    Raises:
        ValueError: arguments that contradict each other (``--lr`` with ``--lr-grid``, …).
    """
    exps = EXPERIMENTS if args.experiment == "all" else (args.experiment,)
    overrides = {}
    if args.steps is not None:
        overrides["steps"] = args.steps
        overrides["warmup"] = min(DEFAULTS[exps[0]].warmup, max(1, args.steps // 10))
    if args.eval_streams is not None:
        overrides["eval_streams"] = args.eval_streams
    for name in ("lr", "periods", "slow_rate_lr_scale", "warmup", "optimizer", "m3_eps"):
        if getattr(args, name) is not None:
            v = getattr(args, name)
            overrides[name] = tuple(int(x) for x in v.split(",")) if name == "periods" else v
    if args.rate_per_period:
        overrides["rate_per_period"] = True
    if args.nlms:
        overrides["nlms"] = True
    if args.select_seed is not None and args.lr_grid is None:
        raise ValueError("--select-seed: it chooses among --lr-grid's rates; pass --lr-grid too")
    if args.lr is not None and args.lr_grid is not None:
        raise ValueError("--lr: each model's rate is chosen from --lr-grid; pass one of the two")
    if (args.m3_eps is not None or args.eps_grid is not None) and args.optimizer != "m3":
        raise ValueError("--m3-eps / --eps-grid: they set M3's ε; pass --optimizer m3 too")
    if args.eps_grid is not None and args.lr_grid is None:
        raise ValueError("--eps-grid: ε is chosen with the learning rate; pass --lr-grid too")
    if args.m3_eps is not None and args.eps_grid is not None:
        raise ValueError("--m3-eps: ε is chosen from --eps-grid; pass one of the two")
    if args.task:
        overrides["task"] = _task_overrides(args.task, exps)
    return exps, {
        "seeds": args.seeds,
        "out": args.out,
        "progress": not args.no_progress,
        "overrides": overrides,
        "models": args.models.split(",") if args.models else None,
        "workers": args.workers,
        "lr_grid": [float(x) for x in args.lr_grid.split(",")] if args.lr_grid else None,
        "select_seed": args.select_seed,
        "eps_grid": [float(x) for x in args.eps_grid.split(",")] if args.eps_grid else None,
        "fresh": args.force,  # replacing the results retrains their runs too
    }


def _cmd(args) -> int:
    old = [p.name for p in (Path(args.out) / "continual.json", Path(args.out) / "continual.md") if p.exists()]
    if old and not args.force:
        raise ValueError(
            f"--out: {args.out} already holds results ({', '.join(old)}); pick another --out or pass --force"
        )
    exps, kwargs = run_arguments(args)
    kept = [Path(args.out) / RUNS_DIR / e for e in exps if (Path(args.out) / RUNS_DIR / e).is_dir()]
    if kept and not args.force:
        n = sum(len(list(d.glob("*.json"))) for d in kept)
        print(
            f"--out: {n} finished run(s) kept in {Path(args.out) / RUNS_DIR}: those that match are reused",
            file=sys.stderr,
        )
    try:
        res = run(exps, **kwargs)
    except KeyboardInterrupt as e:
        e.then = (
            f"; the finished runs are kept in {Path(args.out) / RUNS_DIR}: run the same mnemo continual "
            "command again to continue"
        )
        raise
    for r in res["experiments"].values():
        print(table(r) + "\n")
    print("wrote " + ", ".join(res["paths"]))
    # --force replaced continual.json/.md: a plot of an experiment they no longer hold would read
    # as part of these results
    stale = [Path(args.out) / f"{e}.png" for e in EXPERIMENTS if e not in exps]
    stale = [p for p in stale if p.is_file()]
    for p in stale:
        p.unlink()
    if stale:
        print("removed the replaced results' plots: " + ", ".join(p.name for p in stale))
    return 0


# --------------------------------------------------------------------------------------------
# results pages: a `<!-- mnemo:continual ARGS -->` line (mnemo reproduce, mnemo.sweep.reproduce)


def _page_root(page: Path) -> Path | None:
    """The checkout a page lives in: its nearest parent holding ``pyproject.toml`` or ``.git``."""
    return next(
        (p for p in page.resolve().parents if (p / "pyproject.toml").is_file() or (p / ".git").exists()), None
    )


def _parse_in(folder: Path, parse, argv: list[str]):
    """``parse(argv)`` with ``folder`` as the working directory: a page line's relative paths are
    its checkout's, and the CLI's checks of them (``--out`` a folder it may write into, not a
    training run's) must look there, not wherever ``mnemo reproduce`` was called from."""
    import os

    here = os.getcwd()
    os.chdir(folder)
    try:
        return parse(argv)
    finally:
        os.chdir(here)


def page_out(args, root: Path | None) -> Path:
    """A page line's ``--out`` as a path: ``~`` expanded, a relative one read against the page's
    checkout ``root`` (else the working directory)."""
    out = Path(args.out).expanduser()
    return out if out.is_absolute() else (root or Path.cwd()) / out


def page_jobs(page: Path) -> list[dict]:
    """Each ``mnemo:continual`` line of ``page``, parsed before anything runs: ``{"line", "argv",
    "name" (its block: ``--out``'s folder name, prefixed with ``continual_`` unless it starts
    with ``continual``), "out", "experiments", "kwargs"}``. A relative ``--out`` is resolved like
    a sweep file (:func:`mnemo.sweep.reproduce.page_sweeps`): against the page's checkout (its
    nearest parent with ``pyproject.toml`` or ``.git``), else the working directory, and checked
    there as the CLI checks a folder to write into; ``~`` is expanded.

    Raises:
        ValueError: a line the CLI refuses, one with ``--force`` (it would retrain every run at each
            rebuild), two lines with one block name.
    """
    from ..sweep.reproduce import page_continual

    jobs: list[dict] = []
    root = _page_root(page)
    for line, argv in page_continual(page):
        where = f"{page}:{line}"
        try:
            args = _parse_in(root or Path.cwd(), parse_command, argv)
            if args.force:
                raise ValueError(
                    "--force: it retrains every run at each rebuild; the page's line resumes from the kept "
                    "runs (delete them to retrain)"
                )
            exps, kwargs = run_arguments(args)
        except ValueError as e:
            raise ValueError(f"{where}: mnemo continual {' '.join(argv)}: {e}") from None
        out = page_out(args, root)
        kwargs["out"] = out
        folder = out.resolve().name
        name = folder if folder.startswith("continual") else f"continual_{folder}"
        if any(j["name"] == name for j in jobs):
            raise ValueError(f"{where}: a second mnemo:continual line writes to {out.name}: block {name!r}")
        jobs.append(
            {"line": line, "argv": argv, "name": name, "out": out, "experiments": exps, "kwargs": kwargs}
        )
    return jobs


def check_page_job(page: Path, job: dict) -> None:
    """``--no-run``: the line's ``--out`` must hold ``continual.json`` with results of every one of
    its experiments, made by the command the line names (:func:`_continual_mismatch`).

    Raises:
        FileNotFoundError: no such results. ValueError: results of another command.
    """
    from ..sweep.reproduce import _shown

    where, path = f"{page}:{job['line']}", job["out"] / "continual.json"
    try:
        held = _stored_experiments(path)
        missing = [e for e in job["experiments"] if e not in held]
        differ = [
            f"{e}: {d}" for e in job["experiments"] if e in held for d in _mismatch(e, held[e], job["kwargs"])
        ]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(
            f"{where}: {_shown(path)} is not a result of mnemo continual ({type(e).__name__}: {e}); run the "
            "command (drop --no-run)"
        ) from None
    if missing:
        raise FileNotFoundError(
            f"{where}: {_shown(path)} holds no results of {', '.join(missing)}; run the command "
            "(drop --no-run)"
        )
    if differ:
        raise ValueError(
            f"{where}: {_shown(path)} holds results of another command than the page's line ("
            + "; ".join(differ)
            + "): fix the line, or run it (drop --no-run)"
        )


def _stored_experiments(path: Path) -> dict:
    """``{experiment: result}`` of a ``continual.json`` (``{}`` when there is none).

    Raises:
        ValueError, KeyError, TypeError: a file that is not one.
    """
    if not path.is_file():
        return {}
    from ..bench import loads_json  # a NaN written as null + "nonfinite" is a NaN again

    held = loads_json(path.read_text())["experiments"]
    if not isinstance(held, dict):
        raise TypeError(f"'experiments' is a {type(held).__name__}")
    return held


def foreign_results(page: Path, job: dict) -> str | None:
    """Before a run (:func:`mnemo.sweep.reproduce.reproduce_page`): why the line's ``--out`` holds
    results that running the line would replace and that are not its command's — experiments the
    line does not run (the new ``continual.json`` holds the line's only), or results of one it runs
    made with other settings (:func:`_mismatch`), or a file that is not a result; ``None``: nothing
    there, or the line's own (possibly fewer experiments than it runs)."""
    from ..sweep.reproduce import _shown

    path = job["out"] / "continual.json"
    try:
        held = _stored_experiments(path)
        extra = sorted(set(held) - set(job["experiments"]))
        differ = [
            f"{e}: {d}" for e in job["experiments"] if e in held for d in _mismatch(e, held[e], job["kwargs"])
        ]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{_shown(path)} is not a result of mnemo continual ({type(e).__name__}: {e})"
    if extra:
        return f"{_shown(path)} holds results of {', '.join(extra)}, which the line does not run"
    if differ:
        return (
            f"{_shown(path)} holds results of another command than the page's line ("
            + "; ".join(differ)
            + ")"
        )
    return None


def _mismatch(experiment: str, result: dict, kwargs: dict) -> list[str]:
    """Where one experiment's stored ``result`` (``continual.json``) differs from what the line's
    :func:`~mnemo.commands.continual.run` arguments ``kwargs`` would train: the seeds, the models
    (the default set when the line names none), the grids and the held-out seed, every
    :class:`~mnemo.commands.Settings` field and every task size — defaults included, so a
    flag dropped from the line counts as much as one changed. A field that results written by
    older code do not record is compared with its default (a task size they do not record is
    skipped: older tasks had fewer)."""
    from dataclasses import asdict, fields

    def same(a, b):
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        return a == b

    out = []
    overrides = kwargs["overrides"] or {}
    settings = Settings(**{**asdict(DEFAULTS[experiment]), **overrides})
    if result["seeds"] != list(range(kwargs["seeds"])):
        out.append(f"seeds {result['seeds']} against --seeds {kwargs['seeds']}")
    models = kwargs["models"]
    if models is None:
        models = list(model_specs(settings.d_model, settings.expansion, settings.periods))  # names only
    if set(result["models"]) != set(models):
        out.append(f"models {sorted(result['models'])} against {sorted(models)}")
    for key in ("lr_grid", "eps_grid"):
        want = sorted(kwargs[key]) if kwargs[key] is not None else None
        if not same(result.get(key), want):
            out.append(f"{key} {result.get(key)} against {want}")
    if kwargs["lr_grid"] is not None:
        chosen_on = {m.get("selection", {}).get("seed") for m in result["models"].values()}
        want_seed = kwargs["select_seed"] if kwargs["select_seed"] is not None else SELECT_SEED
        if chosen_on != {want_seed}:
            out.append(f"held-out seed {sorted(chosen_on, key=str)} against --select-seed {want_seed}")
    stored = result["settings"]
    for f in fields(Settings):
        want = getattr(settings, f.name)
        have = stored[f.name] if f.name in stored else asdict(Settings())[f.name]
        if not same(have, want):
            out.append(f"{f.name} {have} against {want}")
    task = asdict(make_task(experiment, **settings.task))
    for k, v in task.items():
        if k in result["task"] and not same(result["task"][k], v):
            out.append(f"task {k}={result['task'][k]} against {k}={v}")
    return out


def page_block(
    page: Path, job: dict, *, train: bool, progress: bool = True, log=print, threads: int | None = None
) -> str:
    """The generated block of one ``mnemo:continual`` line (:func:`page_jobs`): with ``train``, the
    command run or resumed (:func:`run`; a warning first when it replaces stored results; with
    ``--workers 1`` on ``threads`` torch threads, ``mnemo reproduce --threads``, ``None``: torch's;
    each worker process takes one), else its
    stored ``continual.json``; then the command, each experiment's table with its claims judged
    again from the kept numbers (:func:`judge_claims`: the current rules, on the stored values),
    and the figures; the summaries are also taken again from the kept per-seed values
    (:func:`summarise`)."""
    from ..sweep.reproduce import _shown

    if train:
        stored, kept = job["out"] / "continual.json", job["out"] / RUNS_DIR
        if stored.is_file():
            n = sum(1 for e in job["experiments"] for _ in (kept / e).glob("*.json"))
            log(
                f"{job['name']}: replacing {_shown(stored)}; {n} run(s) kept in {_shown(kept)} "
                "(those made with today's code and settings are read, every other run trains again; "
                "--no-run rebuilds the block from the stored results without training)"
            )
        before = torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)
        try:
            results = run(job["experiments"], **{**job["kwargs"], "progress": progress})["experiments"]
        finally:
            torch.set_num_threads(before)
    else:
        from ..bench import loads_json  # the NaN of a diverged seed again, as a run's results hold

        results = loads_json((job["out"] / "continual.json").read_text())["experiments"]
    import os
    import shlex

    rel = os.path.relpath(job["out"], page.parent)
    lines = [
        f"*Generated by `mnemo reproduce {_shown(page)}` from its `mnemo:continual` line; edits between "
        "these markers are replaced.* Command (where it ran before, it resumes from the runs kept in its "
        "`--out`'s `runs/`, which git ignores):",
        "",
        "```bash",
        f"OMP_NUM_THREADS=1 mnemo continual {shlex.join(job['argv'])}",
        "```",
        "",
    ]
    for exp in job["experiments"]:
        r = results[exp]
        models = {  # the summaries too, by the current rules (diverged seeds out of every metric)
            n: {**m, "summary": summarise(m["per_seed"], list(m["summary"]))} for n, m in r["models"].items()
        }
        r = {**r, "models": models, "claims": judge_claims(exp, models, r["chance"])}
        lines += [table(r), ""]
        if (job["out"] / f"{exp}.png").is_file():
            lines += [f"![{exp}]({rel}/{exp}.png)", ""]
    return "\n".join(lines).rstrip()


def _task_overrides(items: list[str], exps) -> dict:
    """``["n_keys=64", ...]`` -> ``{"n_keys": 64, ...}``, checked against every experiment's task."""
    import dataclasses

    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        key = key.strip()
        try:
            out[key] = int(value)
        except ValueError:
            out[key] = None
        if not eq or out[key] is None:
            raise ValueError(f"--task: expected KEY=INT (e.g. n_keys=64), got {item!r}")
    for exp in exps:
        fields = {f.name for f in dataclasses.fields(type(make_task(exp)))}
        unknown = sorted(set(out) - fields)
        if unknown:
            raise ValueError(f"--task: {exp} has no size {unknown}; expected one of {sorted(fields)}")
        make_task(exp, **out)  # the task's own checks (e.g. n_a + n_b <= n_keys)
    return out
