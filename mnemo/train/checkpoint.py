"""Atomic checkpoints: each one is a directory written under a temporary name, flushed to disk,
then renamed into place; ``latest`` (a one-line file, replaced atomically) names the newest.

Layout of a run directory::

    OUT/latest                 -> "ckpt-000500"
    OUT/ckpt-000500/config.json, model.safetensors, tokenizer.json,
                    train_config.json, trainer_state.pt, manifest.json
    OUT/metrics.jsonl

(An FSDP run stores the weights and optimizer state as DCP shards in ``ckpt-*/sharded/`` instead,
listed in the same manifest: :mod:`mnemo.train.sharded`.) A crash at any point leaves the
previous checkpoint and ``latest`` intact. ``manifest.json`` records the size and SHA-256 of
every other file; :func:`resolve_checkpoint` checks them and, for a run directory, falls back to
the newest intact checkpoint (a warning names the damaged file).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from ..models.lm import CONFIG_NAME, WEIGHTS_NAME

LATEST = "latest"
STATE_NAME = "trainer_state.pt"
TRAIN_CONFIG_NAME = "train_config.json"
MANIFEST_NAME = "manifest.json"


#: what ``latest`` may name: one of the run folder's own checkpoint directories
_CKPT_NAME = re.compile(r"ckpt-\d+")


class ForeignCheckpointError(ValueError):
    """A run folder's ``latest`` names something other than one of its own checkpoints (another
    run's, a path, a link out of the folder): never followed."""


class CorruptCheckpointError(ValueError):
    """A checkpoint whose files disagree with its manifest (``problems``: one line per file)."""

    def __init__(self, ckpt: Path, problems: list[str]):
        self.ckpt, self.problems = Path(ckpt), problems
        super().__init__(f"checkpoint {ckpt} is damaged: " + "; ".join(problems))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(ckpt_dir: str | Path) -> None:
    """Record the size (bytes) and SHA-256 of every file of ``ckpt_dir`` in ``manifest.json``
    (files in subdirectories, e.g. the shards of a sharded checkpoint, by their relative path)."""
    d = Path(ckpt_dir)
    files = {
        f.relative_to(d).as_posix(): {"bytes": f.stat().st_size, "sha256": _sha256(f)}
        for f in sorted(d.rglob("*"))
        if f.is_file() and f.relative_to(d).as_posix() != MANIFEST_NAME
    }
    (d / MANIFEST_NAME).write_text(json.dumps({"format": 1, "files": files}, indent=1) + "\n")


def _inside(name: str) -> bool:
    """Whether a manifest's file name is a plain relative path below the checkpoint (no empty, ``.``
    or ``..`` part, not absolute, no backslash)."""
    parts = name.split("/")
    return bool(name) and "\\" not in name and all(part not in ("", ".", "..") for part in parts)


def verify_checkpoint(ckpt_dir: str | Path) -> list[str]:
    """The problems of a checkpoint against its manifest: one line per missing, truncated or
    changed file (empty when intact). A checkpoint without ``manifest.json`` (written by an older
    mnemo, or by ``LanguageModel.save_pretrained``) has nothing to check and returns ``[]``.
    A manifest naming a file outside the checkpoint (an absolute path, a ``..`` part) is refused
    as unreadable, its one problem naming the entry: nothing outside the folder is read.
    """
    d = Path(ckpt_dir)
    m = d / MANIFEST_NAME
    if not m.is_file():
        return []
    try:  # (a manifest damaged on disk: not UTF-8, not JSON, or JSON of another shape)
        files = json.loads(m.read_text(encoding="utf-8"))["files"]
        if not isinstance(files, dict):
            raise TypeError(f"'files' is a {type(files).__name__}, expected a mapping")
        for name, want in files.items():
            if not (
                isinstance(want, dict)
                and type(want.get("bytes")) is int
                and isinstance(want.get("sha256"), str)
            ):
                raise TypeError(f"entry {name!r} is {want!r}, expected {{'bytes': int, 'sha256': str}}")
            if not _inside(name):  # a crafted manifest must not make verification read other files
                raise ValueError(
                    f"'files' entry {name!r} is not a relative path inside the checkpoint (expected a "
                    "name like 'model.safetensors' or 'sharded/__0_0.distcp': no '..', no absolute path)"
                )
    except (ValueError, KeyError, TypeError) as e:  # (JSONDecodeError, UnicodeDecodeError: ValueErrors)
        return [f"{m} is unreadable ({e})"]
    problems = []
    for name, want in files.items():
        f = d / name
        if not f.is_file():
            problems.append(f"{f} is missing")
            continue
        size = f.stat().st_size
        if size != want["bytes"]:
            problems.append(
                f"{f} has {size:,} bytes, its manifest says {want['bytes']:,}"
                + (" (shorter: truncated or edited)" if size < want["bytes"] else " (edited)")
            )
        elif _sha256(f) != want["sha256"]:
            problems.append(f"{f} has a different SHA-256 than its manifest (changed after it was written)")
    return problems


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
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, say: no half-written temporary left beside ``path``
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def ckpt_name(step: int) -> str:
    return f"ckpt-{step:06d}"


