#!/usr/bin/env python
"""Mutation testing for mnemo: plant one small bug at a time and check that the tests notice.

How it works:

1. The repository (tracked and untracked, non-ignored files: ``git ls-files -co --exclude-standard``)
   is copied once into a temporary directory. The working tree is never touched.
2. Mutants are generated with :mod:`ast` over the chosen source files (``_mutations``): operator
   swaps (``+ -``, ``* /``, ``** -> *``, ``& |``), comparison boundaries (``< <=``, ``== !=``,
   ``is``, ``in``), ``and <-> or``, dropped unary ``-`` / ``not``, numeric constants (``0 -> 1``,
   ``1 -> 0``, ``2 -> 1``, else ``c -> c + 1``), ``True <-> False``, ``1 - x -> x``, swapped
   arguments of two-argument calls (not of commutative ones such as ``max`` or ``transpose``),
   dropped clamp / ``min`` / ``max`` bounds, ``sum <-> mean``, ``+= <-> -=``. Code that cannot
   change what the library computes is never mutated: docstrings, annotations, ``raise`` /
   ``assert`` statements, f-strings, logging / printing / warnings, ``__repr__`` / ``__str__``, and
   the presentation of figures (the text of matplotlib calls on ``ax`` / ``fig`` / ``plt`` and their
   style keywords: colours, fonts, sizes, rotations; their data and axis limits are mutated).
3. Each source file has a group of targeted tests (``TESTS``), run after the root-level
   ``tests/test_meaning_*.py`` and its area's ``tests/<area>/test_meaning_*.py``. The test files of
   all the groups run once, unmutated, under ``coverage`` (when installed) with one coverage
   context per test: they must pass (tests that already fail are deselected, with a warning), each
   group's time (from a JUnit report) sets its per-mutant timeout (``max(60 s, 3 x`` the group's
   time), and a mutant on a line that its group's tests never execute is left out (a mutant nobody runs says
   nothing about the tests; module-level lines, run on import, count as run). The result is
   cached per content of ``mnemo/`` and ``tests/`` in ``~/.cache/mnemo/mutation``.
4. A sample is drawn with a fixed ``--seed`` (``--total N`` over all candidates, or ``--per-file N``):
   the candidates are shuffled with the seed and the first covered ones are taken, so the sample is
   unbiased over the candidates and reproducible. ``--replay RESULTS.json`` (or ``--ids``) runs
   exactly the given mutants.
5. For each mutant the file is rewritten in the copy, its group runs with ``-x -q -p
   no:cacheprovider`` (``PYTHONDONTWRITEBYTECODE=1``: no stale bytecode) and the timeout, and the
   original file is put back. A failing, timed-out or not importable run kills the mutant; a
   passing one lets it survive.

Score = killed / (mutants - judged equivalent). Equivalent mutants (the change cannot alter
behaviour) are listed with a reason in ``scripts/mutation_equivalent.json`` (``--equivalent``).

Examples::

    python scripts/mutation.py --total 70 --seed 1 --out runs/mutation-seed1.json
    python scripts/mutation.py --files mnemo/ops/ssd.py --per-file 10 --seed 3
    python scripts/mutation.py --replay runs/mutation-seed1.json --out runs/mutation-seed1-again.json
    python scripts/mutation.py --total 70 --seed 1 --list          # show the sample, run nothing
    python scripts/mutation.py --show 'mnemo/ops/ssd.py:57:12:Add->Sub'   # print one mutant's diff
"""

from __future__ import annotations

import argparse
import ast
import difflib
import fnmatch
import glob
import hashlib
import itertools
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from xml.etree import ElementTree

ROOT = Path(__file__).resolve().parent.parent
# issue 16's areas; after issue 17 the nested-learning code lives in layers/ (CMS, self-modifying
# memories), train/ (M3) and models/task_signal.py, and mnemo/nested only re-exports it
AREAS = (
    "mnemo/ops",
    "mnemo/memory",
    "mnemo/layers",
    "mnemo/models/task_signal.py",
    "mnemo/train",
    "mnemo/interp",
)
DEFAULT_EQUIVALENT = ROOT / "scripts" / "mutation_equivalent.json"
CACHE = Path(os.environ.get("MNEMO_MUTATION_CACHE", Path.home() / ".cache" / "mnemo" / "mutation"))

