"""Every numeric or boolean default of the public API is a documented fact, and docs and code agree.

A planted bug in a default value (``directions=32 -> 33``, ``state_spec(batch_size=1) -> 0``, a
dataclass field ``sample_temperature: float = 0.8 -> 1.8``) changes what the library computes
without failing any behavioural test that passes the value explicitly. This test pins each such
default to its docstring.

What is checked: every module of ``mnemo.ops``, ``mnemo.memory``, ``mnemo.layers``,
``mnemo.models``, ``mnemo.train`` and ``mnemo.interp`` is imported (a module that cannot be imported
fails its test). For every public function, public class and public method defined in it (its
``__module__`` is the module; the name does not start with ``_``), each parameter whose default is
an ``int``, ``float`` or ``bool`` literal — for a class, its ``__init__`` parameters or its
dataclass fields — must state that default in its docstring (for a class: class docstring +
``__init__`` docstring; for a function or method: its own docstring) in one of two forms:

(a) in the parameter's own entry (Google style ``name: text``, up to the next entry or section),
    the words ``default ``X`` `` (any case; ``X`` in double backticks, e.g. ``(default ``64``)``);
(b) anywhere in the docstring, the literal ``name=X`` in double backticks inside a list of
    defaults, i.e. right after the word "default(s)" (``Defaults: ``chunk_size=64``,
    ``output_final_state=False``.``, ``(default ``scale=1.0``)``) — for parameters documented
    jointly (``mode, chunk_size: as in ...``) or without an entry of their own. A ``name=X``
    elsewhere (``with ``causal=False`` nothing is masked``) is a usage and is not read.

Every stated value must parse (a Python literal, or arithmetic on literals such as ``2 ** -0.5``)
and equal the code's default (floats up to ``rel 1e-12``; ``True`` is not ``1``).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import math
import operator
import pkgutil
import re
from collections.abc import Callable, Iterator

import pytest

PACKAGES = ("mnemo.ops", "mnemo.memory", "mnemo.layers", "mnemo.models", "mnemo.train", "mnemo.interp")

_LITERAL_TYPES = (bool, int, float)


# --------------------------------------------------------------------------------------------
# The modules
# --------------------------------------------------------------------------------------------
def _module_names() -> tuple[list[str], list[str]]:
    """Every module under :data:`PACKAGES` (the packages included), and the walk's errors."""
    names: list[str] = []
    errors: list[str] = []
    for pkg_name in PACKAGES:
        try:
            pkg = importlib.import_module(pkg_name)
        except Exception as e:  # noqa: BLE001 - reported by test_every_module_is_walked
            errors.append(f"{pkg_name}: {type(e).__name__}: {e}")
            continue
        names.append(pkg_name)
        for info in pkgutil.walk_packages(pkg.__path__, prefix=pkg_name + ".", onerror=errors.append):
            names.append(info.name)
    return names, errors


MODULES, WALK_ERRORS = _module_names()


# --------------------------------------------------------------------------------------------
# The parser
# --------------------------------------------------------------------------------------------
_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Pow: operator.pow,
}


def parse_value(text: str) -> object:
    """A stated default: a Python literal, or ``+ - * / // **`` on numeric literals.

    Raises ``ValueError`` for anything else (a name, a call, an expression in other parameters).
    """
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError):
        pass

    def ev(node: ast.AST) -> object:
        if isinstance(node, ast.Constant) and type(node.value) in _LITERAL_TYPES:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else +v
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError(f"not a literal: {text!r}")

    try:
        return ev(ast.parse(text.strip(), mode="eval").body)
    except SyntaxError as e:
        raise ValueError(f"not a literal: {text!r}") from e


def same_value(stated: object, default: object) -> bool:
    """``stated == default``: bools only equal bools, numbers up to ``rel 1e-12``."""
    if isinstance(default, bool) or isinstance(stated, bool):
        return type(stated) is bool and type(default) is bool and stated is default
    if isinstance(stated, (int, float)) and isinstance(default, (int, float)):
        if isinstance(default, int) and not isinstance(stated, int):
            return False  # an int default stated as a float (``64.0``) is a different value's type
        return math.isclose(stated, default, rel_tol=1e-12, abs_tol=0.0) or stated == default
    return False


