"""Text corpora as lists of documents: the bundled tinyshakespeare, plain UTF-8 text files, and
local JSONL / Parquet files read through the ``datasets`` library (local files only, never the
Hub: the packaged ``"json"`` and ``"parquet"`` builders with ``data_files``).

A corpus becomes one token stream: its documents, each encoded alone, joined by the tokenizer's
end-of-text token (or by ``"\\n\\n"`` for tokenizers without one, char and byte), with the offset
where each document starts kept in ``TokenStream.doc_starts`` (for document packing with
``cu_seqlens`` later). The validation split is deterministic: the last ``VAL_FRACTION`` of the
characters of the documents joined by ``"\\n\\n"`` (for one document — a text file — exactly
:func:`~mnemo.data.text.split_text`).

    corpus = load_corpus("data/docs.jsonl", text_field="text")
    train, val = corpus.split()
    stream = val.stream(tokenizer, seq_len=256)   # TokenStream; .doc_starts, .num_chars
"""

from __future__ import annotations

import bz2
import glob
import gzip
import json
import lzma
import os
import re
import warnings
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from .stream import TokenStream
from .tokenizer import DOC_SEPARATOR, document_separator

BUNDLED = {"tinyshakespeare": "tinyshakespeare.txt"}
VAL_FRACTION = 0.1
#: file suffixes read through ``datasets`` (``.gz``, ``.bz2``, ... compressed JSON too)
JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
_COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".lz4")
#: compressed plain text read as its text (``.txt.gz``); ``.zst``/``.lz4`` text is refused by name
_TEXT_CODECS = {".gz": gzip, ".bz2": bz2, ".xz": lzma}
#: the suffixes of a plain text file in a folder (each also compressed: :data:`_TEXT_CODECS`)
TEXT_SUFFIXES = (".txt", ".text")
#: documents per call of a batch encoder
_BATCH = 1024
#: whitespace between JSON values
_JSON_SPACE = re.compile(r"[ \t\n\r]*")


def _compression(path: str | Path) -> str | None:
    """The compression suffix of ``path``'s name (``".gz"``, ...), or ``None``."""
    name = Path(path).name.lower()
    return next((c for c in _COMPRESSED if name.endswith(c)), None)


def _plain_name(path: str | Path) -> str:
    """``path``'s name in lower case without its compression suffix (``a.txt.gz`` -> ``a.txt``)."""
    name, c = Path(path).name.lower(), _compression(path)
    return name[: -len(c)] if c else name


def corpus_format(path: str | Path) -> str:
    """``"json"``, ``"parquet"`` or ``"text"`` (anything else), from the file name."""
    name = _plain_name(path)
    if name.endswith(JSON_SUFFIXES):
        return "json"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return "text"


