"""Text corpora: the bundled tinyshakespeare, or any UTF-8 file; deterministic splits and batches."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import torch

BUNDLED = {"tinyshakespeare": "tinyshakespeare.txt"}
VAL_FRACTION = 0.1


def load_text(data: str) -> str:
    """The text of a bundled corpus name (``"tinyshakespeare"``) or of a UTF-8 file path.

    Raises:
        FileNotFoundError: the path does not exist (and is not a bundled name).
        ValueError: the file is empty, is a directory, or is not valid UTF-8.
    """
    if data in BUNDLED:
        return resources.files("mnemo.data").joinpath("corpora", BUNDLED[data]).read_text(encoding="utf-8")
    p = Path(data)
    if not p.exists():
        raise FileNotFoundError(
            f"data file not found: {data!r} (give a path to a UTF-8 text file or one of {sorted(BUNDLED)})"
        )
    if p.is_dir():
        raise ValueError(f"data must be a text file, got a directory: {data!r}")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"data file {data!r} is not valid UTF-8: {e}") from e
    if not text:
        raise ValueError(f"data file {data!r} is empty")
    return text


def split_text(text: str, val_fraction: float = VAL_FRACTION) -> tuple[str, str]:
    """Deterministic split: the first ``1 − val_fraction`` of the characters train, the rest validate."""
    cut = int(len(text) * (1.0 - val_fraction))
    return text[:cut], text[cut:]


class TokenStream:
    """A 1-D token tensor sampled as ``(input, target)`` windows of ``seq_len``.

    ``sample(batch_size, generator)`` draws random window starts from ``generator`` (so a saved
    generator state resumes the exact batch sequence); ``eval_batches`` gives fixed,
    non-overlapping windows covering the stream.
    """

    def __init__(self, ids: torch.Tensor, seq_len: int):
        if ids.numel() < seq_len + 1:
            raise ValueError(
                f"the text is too short: {ids.numel()} tokens, but a window of seq_len + 1 = {seq_len + 1} "
                "tokens is needed (use a longer file or a smaller --seq-len)"
            )
        self.ids, self.seq_len = ids, seq_len

    def sample(self, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, self.ids.numel() - self.seq_len, (batch_size,), generator=generator)
        idx = starts[:, None] + torch.arange(self.seq_len + 1)[None, :]
        w = self.ids[idx]
        return w[:, :-1], w[:, 1:]

    def eval_batches(self, batch_size: int, max_batches: int | None = None):
        """Yield non-overlapping ``(x, y)`` batches in order (at most ``max_batches``)."""
        n = (self.ids.numel() - 1) // self.seq_len
        starts = torch.arange(n) * self.seq_len
        if max_batches is not None:
            starts = starts[: max_batches * batch_size]
        for i in range(0, starts.numel(), batch_size):
            idx = starts[i : i + batch_size, None] + torch.arange(self.seq_len + 1)[None, :]
            w = self.ids[idx]
            yield w[:, :-1], w[:, 1:]
