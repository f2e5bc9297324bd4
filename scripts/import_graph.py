"""The package-level import graph of ``mnemo`` and its cycles (DESIGN.md §2).

Parses every ``mnemo/**/*.py`` with :mod:`ast` — module-level *and* function-level imports
(``import``, ``from … import …``, relative ones resolved), plus modules named by string in
``importlib.import_module("mnemo.…")`` calls and in ``*_MODULES`` lists (``mnemo.cli``'s command
modules) — and maps each to its package: the first part below ``mnemo`` (``mnemo/train/trainer.py``
is ``train``, ``mnemo/cli.py`` is ``cli``). Prints one line per edge between two packages
(``A -> B``: some module of A imports one of B; ``lazy`` counts imports inside functions, ``dynamic``
the string ones), then every cycle (strongly connected component of two or more packages), then
the edges against the documented order, then the cycles between modules (any import kind), and
exits 1 if there is a cycle of either kind.

    python scripts/import_graph.py            # the whole graph
    python scripts/import_graph.py --only train,interp

Standard library only; it imports nothing of mnemo.
"""

from __future__ import annotations

import argparse
import ast
import functools
import sys
from collections import defaultdict, deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "mnemo"
#: DESIGN.md §2: each package may import those to its left, never those to its right
ORDER = ["ops", "memory", "layers", "models", "train", "hf", "cli"]
#: lazy edges against the order that are allowed, with the reason (left out of the cycle search);
#: none today (``models`` reads foreign checkpoints through a registry that ``hf`` fills)
ALLOWED_LAZY: dict[tuple[str, str], str] = {}
#: side packages: the core packages (of ORDER) that may never import them. ``data`` and ``interp``
#: depend on models/ops, never the reverse; ``train`` does not import ``interp`` (its callbacks are
#: passed in by the CLI and the sweep runner)
SIDE = {
    "data": {"ops", "memory", "layers", "models"},
    "interp": {"ops", "memory", "layers", "models", "train"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(module: str) -> str | None:
    """``mnemo.train.trainer`` -> ``train``; ``mnemo`` itself -> ``mnemo``; not mnemo -> None."""
    parts = module.split(".")
    if parts[0] != "mnemo":
        return None
    return parts[1] if len(parts) > 1 else "mnemo"


def imports(path: Path):
    """``(imported module, line, kind)`` for every import in ``path``; kind is ``top``, ``lazy``
    (inside a function) or ``dynamic`` (a module named by string)."""
    return _imports(path, path.stat().st_mtime_ns, ROOT)


def _nodes(tree: ast.AST):
    """``(node, inside a function)`` for every node, in :func:`ast.walk`'s order (breadth first):
    one pass (walking each function's subtree again was quadratic in the nesting)."""
    todo = deque([(tree, False)])
    while todo:
        node, inside = todo.popleft()
        yield node, inside
        inner = inside or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        todo.extend((child, inner) for child in ast.iter_child_nodes(node))


@functools.cache
def _imports(path: Path, mtime_ns: int, root: Path) -> tuple[tuple[str, int, str], ...]:
    """:func:`imports`' answer, parsed once per file version and root (both graphs read every file)."""
    return tuple(_scan(path))


def _scan(path: Path):
    me = module_name(path)
    is_pkg = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), str(path))
    for node, inside in _nodes(tree):
        kind = "lazy" if inside else "top"
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno, kind
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = me.split(".")
                if not is_pkg:
                    base = base[:-1]  # a module's package
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base)
                if node.module:
                    yield f"{prefix}.{node.module}", node.lineno, kind
                else:  # ``from .. import interp``: the names are modules (or attributes)
                    for alias in node.names:
                        yield f"{prefix}.{alias.name}", node.lineno, kind
            elif node.module:
                yield node.module, node.lineno, kind
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name == "import_module" and node.args and isinstance(node.args[0], ast.Constant):
                if isinstance(node.args[0].value, str):
                    yield node.args[0].value, node.lineno, "dynamic"
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            if any(n.endswith("MODULES") for n in names) and isinstance(node.value, (ast.List, ast.Tuple)):
                for elt in node.value.elts:
                    if isinstance(elt, ast.Constant) and isinstance(elt.value, str):
                        yield elt.value, node.lineno, "dynamic"