# --------------------------------------------------------------------------------------------
# Targeted tests of each source file (globs allowed; a pattern that matches nothing is dropped).
# Chosen so that a surviving mutant (the whole group passes) costs about 5-40 s on one core.
# Every file also gets its area's ``tests/<area>/test_meaning_*.py``, run first (see ``tests_for``).
# --------------------------------------------------------------------------------------------
_OPS_CORE = ("tests/ops/test_contract.py",)
_LAYERS = (
    "tests/layers/test_components.py",
    "tests/layers/test_anatomy_core.py",
    "tests/layers/test_mixer_checks.py",
    "tests/layers/test_mixers.py",
    "tests/models/test_state_size.py",
    "tests/models/test_lm.py",
    "tests/models/test_packing_and_padding.py",
)
_NESTED = (
    "tests/nested/test_cms.py",
    "tests/nested/test_self_modifying.py",
    "tests/nested/test_task_signal.py",
)
_TRAIN = (
    "tests/train/test_trainer.py",
    "tests/train/test_packing.py",
    "tests/tasks/test_task_training.py",
    "tests/tasks/test_sweep.py",
)
TESTS: dict[str, tuple[str, ...]] = {
    "mnemo/ops/_common.py": (
        "tests/ops/test_decay_exp.py",
        "tests/ops/test_delta_rule.py",
        "tests/ops/test_gated_linear_attention.py",
        "tests/ops/test_linear_attention.py",
        "tests/ops/test_ssd.py",
        "tests/ops/test_selective_scan.py",
        "tests/ops/test_softmax_attention.py",
        *_OPS_CORE,
    ),
    "mnemo/ops/_chunked.py": (
        "tests/ops/test_chunk_scan_native.py",
        "tests/ops/test_delta_rule.py",
        "tests/ops/test_gated_linear_attention.py",
        "tests/ops/test_native_fallback.py",
        *_OPS_CORE,
    ),
    "mnemo/ops/_native/__init__.py": (
        "tests/ops/test_native_wrappers.py",
        "tests/ops/test_chunk_scan_native.py",
        "tests/ops/test_native_fallback.py",
        "tests/ops/test_native.py",
    ),
    "mnemo/ops/delta_rule.py": (
        "tests/ops/test_delta_rule.py",
        "tests/ops/test_properties.py",
        *_OPS_CORE,
        "tests/ops/test_chunk_backward.py",
    ),
    "mnemo/ops/feature_maps.py": ("tests/ops/test_linear_attention.py", "tests/layers/test_mixers.py"),
    "mnemo/ops/gated_linear_attention.py": (
        "tests/ops/test_gated_linear_attention.py",
        "tests/ops/test_linear_attention.py",
        "tests/ops/test_ssd.py",
        *_OPS_CORE,
        "tests/ops/test_chunk_backward.py",
    ),
    "mnemo/ops/linear_attention.py": (
        "tests/ops/test_linear_attention.py",
        "tests/ops/test_gated_linear_attention.py",
        *_OPS_CORE,
    ),
    "mnemo/ops/selective_scan.py": (
        "tests/ops/test_selective_scan.py",
        "tests/ops/test_native_fallback.py",
        *_OPS_CORE,
        "tests/ops/test_native.py",
    ),
    "mnemo/ops/softmax_attention.py": (
        "tests/ops/test_softmax_attention.py",
        "tests/layers/test_sinks.py",
        "tests/ops/test_linear_attention.py",
        "tests/ops/test_properties.py",
    ),
    "mnemo/ops/ssd.py": ("tests/ops/test_ssd.py", "tests/ops/test_selective_scan.py", *_OPS_CORE),
    "mnemo/ops/ring_attention.py": ("tests/ops/test_ring_attention.py",),
    "mnemo/memory/attribution.py": ("tests/interp/test_ttt_maps.py", "tests/memory/test_engine.py"),
    "mnemo/memory/*.py": (
        "tests/test_mutants_42.py",
        "tests/memory/test_engine.py",
        "tests/memory/test_miras.py",
        "tests/layers/test_titans.py",
    ),
    "mnemo/layers/cms.py": (
        "tests/nested/test_meaning_nested.py",
        *_NESTED,
        "tests/nested/test_continual.py",
    ),
    "mnemo/train/m3.py": (
        "tests/train/test_meaning_optimizer.py",
        "tests/nested/test_m3.py",
        "tests/nested/test_cms.py",
    ),
    "mnemo/layers/self_modifying*.py": (
        "tests/nested/test_meaning_nested.py",
        "tests/nested/test_self_modifying.py",
        "tests/nested/test_cms.py",
    ),
    "mnemo/models/task_signal.py": (
        "tests/nested/test_meaning_nested.py",
        "tests/nested/test_task_signal.py",
        "tests/nested/test_cms.py",
    ),
    "mnemo/nested/__init__.py": _NESTED,
    "mnemo/layers/hooks.py": ("tests/models/test_hooks.py", "tests/layers/test_mixer_checks.py"),
    "mnemo/layers/state.py": ("tests/models/test_hooks.py", "tests/layers/test_mixer_checks.py", *_LAYERS),
    "mnemo/layers/titans.py": ("tests/layers/test_titans.py", *_LAYERS),
    "mnemo/layers/ssm.py": ("tests/layers/test_ssm_options.py", *_LAYERS),
    "mnemo/layers/delta.py": ("tests/test_mutants_42.py", "tests/layers/test_gdn_options.py", *_LAYERS),
    "mnemo/layers/norm.py": ("tests/test_mutants_42.py", *_LAYERS),
    "mnemo/layers/attention.py": (
        "tests/layers/test_sinks.py",
        "tests/layers/test_yarn.py",
        "tests/layers/test_gdn_options.py",
        *_LAYERS,
    ),
    "mnemo/layers/rotary.py": ("tests/layers/test_yarn.py", "tests/layers/test_gdn_options.py", *_LAYERS),
    "mnemo/layers/moe.py": ("tests/test_mutants_42.py", "tests/layers/test_moe.py", *_LAYERS),
    "mnemo/layers/*.py": _LAYERS,
    "mnemo/train/distributed.py": (
        "tests/train/test_distributed.py",
        "tests/train/test_ddp.py",
        "tests/train/test_ring_attention_cp.py",
    ),
    "mnemo/train/sharded.py": ("tests/train/test_fsdp.py",),
    "mnemo/train/memory_estimate.py": ("tests/train/test_memory_estimate.py", *_TRAIN),
    "mnemo/train/task_eval.py": ("tests/tasks/test_task_training.py", "tests/tasks/test_sweep.py"),
    # gradient accumulation under DDP (no_sync): one short 2-process run, about 25 s
    "mnemo/train/trainer.py": (*_TRAIN, "tests/train/test_ddp_no_sync.py"),
    "mnemo/train/strategy.py": (*_TRAIN, "tests/train/test_ddp_no_sync.py"),
    "mnemo/train/aux_losses.py": ("tests/layers/test_moe.py", *_TRAIN),
    "mnemo/train/*.py": _TRAIN,
    "mnemo/interp/maps.py": ("tests/interp/test_maps.py", "tests/interp/test_scores.py"),
    "mnemo/interp/scores.py": ("tests/interp/test_scores.py", "tests/interp/test_maps.py"),
    "mnemo/interp/spectrum.py": ("tests/interp/test_spectrum.py", "tests/interp/test_spectrum_state.py"),
    "mnemo/interp/interventions.py": ("tests/interp/test_interventions.py",),
    "mnemo/interp/*.py": ("tests/interp/test_probe.py",),
}


