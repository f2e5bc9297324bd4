"""The manual cannot rot (issue 38): every Python block of the README and the guides runs, every
``mnemo`` command line in their shell blocks parses with today's flags, and the mkdocs site
(guides, design, results, API reference from the docstrings) builds with ``--strict``."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from mnemo import argtypes
from mnemo.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "docs" / "index.md", *sorted((ROOT / "docs" / "guides").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def _blocks(page: Path, lang: str) -> list[str]:
    return [m.group(2) for m in FENCE.finditer(page.read_text()) if m.group(1) == lang]


def _commands(block: str) -> list[list[str]]:
    """The ``mnemo`` invocations of a shell block: continuation lines joined, comments dropped,
    ``torchrun ... -m mnemo`` and ``python -m mnemo`` included; what follows ``&&`` is split off."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        for part in line.split("&&"):
            words = shlex.split(part, comments=True)
            for i, w in enumerate(words):
                if w == "mnemo" and (i == 0 or words[i - 1] == "-m" or "=" in words[i - 1]):
                    out.append(words[i + 1 :])
                    break
    return out


def test_the_pages_hold_code_to_check():
    assert len(PAGES) >= 10
    assert sum(len(_blocks(p, "python")) for p in PAGES) >= 4
    assert sum(len(_commands(b)) for p in PAGES for b in _blocks(p, "bash")) >= 40


@pytest.mark.parametrize("page", [p for p in PAGES if _blocks(p, "python")], ids=lambda p: p.name)
def test_every_python_block_runs(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # blocks that save write here
    namespace: dict = {"__name__": "__docs__"}
    for i, block in enumerate(_blocks(page, "python")):
        exec(compile(block, f"{page.name}, python block {i + 1}", "exec"), namespace)


@pytest.mark.parametrize("page", [p for p in PAGES if _blocks(p, "bash")], ids=lambda p: p.name)
def test_every_command_line_parses_with_todays_flags(page, monkeypatch):
    """Flags, choices and values are checked by the real parser; the paths of the examples
    (``runs/gla``, ``~/models/...``) need not exist here, so the path kinds accept any text."""
    for kind in (
        argtypes.ExistingFile,
        argtypes.ExistingDir,
        argtypes.OutDir,
        argtypes.OutFile,
        argtypes.OutPath,
    ):
        monkeypatch.setattr(kind, "__call__", lambda self, text: text)
    monkeypatch.setattr(argtypes.Device, "__call__", lambda self, text: text)  # --device cuda examples
    parser = build_parser()
    for block in _blocks(page, "bash"):
        for argv in _commands(block):
            if argv[:1] in (["--help"], []):
                continue
            try:
                parser.parse_args(argv)
            except SystemExit as e:
                pytest.fail(f"{page.name}: `mnemo {' '.join(argv)}` no longer parses (exit {e.code})")


def test_the_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    site = tmp_path / "site"
    for page in (
        "index.html",
        "guides/streaming/index.html",
        "reference/ops/index.html",
        "DESIGN/index.html",
    ):
        assert (site / page).is_file(), page
    # the API reference is generated from the docstrings
    assert "gated_delta_rule" in (site / "reference" / "ops" / "index.html").read_text()
