"""Deferred interrupts: SIGINT/SIGTERM during training only *request* a stop, which the loop
honours between two steps (it writes a checkpoint of the last finished step, then raises
``KeyboardInterrupt``), so an interrupt loses no finished step and never catches the optimizer
half-way. A second SIGINT interrupts at once.

Extension point: another stop condition (a file, a wall-clock budget, a scheduler's pre-emption
notice) is an object with the same shape as :class:`DeferredInterrupts` — a context manager whose
``requested`` is ``None`` until a stop is wanted, then a short name for the log line
(``"<name> at step <n>: ..."``, :func:`interrupted`); the trainer reads ``requested`` before every
step.
"""

from __future__ import annotations

import signal
import threading


class DeferredInterrupts:
    """While entered (single process, main thread), SIGINT/SIGTERM set :attr:`requested` to the
    signal's name instead of raising (default ``enabled=True``); a signal already ignored
    (``SIG_IGN``, e.g. SIGINT in a shell script's background job) stays ignored. Several processes (torchrun;
    ``enabled=False``) keep the default handlers: the ranks could not agree on the step. The old
    handlers come back on exit."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.requested: str | None = None

    def __enter__(self):
        self.requested, self._old = None, {}
        if not self.enabled or threading.current_thread() is not threading.main_thread():
            return self

        def request(signum, frame):
            if self.requested is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt  # asked twice: stop now
            self.requested = signal.Signals(signum).name

        # a signal the process was started ignoring stays ignored (a script's background job
        # ignores SIGINT, as POSIX shells start it): honoured here only, it would stop training but
        # not the seconds before it, which read as "sometimes ignored"
        ours = [sig for sig in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(sig) is not signal.SIG_IGN]
        self._old = {sig: signal.signal(sig, request) for sig in ours}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        self._old = {}


def interrupted(requested: str, step: int, checkpoint) -> KeyboardInterrupt:
    """What ``fit`` raises for a stop ``requested`` (a stop condition's name) before the step after
    ``step``: the log line names it, the step and the ``checkpoint`` that holds every finished step
    (``None``: stopped before a first step, nothing written). The exception carries ``signal``
    (``requested``: the command's exit status follows a SIGTERM) and, without a checkpoint,
    ``then`` (what the command says instead of "continue with --resume")."""
    if checkpoint is None:
        e = KeyboardInterrupt(f"{requested} at step {step}, before any checkpoint was written")
        e.then = "; nothing was trained or saved: run the command again to start"
    else:
        e = KeyboardInterrupt(
            f"{requested} at step {step}: checkpoint {checkpoint} holds every finished step"
        )
    e.signal = requested
    return e