@dataclass
class Corpus:
    """The documents of a corpus (non-empty strings) and where they came from."""

    documents: list[str]
    source: str = "<documents>"

    def __post_init__(self):
        self.documents = [d for d in self.documents if d]

    @property
    def text(self) -> str:
        """The documents joined by ``"\\n\\n"`` (for one document: the document itself)."""
        return DOC_SEPARATOR.join(self.documents)

    def __len__(self) -> int:
        return len(self.documents)

    def split(self, val_fraction: float = VAL_FRACTION) -> tuple[Corpus, Corpus]:
        """Deterministic train/validation split at ``1 − val_fraction`` of the characters of
        :attr:`text`: the document holding the cut is cut in two (a cut that falls between two
        documents moves to the start of the next one). One document: exactly ``split_text``."""
        sep = len(DOC_SEPARATOR)
        total = sum(len(d) for d in self.documents) + sep * max(len(self.documents) - 1, 0)
        cut = int(total * (1.0 - val_fraction))
        start = 0
        for i, doc in enumerate(self.documents):
            end = start + len(doc)
            if cut < end or i == len(self.documents) - 1:
                at = max(min(cut - start, len(doc)), 0)
                train, val = self.documents[:i] + [doc[:at]], [doc[at:]] + self.documents[i + 1 :]
                break
            if cut < end + sep:  # in the separator after this document
                train, val = self.documents[: i + 1], self.documents[i + 1 :]
                break
            start = end + sep
        else:
            train, val = [], []
        return Corpus(train, f"{self.source} (train)"), Corpus(val, f"{self.source} (val)")

    def encode(self, tokenizer) -> tuple[torch.Tensor, torch.Tensor, int]:
        """``(ids, doc_starts, num_chars)``: the token stream (documents joined by the
        tokenizer's separator, :func:`~mnemo.data.tokenizer.document_separator`), the offset of
        each document's first token, and the characters the stream stands for (the documents'
        plus the separators': bits per character divide by it)."""
        sep_ids, sep_chars = document_separator(tokenizer)
        sep_ids = torch.as_tensor(sep_ids, dtype=torch.long)
        batch = getattr(tokenizer, "encode_batch", None)
        pieces: list[torch.Tensor] = []  # the documents' ids and the separators between them, in order
        starts: list[int] = []
        n = 0
        for i in range(0, len(self.documents), _BATCH):
            docs = self.documents[i : i + _BATCH]
            if batch is not None:  # lists of ids: one tensor for the batch, cut at the documents
                encoded = batch(docs)
                flat = torch.tensor([t for doc in encoded for t in doc], dtype=torch.long)
                encoded = flat.split([len(doc) for doc in encoded])
            else:
                # (as torch.long: a tokenizer's int32 ids would make int32 targets)
                encoded = [torch.as_tensor(tokenizer.encode(d), dtype=torch.long) for d in docs]
            for doc_ids in encoded:
                if starts:
                    pieces.append(sep_ids)
                    n += len(sep_ids)
                starts.append(n)
                pieces.append(doc_ids)
                n += len(doc_ids)
        chars = sum(tokenizer.num_chars(d) for d in self.documents) + sep_chars * max(len(starts) - 1, 0)
        ids = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)
        return ids, torch.tensor(starts, dtype=torch.long), chars

    def stream(self, tokenizer, seq_len: int):
        """A :class:`~mnemo.data.stream.TokenStream` of :meth:`encode` (``doc_starts`` and
        ``num_chars`` set)."""
        ids, starts, chars = self.encode(tokenizer)
        return TokenStream(ids, seq_len, doc_starts=starts, num_chars=chars)


def load_corpus(data: str, text_field: str = "text") -> Corpus:
    """The documents of ``data``: a bundled name (``"tinyshakespeare"``), a UTF-8 text file (one
    document; compressed as ``.gz``, ``.bz2`` or ``.xz`` too), a ``.jsonl``/``.json`` or
    ``.parquet`` file (one document per record, its ``text_field``; records whose field is null or
    absent are skipped; a Parquet file with no rows among others is skipped with a warning), a
    folder of such files (all of one format; records with other fields in other files are fine;
    an empty file among others adds nothing; its entries with other names, and its subfolders,
    are not read: a warning names them) or a glob pattern (a leading ``~`` is the home folder). A text
    file is read with universal newlines (``"\\r\\n"`` and ``"\\r"`` become ``"\\n"``) and without a
    leading UTF-8 byte order mark.

    Raises:
        FileNotFoundError: nothing at ``data`` (and not a bundled name).
        ValueError: an empty corpus, a text file that is not UTF-8, files of mixed formats, a
            missing ``text_field`` (the message names the fields present; or a file of several
            whose records never hold it), a non-string value (in any file, the message names it), a
            ``text_field`` other than ``"text"`` for plain text (which has no fields), a path that is
            neither a file nor a folder (``/dev/null``, a pipe), a folder or glob holding a file and
            its compressed copy (``a.txt`` and ``a.txt.gz``: it would be read twice).
        ImportError: JSONL/Parquet without the ``datasets`` library (``pip install "mnemo[hf]"``).
    """
    if data in BUNDLED:
        _no_fields(data, text_field)
        text = resources.files("mnemo.data").joinpath("corpora", BUNDLED[data]).read_text(encoding="utf-8")
        return Corpus([text], data)
    files = _files(data)
    formats = sorted({corpus_format(f) for f in files})
    if len(formats) > 1:
        raise ValueError(f"data {data!r}: files of mixed formats {formats}; give one format at a time")
    if formats == ["text"]:
        _no_fields(data, text_field)
        docs = [_read_text(f, data) for f in files]
    else:
        docs = _read_records(files, formats[0], text_field, data)
    corpus = Corpus(docs, data)
    if not corpus.documents:
        raise ValueError(f"data {data!r} holds no text")
    return corpus


