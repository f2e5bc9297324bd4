"""Declared kinds of command-line values: the one validation layer of the ``mnemo`` command.

Every numeric option of every sub-command states its range, and every path option its kind,
where the parser is built (``add_argument(..., type=positive_int)``). The kinds are ``argparse``
``type=`` callables, so a bad value is refused while the command line is read, before any work
starts: exit status 2 and one line naming the flag, the expected and the received value::

    mnemo probe circuits: error: argument --length: expected an int >= 1, got '0' (see: ...)

Kinds:

- :class:`Int` / :class:`Float`: a range (``lo``, ``hi``; open or closed ends); floats are always
  finite (``nan`` and ``inf`` are refused). Shorthands: :data:`positive_int`,
  :data:`nonneg_int`, :data:`seed`, :data:`positive_float`, :data:`nonneg_float`,
  :data:`probability`, :data:`finite_float`.
- :class:`IntList`: comma-separated ints in a range (``1024,4096``), optionally one of a few words
  (``none``, ``all``); the value is returned as given, for the command to split.
- :class:`Text`: a non-empty string. :class:`Token`: a non-empty string, blanks included.
- :func:`match_names`: the names that comma-separated names or shell-style patterns choose
  (``--ops 'gla*'``), each pattern required to match one.
- Paths: :class:`ExistingFile`, :class:`ExistingDir` (what a command
  reads), :class:`OutDir` (a folder to create or write into), :class:`OutFile` (a file to
  write), :class:`OutPath` (either). An output is checked for writability here, before the work:
  it must not be an existing path of the other kind, nor lie inside a run's checkpoint (which
  training rotates away), and its nearest existing ancestor must be a writable folder (a
  read-only file system counts as not writable).

Each kind carries ``hostile``: the values of its kind that a careful user may mistype (zero,
negative, huge, NaN, an empty string, a file for a folder, ...). The test suite
(``tests/test_hostile_cli.py``) walks the whole parser and tries each of them on each option, so
an option added later is covered by construction. Standard library only; this module imports
nothing of mnemo.
"""

from __future__ import annotations

import argparse
import fnmatch
import math
import os
import re
from pathlib import Path

