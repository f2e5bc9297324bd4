"""The training loop: AdamW, warm-up + cosine schedule, clipping, evaluation, exact resume."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import math
import os
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import save_model
from tqdm.auto import tqdm

from ..data import build_tokenizer, load_corpus
from ..data.tasks import IGNORE_INDEX, make_generator
from ..data.tokenizer import load_tokenizer, save_tokenizer
from ..models import LanguageModel, build_config
from ..models.lm import CONFIG_NAME, WEIGHTS_NAME
from ..ops._common import NonFiniteError
from .checkpoint import (
    STATE_NAME,
    TRAIN_CONFIG_NAME,
    atomic_write_text,
    ckpt_name,
    clean_stale_temporaries,
    load_json,
    load_trainer_state,
    resolve_checkpoint,
    save_checkpoint,
    save_torch,
)
from .config import TrainConfig
from .distributed import (
    _check_recurrent,
    backend_for,
    barrier,
    context_parallel_forward,
    init_from_env,
    local_device,
    shard,
)
from .memory_estimate import check_forward_memory, check_memory, check_sequences_memory, estimate_memory
from .optim import lr_factor, make_optimizer
from .sharded import is_sharded, load_sharded, save_sharded_checkpoint, shard_model
from .task_eval import evaluate_task

METRICS_NAME = "metrics.jsonl"


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm became NaN/inf; ``step`` is the step it happened at."""

    def __init__(
        self,
        step: int,
        what: str,
        value: float,
        last_checkpoint: Path | None,
        detail: str | None = None,
        precision: str = "fp32",
    ):
        self.step, self.what, self.value = step, what, value
        where = (
            f"the last good checkpoint is {last_checkpoint}"
            if last_checkpoint
            else "no checkpoint was written yet"
        )
        if detail:
            where = f"{detail}; {where}"
        super().__init__(
            f"training stopped at step {step}: the {what} became {value} ({where}); "
            + (
                "try a lower --lr, a smaller model, or --precision fp32"
                if precision == "bf16"
                else "try a lower --lr or a smaller model"
            )
        )


def _nonfinite_detail(e: Exception) -> str:
    """An op's NaN/inf report without its advice to turn the check off (which would only hide a
    diverged run): e.g. ``"an op's input A contains 0 NaN and 34 inf of 1024 values"``."""
    return "an op's input " + str(e).split(";")[0]


class _Logits(torch.nn.Module):
    """The training forward: ``input_ids -> logits``. DDP wraps this rather than the model, since
    the per-layer states the model also returns depend on parameters the loss may not (e.g. CMS
    levels), and DDP would wait for their gradients."""

    def __init__(self, model: LanguageModel):
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: torch.Tensor,
        first: torch.Tensor | None = None,
        logits_at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if first is None:
            return self.model(input_ids, logits_at=logits_at)[0]
        return packed_logits(self.model, input_ids, first)


