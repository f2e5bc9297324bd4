"""What every synthetic recall task shares: options, seeds, the ``(inputs, targets)`` contract.

A task is a small dataclass of options (validated on construction, errors name the option) with

* ``vocab_size`` — the vocabulary the model needs (an option, or a property derived from them);
* ``min_length`` — the shortest sequence the options allow;
* ``generate(batch_size, seq_len, generator) -> (input_ids, targets)`` — both ``[B, T]`` long;
  ``targets[b, t]`` is the token the model must predict *at* position ``t`` (i.e. from
  ``input_ids[b, : t + 1]``), or :data:`IGNORE_INDEX` where nothing is supervised. The model's
  logits at ``t`` are compared with ``targets[:, t]`` directly (no shift).

Generation is vectorised over the batch and draws every random number from the given
``torch.Generator``, so one seed gives one stream of batches. :func:`split_seed` maps a run seed
to disjoint train (even) and test (odd) generator seeds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

IGNORE_INDEX = -100
SPLITS = ("train", "test")


def split_seed(seed: int, split: str) -> int:
    """The generator seed of ``split`` (``"train"`` or ``"test"``) for run seed ``seed``.

    Train seeds are even (``2·seed``) and test seeds odd (``2·seed + 1``), so no train stream ever
    equals a test stream, for any pair of run seeds.

    Raises:
        ValueError: ``split`` is not ``"train"``/``"test"`` or ``seed`` is not in ``[0, 2^63)`` (a
            generator seed is at most ``2^64 − 1``).
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
        raise ValueError(
            f"seed must be a non-negative int below 2**63 (generator seeds are < 2**64), got {seed!r}"
        )
    return 2 * seed + SPLITS.index(split)


def make_generator(seed: int, split: str = "train") -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with ``split_seed(seed, split)``."""
    return torch.Generator().manual_seed(split_seed(seed, split))


def sample_without_replacement(
    batch_size: int, population: int, k: int, generator: torch.Generator, log_weights=None
) -> torch.Tensor:
    """``[batch_size, k]`` distinct indices in ``[0, population)`` per row (random order).

    Uniform by default; with ``log_weights [population]`` the draw is successive sampling
    proportional to ``exp(log_weights)`` (the Gumbel-top-k trick), vectorised over rows.
    """
    u = torch.rand(batch_size, population, generator=generator, dtype=torch.float64)
    if log_weights is None:
        # the k smallest draws in increasing order (= argsort()[:, :k], without sorting them all:
        # a vocabulary of 8192 has 4095 candidate keys per row)
        return u.topk(k, dim=-1, largest=False).indices
    e = (-torch.log(u.clamp_min(1e-300))).clamp_min(1e-300)  # Exp(1) draws
    gumbel = -torch.log(e)
    return (log_weights.to(torch.float64)[None, :] + gumbel).topk(k, dim=-1).indices


@dataclass
class Task:
    """Base class of the synthetic tasks (subclasses are dataclasses whose fields are the options)."""

    name: ClassVar[str] = ""
    #: the paper the task definition follows (shown by ``mnemo tasks``)
    paper: ClassVar[str] = ""

    def __post_init__(self):
        self.validate()

    # -- option checks (raise ValueError naming the option) ------------------------------------
    def _bad(self, option: str, expected: str):
        raise ValueError(f"{self.name} option {option!r}: expected {expected}, got {getattr(self, option)!r}")

    def _int(self, option: str, minimum: int = 1, allow_none: bool = False) -> None:
        v = getattr(self, option)
        if v is None and allow_none:
            return
        if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
            self._bad(option, f"an int >= {minimum}" + (" or None" if allow_none else ""))

    def validate(self) -> Task:  # pragma: no cover - every task overrides it
        return self

    # -- the contract ------------------------------------------------------------------------
    @property
    def min_length(self) -> int:  # pragma: no cover
        raise NotImplementedError

    def options(self) -> dict[str, Any]:
        """The task's options as a plain dict (what ``build_task(name, **options)`` takes)."""
        return dataclasses.asdict(self)

    def check_length(self, seq_len: int, what: str = "seq_len") -> None:
        """Raise ``ValueError`` naming ``what`` when ``seq_len`` is no int or is below :attr:`min_length`."""
        if not isinstance(seq_len, int) or isinstance(seq_len, bool):
            raise ValueError(f"{what}: expected an int, got {seq_len!r} ({type(seq_len).__name__})")
        if seq_len < self.min_length:
            raise ValueError(
                f"{what}: {self.name} with options {self.options()} needs sequences of at least "
                f"{self.min_length} tokens, got {seq_len!r}"
            )

    def generate(
        self, batch_size: int, seq_len: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids [B, T] long, targets [B, T] long)`` drawn from ``generator``."""
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        self.check_length(seq_len)
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        x, y = self._generate(batch_size, seq_len, generator)
        return x, y

    def _generate(self, batch_size: int, seq_len: int, generator: torch.Generator):  # pragma: no cover
        raise NotImplementedError

    def scored(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The targets a test set's metrics read (``[B, T]``; :data:`IGNORE_INDEX` elsewhere).

        By default every supervised position. A task that trains on more positions than it scores
        (``niah``'s haystack text) keeps only the scored ones here, so ``acc`` and ``seq_acc`` mean
        what the task's paper measures."""
        return targets

    def answer_units(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """For a test set whose sequences hold several answers scored one by one: per position of the
        :meth:`scored` targets, the answer it belongs to (``[B, T]`` int32, ``0, 1, …`` on scored
        positions, −1 elsewhere); ``seq_acc`` is then the fraction of answers with every position
        right. ``None`` (the default): a sequence is one answer."""
        return None

    def sample(
        self, batch_size: int, seq_len: int, seed: int = 0, split: str = "train"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One batch from a fresh generator for ``(seed, split)`` (a fixed test set, or a demo)."""
        return self.generate(batch_size, seq_len, make_generator(seed, split))
