"""The training loop: AdamW, warm-up + cosine schedule, clipping, evaluation, exact resume.

:class:`Trainer` is the loop; each concern is a part with an extension point of its own:
parallelism (:mod:`~mnemo.train.strategy`), the run folder, resume and checkpoints
(:mod:`~mnemo.train.run_folder`), auxiliary losses (:mod:`~mnemo.train.aux_losses`), logging
(:mod:`~mnemo.train.sinks`), interrupts (:mod:`~mnemo.train.interrupts`), evaluation
(:mod:`~mnemo.train.evaluation`), data (:mod:`~mnemo.train.batches`), the carried state
(:mod:`~mnemo.train.carry`), the model (:mod:`~mnemo.train.build`), text generation
(:mod:`~mnemo.train.generation`)."""

from __future__ import annotations

import contextlib
import math
import shlex
import time
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError

from ..data.tasks import IGNORE_INDEX
from ..ops._common import NonFiniteError
from .aux_losses import AuxiliaryLosses, MoEBalance
from .batches import RunData, _Logits, fixed_batch, fixed_train_set, packed_logits, summed_cross_entropy  # noqa: F401
from .build import (  # noqa: F401
    _count_parameters,
    _misfit,
    build_model,
    check_carry_state,
    load_checkpoint,
    load_weights,
    source_files,
)
from .carry import CarriedState
from .checkpoint import MANIFEST_NAME, CorruptCheckpointError, ckpt_name, save_torch  # noqa: F401  (save_torch: tests fake a full disk here)
from .config import TrainConfig
from .distributed import backend_for, barrier, init_from_env, local_device
from .diverged import TrainingDiverged, _nonfinite_detail, _nonfinite_weights
from .evaluation import Evaluator, make_callbacks
from .generation import generate_text, sample_run
from .interrupts import DeferredInterrupts, interrupted
from .optim import grad_clip, load_schedule, lr_factor, make_optimizer, make_scheduler  # noqa: F401
from .run_folder import LOCK_NAME, RESCHEDULE, RESUMABLE, RunFolder, lock_run_folder, resume_config  # noqa: F401
from .sinks import METRICS_NAME, IntervalMeter, Logbook, ProgressBar, evaluation_record  # noqa: F401
from .strategy import ContextParallel, Sharded, make_strategy

__all__ = ["Trainer", "TrainingDiverged", "generate_text", "resume_config", "lock_run_folder"]


