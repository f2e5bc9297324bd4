"""Tokenizers: character- and byte-level (mnemo's own), and Hugging Face ``tokenizers`` files.

Every tokenizer has one interface: ``encode(text)`` → 1-D ``torch.long`` tensor, ``decode(ids)``
→ ``str``, ``vocab_size`` (the model's vocabulary, added tokens included), ``num_chars(text)``
(characters, for bits per character), ``kind``, ``eot_id`` (the end-of-text token that separates
documents, or ``None``), ``to_dict()`` and ``save(directory)`` (writes ``tokenizer.json``).

On disk, mnemo's own tokenizers are a small JSON object ``{"kind": "char" | "byte", ...}``; a
Hugging Face tokenizer is its own ``tokenizer.json`` (what ``tokenizers.Tokenizer.from_file`` and
``transformers.PreTrainedTokenizerFast(tokenizer_file=...)`` read). :func:`load_tokenizer` tells the
two apart. The Hugging Face ones need the optional extra ``pip install "mnemo[hf]"``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

TOKENIZER_NAME = "tokenizer.json"
#: mnemo's own char/byte tokenizer in a folder exported for transformers (``mnemo export``)
MNEMO_TOKENIZER_NAME = "mnemo_tokenizer.json"
#: names of end-of-text tokens, in order of preference (the document separator)
EOT_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")
#: text between documents when the tokenizer has no end-of-text token (char and byte)
DOC_SEPARATOR = "\n\n"


class CharTokenizer:
    """One id per distinct character of the training text, plus ``<unk>`` (id 0).

    ``encode`` maps characters outside the vocabulary to ``<unk>``; ``decode`` renders ``<unk>``
    as U+FFFD. Tokens are characters, so nats per token are nats per character. ``chars`` and
    ``stoi`` are not to be changed after the first ``encode`` (it caches a lookup table built from
    them): build a new ``CharTokenizer`` for another vocabulary.
    """

    kind = "char"
    UNK = "\ufffd"
    eot_id = None

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
        try:  # the code points as one array, looked up in the sorted vocabulary (no loop per character)
            points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        except UnicodeEncodeError:  # a lone surrogate (text read with surrogateescape): one by one
            get = self.stoi.get
            return torch.tensor([get(c, 0) for c in text], dtype=torch.long)
        keys, ids = self._lookup()
        at = np.minimum(np.searchsorted(keys, points), len(keys) - 1)
        return torch.from_numpy(np.where(keys[at] == points, ids[at], 0))

    def _lookup(self) -> tuple[np.ndarray, np.ndarray]:
        """The vocabulary's code points, sorted, and their ids (int64; left out: surrogate
        characters, which no UTF-32 text holds, and entries that are not one character, which no
        character of a text is)."""
        if getattr(self, "_table", None) is None:
            pairs = sorted(
                (ord(c), i) for c, i in self.stoi.items() if len(c) == 1 and not 0xD800 <= ord(c) <= 0xDFFF
            )
            pairs = pairs or [(0x110000, 0)]  # (beyond every code point: all <unk>)
            self._table = (
                np.array([c for c, _ in pairs], dtype=np.uint32),
                np.array([i for _, i in pairs], dtype=np.int64),
            )
        return self._table

    def decode(self, ids) -> str:
        table = [self.UNK] + self.chars
        return "".join(table[i] if 0 <= i < len(table) else self.UNK for i in _to_list(ids))

    def num_chars(self, text: str) -> int:
        return len(text)

    def unknown_share(self, text: str) -> float:
        """The fraction of ``text``'s characters outside the vocabulary (read as ``<unk>``)."""
        if not text:
            return 0.0
        return (self.encode(text) == 0).sum().item() / len(text)  # (<unk> is id 0, nothing else)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "chars": self.chars}

    def save(self, directory: str | Path) -> None:
        Path(directory, TOKENIZER_NAME).write_text(json.dumps(self.to_dict()))


class ByteTokenizer:
    """UTF-8 bytes, vocabulary 256: any text, no unknowns; multi-byte characters span tokens."""

    kind = "byte"
    eot_id = None

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

    def save(self, directory: str | Path) -> None:
        Path(directory, TOKENIZER_NAME).write_text(json.dumps(self.to_dict()))


def import_tokenizers():
    """The ``tokenizers`` module, or an ``ImportError`` that says how to install it."""
    try:
        import tokenizers
    except ImportError as e:
        raise ImportError(
            'Hugging Face tokenizers need the `tokenizers` library: pip install "mnemo[hf]"'
        ) from e
    return tokenizers


class HFTokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` (BPE, Unigram, WordPiece, ... from a
    ``tokenizer.json``) with the interface of :class:`CharTokenizer`.

    ``encode`` adds no special tokens (no BOS/EOS from a post-processor): documents are separated
    by ``eot_id`` when the stream is built (:mod:`mnemo.data.corpus`). Special tokens written in
    the text (``"<|endoftext|>"``) are read as those tokens. ``decode`` keeps special tokens, so
    ``decode(encode(s)) == s`` for byte-level tokenizers. ``vocab_size`` counts the added tokens;
    ``num_chars`` counts the characters of the text (bits per character stay comparable with the
    character-level runs). ``kind`` is ``"hf"``; ``model_type`` names the model (``"bpe"``,
    ``"unigram"``, ...).
    """

    kind = "hf"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.model_type = type(tokenizer.model).__name__.lower()
        added = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        self.eot_id = next((added[n] for n in EOT_NAMES if n in added), None)
        if self.eot_id is None:  # an end-of-text token in the vocabulary, not marked special
            ids = (tokenizer.token_to_id(n) for n in EOT_NAMES)
            self.eot_id = next((i for i in ids if i is not None), None)

    @classmethod
    def from_file(cls, path: str | Path) -> HFTokenizer:
        """Read a ``tokenizer.json`` (or a folder holding one)."""
        p = _tokenizer_file(path)
        return cls.from_str(p.read_text(encoding="utf-8"), source=str(p))

    @classmethod
    def from_str(cls, text: str, source: str = "tokenizer.json") -> HFTokenizer:
        tokenizers = import_tokenizers()
        try:
            return cls(tokenizers.Tokenizer.from_str(text))
        except Exception as e:  # the Rust side raises its own exception type
            raise ValueError(f"{source} is not a valid Hugging Face tokenizer file: {e}") from e

    @property
    def eot_token(self) -> str | None:
        return None if self.eot_id is None else self.tokenizer.id_to_token(self.eot_id)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor(self.tokenizer.encode(text, add_special_tokens=False).ids, dtype=torch.long)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """The ids of each text (``tokenizers``' parallel batch encoder)."""
        return [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def special_prefix(self) -> list[int]:
        """The special token ids this tokenizer's own post-processor puts before a single text (a
        Llama- or Mistral-style BOS: what ``transformers``' ``tokenizer(text)`` starts with, and
        what models released with such a tokenizer saw first), ``[]`` when it puts none. ``encode``
        never adds them (see the class docstring); ``mnemo generate`` reads them before the prompt
        of a checkpoint that no mnemo training run made (a converted one)."""
        if self.tokenizer.post_processor is None:
            return []
        enc = self.tokenizer.encode("a", add_special_tokens=True)
        prefix = []
        for i, special in zip(enc.ids, enc.special_tokens_mask):
            if not special:
                break
            prefix.append(i)
        return prefix

    def decode(self, ids) -> str:
        return self.tokenizer.decode(_to_list(ids), skip_special_tokens=False)

    def num_chars(self, text: str) -> int:
        return len(text)

    def to_dict(self) -> dict:
        return json.loads(self.tokenizer.to_str())

    def save(self, directory: str | Path) -> None:
        """Write the Hugging Face file itself as ``directory/tokenizer.json`` and, unless one is
        there, a ``tokenizer_config.json`` naming ``PreTrainedTokenizerFast`` (and the end-of-text
        token), so ``transformers.AutoTokenizer`` loads the folder too."""
        Path(directory, TOKENIZER_NAME).write_text(self.tokenizer.to_str(), encoding="utf-8")
        config = Path(directory, "tokenizer_config.json")
        if not config.exists():
            meta = {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "add_bos_token": False,
                "add_eos_token": False,
            }
            if self.eot_id is not None:
                meta["eos_token"] = self.tokenizer.id_to_token(self.eot_id)
            config.write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")


Tokenizer = CharTokenizer | ByteTokenizer | HFTokenizer


def _to_list(ids) -> list[int]:
    if isinstance(ids, torch.Tensor):
        return ids.flatten().tolist()
    return list(ids)


def _tokenizer_file(path: str | Path) -> Path:
    """``path`` itself (a file) or ``path/tokenizer.json`` (a folder)."""
    p = Path(path)
    if p.is_dir():
        p = p / TOKENIZER_NAME
    if not p.is_file():
        raise FileNotFoundError(
            f"tokenizer not found: {str(path)!r} is neither 'char', 'byte', a tokenizer.json file nor a "
            "folder holding one"
        )
    return p


def build_tokenizer(kind: str, text: str = "") -> Tokenizer:
    """``"char"`` (vocabulary from ``text``), ``"byte"``, or a path to a ``tokenizer.json`` (a
    Hugging Face file, or mnemo's own) or to a folder holding one (a tokenizer trained with
    ``mnemo tokenizer train``, a checkpoint, a ``transformers`` model folder)."""
    if kind == "char":
        return CharTokenizer.from_text(text)
    if kind == "byte":
        return ByteTokenizer()
    if not isinstance(kind, str) or not kind:
        raise ValueError(f"tokenizer must be 'char', 'byte' or a path to a tokenizer.json, got {kind!r}")
    return load_tokenizer(_tokenizer_file(kind))


def tokenizer_from_dict(d: dict) -> Tokenizer:
    """mnemo's ``{"kind": ...}`` object, or a Hugging Face ``tokenizer.json`` object."""
    if not isinstance(d, dict):
        raise TypeError(f"expected a JSON object, got {type(d).__name__}")
    if "kind" not in d and "model" in d:
        return HFTokenizer.from_str(json.dumps(d))
    kind = d.get("kind")
    if kind == "char":
        return CharTokenizer(d["chars"])
    if kind == "byte":
        return ByteTokenizer()
    if kind is None:
        raise ValueError(
            f"a JSON object with neither 'kind' (mnemo's char/byte tokenizers) nor 'model' (a Hugging "
            f"Face tokenizer.json), so not a tokenizer; its keys: {sorted(d)[:8]}"
        )
    raise ValueError(
        f"unknown tokenizer kind {kind!r} (expected 'char', 'byte' or a Hugging Face tokenizer.json)"
    )


def save_tokenizer(tok, directory: str | Path) -> None:
    """Write ``directory/tokenizer.json`` (a Hugging Face tokenizer writes its own file)."""
    if hasattr(tok, "save"):
        tok.save(directory)
    else:
        Path(directory, TOKENIZER_NAME).write_text(json.dumps(tok.to_dict()))


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a checkpoint directory (``path/tokenizer.json``, or ``mnemo_tokenizer.json``
    in a folder written by ``mnemo export``) or of a tokenizer file: mnemo's char/byte format or a
    Hugging Face file (then needs ``mnemo[hf]``).

    Raises:
        FileNotFoundError: no such file. ValueError: the file is neither format.
        ImportError: a Hugging Face file without the ``tokenizers`` library.
    """
    p = Path(path)
    if p.is_dir() and not (p / TOKENIZER_NAME).exists() and (p / MNEMO_TOKENIZER_NAME).is_file():
        p = p / MNEMO_TOKENIZER_NAME  # a folder written by `mnemo export` (mnemo's own format renamed)
    elif p.is_dir() or not p.exists():
        p = p / TOKENIZER_NAME
    if not p.is_file():
        raise FileNotFoundError(f"checkpoint file missing: {p}")
    text = p.read_text(encoding="utf-8")
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"corrupt tokenizer file {p}: {e}") from e
    if isinstance(d, dict) and "kind" not in d and "model" in d:
        return HFTokenizer.from_str(text, source=str(p))
    try:
        return tokenizer_from_dict(d)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"corrupt tokenizer file {p}: {e}") from e


def check_tokenizer_fits(tok, vocab_size: int, where: str) -> None:
    """Refuse a tokenizer whose ids reach past the model's embedding table (a checkpoint whose
    ``tokenizer.json`` was replaced by another one, say): every text it encodes could hold an id
    the model cannot read.

    Raises:
        ValueError: ``tok.vocab_size > vocab_size``; the message names ``where`` and both sizes.
    """
    if tok.vocab_size > vocab_size:
        raise ValueError(
            f"{where}: its tokenizer has {tok.vocab_size} ids but the model reads {vocab_size} "
            "(vocab_size): the tokenizer is not the one the model was trained with (was its "
            "tokenizer.json replaced?)"
        )


def document_separator(tok) -> tuple[torch.Tensor, int]:
    """The ids put between two documents and the characters they stand for: the end-of-text
    token (0 characters) when the tokenizer has one, else :data:`DOC_SEPARATOR` encoded."""
    eot = getattr(tok, "eot_id", None)
    if eot is not None:
        return torch.tensor([eot], dtype=torch.long), 0
    return tok.encode(DOC_SEPARATOR), tok.num_chars(DOC_SEPARATOR)
