"""Multi-query associative recall (MQAR; Arora et al. 2023, "Zoology: Measuring and Improving
Recall in Efficient Language Models", §3)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .base import IGNORE_INDEX, Task, sample_without_replacement


@dataclass
class MQAR(Task):
    """Multi-query associative recall.

    Layout of one sequence of length ``T`` with ``N = num_pairs`` pairs::

        k1 v1 k2 v2 … kN vN | f f kσ(1) f f f f kσ(2) f …
        └──── context (2N) ─┘ └─── queries in T − 2N positions ──┘

    * keys are drawn from the lower half of the vocabulary ``[1, V/2)`` (0 is the pad token),
      values from the upper half ``[V/2, V)``; keys are distinct within a sequence, and so are
      values;
    * after the context, the query region is cut into ``S = (T − 2N) // 2`` two-token slots; every
      key is queried exactly once, in slot ``s`` drawn without replacement with probability
      ``∝ s^(power_a − 1)`` (a power law: most queries come soon after the context, some far);
      as in Zoology, the token after a query is filler (the model never sees the answer);
    * only the query positions are supervised: ``targets`` at a query key is its value,
      :data:`IGNORE_INDEX` everywhere else;
    * the other positions hold filler: ``"random"`` draws it from the value half (so a filler
      token never looks like a key), ``"pad"`` uses token 0. Zoology's published experiments (its
      Figure 2 configs, ``random_non_queries=False``) use token 0: ``"pad"``. **Not Zoology's random
      filler**: its code's default (``random_non_queries=True``) draws the filler uniformly from the
      whole vocabulary ``[0, V)``, keys included (an unqueried key can stand in the query region: a
      harder task); the value-half filler here (the default) is neither of the two, so accuracies
      are not comparable one to one with Zoology's.

    Options:
        vocab_size: ``V`` (``V // 2 − 1 >= num_pairs`` keys are needed). Default 256
            (Zoology uses 8192; a small vocabulary keeps the output layer cheap on CPU).
        num_pairs: ``N`` key–value pairs (and queries) per sequence (default 8).
        power_a: the power-law exponent of the query gaps (Zoology's ``0.01``), in ``(0, 1]``.
        filler: ``"random"`` (default) or ``"pad"``.

    ``min_length = 4 N`` (the context plus one slot per query).
    """

    name = "mqar"
    paper = "Arora et al. 2023, Zoology (multi-query associative recall)"

    vocab_size: int = 256
    num_pairs: int = 8
    power_a: float = 0.01
    filler: str = "random"

    def validate(self) -> MQAR:
        self._int("vocab_size", 4)
        self._int("num_pairs", 1)
        a = self.power_a
        if not isinstance(a, (int, float)) or isinstance(a, bool) or not (0 < a <= 1):
            self._bad("power_a", "a number in (0, 1]")
        if self.filler not in ("random", "pad"):
            self._bad("filler", "'random' or 'pad'")
        half = self.vocab_size // 2
        if self.num_pairs > half - 1 or self.num_pairs > self.vocab_size - half:
            raise ValueError(
                f"mqar option 'num_pairs': {self.num_pairs} distinct keys need vocab_size >= "
                f"{2 * self.num_pairs + 2}, got vocab_size = {self.vocab_size}"
            )
        return self

    @property
    def min_length(self) -> int:
        return 4 * self.num_pairs

    def _generate(self, B: int, T: int, gen: torch.Generator):
        N, V = self.num_pairs, self.vocab_size
        half = V // 2
        keys = sample_without_replacement(B, half - 1, N, gen) + 1  # [B, N] in [1, V/2)
        values = sample_without_replacement(B, V - half, N, gen) + half  # [B, N] in [V/2, V)
        slots_total = (T - 2 * N) // 2
        s = torch.arange(1, slots_total + 1, dtype=torch.float64)
        log_w = (self.power_a - 1.0) * torch.log(s) + math.log(self.power_a)
        slots = sample_without_replacement(B, slots_total, N, gen, log_weights=log_w)  # [B, N]
        pos = 2 * N + 2 * slots
        if self.filler == "random":
            x = torch.randint(half, V, (B, T), generator=gen)
        else:
            x = torch.zeros(B, T, dtype=torch.long)
        x[:, : 2 * N] = torch.stack([keys, values], dim=-1).reshape(B, 2 * N)
        x.scatter_(1, pos, keys)
        y = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)
        y.scatter_(1, pos, values)
        return x, y
