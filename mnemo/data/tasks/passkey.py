"""Passkey / needle-in-a-haystack retrieval (Mohtashami & Jaggi 2023, "Landmark Attention", the
passkey test; single-needle S-NIAH of Hsieh et al. 2024, "RULER"), as a token-level task."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import IGNORE_INDEX, Task, sample_without_replacement


def draw_needles(B, H, n, L, key0, num_keys, value_vocab, needle_token, gen):
    """``n`` non-overlapping needles ``▷ κ d1 … dL`` per row at uniformly random depths of a
    haystack of ``H`` positions, with distinct keys ``κ`` from ``[key0, key0 + num_keys)`` and
    value tokens from the ``value_vocab`` ids after the keys (random draws: keys, values, depths).

    Returns ``(keys [B, n], vals [B, n, L], idx [B, n·(L+2)], needles [B, n·(L+2)])``: the needles'
    tokens and the haystack positions they occupy (``x.scatter_(1, idx, needles)`` places them).
    """
    m = L + 2  # needle length
    val0 = key0 + num_keys
    keys = sample_without_replacement(B, num_keys, n, gen) + key0  # [B, n] distinct
    vals = torch.randint(val0, val0 + value_vocab, (B, n, L), generator=gen)
    # non-overlapping starts: distinct sorted c in [0, H − n(m−1)), pos_j = c_j + j(m − 1)
    c = sample_without_replacement(B, H - n * (m - 1), n, gen).sort(dim=-1).values
    pos = c + torch.arange(n) * (m - 1)  # [B, n]
    needles = torch.cat(
        [torch.full((B, n, 1), needle_token, dtype=torch.long), keys[..., None], vals], dim=-1
    )
    idx = (pos[..., None] + torch.arange(m)).reshape(B, n * m)
    return keys, vals, idx, needles.reshape(B, n * m)


@dataclass
class Passkey(Task):
    """A key–value needle hidden in long filler, retrieved at the end.

    Layout of one sequence of length ``T`` (``L = value_len``)::

        f f f f ▷ κ d1 d2 … dL f f f f f … f f | ? κ d1 … d(L−1)
        └────────── haystack, T − L − 1 ─────────┘ └── query, L + 1 ──┘

    The haystack is filler (``"random"``: uniform over the ``filler_vocab`` filler tokens;
    ``"repeat"``: the filler tokens in a fixed cycle, like the repeated sentences of the passkey
    test) with ``num_needles`` non-overlapping needles ``▷ κ d1 … dL`` at uniformly random depths;
    their keys ``κ`` are distinct. The query ``? κ`` names one needle's key (uniformly chosen) and
    the model must produce that needle's value: ``targets`` at ``κ`` is ``d1``, at ``d_i`` it is
    ``d(i+1)`` (teacher-forced), :data:`IGNORE_INDEX` elsewhere. With ``num_needles > 1`` the other
    needles are distractors.

    Vocabulary: filler ``[0, F)``, needle marker ``▷ = F``, query marker ``? = F + 1``, keys
    ``[F + 2, F + 2 + K)``, value tokens ``[F + 2 + K, F + 2 + K + value_vocab)``.

    Options:
        filler_vocab: ``F`` (16). filler: ``"random"`` (default) or ``"repeat"``.
        num_keys: ``K``, the key vocabulary (16), ``>= num_needles``.
        value_len: ``L`` value tokens per needle (5, a 5-digit passkey). value_vocab: 10 (digits).
        num_needles: needles in the haystack (1).

    ``min_length = num_needles · (L + 2) + L + 1``.
    """

    name = "passkey"
    paper = "Mohtashami & Jaggi 2023 (passkey retrieval); Hsieh et al. 2024, RULER (S-NIAH)"

    filler_vocab: int = 16
    filler: str = "random"
    num_keys: int = 16
    value_len: int = 5
    value_vocab: int = 10
    num_needles: int = 1

    def validate(self) -> Passkey:
        self._int("filler_vocab", 1)
        if self.filler not in ("random", "repeat"):
            self._bad("filler", "'random' or 'repeat'")
        self._int("num_keys", 1)
        self._int("value_len", 1)
        self._int("value_vocab", 2)
        self._int("num_needles", 1)
        if self.num_needles > self.num_keys:
            raise ValueError(
                f"passkey option 'num_needles': {self.num_needles} needles need as many distinct keys, "
                f"but num_keys = {self.num_keys}"
            )
        return self

    @property
    def vocab_size(self) -> int:
        return self.filler_vocab + 2 + self.num_keys + self.value_vocab

    @property
    def needle_token(self) -> int:
        return self.filler_vocab

    @property
    def query_token(self) -> int:
        return self.filler_vocab + 1

    @property
    def min_length(self) -> int:
        return self.num_needles * (self.value_len + 2) + self.value_len + 1

    def _generate(self, B: int, T: int, gen: torch.Generator):
        F, L, n = self.filler_vocab, self.value_len, self.num_needles
        H = T - (L + 1)  # haystack length
        if self.filler == "random":
            x = torch.randint(0, F, (B, T), generator=gen)
        else:
            x = (torch.arange(T) % F).expand(B, T).clone()
        keys, vals, idx, needles = draw_needles(
            B, H, n, L, F + 2, self.num_keys, self.value_vocab, self.needle_token, gen
        )
        x.scatter_(1, idx, needles)
        q = torch.randint(0, n, (B, 1), generator=gen)
        qkey = keys.gather(1, q)  # [B, 1]
        qval = vals.gather(1, q[..., None].expand(B, 1, L))[:, 0]  # [B, L]
        x[:, H] = self.query_token
        x[:, H + 1 : H + 2] = qkey
        x[:, H + 2 :] = qval[:, : L - 1]
        y = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)
        y[:, H + 1 :] = qval
        return x, y
