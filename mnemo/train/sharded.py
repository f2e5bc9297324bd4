"""Fully sharded data parallelism (FSDP2, ``torch.distributed.fsdp.fully_shard``; Zhao et al. 2023,
"PyTorch FSDP") and its sharded checkpoints (``torch.distributed.checkpoint``, DCP).

**Sharding.** :func:`shard_model` applies ``fully_shard`` to every block and then to the root
(embedding, final norm and head, tied or not): each parameter becomes a ``DTensor`` split along
dim 0 over the processes; a block's parameters are all-gathered just before its forward and
backward and freed after, and its gradients are reduce-scattered (averaged over the processes, as
DDP does, so the trainer's loss scale ``world / tokens`` is unchanged). The optimizer holds and
updates shards only. Works on CPU with gloo (checked with torch 2.13) and on CUDA with nccl.

**Sharded checkpoints.** A checkpoint of an FSDP run keeps the usual layout except the weights
and the optimizer state::

    OUT/ckpt-000500/config.json, tokenizer.json, train_config.json, manifest.json,
                    trainer_state.pt          (step, schedule, RNG states; "sharded": true)
                    sharded/.metadata, sharded/__0_0.distcp, sharded/__1_0.distcp, …
                                              (DCP: {"model": …, "optim": …}, one file per process)

It is written with the guarantees of :func:`~mnemo.train.checkpoint.save_checkpoint`: every
process writes its shard into one temporary directory (``OUT/.tmp-ckpt-000500-sharded``, so ``OUT``
must be a filesystem all processes share — on several nodes a network filesystem), all meet at a
barrier, then rank 0 writes the other files and a manifest with the size and SHA-256 of every file
(the shards included), fsyncs, renames the directory into place and updates ``latest``; readers
check the manifest and fall back to the newest intact checkpoint as for single-file checkpoints.
What differs: a crash of a process other than 0 mid-write is noticed by the others only at the
barrier (torchrun then stops the job; the previous checkpoint stays intact), and the temporary
directory is named by step, not by process id (a rerun removes a stale one first).

**Resharding.** DCP stores each shard with its global offsets, so :func:`load_sharded` fills a
model and optimizer sharded over any number of processes — or a plain model in a single process
without a process group. :func:`consolidate_checkpoint` (``mnemo convert --from-dcp``) rewrites a
sharded checkpoint as an ordinary single-file one (``model.safetensors`` and the optimizer state in
``trainer_state.pt``), which ``mnemo eval``, ``generate`` and ``export`` read.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from .checkpoint import STATE_NAME, CorruptCheckpointError, ckpt_name, save_checkpoint
from .run_lock import lock_run_folder

SHARDED_DIR = "sharded"


def is_sharded(ckpt: str | Path) -> bool:
    """Whether the checkpoint directory ``ckpt`` holds DCP shards (an FSDP run's checkpoint)."""
    return (Path(ckpt) / SHARDED_DIR / ".metadata").is_file()


def shard_model(model, device: torch.device):
    """``fully_shard`` every block of ``model`` (a :class:`~mnemo.models.LanguageModel`), then the
    root; returns the same module (its class becomes an FSDP subclass, its parameters
    ``DTensor`` shards). Needs an initialised process group. Build the optimizer afterwards.

    Raises:
        ValueError: the model has scalar (0-d) parameters (e.g. the HOPE models' self-modifying
            mixers), which ``fully_shard`` cannot split; raised before anything is sharded.
    """
    from torch.distributed.fsdp import fully_shard

    scalars = [name for name, p in model.named_parameters() if p.ndim == 0]
    if scalars:
        more = f" and {len(scalars) - 2} more" if len(scalars) > 2 else ""
        raise ValueError(
            f"TrainConfig.fsdp: this model has scalar (0-d) parameters ({', '.join(scalars[:2])}{more}), "
            "which FSDP2 (fully_shard) cannot shard; train it without --fsdp (data-parallel: every "
            "process holds the whole model)"
        )
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def _state_dicts(model, optimizer):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def save_sharded_checkpoint(out_dir, step: int, model, optimizer, write_files, keep: int = 2) -> Path:
    """Write ``OUT/ckpt-{step}`` as a sharded checkpoint (module docstring): *every* process calls
    this; each writes its shards of ``model`` and ``optimizer`` with DCP, then rank 0 calls
    ``write_files(tmp_dir)`` for the other files and completes the checkpoint atomically, keeping
    the ``keep`` most recent checkpoints (:func:`~mnemo.train.checkpoint.save_checkpoint`; default
    ``keep=2``). Returns its path (on every process)."""
    import torch.distributed.checkpoint as dcp

    out = Path(out_dir)
    tmp = out / f".tmp-{ckpt_name(step)}-sharded"
    rank = dist.get_rank()
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    dist.barrier()
    dcp.save(_state_dicts(model, optimizer), checkpoint_id=str(tmp / SHARDED_DIR))
    dist.barrier()  # every shard and DCP's metadata are on disk
    final = out / ckpt_name(step)
    if rank == 0:
        save_checkpoint(out, step, write_files, keep=keep, prepared=tmp)
    dist.barrier()
    return final


def load_sharded(ckpt: str | Path, model, optimizer=None) -> None:
    """Fill ``model`` (and ``optimizer``: its parameter groups must match the saved ones) from the
    DCP shards of ``ckpt``, whatever the number of processes that wrote them: sharded over the
    current process group (FSDP) or, in a single process without one, a plain model.

    Raises:
        FileNotFoundError: ``ckpt`` holds no shards.
        CorruptCheckpointError: DCP cannot read the shards of a checkpoint without ``manifest.json``
            (unchecked: a truncated or damaged shard); the message names the folder and DCP's error.
        RuntimeError: DCP cannot read the shards of a verified checkpoint (they do not fit
            ``model``); the message names the folder and DCP's error (and, for a TTT memory saved
            before its inner norm's scale and shift, whatever its manifest, ``inner_norm_affine``).
        KeyboardInterrupt, SystemExit, torch.OutOfMemoryError, MemoryError: raised while DCP
            reads (it wraps them in its ``CheckpointException``): as themselves.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    if not is_sharded(ckpt):
        raise FileNotFoundError(
            f"no sharded checkpoint in {ckpt}: expected {Path(ckpt) / SHARDED_DIR / '.metadata'}"
        )
    path = str(Path(ckpt) / SHARDED_DIR)
    sd = {"model": get_model_state_dict(model)} if optimizer is None else _state_dicts(model, optimizer)
    try:
        with warnings.catch_warnings():  # one process without a group is intended here: say nothing
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load(sd, checkpoint_id=path)
    except CheckpointException as e:  # (a BaseException: it escaped every `except Exception`)
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        inner = e.failures.get(rank, next(iter(e.failures.values()), (e, None)))[0]
        # DCP wraps every BaseException of its steps: a Ctrl-C, SystemExit or running out of
        # memory while reading is no damage nor misfit, and is raised as itself
        if not isinstance(inner, Exception) or isinstance(inner, (torch.OutOfMemoryError, MemoryError)):
            raise inner from None
        last = (str(inner).strip().splitlines() or [""])[-1]
        detail = f"DCP could not read {path}: {type(inner).__name__}: {last}"
        if "Missing key" in last and (".inner_norm_weight" in last or ".inner_norm_bias" in last):
            # a TTT memory checkpointed before its inner norm's scale and shift: a misfit, not damage
            raise RuntimeError(
                f"{detail.rstrip('.')}: the checkpoint was written before the TTT memory's inner norm had "
                "a learned scale and shift; build the model without them (inner_norm_affine: false in "
                "its mixer_options, e.g. {neural_memory: {inner_norm_affine: false}})"
            ) from None
        if not (Path(ckpt) / "manifest.json").is_file():  # unchecked: damaged on disk
            raise CorruptCheckpointError(
                Path(ckpt), [detail + " (no manifest.json: its shards were not checked)"]
            ) from None
        raise RuntimeError(detail) from None
    if optimizer is None:
        set_model_state_dict(model, sd["model"])
        return
    from .optim import match_saved_groups

    # a checkpoint of older groups (before no_weight_decay): without this, set_state_dict left a
    # group without its hyperparameters (lr, weight_decay, ...)
    match_saved_groups(optimizer, model, sd["optim"])
    set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def consolidate_checkpoint(src: str | Path, out: str | Path) -> Path:
    """Rewrite the sharded checkpoint ``src`` (a checkpoint directory, or a run directory: its newest
    intact checkpoint) as an ordinary single-file checkpoint ``OUT/ckpt-{step}`` of the run
    directory ``out`` (``latest`` included): ``model.safetensors``, and ``trainer_state.pt`` with the
    whole optimizer state, so ``mnemo eval/generate`` read it and ``mnemo train --resume --out OUT``
    continues the run in one process (or data-parallel: its ``train_config.json`` says ``fsdp: false``).
    Runs in one process, no process group.
    Returns the new checkpoint's path.

    ``out`` must hold no run yet (no ``ckpt-NNNNNN``, linked or not, no ``latest``): writing there
    would rotate its older checkpoints out (only the newest two are kept), replace its checkpoint
    of the same step and point its ``latest`` at another run's. As ``mnemo train`` treats a folder,
    neither may it hold the ``metrics.jsonl`` of a run that wrote no checkpoint (the consolidated
    run would take that log as its own), nor be a checkpoint's own folder (``config.json`` or
    ``model.safetensors``: resolving ``out`` would find those weights, not the consolidated run's),
    nor be in use: ``out`` is locked while the checkpoint is written
    (:func:`~mnemo.train.run_lock.lock_run_folder`; a ``.lock`` that no live process holds, left
    by a killed run, is taken over and removed). A failed consolidation leaves no folder it created
    (``out``, and the parents ``mkdir`` made for it, when still empty).

    Raises:
        FileNotFoundError / CorruptCheckpointError: as :func:`~mnemo.train.resolve_checkpoint`.
        ValueError: ``src`` is not a sharded checkpoint; ``out`` (or a parent of it) is a file or
            a link to nothing; ``out`` already holds a run, or the
            ``metrics.jsonl`` of one, or a checkpoint's weights, or another live process holds it
            (each naming ``out`` and what it found: the checkpoints, the log, the weights, the
            holder's pid).
    """
    out = Path(out)
    # (mkdir would fail on a file, or on a link to nothing, which exists() does not see)
    found = next((p for p in (out, *out.parents) if p.exists() or p.is_symlink()), None)
    if found is not None and not found.is_dir():
        kind = f"a link to nothing ({os.readlink(found)})" if not found.exists() else "a file"
        what = f"{out} is {kind}" if found == out else f"{out}: its parent {found} is {kind}"
        raise ValueError(
            f"OUT: {what}, not a folder: give a run folder (a new one, or a path under a folder)"
        )
    made = [p for p in (out, *out.parents) if not p.exists()]  # the folders mkdir creates, deepest first
    out.mkdir(parents=True, exist_ok=True)
    # as `mnemo train`: refused while a live process holds the folder (a run before its first
    # checkpoint: its checkpoints would rotate this one out), a dead one's .lock taken over; a
    # failed consolidation removes the folders it made (OUT when empty: the lock's close; then the
    # parents it made, e.g. a/ and a/b/ of OUT=a/b/c)
    try:
        try:
            lock = lock_run_folder(out, remove_empty=out in made)
        except ValueError as e:  # ("in use by another training process (pid N)"; OUT, not --out, here)
            raise ValueError(f"OUT: {e}".replace("pick another --out", "pick another OUT")) from None
        with lock or contextlib.nullcontext():
            return _consolidate(src, out)
    except BaseException:
        for folder in made:  # (OUT itself is gone already when the lock's close removed it)
            try:
                folder.rmdir()  # (only when empty)
            except FileNotFoundError:
                continue
            except OSError:
                break
        raise


def _consolidate(src: str | Path, out: Path) -> Path:
    """:func:`consolidate_checkpoint` holding the lock of ``out``."""
    import json

    from safetensors.torch import save_model

    from ..models import LanguageModel, ModelConfig
    from ..models.lm import CONFIG_NAME, WEIGHTS_NAME
    from .checkpoint import (
        LATEST,
        TRAIN_CONFIG_NAME,
        linked_checkpoints,
        load_json,
        load_trainer_state,
        resolve_checkpoint,
        run_checkpoints,
        save_torch,
    )
    from .config import TrainConfig
    from .sinks import METRICS_NAME

    held = [p.name for p in run_checkpoints(out) + linked_checkpoints(out)]
    held += [LATEST] if (out / LATEST).is_symlink() or (out / LATEST).exists() else []
    if held:  # its checkpoints would be rotated out or replaced, its latest repointed
        raise ValueError(
            f"OUT: {out} already holds a run ({', '.join(held[-3:])}); writing the consolidated checkpoint "
            "there would delete or replace its checkpoints and point its latest at this one: pick a new "
            "or empty folder"
        )
    weights = [name for name in (CONFIG_NAME, WEIGHTS_NAME) if (out / name).is_file()]
    if weights:  # a checkpoint's own folder (mnemo train refuses it too): resolving OUT finds its weights
        raise ValueError(
            f"OUT: {out} holds a checkpoint ({', '.join(weights)}); the consolidated run written there would "
            "be hidden behind it (mnemo eval/generate/train --resume of OUT would read those weights): pick "
            "a new or empty folder"
        )
    if (out / METRICS_NAME).is_file():  # (mnemo train refuses it too, without --overwrite)
        raise ValueError(
            f"OUT: {out} holds the {METRICS_NAME} of a run that wrote no checkpoint; the consolidated run "
            "would take that log as its own (a --resume appends to it): pick a new or empty folder"
        )
    ckpt = resolve_checkpoint(src)
    if not is_sharded(ckpt):
        raise ValueError(f"--from-dcp: {ckpt} is not a sharded (FSDP) checkpoint: no {SHARDED_DIR}/.metadata")
    from .optim import make_optimizer

    tcfg = TrainConfig.from_dict(load_json(ckpt / TRAIN_CONFIG_NAME))
    model = LanguageModel(ModelConfig.load(ckpt / CONFIG_NAME))
    optimizer = make_optimizer(model, tcfg)
    load_sharded(ckpt, model, optimizer)
    state = load_trainer_state(ckpt)
    state = {k: v for k, v in state.items() if k != "sharded"}
    state["optimizer"] = optimizer.state_dict()

    def write(tmp: Path):
        for f in ckpt.iterdir():  # config, tokenizer, train config: unchanged
            if f.is_file() and f.name not in (STATE_NAME, "manifest.json"):
                shutil.copy2(f, tmp / f.name)
        save_model(model, str(tmp / WEIGHTS_NAME))
        save_torch(state, tmp / STATE_NAME)
        # no longer a sharded run: its resume (one process or data-parallel) must not be sharded,
        # and no flag of a resumed `mnemo train` turns a saved --fsdp off
        saved = json.loads((tmp / TRAIN_CONFIG_NAME).read_text())
        (tmp / TRAIN_CONFIG_NAME).write_text(json.dumps({**saved, "fsdp": False}, indent=2))

    return save_checkpoint(out, state["step"], write)
