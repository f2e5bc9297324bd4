"""Mixture of experts: a token-routed MLP of ``E`` SwiGLU experts (``ModelConfig(mlp="moe")``).

Routing (top-k softmax gating, Shazeer et al. 2017; GShard, Lepikhin et al. 2020; Switch, Fedus et
al. 2021): for a token ``x`` (``[d]``) the router gives logits ``z = W_r x`` (``[E]``) and scores
``s = softmax(z)``. The token goes to the ``k`` experts with the largest selection scores
``s_e + b_e`` (``b`` is the balancing bias, zero unless ``bias_balancing``) and the output is

    y = Σ_{e ∈ TopK} w_e · E_e(x)  [+ σ(W_g x) · E_shared(x)]
    w_e = s_e                      (or s_e / Σ_{e' ∈ TopK} s_e' with ``norm_topk_prob``)
    E_e(x) = W_out[e] (silu(W_gate[e] x) ⊙ W_up[e] x)   (the SwiGLU of :mod:`mnemo.layers.mlp`)

The weights use the unbiased scores: the bias changes which experts are chosen, never how much
they count (DeepSeek-V3, §2.1.2, eq. 16).

Scores (``score=``): ``"softmax"`` (default, above) or ``"sigmoid"``, the affinities of
DeepSeek-V3 (Liu et al. 2024, §2.1.2, eq. 12–16): ``s_e = σ(z_e)`` (each expert scored alone, not
summing to 1), chosen by ``s_e + b_e``, and weighted by the unbiased ``s_e / Σ_{e' ∈ TopK} s_e'``
(``norm_topk_prob``, DeepSeek-V3's form) or ``s_e``. DeepSeek-V3's auxiliary-loss-free balancing is
``score="sigmoid", norm_topk_prob=True, bias_balancing=True``; its released router adds
``routed_scaling_factor=2.5, n_group=8, topk_group=4`` (below); its complementary sequence-wise
balance loss (eq. 17–20) is ``L_seq`` below (``seq_aux_loss_coef``, 1e-4 there). With sigmoid scores
``L_aux`` below uses the scores normalised over all experts, ``s_e / Σ_e' s_e'`` (DeepSeek-V3 eq.
19–20), for ``P``.

Routed scaling factor (``routed_scaling_factor = γ``, default 1: off; DeepSeek-V3's config
``routed_scaling_factor``, 2.5 there): the routed experts' combined output is multiplied by ``γ``,
``y = γ · Σ_{e ∈ TopK} w_e · E_e(x) [+ shared]`` — i.e. every routing weight ``w_e`` of eq. 13 (after
``norm_topk_prob``) becomes ``γ · w_e``; the shared expert is not scaled. ``hook_topk_weights`` shows
the scaled weights; ``L_aux`` and ``L_z`` do not depend on ``γ``.

Group-limited routing (``n_group = G``, ``topk_group = M``; default ``G = M = 1``: off; DeepSeek-V3
§2.1.2 "Node-Limited Routing", its config ``n_group``, ``topk_group``; with either ``score``): the
``E`` experts form ``G`` groups of ``E/G`` consecutive experts (expert ``e`` is in group
``e // (E/G)``); each group is scored by the sum of its two largest selection scores ``s_e + b_e`` (the
paper: the ``K_r / M`` highest affinities per node, ``8 / 4 = 2`` for DeepSeek-V3; its released code
fixes 2 (its inference code takes the largest score alone when it has no bias; here always 2); a
group of one expert: that expert's score), the token keeps its ``M`` best groups, and the
top-k choice runs over the experts of those groups only (the others are excluded, score ``−inf``;
as DeepSeek-V3's inference code and ``transformers``' ``DeepseekV3``; its Hugging Face modeling code
writes 0 there instead, which differs only where a kept expert's selection score is ≤ 0, e.g. under
a negative bias). With ``group_score="max"`` a group is scored by its largest selection score alone:
DeepSeek-V2's device-limited routing (DeepSeek-V2 §2.2.2, its config's ``topk_method`` =
``"group_limited_greedy"``; ``transformers``' ``DeepseekV2TopkRouter``, which masks the other groups'
scores to 0: the same choice where no kept expert's softmax score underflows to 0). Requires ``G | E``
and ``k ≤ M · E / G``. The weights are then those of eq. 13 over the chosen experts, unchanged. A
``hook_topk_indices`` replacement is not limited to the groups.

Ties: experts (and groups) with equal selection scores are chosen in ``torch.topk``'s order, the
call DeepSeek-V3's code and ``transformers`` make, so a converted checkpoint routes as they do.
torch promises no order among ties (on the CPU, torch 2.13, it takes experts 6 and 5 of 8 equal
scores); exact ties happen with a zero router (every expert alike) and with sigmoid scores that
underflow to 0 (logits below about −88 in float32). A fixed rule (the larger logit, then the lower
index, by stable sorts) was measured at 7–10× ``topk``'s selection time and would part from
``transformers`` on ties, so it is not used.

Losses (on the module after each forward, see :class:`MoE`):

* load balance (Switch Transformer eq. 4–6, generalised to top-k as in DeepSeekMoE, counting
  all ``k`` choices; GShard counts first choices only, and ``transformers``' Qwen/Mixtral loss is
  ``k`` times this value):
  ``L_aux = E · Σ_e f_e · P_e`` with ``f_e = (1 / (N k)) Σ_n Σ_j 1{idx[n, j] = e}`` (fraction of
  the ``N k`` assignments of the ``N`` tokens that go to ``e``) and ``P_e = (1/N) Σ_n s_e(x_n)``
  (mean router probability). It is 1 under uniform routing (``f = P = 1/E``), whenever ``P`` or
  ``f`` is uniform, and at most ``E / k`` (an expert takes at most one of a token's ``k`` choices,
  so ``f_e ≤ 1/k``), reached when every token's router is certain of one same expert (``E`` for
  top-1, ``E / 2`` for top-2: the second choices spread over experts of score 0; a
  ``hook_topk_indices`` replacement that repeats an expert lifts the ceiling to ``E``); it is not
  bounded below by 1 (``f`` counts choices, ``P`` averages scores: tokens that narrowly prefer
  one expert and a confident token for another give ``f = (2/3, 1/3)``, ``P ≈ (0.34, 0.66)``,
  ``L_aux ≈ 0.89``), and its gradient (through ``P`` only) lowers the scores of the busiest experts.
* router z-loss (ST-MoE, Zoph et al. 2022, eq. 5): ``L_z = (1/N) Σ_n (log Σ_e exp z_e(x_n))²``.
  With ``score="sigmoid"`` it is the same function of the logits ``z`` (not of the affinities): the
  softmax's normaliser does not enter the sigmoid scores, so it is no longer the stabiliser of a
  softmax router but a plain penalty on the logits, with gradient ``∂L_z/∂z_e = (2/N) · lse(z) ·
  softmax(z)_e``: while ``Σ_e exp z_e > 1`` it lowers every logit (most the largest), its minimum is at
  ``Σ_e exp z_e = 1`` (every affinity ``σ(z_e) < 1/2``: without ``norm_topk_prob`` that caps the
  routing weights), and it keeps the logits out of the sigmoid's saturation. DeepSeek-V3 uses no z-loss;
  ``z_loss_coef`` defaults to 0.
* sequence-wise balance (DeepSeek-V3 §2.1.2, "Complementary Sequence-Wise Auxiliary Loss", eq.
  17–20; weight ``seq_aux_loss_coef = α``, default 0: off; DeepSeek-V3 uses 1e-4): for each sequence
  of ``T`` tokens ``t`` and the ``E`` experts ``i``,
  ``L_Bal = α Σ_i f_i P_i`` (eq. 17),
  ``f_i = E / (k T) Σ_t 1{s_{i,t} ∈ TopK({s_{j,t}}_j, k)}`` (eq. 18),
  ``s'_{i,t} = s_{i,t} / Σ_j s_{j,t}`` (eq. 19), ``P_i = (1/T) Σ_t s'_{i,t}`` (eq. 20).
  ``last_seq_aux_loss`` is ``L_seq``, the **mean over the sequences** of ``Σ_i f_i P_i`` (without
  ``α``; 1 under uniform routing, like ``L_aux``), and :meth:`MoE.loss` adds ``seq_aux_loss_coef ·
  L_seq``. Decisions: eq. 18 counts the top-k of the **unbiased** scores ``s`` over all ``E``
  experts, as the paper writes it — not the routing's choice, which uses ``s + b`` and the group
  limit (and follows a ``hook_topk_indices`` replacement); without a bias, a group limit or such a
  hook the two are the same experts. A sequence is the second-to-last axis of ``x``: ``x [B, T, d]``
  (or ``[..., T, d]``: each index of the leading dims is a sequence) has ``B`` sequences of ``T``
  tokens; ``x [T, d]`` (no batch axis) is one sequence of ``T`` tokens, ``x [d]`` one of one token.
  In a language model a sequence is a row of the batch (packed documents are not told apart) and,
  under context parallelism, each rank's slice of that row. With softmax scores ``s' = s`` (they
  already sum to 1); with sigmoid scores eq. 19 normalises them. For one sequence whose routing is
  the unbiased top-k, ``L_seq = L_aux``; they differ when sequences are imbalanced in opposite
  ways: a batch balanced overall keeps ``L_aux`` near 1 while ``L_seq`` rises toward ``E / k``. As
  for ``L_aux`` the gradient flows through ``P`` only (``f`` counts choices).

Auxiliary-loss-free balancing (Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing Strategy for
Mixture-of-Experts", Alg. 1; DeepSeek-V3): a per-expert bias ``b`` (a buffer, no gradient) is added
to the scores for the top-k choice only, and after each optimizer step ``b_e ← b_e + u ·
sign(c̄ − c_e)`` with ``c_e`` the assignments expert ``e`` received in the step and ``c̄`` their
mean (:meth:`MoE.update_bias`; the trainer calls it).

Capacity: by default nothing is dropped — every token reaches its ``k`` experts. With
``capacity_factor = c`` each expert takes at most ``C = ceil(c · N k / E)`` assignments of a
training forward (``N`` tokens of the call); assignments are served first choices first (all
tokens' first choice, then their second, …), in token order within a choice (GShard's priority).
An assignment over capacity is *dropped*: its expert contribution is zero, so the residual stream
carries the token past this expert unchanged. Drops are counted in ``last_dropped`` and the trainer
logs them (``moe_dropped``). Evaluation and decoding (``module.eval()``) never drop, so cached
decoding equals the full forward pass.

Dispatch (``dispatch=``): ``"sorted"`` (default) sorts the assignments by expert, gathers the
tokens once (``index_select``), runs each expert on its contiguous slice (a loop over the ``E``
experts, not over tokens) and adds the weighted outputs back with ``index_add``;
``"padded"`` scatters the sorted tokens into an ``[E, C_max, d]`` buffer and runs all experts as
two batched matmuls (``bmm``); ``"fixed"`` is ``"padded"`` with a buffer whose size depends on
shapes only (``C_max`` = the capacity, or ``N`` without one), so that nothing is read back to the
host; ``"reference"`` runs every expert on every token and weights by the routing (dense, for
tests). All four give the same result.

On a device other than the CPU (CUDA, ``meta``) ``"sorted"`` and ``"padded"`` run as ``"fixed"``:
their slice lengths (``counts.tolist()``), ``C_max`` (``counts.max()``) and the removal of dropped
assignments (a boolean index) are each a host synchronisation per layer and forward. ``"fixed"``
keeps all ``k N`` assignments with the same shapes every call: a dropped one is written to a spare
row of the buffer and weighs 0. Without a capacity it computes ``E · N`` expert rows (as much as
``"reference"``, ``E / k`` times the routed work; ``E · k N`` while ``hook_topk_indices`` has a
hook, since a replaced routing may send a token to one expert more than once); with
``capacity_factor = c``, ``E · (C + 1)`` rows, about ``c · k · N``. The assignment counts are a
``scatter_add`` (``bincount``'s output size depends on the values). Measured (CPU, one thread,
float32, forward + backward, 4 shapes × 3 runs, ``scripts/moe_dispatch_bench.py``): ``sorted`` / ``padded``
time ratio 0.85–1.22, median 0.96 — neither consistently faster — and both 2.5–7× faster than
``reference``. ``sorted`` is the default because its work does not grow with imbalance
(``padded`` computes ``E × max_load`` rows); see ``docs/results/moe.md``.
"""