def tests_for(path: str, root: Path) -> tuple[str, ...]:
    """The test files of ``path`` (the first matching pattern of ``TESTS``), expanded in ``root``."""
    group = next((g for pattern, g in TESTS.items() if fnmatch.fnmatch(path, pattern)), None)
    if group is None:
        return ()
    area = path.split("/")[1] if path.startswith("mnemo/") else ""
    # the meaning tests first: they are fast and pin values down, so they fail first; the root-level
    # ones (documented defaults, ...) cover every area
    meaning = ["tests/test_meaning_*.py"] + ([f"tests/{area}/test_meaning_*.py"] if area else [])
    patterns = meaning + list(group)
    out: list[str] = []
    for p in patterns:
        for m in sorted(glob.glob(str(root / p))):
            rel = os.path.relpath(m, root)
            if rel not in out:
                out.append(rel)
    return tuple(out)


# --------------------------------------------------------------------------------------------
# Mutant generation
# --------------------------------------------------------------------------------------------
@dataclass
class Mutant:
    id: str
    file: str
    line: int
    col: int
    kind: str
    code: str  # the original source line, stripped
    replacement: str  # the mutated expression / statement
    start: int = field(repr=False, default=0)  # byte offsets of the replaced span
    end: int = field(repr=False, default=0)
    stmt_line: int = field(repr=False, default=0)  # first line of the enclosing statement (coverage)

    def apply(self, source: bytes) -> bytes:
        return source[: self.start] + self.replacement.encode() + source[self.end :]

    def valid(self, source: bytes) -> bool:
        """The mutated module parses (checked for the sampled mutants only: parsing is slow)."""
        try:
            ast.parse(self.apply(source))
        except SyntaxError:
            return False
        return True


_BINOP_SWAPS = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.Div,
    ast.Div: ast.Mult,
    ast.FloorDiv: ast.Div,
    ast.Mod: ast.FloorDiv,
    ast.Pow: ast.Mult,
    ast.BitAnd: ast.BitOr,
    ast.BitOr: ast.BitAnd,
    ast.LShift: ast.RShift,
    ast.RShift: ast.LShift,
}
_CMP_SWAPS = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
}
# two-argument calls whose arguments commute (swapping them is equivalent by construction)
_COMMUTATIVE = set(
    "min max maximum minimum fmax fmin add mul hypot logaddexp eq ne isclose allclose equal "
    "transpose swapaxes swapdims gcd lcm logical_and logical_or dist".split()
)
_QUIET_CALLS = {"print", "warn", "debug", "info", "warning", "error", "exception", "critical", "log", "write"}
_CLAMPS = {"clamp", "clip", "clamp_", "clip_"}
# presentation only (like printing): the text of a matplotlib figure and the styling of its marks
_PLOT_OBJECTS = {"ax", "ax2", "axes", "fig", "plt", "bar"}
_PLOT_TEXT = {
    "text", "annotate", "set_title", "set_xlabel", "set_ylabel", "suptitle", "legend", "set_xticks",
    "set_yticks", "axhline", "axvline", "set_postfix", "set_description",
}  # fmt: skip
_STYLE_KWARGS = {
    "color", "colors", "cmap", "fontsize", "rotation", "ha", "va", "lw", "linewidth", "ls", "linestyle",
    "ms", "markersize", "mew", "figsize", "dpi", "fraction", "aspect", "layout", "xytext", "textcoords",
    "xycoords", "loc", "label", "refresh",
}  # fmt: skip


