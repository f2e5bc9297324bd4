"""The outer optimizer of a training run and its learning-rate schedule: AdamW (or M3) with
weight decay on matrices only, per-module learning-rate scales (``outer_lr_scale``), and linear
warm-up then cosine decay. Used by the trainer, the sharded-checkpoint reader and the continual
experiments (:mod:`mnemo.commands.continual`); a module of its own so that none of them imports
another for it.

``optimizer="m3_paper"`` runs Nested Learning's Algorithm 1 alone (:class:`mnemo.train.m3.M3`
with no weight decay, no gradient clipping, a constant learning rate and accumulating momenta);
``"m3"`` is the same update with the trainer's additions (decoupled weight decay on matrices,
clipping, warm-up + cosine), which :func:`describe_optimizer` lists in the run's log."""

from __future__ import annotations

import math
import warnings

import torch

from .config import TrainConfig
from .m3 import M3


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to ``min_ratio`` at ``total``; from
    ``total`` on, ``min_ratio`` (also when the warm-up is longer than the schedule and never ended:
    a held schedule, ``--reschedule hold``, stops there and does not keep warming up)."""
    if step >= total:
        return min_ratio
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def algorithm1_only(cfg: TrainConfig) -> bool:
    """Whether ``cfg`` runs M3 as Algorithm 1 alone (``optimizer="m3_paper"``)."""
    return cfg.optimizer == "m3_paper"


def schedule_factor(cfg: TrainConfig, step: int) -> float:
    """The learning rate at ``step`` over ``cfg.lr``: :func:`lr_factor` of ``cfg``'s warm-up +
    cosine, or ``1`` throughout for ``m3_paper`` (Algorithm 1's ``η`` is a constant)."""
    if algorithm1_only(cfg):
        return 1.0
    return lr_factor(step, cfg.warmup_steps, cfg.cosine_steps, cfg.min_lr_ratio)


def grad_clip(cfg: TrainConfig) -> float:
    """The global gradient-norm clip the trainer applies (``0``: none, always for ``m3_paper``)."""
    return 0.0 if algorithm1_only(cfg) else cfg.grad_clip


def describe_optimizer(cfg: TrainConfig) -> str:
    """One line for the run's log: the optimizer and, for M3, what is added to Algorithm 1 (or
    that nothing is, for ``m3_paper``)."""
    if cfg.optimizer == "adamw":
        return (
            f"optimizer: AdamW (betas {cfg.beta1:g}, {cfg.beta2:g}; weight decay {cfg.weight_decay:g} on "
            f"matrices; clip {cfg.grad_clip:g}; warm-up {cfg.warmup_steps} + cosine to "
            f"{cfg.min_lr_ratio:g}·lr)"
        )
    m3 = (
        f"M3, Nested Learning Algorithm 1 (betas {cfg.beta1:g}, {cfg.beta2:g}, {cfg.m3_beta3:g}; "
        f"alpha {cfg.m3_alpha:g}; f = {cfg.m3_slow_every}; {cfg.m3_ns_steps} Newton-Schulz steps; "
        f"eps {cfg.m3_eps:g})"
    )
    if algorithm1_only(cfg):
        return f"optimizer: m3_paper = {m3} alone: constant lr {cfg.lr:g}, no weight decay, clipping or EMA"
    added = []
    if cfg.weight_decay > 0:
        added.append(f"decoupled weight decay {cfg.weight_decay:g} on matrices")
    if cfg.grad_clip > 0:
        added.append(f"gradient clipping at norm {cfg.grad_clip:g}")
    added.append(f"warm-up {cfg.warmup_steps} + cosine to {cfg.min_lr_ratio:g}·lr (Algorithm 1: constant lr)")
    if cfg.m3_ema:
        added.append("exponential moving averages (Algorithm 1: accumulating sums)")
    return f"optimizer: {m3} + {'; '.join(added)} (--optimizer m3_paper runs Algorithm 1 alone)"


def _outer_lr_scales(model: torch.nn.Module) -> dict[int, float]:
    """``id(parameter) -> scale`` for the parameters of modules with an ``outer_lr_scale``
    attribute (``None`` = no scale); a module nested in another takes its own (innermost) scale."""
    scales: dict[int, float] = {}
    for name, module in model.named_modules():  # pre-order: children after their parents
        scale = getattr(module, "outer_lr_scale", None)
        if scale is None:
            continue
        where = f"{type(module).__name__} {name or '(root)'!r}"
        if not isinstance(scale, (int, float)) or isinstance(scale, bool):
            raise TypeError(f"{where}: outer_lr_scale: expected a float, got {scale!r}")
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"{where}: outer_lr_scale: expected a finite number > 0, got {scale!r}")
        for p in module.parameters():
            scales[id(p)] = float(scale)
    return scales


