"""Evaluation during training: the validation loss of a text run (nats/token and bits per
character over the first ``eval_batches · batch_size`` validation windows) or a task's loss and
accuracies on a fixed test set (:func:`mnemo.train.task_eval.evaluate_task`), at the training
length and, at the final evaluation, at every ``eval_lengths``.

Extension point: what is measured at each evaluation beyond this is a *callback*
(``Trainer(..., callbacks=[f])``, ``f(trainer, record) -> dict | None``, e.g.
:class:`mnemo.interp.CircuitTracker`): it runs after :meth:`Evaluator.evaluate`, on rank 0 (under
FSDP on every rank), before the record is logged, and its dict is merged into the record; it must
not touch the RNG streams the trainer uses. Instead of a sequence, ``callbacks`` may be a factory
``f(cfg) -> sequence of callbacks``, called once with the run's resolved configuration
(:func:`make_callbacks`). A different validation metric for every run is a subclass of
:class:`Evaluator` overriding ``evaluate``.
"""

from __future__ import annotations

import math

import torch

from .batches import packed_logits, with_bos
from .config import TrainConfig
from .task_eval import evaluate_task


class Evaluator:
    """Evaluates a model of the run ``cfg``: on ``task``'s test sets (cached in ``cache``, keyed
    ``(length, rows)``), else on the text stream ``val_data`` of ``val_chars`` characters; forward
    passes under ``autocast()``."""

    def __init__(self, cfg: TrainConfig, task, val_data, val_chars, autocast, cache: dict, bos=None):
        self.cfg, self.task, self.val_data, self.val_chars = cfg, task, val_data, val_chars
        self.autocast, self.cache, self.bos = autocast, cache, bos  # bos: TrainConfig.bos's id

    @torch.no_grad()
    def evaluate(
        self, model, device, max_batches: int | None = None, lengths: list[int] | None = None
    ) -> dict:
        """``model`` (on ``device``) evaluated: see :meth:`mnemo.train.Trainer.evaluate`.

        Raises:
            ValueError: ``max_batches`` is not ``None`` or an int ``>= 1`` (no batch would give a
            validation loss of 0); ``lengths`` is not ``None`` or a list (or tuple) of lengths, or
            is not empty on a text run (they are a task's)."""
        if max_batches is not None and (
            isinstance(max_batches, bool) or not isinstance(max_batches, int) or max_batches < 1
        ):
            raise ValueError(
                f"max_batches: expected None or an int >= 1 (validation batches), got {max_batches!r}"
            )
        if lengths is not None and not isinstance(lengths, (list, tuple)):  # (an int iterated, text by char)
            raise ValueError(f"lengths: expected None or a list of test lengths (ints), got {lengths!r}")
        if self.task is not None:
            return self._evaluate_task(model, device, max_batches, lengths or [])
        if lengths:  # (as TrainConfig.eval_lengths: the test lengths are a task's)
            raise ValueError(
                f"lengths: further test lengths apply to a task run (TrainConfig.task); this text run is "
                f"evaluated on seq_len={self.cfg.seq_len} windows, got lengths={lengths!r} (a text "
                "checkpoint at other window lengths: mnemo eval --checkpoint RUN --length L1,L2)"
            )
        was = model.training
        model.eval()
        total, count = 0.0, 0
        pack = self.cfg.pack_documents
        try:
            for batch in self.val_data.eval_batches(self.cfg.batch_size, max_batches, with_documents=pack):
                x, y = with_bos(batch[0], self.bos).to(device), batch[1].to(device)
                with self.autocast():
                    if pack:
                        logits = packed_logits(model, x, batch[2].to(device))
                    else:
                        logits, _ = model(x)
                # float32 at least (bf16 autocast's logits), a float64 model's own float64
                logits = logits if logits.dtype == torch.float64 else logits.float()
                total += torch.nn.functional.cross_entropy(
                    logits.flatten(0, 1), y.flatten(), reduction="sum"
                ).item()
                count += y.numel()
        finally:  # the mode it found, also when a forward pass raises (e.g. NaN/inf in an op's input)
            model.train(was)
        val_loss = total / max(count, 1)
        # bits per character: tokens per character of the whole validation split (1 for char-level;
        # for byte and subword tokenizers the split's average, not the evaluated windows' own ratio)
        tokens_per_char = self.val_data.ids.numel() / max(self.val_chars, 1)
        return {
            "val_loss": val_loss,
            "val_bpc": val_loss * tokens_per_char / math.log(2),
            "val_tokens": count,  # the first eval_batches · batch_size windows of the split
        }

    def during_training(self, evaluate, last: bool, agree=bool) -> dict:
        """The metrics of an evaluation during training, by ``evaluate(max_batches, lengths=)``
        (the trainer's :meth:`~mnemo.train.Trainer.evaluate`): ``eval_batches`` batches, at the
        final evaluation (``last``) also at every ``eval_lengths``. An evaluation that reaches
        ``early_stop_acc`` ends the run, so it is the final one: it adds the longer lengths too
        (``agree``: rank 0's decision on every rank, where every rank evaluates)."""
        cfg = self.cfg
        ev = evaluate(cfg.eval_batches, lengths=cfg.eval_lengths if last else None)
        stops = not last and bool(cfg.eval_lengths) and cfg.early_stop_acc is not None
        if stops:
            stops = agree(ev.get("val_acc", 0.0) >= cfg.early_stop_acc)
        if stops:
            # this evaluation ends the run (early stop): it is the final one, with eval_lengths
            longer = evaluate(cfg.eval_batches, lengths=cfg.eval_lengths)
            ev.update({k: v for k, v in longer.items() if "@" in k})
        return ev

    def stops_early(self, record: dict, last: bool, agree, announce: bool = False) -> bool:
        """Whether the evaluation of ``record`` ends the run: ``cfg.early_stop_acc`` reached before
        the last step (``last``). ``agree``: rank 0's decision on every rank (a collective: every
        rank calls this, those that did not evaluate with a record without ``val_acc``).
        ``announce``: print the early stop (rank 0; default ``announce=False``)."""
        cfg = self.cfg
        if cfg.early_stop_acc is None or last:
            return False
        stops = agree(record.get("val_acc", 0.0) >= cfg.early_stop_acc)
        if stops and announce:
            print(
                f"early stop at step {record['step']}: val_acc {record['val_acc']:.4f} >= "
                f"{cfg.early_stop_acc}",
                flush=True,
            )
        return stops

    def _evaluate_task(self, model, device, max_batches: int | None, lengths: list[int]) -> dict:
        cfg = self.cfg
        for L in lengths:  # (else the task's own check names seq_len, which the caller did not give)
            self.task.check_length(L, f"lengths (evaluate's {lengths!r})")
        n = cfg.batch_size * (cfg.eval_batches if max_batches is None else min(max_batches, cfg.eval_batches))
        wanted = [cfg.seq_len] + [L for L in lengths if L != cfg.seq_len]
        res = evaluate_task(
            model,
            self.task,
            wanted,
            num_samples=n,
            batch_size=cfg.batch_size,
            train_len=cfg.seq_len,
            seed=cfg.seed,
            device=device,
            autocast=self.autocast,
            cache=self.cache,
        )
        main = res[cfg.seq_len]
        out = {"val_loss": main["loss"], "val_acc": main["acc"], "val_seq_acc": main["seq_acc"]}
        for L in lengths:
            r = res[L]
            out.update(
                {f"val_loss@{L}": r["loss"], f"val_acc@{L}": r["acc"], f"val_seq_acc@{L}": r["seq_acc"]}
            )
        return out