def _name(func: ast.AST) -> str:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return ""


def _is_num(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) in (int, float)


def _is_str(node: ast.AST) -> bool:
    return (isinstance(node, ast.Constant) and isinstance(node.value, str)) or isinstance(node, ast.JoinedStr)


def _new_const(v):
    if v == 0:
        return type(v)(1)
    if v == 1:
        return type(v)(0)
    if v == 2:
        return type(v)(1)
    return v + 1


def _fmt(v) -> str:
    return repr(v)


def _mutations(node: ast.AST) -> list[tuple[str, ast.AST]]:
    """(kind, replacement node) pairs for one node."""
    out: list[tuple[str, ast.AST]] = []
    if isinstance(node, ast.BinOp):
        if _is_str(node.left) or _is_str(node.right):
            return out
        new = _BINOP_SWAPS.get(type(node.op))
        if new is not None:
            out.append((f"{type(node.op).__name__}->{new.__name__}", ast.BinOp(node.left, new(), node.right)))
        if isinstance(node.op, ast.Sub) and _is_num(node.left) and node.left.value == 1:
            out.append(("1-x->x", node.right))
    elif isinstance(node, ast.AugAssign):
        new = _BINOP_SWAPS.get(type(node.op))
        if new is not None and not _is_str(node.value):
            out.append(
                (f"{type(node.op).__name__}=->{new.__name__}=", ast.AugAssign(node.target, new(), node.value))
            )
    elif isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            new = _CMP_SWAPS.get(type(op))
            if new is not None:
                ops = list(node.ops)
                ops[i] = new()
                out.append(
                    (f"{type(op).__name__}->{new.__name__}", ast.Compare(node.left, ops, node.comparators))
                )
    elif isinstance(node, ast.BoolOp):
        new = ast.Or if isinstance(node.op, ast.And) else ast.And
        out.append((f"{type(node.op).__name__}->{new.__name__}", ast.BoolOp(new(), node.values)))
    elif isinstance(node, ast.UnaryOp):
        if isinstance(node.op, (ast.USub, ast.Not, ast.Invert)):
            out.append((f"drop-{type(node.op).__name__}", node.operand))
    elif isinstance(node, ast.Constant):
        v = node.value
        if isinstance(v, bool):
            out.append((f"{v}->{not v}", ast.Constant(not v)))
        elif type(v) in (int, float):
            nv = _new_const(v)
            out.append((f"const {_fmt(v)}->{_fmt(nv)}", ast.Constant(nv)))
    elif isinstance(node, ast.Call):
        name = _name(node.func)
        pos, kws = node.args, node.keywords
        starred = any(isinstance(a, ast.Starred) for a in pos) or any(k.arg is None for k in kws)
        if starred:
            return out
        # clamp bounds: x.clamp(lo, hi) / x.clamp(min=.., max=..) / torch.clamp(x, ...)
        if name in _CLAMPS or name in ("clamp_min", "clamp_max", "clamp_min_", "clamp_max_"):
            method = isinstance(node.func, ast.Attribute) and not (
                isinstance(node.func.value, ast.Name) and node.func.value.id in ("torch", "np", "numpy")
            )
            target = node.func.value if method else (pos[0] if pos else None)
            bounds = pos if method else pos[1:]
            named = [("min" if i == 0 else "max", b) for i, b in enumerate(bounds)]
            named += [(k.arg, k.value) for k in kws if k.arg in ("min", "max")]
            if name.startswith("clamp_m"):
                if target is not None:
                    out.append((f"drop-{name}", target))
            elif target is not None:
                for which, _ in named:
                    keep = [ast.keyword(arg=w, value=b) for w, b in named if w != which]
                    if keep:
                        call = ast.Call(node.func, [] if method else [target], keep)
                    else:
                        call = target
                    out.append((f"drop-clamp-{which}", call))
        elif name in ("min", "max") and isinstance(node.func, ast.Name) and len(pos) == 2 and not kws:
            out.append((f"{name}(a,b)->a", pos[0]))
            out.append((f"{name}(a,b)->b", pos[1]))
        elif name in ("sum", "mean") and isinstance(node.func, ast.Attribute):
            other = "mean" if name == "sum" else "sum"
            out.append(
                (f"{name}->{other}", ast.Call(ast.Attribute(node.func.value, other, ast.Load()), pos, kws))
            )
        if len(pos) == 2 and name not in _COMMUTATIVE and ast.dump(pos[0]) != ast.dump(pos[1]):
            out.append(("swap-args", ast.Call(node.func, [pos[1], pos[0]], kws)))
    return out


