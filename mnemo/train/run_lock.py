"""A run folder's lock: an exclusive advisory ``flock`` on ``OUT/.lock`` that one process (one
thread) holds while it writes the folder (:func:`lock_run_folder`; ``mnemo train``, the Trainer,
``mnemo convert --from-dcp``). A module of its own, importing nothing of mnemo, so that every writer
of a run folder can take the lock (:mod:`mnemo.train.run_folder` re-exports it)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

LOCK_NAME = ".lock"


class RunLock:
    """The held lock of a run folder (:func:`lock_run_folder`). :meth:`close` releases it and
    removes ``.lock``, so a folder that a run left (finished, failed or interrupted) holds nothing
    of the lock; ``remove_empty``: the folder too, when this process created it and nothing else
    was written there (a run that failed before its first record). Default ``remove_empty=False``.
    As a context manager it is closed when the ``with`` block ends."""

    def __init__(self, file, path: Path, remove_empty: bool = False):
        self.file, self.path, self.remove_empty = file, path, remove_empty
        self.key = _held_key(path.parent)

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def fileno(self) -> int:
        return self.file.fileno()

    @property
    def closed(self) -> bool:
        return self.file.closed

    def close(self) -> None:
        if self.file.closed:
            return
        _HELD.pop(self.key, None)
        try:  # unlinked while still held: a process that opened it meanwhile sees it went (below)
            if os.path.samestat(os.fstat(self.file.fileno()), os.stat(self.path)):
                self.path.unlink()
        except OSError:
            pass
        finally:
            self.file.close()
        if self.remove_empty:
            try:
                self.path.parent.rmdir()  # only when empty
            except OSError:
                pass


class _HeldAgain:
    """What :func:`lock_run_folder` returns to a thread that already holds the folder (the
    ``train`` command holds it from its first check to its end, the Trainer takes it again in
    ``fit``): the outer :class:`RunLock` stays held; closing this does nothing."""

    def __init__(self, outer: RunLock):
        self.outer = outer

    def __enter__(self) -> _HeldAgain:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def fileno(self) -> int:
        return self.outer.fileno()

    @property
    def closed(self) -> bool:
        return self.outer.closed

    def close(self) -> None:
        pass


#: the run folders this process holds, by (real path, process, thread): a thread that holds one may
#: take it again (:class:`_HeldAgain`); another thread, like another process (a forked child too), is
#: refused
_HELD: dict[tuple[str, int, int], RunLock] = {}


def _held_key(out: Path) -> tuple[str, int, int]:
    return os.path.realpath(out), os.getpid(), threading.get_ident()


def take_lock_file(path: Path, busy) -> object:
    """Open ``path`` and take an exclusive ``flock`` on it without waiting; write this process's
    pid into it and return the open file (closing it releases the lock). The kernel drops the lock
    when its process dies. A file its holder removed between our open and our lock is not taken:
    the new one is. Requires ``fcntl`` (POSIX).

    Raises:
        ValueError: another process holds it: ``busy(holder_pid_text)`` is the message.
    """
    import fcntl

    for _ in range(100):
        f = open(path, "a+")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            f.close()
            raise ValueError(busy(holder)) from None
        try:
            same = os.path.samestat(os.fstat(f.fileno()), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            break
        f.close()  # its holder removed the file between our open and our lock: take the new one
    else:  # pragma: no cover - another process takes and releases it without pause
        raise ValueError(f"could not take the lock {path}")
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def lock_run_folder(out: Path, remove_empty: bool = False) -> RunLock | _HeldAgain | None:
    """Take the run folder ``out`` for this process: an exclusive advisory lock on ``out/.lock``
    (``flock``), held until the returned :class:`RunLock` is closed (which removes ``.lock``;
    ``remove_empty``: and ``out`` if nothing else is in it then; default ``remove_empty=False``).
    The kernel drops the lock when its process dies, so a crashed run's lock is taken over without
    ceremony. On systems without ``fcntl`` this is a no-op. A thread that already holds the folder
    gets a :class:`_HeldAgain` (the lock stays held until the first holder closes it).

    Raises:
        ValueError: another live process holds the folder (the message names its pid).
    """
    try:
        import fcntl  # noqa: F401  (take_lock_file's)
    except ImportError:  # pragma: no cover - not POSIX
        return None
    again = _HELD.get(_held_key(out))
    if again is not None and not again.closed:
        return _HeldAgain(again)
    path = out / LOCK_NAME
    f = take_lock_file(
        path,
        lambda holder: (
            f"run folder {out} is in use by another training process (pid {holder}); wait for "
            "it to finish, or pick another --out"
        ),
    )
    lock = RunLock(f, path, remove_empty)
    _HELD[lock.key] = lock
    return lock
