"""Induction heads (Olsson et al. 2022; the synthetic task of Fu et al. 2023, "Hungry Hungry
Hippos" (H3), §3.1, and Gu & Dao 2023, Mamba §4.1.2)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import IGNORE_INDEX, Task


@dataclass
class InductionHeads(Task):
    """Induction heads: after ``… ◆ a …``, seeing ``◆`` again, predict ``a``.

    Layout of one sequence of length ``T``::

        r r r r ◆ a r r r r r … r r ◆
                 p                 T−1

    All tokens are uniform over ``[0, V − 1)``; the trigger ``◆ = V − 1`` appears exactly twice:
    at a uniformly random position ``p ∈ [0, T − 3]`` and at the last position. The only supervised
    position is the last one, with ``targets[:, T − 1] = input_ids[:, p + 1]`` (the token that
    followed the first trigger). Because ``p`` is uniform over the whole sequence and nothing else
    depends on ``T``, a model trained at one length can be tested at any other (Mamba trains at 256
    and tests up to 2^20 tokens); a model that counts positions cannot.

    Options:
        vocab_size: ``V`` including the trigger (Mamba: 16), ``>= 3``.

    ``min_length = 3``.
    """

    name = "induction_heads"
    paper = "Fu et al. 2023 (H3) §3.1; Gu & Dao 2023, Mamba §4.1 (induction heads)"

    vocab_size: int = 16

    def validate(self) -> InductionHeads:
        self._int("vocab_size", 3)
        return self

    @property
    def min_length(self) -> int:
        return 3

    @property
    def trigger_token(self) -> int:
        return self.vocab_size - 1

    def _generate(self, B: int, T: int, gen: torch.Generator):
        V = self.vocab_size
        x = torch.randint(0, V - 1, (B, T), generator=gen)
        p = torch.randint(0, T - 2, (B, 1), generator=gen)  # [0, T − 3]
        x.scatter_(1, p, torch.full_like(p, self.trigger_token))
        x[:, -1] = self.trigger_token
        y = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)
        y[:, -1] = x.gather(1, p + 1)[:, 0]
        return x, y
