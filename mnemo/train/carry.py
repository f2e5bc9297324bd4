"""The carried state of truncated back-propagation through time (``TrainConfig.carry_state``).

:class:`CarriedState` is the trainer's part for it: the model's state after the last step's
windows (:class:`~mnemo.train.batches.CarriedStreams` gives the windows), passed to the next step's
forward, dropped when every stream restarts, and saved with / restored from the checkpoints so a
resumed run continues the streams exactly. One process, no wrapper: the forward is
``model(x, state, targets=y)``. Without ``carry_state`` the part is :class:`FreshState` (every
step starts from a fresh state; nothing to save); :meth:`CarriedState.for_run` picks one.

Extension point: another policy for the state a step starts from is an object with the methods of
:class:`FreshState`, and, when its ``active`` is true, a ``forward`` like
:meth:`CarriedState.forward` that the trainer runs instead of its own; :meth:`CarriedState.for_run`
returns it.
"""

from __future__ import annotations

from pathlib import Path

from ..data.tasks import IGNORE_INDEX
from ..layers import state as states
from .batches import CarriedStreams
from .build import check_carry_state


class FreshState:
    """No carried state (``cfg.carry_state`` off): each step's forward starts from a fresh state,
    and checkpoints hold nothing of it."""

    active = False  # the trainer runs its own forward
    state = None

    def begin_step(self, step: int) -> None:
        """Before step ``step``'s forward."""

    def end_step(self) -> None:
        """After a successful step."""

    def save(self, step: int) -> dict:
        """What a checkpoint of step ``step`` holds of the state (its keys in the trainer state)."""
        return {}

    def restore(self, ckpt: Path, saved: dict, step: int) -> None:
        """Resume from checkpoint ``ckpt`` (its trainer state ``saved``) at step ``step``."""


class CarriedState(FreshState):
    """``state``: the model's recurrent state after the last step (``None`` at the start of every
    epoch), a snapshot (:func:`mnemo.layers.state.snapshot`: detached and copied, since the
    optimizer step changes parameters that a fresh state holds by reference)."""

    active = True  # the forward of a step is :meth:`forward`

    @classmethod
    def for_run(cls, model, cfg, streams: CarriedStreams | None, device, world: int = 1) -> FreshState:
        """The part of the run ``cfg``: with ``cfg.carry_state`` a :class:`CarriedState` over
        ``streams`` on ``device``, once :func:`~mnemo.train.build.check_carry_state` has found that
        ``model`` can carry its state on ``world`` processes (default ``world=1``), else a
        :class:`FreshState`."""
        if not cfg.carry_state:
            return FreshState()
        # its warnings point at the caller of our caller (Trainer(...)'s, as before)
        check_carry_state(model, cfg, streams.stream_tokens, world, stacklevel=3)
        return cls(streams, device)

    def __init__(self, streams: CarriedStreams, device):
        self.streams, self.device = streams, device
        self.state = None
        self._parts: list = []

    def begin_step(self, step: int) -> None:
        """Before step ``step``'s forward: a fresh state when every stream restarts."""
        if self.streams.restarts(step):
            self.state = None  # every stream starts again at its shard's first token
        self._parts = []

    def forward(self, model, x, y, rows: slice | None):
        """Summed cross-entropy of ``model`` on windows ``x`` (targets ``y``) from the carried state
        (its ``rows``: a micro-batch under ``grad_accum``); the new state is kept for :meth:`end_step`."""
        carried = self.state
        if carried is not None and rows is not None:
            carried = states.select_rows(carried, rows)
        ce, new_state = model(x, carried, targets=y, ignore_index=IGNORE_INDEX)
        self._parts.append(states.snapshot(new_state))  # a value, cut from the graph
        return ce

    def end_step(self) -> None:
        """After a successful step: the next step starts from the states of this one's windows."""
        parts = self._parts
        self.state = parts[0] if len(parts) == 1 else states.cat_rows(parts)

    def save(self, step: int) -> dict:
        """What a checkpoint holds: the next step's stream window and the state it starts from."""
        return {
            "stream_window": self.streams.window(step),
            "carried_state": None if self.state is None else states.to(self.state, "cpu"),
        }

    def restore(self, ckpt: Path, saved: dict, step: int) -> None:
        """Resume from checkpoint ``ckpt`` (its trainer state ``saved``) at step ``step``.

        Raises:
            ValueError: the checkpoint holds no carried state, or one of another stream window."""
        streams = self.streams
        if "carried_state" not in saved or saved.get("stream_window") != streams.window(step):
            raise ValueError(
                f"TrainConfig.carry_state: {ckpt} does not hold the carried state of step {step} "
                f"(expected stream window {streams.window(step)} of {streams.windows}, got "
                f"{saved.get('stream_window')!r}); it was not written by this run"
            )
        carried = saved["carried_state"]
        self.state = None if carried is None else states.to(carried, self.device)
