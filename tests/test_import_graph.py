"""``scripts/import_graph.py``: no import circle in ``mnemo/``, between packages or between modules
(function-level imports included), and the check finds one when there is one."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "import_graph.py"


def _load():
    spec = importlib.util.spec_from_file_location("import_graph", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_cycle_between_packages_or_modules(capsys):
    graph = _load()
    assert graph.main([]) == 0
    out = capsys.readouterr().out
    assert "cycles: none" in out and "module-level cycles (" in out and "): none" in out
    assert graph.cycles(graph.build_module_graph()) == []


def test_a_lazy_module_cycle_is_found(tmp_path, monkeypatch):
    """Two modules of one package that import each other, one of them inside a function: a cycle
    between modules (the package graph cannot see it)."""
    graph = _load()
    pkg = tmp_path / "mnemo" / "data"
    pkg.mkdir(parents=True)
    (tmp_path / "mnemo" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text("def f():\n    from .b import g\n    return g()\n")
    (pkg / "b.py").write_text("from .a import f\n\ndef g():\n    return 1\n")
    monkeypatch.setattr(graph, "ROOT", tmp_path / "mnemo")
    edges = graph.build_module_graph()
    assert ("mnemo.data.a", "mnemo.data.b") in edges and ("mnemo.data.b", "mnemo.data.a") in edges
    assert graph.cycles(edges) == [["mnemo.data.a", "mnemo.data.b"]]
    assert graph.main([]) == 1