# an entry header: ``name: text``, ``a, b: text``, ``name (int): text`` at the start of a line
_HEADER = re.compile(
    r"^(?P<indent>[ \t]*)(?P<names>[A-Za-z_]\w*(?:\s*[,;]\s*[A-Za-z_]\w*)*)\s*(?:\([^)]*\))?:(?:\s|$)"
)
_DEFAULT_IN_ENTRY = re.compile(r"\bdefault\s+``(?P<value>[^`]+)``", re.IGNORECASE)


def _entries(doc: str, others: tuple[str, ...] = ()) -> dict[str, str]:
    """``name -> its entry's text`` for the entries that name exactly one parameter.

    An entry runs from its header line up to the next line that is not more indented than the
    header (the next entry, a section such as ``Returns:``, or prose), or up to an inline header
    ``other:`` of one of the ``others`` (``a: text. b: text`` on one line).
    """
    lines = doc.splitlines()
    out: dict[str, str] = {}
    for i, line in enumerate(lines):
        m = _HEADER.match(line)
        if m is None:
            continue
        indent = len(m.group("indent").expandtabs())
        j = i + 1
        while j < len(lines) and not (lines[j].strip() and len(lines[j]) - len(lines[j].lstrip()) <= indent):
            j += 1
        names = re.split(r"\s*[,;]\s*", m.group("names"))
        if len(names) != 1 or names[0] in out:
            continue
        text = "\n".join(lines[i:j])[m.end() :]
        others = tuple(o for o in others if o != names[0])
        if others:
            inline = re.search(r"(?<![\w.`])(?:" + "|".join(map(re.escape, others)) + r")\s*:(?:\s|$)", text)
            if inline is not None:
                text = text[: inline.start()]
        out[names[0]] = text
    return out


# a list of defaults: the word "default(s)", an optional colon, then ````...```` items separated
# by commas, semicolons or "and" (``Defaults: ``a=1``, ``b=2``.``, ``(defaults ``a=1`` and ``b=2``)``)
_DEFAULT_LIST = re.compile(
    r"\bdefaults?\b:?\s*(?P<items>``[^`]+``(?:\s*(?:,|;|and|, and)\s*``[^`]+``)*)", re.IGNORECASE
)