def save_checkpoint(
    out_dir: str | Path, step: int, write_files, keep: int = 2, *, prepared: str | Path | None = None
) -> Path:
    """Create ``OUT/ckpt-{step}`` atomically.

    ``write_files(tmp_dir)`` writes every file of the checkpoint into ``tmp_dir``; then each file
    is fsynced, the directory renamed into place, and ``OUT/latest`` updated. Older checkpoints
    beyond the ``keep`` most recent (default ``keep=2``) are removed afterwards. ``prepared``: a
    temporary directory inside ``OUT`` that other writers already filled (the shards of a sharded
    checkpoint, :mod:`mnemo.train.sharded`), used instead of a fresh one (removed too if anything
    fails).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    final = out / ckpt_name(step)
    if prepared is not None:
        tmp = Path(prepared)
    else:
        tmp = out / f".tmp-{ckpt_name(step)}-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    try:
        write_files(tmp)
        write_manifest(tmp)
        for f in tmp.rglob("*"):
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        for sub in [p for p in tmp.rglob("*") if p.is_dir()] + [tmp]:
            _fsync_dir(sub)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # the previous checkpoint and `latest` are untouched
        raise
    if final.exists():  # a stale checkpoint of the same step (e.g. resumed from an earlier one)
        trash = out / f".old-{final.name}-{os.getpid()}"
        os.replace(final, trash)
        os.replace(tmp, final)
        discard_checkpoint(trash, out)
    else:
        os.replace(tmp, final)
    _fsync_dir(out)
    atomic_write_text(out / LATEST, final.name + "\n")
    ckpts = run_checkpoints(out)  # by step, not name; only mnemo's own names (a user's ckpt-abc stays)
    for old in ckpts[:-keep] if keep > 0 else []:
        if old != final:
            # out of sight first: a crash mid-delete must not leave a half checkpoint to resume from
            trash = out / f".old-{old.name}-{os.getpid()}"
            os.replace(old, trash)
            discard_checkpoint(trash, out)
    for stale in out.glob(".old-ckpt-*"):  # left by a crash during an earlier cleanup
        discard_checkpoint(stale, out)
    return final


#: the files of a checkpoint written without a manifest (by an older mnemo)
_CHECKPOINT_FILES = {
    CONFIG_NAME,
    WEIGHTS_NAME,
    "tokenizer.json",
    TRAIN_CONFIG_NAME,
    STATE_NAME,
    MANIFEST_NAME,
}


def _checkpoint_of(trash: Path) -> str:
    """``ckpt-000500`` from ``.old-ckpt-000500-PID`` (or the name itself)."""
    m = re.search(r"ckpt-\d+", trash.name)
    return m.group(0) if m else trash.name


def discard_checkpoint(ckpt: Path, out: Path) -> list[Path]:
    """Delete a rotated-out checkpoint directory, but never a file its manifest does not list
    (figures or JSON a user or ``mnemo probe --out`` put there): those are moved to
    ``OUT/kept/ckpt-NNNNNN/`` first, with a warning naming them. In a directory without a manifest
    (written by an older mnemo) the files mnemo writes count as listed. A symbolic link is removed
    itself, its target left untouched. Returns the kept paths."""
    ckpt = Path(ckpt)
    if ckpt.is_symlink():  # a link (made by hand): removed, never reached through into its target
        ckpt.unlink()
        return []
    try:
        listed = set(json.loads((ckpt / MANIFEST_NAME).read_text())["files"]) | {MANIFEST_NAME}
    except (OSError, ValueError, KeyError, TypeError):  # no manifest: the files mnemo writes
        listed = None

    def ours(f: Path) -> bool:
        rel = f.relative_to(ckpt).as_posix()
        if listed is not None:
            return rel in listed
        return rel in _CHECKPOINT_FILES or rel.startswith("sharded/")

    extra = [f for f in sorted(ckpt.rglob("*")) if f.is_file() and not ours(f)]
    kept: list[Path] = []
    if extra:
        dest = out / "kept" / _checkpoint_of(ckpt)
        for f in extra:
            target = dest / f.relative_to(ckpt)
            if target.exists():  # never replace an earlier kept file of the same name
                target = target.with_name(f"{target.stem}-{os.getpid()}{target.suffix}")
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(f, target)
            kept.append(target)
        warnings.warn(
            f"checkpoint rotation: {len(kept)} file(s) in {_checkpoint_of(ckpt)} that are not part of "
            f"the checkpoint were kept in {dest} ({', '.join(p.name for p in kept[:5])}"
            f"{', ...' if len(kept) > 5 else ''})",
            stacklevel=2,
        )
    shutil.rmtree(ckpt, ignore_errors=True)
    return kept


def clean_stale_temporaries(out: str | Path) -> list[str]:
    """Remove what a killed run left in its folder: ``.tmp-ckpt-*`` (a checkpoint being written)
    and ``.old-ckpt-*`` (one being rotated out; files its manifest does not list are kept, see
    :func:`discard_checkpoint`) and ``.latest.tmp-*`` files. Call it only while holding the run
    folder's lock (nothing else writes there then). Returns the names removed."""
    out = Path(out)
    removed = []
    for p in sorted(out.glob(".tmp-ckpt-*")):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:  # a file, or a link (removed itself: rmtree refuses links, which stayed)
            p.unlink(missing_ok=True)
        removed.append(p.name)
    for p in sorted(out.glob(".old-ckpt-*")):
        discard_checkpoint(p, out)
        removed.append(p.name)
    for p in sorted(out.glob(f".{LATEST}.tmp-*")):
        p.unlink(missing_ok=True)
        removed.append(p.name)
    return removed


