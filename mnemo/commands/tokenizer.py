"""``mnemo tokenizer train``: train a Hugging Face tokenizer (byte-level BPE or Unigram) on a local
corpus and write ``DIR/tokenizer.json``, which ``mnemo train --tokenizer DIR`` reads.

    mnemo tokenizer train --data tinyshakespeare --vocab-size 1024 --out runs/tok
    mnemo tokenizer train --data docs.jsonl --text-field body --kind unigram --vocab-size 8000 --out tok

Byte-level: every text encodes (no unknown token) and ``decode(encode(s)) == s``. The vocabulary
holds the 256 byte symbols, the end-of-text token ``<|endoftext|>`` (the document separator of the
training stream) and the learned merges/pieces. Needs ``pip install "mnemo[hf]"``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from .. import argtypes as kinds

HELP = "train a byte-level BPE or Unigram tokenizer (Hugging Face tokenizers) on a local corpus"
EOT = "<|endoftext|>"
#: characters per training chunk when a document is long (a text file is one document)
_CHUNK = 1 << 16


def _add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--data",
        required=True,
        type=kinds.Text("'tinyshakespeare', a file, a folder or a glob"),
        help="'tinyshakespeare' (bundled), a UTF-8 text file, a .jsonl/.parquet file, or a folder or "
        "glob of them",
    )
    p.add_argument(
        "--text-field",
        default="text",
        type=kinds.Text("a field name"),
        help="JSONL/Parquet: the field holding the text (default text)",
    )
    p.add_argument(
        "--vocab-size",
        type=kinds.Int(258, 2**24),
        required=True,
        help="vocabulary size, special tokens included: at least 258 (the 256 byte symbols, <|endoftext|> "
        "and one learned token)",
    )
    p.add_argument(
        "--out", required=True, type=kinds.OutDir(), help="folder to write tokenizer.json into (created)"
    )
    p.add_argument("--kind", choices=["bpe", "unigram"], default="bpe", help="model (default bpe)")
    p.add_argument(
        "--min-frequency",
        type=kinds.Int(1, 2**31 - 1),
        help="bpe: least count of a pair to merge (default 2); not for unigram",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing DIR/tokenizer.json")


def add_commands(subparsers) -> None:
    """The hook ``mnemo.cli`` calls for each command module (see ``mnemo.cli._COMMAND_MODULES``)."""
    p = subparsers.add_parser("tokenizer", help="train Hugging Face tokenizers", description=HELP)
    sub = p.add_subparsers(dest="tokenizer_command", required=True, metavar="{train}")
    t = sub.add_parser("train", help=HELP, description=kinds.plain_text(__doc__.split("\n\n")[0]))
    _add_train_arguments(t)
    t.set_defaults(func=run_train)


def _space(c: str) -> bool:
    """Whitespace as the byte-level pre-tokenizer's ``\\s`` has it (Unicode White_Space):
    ``str.isspace`` without the separators U+001C..U+001F, which ``\\s`` does not match."""
    return c.isspace() and not "\x1c" <= c <= "\x1f"


def _chunks(documents):
    """Each document, long ones in pieces of at most ``_CHUNK`` characters, each cut before a
    whitespace character (:func:`_space`) that a non-whitespace one follows (a word's own leading
    space or newline): the byte-level pre-tokenizer then splits the pieces into the words it splits
    the whole document into, so the counts the trainer learns from are the same. A stretch of
    ``_CHUNK`` characters without such a place (no whitespace in it) is cut at ``_CHUNK``."""
    for doc in documents:
        start = 0
        while start < len(doc):
            end = start + _CHUNK
            if end < len(doc):
                k = end - 1
                while k > start and not (_space(doc[k]) and not _space(doc[k + 1])):
                    k -= 1
                end = k if k > start else end
            yield doc[start:end]
            start = end


def train_tokenizer(documents, vocab_size: int, kind: str = "bpe", min_frequency: int | None = None):
    """A byte-level ``tokenizers.Tokenizer`` (``kind`` ``"bpe"`` or ``"unigram"``) trained on the
    strings ``documents``, with the special token ``<|endoftext|>`` (id 0)."""
    from ..data.tokenizer import import_tokenizers

    tk = import_tokenizers()
    if kind not in ("bpe", "unigram"):
        raise ValueError(f"--kind: expected 'bpe' or 'unigram', got {kind!r}")
    alphabet = tk.pre_tokenizers.ByteLevel.alphabet()
    if not isinstance(vocab_size, int) or vocab_size < len(alphabet) + 2:
        raise ValueError(
            f"--vocab-size: expected an int >= {len(alphabet) + 2} (the {len(alphabet)} byte symbols, "
            f"{EOT} and at least one learned token), got {vocab_size}"
        )
    if kind == "bpe":
        if min_frequency is not None and min_frequency < 1:
            raise ValueError(f"--min-frequency: expected an int >= 1, got {min_frequency}")
        tok = tk.Tokenizer(tk.models.BPE())
        trainer = tk.trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=2 if min_frequency is None else min_frequency,
            special_tokens=[EOT],
            initial_alphabet=alphabet,
            show_progress=False,
        )
    else:
        if min_frequency is not None:
            raise ValueError("--min-frequency applies to --kind bpe only")
        tok = tk.Tokenizer(tk.models.Unigram())
        trainer = tk.trainers.UnigramTrainer(
            vocab_size=vocab_size, special_tokens=[EOT], initial_alphabet=alphabet, show_progress=False
        )
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    tok.train_from_iterator(_chunks(documents), trainer)
    return tok


def run_train(args) -> int:
    from ..data import HFTokenizer, load_corpus

    out = Path(args.out)
    if kinds.is_run_folder(out):
        raise ValueError(
            f"--out: {out} is a training run's folder (the run's checkpoints carry its own tokenizer); "
            "write the new tokenizer to a folder of its own, e.g. tokenizers/NAME"
        )
    if (out / "config.json").is_file() or any(out.glob("*.safetensors")):
        raise ValueError(
            f"--out: {out} holds a model checkpoint (config.json / *.safetensors) whose tokenizer the new "
            "one would replace, leaving a model that reads other ids (--overwrite does not write into "
            "one); write the new tokenizer to a folder of its own, e.g. tokenizers/NAME"
        )
    data = Path(args.data)
    if data.is_dir() and out.resolve() == data.resolve():  # (a folder's corpus is the files in it)
        raise ValueError(
            f"--out: {out} is the --data folder: tokenizer.json and tokenizer_config.json would be read "
            "as files of its corpus from then on; write the tokenizer to a folder of its own, e.g. "
            "tokenizers/NAME"
        )
    if args.kind != "bpe" and args.min_frequency is not None:  # before the corpus is read (minutes, may be)
        raise ValueError(f"--min-frequency applies to --kind bpe only (got --kind {args.kind})")
    path = out / "tokenizer.json"
    # tokenizer_config.json is written with it (transformers reads both): an old one, kept, would
    # give the new tokenizer the old one's end-of-text token and settings
    config = out / "tokenizer_config.json"
    for p in (path, config):
        if p.exists() and not args.overwrite:
            raise ValueError(f"--out: {p} exists (pass --overwrite to replace it)")
    try:
        corpus = load_corpus(args.data, args.text_field)
        tok = HFTokenizer(train_tokenizer(corpus.documents, args.vocab_size, args.kind, args.min_frequency))
    except KeyboardInterrupt as e:
        e.then = f"; the tokenizer was not trained: {out} is as it was"
        raise
    out.mkdir(parents=True, exist_ok=True)
    config.unlink(missing_ok=True)  # HFTokenizer.save writes a config only where none is
    tok.save(out)
    try:
        ids, _, chars = corpus.encode(tok)
    except KeyboardInterrupt as e:  # (encoding a large corpus for the statistics takes a while)
        e.then = f"; {path} is written and complete, only its statistics on --data were not measured"
        raise
    stats = {
        "tokenizer": str(path),
        "kind": args.kind,
        "vocab_size": tok.vocab_size,
        "documents": len(corpus),
        "chars": chars,
        "tokens": ids.numel(),
        "chars_per_token": round(chars / max(ids.numel(), 1), 4),
    }
    print(
        f"mnemo tokenizer: wrote {path} ({args.kind}, vocab {tok.vocab_size}); on {args.data}: "
        f"{stats['chars_per_token']:.3f} characters per token ({chars:,} characters -> "
        f"{ids.numel():,} tokens)",
        file=sys.stderr,
    )
    # a command the shell reads back as it is: the field too, and quoted (a glob, a space in a path)
    again = ["mnemo", "train", "--tokenizer", str(out), "--data", args.data]
    again += ["--text-field", args.text_field] if args.text_field != "text" else []
    print(f"train with: {shlex.join(again)}", file=sys.stderr)
    print(json.dumps(stats))
    if tok.vocab_size < args.vocab_size:
        print(
            f"note: the corpus gave {tok.vocab_size} tokens, fewer than --vocab-size {args.vocab_size}",
            file=sys.stderr,
        )
    return 0
