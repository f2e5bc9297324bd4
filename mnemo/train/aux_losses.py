"""Auxiliary training losses: terms added to a micro-batch's loss besides the cross-entropy, with
their own bookkeeping per step and per logging interval. The one built in is :class:`MoEBalance`
(mixture-of-experts load balancing and router z-loss, :class:`mnemo.layers.MoE`).

Extension point: a new auxiliary loss is an object with three methods (:class:`AuxiliaryLoss`),
passed as ``Trainer(..., aux_losses=[...])`` (added after the built-in MoE one; the trainer holds
them as :class:`AuxiliaryLosses`, which calls each in that order):

* ``collect(model) -> Tensor | None`` — after each micro-batch's forward (before its backward):
  the 0-d term to add to that micro-batch's loss, already weighted (the loss a rank back-propagates
  is ``summed cross-entropy / global supervised tokens``, so a per-token mean term is divided by
  ``grad_accum`` to weigh it once per step; DDP averages over ranks), or ``None``;
* ``after_step(model)`` — after the optimizer step (e.g. a bias update, a collective over ranks:
  every rank calls it in the same order);
* ``record() -> dict`` — the logging interval's metrics, merged into the evaluation record (keys
  of your own prefix), then reset.

Optionally ``state_dict() -> dict`` / ``load_state_dict(dict)``: the interval's bookkeeping a
checkpoint keeps (tensors, numbers, lists), so the first record after a resume covers the whole
interval, as the uninterrupted run's does.
``discard_step()``, optionally too: a step raised before its optimizer update (an interrupt between
two micro-batches, a NaN/inf loss): forget what ``collect`` gathered for it (the step is run again).

The step's returned and logged ``train_loss`` stays the cross-entropy.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist


class AuxiliaryLoss(Protocol):
    def collect(self, model) -> torch.Tensor | None: ...

    def after_step(self, model) -> None: ...

    def record(self) -> dict: ...


class AuxiliaryLosses(list):
    """The run's auxiliary losses, in order (the built-in :class:`MoEBalance` first), called as one."""

    def add_to(self, loss: torch.Tensor, model) -> torch.Tensor:
        """``loss`` plus each loss's ``collect(model)`` term, added one after the other (after a
        micro-batch's forward)."""
        for term in (aux.collect(model) for aux in self):
            loss = loss if term is None else loss + term
        return loss

    def after_step(self, model) -> None:
        """Each loss's ``after_step(model)`` (after the optimizer step; every rank, same order)."""
        for aux in self:
            aux.after_step(model)

    def discard_step(self) -> None:
        """Each loss's ``discard_step()`` where it has one: the step raised before its update."""
        for aux in self:
            if hasattr(aux, "discard_step"):
                aux.discard_step()

    def record(self) -> dict:
        """The logging interval's metrics of every loss, merged in order (and each one's reset)."""
        return {k: v for aux in self for k, v in aux.record().items()}

    def state_dict(self) -> dict:
        """What a checkpoint holds (the key of the trainer state it joins): each loss's
        ``state_dict()``, in order (``None`` for a loss without one)."""
        return {"aux_losses": [aux.state_dict() if hasattr(aux, "state_dict") else None for aux in self]}

    def load_state_dict(self, state: dict) -> None:
        """Resume each loss's interval from a checkpoint's trainer ``state`` (one written before
        auxiliary losses were checkpointed, or with other losses: the intervals start afresh)."""
        saved = state.get("aux_losses")
        if saved is None or len(saved) != len(self):
            return
        for aux, s in zip(self, saved):
            if s is not None and hasattr(aux, "load_state_dict"):
                aux.load_state_dict(s)


