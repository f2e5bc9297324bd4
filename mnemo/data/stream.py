"""A token stream cut into training windows (a module of its own: :mod:`mnemo.data.corpus`
makes streams and :mod:`mnemo.data.text` re-exports the class, neither importing the other for it)."""

from __future__ import annotations

import numbers

import torch


class TokenStream:
    """A 1-D token tensor sampled as ``(input, target)`` windows of ``seq_len``.

    ``sample(batch_size, generator)`` draws random window starts from ``generator`` (so a saved
    generator state resumes the exact batch sequence); ``eval_batches`` gives fixed,
    non-overlapping windows covering the stream.

    ``doc_starts`` (optional, 1-D long): the offset of each document's first token in ``ids``
    (documents are joined by a separator; :meth:`mnemo.data.corpus.Corpus.stream`); ``num_chars``
    (optional): the characters the stream stands for (bits per character).
    """

    def __init__(
        self,
        ids: torch.Tensor,
        seq_len: int,
        *,
        doc_starts: torch.Tensor | None = None,
        num_chars: int | None = None,
    ):
        if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
            raise ValueError(f"seq_len: expected an int >= 1, got {seq_len!r}")
        if ids.numel() < seq_len + 1:
            raise ValueError(
                f"the text is too short: {ids.numel()} tokens, but a window of seq_len + 1 = {seq_len + 1} "
                "tokens is needed (use a longer file or a smaller --seq-len)"
            )
        self.ids, self.seq_len = ids, seq_len
        self.doc_starts = torch.zeros(1, dtype=torch.long) if doc_starts is None else doc_starts
        self.num_chars = num_chars

    def sample(self, batch_size: int, generator: torch.Generator, *, with_documents: bool = False):
        """``(x, y)`` windows ``[batch_size, seq_len]`` at random starts; with ``with_documents``
        also ``first [batch_size, seq_len]`` bool (:meth:`document_starts`)."""
        starts = torch.randint(0, self.ids.numel() - self.seq_len, (batch_size,), generator=generator)
        return self._windows(starts, with_documents)

    def eval_batches(self, batch_size: int, max_batches: int | None = None, *, with_documents: bool = False):
        """Yield non-overlapping ``(x, y)`` batches in order (at most ``max_batches``; default
        ``max_batches=None``: all); with ``with_documents``, ``(x, y, first)``
        (:meth:`document_starts`). Raises ``ValueError`` naming ``batch_size`` or ``max_batches``
        when it is not an int ``>= 1`` (``0`` yielded nothing, ``-1`` dropped the last batch)."""
        for what, value in (("batch_size", batch_size), ("max_batches", max_batches)):
            if value is None and what == "max_batches":
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{what}: expected an int >= 1, got {value!r}")
        n = (self.ids.numel() - 1) // self.seq_len
        starts = torch.arange(n) * self.seq_len
        if max_batches is not None:
            starts = starts[: max_batches * batch_size]
        for i in range(0, starts.numel(), batch_size):
            yield self._windows(starts[i : i + batch_size], with_documents)

    def _windows(self, starts: torch.Tensor, with_documents: bool):
        idx = starts[:, None] + torch.arange(self.seq_len + 1)[None, :]
        w = self.ids[idx]
        if with_documents:
            return w[:, :-1], w[:, 1:], self.document_starts(starts)
        return w[:, :-1], w[:, 1:]

    def document_starts(self, starts: torch.Tensor) -> torch.Tensor:
        """For windows of ``seq_len`` tokens beginning at ``starts [B]``: ``first [B, seq_len]``
        bool, true where a document begins inside the window (and at column 0: a window's first
        token starts a sequence of its own). Packed training (``TrainConfig.pack_documents``)
        turns it into ``cu_seqlens``."""
        begins = torch.zeros(self.ids.numel() + 1, dtype=torch.bool)
        begins[self.doc_starts] = True
        first = begins[starts[:, None] + torch.arange(self.seq_len)[None, :]]
        first[:, 0] = True
        return first