def run_checkpoints(out: str | Path) -> list[Path]:
    """The checkpoint folders of run folder ``out`` that mnemo names (``ckpt-NNNNNN``; a user's
    ``ckpt-notes`` is not one, nor a symbolic link (made by hand): never rotated out, never
    resumed from), sorted by step."""
    own = (
        p
        for p in Path(out).glob("ckpt-*")
        if p.is_dir() and not p.is_symlink() and _CKPT_NAME.fullmatch(p.name)
    )
    return sorted(own, key=_step_of)


def linked_checkpoints(out: str | Path) -> list[Path]:
    """The ``ckpt-NNNNNN`` entries of ``out`` that are symbolic links, dangling ones too (made by
    hand; :func:`run_checkpoints` skips them), sorted by step, never followed: not the run's own,
    yet this run's checkpoint of that step would be written onto one."""
    links = (p for p in Path(out).glob("ckpt-*") if p.is_symlink() and _CKPT_NAME.fullmatch(p.name))
    return sorted(links, key=lambda p: int(p.name.split("-")[-1]))


def new_kept_folder(out: str | Path, prefix: str) -> Path:
    """Make and return ``OUT/kept/PREFIX-N`` for the smallest ``N >= 1`` not taken: where a run
    sets aside what it does not delete (``overwritten-N``, ``superseded-N``)."""
    n = 1
    while (Path(out) / "kept" / f"{prefix}-{n}").exists():
        n += 1
    dest = Path(out) / "kept" / f"{prefix}-{n}"
    dest.mkdir(parents=True)
    return dest


def _step_of(p: Path) -> int:
    try:
        return int(p.name.split("-")[-1])
    except ValueError:
        return -1