def fixed_train_set(
    task, n: int, seq_len: int, seed: int, chunk: int = 4096
) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` training sequences of ``task`` (``(input_ids, targets)``, ``[n, seq_len]`` int32),
    drawn in chunks of ``chunk`` rows (default ``chunk=4096``) from the train seed stream of ``seed``
    (the stream fresh batches come from; never the test stream): the fixed set of
    ``TrainConfig.train_examples``."""
    gen = make_generator(seed, "train")
    xs, ys = [], []
    for start in range(0, n, chunk):
        x, y = task.generate(min(chunk, n - start), seq_len, gen)
        xs.append(x.to(torch.int32))
        ys.append(y.to(torch.int32))
    return torch.cat(xs), torch.cat(ys)


def fixed_batch(train_set: tuple[torch.Tensor, torch.Tensor], step: int, batch_size: int):
    """The batch of optimizer step ``step`` (0-based) from a fixed training set: rows
    ``[i·B, (i+1)·B)`` with ``i = step mod (n // B)`` — the set read in order, epoch after epoch,
    without shuffling (a last partial batch is skipped). Returns long tensors ``[B, T]``."""
    x, y = train_set
    i = step % (x.shape[0] // batch_size)
    rows = slice(i * batch_size, (i + 1) * batch_size)
    return x[rows].long(), y[rows].long()


def packed_logits(model: LanguageModel, input_ids: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """Logits ``[B, T, vocab]`` of windows whose documents are separate sequences: the rows are
    packed into one ``[1, B·T]`` row with ``cu_seqlens`` at every ``first`` (``[B, T]`` bool, true
    where a sequence begins; column 0 always true)."""
    B, T = input_ids.shape
    flat = first.reshape(-1).clone()
    flat[::T] = True
    cu = torch.cat([flat.nonzero()[:, 0], flat.new_tensor([B * T], dtype=torch.long)])
    logits, _ = model(input_ids.reshape(1, B * T), cu_seqlens=cu)
    return logits.reshape(B, T, -1)


LOCK_NAME = ".lock"


# Settings a resumed run may change: none changes the model, the data, the batches or the update
# rule (grad_accum and the parallel layouts give the same gradients). ``steps`` also moves the
# end of the cosine unless ``schedule_steps`` pins it, which must be chosen (``reschedule``).
RESUMABLE = (
    "steps",
    "schedule_steps",
    "eval_interval",
    "checkpoint_interval",
    "eval_batches",
    "device",
    "sample_tokens",
    "sample_prompt",
    "sample_temperature",
    "tensorboard",
    "eval_lengths",
    "track_circuits",
    "circuit_length",
    "track_spectrum",
    "grad_accum",
    "context_parallel",
    "fsdp",
    "activation_checkpointing",
)
RESCHEDULE = ("stretch", "hold")


def resume_config(
    saved: TrainConfig,
    given: TrainConfig | dict | None,
    reschedule: str | None = None,
    step: int | None = None,
) -> tuple[TrainConfig, list[str]]:
    """The configuration of a resumed run, and one line per setting that changes.

    ``saved`` is the checkpoint's configuration; every setting keeps its saved value unless
    ``given`` changes it: a dict holds only the settings to change (what ``mnemo train --resume``
    passes: the flags actually given; dict-valued settings such as ``model_overrides`` change key
    by key), a :class:`TrainConfig` is compared field by field, ``None``
    changes nothing. Only the :data:`RESUMABLE` fields may change (they leave the model, data,
    batches and update rule alone); any other difference raises ``ValueError`` naming the field.

    The learning rate follows a warm-up + cosine over ``cosine_steps`` (``schedule_steps`` or
    ``steps``). When new ``steps`` would move the end of that cosine, ``reschedule`` must say what
    happens, else ``ValueError`` naming both choices (``step``, the resumed step, only sets where
    the note on the learning rate is taken; default the saved ``steps``):

    * ``"stretch"``: the cosine is recomputed over the new ``steps`` — the learning rate at the
      resumed step jumps to its value on the longer (or shorter) cosine;
    * ``"hold"``: the cosine keeps its saved length (``schedule_steps`` is pinned to it); past its
      end the learning rate stays at ``lr · min_lr_ratio``.
    """
    if reschedule is not None and reschedule not in RESCHEDULE:
        raise ValueError(f"reschedule: expected one of {RESCHEDULE} or None, got {reschedule!r}")
    if given is None:
        changes = {}
    elif isinstance(given, TrainConfig):
        changes = {
            f.name: getattr(given, f.name)
            for f in dataclasses.fields(TrainConfig)
            if getattr(given, f.name) != getattr(saved, f.name)
        }
    elif isinstance(given, dict):
        known = {f.name for f in dataclasses.fields(TrainConfig)}
        unknown = sorted(set(given) - known, key=str)
        if unknown:
            raise ValueError(f"unknown TrainConfig field(s) {unknown}; known fields: {sorted(known)}")
        given = {  # nested settings change key by key
            k: {**getattr(saved, k), **v}
            if isinstance(v, dict) and isinstance(getattr(saved, k), dict)
            else v
            for k, v in given.items()
        }
        changes = {k: v for k, v in given.items() if v != getattr(saved, k)}
    else:
        raise TypeError(f"cfg: expected a TrainConfig, a dict of changes or None, got {type(given).__name__}")
    fixed = sorted(k for k in changes if k not in RESUMABLE)
    if fixed:
        k = fixed[0]
        raise ValueError(
            f"TrainConfig.{k}: a resumed run keeps {k} = {getattr(saved, k)!r} (got {changes[k]!r}); "
            f"only {', '.join(RESUMABLE)} may change on resume — start a new run "
            "(e.g. with --init-from) to change it"
        )
    cfg = dataclasses.replace(saved, **changes).validate()
    notes = [f"{k} {getattr(saved, k)!r} -> {v!r}" for k, v in changes.items() if k != "schedule_steps"]
    step_lr = lambda c, s: c.lr * lr_factor(s, c.warmup_steps, c.cosine_steps, c.min_lr_ratio)  # noqa: E731
    if cfg.cosine_steps != saved.cosine_steps or reschedule is not None:
        stretched = dataclasses.replace(cfg, schedule_steps=None)
        held = dataclasses.replace(cfg, schedule_steps=saved.cosine_steps)
        if reschedule is None and "schedule_steps" not in changes:
            raise ValueError(
                f"TrainConfig.steps: {saved.steps} -> {cfg.steps} moves the end of the cosine "
                f"learning-rate schedule (now {saved.cosine_steps} steps); say what should happen: "
                f"--reschedule stretch (a cosine over {cfg.steps} steps) or --reschedule hold (keep "
                f"the {saved.cosine_steps}-step cosine, then lr · min_lr_ratio = "
                f"{saved.lr * saved.min_lr_ratio:.3g})"
            )
        if reschedule is not None:
            cfg = stretched if reschedule == "stretch" else held
        notes.append(f"learning-rate cosine over {cfg.cosine_steps} steps (was {saved.cosine_steps})")
        at = saved.steps if step is None else step
        notes.append(
            f"lr at step {at}: {step_lr(saved, at):.3g} on the saved schedule, {step_lr(cfg, at):.3g} now"
        )
    return cfg, notes


def _count_parameters(model_cfg) -> int:
    """Parameters of the model ``model_cfg`` describes, counted on the meta device (nothing is
    allocated; 0 if a layer cannot be built there — the estimate then leaves parameters out)."""
    try:
        with torch.device("meta"):
            return LanguageModel(model_cfg).num_parameters()
    except Exception:  # a layer that computes with its tensors at construction
        return 0


def lock_run_folder(out: Path):
    """Take the run folder ``out`` for this process: an exclusive advisory lock on ``out/.lock``
    (``flock``), held until the returned file is closed. The kernel drops the lock when its process
    dies, so a crashed run's lock is taken over without ceremony. On systems without ``fcntl`` this
    is a no-op.

    Raises:
        ValueError: another live process holds the folder (the message names its pid).
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        return None
    f = open(out / LOCK_NAME, "a+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise ValueError(
            f"run folder {out} is in use by another training process (pid {holder}); wait for it to "
            "finish, or pick another --out"
        ) from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


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

    ``callbacks``: functions ``f(trainer, record) -> dict | None`` called after every evaluation,
    before the record is written; a returned dict is merged into the record (e.g. circuit scores
    tracked during training). They must not touch the RNG streams the trainer uses. Instead of a
    sequence, ``callbacks`` may be a factory ``f(cfg) -> sequence of callbacks``, called once with
    the run's resolved :class:`TrainConfig` (for a resumed run: the saved one with its changes).
    ``cfg.track_circuits`` needs a callback that tracks the circuits (one with
    ``tracks_circuits = True``): this package does not import :mod:`mnemo.interp`, so pass
    ``callbacks=[mnemo.interp.CircuitTracker(length=cfg.circuit_length)]`` or the factory
    ``callbacks=mnemo.interp.circuit_callbacks`` (what ``mnemo train`` and ``mnemo sweep`` do);
    without one the trainer raises ``ValueError``.

    **Data parallelism.** Launched by ``torchrun --nproc_per_node N`` (gloo on CPU, nccl on CUDA,
    one GPU per process), the trainer joins the process group and wraps the model in
    ``DistributedDataParallel`` (``self.model`` stays the plain :class:`LanguageModel`, used for
    evaluation, checkpoints and sampling). Every rank draws the same global batch of
    ``cfg.batch_size`` rows from the same generator — so the generator state is rank-independent
    and a checkpoint resumes on any number of processes — and trains on its ``batch_size / N``
    rows, in ``cfg.grad_accum`` micro-batches. The loss is the summed cross-entropy divided by
    the global number of supervised tokens, so the gradient (and the logged loss, the global mean)
    equal the single-process run's up to float rounding. Only rank 0 evaluates, writes
    checkpoints, ``metrics.jsonl`` and TensorBoard events, prints and shows the progress bar; the
    other ranks wait at a barrier meanwhile, and ``fit`` returns them the record without the
    evaluation metrics. ``rank``, ``world`` and ``is_main`` tell where a trainer runs.

    **Context parallelism** (``cfg.context_parallel``). Under torchrun
    every rank trains on the whole global batch but only on its slice of each sequence — tokens
    ``[r·T/N, (r+1)·T/N)`` — through :func:`~mnemo.train.distributed.context_parallel_forward`
    (the states cross ranks forward, their gradients backward). The loss of a rank is its slice's
    summed cross-entropy divided by the global supervised-token count; the parameter gradients
    are then summed over ranks with ``all_reduce`` (no DDP), so the update equals the
    single-process run's. ``grad_accum`` splits the global batch into micro-batches; each one's
    states and gradients cross ranks in its own forward/backward, the parameter gradients are
    summed once per step. Softmax-attention layers run ring attention (their key/value blocks
    circulate over the ranks), recurrent layers relay their states, layer by layer, so
    transformers and hybrids train this way too; what the ring cannot carry (attention sinks, an
    attention block with a CMS) is rejected here naming the layer (on any number of processes);
    with one process the flag changes nothing.

    **Sharded training** (``cfg.fsdp``, :mod:`mnemo.train.sharded`). As data parallelism, but the
    blocks and the root are sharded with FSDP2 (``fully_shard``) instead of wrapped in DDP; the
    optimizer holds shards. Every rank evaluates and runs the callbacks (the sharded model needs
    all ranks), rank 0 logs; checkpoints are DCP shards written by every rank, resumed on any
    number of processes (a single-file checkpoint is not resumed sharded: start with
    ``init_from``).
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
    ):
        self.out = Path(out_dir)
        self.progress, self.log = progress, log
        cfg, ckpt, state, notes = self._resolve_config(cfg, resume, reschedule)
        self._join_processes(cfg, notes)  # sets self.cfg
        self.callbacks = self._make_callbacks(callbacks)
        vocab_size = self._setup_data(ckpt if state is not None else None)
        self._build_model(vocab_size)
        self._setup_optimizer()
        if state is not None:
            self._restore_state(ckpt, state)
        elif self.cfg.init_from is not None:
            self._init_weights(self.cfg.init_from)
        self._setup_wrappers()

    # ------------------------------------------------------------------------------------------
    # construction, in order: configuration, processes, callbacks, data, model, optimizer, state,
    # wrappers (the order of the RNG draws is part of exact resume: keep it)
    def _resolve_config(
        self, cfg, resume: bool, reschedule: str | None
    ) -> tuple[TrainConfig, Path | None, dict | None, list[str]]:
        """``(cfg, checkpoint, trainer state, notes)``: a fresh run's configuration (``None`` or a
        dict of fields builds a :class:`TrainConfig`), or for ``resume`` the newest intact
        checkpoint's configuration with ``cfg``'s changes (:func:`resume_config`), its trainer state
        and one note per change (printed once the rank is known)."""
        notes: list[str] = []
        if resume:
            ckpt = resolve_checkpoint(self.out, verify=True, warn=notes.append)
            saved = TrainConfig.from_dict(load_json(ckpt / TRAIN_CONFIG_NAME))
            state = load_trainer_state(ckpt)
            cfg, changed = resume_config(saved, cfg, reschedule, step=state["step"])
            notes += [f"resume: {c}" for c in changed]
            return cfg, ckpt, state, notes
        if cfg is None or isinstance(cfg, dict):
            cfg = TrainConfig.from_dict(cfg or {})
        elif reschedule is not None:
            raise ValueError("reschedule: applies to a resumed run (resume=True) only")
        return cfg, None, None, notes

    def _join_processes(self, cfg: TrainConfig, notes: list[str]) -> None:
        """Join the process group (under torchrun), print ``notes`` on rank 0, validate ``cfg``
        (``self.cfg``) and check that the batch or the sequences split over the processes."""
        self.device = local_device(torch.device(cfg.device))  # cuda:LOCAL_RANK under torchrun
        self.rank, self.world = init_from_env(backend_for(self.device))
        self.is_main = self.rank == 0
        for note in notes if self.is_main else ():
            self.log(note)
        self.cfg = cfg.validate()
        # context parallelism splits the sequences, not the batch
        self.context_parallel = cfg.context_parallel and self.world > 1
        self.fsdp = cfg.fsdp and self.world > 1  # sharded parameters (mnemo.train.sharded)
        if self.context_parallel and cfg.seq_len % self.world:
            raise ValueError(
                f"TrainConfig.seq_len: context parallelism over {self.world} processes needs a "
                f"multiple of {self.world}, got {cfg.seq_len}"
            )
        if not self.context_parallel and cfg.batch_size % (self.world * cfg.grad_accum):
            raise ValueError(
                f"TrainConfig.batch_size: the global batch ({cfg.batch_size}) must be a multiple of "
                f"the number of processes ({self.world}) x grad_accum ({cfg.grad_accum}) = "
                f"{self.world * cfg.grad_accum}"
            )

    def _make_callbacks(self, callbacks) -> list:
        """The evaluation callbacks: ``callbacks`` itself, or, when it is callable (a factory),
        what it returns for the run's configuration. ``cfg.track_circuits`` needs one that tracks
        the circuits (``tracks_circuits = True``): this package does not import :mod:`mnemo.interp`
        (DESIGN.md §2), so the caller supplies it."""
        cfg = self.cfg
        made = list(callbacks(cfg) if callable(callbacks) else callbacks)
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

    def _setup_data(self, ckpt: Path | None) -> int:
        """The task, or the text corpus with its tokenizer (the checkpoint's ``ckpt`` on resume,
        else built from the text) and train/validation streams; returns the vocabulary size."""
        cfg = self.cfg
        self.task = cfg.build_task()
        self._test_sets: dict = {}
        if self.task is not None:
            self.tokenizer = self.train_data = self.val_data = None
            self.train_set = None
            if cfg.train_examples is not None:
                check_sequences_memory(cfg.train_examples, cfg.seq_len, "cpu", flag="--train-examples")
                self.train_set = fixed_train_set(self.task, cfg.train_examples, cfg.seq_len, cfg.seed)
            return self.task.vocab_size
        corpus = load_corpus(cfg.data, cfg.text_field)
        if ckpt is not None:
            self.tokenizer = load_tokenizer(ckpt)
        else:  # a char vocabulary is read from the text; byte and tokenizer files need none
            self.tokenizer = build_tokenizer(cfg.tokenizer, corpus.text if cfg.tokenizer == "char" else "")
        if cfg.pack_documents and len(corpus) < 2 and self.is_main:
            warnings.warn(
                f"pack_documents: {cfg.data!r} is a single document, so packing changes nothing "
                "(JSONL/Parquet corpora give one document per record)",
                stacklevel=2,
            )
        train_docs, val_docs = corpus.split()
        # documents joined by the end-of-text token (char/byte: "\n\n"); .doc_starts keeps them
        self.train_data = train_docs.stream(self.tokenizer, cfg.seq_len)
        self.val_data = val_docs.stream(self.tokenizer, cfg.seq_len)
        self.val_chars = self.val_data.num_chars
        return self.tokenizer.vocab_size

    def _build_model(self, vocab_size: int) -> None:
        """Seed and build ``self.model`` on the device, after checking that the learned positions
        cover the lengths, that a step fits in memory, and (context parallelism) that the model
        can run context-parallel; warns about CMS periods the training length never reaches."""
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        model_cfg = build_config(cfg.model, vocab_size=vocab_size, **cfg.model_overrides)
        if model_cfg.pos_embedding == "learned":
            longest = max([cfg.seq_len, *cfg.eval_lengths])
            if longest > model_cfg.max_position:
                name = "eval_lengths" if longest > cfg.seq_len else "seq_len"
                raise ValueError(
                    f"TrainConfig.{name}: {longest} tokens exceed the learned positions of model "
                    f"{cfg.model!r} (max_position = {model_cfg.max_position}); raise "
                    "model_overrides.max_position"
                )
        cp_world = self.world if self.context_parallel else 1
        rows = cfg.batch_size // ((1 if self.context_parallel else self.world) * cfg.grad_accum)
        est = estimate_memory(
            n_params=_count_parameters(model_cfg),
            vocab_size=vocab_size,
            d_model=model_cfg.d_model,
            n_layers=model_cfg.n_layers,
            batch_size=cfg.batch_size,
            micro_rows=rows,
            seq_len=cfg.seq_len // cp_world,
            activation_checkpointing=cfg.activation_checkpointing,
        )
        check_memory(est, self.device, what=f"a step of {cfg.batch_size:,} x {cfg.seq_len} tokens")
        if cfg.eval_lengths:  # the final evaluation's test sets at the longer lengths
            rows = cfg.eval_batches * cfg.batch_size
            for L in cfg.eval_lengths:
                check_sequences_memory(rows, L, self.device, flag="--eval-lengths")
                check_forward_memory(model_cfg, cfg.batch_size, L, self.device, flag="--eval-lengths")
        if cfg.track_circuits:  # the tracker runs one repeated random sequence (and its maps) per evaluation
            check_forward_memory(
                model_cfg, 1, 2 * cfg.circuit_length, self.device, flag="--circuit-length", maps=True
            )
        self.model = LanguageModel(model_cfg).to(self.device)
        self.model.activation_checkpointing = cfg.activation_checkpointing
        for i, block in enumerate(self.model.blocks):
            window_problems = getattr(block.mlp, "window_problems", None)
            for msg in window_problems(cfg.seq_len) if window_problems else ():
                warnings.warn(
                    f"model {cfg.model!r}, block {i}: {msg}; use periods < seq_len = {cfg.seq_len} "
                    "or a longer --seq-len",
                    stacklevel=3,
                )
        if cfg.context_parallel:
            try:
                _check_recurrent(self.model)
            except ValueError as e:
                raise ValueError(f"TrainConfig.context_parallel: model {cfg.model!r}: {e}") from None
        if self.fsdp:  # before the optimizer: it must hold the shards
            shard_model(self.model, self.device)

    def _setup_optimizer(self) -> None:
        """The optimizer, the warm-up + cosine schedule, the batch generator (seeded from
        ``cfg.seed``) and the step counters of a fresh run."""
        cfg = self.cfg
        if cfg.warmup_steps >= cfg.cosine_steps and self.is_main:
            warnings.warn(
                f"warmup_steps {cfg.warmup_steps} >= the {cfg.cosine_steps}-step learning-rate schedule: "
                f"the lr never reaches lr={cfg.lr:g} (at most "
                f"{cfg.lr * cfg.cosine_steps / cfg.warmup_steps:.3g}) and never decays; lower --warmup-steps",
                stacklevel=2,
            )
        self.optimizer = make_optimizer(self.model, cfg)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, cfg.warmup_steps, cfg.cosine_steps, cfg.min_lr_ratio)
        )
        if self.task is None:
            self.generator = torch.Generator().manual_seed(cfg.seed + 1)
        else:
            self.generator = make_generator(cfg.seed, "train")
        self.step = 0
        self.early_stopped = False  # TrainConfig.early_stop_acc reached (saved with checkpoints)
        self.last_checkpoint: Path | None = None
        self._acc_loss, self._acc_n, self._acc_tokens, self._acc_time = 0.0, 0, 0, 0.0

    def _restore_state(self, ckpt: Path, state: dict) -> None:
        """Resume: the checkpoint's weights, optimizer, schedule, generator and torch RNG states
        and step; the metrics log is cut back to that step (rank 0, under the folder's lock)."""
        from safetensors.torch import load_model

        if is_sharded(ckpt):  # DCP shards of an FSDP run: any number of processes, sharded or not
            load_sharded(ckpt, self.model, self.optimizer)
        elif self.fsdp:
            raise ValueError(
                f"TrainConfig.fsdp: {ckpt} is a single-file checkpoint; resuming it sharded is not "
                "supported (resume it without --fsdp, or start a new run with init_from)"
            )
        else:
            load_model(self.model, str(ckpt / WEIGHTS_NAME), device=str(self.device))
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.generator.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
        self.step = state["step"]
        self._acc_loss, self._acc_n = state["acc_loss"], state["acc_n"]
        self.early_stopped = bool(state.get("early_stopped", False))
        self.last_checkpoint = ckpt
        if self.is_main:  # under the folder's lock: never trim a live run's log
            lock = lock_run_folder(self.out)
            try:
                self._truncate_metrics(self.step)
            finally:
                if lock is not None:
                    lock.close()

    def _setup_wrappers(self) -> None:
        """The module the training forward runs through (DDP's wrapper with several processes;
        context parallelism synchronises the gradients itself) and, on rank 0, the TensorBoard
        writer."""
        plain = self.context_parallel or self.fsdp  # they synchronise the gradients themselves
        self.ddp = self._wrap_ddp() if self.world > 1 and not plain else None
        self.train_model = self.ddp if self.ddp is not None else _Logits(self.model)
        self.tb = None
        if self.cfg.tensorboard and self.is_main:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # pragma: no cover - depends on the environment
                raise ImportError(
                    "TrainConfig.tensorboard needs the 'tensorboard' package: pip install tensorboard"
                ) from e
            self.tb = SummaryWriter(str(self.out / "tb"))

    # ------------------------------------------------------------------------------------------
    def _init_weights(self, source: str) -> None:
        """Start from the weights of another run (``TrainConfig.init_from``): same model shapes
        required; the optimizer, schedule and data stream start fresh."""
        from safetensors.torch import load_model

        ckpt = resolve_checkpoint(source)
        try:
            if is_sharded(ckpt):
                load_sharded(ckpt, self.model)
            elif self.fsdp:  # every process reads the whole file and keeps its shards
                from safetensors.torch import load_file
                from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

                full = load_file(str(ckpt / WEIGHTS_NAME), device=str(self.device))
                set_model_state_dict(self.model, full, options=StateDictOptions(full_state_dict=True))
            else:
                load_model(self.model, str(ckpt / WEIGHTS_NAME), device=str(self.device))
        except RuntimeError as e:  # missing/unexpected keys or shape mismatches
            raise ValueError(
                f"TrainConfig.init_from: the weights in {ckpt} do not fit model {self.cfg.model!r} "
                f"(it needs the same architecture, width, depth and vocabulary): {e}"
            ) from None

    def _wrap_ddp(self) -> torch.nn.parallel.DistributedDataParallel:
        """``DistributedDataParallel(self.model)``; DDP searches for unused parameters every step
        only when a probe forward/backward (one zero sequence of the training length) leaves some
        without a gradient (e.g. CMS levels that update less often than once per sequence), or when
        packed documents meet a CMS (a document may be shorter than a level's period)."""
        probe = torch.zeros(1, self.cfg.seq_len, dtype=torch.long, device=self.device)
        logits, _ = self.model(probe)
        logits.float().sum().backward()
        unused = any(p.requires_grad and p.grad is None for p in self.model.parameters())
        # packed documents can be shorter than a CMS level's period: such a level may then get no
        # gradient in a step although the full-length probe reached it
        unused = unused or (self.cfg.pack_documents and any(b.stateful_mlp for b in self.model.blocks))
        self.model.zero_grad(set_to_none=True)
        ddp = torch.nn.parallel.DistributedDataParallel
        # buffers are constants (rotary frequencies, fixed decays): no per-forward broadcast
        # (``forward_sync_buffers`` replaces the deprecated ``broadcast_buffers`` in newer torch)
        no_sync_buffers = (
            {"forward_sync_buffers": False}
            if "forward_sync_buffers" in inspect.signature(ddp.__init__).parameters
            else {"broadcast_buffers": False}
        )
        return ddp(
            _Logits(self.model),
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            find_unused_parameters=unused,
            **no_sync_buffers,
        )

    def _autocast(self):
        if self.cfg.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @torch.no_grad()
    def evaluate(self, max_batches: int | None = None, *, lengths: list[int] | None = None) -> dict:
        """Mean validation loss (nats/token) and bits per character over ``max_batches`` batches.

        For a task: ``val_loss``, ``val_acc`` and ``val_seq_acc`` on the supervised positions of
        ``max_batches · batch_size`` test sequences (all ``eval_batches`` when ``None``), plus
        ``val_loss@L``, ``val_acc@L`` and ``val_seq_acc@L`` for each of ``lengths``.
        """
        if self.task is not None:
            return self._evaluate_task(max_batches, lengths or [])
        was = self.model.training
        self.model.eval()
        total, count = 0.0, 0
        pack = self.cfg.pack_documents
        for batch in self.val_data.eval_batches(self.cfg.batch_size, max_batches, with_documents=pack):
            x, y = batch[0].to(self.device), batch[1].to(self.device)
            with self._autocast():
                if pack:
                    logits = packed_logits(self.model, x, batch[2].to(self.device))
                else:
                    logits, _ = self.model(x)
            total += torch.nn.functional.cross_entropy(
                logits.float().flatten(0, 1), y.flatten(), reduction="sum"
            ).item()
            count += y.numel()
        self.model.train(was)
        val_loss = total / max(count, 1)
        # bits per character: tokens per character of the validation text (1 for char-level)
        tokens_per_char = self.val_data.ids.numel() / max(self.val_chars, 1)
        return {
            "val_loss": val_loss,
            "val_bpc": val_loss * tokens_per_char / math.log(2),
            "val_tokens": count,  # the first eval_batches · batch_size windows of the split
        }

    def _evaluate_task(self, max_batches: int | None, lengths: list[int]) -> dict:
        cfg = self.cfg
        n = cfg.batch_size * (cfg.eval_batches if max_batches is None else min(max_batches, cfg.eval_batches))
        wanted = [cfg.seq_len] + [L for L in lengths if L != cfg.seq_len]
        res = evaluate_task(
            self.model,
            self.task,
            wanted,
            num_samples=n,
            batch_size=cfg.batch_size,
            train_len=cfg.seq_len,
            seed=cfg.seed,
            device=self.device,
            autocast=self._autocast,
            cache=self._test_sets,
        )
        main = res[cfg.seq_len]
        out = {"val_loss": main["loss"], "val_acc": main["acc"], "val_seq_acc": main["seq_acc"]}
        for L in lengths:
            r = res[L]
            out.update(
                {f"val_loss@{L}": r["loss"], f"val_acc@{L}": r["acc"], f"val_seq_acc@{L}": r["seq_acc"]}
            )
        return out

    def _write_checkpoint(self) -> Path:
        """Rank 0 writes the checkpoint (FSDP: every rank calls this and writes its shards)."""
        cfg = self.cfg
        sharded = self.fsdp

        def write(tmp: Path):
            self.model.config.save(tmp / CONFIG_NAME)
            if not sharded:  # else the weights and optimizer state are DCP shards
                save_model(self.model, str(tmp / WEIGHTS_NAME))
            if self.tokenizer is not None:
                save_tokenizer(self.tokenizer, tmp)
            (tmp / TRAIN_CONFIG_NAME).write_text(json.dumps(cfg.to_dict(), indent=2))
            save_torch(
                {
                    "step": self.step,
                    **({"sharded": True} if sharded else {"optimizer": self.optimizer.state_dict()}),
                    "scheduler": self.scheduler.state_dict(),
                    "generator": self.generator.get_state(),
                    "torch_rng": torch.get_rng_state(),
                    "acc_loss": self._acc_loss,
                    "acc_n": self._acc_n,
                    "early_stopped": self.early_stopped,
                },
                tmp / STATE_NAME,
            )

        if sharded:
            self.last_checkpoint = save_sharded_checkpoint(
                self.out, self.step, self.model, self.optimizer, write
            )
        else:
            self.last_checkpoint = save_checkpoint(self.out, self.step, write)
        return self.last_checkpoint

    def _saved_step(self) -> int | None:
        """The step of the newest checkpoint written by this run (``None`` before any)."""
        if self.last_checkpoint is None:
            return None
        try:
            return int(Path(self.last_checkpoint).name.split("-")[-1])
        except ValueError:
            return None

    def _truncate_metrics(self, step: int) -> None:
        p = self.out / METRICS_NAME
        if not p.is_file():
            return
        keep = []
        for line in p.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    keep.append(line)
            except json.JSONDecodeError:
                continue  # a torn last line from a crash
        atomic_write_text(p, "".join(line + "\n" for line in keep))

    def _log_metrics(self, record: dict) -> None:
        with open(self.out / METRICS_NAME, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, record["step"])

    # ------------------------------------------------------------------------------------------
    def train_step(self) -> float:
        """One optimizer step on a fresh global batch; returns its loss (the mean over the global
        batch's supervised tokens, the same on every rank). Raises :class:`TrainingDiverged` (on
        every rank alike). A model with MoE layers also optimises their auxiliary losses
        (:meth:`_moe_aux_scale`); the returned loss stays the cross-entropy, the auxiliary values
        are logged as ``moe_aux_loss`` / ``moe_z_loss``, and the balancing bias steps after the
        optimizer (:meth:`_moe_after_step`).

        Host reads. On the CPU each micro-batch's loss is read and checked before its backward, and
        the gradient norm after the last one (``grad_accum + 1`` reads), as are the ops' own NaN/inf
        input checks (:func:`mnemo.ops.check_finite`). On another device with one process the step
        reads **one** value pair, once: the summed loss and the gradient norm, after the last
        backward and before the optimizer step (the ops' checks are off there, and the MoE
        statistics stay on the device until they are logged). A NaN/inf loss or norm raises
        :class:`TrainingDiverged` with the step, as on the CPU; the optimizer has not stepped. With
        several processes the per-micro-batch agreement of the ranks stays as it is."""
        cfg = self.cfg
        first = None
        if self.task is None and cfg.pack_documents:
            x, y, first = self.train_data.sample(cfg.batch_size, self.generator, with_documents=True)
        elif self.task is None:
            x, y = self.train_data.sample(cfg.batch_size, self.generator)
        elif self.train_set is not None:
            x, y = fixed_batch(self.train_set, self.step, cfg.batch_size)
        else:
            x, y = self.task.generate(cfg.batch_size, cfg.seq_len, self.generator)
        # every rank holds the whole global batch, so the global count needs no communication
        n_tokens = max(int((y != IGNORE_INDEX).sum()), 1)
        cp = self.context_parallel
        if cp:  # every row, this rank's slice of the targets (the inputs are cut by the forward)
            n = cfg.seq_len // self.world
            y = y[:, self.rank * n : (self.rank + 1) * n]
            scale = 1 / n_tokens  # sum / global count; the gradients are summed over ranks
        else:
            # sum / global count; DDP averages gradients over ranks, hence the factor world
            scale = self.world / n_tokens
            x, y = shard(x, self.rank, self.world), shard(y, self.rank, self.world)
            first = None if first is None else shard(first, self.rank, self.world)
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
            # gradients are all-reduced once per step, in the last micro-batch's backward
            defer = self.ddp is not None and i < cfg.grad_accum - 1
            if self.fsdp:  # FSDP2 likewise reduce-scatters in the last micro-batch's backward only
                self.model.set_requires_gradient_sync(i == cfg.grad_accum - 1)
            with self.ddp.no_sync() if defer else contextlib.nullcontext():
                error, handle = None, None
                try:
                    with self._autocast():
                        if cp:
                            logits, handle = context_parallel_forward(self.model, xi, self.rank, self.world)
                        elif first is not None:
                            logits = self.train_model(xi, first[i * micro : (i + 1) * micro].to(self.device))
                        elif sparse:  # a task's supervised positions only: no [B, T, vocab] head
                            # the mask on the host: selecting by it reads no device value
                            at = y_host != IGNORE_INDEX
                            logits, yi = self.train_model(xi, logits_at=at), y_host[at].to(self.device)
                        else:
                            logits = self.train_model(xi)
                    ce = F.cross_entropy(
                        logits.float().flatten(0, -2),
                        yi.flatten(),
                        ignore_index=IGNORE_INDEX,
                        reduction="sum",
                    )
                except NonFiniteError as e:  # an op found NaN/inf in its inputs (MNEMO_CHECK_FINITE)
                    error, ce = e, None
                if deferred and error is None:  # checked with the gradient norm, after the backward
                    part, failed = 0.0, False
                    total_dev = ce.detach() if total_dev is None else total_dev + ce.detach()
                else:
                    part, failed = self._reduce_loss(ce, error is not None)
                if failed:  # raised on every rank before any backward, so no rank waits for another
                    detail = (
                        f"in the forward pass: {_nonfinite_detail(error)}"
                        if error
                        else "in another rank's forward pass"
                    )
                    raise TrainingDiverged(
                        self.step + 1,
                        "loss",
                        math.nan,
                        self.last_checkpoint,
                        detail=detail,
                        precision=self.cfg.precision,
                    ) from error
                if not math.isfinite(part):
                    raise TrainingDiverged(
                        self.step + 1,
                        "loss",
                        part / n_tokens,
                        self.last_checkpoint,
                        precision=self.cfg.precision,
                    )
                loss = ce * scale
                aux = self.model.aux_loss()  # MoE layers' auxiliary losses of this micro-batch
                if aux is not None:
                    loss = loss + aux * self._moe_aux_scale()
                    self._moe_collect()
                try:
                    if handle is not None:
                        handle.backward(loss)  # the state gradients cross ranks here
                    else:
                        loss.backward()
                except NonFiniteError as e:  # an op's backward found NaN/inf
                    raise TrainingDiverged(
                        self.step + 1,
                        "gradient",
                        math.nan,
                        self.last_checkpoint,
                        detail=f"in the backward pass: {_nonfinite_detail(e)}",
                        precision=self.cfg.precision,
                    ) from e
            total += part
        if cp:
            self._sum_gradients()
        # after the synchronisation every rank holds the same gradients: same norm, same decision
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.fsdp:  # DTensor shards: the norm is reduced over the processes (inf: no clipping)
            norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        elif cfg.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        else:
            norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
        if deferred:  # the step's one host read: the summed loss and the gradient norm together
            summed, norm_value = torch.stack([total_dev.double(), norm.detach().double()]).tolist()
            if not math.isfinite(summed):
                raise TrainingDiverged(
                    self.step + 1,
                    "loss",
                    summed / n_tokens,
                    self.last_checkpoint,
                    precision=self.cfg.precision,
                )
            total = summed
        else:
            norm_value = norm.item()
        if not math.isfinite(norm_value):
            raise TrainingDiverged(
                self.step + 1, "gradient norm", norm_value, self.last_checkpoint, precision=self.cfg.precision
            )
        self.optimizer.step()
        self.scheduler.step()
        self._moe_after_step()
        self.step += 1
        return total / n_tokens

    # ------------------------------------------------------------------------------------------
    # mixture of experts (mnemo.layers.MoE): auxiliary losses, expert loads, bias balancing
    def _moe_aux_scale(self) -> float:
        """Weight of a micro-batch's auxiliary loss (already ``Σ_layers coef · L``). Each
        micro-batch's ``L_aux`` / ``L_z`` is computed over its own tokens (per rank), and the
        training objective adds their **mean** over the step's micro-batches and ranks: ``1 /
        grad_accum`` here, DDP's gradient average does the rest; context parallelism sums gradients
        over ranks, hence ``1 / (grad_accum · world)`` there. (With one micro-batch on one process
        this is the full batch's loss; otherwise ``f · P`` is averaged per micro-batch, not pooled.)"""
        n = self.cfg.grad_accum * (self.world if self.context_parallel else 1)
        return 1.0 / n

    def _moe_collect(self) -> None:
        """After a micro-batch's forward: add each MoE layer's assignment counts, dropped
        assignments and loss values to the step's sums (before the backward, so activation
        recomputation does not count twice)."""
        parts = [  # kept on the device: no host synchronisation per micro-batch
            torch.cat(
                [
                    m.last_counts.double(),
                    m.last_dropped.double()[None],
                    m.last_aux_loss.detach().double()[None],
                    m.last_z_loss.detach().double()[None],
                ]
            )
            for _, m in self.model.moe_layers()
        ]
        acc = getattr(self, "_moe_step_sums", None)
        self._moe_step_sums = parts if acc is None else [a + b for a, b in zip(acc, parts)]

    def _moe_after_step(self) -> None:
        """After the optimizer step: sum the step's MoE statistics over ranks (one all-reduce), take
        one auxiliary-loss-free bias step per layer with ``bias_balancing`` (its global counts, so
        every rank's bias stays equal), and add the statistics to the logging interval's."""
        acc = getattr(self, "_moe_step_sums", None)
        if acc is None:
            return
        self._moe_step_sums = None
        flat = torch.cat(acc)
        if self.world > 1:
            dist.all_reduce(flat)
        if self.world > 1 or self.device.type == "cpu":
            flat = flat.cpu()  # (a host sync off the CPU: with one process the sums stay there until logged)
        sums = list(flat.split([a.numel() for a in acc]))
        for s_, (_, m) in zip(sums, self.model.moe_layers()):
            if m.bias_balancing:
                m.update_bias(s_[:-3])
        interval = getattr(self, "_moe_interval", None)
        if interval is None:
            interval = self._moe_interval = [torch.zeros_like(s_) for s_ in sums]
        for a, s_ in zip(interval, sums):
            a += s_
        # micro-batches (× ranks) that contributed a loss value, for the interval means
        self._moe_interval_n = getattr(self, "_moe_interval_n", 0) + self.cfg.grad_accum * self.world

    def _moe_record(self) -> dict:
        """The logging interval's MoE metrics (and a reset): ``moe_load`` (per layer, the fraction
        of assignments each expert received; balanced = ``1/E``), ``moe_load_max`` / ``moe_load_min``
        (over layers and experts), ``moe_dropped`` (assignments dropped by ``capacity_factor``) and
        ``moe_dropped_frac``, ``moe_aux_loss`` / ``moe_z_loss`` (per layer and micro-batch means;
        ``moe_aux_loss`` is 1 for uniform routing). Empty without MoE layers."""
        interval = getattr(self, "_moe_interval", None)
        if interval is None:
            return {}
        n = max(getattr(self, "_moe_interval_n", 0), 1)
        self._moe_interval, self._moe_interval_n = None, 0
        loads = [(a[:-3] / a[:-3].sum().clamp_min(1)).tolist() for a in interval]
        assigned = sum(float(a[:-3].sum()) for a in interval)
        dropped = sum(float(a[-3]) for a in interval)
        flat = [v for row in loads for v in row]
        return {
            "moe_load": [[round(v, 5) for v in row] for row in loads],
            "moe_load_max": max(flat),
            "moe_load_min": min(flat),
            "moe_dropped": int(dropped),
            "moe_dropped_frac": dropped / max(assigned, 1.0),
            "moe_aux_loss": sum(float(a[-2]) for a in interval) / (n * len(interval)),
            "moe_z_loss": sum(float(a[-1]) for a in interval) / (n * len(interval)),
        }

    def _sum_gradients(self) -> None:
        """Context parallelism: sum every parameter's gradient over the ranks. Every rank issues
        the same collectives in the same order — one all-reduce of which parameters have a
        gradient, then one per parameter dtype over all of them (``None`` counts as zeros) — and
        a parameter no rank's slice reached keeps ``None``, as in a single process."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        has = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=self.device)
        dist.all_reduce(has)
        reached = has.tolist()
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, p in enumerate(params):
            by_dtype.setdefault(p.dtype, []).append(i)
        for idx in by_dtype.values():
            parts = []
            for i in idx:
                g = params[i].grad
                parts.append((g if g is not None else torch.zeros_like(params[i])).reshape(-1))
            flat = torch.cat(parts)
            dist.all_reduce(flat)
            offset = 0
            for i in idx:
                p = params[i]
                k = p.numel()
                p.grad = flat[offset : offset + k].view_as(p) if reached[i] > 0 else None
                offset += k

    def _nonfinite_parameters(self) -> list[str]:
        """Names of the parameters that hold NaN/inf (one host read; with several processes the
        ranks agree, each checking its own copy or FSDP shard)."""
        named = [(n, p.to_local() if hasattr(p, "to_local") else p) for n, p in self.model.named_parameters()]
        flags = torch.stack([torch.isfinite(p.detach()).all() for _, p in named])
        ok = flags.all()
        if self.world > 1:
            t = (~ok).to(torch.float64).reshape(1)
            dist.all_reduce(t)
            ok = t[0] == 0
        if bool(ok):
            return []
        return [n for (n, _), f in zip(named, flags.tolist()) if not f] or ["another process's shard"]

    def _agree(self, flag: bool) -> bool:
        """Rank 0's ``flag`` on every rank (one broadcast; none with a single process)."""
        if self.world == 1:
            return bool(flag)
        t = torch.tensor([float(flag)], dtype=torch.float64, device=self.device)
        dist.broadcast(t, 0)
        return bool(t.item() > 0)

    def _reduce_loss(self, ce: torch.Tensor | None, failed: bool) -> tuple[float, bool]:
        """The summed cross-entropy of this micro-batch over all ranks, and whether any rank's
        forward pass failed (one all-reduce; none with a single process)."""
        if self.world == 1:
            return (math.nan if ce is None else ce.item()), failed
        value = math.nan if ce is None else ce.detach().double()
        t = torch.tensor([0.0, float(failed)], dtype=torch.float64, device=self.device)
        t[0] = value
        dist.all_reduce(t)
        return t[0].item(), bool(t[1].item() > 0)

    def fit(self, until: int | None = None) -> dict:
        """Run until ``cfg.steps`` (or stop early after step ``until``, writing a checkpoint there, as
        an interruption would); evaluate, log and checkpoint on schedule; return the last record
        (on ranks other than 0: without the evaluation metrics)."""
        cfg = self.cfg
        stop = cfg.steps if until is None else min(until, cfg.steps)
        lock = None
        if self.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            lock = lock_run_folder(self.out)
            stale = clean_stale_temporaries(self.out)  # left by a killed run (we hold the lock)
            if stale:
                warnings.warn(
                    f"removed what a stopped run left in {self.out}: {', '.join(stale)}", stacklevel=2
                )
        try:
            with self._deferred_interrupts():
                return self._fit(stop)
        finally:
            if lock is not None:
                lock.close()  # releases the lock

    @contextlib.contextmanager
    def _deferred_interrupts(self):
        """Single process, main thread: SIGINT/SIGTERM only *request* a stop, which ``_fit`` honours
        between two steps by writing a checkpoint of the last completed step (atomically, as every
        checkpoint) and raising ``KeyboardInterrupt`` — so an interrupt loses no finished step and
        never catches the optimizer half-way. A second SIGINT interrupts at once. Several processes
        (torchrun) keep the default handlers: the ranks could not agree on the step."""
        import signal
        import threading

        self._stop_signal = None
        if self.world > 1 or threading.current_thread() is not threading.main_thread():
            yield
            return

        def request(signum, frame):
            if self._stop_signal is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt  # asked twice: stop now
            self._stop_signal = signal.Signals(signum).name

        old = {sig: signal.signal(sig, request) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)

    def _fit(self, stop: int) -> dict:
        cfg = self.cfg
        self.train_model.train()
        tokens_per_step = cfg.batch_size * cfg.seq_len  # the global batch: global tokens/s
        bar = tqdm(
            total=cfg.steps,
            initial=self.step,
            disable=not (self.progress and self.is_main),
            dynamic_ncols=True,
            desc=f"train {cfg.model}",
            unit="step",
            mininterval=0.5,
        )
        record: dict = {}
        ema = None
        t_start = time.perf_counter()
        try:
            while self.step < stop and not self.early_stopped:
                if getattr(self, "_stop_signal", None) is not None:
                    if self.is_main and self.step > 0 and self.step != self._saved_step():
                        self._write_checkpoint()
                    raise KeyboardInterrupt(
                        f"{self._stop_signal} at step {self.step}: checkpoint {self.last_checkpoint} holds "
                        "every finished step"
                    )
                t0 = time.perf_counter()
                loss = self.train_step()
                dt = time.perf_counter() - t0
                self._acc_loss += loss
                self._acc_n += 1
                self._acc_tokens += tokens_per_step
                self._acc_time += dt
                ema = loss if ema is None else 0.9 * ema + 0.1 * loss
                bar.update(1)
                bar.set_postfix(loss=f"{ema:.3f}", tok_s=f"{tokens_per_step / dt:,.0f}", refresh=False)
                last = self.step == cfg.steps
                evaluate = self.step % cfg.eval_interval == 0 or last
                save = self.step % cfg.ckpt_every == 0 or last or self.step == stop
                if evaluate or save:  # never evaluate or checkpoint weights that overflowed
                    bad = self._nonfinite_parameters()
                    if bad:
                        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
                        raise TrainingDiverged(
                            self.step,
                            "weights",
                            math.nan,
                            self.last_checkpoint,
                            detail=f"NaN/inf after the optimizer step in {', '.join(bad[:3])}{more}",
                            precision=self.cfg.precision,
                        )
                if evaluate:
                    record = {
                        "step": self.step,
                        "train_loss": self._acc_loss / max(self._acc_n, 1),
                        "tokens_per_s": self._acc_tokens / max(self._acc_time, 1e-9),
                        "lr": self.scheduler.get_last_lr()[0],
                        **self._moe_record(),
                    }
                    if self.is_main or self.fsdp:  # FSDP: every rank runs the (sharded) model
                        record = self._eval_record(record, last, t_start, bar)
                    self._acc_loss, self._acc_n, self._acc_tokens, self._acc_time = 0.0, 0, 0, 0.0
                    if cfg.early_stop_acc is not None and not last:
                        self.early_stopped = self._agree(record.get("val_acc", 0.0) >= cfg.early_stop_acc)
                        if self.early_stopped:
                            save = True
                            if self.is_main:
                                print(
                                    f"early stop at step {self.step}: val_acc {record['val_acc']:.4f} >= "
                                    f"{cfg.early_stop_acc}",
                                    flush=True,
                                )
                if save:
                    if self.is_main or self.fsdp:
                        self._write_checkpoint()
                    else:
                        self.last_checkpoint = self.out / ckpt_name(self.step)
                if evaluate or save:
                    barrier()  # the other ranks wait while rank 0 evaluates and writes
                if self.early_stopped:
                    break
        finally:
            bar.close()
            if self.tb is not None:
                self.tb.flush()
        return record

    def _eval_record(self, record: dict, last: bool, t_start: float, bar) -> dict:
        """Rank 0: evaluate, complete ``record``, run the callbacks, log and print it. Under FSDP
        every rank calls this (the sharded model needs all of them, in the evaluation and in
        callbacks that run it); only rank 0 logs and prints."""
        cfg = self.cfg
        try:
            ev = self.evaluate(cfg.eval_batches, lengths=cfg.eval_lengths if last else None)
        except NonFiniteError as e:  # an op of the evaluation found NaN/inf: the run diverged
            raise TrainingDiverged(
                self.step,
                "validation loss",
                math.nan,
                self.last_checkpoint,
                detail=_nonfinite_detail(e),
                precision=self.cfg.precision,
            ) from e
        stops = not last and bool(cfg.eval_lengths) and cfg.early_stop_acc is not None
        if stops:
            stops = ev.get("val_acc", 0.0) >= cfg.early_stop_acc
            if self.fsdp:  # every rank is here and the evaluation below is collective: rank 0 decides
                stops = self._agree(stops)
        if stops:
            # this evaluation ends the run (early stop): it is the final one, with eval_lengths
            longer = self.evaluate(cfg.eval_batches, lengths=cfg.eval_lengths)
            ev.update({k: v for k, v in longer.items() if "@" in k})
            last = True
        record = {
            "step": record["step"],
            "train_loss": record["train_loss"],
            **ev,
            "tokens_per_s": record["tokens_per_s"],
            "lr": record["lr"],
            "elapsed_s": time.perf_counter() - t_start,
            **{k: v for k, v in record.items() if k.startswith("moe_")},
        }
        for callback in self.callbacks:
            extra = callback(self, record)
            if extra:
                record.update(extra)
        if not self.is_main:
            return record
        self._log_metrics(record)
        if self.task is None:
            quality = f"({ev['val_bpc']:.3f} bpc)"
        else:
            quality = f"acc {ev['val_acc']:.4f}" + "".join(
                f"  acc@{L} {ev[f'val_acc@{L}']:.4f}" for L in cfg.eval_lengths if last
            )
        bar.write(
            f"step {self.step:>6}  train {record['train_loss']:.4f}  val {ev['val_loss']:.4f} "
            f"{quality}  {record['tokens_per_s']:,.0f} tok/s"
        )
        return record

    def sample(
        self,
        prompt: str | None = None,
        max_new_tokens: int | None = None,
        *,
        seed: int | None = None,
        temperature: float | None = None,
    ) -> str:
        """Generate text from ``prompt`` with the current model (text runs only)."""
        cfg = self.cfg
        if self.tokenizer is None:
            raise ValueError(f"no text to sample: this run trains on the task {cfg.task!r}")
        return generate_text(
            self.model,
            self.tokenizer,
            cfg.sample_prompt if prompt is None else prompt,
            cfg.sample_tokens if max_new_tokens is None else max_new_tokens,
            temperature=cfg.sample_temperature if temperature is None else temperature,
            seed=cfg.seed if seed is None else seed,
            device=self.device,
        )


def generate_text(
    model,
    tokenizer,
    prompt: str,
    max_new_tokens: int,
    *,
    temperature: float = 0.8,
    top_k: int | None = None,
    seed: int = 0,
    device="cpu",
    compile: bool = False,
) -> str:
    """Decode ``max_new_tokens`` after ``prompt`` (an empty prompt starts from a newline), sampled
    at ``temperature`` (``0``: greedy) from a generator seeded with ``seed``; ``compile``: decode
    under ``torch.compile`` (:meth:`~mnemo.models.LanguageModel.generate`). Defaults:
    ``temperature=0.8``, ``seed=0``, ``compile=False``."""
    ids = tokenizer.encode(prompt or "\n")
    gen = torch.Generator(device=device).manual_seed(seed)
    out = model.generate(
        ids[None].to(device),
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        generator=gen,
        compile=compile,
    )
    text = tokenizer.decode(out[0].cpu())
    return text if prompt else text[1:]