def build_graph() -> dict[tuple[str, str], dict]:
    edges: dict[tuple[str, str], dict] = {}
    for path in sorted(ROOT.rglob("*.py")):
        src = package_of(module_name(path))
        for target, line, kind in imports(path):
            dst = package_of(target)
            if dst is None or dst == src or dst == "mnemo":
                continue
            e = edges.setdefault((src, dst), {"top": 0, "lazy": 0, "dynamic": 0, "where": []})
            e[kind] += 1
            e["where"].append(f"{path.relative_to(ROOT.parent)}:{line}")
    return edges


def build_module_graph() -> dict[tuple[str, str], list[str]]:
    """Module-level edges (``mnemo.train.trainer -> mnemo.train.optim``), every import kind
    included; an imported name resolves to the longest module it names (``from ..ops import
    delta_rule`` is ``mnemo.ops.delta_rule`` when that module exists, else ``mnemo.ops``)."""
    paths = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}

    def resolve(name: str) -> str | None:
        parts = name.split(".")
        while parts and ".".join(parts) not in paths:
            parts.pop()
        return ".".join(parts) if parts else None

    edges: dict[tuple[str, str], list[str]] = {}
    for mod, path in paths.items():
        for target, line, _ in imports(path):
            dst = resolve(target)
            if dst is not None and dst != mod:
                edges.setdefault((mod, dst), []).append(f"{path.relative_to(ROOT.parent)}:{line}")
    return edges


def cycles(edges) -> list[list[str]]:
    """Strongly connected components with more than one package (Tarjan)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def against_order(a: str, b: str) -> bool:
    """Whether ``a -> b`` breaks DESIGN.md §2 (only among the packages it names)."""
    if a in ORDER and b in ORDER:
        return ORDER.index(b) > ORDER.index(a)
    if b in SIDE:
        return a in SIDE[b]
    if a in SIDE:  # data/interp import models/ops (and each other), nothing above
        return b in ORDER and ORDER.index(b) > ORDER.index("models")
    return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", help="comma-separated packages: print only edges among them")
    p.add_argument("--where", action="store_true", help="also list the importing file:line of each edge")
    args = p.parse_args(argv)
    edges = build_graph()
    only = set(args.only.split(",")) if args.only else None
    print("package-level import edges (A -> B: A imports B; top / lazy = inside a function / dynamic):")
    for (a, b), e in sorted(edges.items()):
        if only and not (a in only and b in only):
            continue
        print(f"  {a:>9} -> {b:<9} top {e['top']:>2}  lazy {e['lazy']:>2}  dynamic {e['dynamic']:>2}")
        if args.where:
            for w in e["where"]:
                print(f"{'':16}{w}")
    for (a, b), why in ALLOWED_LAZY.items():
        e = edges.get((a, b))
        if e is not None and e["top"] == 0:
            print(f"allowed lazy edge {a} -> {b}: {why}")
    kept = {k: e for k, e in edges.items() if not (k in ALLOWED_LAZY and e["top"] == 0)}
    found = cycles(kept)
    print("cycles:", "none" if not found else "")
    for comp in found:
        print("  " + " <-> ".join(comp))
    bad = [(a, b) for a, b in sorted(kept) if against_order(a, b)]
    order = " <- ".join(ORDER)
    print(
        f"edges against DESIGN.md §2 ({order}; data/interp depend on models/ops):", "none" if not bad else ""
    )
    for a, b in bad:
        print(f"  {a} -> {b}: " + ", ".join(edges[a, b]["where"]))
    for a, b in (("train", "interp"), ("interp", "train")):
        print(f"{a} -> {b}: {'yes' if (a, b) in edges else 'no'}")
    module_edges = build_module_graph()
    module_found = cycles(module_edges)
    print(
        f"module-level cycles ({len(module_edges)} edges between modules):",
        "none" if not module_found else "",
    )
    for comp in module_found:
        inside = [
            f"{a} -> {b} ({', '.join(w)})"
            for (a, b), w in sorted(module_edges.items())
            if a in comp and b in comp
        ]
        print("  " + " <-> ".join(comp) + ": " + "; ".join(inside))
    return 1 if found or module_found else 0


if __name__ == "__main__":
    sys.exit(main())