class Trainer:
    """Train a registered model on a text corpus or a synthetic task; see :class:`TrainConfig`.

    With ``cfg.task`` set, training batches come from the task generator (seeded with the run's
    train seed; its state is checkpointed, so resume stays exact), the loss covers only the
    supervised positions, and each evaluation reports ``val_loss``, ``val_acc`` (token accuracy on
    the supervised positions) and ``val_seq_acc`` on a fixed test set drawn from the disjoint test
    seed; the final evaluation adds ``val_acc@L`` / ``val_loss@L`` for every ``cfg.eval_lengths``.

    ``Trainer(cfg, out_dir, resume=False).fit()`` returns the final evaluation record. With
    ``resume=True`` it continues from ``out_dir``'s newest intact checkpoint (verified against its
    manifest; a damaged one is skipped with a warning naming the bad file) and reproduces, step
    for step, the losses of an uninterrupted run (same seed, config and machine). A resumed run
    restores every saved setting; ``cfg`` then only says what to change — ``None`` (nothing), a
    dict of the settings to change, or a full :class:`TrainConfig` compared field by field — see
    :func:`resume_config` (which settings may change; ``reschedule`` = ``"stretch"`` or ``"hold"``
    when new ``steps`` would move the end of the cosine). Each change is logged in one line.
    ``progress``: show a progress bar (on the main process). Defaults: ``resume=False``,
    ``progress=True``.

    The parts' extension points: ``callbacks`` (what each evaluation adds to its record, e.g.
    circuit scores, or a factory of them: :mod:`mnemo.train.evaluation`; ``cfg.track_circuits``
    needs one, e.g. ``callbacks=mnemo.interp.circuit_callbacks``, what ``mnemo train`` and ``mnemo
    sweep`` pass: this package does not import :mod:`mnemo.interp`), ``sinks`` (more loggers of
    the evaluation records: :mod:`mnemo.train.sinks`), ``aux_losses`` (more auxiliary losses:
    :mod:`mnemo.train.aux_losses`). Defaults: none.

    **Carried state** (``cfg.carry_state``: truncated back-propagation through time). The text is
    read as ``batch_size`` parallel streams (:class:`~mnemo.train.batches.CarriedStreams`); each
    step starts from the state the previous one ended with (``carried_state``; the part:
    :class:`~mnemo.train.carry.CarriedState`), and the checkpoints hold it.

    **Parallelism**. Launched by ``torchrun --nproc_per_node N``, the trainer joins the process
    group and trains as :mod:`mnemo.train.strategy` describes: data-parallel (DDP), sharded
    (``cfg.fsdp``: FSDP2) or context-parallel (``cfg.context_parallel``), with the single-process
    run's gradients and losses, and rank 0 evaluating, logging and writing checkpoints (resumed on
    any number of processes). ``self.model`` stays the plain :class:`LanguageModel` (evaluation,
    checkpoints, sampling); ``rank``, ``world`` and ``is_main`` tell where a trainer runs.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        out_dir: str | Path,
        *,
        resume: bool = False,
        reschedule: str | None = None,
        progress: bool = True,
        log=print,
        callbacks=(),
        sinks=(),
        aux_losses=(),
    ):
        # construction, in order: configuration, processes, callbacks, data, model, optimizer,
        # state, wrappers (the order of the RNG draws is part of exact resume: keep it)
        self.out = Path(out_dir)
        self.progress, self.log = progress, log
        self.run_folder = RunFolder(self.out)
        cfg, ckpt, state, notes = self.run_folder.resolve(cfg, resume, reschedule)
        self._join_processes(cfg, notes)  # sets self.cfg and self.strategy
        self.callbacks = make_callbacks(callbacks, self.cfg)
        self.data = RunData(self.cfg, ckpt if state is not None else None, self.is_main)
        for name in ("task", "tokenizer", "train_data", "val_data", "train_set", "val_chars"):
            setattr(self, name, getattr(self.data, name))  # (the attributes callbacks read)
        self._test_sets: dict = {}  # a task's test sets (ids, scored targets, answer units) by (length, rows)
        self.data_fingerprint = self.data.fingerprint()  # (saved with every checkpoint)
        self.model = build_model(self.cfg, self.data.vocab_size, self.strategy)
        self.callbacks.check_model(self.model)  # what a callback would refuse at its first evaluation
        # cfg.carry_state: the state carried from step to step (else a fresh state every step)
        self.carry = CarriedState.for_run(self.model, self.cfg, self.data.streams, self.device, self.world)
        moe = MoEBalance(self.cfg.grad_accum, self.world, self.context_parallel)
        # the built-in one, then the caller's (before a resume, which restores their intervals)
        self.aux_losses = AuxiliaryLosses([moe, *aux_losses])
        self._setup_optimizer()
        start = ckpt if state is not None else None  # (the checkpoint whose weights the run starts from)
        if state is not None:
            self._restore_state(ckpt, state)
        elif self.cfg.init_from is not None:
            start = load_weights(
                self.model, self.cfg.init_from, self.cfg.model, self.device, self.fsdp, self.tokenizer
            )
        # a converted checkpoint's record of its source, which every checkpoint of the run carries
        # while it still describes the model (the rule: build.source_files); name -> bytes
        self.source_files = (
            {}
            if start is None
            else source_files(start, self.model, self.tokenizer, resumed=state is not None, warn=self.is_main)
        )
        self.train_model = self.strategy.wrap(self.model)  # DDP's wrapper, or the plain forward
        if self.cfg.compile:  # the training forward only: self.model (checkpoints, evaluation) stays eager
            self.train_model = torch.compile(self.train_model)
        self.ddp = self.strategy.ddp
        self.evaluator = Evaluator(
            self.cfg,
            self.task,
            self.val_data,
            self.val_chars,
            self._autocast,
            self._test_sets,
            self.data.bos_id,
        )
        # rank 0 logs: metrics.jsonl, TensorBoard (cfg.tensorboard), then the caller's sinks
        self.logbook = Logbook(self.out, self.cfg.tensorboard, sinks, enabled=self.is_main)
        self.interrupts = DeferredInterrupts(enabled=self.world == 1)

    def _join_processes(self, cfg: TrainConfig, notes: list[str]) -> None:
        """Join the process group (under torchrun), print ``notes`` on rank 0, validate ``cfg``
        (``self.cfg``) and choose the parallelism (``self.strategy``), which checks that the batch
        or the sequences split over the processes."""
        self.device = local_device(torch.device(cfg.device))  # cuda:LOCAL_RANK under torchrun
        self.rank, self.world = init_from_env(backend_for(self.device))
        self.is_main = self.rank == 0
        for note in notes if self.is_main else ():
            self.log(note)
        self.cfg = cfg.validate()
        self.strategy = make_strategy(self.cfg, self.device, self.rank, self.world)
        self.context_parallel = isinstance(self.strategy, ContextParallel)  # splits the sequences
        self.fsdp = isinstance(self.strategy, Sharded)  # sharded parameters (mnemo.train.sharded)
        if self.cfg.fsdp and not self.fsdp and self.is_main:  # one process: the saved setting changes
            self.log(
                "fsdp: one process trains unsharded and writes single-file checkpoints, saved with "
                "fsdp: false (a later torchrun --resume trains data-parallel; a single-file checkpoint "
                "does not resume sharded)"
            )

    def _setup_optimizer(self) -> None:
        """The optimizer, the warm-up + cosine schedule, the batch generator (seeded from
        ``cfg.seed``) and the step counters of a fresh run."""
        cfg = self.cfg
        self.optimizer = make_optimizer(self.model, cfg)
        self.scheduler = make_scheduler(self.optimizer, cfg, warn=self.is_main)
        self.last_lr = self.scheduler.get_last_lr()[0]  # updated by every step
        self.generator = self.data.batch_generator()
        self.step = 0
        self.early_stopped = False  # TrainConfig.early_stop_acc reached (saved with checkpoints)
        self.last_checkpoint: Path | None = None
        self.meter = IntervalMeter()  # the logging interval's training metrics (checkpointed)

    def _restore_state(self, ckpt: Path, state: dict) -> None:
        """Resume: the checkpoint's weights, optimizer, schedule, generator and torch RNG states
        and step; the metrics log is cut back to that step (rank 0, under the folder's lock)."""
        try:
            load_checkpoint(self.model, self.optimizer, ckpt, state, self.device, self.fsdp)
        except torch.OutOfMemoryError:
            raise
        except ValueError as e:  # torch's optimizer.load_state_dict: the saved groups do not fit
            saved = [len(g["params"]) for g in (state.get("optimizer") or {}).get("param_groups", [])]
            mine = [len(g["params"]) for g in self.optimizer.param_groups]
            if self.fsdp or not saved or saved == mine:  # (another refusal, already worded: e.g. a
                raise  # single-file checkpoint resumed sharded)
            raise ValueError(
                f"checkpoint {ckpt}: its optimizer state does not fit this run's optimizer: the saved "
                f"parameter groups hold {saved} parameters, model {self.cfg.model!r} as configured now puts "
                f"{mine} in them ({e}); to keep its weights with a fresh optimizer and schedule, start a new "
                f"run (another --out) with --init-from {shlex.quote(str(ckpt))} (TrainConfig.init_from), "
                "which loads the weights only"
            ) from e
        except (SafetensorError, RuntimeError) as e:  # a damaged file the manifest did not cover, or misfit
            detail = _misfit(self.model, ckpt, e) if isinstance(e, RuntimeError) else str(e)
            if (ckpt / MANIFEST_NAME).is_file():  # its files were verified: intact, but not this model's
                raise ValueError(
                    f"checkpoint {ckpt}: its (verified) weights do not fit model {self.cfg.model!r} as this "
                    f"mnemo builds it — written by another version? {detail}"
                ) from e
            raise CorruptCheckpointError(
                ckpt,
                [
                    f"its weights do not load into model {self.cfg.model!r} (it has no {MANIFEST_NAME}: "
                    f"unchecked): {detail}"
                ],
            ) from e
        load_schedule(self.scheduler, state["scheduler"])  # (a stretched cosine: its rate from here on)
        self.generator.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
        self.step = state["step"]
        self.meter.load_state_dict(state)
        self.aux_losses.load_state_dict(state)  # (e.g. the MoE loads of the interval so far)
        self.early_stopped = bool(state.get("early_stopped", False))
        self._check_same_data(ckpt, state.get("data"))
        self.carry.restore(ckpt, state, self.step)
        self.last_checkpoint = ckpt
        if self.is_main:  # under the folder's lock: never trim a live run's log
            self.run_folder.set_aside_newer(self.step, ckpt)
            self.run_folder.truncate_metrics(self.step)

    def _check_same_data(self, ckpt: Path, saved: dict | None) -> None:
        """Warn (rank 0) when the run's text is not the one checkpoint ``ckpt`` was trained on
        (``saved``: its :meth:`~mnemo.train.batches.RunData.fingerprint`; absent in checkpoints of an
        older mnemo): the file at ``cfg.data`` changed, so the resumed batches are not the
        uninterrupted run's. Training goes on, on the new text."""
        now = self.data_fingerprint
        if not self.is_main or saved is None or now is None or saved == now:
            return
        counts = lambda d: f"{d['train_tokens']:,} train / {d['val_tokens']:,} val tokens"  # noqa: E731
        warnings.warn(
            f"resume: data {self.cfg.data!r} is not the text {ckpt} was trained on ({counts(saved)} then, "
            f"{counts(now)} now{', other tokens' if counts(saved) == counts(now) else ''}): the resumed "
            "run trains on the new text, so its batches and losses differ from an uninterrupted run's",
            stacklevel=3,
        )

    @property
    def carried_state(self):
        """``cfg.carry_state``: the model's state after the last step's windows (else ``None``)."""
        return self.carry.state

    def _write_checkpoint(self) -> Path:
        """Rank 0 writes the checkpoint (FSDP: every rank calls this and writes its shards)."""
        state = {
            "step": self.step,
            "scheduler": self.scheduler.state_dict(),
            "generator": self.generator.get_state(),
            "torch_rng": torch.get_rng_state(),
            **self.meter.state_dict(),
            **self.aux_losses.state_dict(),
            "early_stopped": self.early_stopped,
            "data": self.data_fingerprint,  # (a resumed run checks that its text is the same)
            **self.carry.save(self.step),  # carry_state: the next step's window and its starting state
        }
        with self._writing(f"the checkpoint of step {self.step} ({self.out / ckpt_name(self.step)})"):
            self.last_checkpoint = self.run_folder.write_checkpoint(
                self.step,
                self.model,
                self.optimizer,
                self.tokenizer,
                self.cfg,
                state,
                sharded=self.fsdp,
                source_files=self.source_files,
            )
        return self.last_checkpoint

    @contextlib.contextmanager
    def _writing(self, what: str):
        """An ``OSError`` (a full disk, a file-size limit, a read-only folder) while writing ``what``
        is raised again saying what was being written and which checkpoint still holds the run (the
        file system's own message names neither)."""
        try:
            yield
        except OSError as e:
            kept = (
                f"the last checkpoint, {self.last_checkpoint}, is intact"
                if self.last_checkpoint is not None
                else "no checkpoint was written before it"
            )
            msg = f"{e.strerror or e} while writing {what}; {kept}"
            raise (OSError(e.errno, msg, e.filename) if e.errno is not None else OSError(msg)) from e

    def _autocast(self):
        """The forward passes' precision context: bf16 autocast on the run's device type
        (``cfg.precision="bf16"``; parameters stay float32, see :class:`TrainConfig`), else none."""
        if self.cfg.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def evaluate(self, max_batches: int | None = None, *, lengths: list[int] | None = None) -> dict:
        """Mean validation loss (nats/token) and bits per character over the first ``max_batches``
        batches of the validation split (the whole split when ``None``).

        For a task: ``val_loss``, ``val_acc`` and ``val_seq_acc`` on the supervised positions of
        ``min(max_batches, eval_batches) · batch_size`` test sequences (all ``eval_batches`` when
        ``None``), plus ``val_loss@L``, ``val_acc@L`` and ``val_seq_acc@L`` for each of ``lengths``.
        Raises ``ValueError`` naming ``max_batches`` when it is not ``None`` or an int ``>= 1``, and
        naming ``lengths`` when a text run is given any (a text checkpoint at other window lengths:
        ``mnemo eval --length``).
        """
        return self.evaluator.evaluate(self.model, self.device, max_batches, lengths)

    def _diverged(self, what: str, value: float, detail: str | None = None, step: int | None = None):
        step = self.step + 1 if step is None else step
        return TrainingDiverged(
            step, what, value, self.last_checkpoint, detail=detail, precision=self.cfg.precision
        )

    # ------------------------------------------------------------------------------------------
    def train_step(self) -> float:
        """One optimizer step on a fresh global batch; returns its loss (the mean over the global
        batch's supervised tokens, the same on every rank). Raises :class:`TrainingDiverged` (on
        every rank alike). Auxiliary losses (MoE balance and z-loss: :mod:`mnemo.train.aux_losses`)
        are added to each micro-batch's loss; the returned loss stays the cross-entropy.

        Host reads. On the CPU each micro-batch's loss is read and checked before its backward, and
        the gradient norm after the last one (``grad_accum + 1`` reads), as are the ops' own NaN/inf
        input checks (:func:`mnemo.ops.check_finite`). On another device with one process the step
        reads **one** value pair, once: the summed loss and the gradient norm, after the last
        backward and before the optimizer step (the ops' checks are off there, and the MoE
        statistics stay on the device until they are logged). A NaN/inf loss or norm raises
        :class:`TrainingDiverged` with the step, as on the CPU; the optimizer has not stepped. With
        several processes the per-micro-batch agreement of the ranks stays as it is.

        With ``cfg.carry_state`` the batch is the streams' next windows, the forward starts from
        ``carried_state`` and the model's new state replaces it once the step succeeded.

        A step that raises before its optimizer update (``TrainingDiverged``, an error or a
        ``KeyboardInterrupt`` between two micro-batches) leaves nothing behind: its batch is drawn
        again by the next step (a second ``fit`` trains on the batches of a run that never raised),
        its partial gradients and auxiliary-loss statistics are dropped."""
        # a step that raises before its update (an interrupt half-way through its micro-batches, a
        # NaN/inf) leaves no trace: the next step draws the same batch, as a run that never raised
        drawn = self.generator.get_state()
        try:
            total, n_tokens = self._gradients()
        except BaseException:
            self.generator.set_state(drawn)
            self.optimizer.zero_grad(set_to_none=True)
            self.strategy.discard_gradients(self.model)  # (FSDP2's unsharded micro-batch gradients)
            self.aux_losses.discard_step()
            raise
        self.carry.end_step()  # carry_state: the next step starts from here (cut from this step's graph)
        self.last_lr = self.scheduler.get_last_lr()[0]  # the rate of this update (metrics' lr)
        self.optimizer.step()
        self.scheduler.step()
        self.aux_losses.after_step(self.model)
        self.step += 1
        return total / n_tokens

    def _gradients(self) -> tuple[float, int]:
        """The gradients of this step's global batch (summed over its micro-batches, synchronised and
        clipped): ``(summed loss, supervised tokens)``; raises :class:`TrainingDiverged` before any
        update (see :meth:`train_step`)."""
        cfg, strategy, carry = self.cfg, self.strategy, self.carry
        carry.begin_step(self.step)  # truncated BPTT: this step's windows continue the last step's
        x, y, first = self.data.next_batch(self.step, self.generator)
        # every rank holds the whole global batch, so the global count needs no communication
        n_tokens = max(int((y != IGNORE_INDEX).sum()), 1)
        x, y, first, scale = strategy.split(x, y, first, n_tokens)
        cp = self.context_parallel
        micro = x.shape[0] // cfg.grad_accum
        # a task supervises few positions: the head (and the loss) only there, same loss and gradients
        sparse = self.task is not None and not cp and first is None and self.model.task_segment is None
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        # one host read per step on an accelerator (see the docstring): the losses stay on the device
        deferred = self.world == 1 and self.device.type != "cpu"
        total_dev = None
        for i in range(cfg.grad_accum):
            xi = x[i * micro : (i + 1) * micro].to(self.device)
            y_host = y[i * micro : (i + 1) * micro]  # (on the CPU: a batch is drawn there)
            yi = y_host.to(self.device)
            with strategy.micro_batch(i, cfg.grad_accum):
                error, handle = None, None
                try:
                    with self._autocast():
                        if carry.active:  # carry_state: one process, no wrapper: the model itself
                            rows = slice(i * micro, (i + 1) * micro) if cfg.grad_accum > 1 else None
                            logits, ce = None, carry.forward(self.model, xi, yi, rows)
                        elif cp:
                            logits, handle = strategy.forward(self.model, xi)
                        elif first is not None:
                            logits = self.train_model(xi, first[i * micro : (i + 1) * micro].to(self.device))
                        elif sparse:  # a task's supervised positions only: no [B, T, vocab] head
                            # the mask on the host: selecting by it reads no device value
                            at = y_host != IGNORE_INDEX
                            logits, yi = self.train_model(xi, logits_at=at), y_host[at].to(self.device)
                        else:  # the summed loss, without the [B, T, vocab] logits (chunked head)
                            logits, ce = None, self.train_model(xi, targets=yi, ignore_index=IGNORE_INDEX)
                    if logits is not None:  # (in float32, float64 kept; outside the autocast)
                        ce = summed_cross_entropy(logits, yi)
                except NonFiniteError as e:  # an op found NaN/inf in its inputs (MNEMO_CHECK_FINITE)
                    error, ce = e, None
                if deferred and error is None:  # checked with the gradient norm, after the backward
                    part, failed = 0.0, False
                    total_dev = ce.detach() if total_dev is None else total_dev + ce.detach()
                else:
                    part, failed = strategy.reduce_loss(ce, error is not None)
                if failed:  # raised on every rank before any backward, so no rank waits for another
                    other = "in another rank's forward pass"
                    where = f"in the forward pass: {_nonfinite_detail(error)}" if error else other
                    raise self._diverged("loss", math.nan, where) from error
                if not math.isfinite(part):
                    raise self._diverged("loss", part / n_tokens)
                loss = self.aux_losses.add_to(ce * scale, self.model)  # e.g. MoE balance
                try:
                    if handle is not None:
                        handle.backward(loss)  # the state gradients cross ranks here
                    else:
                        loss.backward()
                except NonFiniteError as e:  # an op's backward found NaN/inf
                    raise self._diverged(
                        "gradient", math.nan, f"in the backward pass: {_nonfinite_detail(e)}"
                    ) from e
            total += part
        strategy.sum_gradients(self.model)
        # after the synchronisation every rank holds the same gradients: same norm, same decision
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = strategy.grad_norm(params, grad_clip(cfg))
        if deferred:  # the step's one host read: the summed loss and the gradient norm together
            summed, norm_value = torch.stack([total_dev.double(), norm.detach().double()]).tolist()
            if not math.isfinite(summed):
                raise self._diverged("loss", summed / n_tokens)
            total = summed
        else:
            norm_value = norm.item()
        if not math.isfinite(norm_value):
            raise self._diverged("gradient norm", norm_value)
        return total, n_tokens

    def fit(self, until: int | None = None) -> dict:
        """Run until ``cfg.steps`` (or stop early after step ``until``, writing a checkpoint there, as
        an interruption would); evaluate, log and checkpoint on schedule; return the last record
        (on ranks other than 0: without the evaluation metrics). SIGINT/SIGTERM stop between two
        steps with a checkpoint (:mod:`mnemo.train.interrupts`). A run resumed past ``cfg.steps``
        trains nothing and returns ``{}``, with a warning naming ``steps``.

        Raises:
            ValueError: ``until`` is not ``None`` or an int ``>= 0`` (a step number)."""
        if until is not None and (isinstance(until, bool) or not isinstance(until, int) or until < 0):
            raise ValueError(f"until: expected None or an int >= 0 (the step to stop after), got {until!r}")
        stop = self.cfg.steps if until is None else min(until, self.cfg.steps)
        if self.is_main and self.step > self.cfg.steps:  # (a resumed run is never cut back)
            warnings.warn(
                f"steps: the run is already at step {self.step}, past steps={self.cfg.steps}: fit() trains "
                f"nothing and returns no record (the run is not cut back); raise steps above {self.step} "
                "to continue it (resume with reschedule), or start a new run",
                stacklevel=2,
            )
        lock = self.run_folder.open() if self.is_main else None  # (None: another rank, or no fcntl)
        with lock or contextlib.nullcontext(), self.interrupts:  # the lock is released at the end
            if self.last_checkpoint is None:  # a new run: never into the checkpoints of another one
                self.run_folder.refuse_other_run()
                # nor into the log of a run that wrote no checkpoint (before this trainer's first
                # step: after it, the log is its own, e.g. a second fit() after a failed one)
                if self.is_main and self.step == 0:
                    self.run_folder.set_aside_unfinished_log()
            return self._fit(stop)

    def _fit(self, stop: int) -> dict:
        cfg = self.cfg
        self.train_model.train()
        tokens_per_step = cfg.batch_size * cfg.seq_len  # the global batch: global tokens/s
        bar = ProgressBar(cfg, self.step, enabled=self.progress and self.is_main, task=self.task is not None)
        record: dict = {}
        t_start = time.perf_counter()
        try:
            while self.step < stop and not self.early_stopped:
                if self.interrupts.requested is not None:  # a checkpoint of every finished step, then stop
                    saved = RunFolder.saved_step(self.last_checkpoint)
                    if self.is_main and self.step > 0 and self.step != saved:
                        # as every scheduled checkpoint: never one of weights that overflowed
                        bad = self.strategy.nonfinite_parameters(self.model)
                        if bad:
                            raise self._diverged("weights", math.nan, _nonfinite_weights(bad), step=self.step)
                        self._write_checkpoint()
                    raise interrupted(self.interrupts.requested, self.step, self.last_checkpoint)
                t0 = time.perf_counter()
                loss = self.train_step()
                dt = time.perf_counter() - t0
                self.meter.add(loss, tokens_per_step, dt)
                bar.update(loss, tokens_per_step / dt)
                last = self.step == cfg.steps
                evaluate = self.step % cfg.eval_interval == 0 or last
                save = self.step % cfg.ckpt_every == 0 or last or self.step == stop
                if evaluate or save:  # never evaluate or checkpoint weights that overflowed
                    bad = self.strategy.nonfinite_parameters(self.model)
                    if bad:
                        raise self._diverged("weights", math.nan, _nonfinite_weights(bad), step=self.step)
                if evaluate:
                    # the interval's training metrics (and a new interval), the auxiliary losses' metrics
                    record = self.meter.record(self.step, self.last_lr, self.aux_losses.record())
                    if self.is_main or self.fsdp:  # FSDP: every rank runs the (sharded) model
                        record = self._eval_record(record, last, t_start, bar)
                    if self.evaluator.stops_early(record, last, self.strategy.agree, announce=self.is_main):
                        self.early_stopped = save = True  # (the checkpoint resumes as stopped)
                if save:
                    if self.is_main or self.fsdp:
                        self._write_checkpoint()
                    else:
                        self.last_checkpoint = self.out / ckpt_name(self.step)
                if evaluate or save:
                    barrier()  # the other ranks wait while rank 0 evaluates and writes
                if self.early_stopped:
                    break
            if self.interrupts.requested is not None:  # asked during the last step, which is saved
                e = interrupted(self.interrupts.requested, self.step, self.last_checkpoint)
                if self.step >= cfg.steps or self.early_stopped:
                    e.then = f"; the run had reached its end (step {self.step}): nothing is left to resume"
                raise e
        finally:
            bar.close()
            self.logbook.close()
        return record

    def _eval_record(self, record: dict, last: bool, t_start: float, bar: ProgressBar) -> dict:
        """Rank 0: evaluate, complete the interval's ``record``, run the callbacks, log and print
        it. Under FSDP every rank calls this (the sharded model needs all of them, in the
        evaluation and in callbacks that run it); only rank 0 logs and prints."""
        # FSDP: every rank is here and an evaluation is collective, so rank 0 decides an early stop
        agree = self.strategy.agree if self.fsdp else bool
        try:
            ev = self.evaluator.during_training(self.evaluate, last, agree)
        except NonFiniteError as e:  # an op of the evaluation found NaN/inf: the run diverged
            raise self._diverged("validation loss", math.nan, _nonfinite_detail(e), step=self.step) from e
        record = evaluation_record(record, ev, elapsed_s=time.perf_counter() - t_start)
        record = self.callbacks.merge(self, record)  # what the callbacks add (e.g. circuit scores)
        with self._writing(f"the metrics of step {self.step} ({self.out / METRICS_NAME})"):
            self.logbook.log(record, bar)  # rank 0: metrics.jsonl, TensorBoard, yours, the summary line
        return record

    def sample(
        self,
        prompt: str | None = None,
        max_new_tokens: int | None = None,
        *,
        seed: int | None = None,
        temperature: float | None = None,
    ) -> str:
        """Generate text from ``prompt`` with the current model (text runs only; what is ``None``
        comes from the run's config: :func:`~mnemo.train.generation.sample_run`). The text ends
        before the tokenizer's end-of-text token (a BPE run's ``<|endoftext|>``), as ``mnemo
        generate`` ends it. Raises ``ValueError`` for a task run (no tokenizer)."""
        args = (self.cfg, self.model, self.tokenizer, self.device, prompt, max_new_tokens)
        return sample_run(*args, seed=seed, temperature=temperature)
