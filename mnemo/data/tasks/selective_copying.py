"""Selective copying (Gu & Dao 2023, "Mamba: Linear-Time Sequence Modeling with Selective State
Spaces", §4.1.1 and Fig. 2)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import IGNORE_INDEX, Task, sample_without_replacement


@dataclass
class SelectiveCopying(Task):
    """Selective copying: remember the data tokens scattered among noise, output them in order.

    Layout of one sequence of length ``T`` with ``n = num_tokens``::

        ∅ ∅ d1 ∅ ∅ ∅ d2 ∅ d3 ∅ … ∅ dn ∅ ∅ | M M M … M
        └──── context (T − n), data at random positions ┘ └ n markers ┘

    Token 0 is the noise token, ``V − 1`` the marker, data tokens are drawn uniformly (with
    repetition) from ``[1, V − 1)``. The data positions are distinct, uniformly random and kept in
    order. ``targets`` at the ``i``-th marker is ``d_i`` (the markers carry no information, so the
    model must have stored the data: this is what an LTI model, whose "where to look" cannot depend
    on content, fails at); every other position is :data:`IGNORE_INDEX`.

    Options:
        vocab_size: ``V`` including the noise and marker tokens (Mamba: 16), ``>= 4`` (two data
            tokens at least: with one, every target is known in advance).
        num_tokens: ``n`` data tokens to copy (Mamba: 16).

    ``min_length = 2 n`` (a context of at least ``n`` positions, then ``n`` markers).
    """

    name = "selective_copying"
    paper = "Gu & Dao 2023, Mamba §4.1 (selective copying)"

    vocab_size: int = 16
    num_tokens: int = 16

    def validate(self) -> SelectiveCopying:
        self._int("vocab_size", 4)
        self._int("num_tokens", 1)
        return self

    @property
    def min_length(self) -> int:
        return 2 * self.num_tokens

    @property
    def noise_token(self) -> int:
        return 0

    @property
    def marker_token(self) -> int:
        return self.vocab_size - 1

    def _generate(self, B: int, T: int, gen: torch.Generator):
        n, V = self.num_tokens, self.vocab_size
        C = T - n
        pos = sample_without_replacement(B, C, n, gen).sort(dim=-1).values  # [B, n] increasing
        data = torch.randint(1, V - 1, (B, n), generator=gen)
        x = torch.zeros(B, T, dtype=torch.long)
        x.scatter_(1, pos, data)
        x[:, C:] = self.marker_token
        y = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)
        y[:, C:] = data
        return x, y