class MoEBalance:
    """The MoE layers' auxiliary losses (``Σ_layers aux_loss_coef · L_aux + z_loss_coef · L_z +
    seq_aux_loss_coef · L_seq``,
    :meth:`mnemo.models.LanguageModel.aux_loss`), expert loads and bias balancing, for a run of
    ``grad_accum`` micro-batches on ``world`` processes. Does nothing for a model without MoE
    layers.

    A documented choice (the Switch/GShard convention, per device and per batch): ``L_aux = E · Σ_e
    f_e · P_e`` is computed over each micro-batch's tokens on each rank (its slice of the sequence
    under context parallelism), and the objective takes the **mean** of those values, not the loss
    of the step's pooled tokens (``f`` and ``P`` are means, so their product is not additive; on a
    tiny model the two differ by about 1%). Pooling over micro-batches would need every
    micro-batch's graph kept until the last one. So changing ``grad_accum``, the number of
    processes or ``context_parallel`` (even on resume) changes this term slightly, though not the
    cross-entropy's gradients; ``L_z`` (a per-token mean over equal-sized slices) and the
    ``bias_balancing`` counts (summed over the step and ranks) do not depend on the split.
    ``L_seq`` (DeepSeek-V3's sequence-wise loss, a mean over the micro-batch's rows) does not
    depend on ``grad_accum`` or data-parallel processes (equal-sized micro-batches), but under
    context parallelism each rank sees its slice of every row as the sequence. ``L_seq`` enters
    the objective through :meth:`mnemo.layers.MoE.loss` (with ``seq_aux_loss_coef > 0``) and is
    logged as ``moe_seq_aux_loss`` whatever its weight, as ``L_z`` is."""

    #: a layer's step and interval sums: its ``E`` assignment counts, then dropped assignments,
    #: ``L_aux``, ``L_z`` and ``L_seq`` (the last ``_TAIL``)
    _TAIL = 4

    def __init__(self, grad_accum: int, world: int, context_parallel: bool):
        self.grad_accum, self.world = grad_accum, world
        self.scale = self._scale(grad_accum, world, context_parallel)
        self._step_sums = None  # this step's per-layer sums, on the device
        self._interval, self._interval_n = None, 0  # the logging interval's
        # micro-batches (× ranks) whose L_seq the interval holds: _interval_n, but after resuming
        # from a checkpoint written before L_seq was logged, only those run since
        self._seq_n = 0

    @staticmethod
    def _scale(grad_accum: int, world: int, context_parallel: bool) -> float:
        """Weight of a micro-batch's auxiliary loss (already ``Σ_layers coef · L``). Each
        micro-batch's ``L_aux`` / ``L_z`` is computed over its own tokens (per rank), and the
        training objective adds their **mean** over the step's micro-batches and ranks: ``1 /
        grad_accum`` here, DDP's gradient average does the rest; context parallelism sums gradients
        over ranks, hence ``1 / (grad_accum · world)`` there. (With one micro-batch on one process
        this is the full batch's loss; otherwise ``f · P`` is averaged per micro-batch, not pooled.)"""
        n = grad_accum * (world if context_parallel else 1)
        return 1.0 / n

    def collect(self, model) -> torch.Tensor | None:
        """The weighted auxiliary loss of the micro-batch just run (``None`` without MoE layers);
        adds each layer's assignment counts, dropped assignments and loss values (``L_aux``,
        ``L_z``, ``L_seq``: the last ``_TAIL`` entries of a layer's sums) to the step's sums
        (before the backward, so activation recomputation does not count twice)."""
        aux = model.aux_loss()
        if aux is None:
            return None
        term = aux * self.scale
        parts = [  # kept on the device: no host synchronisation per micro-batch
            torch.cat(
                [
                    m.last_counts.double(),
                    m.last_dropped.double()[None],
                    m.last_aux_loss.detach().double()[None],
                    m.last_z_loss.detach().double()[None],
                    m.last_seq_aux_loss.detach().double()[None],
                ]
            )
            for _, m in model.moe_layers()
        ]
        acc = self._step_sums
        self._step_sums = parts if acc is None else [a + b for a, b in zip(acc, parts)]
        return term

    def discard_step(self) -> None:
        """The step raised before its update: its micro-batches' statistics so far are dropped."""
        self._step_sums = None

    def after_step(self, model) -> None:
        """After the optimizer step: sum the step's MoE statistics over ranks (one all-reduce), take
        one auxiliary-loss-free bias step per layer with ``bias_balancing`` (its global counts, so
        every rank's bias stays equal), and add the statistics to the logging interval's."""
        acc = self._step_sums
        if acc is None:
            return
        self._step_sums = None
        flat = torch.cat(acc)
        if self.world > 1:
            dist.all_reduce(flat)
        if self.world > 1 or flat.device.type == "cpu":  # (the sums are on the model's device)
            flat = flat.cpu()  # (a host sync off the CPU: with one process the sums stay there until logged)
        sums = list(flat.split([a.numel() for a in acc]))
        for s_, (_, m) in zip(sums, model.moe_layers()):
            if m.bias_balancing:
                m.update_bias(s_[: -self._TAIL])
        if self._interval is None:
            self._interval = [torch.zeros_like(s_) for s_ in sums]
        elif self._interval[0].device != sums[0].device:  # resumed (a checkpoint keeps it on the CPU)
            self._interval = [a.to(s_.device) for a, s_ in zip(self._interval, sums)]
        for a, s_ in zip(self._interval, sums):
            a += s_
        # micro-batches (× ranks) that contributed a loss value, for the interval means
        self._interval_n += self.grad_accum * self.world
        self._seq_n += self.grad_accum * self.world

    def record(self) -> dict:
        """The logging interval's MoE metrics (and a reset): ``moe_load`` (per layer, the fraction
        of assignments each expert received; balanced = ``1/E``), ``moe_load_max`` / ``moe_load_min``
        (over layers and experts), ``moe_dropped`` (assignments dropped by ``capacity_factor``) and
        ``moe_dropped_frac``, ``moe_aux_loss`` / ``moe_z_loss`` / ``moe_seq_aux_loss`` (per layer
        and micro-batch means of ``L_aux``, ``L_z`` and ``L_seq``, unweighted; ``moe_aux_loss`` and
        ``moe_seq_aux_loss`` are 1 for uniform routing). Empty without MoE layers."""
        interval = self._interval
        if interval is None:
            return {}
        n, n_seq, t = max(self._interval_n, 1), self._seq_n, self._TAIL
        self._interval, self._interval_n, self._seq_n = None, 0, 0
        loads = [(a[:-t] / a[:-t].sum().clamp_min(1)).tolist() for a in interval]
        assigned = sum(float(a[:-t].sum()) for a in interval)
        dropped = sum(float(a[-t]) for a in interval)
        flat = [v for row in loads for v in row]
        seq_means = sum(float(a[-1]) for a in interval) / (max(n_seq, 1) * len(interval))
        return {
            "moe_load": [[round(v, 5) for v in row] for row in loads],
            "moe_load_max": max(flat),
            "moe_load_min": min(flat),
            "moe_dropped": int(dropped),
            "moe_dropped_frac": dropped / max(assigned, 1.0),
            "moe_aux_loss": sum(float(a[-3]) for a in interval) / (n * len(interval)),
            "moe_z_loss": sum(float(a[-2]) for a in interval) / (n * len(interval)),
            **({"moe_seq_aux_loss": seq_means} if n_seq else {}),  # (none yet: resumed from an old state)
        }

    def state_dict(self) -> dict:
        """The logging interval's statistics so far (on the CPU; ``None`` before the first step)."""
        interval = None if self._interval is None else [a.detach().cpu() for a in self._interval]
        return {"interval": interval, "interval_n": self._interval_n, "seq_n": self._seq_n}

    def load_state_dict(self, state: dict) -> None:
        """Resume the interval of :meth:`state_dict` (its tensors on the device the sums live on).
        A state written before ``L_seq`` was logged (no ``seq_n``; a layer's sums end with ``L_z``)
        gets a zero ``L_seq`` sum: the interval's ``moe_seq_aux_loss`` then covers the micro-batches
        run since the resume."""
        interval, self._interval_n = state["interval"], int(state["interval_n"])
        if "seq_n" not in state and interval is not None:
            interval = [torch.cat([a, a.new_zeros(1)]) for a in interval]
        self._interval, self._seq_n = interval, int(state.get("seq_n", 0))