def inherited_text_field(data: str, text_field: str | None) -> str:
    """The field to read from ``data`` when the user named none: ``text_field`` (e.g. the one a
    checkpoint was trained with) for records, ``"text"`` for plain text, which has no fields. A
    missing path gives ``text_field`` too (:func:`load_corpus` then names what is wrong)."""
    try:
        plain = data in BUNDLED or all(corpus_format(f) == "text" for f in _files(data, warn=False))
    except (OSError, ValueError):
        plain = False
    return "text" if plain or not text_field else text_field


def _no_fields(data: str, text_field: str) -> None:
    if text_field != "text":
        raise ValueError(
            f"text_field (--text-field) {text_field!r}: data {data!r} is plain text, one document with "
            "no fields; the field names what to read from .jsonl/.json/.parquet records"
        )


def _files(data: str, warn: bool = True) -> list[Path]:
    """The files of ``data`` to read (a leading ``~`` is the home folder, for a path and a glob, as
    ``mnemo train`` and a sweep read it); ``warn``: a warning names a folder's entries left unread."""
    path = os.path.expanduser(data)
    p = Path(path)
    if p.is_file():
        return [p]
    if p.exists() and not p.is_dir():
        raise ValueError(f"data {data!r} is neither a regular file nor a folder (a device or a pipe?)")
    if p.is_dir():
        from ..argtypes import checkpoint_around

        if _run_root(p) or checkpoint_around(p) is not None:  # metrics.jsonl would read as text
            raise ValueError(
                f"data {data!r} is a training run's folder or checkpoint (its .jsonl files are logs, "
                "not text); give a corpus: a bundled name, a text/.jsonl/.parquet file, or a folder or "
                "glob of them"
            )
        entries = sorted(f for f in p.iterdir() if not f.name.startswith("."))
        files = [f for f in entries if f.is_file()]
        known = [f for f in files if corpus_format(f) != "text" or _plain_name(f).endswith(TEXT_SUFFIXES)]
        if not known:
            raise ValueError(
                f"data must be a file, a glob or a folder of .txt/.jsonl/.json/.parquet files (.txt.gz, "
                f".jsonl.gz, ... too); "
                f"the folder {data!r} holds none"
            )
        skipped = [f.name + ("/" if f.is_dir() else "") for f in entries if f not in known]
        # another extension, a subfolder (not read), a device: said, not silently left out
        if skipped and warn:
            shown = ", ".join(skipped[:5]) + (f", ... ({len(skipped) - 5} more)" if len(skipped) > 5 else "")
            warnings.warn(
                f"data {data!r}: {len(skipped)} entr{'y' if len(skipped) == 1 else 'ies'} of the folder "
                f"not read (not .txt/.text/.jsonl/.json/.ndjson/.parquet, compressed or not, or a "
                f"subfolder): {shown}",
                stacklevel=3,
            )
        return _no_twins(known, data)
    if any(c in data for c in "*?["):
        files = sorted(Path(f) for f in glob.glob(path, recursive=True) if Path(f).is_file())
        refuse_run_files(path, files)
        if files:
            return _no_twins(files, data)
    raise FileNotFoundError(
        f"data file not found: {data!r} (give a path to a UTF-8 text, .jsonl or .parquet file, a folder or "
        f"glob of them, or one of {sorted(BUNDLED)})"
    )


def _wild(part: str) -> bool:
    return any(c in part for c in "*?[")


def run_files(pattern: str, files: list[Path]) -> list[Path]:
    """The ``files`` (matches of the glob ``pattern``) that lie in a training run's folder (one
    holding the file ``latest``, ``metrics.jsonl`` or ``.lock``, or a run's checkpoint): its logs and
    checkpoints, not text. The folders looked at are those between the pattern's literal start
    (its folders before the first wildcard) and the file."""
    from .. import argtypes

    parts = Path(pattern).parts
    first = next((i for i, p in enumerate(parts) if _wild(p)), len(parts))
    top = Path(*parts[:first]) if first else Path(".")
    seen: dict[Path, bool] = {}
    folders: dict[Path, bool] = {}

    def in_run(folder: Path) -> bool:  # (a file's answer is its folder's: asked once per folder)
        for a in (folder, *folder.parents):
            if a not in seen:
                seen[a] = _run_root(a)
            if seen[a]:
                return True
            if a == top or len(a.parts) <= len(top.parts):
                break
        return argtypes.checkpoint_around(folder) is not None

    for f in files:
        if f.parent not in folders:
            folders[f.parent] = in_run(f.parent)
    return [f for f in files if folders[f.parent]]