def resolve_checkpoint(
    path: str | Path, *, verify: bool = True, warn: Callable[[str], None] | None = None
) -> Path:
    """A checkpoint directory from either itself or a run directory (through ``latest``).

    With ``verify`` (default ``verify=True``) the checkpoint's files are checked against its
    manifest (sizes and SHA-256, :func:`verify_checkpoint`). For a run directory whose ``latest``
    checkpoint is damaged or missing, the newest intact ``ckpt-*`` is returned instead and ``warn``
    (default: ``warnings.warn``) is told which file was bad and which checkpoint is used.

    ``latest`` is followed only to one of the run directory's own checkpoints (a ``ckpt-NNNNNN``
    directory inside it, not a link out of it); a ``latest`` made by hand as a symbolic link to
    one of them is followed like the file, and so is a ``ckpt-NNNNNN`` link it names that points
    at one of them (the folder is returned, never the link: :func:`run_checkpoints`).

    Raises:
        FileNotFoundError: nothing at ``path``, or no checkpoint in it (says what was looked for).
        ForeignCheckpointError: ``latest`` names anything else (``../other-run/ckpt-000005``, an
            absolute path, a link out of the folder); the message names the file and its content.
        CorruptCheckpointError: a checkpoint directory given directly is damaged, or every
            checkpoint of a run directory is (the message names the bad files).
    """
    warn = warn or (lambda msg: warnings.warn(msg, stacklevel=3))
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"checkpoint not found: {str(path)!r} does not exist")
    if (p / CONFIG_NAME).is_file() or (p / WEIGHTS_NAME).is_file():
        problems = verify_checkpoint(p) if verify else []
        if problems:
            raise CorruptCheckpointError(p, problems)
        if verify:
            _warn_unverified(p, warn)
        return p
    latest = p / LATEST
    own = run_checkpoints(p)
    linked = None  # ``latest`` made by hand as a symbolic link (``ln -s ckpt-000500 latest``)
    if latest.is_symlink():
        dest = latest.resolve()
        if not (dest.is_dir() and dest.parent == p.resolve() and _CKPT_NAME.fullmatch(dest.name)):
            raise ForeignCheckpointError(
                f"{latest} is a link to {os.readlink(latest)!r}, which is not one of this run's checkpoints "
                f"(mnemo writes {LATEST} as a text file naming a ckpt-NNNNNN directory inside {p}); refusing "
                f"to follow it. Fix or delete {latest}"
            )
        linked = dest.name
    # a ckpt-NNNNNN folder with neither config nor weights is no checkpoint (``mnemo probe``'s outputs
    # of one, RUN/probes/ckpt-NNNNNN/): never the run's newest intact one
    empty = [c for c in own if not _holds_a_model(c)]
    own = [c for c in own if _holds_a_model(c)]
    if linked is None and not latest.is_file() and not own:
        raise FileNotFoundError(
            f"no checkpoint in {str(path)!r}: expected {CONFIG_NAME} + {WEIGHTS_NAME} there, or a "
            f"'{LATEST}' file naming a checkpoint directory (a run directory written by `mnemo train`)"
            + _linked_note(p)
            + _not_checkpoints_note(p, empty)
        )
    if linked is None and not latest.is_file():  # the pointer was lost: the newest intact checkpoint, said
        newest = max(own, key=_step_of)
        if not verify:
            return newest
        lost_how = "not a file (a folder, say)" if latest.exists() else "missing"
        for c in sorted(own, key=_step_of, reverse=True):
            problems = verify_checkpoint(c)
            if not problems:
                warn(f"{latest} is {lost_how} — using {c}, the run's newest intact checkpoint")
                _warn_unverified(c, warn)
                return c
        lost = [f"{latest} is {lost_how}", "no intact checkpoint is left in the run directory"]
        raise CorruptCheckpointError(p, lost)
    name = linked or latest.read_text().strip()
    target = p / name
    if linked is None and name and target.is_symlink():  # a ckpt-NNNNNN link beside its target (made by
        dest = target.resolve()  # hand): the folder it names, never the link (never rotated, see above)
        if dest.is_dir() and dest.parent == p.resolve() and _CKPT_NAME.fullmatch(dest.name):
            name, target = dest.name, p / dest.name
    if name and (
        not _CKPT_NAME.fullmatch(name) or (target.exists() and target.resolve().parent != p.resolve())
    ):
        raise ForeignCheckpointError(
            f"{latest} points to {name!r}, which is not one of this run's checkpoints (expected the "
            f"name of a ckpt-NNNNNN directory inside {p}); refusing to follow it. Fix or delete {latest}"
            + _linked_note(p)
        )
    if not verify:
        if not name or not target.is_dir():
            raise FileNotFoundError(
                f"{latest} points to {name!r}, which is not a checkpoint directory in {p}"
            )
        return target
    bad: list[str] = []
    if not name or not target.is_dir():
        bad.append(f"{latest} points to {name!r}, which is not a checkpoint directory")
        candidates = []
    elif not _holds_a_model(target):
        bad.append(f"{latest} points to {name!r}, which holds none of a checkpoint's files")
        candidates = []
    else:
        candidates = [target]
    newest = _step_of(target) if name and target.is_dir() else float("inf")  # never skip ahead of `latest`
    # the run's own checkpoints only: a ckpt-NNNNNN link (made by hand) is never resumed from
    candidates += [c for c in reversed(own) if _step_of(c) < newest]
    for c in candidates:
        problems = verify_checkpoint(c)
        if not problems:
            if bad:
                warn(f"damaged checkpoint skipped: {'; '.join(bad)} — using {c} instead")
            _warn_unverified(c, warn)
            return c
        bad += problems
    if not bad:
        raise FileNotFoundError(f"{latest} points to {name!r}, which is not a checkpoint directory in {p}")
    raise CorruptCheckpointError(p, bad + ["no intact checkpoint is left in the run directory"])