class _Collector:
    """Walks a module and collects mutation sites, skipping code that cannot change behaviour."""

    def __init__(self, path: str, source: bytes):
        self.path = path
        self.source = source
        self.tree = ast.parse(source)
        self.line_starts = [0] + [m.end() for m in re.finditer(rb"\n", source)]
        self.lines = source.decode().split("\n")
        self.sites: list[tuple[ast.AST, str, ast.AST, int]] = []

    def offset(self, line: int, col: int) -> int:
        return self.line_starts[line - 1] + col

    def run(self) -> list[Mutant]:
        self._visit(self.tree, stmt=None)
        mutants, seen = [], set()
        for node, kind, new, stmt_line in self.sites:
            is_stmt = isinstance(node, ast.stmt)
            text = ast.unparse(new)
            if not is_stmt:
                text = f"({text})"
            mid = f"{self.path}:{node.lineno}:{node.col_offset}:{kind}"
            if mid in seen:
                continue
            seen.add(mid)
            m = Mutant(
                id=mid,
                file=self.path,
                line=node.lineno,
                col=node.col_offset,
                kind=kind,
                code=self.lines[node.lineno - 1].strip(),
                replacement=text,
                start=self.offset(node.lineno, node.col_offset),
                end=self.offset(node.end_lineno, node.end_col_offset),
                stmt_line=stmt_line,
            )
            if ast.dump(new) == ast.dump(node):  # e.g. swapping two equal arguments
                continue
            mutants.append(m)
        return mutants

    def _skip_call(self, node: ast.Call) -> bool:
        f = node.func
        name = _name(f)
        if name in _QUIET_CALLS:
            return True
        if (
            isinstance(f, ast.Attribute)
            and isinstance(f.value, ast.Name)
            and f.value.id in ("logger", "log", "logging", "warnings")
        ):
            return True
        return False

    @staticmethod
    def _plot_call(node: ast.AST) -> str | None:
        """The method name of a call on a matplotlib-like object (``ax.text(...)``), else None."""
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            recv = node.func.value
            if isinstance(recv, ast.Name) and recv.id in _PLOT_OBJECTS:
                return node.func.attr
        return None

    def _visit(self, node: ast.AST, stmt: ast.stmt | None) -> None:
        if isinstance(
            node, (ast.Raise, ast.Assert, ast.JoinedStr, ast.Import, ast.ImportFrom, ast.Global, ast.Nonlocal)
        ):
            return
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in (
            "__repr__",
            "__str__",
            "extra_repr",
        ):
            return
        if isinstance(node, ast.Call) and self._skip_call(node):
            return
        plot = self._plot_call(node)
        if plot in _PLOT_TEXT:
            return
        walk = node  # what the children are taken from
        if plot is not None or (isinstance(node, ast.Call) and _name(node.func) == "subplots"):
            walk = ast.Call(node.func, node.args, [k for k in node.keywords if k.arg not in _STYLE_KWARGS])
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            return
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return
        if isinstance(node, ast.stmt):
            stmt = node
        if stmt is not None and hasattr(node, "lineno"):
            for kind, new in _mutations(node):
                self.sites.append((node, kind, new, stmt.lineno))
        for name, value in ast.iter_fields(walk):
            if name in ("annotation", "returns", "type_comment"):
                continue
            if isinstance(value, list):
                body = value
                if name == "body" and isinstance(
                    node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
                ):
                    body = value[1:] if value and _is_docstring_expr(value[0]) else value
                for v in body:
                    if isinstance(v, ast.AST):
                        self._visit(v, stmt)
            elif isinstance(value, ast.AST):
                self._visit(value, stmt)


def _is_docstring_expr(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    )


def _is_type_checking(test: ast.AST) -> bool:
    return _name(test) == "TYPE_CHECKING"


def generate(path: str, root: Path) -> list[Mutant]:
    return _Collector(path, (root / path).read_bytes()).run()


# --------------------------------------------------------------------------------------------
# The copy, coverage and test runs
# --------------------------------------------------------------------------------------------
def copy_repo(dest: Path) -> None:
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    for f in files:
        if not f:
            continue
        src = ROOT / os.fsdecode(f)
        if not src.is_file():  # deleted in the work tree
            continue
        dst = dest / os.fsdecode(f)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)


def run_env(root: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=str(root) + os.pathsep + env.get("PYTHONPATH", ""),
        # a same-size mutant written within the same second must not load a stale .pyc
        PYTHONDONTWRITEBYTECODE="1",
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
        MKL_NUM_THREADS=env.get("MKL_NUM_THREADS", "1"),
        PYTHONHASHSEED="0",
    )
    return env


def run_cmd(
    cmd: list[str], root: Path, timeout: float | None, extra_path: str = ""
) -> tuple[int | None, str, float]:
    """Run ``cmd`` in ``root`` in its own process group; rc None on timeout."""
    t0 = time.perf_counter()
    env = run_env(root)
    if extra_path:
        env["PYTHONPATH"] = extra_path + os.pathsep + env["PYTHONPATH"]
    p = subprocess.Popen(
        cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        out, _ = p.communicate(timeout=timeout)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        rc = None
    except BaseException:  # interrupted: take the test run down too
        os.killpg(p.pid, signal.SIGKILL)
        raise
    return rc, out.decode(errors="replace"), time.perf_counter() - t0


_FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+?)(?: - .*)?$", re.M)