def _run_root(p: Path) -> bool:
    """Whether ``p`` holds a training run's marker files (``latest``, ``metrics.jsonl``, ``.lock``):
    a folder of that name is a corpus's own (a Wikipedia dump's ``enwiki/latest/``), not a marker."""
    from ..argtypes import RUN_MARKERS

    return p.is_dir() and any((p / name).is_file() for name in RUN_MARKERS)


def refuse_run_files(pattern: str, files: list[Path]) -> None:
    """Raise ``ValueError`` naming the ``files`` of the glob ``pattern`` that lie in a training run's
    folder (:func:`run_files`): a glob such as ``**/*.jsonl`` over a project would read runs'
    ``metrics.jsonl`` (this run's siblings', a sweep's earlier runs') as corpus."""
    found = run_files(pattern, files)
    if found:
        shown = ", ".join(map(str, found[:3])) + (f", ... ({len(found) - 3} more)" if len(found) > 3 else "")
        raise ValueError(
            f"data {pattern!r} matches {len(found)} file(s) of training run folders (their logs and "
            f"checkpoints, not text): {shown}; narrow the glob to the corpus files (e.g. corpus/**/*.jsonl)"
        )


def glob_reads_run(pattern: str, out) -> bool:
    """Whether ``glob.glob(pattern, recursive=True)`` would match a file a run writes in ``out``
    (``metrics.jsonl``, a checkpoint's ``config.json``): ``**`` spans any folders, ``*``/``?``/``[``
    one name, as ``glob`` reads them (a name starting with "." is not matched by a wildcard); a
    pattern ending in ``/`` matches folders only (never a file: ``False``). ``mnemo train`` and a
    sweep refuse a run folder that their ``data`` glob reads.

    Raises:
        ValueError: ``..`` after a wildcard (``corpus/*/../x``): which folder it names depends on
            what the wildcard matches, so the answer would be a guess.
    """
    import fnmatch
    import os

    if pattern.endswith(("/", os.sep)):
        return False
    written_parts = Path(os.path.expanduser(pattern)).parts
    wild = [i for i, p in enumerate(written_parts) if _wild(p)]
    if wild and ".." in written_parts[wild[0] :]:
        raise ValueError(
            f"data {pattern!r}: '..' after a wildcard is not supported in a data glob (the folder it "
            "names depends on what the wildcard matches); write the path without it"
        )

    def parts(path: str) -> list[str]:
        return list(Path(os.path.abspath(os.path.expanduser(path))).parts)

    def match(pat: list[str], name: list[str]) -> bool:
        if not pat:
            return not name
        if pat[0] == "**":  # zero or more folders, none hidden
            hidden = [n.startswith(".") for n in name]
            return any(match(pat[1:], name[i:]) for i in range(len(name) + 1) if not any(hidden[:i]))
        if not name or (name[0].startswith(".") and not pat[0].startswith(".")):
            return False
        return fnmatch.fnmatchcase(name[0], pat[0]) and match(pat[1:], name[1:])

    run = Path(os.path.abspath(out))
    written = [
        run / "metrics.jsonl",
        run / "ckpt-000001" / "config.json",
        run / "ckpt-000001" / "manifest.json",
    ]
    return any(match(parts(pattern), list(f.parts)) for f in written)


def _no_twins(files: list[Path], data: str) -> list[Path]:
    """``files``, refused when two of them are one file with and without compression (``a.txt`` and
    ``a.txt.gz`` in one folder: a compressed copy left beside its original would be read twice)."""
    seen: dict[tuple[Path, str], Path] = {}
    for f in files:
        c = _compression(f)
        key = (f.parent, f.name[: -len(c)] if c else f.name)
        if key in seen and _compression(seen[key]) != c:
            raise ValueError(
                f"data {data!r}: {str(seen[key])!r} and {str(f)!r} are the same file with and without "
                "compression (a copy would be read twice); keep one of them, or name the file itself"
            )
        seen[key] = f
    return files