#: values every kind's hostile list starts from (a kind adds its own)
_NUMERIC_HOSTILE = ("0", "-5", "-1e9", "1e30", "99999999999999999999", "nan", "inf", "-inf", "", "abc")


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose usage errors are one line on stderr (no usage block):
    ``PROG: error: MESSAGE (see: PROG --help)``, exit status 2. Sub-parsers made through
    ``add_subparsers`` are of this class too.

    A value that looks like a negative number, in any spelling ``float`` reads (``-1e9``, ``-inf``,
    ``-nan``, ``-.5``, ``-1_000``), is read as the value of the option before it (``--lr -inf``), as argparse
    already does for ``-5`` and ``-0.5``, so that it reaches the option's kind and is refused there
    with the usual message instead of "expected one argument"."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # argparse's own pattern knows only -5 and -0.5 (no option of mnemo looks like a number);
        # digits may be grouped by single underscores, as int() and float() read them (-1_000)
        d = r"\d(?:_?\d)*"
        self._negative_number_matcher = re.compile(
            rf"^-({d}\.?(?:{d})?|\.{d})([eE][+-]?{d})?$|^-(inf|infinity|nan)$", re.IGNORECASE
        )

    def error(self, message: str):  # noqa: D102 - argparse's hook
        self.exit(2, f"{self.prog}: error: {message} (see: {self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):  # noqa: D102 - argparse's method
        ns, extras = super().parse_known_args(args, namespace)
        # the deepest (sub-)parser that read the line is recorded first; argparse copies a
        # sub-parser's namespace into its parent's, so the parents keep the sub-command's
        if not hasattr(ns, "_mnemo_parser"):
            ns._mnemo_parser = self
        return ns, extras

    def parse_args(self, args=None, namespace=None):
        """argparse's, but an unknown flag is named by the sub-command that read the line
        (``mnemo train: error: unrecognized arguments: ... (see: mnemo train --help)``), whose
        ``--help`` lists the flags, rather than by ``mnemo``."""
        ns, extras = self.parse_known_args(args, namespace)
        owner = ns.__dict__.pop("_mnemo_parser", self)
        if extras:
            owner.error(f"unrecognized arguments: {' '.join(extras)}")
        return ns


#: roles whose text is shown as written (a literal: ``~`` in ``:file:`~/x``` is the home folder)
_LITERAL_ROLES = {
    "file", "samp", "envvar", "kbd", "command", "program", "option", "math", "code", "regexp",
    "dfn", "abbr", "mimetype", "makevar", "manpage", "guilabel", "menuselection", "newsgroup",
}  # fmt: skip


def _role_text(role: str, text: str) -> str:
    """What Sphinx shows for ``:role:`text```: a literal role its text; a cross-reference its
    title (``title <target>``), else its target without a leading ``!``, and with ``~`` only
    the target's last dotted part (``~a.B.c``: ``c``)."""
    if role.rsplit(":", 1)[-1] in _LITERAL_ROLES:
        return text
    titled = re.fullmatch(r"(.*?)\s*<([^<>]*)>", text, re.S)
    if titled and titled.group(1):
        return titled.group(1)
    text = text.lstrip("!")
    if text.startswith("~"):
        return text[1:].rsplit(".", 1)[-1]
    return text


def plain_text(doc: str) -> str:
    """``doc`` (reStructuredText, e.g. a module docstring) as the plain text of a ``--help`` page:
    ``:role:`target``` becomes what Sphinx shows for it (``~a.b.c``: ``c``; ``title <target>``:
    ``title``; a literal role such as ``:file:`~/x``` its text as written) and double backticks
    go."""
    doc = re.sub(r":([\w:.-]+):`([^`]*)`", lambda m: _role_text(m.group(1), m.group(2)), doc)
    return doc.replace("``", "")


class Kind:
    """Base of the declared kinds: ``kind(text)`` returns the value or raises
    ``argparse.ArgumentTypeError("expected EXPECTED, got 'TEXT'")``."""

    expected: str = "a value"
    hostile: tuple[str, ...] = ("",)
    #: what argparse shows in error messages it builds itself (``invalid <name> value``)
    __name__ = "value"

    def fail(self, text: str, why: str = "") -> None:
        raise argparse.ArgumentTypeError(f"expected {self.expected}, got {text!r}{why}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.expected!r})"


def _num(x) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def _range_text(lo, hi, lo_open: bool, hi_open: bool, what: str) -> str:
    if lo is not None and hi is not None:
        return f"{what} in {'(' if lo_open else '['}{_num(lo)}, {_num(hi)}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{what} {'>' if lo_open else '>='} {_num(lo)}"
    if hi is not None:
        return f"{what} {'<' if hi_open else '<='} {_num(hi)}"
    return what


class Int(Kind):
    """An int in ``[lo, hi]`` (either end ``None``: unbounded), or one of ``words`` (returned as
    the word)."""

    def __init__(self, lo: int | None = None, hi: int | None = None, words: tuple[str, ...] = ()):
        self.lo, self.hi, self.words = lo, hi, tuple(words)
        self.expected = _range_text(lo, hi, False, False, "an int") + "".join(f" or '{w}'" for w in words)
        self.hostile = _NUMERIC_HOSTILE + ("1.5",)

    def __call__(self, text: str) -> int | str:
        if str(text).strip() in self.words:
            return str(text).strip()
        try:
            v = int(str(text).strip())
        except ValueError:
            self.fail(text)
        if (self.lo is not None and v < self.lo) or (self.hi is not None and v > self.hi):
            self.fail(text)
        return v


class Float(Kind):
    """A finite float in the range ``lo .. hi`` (``lo_open`` / ``hi_open``: the end itself is
    excluded; ``None``: unbounded). ``nan`` and ``inf`` are always refused."""

    def __init__(self, lo=None, hi=None, *, lo_open=False, hi_open=False, words: tuple[str, ...] = ()):
        self.lo, self.hi, self.lo_open, self.hi_open, self.words = lo, hi, lo_open, hi_open, tuple(words)
        self.expected = _range_text(lo, hi, lo_open, hi_open, "a finite number") + "".join(
            f" or '{w}'" for w in words
        )
        self.hostile = _NUMERIC_HOSTILE

    def __call__(self, text: str) -> float | str:
        if str(text).strip() in self.words:
            return str(text).strip()
        try:
            v = float(str(text).strip())
        except ValueError:
            self.fail(text)
        if not math.isfinite(v):
            self.fail(text)
        v += 0.0  # -0.0 is 0.0 (a "-0" is no negative value, and prints as none)
        if self.lo is not None and (v < self.lo or (self.lo_open and v == self.lo)):
            self.fail(text)
        if self.hi is not None and (v > self.hi or (self.hi_open and v == self.hi)):
            self.fail(text)
        return v


class IntList(Kind):
    """Comma-separated ints in ``[lo, hi]`` (at least one), or one of ``words``; returns the text
    as given (stripped), for the command to split. ``unique``: a value given twice is refused (a
    list of lengths or sizes, where a repeat would only do the same work twice; default ``False``)."""

    def __init__(
        self, lo: int | None = 1, hi: int | None = None, words: tuple[str, ...] = (), unique: bool = False
    ):
        self.item, self.words, self.unique = Int(lo, hi), tuple(words), unique
        alt = "".join(f" or '{w}'" for w in words)
        self.expected = f"comma-separated {self.item.expected.replace('an int', 'ints')}{alt}"
        self.hostile = ("", ",", "0", "-5", "1,x", "1.5", "nan", "1,,0") + (("4,4",) if unique else ())

    def __call__(self, text: str) -> str:
        t = str(text).strip()
        if t in self.words:
            return t
        parts = [p.strip() for p in t.split(",")]
        if not t or any(not p for p in parts):
            self.fail(text)
        for p in parts:
            try:
                self.item(p)
            except argparse.ArgumentTypeError:
                self.fail(text)
        if self.unique:
            values = [int(p) for p in parts]
            twice = sorted({v for v in values if values.count(v) > 1})
            if twice:
                self.fail(text, f" ({', '.join(map(str, twice))} given twice)")
        return t


class FloatList(IntList):
    """Comma-separated finite numbers ``> 0`` (at least one); returns the text as given (stripped),
    for the command to split."""

    def __init__(self):
        self.item, self.words, self.unique = Float(0, lo_open=True), (), False
        self.expected = "comma-separated finite numbers > 0"
        self.hostile = ("", ",", "0", "-5", "1,x", "nan", "1,,2", "inf")


class Text(Kind):
    """A non-empty string (surrounding blanks do not count)."""

    def __init__(self, what: str = "a non-empty string"):
        self.expected = what
        self.hostile = ("", "   ")

    def __call__(self, text: str) -> str:
        if not str(text).strip():
            self.fail(text)
        return text


class Token(Kind):
    """A non-empty string, blanks included (``"\\n"`` is a character token): text meant to be one
    token, checked against the tokenizer where it is used."""

    def __init__(self, what: str = "a non-empty text (one token)"):
        self.expected = what
        self.hostile = ("",)

    def __call__(self, text: str) -> str:
        if not text:
            self.fail(text)
        return text


class Device(Kind):
    """A torch device this machine has: ``cpu``, ``cuda`` or ``cuda:N`` (CUDA is checked only
    when asked for, importing torch then)."""

    expected = "'cpu', 'cuda' or 'cuda:N'"
    hostile = ("", "gpu", "cuda:-1", "cuda:x", "tpu", "cuda:")

    def __call__(self, text: str) -> str:
        t = str(text).strip()
        if t == "cpu":
            return t
        name, colon, index = t.partition(":")
        # (`cuda:` with no index, or an index in other digits than 0-9, is no device torch names)
        if name != "cuda" or (colon and not (index.isascii() and index.isdigit())):
            self.fail(text)
        import torch  # only for a CUDA device

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            self.fail(text, " (this machine has no CUDA device)")
        if index and int(index) >= n:
            self.fail(text, f" (this machine has {n} CUDA device(s))")
        return t


# --------------------------------------------------------------------------------------------
# paths


def _writable_ancestor(p: Path) -> tuple[Path | None, str]:
    """The nearest existing ancestor of ``p`` and why it cannot take new entries ('' if it can)."""
    a = p.parent if p.parent != p else p
    while not a.exists():
        if a.parent == a:
            return None, " (no existing folder above it)"
        a = a.parent
    if not a.is_dir():
        return a, f" ({a} is a file, not a folder)"
    if not os.access(a, os.W_OK | os.X_OK):
        return a, f" ({a} is not writable)"
    return a, ""


_CKPT_DIR = re.compile(r"ckpt-\d+")


def checkpoint_around(p: Path) -> Path | None:
    """The checkpoint directory of a run that ``p`` is or lies in (a ``ckpt-NNNNNN`` folder next
    to a ``latest`` file, or holding a ``manifest.json``), else ``None``. Nothing may be written
    there: training deletes old checkpoints, and a checkpoint's manifest lists its files."""
    for a in (p, *p.parents):
        if _CKPT_DIR.fullmatch(a.name) and a.is_dir():
            if (a.parent / "latest").is_file() or (a / "manifest.json").is_file():
                return a
    return None


#: files that mark the root of a training run's folder (:mod:`mnemo.train.run_folder`)
RUN_MARKERS = ("latest", "metrics.jsonl", ".lock")


def is_run_folder(p: Path) -> bool:
    """Whether ``p`` is the root of a training run's folder (it holds ``latest``,
    ``metrics.jsonl`` or ``.lock``)."""
    return p.is_dir() and any((p / name).exists() for name in RUN_MARKERS)


class _PathKind(Kind):
    def __init__(self, expected: str):
        self.expected = expected
        self.hostile = ("", "   ")

    def __call__(self, text: str) -> str:
        try:
            return self._check(text)
        except OSError as e:  # a name too long for the file system, a folder it may not look in, ...
            self.fail(text, f" ({e.strerror or e})")
        except RuntimeError as e:  # pathlib's resolve() meeting a loop of symbolic links
            self.fail(text, " (a loop of symbolic links)" if "loop" in str(e).lower() else f" ({e})")

    def _check(self, text: str) -> str:
        raise NotImplementedError

    def _path(self, text: str) -> Path:
        if not str(text).strip():
            self.fail(text)
        try:
            return Path(text).expanduser()
        except RuntimeError:  # ~name of no such user
            self.fail(text, " (no such user's home folder)")

    @staticmethod
    def _value(text: str) -> str:
        """The value the command receives: the text as given, with a leading ``~`` expanded (the
        path the checks looked at; a shell leaves ``--out=~/x`` and a quoted ``'~/x'`` alone)."""
        return os.path.expanduser(text) if str(text).startswith("~") else text

    def _not_in_checkpoint(self, text: str, p: Path) -> None:
        ckpt = checkpoint_around(p.resolve())  # where the path leads (`..` and links), not its text
        if ckpt is not None:
            self.fail(
                text,
                f" (inside the checkpoint {ckpt}, which training rotates away: choose a folder outside it)",
            )


class ExistingFile(_PathKind):
    """A file that exists (not a folder)."""

    def __init__(self, what: str = "an existing file"):
        super().__init__(what)

    def _check(self, text: str) -> str:
        p = self._path(text)
        if p.is_dir():
            self.fail(text, " (a folder)")
        if not p.is_file():  # (a device or a pipe is there, but no file to read)
            self.fail(text, " (not a regular file)" if p.exists() else " (not found)")
        return self._value(text)


class ExistingDir(_PathKind):
    """A folder that exists (not a file)."""

    def __init__(self, what: str = "an existing folder"):
        super().__init__(what)

    def _check(self, text: str) -> str:
        p = self._path(text)
        if p.is_file():
            self.fail(text, " (a file)")
        if not p.is_dir():
            self.fail(text, " (not a folder)" if p.exists() else " (not found)")
        return self._value(text)


class OutDir(_PathKind):
    """A folder to write into: an existing folder, or a new one that can be created (its
    nearest existing ancestor is a writable folder); never inside a checkpoint, with
    ``not_a_run`` not the root of a training run's folder (:func:`is_run_folder`), and with
    ``not_inside_run`` not inside one (a run's ``--overwrite`` discards, and its resume sets
    aside, what lies in its folder: a run nested in ``RUN/kept/`` would go with them)."""

    def __init__(
        self, what: str = "a folder to write into", not_a_run: bool = False, not_inside_run: bool = False
    ):
        super().__init__(what)
        self.not_a_run = not_a_run
        self.not_inside_run = not_inside_run

    def _check(self, text: str) -> str:
        p = self._path(text)
        self._not_in_checkpoint(text, p)
        if self.not_inside_run:
            for a in p.resolve().parents:  # `.lock` alone is no mark here: other tools (pytest) make one
                if any((a / name).is_file() for name in ("latest", "metrics.jsonl")):
                    self.fail(
                        text,
                        f" (inside the training run {a}, whose --overwrite discards and whose resume sets "
                        "aside what its folder holds: choose a folder outside it)",
                    )
        if p.exists():
            if not p.is_dir():
                self.fail(text, " (an existing file)")
            if self.not_a_run and is_run_folder(p):
                self.fail(
                    text,
                    " (a training run's folder: what this writes would mix with the run's files; choose "
                    "another folder)",
                )
            if not os.access(p, os.W_OK | os.X_OK):
                self.fail(text, " (not writable)")
            return self._value(text)
        if p.suffix.lower() in _FILE_SUFFIXES:  # `--out scores.png`: a file's name, not a folder's
            self.fail(
                text, f" (a file name: this is the folder the files go into, e.g. {str(p.parent or '.')!r})"
            )
        _, why = _writable_ancestor(p)
        if why:
            self.fail(text, why)
        return self._value(text)


#: suffixes that name a file, refused for a new folder (an existing folder of such a name is fine)
_FILE_SUFFIXES = {".png", ".pdf", ".svg", ".jpg", ".json", ".jsonl", ".csv", ".txt", ".md", ".html"}
_FILE_SUFFIXES |= {".yaml", ".yml", ".pt", ".safetensors", ".sqlite", ".parquet"}


def refuse_existing(path, flag: str, overwrite: bool) -> None:
    """``ValueError`` when the output file ``path`` (given as ``flag``) exists and ``overwrite`` is
    off: a command never replaces a file it did not ask about (checked before the work)."""
    if path is not None and not overwrite and Path(path).exists():
        raise ValueError(f"{flag}: {path} exists; pass --overwrite to replace it (or choose another file)")


class OutFile(_PathKind):
    """A file to write (replaced if it exists): not an existing folder; its folder exists or can
    be created, and takes new entries (a file is replaced through a temporary one beside it).
    ``suffix``: the name must end with it (e.g. ``.json``)."""

    def __init__(self, what: str = "a file to write", suffix: str | None = None):
        super().__init__(what if suffix is None else f"{what} ending in {suffix}")
        self.suffix = suffix

    def _check(self, text: str) -> str:
        p = self._path(text)
        if p.is_dir() or str(text).endswith(("/", os.sep)):
            self.fail(text, " (a folder)")
        self._not_in_checkpoint(text, p)
        if p.name in ("latest", "metrics.jsonl", ".lock") and (p.parent / "latest").is_file():
            self.fail(text, f" (a file of the training run {p.parent})")
        if self.suffix and not p.name.endswith(self.suffix):
            self.fail(text)
        if p.exists():
            if not os.access(p, os.W_OK):
                self.fail(text, " (not writable)")
            # it is replaced through a temporary file beside it (atomic_write_text; SQLite's journal)
            folder = p.parent
            if not os.access(folder, os.W_OK | os.X_OK):
                self.fail(text, f" ({folder} is not writable: the file is replaced through a new one there)")
            return self._value(text)
        _, why = _writable_ancestor(p)
        if why:
            self.fail(text, why)
        return self._value(text)


class OutPath(_PathKind):
    """A file (its name ending in ``suffix``) or a folder to write into."""

    def __init__(self, suffix: str, what: str | None = None):
        super().__init__(what or f"a {suffix} file or a folder to write into")
        self.file, self.dir = OutFile(suffix=suffix), OutDir()

    def _check(self, text: str) -> str:
        kind = self.file if Path(str(text)).suffix == self.file.suffix else self.dir
        try:
            return kind(text)
        except argparse.ArgumentTypeError as e:
            why = str(e).split(f"got {text!r}", 1)[-1]
            self.fail(text, why)


# --------------------------------------------------------------------------------------------
# the shorthands the parsers use

positive_int = Int(1)
nonneg_int = Int(0)
#: seeds: what ``torch.manual_seed`` takes
seed = Int(0, 2**63 - 1)
positive_float = Float(0, lo_open=True)
nonneg_float = Float(0)
probability = Float(0, 1)
finite_float = Float()
threads = Int(1, 4096)
#: model sizes: beyond these a model cannot be built on any machine (the memory check refuses
#: what this one cannot hold)
width = Int(1, 2**20)
depth = Int(1, 1024)
device = Device()


def kind_of(action: argparse.Action) -> Kind | None:
    """The declared kind of a parser action (``None`` for switches, choices and plain strings)."""
    return action.type if isinstance(action.type, Kind) else None


def match_names(flag: str, text: str, names) -> list[str]:
    """The names among ``names`` chosen by ``text``: comma-separated names or shell-style patterns
    (``fnmatch``, case-sensitive: ``gla*``, ``*delta*``), in ``names``' order and each once (as
    ``mnemo verify --ops`` reads its patterns). Raises ``ValueError`` naming ``flag``, each pattern
    that matches no name and the known names (a mistyped one would silently choose less), or for a
    ``text`` of no name at all."""
    names = list(names)
    patterns = [t.strip() for t in str(text).split(",") if t.strip()]
    if not patterns:
        raise ValueError(f"{flag}: expected comma-separated names or patterns, got {text!r}")
    unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n in names)]
    if unmatched:
        raise ValueError(
            f"{flag}: {', '.join(map(repr, unmatched))} matches no name; known: {', '.join(names)}"
        )
    return [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
