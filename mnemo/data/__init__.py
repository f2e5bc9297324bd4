"""Tokenizers, text corpora (tinyshakespeare bundled) and synthetic tasks."""

from .text import TokenStream, load_text, split_text
from .tokenizer import ByteTokenizer, CharTokenizer, build_tokenizer, load_tokenizer, save_tokenizer

__all__ = [
    "TokenStream",
    "load_text",
    "split_text",
    "ByteTokenizer",
    "CharTokenizer",
    "build_tokenizer",
    "load_tokenizer",
    "save_tokenizer",
]