def _read_text(p: Path, data: str) -> str:
    """A text file's text (universal newlines, no byte order mark), decompressed first when its
    name ends in ``.gz``, ``.bz2`` or ``.xz``."""
    c = _compression(p)
    if c is not None and c not in _TEXT_CODECS:
        raise ValueError(
            f"data file {str(p)!r}: {c} compressed text is not supported; compress plain text as "
            f"{', '.join(_TEXT_CODECS)} (or give it uncompressed)"
        )
    opener = _TEXT_CODECS[c].open if c is not None else open
    try:
        with opener(p, "rt", encoding="utf-8-sig") as fh:  # a leading byte order mark is no text
            text = fh.read()
    except UnicodeDecodeError as e:
        raise ValueError(
            f"data file {str(p)!r} is not valid UTF-8{' (once decompressed)' if c else ''}: {e}"
        ) from e
    except (OSError, EOFError, lzma.LZMAError) as e:
        if c is None:
            raise
        raise ValueError(f"data file {str(p)!r} is not a valid {c} file: {type(e).__name__}: {e}") from e
    if not text and str(p) == data:
        raise ValueError(f"data file {data!r} is empty")
    return text


def import_datasets():
    """The ``datasets`` module, or an ``ImportError`` that says how to install it."""
    try:
        import datasets
    except ImportError as e:
        raise ImportError(
            'JSONL and Parquet corpora need the `datasets` library: pip install "mnemo[hf]"'
        ) from e
    return datasets


def _first_bad_json_line(files: list[Path]) -> str | None:
    """``"FILE line N: ..."`` for the first line of the JSON Lines ``files`` that is not UTF-8 or
    not one JSON object (blank lines are allowed), else ``None``."""
    for f in files:
        opener = _byte_opener(f)
        if opener is None:  # .zst, .lz4: left to datasets' own message
            continue
        try:
            with opener(f, "rb") as fh:
                for n, raw in enumerate(fh, 1):
                    if not raw.strip():
                        continue
                    try:
                        record = json.loads(raw.decode("utf-8"))
                    except UnicodeDecodeError as e:
                        return f"{f} line {n}: not valid UTF-8 ({e.reason} at byte {e.start})"
                    except json.JSONDecodeError as e:
                        return f"{f} line {n}: not JSON ({e.msg} at column {e.colno}): {raw[:60]!r}"
                    if not isinstance(record, dict):
                        return f"{f} line {n}: a JSON {type(record).__name__}, expected one object per line"
        except (OSError, EOFError, lzma.LZMAError) as e:
            c = _compression(f)
            if c is not None and not isinstance(e, (FileNotFoundError, PermissionError)):
                return f"{f}: not a valid {c} file ({type(e).__name__}: {e})"
            return f"{f}: cannot be read ({e.strerror})"
    return None


def _byte_opener(f: Path):
    """``open`` for a file's bytes as stored, ``gzip.open`` etc. for its decompressed bytes when
    its name ends in a compression suffix read here (:data:`_TEXT_CODECS`), else ``None``."""
    c = _compression(f)
    if c is None:
        return open
    return _TEXT_CODECS[c].open if c in _TEXT_CODECS else None


def _blank(f: Path) -> bool:
    """Whether file ``f`` holds nothing but whitespace (once decompressed: ``.jsonl.gz``)."""
    opener = _byte_opener(f)
    if opener is None:
        return False
    try:
        with opener(f, "rb") as fh:
            return all(not chunk.strip() for chunk in iter(lambda: fh.read(1 << 20), b""))
    except (OSError, EOFError, lzma.LZMAError):
        return False


def _json_documents(text: str):
    """``(line, value)`` for each JSON value of ``text`` in turn (JSON Lines, or objects written
    over several lines one after another, as datasets reads them), ``line`` where it starts."""
    decoder, pos, line = json.JSONDecoder(), 0, 1
    while True:
        gap = _JSON_SPACE.match(text, pos).end()
        line, pos = line + text.count("\n", pos, gap), gap
        if pos >= len(text):
            return
        value, end = decoder.raw_decode(text, pos)
        yield line, value
        line, pos = line + text.count("\n", pos, end), end