from __future__ import annotations

import math
import warnings
from fractions import Fraction
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import buffer_dtype
from .hooks import HookPoint
from .mlp import SwiGLU, swiglu_hidden

DISPATCH = ("sorted", "padded", "fixed", "reference")
SCORES = ("softmax", "sigmoid")
#: how a group of experts is scored for group-limited routing (``group_score=``)
GROUP_SCORES = ("top2", "max")

#: the options of :class:`MoE` that ``ModelConfig(mlp="moe", mlp_options=...)`` accepts, with
#: their defaults (``expert_hidden = None``: ``ModelConfig.mlp_hidden``, else the dense SwiGLU width)
MOE_OPTIONS: dict[str, Any] = {
    "n_experts": 8,
    "top_k": 2,
    "expert_hidden": None,
    "shared_expert_hidden": None,
    "shared_expert_gate": False,
    "norm_topk_prob": True,
    "capacity_factor": None,
    "aux_loss_coef": 0.01,
    "z_loss_coef": 0.0,
    "seq_aux_loss_coef": 0.0,
    "bias_balancing": False,
    "bias_update_rate": 1e-3,
    "dispatch": "sorted",
    "score": "softmax",
    "routed_scaling_factor": 1.0,
    "n_group": 1,
    "topk_group": 1,
    "group_score": "top2",
}


