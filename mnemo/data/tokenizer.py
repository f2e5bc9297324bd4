"""Character- and byte-level tokenizers (serialisable to ``tokenizer.json``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TOKENIZER_NAME = "tokenizer.json"


class CharTokenizer:
    """One id per distinct character of the training text, plus ``<unk>`` (id 0).

    ``encode`` maps characters outside the vocabulary to ``<unk>``; ``decode`` renders ``<unk>``
    as U+FFFD. Tokens are characters, so nats per token are nats per character.
    """

    kind = "char"
    UNK = "\ufffd"

    def __init__(self, chars: list[str]):
        if len(set(chars)) != len(chars):
            raise ValueError("CharTokenizer: the character list has duplicates")
        self.chars = list(chars)
        self.stoi = {c: i + 1 for i, c in enumerate(self.chars)}

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        return cls(sorted(set(text)))

    @property
    def vocab_size(self) -> int:
        return len(self.chars) + 1

    def encode(self, text: str) -> torch.Tensor:
        get = self.stoi.get
        return torch.tensor([get(c, 0) for c in text], dtype=torch.long)

    def decode(self, ids) -> str:
        table = [self.UNK] + self.chars
        return "".join(table[i] if 0 <= i < len(table) else self.UNK for i in _to_list(ids))

    def num_chars(self, text: str) -> int:
        return len(text)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "chars": self.chars}


class ByteTokenizer:
    """UTF-8 bytes, vocabulary 256: any text, no unknowns; multi-byte characters span tokens."""

    kind = "byte"

    @property
    def vocab_size(self) -> int:
        return 256

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)

    def decode(self, ids) -> str:
        return bytes(i for i in _to_list(ids) if 0 <= i < 256).decode("utf-8", errors="replace")

    def num_chars(self, text: str) -> int:
        return len(text)

    def to_dict(self) -> dict:
        return {"kind": self.kind}


def _to_list(ids) -> list[int]:
    if isinstance(ids, torch.Tensor):
        return ids.flatten().tolist()
    return list(ids)


def build_tokenizer(kind: str, text: str) -> CharTokenizer | ByteTokenizer:
    """``"char"`` (vocabulary from ``text``) or ``"byte"``."""
    if kind == "char":
        return CharTokenizer.from_text(text)
    if kind == "byte":
        return ByteTokenizer()
    raise ValueError(f"tokenizer must be 'char' or 'byte', got {kind!r}")


def tokenizer_from_dict(d: dict) -> CharTokenizer | ByteTokenizer:
    kind = d.get("kind")
    if kind == "char":
        return CharTokenizer(d["chars"])
    if kind == "byte":
        return ByteTokenizer()
    raise ValueError(f"unknown tokenizer kind {kind!r} (expected 'char' or 'byte')")


def save_tokenizer(tok, directory: str | Path) -> None:
    Path(directory, TOKENIZER_NAME).write_text(json.dumps(tok.to_dict()))


def load_tokenizer(directory: str | Path) -> CharTokenizer | ByteTokenizer:
    p = Path(directory, TOKENIZER_NAME)
    if not p.is_file():
        raise FileNotFoundError(f"checkpoint file missing: {p}")
    try:
        return tokenizer_from_dict(json.loads(p.read_text()))
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"corrupt tokenizer file {p}: {e}") from e