def _json_records(files: list[Path]):
    """``(where, record)`` for every record of the JSON ``files``: a file whose text is one JSON
    array is its records (an array of values that are not objects, strings say, is a column
    ``"text"``, as datasets reads it; in a ``.jsonl`` file only an array of objects or of strings),
    else each JSON value of the file (JSON Lines, an indented object) is one record, named by the
    line it starts on (lines end at ``"\\n"`` alone: a string may hold U+2028, U+2029 or NEL raw).

    Raises:
        UnicodeDecodeError, json.JSONDecodeError: a file that is not UTF-8 JSON.
    """
    for f in files:
        values = _json_documents(f.read_text(encoding="utf-8-sig"))
        first = next(values, None)
        second = next(values, None)
        if first is not None and second is None and isinstance(first[1], list):
            jsonl = f.name.lower().endswith(".jsonl")
            # datasets reads an array of values that are not objects as one column "text" (in a
            # .jsonl file too: there, unless an array of texts, it is named as a line that is a list)
            column = not any(isinstance(r, dict) for r in first[1])
            texts = all(r is None or isinstance(r, str) for r in first[1])
            if not jsonl or texts or all(isinstance(r, dict) for r in first[1]):
                for n, record in enumerate(first[1], 1):
                    yield f"{f} record {n}", {"text": record} if column else record
                continue
        for line, record in (v for v in (first, second) if v is not None):
            yield f"{f} line {line}", record
        for line, record in values:
            yield f"{f} line {line}", record


def _json_values(
    files: list[Path], text_field: str, data: str, unchecked: bool = False
) -> tuple[list[str | None], list[str]]:
    """The ``text_field`` of every record of the plain JSON ``files`` as the files hold them
    (``None`` where a record lacks it) and the fields the records hold, in order of appearance;
    ``unchecked``: files datasets did not read, whose strings may hold an escaped lone surrogate.

    Raises:
        ValueError: a record that is not an object, or whose ``text_field`` is not text (null or
            absent is allowed) or holds a lone surrogate (the message names the record, its file
            and its line); a file none of whose records hold ``text_field`` while others' do.
    """
    values: list[str | None] = []
    missing: list[tuple[Path, list[str]]] = []
    fields: dict[str, None] = {}
    for f in files:
        own: dict[str, None] = {}
        for where, record in _json_records([f]):
            i = len(values)
            if not isinstance(record, dict):
                unit = "line" if " line " in where else "record"
                raise ValueError(
                    f"data {data!r}: {where}: a JSON {type(record).__name__}, expected one object per {unit}"
                )
            own.update(dict.fromkeys(record))
            value = record.get(text_field)
            if value is not None and not isinstance(value, str):
                raise ValueError(
                    f"data {data!r}: record {i + 1} (counting from 1): field {text_field!r} holds "
                    f"{type(value).__name__}, not text ({where})"
                )
            if unchecked and isinstance(value, str):
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError as e:  # an escaped lone surrogate ("\ud800"): no character
                    raise ValueError(
                        f"data {data!r}: record {i + 1} (counting from 1): field {text_field!r} holds "
                        f"{value[e.start : e.end]!r}, a lone surrogate, not text ({where})"
                    ) from e
            values.append(value)
        if own and text_field not in own:
            missing.append((f, list(own)))
        fields.update(own)
    if missing and text_field in fields:
        raise _file_without_field(data, text_field, *missing[0])
    return values, list(fields)


def _file_without_field(data: str, text_field: str, f: Path, fields: list[str]) -> ValueError:
    """A file of a folder or glob whose records never hold ``text_field`` while other files' do (a
    stray file, or a shard written with another field name)."""
    return ValueError(
        f"data {data!r}: the records of {str(f)!r} have no field {text_field!r} (its fields: {fields}), "
        "those of the other files do; remove the file from the corpus or give its records the field"
    )