def _no_weight_decay(model: torch.nn.Module) -> set[int]:
    """``id``s of the parameters a module names in its ``no_weight_decay`` attribute (names of its
    own parameters; one it lacks is skipped): the state-space parameters that the reference code
    keeps out of weight decay (mamba-ssm's ``_no_weight_decay`` on Mamba's ``A_log`` and ``D``,
    Mamba-2's and fla's Gated DeltaNet's ``A_log``, ``dt_bias``, ``D``). Read by name, so it holds
    after FSDP2 replaced the parameters by sharded ones. The attribute may also be a method that
    returns the names (timm's convention) or one name as a string."""
    out: set[int] = set()
    for module in model.modules():
        names = getattr(module, "no_weight_decay", ())
        names = names() if callable(names) else names
        for name in (names,) if isinstance(names, str) else names:
            p = module._parameters.get(name)
            if p is not None:
                out.add(id(p))
    return out


def _param_groups(model: torch.nn.Module, exempt: set[int]) -> list[tuple[list, bool, float]]:
    """``(params, decayed, lr scale)`` of :func:`make_optimizer`'s groups, in order: the decayed
    (``ndim >= 2``, not in ``exempt``) and the other parameters at scale 1, then the two of each
    ``outer_lr_scale`` (those that hold parameters)."""
    scales = _outer_lr_scales(model)
    decay, no_decay, seen = [], [], set()
    scaled: dict[float, tuple[list, list]] = {}
    for p in model.parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        scale = scales.get(id(p), 1.0)
        d, nd = (decay, no_decay) if scale == 1.0 else scaled.setdefault(scale, ([], []))
        (d if p.ndim >= 2 and id(p) not in exempt else nd).append(p)
    groups = [(decay, True, 1.0), (no_decay, False, 1.0)]
    for scale, (d, nd) in scaled.items():
        groups += [(params, decayed, scale) for params, decayed in ((d, True), (nd, False)) if params]
    return groups


def match_saved_groups(
    optimizer: torch.optim.Optimizer, model: torch.nn.Module, saved: dict, absent=frozenset()
) -> bool:
    """Before ``optimizer.load_state_dict(saved)`` on resume: a checkpoint written before
    :func:`make_optimizer` read ``no_weight_decay`` holds Mamba-1's 2-D ``A_log`` in the decayed
    group, so its groups hold other numbers of parameters than ``optimizer``'s and torch refuses
    it. When ``saved``'s group sizes are those of that grouping, ``optimizer``'s groups take it (the
    resumed run decays those parameters as its first steps did: the run it continues, bit for
    bit), with a warning; returns whether it did. ``absent``: names of the model's parameters the
    checkpoint lacks (:func:`load_with_fresh`, which then loads ``saved``): its groups are counted
    without them (a checkpoint from before both changes, e.g. of a Mamba-1 + TTT hybrid)."""
    names = {id(p): n for n, p in model.named_parameters()}

    def count(params) -> int:
        return sum(names.get(id(p)) not in absent for p in params)

    sizes = [len(g["params"]) for g in saved.get("param_groups", [])]
    if sizes == [count(g["params"]) for g in optimizer.param_groups]:
        return False
    before = _param_groups(model, exempt=set())
    if sizes != [count(params) for params, _, _ in before] or len(before) != len(optimizer.param_groups):
        return False  # (not that grouping: torch's own error follows)
    moved = {id(p) for params, decayed, _ in before if decayed for p in params}
    moved -= {
        id(p)
        for params, decayed, _ in _param_groups(model, _no_weight_decay(model))
        if decayed
        for p in params
    }
    for group, (params, _, _) in zip(optimizer.param_groups, before):
        group["params"][:] = params
    names = [n for n, p in model.named_parameters() if id(p) in moved]
    shown = ", ".join(names[:3]) + (f", … ({len(names)} in all)" if len(names) > 3 else "")
    warnings.warn(
        f"the checkpoint was written before {shown} (no_weight_decay) were kept out of weight decay: "
        "the resumed run decays them as it was trained (a new run does not)",
        stacklevel=2,
    )
    return True