def pytest_cmd(tests: tuple[str, ...], deselect: list[str], extra: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra, *tests]
    for d in deselect:
        cmd += ["--deselect", d]
    return cmd


@dataclass
class Group:
    tests: tuple[str, ...]
    deselect: list[str]
    seconds: float
    covered: dict[str, list[int]] | None  # file -> executed lines (None: coverage not available)


def _snapshot_hash(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(
        list(root.glob("mnemo/**/*")) + list(root.glob("tests/**/*")) + [root / "pyproject.toml"]
    ):
        if p.is_file() and "__pycache__" not in p.parts:
            h.update(str(p.relative_to(root)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


_CONTEXT_PLUGIN = """
import coverage


def pytest_runtest_setup(item):
    cov = coverage.Coverage.current()
    if cov is not None:
        cov.switch_context(item.nodeid)
"""


def prepare_groups(groups: list[tuple[str, ...]], root: Path, snap: str, use_cov: bool) -> dict:
    """One unmutated run of all the groups' test files together (under coverage, with one context
    per test, when ``use_cov``): which tests already fail (deselected, with a warning), the time of
    each group (per-test times from a JUnit XML report) and, per group, the lines its tests run
    (module-level lines, run on import, count for every group)."""
    files = sorted({f for g in groups for f in g})
    key = hashlib.sha256("\0".join(files).encode()).hexdigest()[:16]
    cache = CACHE / snap / f"{key}{'-cov' if use_cov else ''}.json"
    if cache.exists():
        d = json.loads(cache.read_text())
    else:
        d = _unmutated_run(files, root, use_cov)
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(d))
    if d["failed"]:
        print(f"warning: deselected {len(d['failed'])} test(s) failing without any mutation: {d['failed']}")
    out = {}
    for g in groups:
        mine = set(g)
        deselect = [n for n in d["failed"] if n.split("::")[0] in mine]
        seconds = 4.0 + sum(d["seconds"].get(f, 0.0) for f in g)  # + start-up and collection
        covered = None
        if d["lines"] is not None:
            covered = {
                src: sorted(int(ln) for ln, who in lines.items() if not who or mine.intersection(who))
                for src, lines in d["lines"].items()
            }
        out[g] = Group(g, deselect, seconds, covered)
    return out


def _unmutated_run(files: list[str], root: Path, use_cov: bool) -> dict:
    with tempfile.TemporaryDirectory() as td:
        td = Path(td)
        (td / "_mnemo_mutation_ctx.py").write_text(_CONTEXT_PLUGIN)
        junit = td / "junit.xml"
        args = ["-rfE", f"--junitxml={junit}", "-o", "junit_family=xunit1"]
        if use_cov:
            args += ["-p", "_mnemo_mutation_ctx"]
        cmd = pytest_cmd(tuple(files), [], args)
        if use_cov:
            rc_file = td / "coveragerc"
            rc_file.write_text(f"[run]\ndata_file = {td / '.coverage'}\nsource = mnemo\n")
            cmd = [sys.executable, "-m", "coverage", "run", f"--rcfile={rc_file}", "-m", *cmd[2:]]
        what = " under coverage" if use_cov else ""
        print(f"unmutated run{what} of {len(files)} test files", file=sys.stderr)
        rc, out, secs = run_cmd(cmd, root, None, extra_path=str(td))
        failed = _FAILED.findall(out) if rc else []
        if rc not in (0, 1) or (rc == 1 and not failed):
            raise SystemExit(f"the unmutated tests do not run (rc {rc}):\n{out[-3000:]}")
        seconds: dict[str, float] = {}
        for case in ElementTree.parse(junit).getroot().iter("testcase"):
            f = case.get("file", "")
            seconds[f] = seconds.get(f, 0.0) + float(case.get("time", 0.0))
        lines = None
        if use_cov:
            js = td / "cov.json"
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "coverage",
                    "json",
                    f"--rcfile={rc_file}",
                    "--show-contexts",
                    "-o",
                    str(js),
                ],
                cwd=root,
                env=run_env(root),
                check=True,
                capture_output=True,
            )
            lines = {}
            for f, info in json.loads(js.read_text())["files"].items():
                rel = os.path.relpath(f if os.path.isabs(f) else os.path.join(root, f), root)
                lines[rel] = {
                    ln: sorted({c.split("::")[0] for c in cs if c}) for ln, cs in info["contexts"].items()
                }
    return {"failed": failed, "seconds": seconds, "lines": lines, "wall": round(secs, 1)}