def _parquet_files(files: list[Path], text_field: str, data: str) -> list[Path]:
    """The Parquet ``files``, checked from their schemas: datasets casts every file to the first
    one's columns and types (a later int column would come back as text, a later file with other
    columns fails), so each file's ``text_field`` must be text; it is read alone.

    Raises:
        ValueError: no file holds ``text_field`` (the message names the fields present), one file
            lacks it while others hold it, a file whose ``text_field`` is not text, or a file that
            is not Parquet.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    names: dict[str, None] = {}
    holding, empty = [], []
    for f in files:
        try:
            schema = pq.read_schema(f)
            rows = pq.read_metadata(f).num_rows
        except (OSError, pa.ArrowException) as e:
            raise ValueError(
                f"data {data!r}: cannot read {str(f)!r} as parquet: {type(e).__name__}: {e}"
            ) from e
        if rows == 0:  # no records: skipped as an empty text file is (datasets fails on it)
            empty.append(f)
            continue
        names.update(dict.fromkeys(schema.names))
        if text_field not in schema.names:
            continue
        kind = schema.field(text_field).type
        # a dictionary-encoded column (pandas' category) holds its values' type
        held = kind.value_type if pa.types.is_dictionary(kind) else kind
        text = pa.types.is_string(held) or pa.types.is_large_string(held) or pa.types.is_null(held)
        if not (text or getattr(pa.types, "is_string_view", lambda _: False)(held)):
            raise ValueError(f"data {data!r}: field {text_field!r} holds {kind}, not text (file {f})")
        holding.append(f)
    if empty and len(empty) == len(files):
        if len(files) == 1 and str(files[0]) == data:
            raise ValueError(f"data file {data!r} is empty (a Parquet file with no rows)")
        raise ValueError(f"data {data!r} holds no text (every file is empty: Parquet files with no rows)")
    for f in empty:
        warnings.warn(f"data {data!r}: {str(f)!r} has no rows; it is skipped", stacklevel=4)
    if not holding:
        raise _no_field(data, text_field, list(names))
    for f in files:
        if f not in holding and f not in empty:
            raise _file_without_field(data, text_field, f, pq.read_schema(f).names)
    return holding


def _no_field(data: str, text_field: str, fields: list[str]) -> ValueError:
    return ValueError(
        f"data {data!r}: the records have no field {text_field!r} (fields present: "
        f"{fields}); choose one with --text-field (TrainConfig.text_field)"
    )


def _read_records(files: list[Path], fmt: str, text_field: str, data: str) -> list[str]:
    """The ``text_field`` of every record of local ``files`` (``datasets``' ``fmt`` builder). Plain
    (uncompressed) JSON files are read again as the files hold them: datasets infers a column type
    (strings that look like dates come back as datetimes, in a mixed column the string "1" as an
    int) and casts every file, and every 10 MB chunk of one, to the first one's types (a later int
    comes back as the text "7") and fields (a later record with another field fails); of Parquet
    files only those holding ``text_field`` are read, that column alone (:func:`_parquet_files`)."""
    datasets = import_datasets()
    plain_json = fmt == "json" and not any(f.name.lower().endswith(_COMPRESSED) for f in files)
    options = {}
    if fmt == "parquet":
        files, options = _parquet_files(files, text_field, data), {"columns": [text_field]}
    quiet = datasets.is_progress_bar_enabled()
    if quiet:
        datasets.disable_progress_bars()
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its "Failed to load JSON" line: said below
    try:
        ds = datasets.load_dataset(
            fmt, data_files=[str(f.resolve()) for f in files], split="train", **options
        )
    except Exception as e:  # datasets' and pyarrow's own errors: report them as bad data
        where = _first_bad_json_line(files) if fmt == "json" else None
        if where is not None:
            raise ValueError(f"data {data!r}: {where}") from e
        if fmt == "json" and all(_blank(f) for f in files):
            what = f"data file {data!r} is empty" if len(files) == 1 and str(files[0]) == data else None
            raise ValueError(what or f"data {data!r} holds no text (every file is empty)") from e
        if not plain_json:
            cause = e.__cause__ if e.__cause__ is not None and "error occurred" in str(e) else e
            raise ValueError(
                f"data {data!r}: cannot read it as {fmt}: {type(cause).__name__}: {cause}"
            ) from e
        ds = None  # e.g. files whose records hold different fields: the records are read below
    finally:
        datasets.logging.set_verbosity(verbosity)
        if quiet:
            datasets.enable_progress_bars()
    if plain_json:
        try:
            values, columns = _json_values(files, text_field, data, unchecked=ds is None)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            if ds is not None and not isinstance(e, UnicodeDecodeError):  # read by datasets alone
                plain_json = False
            else:
                raise ValueError(f"data {data!r}: {_first_bad_json_line(files) or e}") from e
    if not plain_json:
        columns = ds.column_names
    if text_field not in columns:
        raise _no_field(data, text_field, columns)
    if plain_json:
        return [v for v in values if v is not None]
    try:
        values = list(ds[text_field])
    except UnicodeDecodeError as e:  # pyarrow keeps invalid UTF-8 until the values are read
        raise ValueError(f"data {data!r}: a record is not valid UTF-8: {e}") from e
    docs = []
    for i, value in enumerate(values):
        if value is None:
            continue
        if not isinstance(value, str):
            raise ValueError(
                f"data {data!r}: record {i + 1} (counting from 1): field {text_field!r} holds "
                f"{type(value).__name__}, not text"
            )
        docs.append(value)
    return docs
