"""Tokenizers, text corpora (tinyshakespeare bundled; text, JSONL and Parquet files) and synthetic tasks."""

from .corpus import Corpus, load_corpus
from .text import TokenStream, load_text, split_text
from .tokenizer import (
    ByteTokenizer,
    CharTokenizer,
    HFTokenizer,
    build_tokenizer,
    load_tokenizer,
    save_tokenizer,
)

__all__ = [
    "Corpus",
    "TokenStream",
    "load_corpus",
    "load_text",
    "split_text",
    "ByteTokenizer",
    "CharTokenizer",
    "HFTokenizer",
    "build_tokenizer",
    "load_tokenizer",
    "save_tokenizer",
]