def _int(name, v, lo=1, hi=None):
    if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
        rng = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{name}: expected an int {rng}, got {v!r}")


def _num(name, v, positive=False):
    if (
        not isinstance(v, (int, float))
        or isinstance(v, bool)
        or not math.isfinite(v)
        or v < 0
        or (positive and v == 0)
    ):
        raise ValueError(f"{name}: expected a finite number {'> 0' if positive else '>= 0'}, got {v!r}")


def _bool(name, v):
    if not isinstance(v, bool):
        raise ValueError(f"{name}: expected True or False, got {v!r}")


def check_moe_options(options: dict[str, Any]) -> None:
    """Validate ``mlp_options`` for ``mlp="moe"`` (keys of :data:`MOE_OPTIONS`).

    Raises ``ValueError`` whose message starts with the offending key, then the expected and the
    received value (``"top_k: expected an int in [1, 4], got 5"``); an unknown key is named with the
    known ones."""
    unknown = sorted(set(options) - set(MOE_OPTIONS))
    if unknown:
        raise ValueError(f"{unknown[0]}: unknown MoE option; known options: {sorted(MOE_OPTIONS)}")
    o = {**MOE_OPTIONS, **options}
    _int("n_experts", o["n_experts"])
    _int("top_k", o["top_k"], 1, o["n_experts"])
    for name in ("expert_hidden", "shared_expert_hidden"):
        if o[name] is not None:
            _int(name, o[name])
    _bool("shared_expert_gate", o["shared_expert_gate"])
    if o["shared_expert_gate"] and o["shared_expert_hidden"] is None:
        raise ValueError(
            "shared_expert_gate: expected False without a shared expert (shared_expert_hidden=None), got True"
        )
    _bool("norm_topk_prob", o["norm_topk_prob"])
    if o["capacity_factor"] is not None:
        _num("capacity_factor", o["capacity_factor"], positive=True)
    _num("aux_loss_coef", o["aux_loss_coef"])
    _num("z_loss_coef", o["z_loss_coef"])
    _num("seq_aux_loss_coef", o["seq_aux_loss_coef"])
    _bool("bias_balancing", o["bias_balancing"])
    _num("bias_update_rate", o["bias_update_rate"], positive=True)
    if o["dispatch"] not in DISPATCH:
        raise ValueError(f"dispatch: expected one of {DISPATCH}, got {o['dispatch']!r}")
    if o["score"] not in SCORES:
        raise ValueError(f"score: expected one of {SCORES}, got {o['score']!r}")
    _num("routed_scaling_factor", o["routed_scaling_factor"], positive=True)
    E, G = o["n_experts"], o["n_group"]
    _int("n_group", G, 1, E)
    if E % G:
        raise ValueError(f"n_group: expected a divisor of n_experts = {E}, got {G}")
    _int("topk_group", o["topk_group"], 1, G)
    if o["group_score"] not in GROUP_SCORES:
        raise ValueError(f"group_score: expected one of {GROUP_SCORES}, got {o['group_score']!r}")
    if o["top_k"] > o["topk_group"] * (E // G):
        raise ValueError(
            f"top_k: expected at most topk_group · n_experts / n_group = {o['topk_group'] * (E // G)} "
            f"(the experts of the kept groups), got {o['top_k']}"
        )


def expert_load(indices: Tensor, n_experts: int) -> Tensor:
    """Fraction of the assignments per expert, ``[E]`` float32 summing to 1, from top-k indices
    ``[..., k]`` (e.g. a ``hook_topk_indices`` value read with ``run_with_cache``)."""
    counts = torch.bincount(indices.reshape(-1), minlength=n_experts).float()
    return counts / counts.sum().clamp_min(1)


class MoE(nn.Module):
    """Top-k routed mixture of SwiGLU experts, optional (gated) shared expert; see the module docstring
    for the equations and sources.

    ``forward(x [..., d_model]) -> y [..., d_model]`` in ``x``'s dtype (stateless; routing scores,
    weights and losses are computed in float32, float64 for a float64 model).

    Args:
        d_model: width. n_experts: ``E`` (default ``n_experts=8``). top_k: ``k`` experts per token
            (``1 ≤ k ≤ E``; default ``top_k=2``).
        expert_hidden: SwiGLU hidden width of each expert (default: the dense
            :func:`~mnemo.layers.mlp.swiglu_hidden`, i.e. each expert as large as the dense MLP).
        shared_expert_hidden: width of a shared SwiGLU expert every token goes through (``None``:
            none; Qwen2-MoE / Qwen3-Next / DeepSeekMoE). shared_expert_gate: scale the shared
            expert by ``σ(W_g x)`` (a learned scalar per token, as Qwen2-MoE / Qwen3-Next; default
            ``shared_expert_gate=False``).
        norm_topk_prob: renormalise the k chosen scores (softmax or sigmoid) to sum to 1 (default ``True``).
            With ``top_k=1`` that makes every routing weight 1, so the router learns from the
            auxiliary losses only, never from the task (a ``UserWarning`` at the first training forward
            with gradients says so, once per module; not at construction); Switch's top-1
            (Fedus et al. 2021, Eq. 2) scales by the unnormalised probability: ``norm_topk_prob=False``.
        capacity_factor: ``None`` (default, never drop) or ``c > 0``: at most ``ceil(c · N k / E)``
            assignments per expert in a training forward; overflow is dropped (zero contribution)
            and counted in ``last_dropped``.
        aux_loss_coef, z_loss_coef: weights of ``L_aux`` and ``L_z`` in :meth:`loss` (defaults
            ``aux_loss_coef=0.01``, ``z_loss_coef=0.0``).
        seq_aux_loss_coef: weight ``α`` of DeepSeek-V3's sequence-wise balance loss ``L_seq`` (eq.
            17–20, the module docstring) in :meth:`loss` (default ``seq_aux_loss_coef=0.0``: off;
            DeepSeek-V3: 1e-4); ``≥ 0`` and finite.
        bias_balancing: keep the auxiliary-loss-free bias (buffer ``expert_bias [E]``, float32,
            also through a cast of the module to half precision; float64 in a float64 module, built so
            or cast)
            and use it for the top-k choice (default ``False``). bias_update_rate: its step ``u``
            (default ``bias_update_rate=1e-3``).
        dispatch: ``"sorted"`` | ``"padded"`` | ``"fixed"`` | ``"reference"`` (same results; see
            the module docstring; off the CPU ``"sorted"`` and ``"padded"`` run as ``"fixed"``).
        score: ``"softmax"`` (default ``score="softmax"``) or ``"sigmoid"`` (DeepSeek-V3's
            affinities ``σ(z_e)``; see the module docstring).
        routed_scaling_factor: ``γ > 0`` multiplying the routed experts' combined output (every
            routing weight), not the shared expert (default ``routed_scaling_factor=1.0``: off;
            DeepSeek-V3: 2.5).
        n_group, topk_group: group-limited routing, DeepSeek-V3 §2.1.2 (the module docstring): ``E``
            experts in ``n_group`` groups of consecutive experts, each token chooses among the
            experts of its ``topk_group`` best groups (scored by the sum of their two largest
            selection scores); ``n_group`` divides ``E``, ``1 ≤ topk_group ≤ n_group``, ``top_k ≤
            topk_group · E / n_group`` (defaults ``n_group=1``, ``topk_group=1``: off; DeepSeek-V3: 8, 4).
        group_score: ``"top2"`` (default ``group_score="top2"``: a group scores the sum of its two
            largest selection scores, DeepSeek-V3) or ``"max"`` (its largest alone, DeepSeek-V2's
            ``group_limited_greedy``); used only while ``topk_group < n_group``.

    Parameters: ``router.weight [E, d]``; ``w_in [E, 2H, d]`` (per expert ``[W_gate; W_up]``, the
    layout of :class:`~mnemo.layers.mlp.SwiGLU`'s ``w_in``), ``w_out [E, d, H]``;
    ``shared_expert`` (a :class:`SwiGLU`) and ``shared_gate.weight [1, d]`` when configured.

    Hook points (``B, T`` = the leading dims of ``x``): ``hook_router_logits [B, T, E]`` (a
    replacement changes scores, choice and weights), ``hook_topk_indices [B, T, k]`` long (the
    chosen experts, best first; a replacement forces the routing and the weights follow it),
    ``hook_topk_weights [B, T, k]`` (the mixing weights of those experts, after dropping: a dropped
    assignment has weight 0), ``hook_shared_out [B, T, d]`` (the shared expert's gated output; only
    with a shared expert). Loads per expert: :func:`expert_load` of the indices, or ``last_load``.

    After each forward the module holds: ``last_aux_loss``, ``last_z_loss`` and
    ``last_seq_aux_loss`` (0-d tensors with their graph, for the training loss; the last one computed
    whatever its weight), ``last_load [E]`` (fraction of assignments, detached), ``last_counts [E]``
    long (assignments per expert before dropping), ``last_dropped`` (0-d long, dropped
    assignments). :meth:`loss` is ``aux_loss_coef · L_aux + z_loss_coef · L_z + seq_aux_loss_coef ·
    L_seq``.

    Raises:
        ValueError: an option is out of range (naming it, expected vs received), or ``x``'s last
            dimension is not ``d_model``.
    """

    def __init__(
        self,
        d_model: int,
        n_experts: int = 8,
        top_k: int = 2,
        expert_hidden: int | None = None,
        shared_expert_hidden: int | None = None,
        shared_expert_gate: bool = False,
        norm_topk_prob: bool = True,
        capacity_factor: float | None = None,
        aux_loss_coef: float = 0.01,
        z_loss_coef: float = 0.0,
        seq_aux_loss_coef: float = 0.0,
        bias_balancing: bool = False,
        bias_update_rate: float = 1e-3,
        dispatch: str = "sorted",
        score: str = "softmax",
        routed_scaling_factor: float = 1.0,
        n_group: int = 1,
        topk_group: int = 1,
        group_score: str = "top2",
    ):
        super().__init__()
        _int("d_model", d_model)
        check_moe_options(
            dict(
                n_experts=n_experts,
                top_k=top_k,
                expert_hidden=expert_hidden,
                shared_expert_hidden=shared_expert_hidden,
                shared_expert_gate=shared_expert_gate,
                norm_topk_prob=norm_topk_prob,
                capacity_factor=capacity_factor,
                aux_loss_coef=aux_loss_coef,
                z_loss_coef=z_loss_coef,
                seq_aux_loss_coef=seq_aux_loss_coef,
                bias_balancing=bias_balancing,
                bias_update_rate=bias_update_rate,
                dispatch=dispatch,
                score=score,
                routed_scaling_factor=routed_scaling_factor,
                n_group=n_group,
                topk_group=topk_group,
                group_score=group_score,
            )
        )
        H = expert_hidden or swiglu_hidden(d_model)
        self.d_model, self.n_experts, self.top_k, self.hidden = d_model, n_experts, top_k, H
        self.norm_topk_prob, self.capacity_factor = norm_topk_prob, capacity_factor
        # top_k=1 with norm_topk_prob: warned at the first training forward (_warn_top1), not here:
        # a model built to run (an imported Qwen3-Next, a checkpoint loaded for eval) is not trained
        self._top1_warned = False
        self.aux_loss_coef, self.z_loss_coef = float(aux_loss_coef), float(z_loss_coef)
        self.seq_aux_loss_coef = float(seq_aux_loss_coef)
        self.bias_balancing, self.bias_update_rate = bias_balancing, float(bias_update_rate)
        self.dispatch, self.score = dispatch, score
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.n_group, self.topk_group, self.group_score = n_group, topk_group, group_score
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.w_in = nn.Parameter(torch.empty(n_experts, 2 * H, d_model))
        self.w_out = nn.Parameter(torch.empty(n_experts, d_model, H))
        self.shared_expert = SwiGLU(d_model, shared_expert_hidden) if shared_expert_hidden else None
        self.shared_gate = nn.Linear(d_model, 1, bias=False) if shared_expert_gate else None
        if bias_balancing:
            self.register_buffer("expert_bias", torch.zeros(n_experts, dtype=buffer_dtype()))
        else:
            self.expert_bias = None
        self.hook_router_logits = HookPoint()
        self.hook_topk_indices = HookPoint()
        self.hook_topk_weights = HookPoint()
        if self.shared_expert is not None:  # no point that would never fire
            self.hook_shared_out = HookPoint()
        self.init_weights()
        self.last_aux_loss: Tensor | None = None
        self.last_z_loss: Tensor | None = None
        self.last_seq_aux_loss: Tensor | None = None
        self.last_load: Tensor | None = None
        self.last_counts: Tensor | None = None
        self.last_dropped: Tensor | None = None

    def init_weights(self, std: float = 0.02, out_std: float | None = None) -> None:
        """Normal(0, ``std``) router, expert inputs and shared gate; normal(0, ``out_std``) (default
        ``std``) expert and shared-expert outputs (the language model passes its residual scaling).
        Default ``std=0.02``."""
        out_std = std if out_std is None else out_std
        nn.init.normal_(self.router.weight, std=std)
        nn.init.normal_(self.w_in, std=std)
        nn.init.normal_(self.w_out, std=out_std)
        if self.shared_expert is not None:
            nn.init.normal_(self.shared_expert.w_in.weight, std=std)
            nn.init.normal_(self.shared_expert.w_out.weight, std=out_std)
        if self.shared_gate is not None:
            nn.init.normal_(self.shared_gate.weight, std=std)

    @property
    def capacity_factor(self) -> float | None:
        return self._capacity_factor

    @capacity_factor.setter
    def capacity_factor(self, c: float | None) -> None:
        # the decimal the user wrote as an exact ratio of ints (1.1 · 100 / 2 is 55.000000000000007
        # in floats), taken here once: the forward's ceiling is then int arithmetic, which
        # torch.compile traces (``str`` of a float is a graph break, an error under fullgraph)
        self._capacity_factor = c
        self._capacity_ratio = None if c is None else Fraction(str(c)).as_integer_ratio()

    def _apply(self, fn, recurse=True):
        # move the balancing bias with the module, but keep it in float32 through a cast to half
        # precision (``model.to(torch.bfloat16)``): in bf16 a step ``u = 1e-3`` on a bias of 0.5 or
        # more rounds away (spacing 2⁻⁸) and the balancing silently stops
        kept = self.expert_bias
        super()._apply(fn, recurse)
        if kept is not None and self.expert_bias.dtype not in (torch.float32, torch.float64):
            self.expert_bias = kept.to(self.expert_bias.device, torch.float32)
        return self

    def __getstate__(self):
        # a copy (``copy.deepcopy``, pickling) keeps the last losses' values, not their graph: a
        # non-leaf tensor cannot be deep-copied, so a model copied after a training forward failed
        state = super().__getstate__()
        for name in ("last_aux_loss", "last_z_loss", "last_seq_aux_loss"):
            if state.get(name) is not None:
                state = {**state, name: state[name].detach()}
        return state

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, n_experts={self.n_experts}, top_k={self.top_k}, hidden={self.hidden}, "
            f"capacity_factor={self.capacity_factor}, bias_balancing={self.bias_balancing}, "
            f"dispatch={self.dispatch!r}, score={getattr(self, 'score', 'softmax')!r}"
            + (f", routed_scaling_factor={self.routed_scaling_factor}" if self._scale() != 1.0 else "")
            + (f", n_group={self.n_group}, topk_group={self.topk_group}" if self._grouped() else "")
            + (f", group_score={self.group_score!r}" if self._grouped() and self._group_max() else "")
            + (f", seq_aux_loss_coef={self._seq_coef()}" if self._seq_coef() else "")
        )

    # modules pickled before these options existed have none: off
    def _scale(self) -> float:
        return getattr(self, "routed_scaling_factor", 1.0)

    def _grouped(self) -> bool:
        return getattr(self, "topk_group", 1) < getattr(self, "n_group", 1)

    def _group_max(self) -> bool:
        return getattr(self, "group_score", "top2") == "max"

    def _seq_coef(self) -> float:
        return getattr(self, "seq_aux_loss_coef", 0.0)

    # ------------------------------------------------------------------------------------------
    def loss(self) -> Tensor:
        """``aux_loss_coef · L_aux + z_loss_coef · L_z + seq_aux_loss_coef · L_seq`` of the last
        forward (0-d, with its graph; the last term only when ``seq_aux_loss_coef > 0``). Raises
        ``RuntimeError`` before any forward."""
        if self.last_aux_loss is None:
            raise RuntimeError("MoE.loss: no forward pass has run yet")
        total = self.aux_loss_coef * self.last_aux_loss + self.z_loss_coef * self.last_z_loss
        if self._seq_coef():
            total = total + self._seq_coef() * self.last_seq_aux_loss
        return total

    @torch.no_grad()
    def update_bias(self, counts: Tensor | None = None) -> None:
        """One auxiliary-loss-free balancing step ``b_e ← b_e + u · sign(c̄ − c_e)`` (Wang et al.
        2024, Alg. 1): ``counts [E]`` = assignments per expert since the last step (default: the
        last forward's ``last_counts``). Raises ``RuntimeError`` without ``bias_balancing``,
        ``ValueError`` for counts of another shape."""
        if self.expert_bias is None:
            raise RuntimeError("MoE.update_bias: the layer was built with bias_balancing=False")
        if counts is None:
            counts = self.last_counts
        if counts is None:
            return
        if tuple(counts.shape) != (self.n_experts,):
            raise ValueError(f"counts: expected shape [{self.n_experts}], got {list(counts.shape)}")
        # sign(c̄ − c_e) = sign(Σ c − E c_e), exact in long or float64 (the trainer's sums): in
        # float32 counts above 2²⁴ (large steps) round, and near-balanced experts got no step or
        # one in the wrong direction; float16 / bfloat16 / float32 counts are widened first (their
        # sum and E · c_e round, or overflow to inf − inf: no step at all)
        c = counts.double() if counts.is_floating_point() else counts.long()
        step = torch.sign(c.sum() - self.n_experts * c)
        self.expert_bias.add_(
            self.bias_update_rate * step.to(self.expert_bias.device, self.expert_bias.dtype)
        )

    # ------------------------------------------------------------------------------------------
    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Router logits ``[N, E]`` (through ``hook_router_logits``), scores ``softmax(logits)``
        (``sigmoid(logits)`` with ``score="sigmoid"``; float32/float64) and the chosen
        experts ``[N, k]`` (through ``hook_topk_indices``; within the ``topk_group`` best groups
        when ``n_group > topk_group``) of tokens ``x [..., d]`` (flattened to ``N``)."""
        lead = x.shape[:-1]
        logits = self.hook_router_logits(self.router(x))
        cd = torch.promote_types(logits.dtype, torch.float32)
        if getattr(self, "score", "softmax") == "sigmoid":
            scores = torch.sigmoid(logits.to(cd))
        else:
            scores = torch.softmax(logits.to(cd), dim=-1)
        sel = scores if self.expert_bias is None else scores + self.expert_bias.to(cd)
        if self._grouped():
            sel = self._limit_groups(sel)
        idx = sel.topk(self.top_k, dim=-1).indices
        idx = self.hook_topk_indices(idx)
        if idx.shape != (*lead, self.top_k) or idx.dtype != torch.long:
            raise ValueError(
                f"hook_topk_indices: expected a long tensor {[*lead, self.top_k]}, "
                f"got {idx.dtype} {list(idx.shape)}"
            )
        E = self.n_experts
        if self.hook_topk_indices.hooked and idx.numel():  # a replacement: its experts must exist
            lo, hi = int(idx.min()), int(idx.max())
            if lo < 0 or hi >= E:
                raise ValueError(
                    f"hook_topk_indices: expected expert indices in [0, {E - 1}] (n_experts = {E}), "
                    f"got values from {lo} to {hi}"
                )
        return logits.reshape(-1, E), scores.reshape(-1, E), idx.reshape(-1, self.top_k)

    def _limit_groups(self, sel: Tensor) -> Tensor:
        """Group-limited routing (DeepSeek-V3 §2.1.2): selection scores ``[..., E]`` with the experts
        outside each token's ``topk_group`` best groups set to ``−inf``; a group (``E / n_group``
        consecutive experts) scores the sum of its two largest selection scores (its largest alone
        with ``group_score="max"``)."""
        G, m = self.n_group, self.n_experts // self.n_group
        if self._group_max():  # DeepSeek-V2's group_limited_greedy
            group_score = sel.unflatten(-1, (G, m)).amax(-1)  # [..., G]
        else:
            group_score = sel.unflatten(-1, (G, m)).topk(min(2, m), dim=-1).values.sum(-1)  # [..., G]
        best = group_score.topk(self.topk_group, dim=-1).indices
        kept = torch.zeros_like(group_score, dtype=torch.bool).scatter(-1, best, True)
        return sel.masked_fill(~kept.repeat_interleave(m, dim=-1), float("-inf"))

    def _warn_top1(self) -> None:
        """Once per module, in a training forward that records gradients for the router."""
        if not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return
        if not any(p.requires_grad for p in self.router.parameters()):
            return
        self._top1_warned = True
        warnings.warn(
            "MoE: top_k=1 with norm_topk_prob=True gives every token the routing weight 1, so the "
            "router gets no gradient from the task (only from the auxiliary losses); Switch's top-1 "
            "scales by the router probability: pass norm_topk_prob=False",
            UserWarning,
            stacklevel=3,
        )

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.d_model:
            raise ValueError(f"x: expected [..., d_model = {self.d_model}], got {list(x.shape)}")
        lead = x.shape[:-1]
        xf = x.reshape(-1, self.d_model)
        N, E, k = xf.shape[0], self.n_experts, self.top_k
        if k == 1 and self.norm_topk_prob and self.training and not getattr(self, "_top1_warned", False):
            self._warn_top1()
        logits, scores, idx = self.route(x)
        sigmoid = getattr(self, "score", "softmax") == "sigmoid"
        if self.norm_topk_prob:
            # s_e / Σ_TopK s_e' = the softmax of the chosen logits (of the chosen log σ(z) for
            # sigmoid scores): the same value, but never 0 / 0 where the chosen scores underflow
            # (the balancing bias may choose experts of score 0)
            chosen = logits.to(scores.dtype).gather(-1, idx)
            w = torch.softmax(F.logsigmoid(chosen) if sigmoid else chosen, dim=-1)
        else:
            w = scores.gather(-1, idx)  # [N, k], unbiased scores of the chosen experts
        if self._scale() != 1.0:
            w = w * self._scale()  # DeepSeek-V3's routed_scaling_factor: γ · Σ w_e E_e(x)

        # assignments in priority order: all first choices (token order), then all second, ...
        expert = idx.t().reshape(-1)  # [k N]
        token = torch.arange(N, device=x.device).repeat(k)
        # assignments per expert: a fixed-shape scatter (bincount's size depends on the values)
        counts = torch.zeros(E, dtype=torch.long, device=x.device).scatter_add_(
            0, expert, torch.ones_like(expert)
        )
        order = torch.argsort(expert, stable=True)
        e_sorted, t_sorted = expert[order], token[order]
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.arange(k * N, device=x.device) - starts[e_sorted]  # rank within its expert
        keep = None
        capacity = None
        if self.capacity_factor is not None and self.training and N > 0:
            # ceil(c · N k / E) exactly for the decimal c the user wrote (see ``capacity_factor``)
            num, den = self._capacity_ratio
            capacity = -(-num * N * k // (den * E))
            keep_sorted = slot < capacity
            keep = torch.empty_like(keep_sorted)
            keep[order] = keep_sorted
            w = w * keep.reshape(k, N).t().to(w.dtype)  # dropped assignments weigh 0
        w = self.hook_topk_weights(w.reshape(*lead, k)).reshape(N, k)
        w_sorted = w.t().reshape(-1)[order]

        dispatch = self.dispatch
        if x.device.type != "cpu" and dispatch in ("sorted", "padded"):
            dispatch = "fixed"  # no host read: see the module docstring
        if dispatch == "reference":
            y = self._dense(xf, idx, w)
        elif dispatch == "fixed":
            # every assignment stays (fixed shapes); a dropped one (slot >= capacity, weight 0)
            # goes to the spare row ``capacity`` of the buffer. top-k never picks an expert twice
            # for a token (at most N per expert), but a replaced routing may: then up to k N
            rows = N * k if self.hook_topk_indices.hooked else N
            c_max = rows if capacity is None else capacity + 1
            kept = None if keep is None else keep_sorted
            y = self._padded(xf, e_sorted, t_sorted, slot.clamp(max=c_max - 1), w_sorted, c_max, kept)
        else:
            if keep is not None:
                kept = keep_sorted
                e_sorted, t_sorted, slot, w_sorted = (
                    e_sorted[kept],
                    t_sorted[kept],
                    slot[kept],
                    w_sorted[kept],
                )
                counts_kept = torch.bincount(e_sorted, minlength=E)
            else:
                counts_kept = counts
            if dispatch == "sorted":
                y = self._sorted(xf, t_sorted, w_sorted, counts_kept)
            else:
                c_max = capacity if capacity is not None else int(counts_kept.max()) if N else 0
                y = self._padded(xf, e_sorted, t_sorted, slot, w_sorted, c_max)
        if self.shared_expert is not None:
            s = self.shared_expert(xf)
            if self.shared_gate is not None:
                s = torch.sigmoid(self.shared_gate(xf)) * s
            y = y + self.hook_shared_out(s.reshape(*lead, self.d_model)).reshape(N, self.d_model)

        # statistics and auxiliary losses (Switch eq. 4–6 generalised to top-k; ST-MoE eq. 5)
        f = counts.to(scores.dtype) / max(N * k, 1)
        probs = (
            scores / scores.sum(-1, keepdim=True).clamp_min(torch.finfo(scores.dtype).tiny)
            if sigmoid
            else scores
        )
        P = probs.mean(0) if N else scores.new_zeros(E)
        self.last_aux_loss = E * (f * P).sum()
        self.last_seq_aux_loss = self._seq_balance(x, scores, probs)
        z = torch.logsumexp(logits.to(scores.dtype), dim=-1)
        self.last_z_loss = (z**2).mean() if N else scores.new_zeros(())
        self.last_counts = counts.detach()
        self.last_load = f.detach().float()
        self.last_dropped = (
            (~keep).sum() if keep is not None else torch.zeros((), dtype=torch.long, device=x.device)
        )
        return y.reshape(*lead, self.d_model)

    def _seq_balance(self, x: Tensor, scores: Tensor, probs: Tensor) -> Tensor:
        """``L_seq``: DeepSeek-V3's sequence-wise balance loss (eq. 17–20) without ``α``, the mean
        over the sequences of ``Σ_i f_i P_i``. ``scores``/``probs`` ``[N, E]`` are the unbiased scores
        ``s`` and ``s'`` (eq. 19; ``probs is scores`` for softmax) of ``x [..., T, d]``'s ``N``
        tokens; the sequences are ``x``'s second-to-last axis (``x [T, d]``: one; ``x [d]``: one
        token). ``f`` counts the top-k of the unbiased ``s`` (eq. 18), not the routing's choice."""
        E, k = self.n_experts, self.top_k
        T = x.shape[-2] if x.dim() >= 2 else 1
        N = scores.shape[0]
        if N == 0:
            return scores.new_zeros(())
        S = N // T
        top = scores.detach().topk(k, dim=-1).indices.reshape(S, T * k)  # eq. 18, unbiased top-k
        counts = scores.new_zeros(S, E).scatter_add_(1, top, scores.new_ones(S, T * k))
        f = counts * (E / (k * T))  # eq. 18: [S, E]
        P = probs.reshape(S, T, E).mean(1)  # eq. 19–20: [S, E]
        return (f * P).sum(-1).mean()  # eq. 17 per sequence (α apart), mean over sequences

    # ------------------------------------------------------------------------------------------
    def _expert(self, h: Tensor, e: int) -> Tensor:
        gate, up = F.linear(h, self.w_in[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.w_out[e])

    def _sorted(self, xf: Tensor, t_sorted: Tensor, w_sorted: Tensor, counts: Tensor) -> Tensor:
        """Tokens gathered once in expert order; each expert on its contiguous slice; weighted
        outputs added back per token (``index_add``)."""
        xs = xf.index_select(0, t_sorted)
        parts = []
        for e, (lo, n) in enumerate(_slices(counts)):
            if n:
                parts.append(self._expert(xs[lo : lo + n], e))
        ys = torch.cat(parts) if parts else xs
        ys = ys * w_sorted.to(ys.dtype)[:, None]
        # under autocast the experts' matmuls return bf16: summed into the input's dtype
        return xf.new_zeros(xf.shape).index_add(0, t_sorted, ys.to(xf.dtype))

    def _padded(self, xf, e_sorted, t_sorted, slot, w_sorted, c_max: int, kept=None) -> Tensor:
        """Sorted tokens scattered into ``[E, C_max, d]``; all experts as two ``bmm``. With
        ``kept`` (``"fixed"`` under a capacity: ``[k N]`` bool, sorted order) the dropped
        assignments share the spare row ``C_max − 1`` as zeros (``accumulate``, deterministic), so
        the row's output is SwiGLU(0) = 0 and it is read back with weight 0 — never a sum of many
        tokens that could overflow to ``inf`` (``0 · inf`` would be NaN) in half precision."""
        E, d = self.n_experts, self.d_model
        buf = xf.new_zeros(E, c_max, d)
        src = xf.index_select(0, t_sorted)
        if kept is not None:
            src = src * kept.to(src.dtype)[:, None]
        buf = buf.index_put((e_sorted, slot), src, accumulate=kept is not None)
        gate, up = torch.bmm(buf, self.w_in.transpose(1, 2)).chunk(2, dim=-1)
        out = torch.bmm(F.silu(gate) * up, self.w_out.transpose(1, 2))  # [E, C_max, d]
        ys = out[e_sorted, slot] * w_sorted.to(out.dtype)[:, None]
        # under autocast the experts' matmuls return bf16: summed into the input's dtype
        return xf.new_zeros(xf.shape).index_add(0, t_sorted, ys.to(xf.dtype))

    def _dense(self, xf: Tensor, idx: Tensor, w: Tensor) -> Tensor:
        """Every expert on every token (``[N, E, d]``), mixed by the routing weights (zero for
        experts not chosen or dropped): the reference the fast paths are tested against."""
        mix = w.new_zeros(xf.shape[0], self.n_experts).scatter_add(1, idx, w)
        gate, up = torch.einsum("nd,ehd->neh", xf, self.w_in).chunk(2, dim=-1)
        out = torch.einsum("neh,edh->ned", F.silu(gate) * up, self.w_out)
        return torch.einsum("ne,ned->nd", mix.to(out.dtype), out)


def _slices(counts: Tensor) -> list[tuple[int, int]]:
    """``(start, length)`` of each expert's run in the sorted assignments (one host transfer)."""
    out, lo = [], 0
    for n in counts.tolist():
        out.append((lo, n))
        lo += n
    return out


def moe_reference(module: MoE, x: Tensor) -> Tensor:
    """``module(x)`` computed densely (every expert on every token, weighted by the routing) —
    the reference of the tests; same statistics and hooks as the fast forward."""
    saved = module.dispatch
    module.dispatch = "reference"
    try:
        return module(x)
    finally:
        module.dispatch = saved