class Callbacks(list):
    """The run's evaluation callbacks, in order (:func:`make_callbacks`)."""

    def merge(self, trainer, record: dict) -> dict:
        """``record`` with what each callback returns for ``(trainer, record)`` merged into it, one
        after the other (each sees what the ones before it added)."""
        for callback in self:
            extra = callback(trainer, record)
            if extra:
                record.update(extra)
        return record


    def check_model(self, model) -> None:
        """Before the first step: each callback with a ``check_model(model)`` method checks the built
        model (e.g. :meth:`mnemo.interp.CircuitTracker.check_model`), raising ``ValueError`` for a
        setting it would otherwise refuse only at its first evaluation."""
        for callback in self:
            check = getattr(callback, "check_model", None)
            if callable(check):
                check(model)


def make_callbacks(callbacks, cfg: TrainConfig) -> Callbacks:
    """The evaluation callbacks (:class:`Callbacks`): ``callbacks`` itself, or, when it is callable
    (a factory), what it returns for the run's configuration ``cfg``. ``cfg.track_circuits`` needs
    one that tracks the circuits (``tracks_circuits = True``): this package does not import
    :mod:`mnemo.interp` (DESIGN.md §2), so the caller supplies it."""
    made = Callbacks(callbacks(cfg) if callable(callbacks) else callbacks)
    if cfg.track_circuits and not any(getattr(cb, "tracks_circuits", False) for cb in made):
        raise ValueError(
            "TrainConfig.track_circuits: the trainer does not build the circuit tracker itself; "
            "pass callbacks=[mnemo.interp.CircuitTracker(length=cfg.circuit_length)] (or the "
            "factory callbacks=mnemo.interp.circuit_callbacks, which reads the run's config), "
            "or set track_circuits=False"
        )
    if getattr(cfg, "track_spectrum", False) and not any(
        getattr(cb, "tracks_spectrum", False) for cb in made
    ):
        raise ValueError(
            "TrainConfig.track_spectrum: the trainer does not build the spectrum tracker itself; "
            "pass callbacks=[mnemo.interp.CircuitTracker(spectrum=True)] (or the factory "
            "callbacks=mnemo.interp.circuit_callbacks), or set track_spectrum=False"
        )
    return made