def run_mutant(m: Mutant, g: Group, root: Path, timeout: float) -> dict:
    path = root / m.file
    original = path.read_bytes()
    try:
        path.write_bytes(m.apply(original))
        rc, out, secs = run_cmd(pytest_cmd(g.tests, g.deselect, ["-x"]), root, timeout)
    finally:
        path.write_bytes(original)
    if rc is None:
        status, by = "timeout", f"> {timeout:.0f} s"
    elif rc == 0:
        status, by = "survived", ""
    elif rc < 0:  # the test process crashed (e.g. a native kernel handed bad arguments)
        status, by = "killed", f"crashed (signal {-rc})"
    elif rc in (1, 2, 3):  # a failure, an import/collection error, an internal error
        status = "killed"
        f = _FAILED.findall(out)
        by = f[0] if f else (out.strip().splitlines() or [f"rc {rc}"])[-1][:120]
    else:
        status, by = "error", f"pytest rc {rc}: " + (out.strip().splitlines() or [""])[-1][:120]
    return {"status": status, "seconds": round(secs, 1), "killed_by": by}


# --------------------------------------------------------------------------------------------
def source_files(patterns: list[str]) -> list[str]:
    out: list[str] = []
    for p in patterns:
        q = ROOT / p
        found = sorted(q.rglob("*.py")) if q.is_dir() else sorted(Path(x) for x in glob.glob(str(q)))
        for f in found:
            rel = str(f.relative_to(ROOT))
            if rel not in out and "__pycache__" not in rel:
                out.append(rel)
    return out


def load_equivalent(path: Path | None) -> list[dict]:
    if path is None or not path.exists():
        return []
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text)
    else:
        data = json.loads(text)
    if isinstance(data, dict):
        data = data.get("equivalent", [])
    return list(data)


def is_equivalent(m: dict, eq: list[dict]) -> dict | None:
    """A listed entry matches by id, or (robust to lines moving) by file, column, kind and source line."""
    for e in eq:
        if e.get("id") == m["id"]:
            return e
        parts = e.get("id", "").rsplit(":", 3)
        if len(parts) == 4 and e.get("code") == m["code"]:
            file, _, col, kind = parts
            if (file, col, kind) == (m["file"], str(m["col"]), m["kind"]):
                return e
    return None