def stated_defaults(doc: str, name: str, others: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """Every default of ``name`` that ``doc`` states, as ``(form, text of the value)``.

    Form (a) ``entry``: ``default ``X`` `` (or ``default ``name=X`` ``) in ``name``'s own entry,
    the first such phrase. Form (b) ``name=``: ````name=X```` in a list of defaults, i.e. right after
    the word "default(s)" (``Defaults: ``a=1``, ``name=X``.``); a ````name=X```` elsewhere is a usage
    (``with ``causal=False`` ...``), not a statement. ``others``: the other parameters' names
    (their inline entries end ``name``'s entry).
    """
    doc = inspect.cleandoc(doc or "")
    found: list[tuple[str, str]] = []
    entry = _entries(doc, others).get(name)
    if entry is not None:
        m = _DEFAULT_IN_ENTRY.search(entry)
        if m is not None:
            value = m.group("value")
            own = re.fullmatch(re.escape(name) + r"\s*=\s*(.+)", value.strip())
            found.append(("entry", own.group(1) if own else value))
    literal = re.compile(r"``" + re.escape(name) + r"\s*=\s*(?P<value>[^`]+)``")
    for listed in _DEFAULT_LIST.finditer(doc):
        found += [("name=", m.group("value")) for m in literal.finditer(listed.group("items"))]
    return found


def check_default(doc: str, name: str, default: object, others: tuple[str, ...] = ()) -> str | None:
    """``None`` when ``doc`` states ``name``'s default correctly; else what is wrong."""
    found = stated_defaults(doc, name, others)
    if not found:
        return "missing"
    for form, text in found:
        try:
            value = parse_value(text)
        except ValueError:
            return f"stated {text!r} ({form}) does not parse; the code says {default!r}"
        if not same_value(value, default):
            return f"stated {text!r} ({form}) but the code says {default!r}"
    return None


# --------------------------------------------------------------------------------------------
# The collection
# --------------------------------------------------------------------------------------------
def _is_literal(value: object) -> bool:
    return type(value) in _LITERAL_TYPES


Candidate = tuple[str, str, str, object, tuple[str, ...]]


def _parameters(fn: Callable, skip_first: bool) -> list[tuple[str, object]]:
    """``(name, default)`` of ``fn``'s parameters (``self`` / ``cls`` left out)."""
    params = list(inspect.signature(fn).parameters.values())
    if skip_first and params:
        params = params[1:]
    return [(p.name, p.default) for p in params]


def _class_parameters(cls: type) -> list[tuple[str, object]]:
    """A dataclass's own init fields, or the parameters of the ``__init__`` the class defines."""
    if dataclasses.is_dataclass(cls):
        own = cls.__dict__.get("__annotations__", {})
        return [(f.name, f.default) for f in dataclasses.fields(cls) if f.name in own and f.init]
    init = cls.__dict__.get("__init__")
    if init is None or not inspect.isfunction(init):
        return []
    return _parameters(init, skip_first=True)


def _candidates(qual: str, doc: str, params: list[tuple[str, object]]) -> Iterator[Candidate]:
    names = tuple(n for n, _ in params)
    for n, d in params:
        if _is_literal(d):
            yield qual, doc, n, d, names


def collect(module) -> Iterator[Candidate]:
    """``(qualified name, docstring, parameter, default, all parameter names)`` for every
    parameter with a literal default of ``module``'s public functions, classes and methods."""
    for attr, obj in sorted(vars(module).items()):
        if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(obj):
            init = obj.__dict__.get("__init__")
            init_doc = init.__doc__ if inspect.isfunction(init) and not dataclasses.is_dataclass(obj) else ""
            doc = inspect.cleandoc(obj.__doc__ or "") + "\n\n" + inspect.cleandoc(init_doc or "")
            yield from _candidates(attr, doc, _class_parameters(obj))
            for mname, member in sorted(obj.__dict__.items()):
                if mname.startswith("_"):
                    continue
                skip_first = True
                if isinstance(member, staticmethod):
                    member, skip_first = member.__func__, False
                elif isinstance(member, classmethod):
                    member = member.__func__
                if inspect.isfunction(member):
                    params = _parameters(member, skip_first)
                    yield from _candidates(f"{attr}.{mname}", member.__doc__ or "", params)
        elif callable(obj):
            fn = inspect.unwrap(obj)
            if inspect.isfunction(fn):
                yield from _candidates(attr, obj.__doc__ or fn.__doc__ or "", _parameters(fn, False))


def problems(module) -> tuple[list[str], list[str]]:
    """(wrong or unparsable stated defaults, undocumented defaults) of ``module``."""
    wrong: list[str] = []
    missing: list[str] = []
    for qual, doc, p, d, names in collect(module):
        msg = check_default(doc, p, d, names)
        if msg == "missing":
            missing.append(f"{qual}({p}={d!r})")
        elif msg is not None:
            wrong.append(f"{qual}({p}): {msg}")
    return wrong, missing


# --------------------------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------------------------
def test_every_module_is_walked():
    assert not WALK_ERRORS, f"packages that could not be walked: {WALK_ERRORS}"
    for pkg in PACKAGES:
        assert pkg in MODULES


@pytest.mark.parametrize("module_name", MODULES)
def test_defaults_are_documented_and_agree_with_the_code(module_name):
    module = importlib.import_module(module_name)  # an import error fails here, named
    wrong, missing = problems(module)
    lines = []
    if wrong:
        lines.append(f"{module_name}: stated defaults that disagree with the code:")
        lines += [f"  {w}" for w in wrong]
    if missing:
        lines.append(
            f"{module_name}: defaults not documented (add 'default ``X``' to the entry or a "
            f"'``name=X``' to the docstring):"
        )
        lines += [f"  {m}" for m in missing]
    assert not lines, "\n".join(lines)


# ------------------------------------------------------------------- the parser on small cases
def _toy(n: int = 4, scale: float = 0.5, causal: bool = True, mode: str = "chunk", chunk_size: int = 64):
    pass


_CORRECT = """Toy.

Args:
    n: number of things (default ``4``).
    scale: a factor; Default ``0.5``.
    causal: mask the future
        (default ``True``).
"""


def test_parser_accepts_a_correct_docstring():
    for p, d in [("n", 4), ("scale", 0.5), ("causal", True)]:
        assert check_default(_CORRECT, p, d) is None, p


def test_parser_rejects_a_wrong_value_and_a_wrong_type():
    assert "code says 5" in check_default(_CORRECT, "n", 5)
    assert "code says 0.25" in check_default(_CORRECT, "scale", 0.25)
    assert check_default(_CORRECT, "causal", 1) is not None  # True is not 1
    assert check_default("n: count (default ``4.0``).", "n", 4) is not None  # an int is not a float
    assert "does not parse" in check_default("n: count (default ``four``).", "n", 4)


def test_parser_reports_a_missing_default_and_keeps_entries_apart():
    doc = """Toy.

    Args:
        n: number of things.
        scale: a factor (default ``0.5``).

    Returns:
        nothing (default ``3``).
    """
    assert check_default(doc, "n", 4) == "missing"  # the next entry's default is not n's
    assert check_default(doc, "causal", True) == "missing"
    assert check_default(doc, "scale", 0.5) is None


def test_parser_reads_joint_entries_through_name_equals():
    doc = """Toy.

    Args:
        mode, chunk_size: as in :func:`other` (default ``32``).

    Defaults: ``chunk_size=64``, ``causal=False``, ``scale=2 ** -1``.
    """
    assert check_default(doc, "chunk_size", 64) is None  # the joint entry's default belongs to nobody
    assert check_default(doc, "chunk_size", 32) is not None
    assert check_default(doc, "causal", False) is None
    assert check_default(doc, "causal", 0) is not None
    assert check_default(doc, "scale", 0.5) is None
    assert check_default(doc, "mode", 1) == "missing"
    # a ``name=X`` outside a sentence about defaults is a usage, not a statement
    usage = "Toy. With ``causal=False`` nothing is masked (default ``causal=True``)."
    assert check_default(usage, "causal", True) is None
    assert check_default("Toy (default 1). With ``causal=False`` no mask.", "causal", True) == "missing"


def test_an_inline_entry_ends_the_previous_one():
    doc = """Toy.

    Args:
        steps: optimizer steps. lr: the rate (default ``0.1``).
    """
    assert check_default(doc, "steps", 10, ("steps", "lr")) == "missing"
    assert check_default(doc, "steps", 10) is not None  # without the names, lr's default is read as steps'


def test_the_collection_sees_signatures_dataclass_fields_and_methods():
    import types

    mod = types.ModuleType("toy_module")

    @dataclasses.dataclass
    class Config:
        """A config.

        Args:
            lr: learning rate (default ``0.001``).
        """

        lr: float = 1e-3
        steps: int = 10
        name: str = "x"

        def spec(self, batch_size: int = 1):
            """Shapes. Defaults: ``batch_size=1``."""

    for obj in (Config, _toy):
        obj.__module__ = "toy_module"
        setattr(mod, obj.__name__, obj)
    got = {(q, p): d for q, _, p, d, _ in collect(mod)}
    assert ("_toy", "n") not in got  # a private name
    assert got == {("Config", "lr"): 1e-3, ("Config", "steps"): 10, ("Config.spec", "batch_size"): 1}
    wrong, missing = problems(mod)
    assert wrong == [] and missing == ["Config(steps=10)"]