#: the files of a checkpoint folder (:func:`save_checkpoint`), any one of which makes a ``ckpt-*``
#: folder a checkpoint, intact or damaged (``mnemo probe``'s outputs of one hold none of them)
_CHECKPOINT_FILES = (CONFIG_NAME, WEIGHTS_NAME, MANIFEST_NAME, STATE_NAME, TRAIN_CONFIG_NAME)


def _holds_a_model(ckpt: Path) -> bool:
    """Whether folder ``ckpt`` holds any of a checkpoint's own files (:data:`_CHECKPOINT_FILES`): a
    checkpoint that lost its config and weights but kept its manifest or trainer state is a damaged
    checkpoint (said, and skipped by :func:`verify_checkpoint`), not a foreign folder."""
    return any((ckpt / name).is_file() for name in _CHECKPOINT_FILES)


def _not_checkpoints_note(folder: Path, inside: list[Path]) -> str:
    """A note naming the ``ckpt-NNNNNN`` folders ``inside`` ``folder`` that hold no model (not
    checkpoints: e.g. ``mnemo probe``'s outputs in ``RUN/probes/``): '' when there are none."""
    if not inside:
        return ""
    names = ", ".join(c.name for c in inside[:3]) + (f", … ({len(inside)} in all)" if len(inside) > 3 else "")
    run = f"; the run folder here is {folder.parent}" if (folder.parent / LATEST).exists() else ""
    return (
        f"; its {names} hold{'s' if len(inside) == 1 else ''} none of a checkpoint's files "
        f"({CONFIG_NAME}, {WEIGHTS_NAME}, {MANIFEST_NAME}, ...): "
        f"not {'a checkpoint' if len(inside) == 1 else 'checkpoints'} (`mnemo probe` writes its outputs "
        f"of a run's checkpoint into RUN/probes/ckpt-NNNNNN/{run})"
    )


def _linked_note(run: Path) -> str:
    """A note naming the run folder's ``ckpt-NNNNNN`` symbolic links, which are never resumed from
    (:func:`run_checkpoints`): '' when it has none."""
    links = sorted(p.name for p in run.glob("ckpt-*") if p.is_symlink() and _CKPT_NAME.fullmatch(p.name))
    if not links:
        return ""
    return (
        f"; {', '.join(links)} in {run} is a symbolic link, which mnemo never resumes from nor rotates "
        "(a linked folder is not the run's own): move the checkpoint folder itself back into the run "
        "folder (or move and link the whole run folder instead)"
    )


def _warn_unverified(ckpt: Path, warn) -> None:
    """A training checkpoint (one with ``trainer_state.pt``) always gets a manifest from this
    mnemo: without one its files cannot be checked, which is said rather than passed over. Folders
    of weights alone (``save_pretrained``, exports, conversions) need no manifest."""
    if (ckpt / STATE_NAME).is_file() and not (ckpt / MANIFEST_NAME).is_file():
        warn(
            f"{ckpt} has no {MANIFEST_NAME}: its files could not be checked for damage (a checkpoint of an "
            "older mnemo, or the manifest was deleted); loading it unverified"
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