def load_with_fresh(optimizer: torch.optim.Optimizer, model: torch.nn.Module, saved: dict, absent) -> bool:
    """``optimizer.load_state_dict(saved)`` on resume, where ``absent`` names the model's parameters
    that the checkpoint's weights lacked (added since it was written and filled on load, e.g. the
    TTT memory's ``inner_norm_weight``/``inner_norm_bias``, :class:`~mnemo.layers.NeuralMemory`):
    when ``saved``'s groups are ``optimizer``'s without them, the rest load their saved state and
    those start with fresh optimizer state, with a one-line warning; returns whether it did so
    (otherwise it loads ``saved`` as it is: torch names a misfit)."""
    names = {id(p): n for n, p in model.named_parameters()}
    fresh = [[p for p in g["params"] if names.get(id(p)) in absent] for g in optimizer.param_groups]
    sizes = [len(g["params"]) for g in saved.get("param_groups", [])]
    want = [len(g["params"]) - len(f) for g, f in zip(optimizer.param_groups, fresh)]
    if not any(fresh) or sizes != want or sizes == [len(g["params"]) for g in optimizer.param_groups]:
        optimizer.load_state_dict(saved)
        return False
    full = [list(g["params"]) for g in optimizer.param_groups]
    for g, f in zip(optimizer.param_groups, fresh):
        g["params"][:] = [p for p in g["params"] if all(p is not x for x in f)]
    try:
        optimizer.load_state_dict(saved)
    finally:
        for g, params in zip(optimizer.param_groups, full):
            g["params"][:] = params
    shown = sorted(names[id(p)] for f in fresh for p in f)
    warnings.warn(
        f"the checkpoint was written before {', '.join(shown[:3])}"
        f"{f', … ({len(shown)} in all)' if len(shown) > 3 else ''} existed: they load at their "
        "initial values (outputs unchanged) and start with fresh optimizer state (a memory without "
        "them: inner_norm_affine: false in its mixer_options, e.g. {neural_memory: {inner_norm_affine: "
        "false}})",
        stacklevel=2,
    )
    return True


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW (or M3) with weight decay on matrices (``ndim >= 2``) only, and not on the parameters
    a module lists in ``no_weight_decay`` (Mamba's 2-D ``A_log``: decayed towards 0, every state's
    ``A = −exp(A_log)`` drifted to ``−1``; :func:`_no_weight_decay`).

    Param groups: ``[decay (ndim >= 2), no decay]`` at ``cfg.lr`` for every parameter, except the
    parameters of modules that carry a float attribute ``outer_lr_scale`` (e.g. the CMS levels of
    :mod:`mnemo.layers.cms`; the innermost such module wins): those go into their own pair of
    groups per scale, with ``lr = cfg.lr · outer_lr_scale`` (the LambdaLR schedule multiplies each
    group's initial lr by the same factor, so the ratio holds throughout). A scale of exactly 1
    stays in the base groups. ``cfg.optimizer == "m3"`` builds :class:`mnemo.train.m3.M3` from
    ``beta1, beta2, m3_beta3, m3_alpha, m3_eps, m3_ns_steps, m3_slow_every, m3_ema``; ``"m3_paper"``
    the same without weight decay or EMA (Algorithm 1 alone).
    """
    weight_decay = 0.0 if algorithm1_only(cfg) else cfg.weight_decay
    groups = [
        {"params": params, "weight_decay": weight_decay if decayed else 0.0}
        | ({} if scale == 1.0 else {"lr": cfg.lr * scale})
        for params, decayed, scale in _param_groups(model, _no_weight_decay(model))
    ]
    if cfg.optimizer in ("m3", "m3_paper"):
        return M3(
            groups,
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2, cfg.m3_beta3),
            alpha=cfg.m3_alpha,
            eps=cfg.m3_eps,
            ns_steps=cfg.m3_ns_steps,
            slow_every=cfg.m3_slow_every,
            ema=cfg.m3_ema and not algorithm1_only(cfg),
        )
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), **adamw_implementation(model))


def adamw_implementation(model: torch.nn.Module) -> dict:
    """``{"fused": True}`` when every trainable parameter is a plain floating tensor on the CPU or a
    CUDA device (torch's fused AdamW kernel: one pass over each parameter instead of a dozen
    element-wise ops; the same update up to float rounding), else ``{}`` (torch's default: the
    sharded ``DTensor`` parameters of an FSDP run, other devices). On 2 CPU cores the AdamW step
    alone ran 4.2x (0.9M parameters) and 7.4x (5.0M) faster than torch's CPU default, the for-loop
    form; ``foreach=True`` 0.77x and 1.17x (docs/benchmarks/fused_loss_cpu_2core.txt)."""
    params = [p for p in model.parameters() if p.requires_grad]
    ok = bool(params) and all(
        type(p.data) is torch.Tensor and p.is_floating_point() and p.device.type in ("cpu", "cuda")
        for p in params
    )
    return {"fused": True} if ok else {}


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, warn: bool = True):
    """The learning-rate schedule of ``cfg``: :func:`lr_factor` over ``cfg.cosine_steps`` as a
    ``LambdaLR``; warns (``warn``: on the main process; default ``warn=True``) when the warm-up is
    as long as the schedule."""
    if cfg.warmup_steps >= cfg.cosine_steps and warn and not algorithm1_only(cfg):
        # the last update's factor is cosine_steps / warmup_steps: 1 when they are equal
        reach = (
            f"reaches lr={cfg.lr:g} only at its last step"
            if cfg.warmup_steps == cfg.cosine_steps
            else f"never reaches lr={cfg.lr:g} (at most {cfg.lr * cfg.cosine_steps / cfg.warmup_steps:.3g})"
        )
        warnings.warn(
            f"warmup_steps {cfg.warmup_steps} >= the {cfg.cosine_steps}-step learning-rate schedule: "
            f"the lr {reach} and never decays; lower --warmup-steps",
            stacklevel=3,  # (Trainer.__init__)
        )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: schedule_factor(cfg, s))


def load_schedule(scheduler, state: dict) -> None:
    """Restore ``scheduler`` (a :func:`make_scheduler` schedule) from its saved ``state`` and set
    every param group's learning rate to the schedule's value at the saved step. The optimizer's
    saved learning rates are the saved schedule's, which a resumed run may have replaced (``mnemo
    train --resume --reschedule stretch``): without this, the first resumed step would still train
    at the old schedule's rate. An unchanged schedule gives the same rates, bit for bit."""
    scheduler.load_state_dict(state)
    lrs = [base * f(scheduler.last_epoch) for f, base in zip(scheduler.lr_lambdas, scheduler.base_lrs)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs  # what get_last_lr() returns (LambdaLR sets it the same way in step())