def diff_of(m: Mutant, root: Path) -> str:
    a = (root / m.file).read_bytes()
    b = m.apply(a)
    return "".join(
        difflib.unified_diff(
            a.decode().splitlines(True), b.decode().splitlines(True), f"a/{m.file}", f"b/{m.file}", n=1
        )
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--files", nargs="+", default=list(AREAS), help="source files / folders / globs to mutate"
    )
    ap.add_argument("--seed", type=int, default=0, help="seed of the sample (default 0)")
    s = ap.add_mutually_exclusive_group()
    s.add_argument("--total", type=int, help="sample N mutants over all chosen files")
    s.add_argument("--per-file", type=int, help="sample N mutants in each file")
    s.add_argument("--replay", type=Path, help="run exactly the mutants of an earlier results JSON")
    s.add_argument("--ids", nargs="+", help="run these mutant ids")
    ap.add_argument(
        "--equivalent", type=Path, default=DEFAULT_EQUIVALENT, help="JSON/YAML list of equivalent mutants"
    )
    ap.add_argument("--out", type=Path, help="write the results JSON here")
    ap.add_argument(
        "--timeout", type=float, help="seconds per mutant (default: max(60, 3 x the group's unmutated time))"
    )
    ap.add_argument(
        "--no-coverage", action="store_true", help="do not drop mutants on lines the tests never run"
    )
    ap.add_argument("--list", action="store_true", help="print the sample and stop")
    ap.add_argument("--show", metavar="ID", help="print the diff of one mutant and stop")
    ap.add_argument("--keep", action="store_true", help="keep the temporary copy (its path is printed)")
    args = ap.parse_args(argv)

    files = source_files(args.files)
    all_mutants: list[Mutant] = []
    for f in files:
        all_mutants += generate(f, ROOT)
    by_id = {m.id: m for m in all_mutants}
    if args.show:
        if args.show not in by_id:
            raise SystemExit(f"no mutant {args.show!r}")
        print(diff_of(by_id[args.show], ROOT))
        return 0

    use_cov = not args.no_coverage
    if use_cov:
        try:
            import coverage  # noqa: F401
        except ImportError:
            print(
                "warning: coverage is not installed (pip install coverage); every line counts as run",
                file=sys.stderr,
            )
            use_cov = False

    t_start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="mnemo-mutation-"))
    try:
        copy_repo(tmp)
        rc, out, _ = run_cmd([sys.executable, "-c", "import mnemo; print(mnemo.__file__)"], tmp, 120)
        if rc != 0 or not Path(out.strip().splitlines()[-1]).resolve().is_relative_to(tmp.resolve()):
            raise SystemExit(f"the copy's mnemo is not the one imported: {out}")
        snap = _snapshot_hash(tmp)
        groups: dict[tuple[str, ...], Group] = {}

        def prepare(paths: list[str], coverage_too: bool) -> None:
            needed = sorted({tests_for(f, tmp) for f in paths} - {()})
            groups.update(prepare_groups(needed, tmp, snap, coverage_too))

        def group_of(path: str) -> Group | None:
            return groups.get(tests_for(path, tmp))

        sources: dict[str, bytes] = {}

        def runnable(m: Mutant) -> bool:
            g = group_of(m.file)
            if g is None or (g.covered is not None and m.stmt_line not in set(g.covered.get(m.file, ()))):
                return False
            return m.valid(sources.setdefault(m.file, (tmp / m.file).read_bytes()))

        # ---- the sample
        if args.replay or args.ids:
            ids = args.ids or [r["id"] for r in json.loads(args.replay.read_text())["mutants"]]
            missing = [i for i in ids if i not in by_id]
            if missing:
                print(
                    f"warning: {len(missing)} mutant(s) no longer exist (the source changed): {missing}",
                    file=sys.stderr,
                )
            sample = [by_id[i] for i in ids if i in by_id]
            # the sample is given: the unmutated run only checks and times the groups
            prepare(sorted({m.file for m in sample}), False)
        else:
            prepare(files, use_cov)
            rng = random.Random(args.seed)
            order = sorted(all_mutants, key=lambda m: (m.file, m.line, m.col, m.kind))
            rng.shuffle(order)
            sample = []
            if args.per_file:
                for f in files:
                    mine = (m for m in order if m.file == f and runnable(m))
                    sample += list(itertools.islice(mine, args.per_file))
            else:
                n = args.total or 70
                for m in order:
                    if len(sample) >= n:
                        break
                    if runnable(m):
                        sample.append(m)
            sample.sort(key=lambda m: (m.file, m.line, m.col, m.kind))
        if args.list:
            for m in sample:
                print(f"{m.id}\t{m.code}\t=> {m.replacement}")
            print(f"{len(sample)} mutants of {len(all_mutants)} candidates in {len(files)} files")
            return 0

        # ---- run
        from tqdm import tqdm

        eq = load_equivalent(args.equivalent)
        results = []
        counts = {"killed": 0, "survived": 0, "timeout": 0, "error": 0}
        bar = tqdm(sample, unit="mutant", dynamic_ncols=True)
        for m in bar:
            g = group_of(m.file)
            timeout = args.timeout or max(60.0, 3 * g.seconds)
            bar.set_description(f"{Path(m.file).name}:{m.line}")
            r = run_mutant(m, g, tmp, timeout)
            counts[r["status"]] += 1
            bar.set_postfix(killed=counts["killed"] + counts["timeout"], survived=counts["survived"])
            rec = {k: v for k, v in asdict(m).items() if k not in ("start", "end", "stmt_line")}
            rec.update(r, tests=list(g.tests))
            e = is_equivalent(rec, eq)
            if e is not None:
                rec["equivalent"] = e.get("reason", "")
            if r["status"] == "survived":
                rec["diff"] = diff_of(m, tmp)
            results.append(rec)
        bar.close()
    finally:
        if args.keep:
            print(f"copy kept at {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    # ---- report
    wall = time.perf_counter() - t_start
    n = len(results)
    n_eq = sum(1 for r in results if "equivalent" in r)
    n_err = sum(1 for r in results if r["status"] == "error")
    killed = sum(1 for r in results if r["status"] in ("killed", "timeout") and "equivalent" not in r)
    denom = n - n_eq - n_err
    score = killed / denom if denom else float("nan")
    w = max([len(f"{r['file']}:{r['line']}") for r in results] + [10])
    print(f"\n{'file:line'.ljust(w)}  {'mutation'.ljust(22)}  status")
    for r in results:
        st = r["status"] + (" (equivalent)" if "equivalent" in r else "")
        print(f"{(r['file'] + ':' + str(r['line'])).ljust(w)}  {r['kind'][:22].ljust(22)}  {st}")
    survivors = [r for r in results if r["status"] == "survived" and "equivalent" not in r]
    if survivors:
        print("\nsurvivors:")
        for r in survivors:
            print(f"  {r['id']}\n    {r['code']}\n    => {r['replacement']}")
    sample_kind = f"per-file {args.per_file}" if args.per_file else f"total {args.total or 70}"
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    summary = {
        "score": score,
        "killed": killed,
        "survived": len(survivors),
        "equivalent": n_eq,
        "errors": n_err,
        "mutants": n,
        "candidates": len(all_mutants),
        "files": len(files),
        "seed": args.seed,
        "sample": "replay" if (args.replay or args.ids) else sample_kind,
        "wall_seconds": round(wall, 1),
        "commit": head,
        "coverage": use_cov,
    }
    print(
        f"\nscore {killed}/{denom} = {100 * score:.1f}%  ({n} mutants: {killed} killed, "
        f"{len(survivors)} survived, "
        f"{n_eq} equivalent, {n_err} errors; {summary['sample']}"
        f"{'' if args.replay or args.ids else f', seed {args.seed}'}; {wall / 60:.1f} min)"
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps({"summary": summary, "mutants": results}, indent=1, ensure_ascii=False) + "\n"
        )
        print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
