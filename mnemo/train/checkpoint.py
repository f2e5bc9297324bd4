"""Atomic checkpoints: each one is a directory written under a temporary name, flushed to disk,
then renamed into place; ``latest`` (a one-line file, replaced atomically) names the newest.

Layout of a run directory::

    OUT/latest                 -> "ckpt-000500"
    OUT/ckpt-000500/config.json, model.safetensors, tokenizer.json,
                    train_config.json, trainer_state.pt
    OUT/metrics.jsonl

A crash at any point leaves the previous checkpoint and ``latest`` intact.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import torch

from ..models.lm import CONFIG_NAME, WEIGHTS_NAME

LATEST = "latest"
STATE_NAME = "trainer_state.pt"
TRAIN_CONFIG_NAME = "train_config.json"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file, fsync and ``os.replace``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def ckpt_name(step: int) -> str:
    return f"ckpt-{step:06d}"


def save_checkpoint(out_dir: str | Path, step: int, write_files, keep: int = 2) -> Path:
    """Create ``OUT/ckpt-{step}`` atomically.

    ``write_files(tmp_dir)`` writes every file of the checkpoint into ``tmp_dir``; then each file
    is fsynced, the directory renamed into place, and ``OUT/latest`` updated. Older checkpoints
    beyond the ``keep`` most recent are removed afterwards.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    final = out / ckpt_name(step)
    tmp = out / f".tmp-{ckpt_name(step)}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        write_files(tmp)
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # the previous checkpoint and `latest` are untouched
        raise
    if final.exists():  # a stale checkpoint of the same step (e.g. resumed from an earlier one)
        trash = out / f".old-{final.name}-{os.getpid()}"
        os.replace(final, trash)
        os.replace(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(out)
    atomic_write_text(out / LATEST, final.name + "\n")
    ckpts = sorted(p for p in out.glob("ckpt-*") if p.is_dir())
    for old in ckpts[:-keep] if keep > 0 else []:
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from either itself or a run directory (through ``latest``).

    Raises ``FileNotFoundError`` saying what was looked for.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"checkpoint not found: {str(path)!r} does not exist")
    if (p / CONFIG_NAME).is_file() or (p / WEIGHTS_NAME).is_file():
        return p
    latest = p / LATEST
    if latest.is_file():
        name = latest.read_text().strip()
        target = p / name
        if not name or not target.is_dir():
            raise FileNotFoundError(
                f"{latest} points to {name!r}, which is not a checkpoint directory in {p}"
            )
        return target
    raise FileNotFoundError(
        f"no checkpoint in {str(path)!r}: expected {CONFIG_NAME} + {WEIGHTS_NAME} there, or a "
        f"'{LATEST}' file naming a checkpoint directory (a run directory written by `mnemo train`)"
    )


def save_torch(obj, path: str | Path) -> None:
    buf = io.BytesIO()
    torch.save(obj, buf)
    Path(path).write_bytes(buf.getvalue())


def load_trainer_state(ckpt: Path) -> dict:
    p = ckpt / STATE_NAME
    if not p.is_file():
        raise FileNotFoundError(f"checkpoint file missing: {p} (needed to resume training)")
    try:
        return torch.load(p, map_location="cpu", weights_only=False)
    except Exception as e:
        raise ValueError(f"corrupt trainer state {p}: {e}") from e


def load_json(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file missing: {path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"corrupt JSON file {path}: {e}") from e
