"""Copying (the copy-memory task of Arjovsky et al. 2016, "Unitary Evolution RNNs", and the
string copying of Jelassi et al. 2024, "Repeat After Me: Transformers are Better than State Space
Models at Copying")."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import IGNORE_INDEX, Task


@dataclass
class Copying(Task):
    """Copy a random string after a delay: recall of *everything*, in order.

    Layout of one sequence of length ``T`` (``L = copy_len``, delay ``D = T − 2L``)::

        x1 x2 … xL ∅ ∅ … ∅ | ▷ x1 x2 … x(L−1)
        └ data ┘ └ D blanks ┘ └── output, L ──┘

    Data tokens are uniform (with repetition) over ``[1, V − 1)``; 0 is the blank and ``V − 1``
    the marker ``▷``. ``targets`` at ``▷`` is ``x1`` and at the ``i``-th output position ``x(i+1)``:
    with ``teacher_forcing`` (default) the inputs after ``▷`` are the string itself (Jelassi et al.),
    without it they are blanks (Arjovsky et al.'s copy memory), so the model cannot lean on the
    previous output. A fixed-size state can copy at most about its capacity in tokens, unlike
    attention, whose cache holds the whole string.

    Options:
        vocab_size: ``V`` including blank and marker (32), ``>= 4`` (two data tokens at least:
            with one, every target is known in advance).
        copy_len: ``L`` (16); ``None`` copies as much as fits, ``L = T // 2`` (no delay at an even
            ``T``; one blank at an odd ``T``).
        teacher_forcing: see above (True).

    ``min_length = 2 L`` (2 when ``copy_len`` is ``None``).
    """

    name = "copying"
    paper = "Arjovsky et al. 2016 (copy memory); Jelassi et al. 2024 (Repeat After Me)"

    vocab_size: int = 32
    copy_len: int | None = 16
    teacher_forcing: bool = True

    def validate(self) -> Copying:
        self._int("vocab_size", 4)
        self._int("copy_len", 1, allow_none=True)
        if not isinstance(self.teacher_forcing, bool):
            self._bad("teacher_forcing", "True or False")
        return self

    @property
    def min_length(self) -> int:
        return 2 if self.copy_len is None else 2 * self.copy_len

    @property
    def marker_token(self) -> int:
        return self.vocab_size - 1

    def _generate(self, B: int, T: int, gen: torch.Generator):
        L = T // 2 if self.copy_len is None else self.copy_len
        V = self.vocab_size
        start = T - L  # the marker position
        data = torch.randint(1, V - 1, (B, L), generator=gen)
        x = torch.zeros(B, T, dtype=torch.long)
        x[:, :L] = data
        x[:, start] = self.marker_token
        if self.teacher_forcing:
            x[:, start + 1 :] = data[:, : L - 1]
        y = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)
        y[:, start:] = data
        return x, y
