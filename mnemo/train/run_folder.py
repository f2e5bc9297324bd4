"""The run folder a training run owns: the lock (one live process per folder), resuming (which
settings may change, :func:`resume_config`; the metrics log cut back to the resumed step), and
checkpoints written atomically (:mod:`mnemo.train.checkpoint`: a temporary folder renamed into
place, a manifest, ``latest``; a damaged checkpoint is skipped for the previous one on resume).

Layout of ``out/``: ``.lock`` (the pid of the process that holds it; removed when it lets go),
``metrics.jsonl`` (one evaluation record per line, :mod:`mnemo.train.sinks`), ``ckpt-<step>/``
(model config and weights or DCP shards, tokenizer, ``train_config.json``, ``trainer_state.pt``),
``latest``, ``tb/``.

Extension point: what a checkpoint holds besides the weights is the ``state`` dict the trainer
passes to :meth:`RunFolder.write_checkpoint` (restored by ``Trainer._restore_state``; parts add
their keys: :meth:`~mnemo.train.sinks.IntervalMeter.state_dict`,
:meth:`~mnemo.train.carry.CarriedState.save`); a new resumable setting goes in :data:`RESUMABLE`
(it must leave the model, data, batches and update rule alone).
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from pathlib import Path

from safetensors.torch import save_model

from ..data.tokenizer import save_tokenizer
from ..models.lm import CONFIG_NAME, WEIGHTS_NAME
from . import checkpoint
from .checkpoint import (
    LATEST,
    STATE_NAME,
    TRAIN_CONFIG_NAME,
    atomic_write_text,
    clean_stale_temporaries,
    linked_checkpoints,
    load_json,
    load_trainer_state,
    new_kept_folder,
    resolve_checkpoint,
    run_checkpoints,
    save_checkpoint,
)
from .config import TrainConfig
from .optim import algorithm1_only, schedule_factor
from .run_lock import LOCK_NAME, RunLock, _HeldAgain, lock_run_folder, take_lock_file  # noqa: F401
from .sharded import save_sharded_checkpoint
from .sinks import METRICS_NAME, metrics_lines

# Settings a resumed run may change: none changes the model, the data, the batches or the update
# rule (grad_accum and the parallel layouts give the same gradients; the one exception, an MoE
# model's load-balancing loss, is computed per micro-batch and rank slice and changes slightly
# with the split: see :class:`mnemo.train.aux_losses.MoEBalance`). ``steps`` also moves the
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
    "spectrum_burn_in",
    "grad_accum",
    "context_parallel",
    "fsdp",
    "activation_checkpointing",
    "compile",
)
RESCHEDULE = ("stretch", "hold")
#: settings that name a file or folder: a resumed run may spell them differently (relative or
#: absolute, ``~``) as long as they name the same one
PATH_FIELDS = ("data", "tokenizer", "init_from")


def _same_path(a, b) -> bool:
    """``a`` and ``b`` (strings) name the same file or folder (read from the working directory;
    ``~`` expanded): spelled alike once absolute (a glob, or a path no longer on disk, too), or
    the same existing one."""
    if not (isinstance(a, str) and isinstance(b, str) and a and b):
        return False
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    if os.path.abspath(pa) == os.path.abspath(pb):
        return True
    try:
        return pa.exists() and pb.exists() and os.path.samefile(pa, pb)
    except OSError:
        return False


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
    A path setting (:data:`PATH_FIELDS`) spelled otherwise but naming the same file or folder (the
    same absolute spelling, or the same existing one) is no difference (the saved spelling is kept).

    The learning rate follows a warm-up + cosine over ``cosine_steps`` (``schedule_steps`` or
    ``steps``). When new ``steps`` would move the end of that cosine, ``reschedule`` must say what
    happens, else ``ValueError`` naming both choices (``step``, the resumed step, sets where the
    note on the learning rate is taken, default the saved ``steps``; new ``steps`` below ``step``
    raise ``ValueError`` naming ``steps`` instead: the resumed run would train nothing). So must a
    ``schedule_steps`` of ``None`` that would unpin a held cosine (a full :class:`TrainConfig`
    like the one that started the run, given again to resume a run resumed with ``"hold"``); a
    ``schedule_steps`` given as a number pins the cosine there without ``reschedule``:

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
    # a path that names the same file or folder is no change (a sweep file's relative data path,
    # made absolute since: mnemo.sweep.spec); the run keeps the saved spelling
    changes = {
        k: v for k, v in changes.items() if not (k in PATH_FIELDS and _same_path(getattr(saved, k), v))
    }
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
    step_lr = lambda c, s: c.lr * schedule_factor(c, s)  # noqa: E731
    if algorithm1_only(cfg):  # a constant lr: nothing to stretch or hold
        if reschedule is not None:
            raise ValueError(
                f"reschedule: optimizer 'm3_paper' keeps a constant learning rate; there is no schedule "
                f"to {reschedule} (leave --reschedule out)"
            )
    elif cfg.cosine_steps != saved.cosine_steps or reschedule is not None:
        stretched = dataclasses.replace(cfg, schedule_steps=None)
        held = dataclasses.replace(cfg, schedule_steps=saved.cosine_steps)
        # a pinned schedule_steps says where the cosine ends; None (e.g. a full TrainConfig like the
        # one that started a held run) would move its end silently: that is for reschedule to say
        if reschedule is None and changes.get("schedule_steps") is None:
            if step is not None and cfg.steps < step:  # no schedule to choose: nothing would train
                raise ValueError(
                    f"TrainConfig.steps: the run is already at step {step}, past steps={cfg.steps} (saved "
                    f"{saved.steps}): resuming would train nothing (a run is not cut back); raise steps "
                    f"above {step} to continue it, or start a new run (e.g. with init_from)"
                )
            moved = (
                f"TrainConfig.steps: {saved.steps} -> {cfg.steps}"
                if cfg.steps != saved.steps
                else f"TrainConfig.schedule_steps: {saved.schedule_steps} -> None (steps {cfg.steps})"
            )
            raise ValueError(
                f"{moved} moves the end of the cosine "
                f"learning-rate schedule (now {saved.cosine_steps} steps); say what should happen: "
                f"--reschedule stretch (a cosine over {cfg.steps} steps) or --reschedule hold (keep "
                f"the {saved.cosine_steps}-step cosine, then lr · min_lr_ratio = "
                f"{saved.lr * saved.min_lr_ratio:.3g})"
            )
        if reschedule is not None:
            cfg = stretched if reschedule == "stretch" else held
        if cfg.cosine_steps != saved.cosine_steps:
            notes.append(f"learning-rate cosine over {cfg.cosine_steps} steps (was {saved.cosine_steps})")
        else:  # (--reschedule hold, or a stretch to the same length)
            notes.append(f"learning-rate cosine over {cfg.cosine_steps} steps, as saved")
        at = saved.steps if step is None else step
        notes.append(
            f"lr at step {at}: {step_lr(saved, at):.3g} on the saved schedule, {step_lr(cfg, at):.3g} now"
        )
    return cfg, notes


def saved_train_config(ckpt: Path) -> TrainConfig:
    """The :class:`TrainConfig` saved in checkpoint ``ckpt`` (``train_config.json``).

    Raises:
        FileNotFoundError: the file is missing. ValueError: it is not JSON, or not a configuration
            this mnemo reads (an unknown field or a bad value: a checkpoint of another version?); the
            message names the file.
    """
    path = Path(ckpt) / TRAIN_CONFIG_NAME
    try:
        return TrainConfig.from_dict(load_json(path))
    except ValueError as e:
        if str(path) in str(e):  # (load_json's own message names it)
            raise
        raise ValueError(f"{path}: the run's saved settings do not load: {e}") from None


class RunFolder:
    """The folder ``out`` of one run: take it (:meth:`open`), cut its metrics log back on resume
    (:meth:`truncate_metrics`), write checkpoints (:meth:`write_checkpoint`)."""

    def __init__(self, out: Path):
        self.out = out

    def resolve(self, cfg, resume: bool, reschedule: str | None):
        """``(cfg, checkpoint, trainer state, notes)``: a fresh run's configuration (``None`` or a
        dict of fields builds a :class:`TrainConfig`), or for ``resume`` the newest intact
        checkpoint's configuration with ``cfg``'s changes (:func:`resume_config`), its trainer state
        and one note per change (printed once the rank is known)."""
        notes: list[str] = []
        if resume:
            ckpt = resolve_checkpoint(self.out, verify=True, warn=notes.append)
            if ckpt.resolve() == self.out.resolve():  # a checkpoint's own folder, not its run's
                raise ValueError(
                    f"out_dir: {self.out} is a checkpoint, not a run folder: the resumed run would write its "
                    f"checkpoints and log inside it; resume {self.out.parent} (its run folder, when it is "
                    "one), or start a new run from these weights with init_from"
                )
            saved = saved_train_config(ckpt)
            state = load_trainer_state(ckpt)
            cfg, changed = resume_config(saved, cfg, reschedule, step=state["step"])
            notes += [f"resume: from {ckpt} (step {state['step']})"]
            notes += [f"resume: {c}" for c in changed]
            return cfg, ckpt, state, notes
        if reschedule is not None:  # (whatever form cfg takes: a TrainConfig, a dict or None)
            raise ValueError(
                f"reschedule: applies to a resumed run (resume=True) only, got reschedule={reschedule!r} "
                "for a new run"
            )
        if cfg is None or isinstance(cfg, dict):
            cfg = TrainConfig.from_dict(cfg or {})
        return cfg, None, None, notes

    def open(self):
        """Create and lock the folder (the returned :class:`RunLock`, or ``None`` without ``fcntl``,
        is held until closed; closing removes ``.lock``, and the folder if this call created it and
        it is still empty) and remove what a killed run left there (we hold the lock)."""
        created = not self.out.exists()
        self.out.mkdir(parents=True, exist_ok=True)
        # a run that fails before writing anything leaves no folder it made (nor its .lock)
        lock = lock_run_folder(self.out, remove_empty=created)
        try:
            stale = clean_stale_temporaries(self.out)  # left by a killed run (we hold the lock)
        except BaseException:
            if lock is not None:
                lock.close()
            raise
        if stale:
            warnings.warn(f"removed what a stopped run left in {self.out}: {', '.join(stale)}", stacklevel=3)
        return lock

    def refuse_other_run(self) -> None:
        """A new run (not resumed) starts only in a folder that holds no run's checkpoints: its own
        would replace theirs step by step, ``latest`` would name a mix of two runs and its records
        would go into their ``metrics.jsonl``; a linked ``ckpt-NNNNNN`` (dangling or not, never
        followed) counts as one. (``mnemo train`` refuses such a folder before any work, and
        ``--overwrite`` sets the old run aside first.) Nor in a checkpoint's own folder
        (``config.json`` / ``model.safetensors``: a resume would find those weights, not the run's).

        Raises:
            ValueError: naming the folder and what of the other run is there.
        """
        weights = [name for name in (CONFIG_NAME, WEIGHTS_NAME) if (self.out / name).is_file()]
        if weights:  # a checkpoint's (or an export's) folder: resolving it would find those weights
            raise ValueError(
                f"{self.out} holds a checkpoint ({', '.join(weights)}): a run there would be hidden behind "
                "it (a resume would find its weights, not the run's); choose another folder"
            )
        latest = self.out / LATEST
        ckpts = sorted(run_checkpoints(self.out) + linked_checkpoints(self.out), key=self.saved_step)
        held = [p.name for p in ckpts]  # (a linked one too, never followed: mnemo train counts it)
        held += [LATEST] if latest.is_symlink() or latest.exists() else []
        if held:
            raise ValueError(
                f"{self.out} already holds a run ({', '.join(held[-3:])}): a new run there would replace "
                "its checkpoints; resume it (resume=True, mnemo train --resume), or choose another folder "
                "(mnemo train --overwrite sets the old run aside)"
            )

    def set_aside_unfinished_log(self) -> Path | None:
        """A new run (not resumed) in a folder whose ``metrics.jsonl`` belongs to a run that wrote
        no checkpoint (it failed or was killed before its first one: nothing to resume): the new
        run's records would be appended to that run's, and the log would read ``2, 4, 2, 4, 6``.
        The old log moves to ``OUT/kept/unfinished-N/metrics.jsonl``, with a warning; returns its
        new path (``None``: no such log). Call it holding the folder's lock, after
        :meth:`refuse_other_run`."""
        log = self.out / METRICS_NAME
        if not log.is_file():
            return None
        dest = new_kept_folder(self.out, "unfinished") / METRICS_NAME
        log.rename(dest)
        warnings.warn(
            f"{log} is the metrics.jsonl of a run that wrote no checkpoint (nothing to resume); the new "
            f"run starts a log of its own, and the old one is kept in {dest}",
            stacklevel=3,
        )
        return dest

    def set_aside_newer(self, step: int, resumed: Path | None = None) -> list[Path]:
        """Resume from ``step`` while the run holds checkpoints of later steps (``latest`` was
        pointed back by hand, or a newer checkpoint is damaged): training on would replace them
        one by one and rotation would mix two histories (a linked ``ckpt-NNNNNN`` would fail the
        write of its step: the link moves, its target is left as it is). They move to
        ``OUT/kept/superseded-N/`` (under the folder's lock), with a warning; returns their new
        paths. ``resumed``: the checkpoint resumed from; when it is one of the run's own, ``latest``
        is rewritten to name it (it named a checkpoint that just moved, and would dangle until the
        next checkpoint)."""
        ckpts = run_checkpoints(self.out) + linked_checkpoints(self.out)  # (a link moves, not its target)
        newer = sorted((p for p in ckpts if self.saved_step(p) > step), key=self.saved_step)
        if not newer:
            return []
        lock = lock_run_folder(self.out)
        try:
            dest = new_kept_folder(self.out, "superseded")
            moved = []
            for p in newer:
                p.rename(dest / p.name)
                moved.append(dest / p.name)
            own = resumed is not None and Path(resumed).absolute().parent == self.out.absolute()
            if own:
                atomic_write_text(self.out / LATEST, Path(resumed).name + "\n")
        finally:
            if lock is not None:
                lock.close()
        warnings.warn(
            f"resume from step {step}: the run's later checkpoints ({', '.join(p.name for p in moved)}) "
            f"moved to {dest}, not replaced (to go back to them, move them into {self.out} and write "
            "their name into latest)" + (f"; latest now names {Path(resumed).name}" if own else ""),
            stacklevel=3,
        )
        return moved

    def truncate_metrics(self, step: int) -> None:
        """Drop the metrics records after ``step`` (and a torn last line), under the folder's lock:
        never trim a live run's log.

        Raises:
            ValueError: a line other than the last is not JSON, or a line is not a record this
                trainer writes (a JSON object with an int ``step``): the file is left as it is and
                the message names the line (nothing the trainer did not write is dropped).
        """
        lock = lock_run_folder(self.out)
        try:
            p = self.out / METRICS_NAME
            if not p.is_file():
                return
            lines = metrics_lines(p, torn_last=True)
            keep = []
            for i, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    if i == len(lines):  # a torn last line (a write cut by a crash): kept aside, said
                        kept = self.out / "kept" / "metrics.jsonl.torn"
                        kept.parent.mkdir(parents=True, exist_ok=True)
                        with open(kept, "a") as fh:
                            fh.write(line + "\n")
                        warnings.warn(
                            f"{p}: its last line is not JSON (a write cut short by a crash?) and leaves the "
                            f"log; it is kept in {kept}: {line[:60]!r}",
                            stacklevel=2,
                        )
                        continue
                    record = None
                if not isinstance(record, dict) or type(record.get("step")) is not int:
                    raise ValueError(
                        f"{p}, line {i}: expected a JSON object with an int 'step' (a record of this run), "
                        f"got {line[:60]!r}; resuming would rewrite the log: fix or remove that line first"
                    )
                if record["step"] <= step:
                    keep.append(line)
            atomic_write_text(p, "".join(line + "\n" for line in keep))
        finally:
            if lock is not None:
                lock.close()

    def write_checkpoint(
        self,
        step: int,
        model,
        optimizer,
        tokenizer,
        cfg: TrainConfig,
        state: dict,
        sharded: bool,
        source_files: dict | None = None,
    ) -> Path:
        """Write ``ckpt-<step>`` atomically: the model's config and weights (``sharded``: DCP
        shards of the weights and ``optimizer``, every rank writing its own), ``tokenizer`` (text
        runs), ``cfg`` and the trainer ``state`` (plus the optimizer's state unless sharded), and
        ``source_files`` (name -> bytes, written as they are: the record of a converted checkpoint's
        source that the run carries, :func:`~mnemo.train.build.source_files`; default none).
        A run of ``cfg.fsdp`` on one process (resumed there) writes a single-file checkpoint, whose
        ``train_config.json`` then says ``fsdp: false`` as a consolidated one's does
        (:func:`~mnemo.train.sharded.consolidate_checkpoint`): a single-file checkpoint is not
        resumed sharded, and no flag of ``mnemo train --resume`` turns a saved ``--fsdp`` off."""
        saved_cfg = {**cfg.to_dict(), **({"fsdp": False} if cfg.fsdp and not sharded else {})}

        def write(tmp: Path):
            model.config.save(tmp / CONFIG_NAME)
            if not sharded:  # else the weights and optimizer state are DCP shards
                save_model(model, str(tmp / WEIGHTS_NAME))
            if tokenizer is not None:
                save_tokenizer(tokenizer, tmp)
            for name, data in (source_files or {}).items():
                (tmp / name).write_bytes(data)
            (tmp / TRAIN_CONFIG_NAME).write_text(json.dumps(saved_cfg, indent=2))
            saved = {
                "step": state["step"],
                **({"sharded": True} if sharded else {"optimizer": optimizer.state_dict()}),
                **{k: v for k, v in state.items() if k != "step"},
            }
            checkpoint.save_torch(saved, tmp / STATE_NAME)  # (read at call time: tests fake a full disk)

        if sharded:
            return save_sharded_checkpoint(self.out, step, model, optimizer, write)
        return save_checkpoint(self.out, step, write)

    @staticmethod
    def saved_step(last_checkpoint: Path | None) -> int | None:
        """The step of checkpoint ``last_checkpoint`` (``None`` before any)."""
        if last_checkpoint is None:
            return None
        try:
            return int(Path(last_checkpoint).name.split("-")[-1])
        except ValueError:
            return None
