"""RULER's needle-in-a-haystack family at token level, with a haystack the model must process.

Hsieh et al. 2024, "RULER: What's the Real Context Size of Your Long-Context Language Models?"
(§3.1: S-NIAH-1/2/3, MK-NIAH, and an adaptation of MQ-NIAH with the keys asked in turn); the
variants Gated DeltaNet (Yang et al. 2024, Table 2) reports.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .base import IGNORE_INDEX, Task
from .passkey import draw_needles

#: RULER's repeated-noise haystack (its S-NIAH-1 "noise" sentences), repeated without end
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
#: symbols of a value: RULER's needles hold 7-digit numbers or UUIDs (hexadecimal)
VALUE_SYMBOLS = {"number": 10, "uuid": 16}


@functools.lru_cache(maxsize=1)
def _essay() -> tuple[str, torch.Tensor]:
    """``(alphabet, ids)``: the bundled corpus' training split (the first 90%: no validation text
    in a haystack) as character ids over ``alphabet`` (its characters and the noise sentence's)."""
    from ..text import load_text, split_text

    text = split_text(load_text("tinyshakespeare"))[0]
    alphabet = "".join(sorted(set(text) | set(NOISE)))
    index = {c: i for i, c in enumerate(alphabet)}
    return alphabet, torch.tensor([index[c] for c in text], dtype=torch.long)


@dataclass
class NIAH(Task):
    """Needles in a haystack of text (RULER's S-NIAH / MK-NIAH; several queries), scored by exact match.

    Layout of one sequence of length ``T`` (``L = value_len``, ``n = num_needles``, one query)::

        t t t t ▷ κ d1 … dL t t t t … t t | ? κ d1 … d(L−1)
        └──────── haystack, H = T − L − 1 ───┘ └─ query, L + 1 ─┘

    The haystack is character text ``t`` with ``n`` needles ``▷ κ d1 … dL`` spliced in at uniformly
    random depths (the text continues after each needle where it stopped before it; needles never
    overlap; their keys ``κ`` are distinct). The query ``? κ`` names one needle's key and the model
    must produce that needle's value: ``targets`` at ``κ`` is ``d1``, at ``d_i`` it is ``d(i+1)``.

    Several queries (``num_queries = q > 1``), an adaptation of RULER's MQ-NIAH: ``q`` distinct
    needles are queried **in turn**, ``? κ1 d1 … dL ? κ2 d1 … dL … ? κq d1 … d(L−1)``
    (``q·(L + 2) − 1`` tokens; the haystack is ``H = T − q·(L + 2) + 1``); each answer is trained
    and scored as above (the ``?`` after an answer is not a target). RULER instead asks for all
    ``q`` keys in one question and scores one free-running answer by the share of the values it
    contains; here the model never holds unanswered keys, and the answers are teacher-forced: a
    later query sees the true values of the earlier ones (a wrong early answer cannot derail it).

    Haystacks (RULER's variants):

    * ``"noise"`` — RULER's repeated sentences (:data:`NOISE`), from a random phase (S-NIAH-1);
    * ``"essay"`` — the bundled corpus (tinyshakespeare's training split) from a random offset: the
      analogue of RULER's Paul Graham essays (S-NIAH-2/3);
    * ``"random"`` — characters drawn uniformly (the old :class:`~.passkey.Passkey` filler:
      nothing in it can be predicted, so it carries no loss).

    With ``haystack_loss`` (default) the haystack's text positions are trained with next-token
    targets (``targets[t] = input_ids[t + 1]`` wherever that token is text), so the model must
    process and store the text, not only skip it: the haystack competes with the needle for the
    memory, as in RULER, where the model is a language model. Positions whose next token belongs to
    a needle are never supervised (the needle's place and content are random).

    **Metric.** :meth:`scored` keeps only the answer positions (``q·L``), so a test set's ``acc`` is
    per-digit accuracy and its ``seq_acc`` is **exact match**, RULER's metric: with teacher forcing
    every answer digit is the argmax exactly when greedy decoding from ``? κ`` generates the whole
    value (each greedy step then sees the true digits before it), so teacher-forced all-correct
    equals the generated value matching. With several queries :meth:`answer_units` makes
    ``seq_acc`` the fraction of *answers* matched exactly (every sample has ``q`` answers, so this
    is RULER's mean over samples of the share of values recalled).

    Values: ``"number"`` (digits, RULER's 7-digit numbers: ``value_len`` 7) or ``"uuid"``
    (hexadecimal symbols; RULER's UUIDs have 32). Multi-key (MK-NIAH): ``num_needles > 1``, the
    other needles are distractors with other keys.

    Vocabulary: text characters ``[0, A)`` (``A`` = :attr:`text_vocab`: the corpus' characters and
    the noise sentence's), ``▷ = A``, ``? = A + 1``, keys ``[A + 2, A + 2 + K)``, value symbols after
    them. ``min_length = (n + q) · (L + 2)``: the needles, the queries and one text token.

    Options:
        haystack: ``"noise"``, ``"essay"`` (default) or ``"random"``.
        haystack_loss: next-token targets on the haystack's text (``True``; ``False`` for
            ``"random"``, where it is refused).
        value: ``"number"`` (default) or ``"uuid"``. value_len: ``L`` symbols (7).
        num_keys: ``K`` distinct key tokens (16), ``>= num_needles``. num_needles: ``n`` (1).
        num_queries: ``q`` needles queried in turn (1), ``<= num_needles``.
    """

    name = "niah"
    paper = "Hsieh et al. 2024, RULER (S-NIAH-1/2/3, MK-NIAH, MQ-NIAH asked in turn; exact match)"

    haystack: str = "essay"
    haystack_loss: bool = True
    value: str = "number"
    value_len: int = 7
    num_keys: int = 16
    num_needles: int = 1
    num_queries: int = 1

    def validate(self) -> NIAH:
        if self.haystack not in ("noise", "essay", "random"):
            self._bad("haystack", "'noise', 'essay' or 'random'")
        if not isinstance(self.haystack_loss, bool):
            self._bad("haystack_loss", "true or false")
        if self.haystack == "random" and self.haystack_loss:
            raise ValueError(
                "niah option 'haystack_loss': a 'random' haystack cannot be predicted, so it carries no "
                "loss; set haystack_loss: false, or use haystack 'noise' or 'essay'"
            )
        if not isinstance(self.value, str) or self.value not in VALUE_SYMBOLS:
            self._bad("value", f"one of {sorted(VALUE_SYMBOLS)}")
        self._int("value_len", 1)
        self._int("num_keys", 1)
        self._int("num_needles", 1)
        if self.num_needles > self.num_keys:
            raise ValueError(
                f"niah option 'num_needles': {self.num_needles} needles need as many distinct keys, but "
                f"num_keys = {self.num_keys}"
            )
        self._int("num_queries", 1)
        if self.num_queries > self.num_needles:
            raise ValueError(
                f"niah option 'num_queries': expected at most num_needles = {self.num_needles} queries "
                f"(each asks for a different needle), got {self.num_queries}"
            )
        return self

    @property
    def text_vocab(self) -> int:
        """``A``: the number of text characters (ids ``[0, A)``)."""
        return len(_essay()[0])

    @property
    def vocab_size(self) -> int:
        return self.text_vocab + 2 + self.num_keys + VALUE_SYMBOLS[self.value]

    @property
    def needle_token(self) -> int:
        return self.text_vocab

    @property
    def query_token(self) -> int:
        return self.text_vocab + 1

    @property
    def min_length(self) -> int:
        return (self.num_needles + self.num_queries) * (self.value_len + 2)

    def decode_text(self, ids) -> str:
        """The characters of text ids (other tokens as ``▷``, ``?``, ``k<i>``, ``v<i>``), for reading."""
        alphabet, A, K = _essay()[0], self.text_vocab, self.num_keys
        out = []
        for i in (int(t) for t in ids):
            if i < A:
                out.append(alphabet[i])
            elif i == A:
                out.append("▷")
            elif i == A + 1:
                out.append("?")
            elif i < A + 2 + K:
                out.append(f"k{i - A - 2}")
            else:
                out.append(f"v{i - A - 2 - K}")
        return "".join(out)

    def _text(self, B: int, n: int, gen: torch.Generator) -> torch.Tensor:
        """``[B, n]`` haystack text ids."""
        alphabet, essay = _essay()
        if self.haystack == "essay":
            if n > essay.numel():
                raise ValueError(
                    f"seq_len: niah's 'essay' haystack holds at most {essay.numel()} characters of text "
                    f"(the bundled corpus' training split), this length needs {n}; use a shorter "
                    "seq_len or haystack 'noise'"
                )
            start = torch.randint(0, essay.numel() - n + 1, (B, 1), generator=gen)
            return essay[start + torch.arange(n)]
        if self.haystack == "noise":
            index = {c: i for i, c in enumerate(alphabet)}
            noise = torch.tensor([index[c] for c in NOISE])
            phase = torch.randint(0, noise.numel(), (B, 1), generator=gen)
            return noise[(phase + torch.arange(n)) % noise.numel()]
        return torch.randint(0, len(alphabet), (B, n), generator=gen)

    def _query_len(self) -> int:
        """Tokens after the haystack: ``q`` blocks ``? κ d1 … dL`` without the last ``dL``."""
        return self.num_queries * (self.value_len + 2) - 1

    def _generate(self, B: int, T: int, gen: torch.Generator):
        A, L, n, nq = self.text_vocab, self.value_len, self.num_needles, self.num_queries
        m = L + 2  # needle length (and a query block's)
        H = T - self._query_len()  # haystack length
        keys, vals, idx, needles = draw_needles(
            B, H, n, L, A + 2, self.num_keys, VALUE_SYMBOLS[self.value], self.needle_token, gen
        )
        in_needle = torch.zeros(B, H, dtype=torch.bool).scatter_(1, idx, True)
        hay = torch.zeros(B, H, dtype=torch.long).scatter_(1, idx, needles)
        # splice: the text goes on after a needle where it stopped before it
        text = self._text(B, H - n * m, gen)
        text_at = ((~in_needle).cumsum(1) - 1).clamp_min(0)
        hay = torch.where(in_needle, hay, text.gather(1, text_at.clamp_max(max(H - n * m - 1, 0))))
        if nq == 1:
            q = torch.randint(0, n, (B, 1), generator=gen)
        else:  # distinct needles, in random order
            q = torch.rand(B, n, generator=gen).argsort(dim=1)[:, :nq]
        qkey = keys.gather(1, q)  # [B, q]
        qval = vals.gather(1, q[..., None].expand(B, nq, L))  # [B, q, L]
        blocks = torch.cat([torch.full((B, nq, 1), self.query_token), qkey[..., None], qval], dim=2)
        ignore = torch.full((B, nq, 1), IGNORE_INDEX)
        answers = torch.cat([ignore, qval, ignore], dim=2)  # the target at each block position
        x = torch.cat([hay, blocks.reshape(B, nq * m)[:, :-1]], dim=1)
        y = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)
        if self.haystack_loss:  # next-token targets where the next token is haystack text
            nxt_text = ~in_needle[:, 1:]
            y[:, : H - 1] = torch.where(nxt_text, hay[:, 1:], IGNORE_INDEX)
        y[:, H:] = answers.reshape(B, nq * m)[:, :-1]
        return x, y

    def scored(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The answer positions only (the last ``value_len``; ``q·L`` with ``q`` queries): ``acc`` per
        symbol, ``seq_acc`` exact match. The haystack's next-token targets train the model but are
        not scored."""
        out = torch.full_like(targets, IGNORE_INDEX)
        H = targets.shape[1] - self._query_len()
        out[:, H:] = targets[:, H:]
        return out

    def answer_units(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """With several queries, the query each answer position belongs to (``[B, T]``: ``0 … q−1``
        on the answers, −1 elsewhere), so ``seq_acc`` counts answers; ``None`` with one query."""
        if self.num_queries == 1:
            return None
        T, m = targets.shape[1], self.value_len + 2
        H = T - self._query_len()
        units = torch.full(targets.shape, -1, dtype=torch.int32, device=targets.device)
        block = torch.arange(T - H, dtype=torch.int32, device=targets.device) // m
        units[:, H:] = torch.where(targets[:, H:] != IGNORE_INDEX, block, -1)
        return units
