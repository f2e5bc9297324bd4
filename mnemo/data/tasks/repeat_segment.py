"""Repeated random segments: the in-context copying data on which induction heads form (Olsson et
al. 2022, "In-context Learning and Induction Heads", §3: a random token sequence in which a segment
reappears later; only an induction circuit can predict the repeat)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import IGNORE_INDEX, Task


@dataclass
class RepeatSegment(Task):
    """Uniform random tokens in which a random segment of ``segment_len`` tokens reappears at a
    random later offset (non-overlapping). Targets are the next tokens (language modelling), on
    every position (``supervise="all"``, the usual phase-change setting: the loss falls when the
    model learns to copy the repeat) or only inside the repeat (``"repeat"``).

    Options:
        vocab_size: ``V`` (64). segment_len: ``L`` (16; ``>= 2`` with ``"repeat"``: a repeat of one
            token holds no position whose next token it predicts). supervise: ``"all"`` or ``"repeat"``.

    ``min_length = 2 L``.
    """

    name = "repeat_segment"
    paper = "Olsson et al. 2022 (In-context Learning and Induction Heads)"

    vocab_size: int = 64
    segment_len: int = 16
    supervise: str = "all"

    def validate(self) -> RepeatSegment:
        self._int("vocab_size", 2)
        self._int("segment_len", 1)
        if self.supervise not in ("all", "repeat"):
            self._bad("supervise", "'all' or 'repeat'")
        if self.supervise == "repeat" and self.segment_len < 2:
            self._bad(
                "segment_len",
                "an int >= 2 with supervise 'repeat' (the targets inside a repeat of L are L − 1)",
            )
        return self

    @property
    def min_length(self) -> int:
        return 2 * self.segment_len

    def _generate(self, B: int, T: int, gen: torch.Generator):
        L = self.segment_len
        n = T + 1  # one extra token so every input position has a next-token target
        tokens = torch.randint(0, self.vocab_size, (B, n), generator=gen)
        u1, u2 = (
            torch.rand(B, generator=gen, dtype=torch.float64),
            torch.rand(B, generator=gen, dtype=torch.float64),
        )
        s1 = (u1 * (n - 2 * L + 1)).long()  # first copy in [s1, s1 + L)
        room = n - L - (s1 + L) + 1  # later starts s2 in [s1 + L, n - L]
        s2 = s1 + L + (u2 * room).long()
        i = torch.arange(L)
        src = s1[:, None] + i
        dst = s2[:, None] + i
        tokens.scatter_(1, dst, tokens.gather(1, src))
        x, y = tokens[:, :T].clone(), tokens[:, 1:].clone()
        if self.supervise == "repeat":
            pos = torch.arange(T)[None, :]
            inside = (pos >= s2[:, None]) & (pos < s2[:, None] + L - 1)  # predictions within the repeat
            y[~inside] = IGNORE_INDEX
        return x, y
