"""Text corpora: the bundled tinyshakespeare, or any UTF-8 file; deterministic splits and batches.

(JSONL, Parquet and many-document corpora: :mod:`mnemo.data.corpus`.)"""

from __future__ import annotations

from .corpus import BUNDLED, VAL_FRACTION, load_corpus
from .stream import TokenStream

__all__ = ["BUNDLED", "VAL_FRACTION", "TokenStream", "load_text", "split_text"]


def load_text(data: str, text_field: str = "text") -> str:
    """The text of a bundled corpus name (``"tinyshakespeare"``) or of a UTF-8 file path; for a
    JSONL/Parquet file, a folder or a glob (:func:`~mnemo.data.corpus.load_corpus`), the
    documents joined by ``"\\n\\n"``.

    Raises:
        FileNotFoundError: the path does not exist (and is not a bundled name).
        ValueError: the file is empty or is not valid UTF-8 (JSONL/Parquet: see ``load_corpus``).
    """
    return load_corpus(data, text_field).text


def split_text(text: str, val_fraction: float = VAL_FRACTION) -> tuple[str, str]:
    """Deterministic split: the first ``1 − val_fraction`` of the characters train, the rest validate."""
    cut = int(len(text) * (1.0 - val_fraction))
    return text[:cut], text[cut:]
