"""The manual cannot rot (issue 38): every Python block of the README and the guides (every page of
the site's Guides section) runs, every ``mnemo`` command line in their shell blocks parses with
today's flags, and the mkdocs site (guides, design, results, API reference from the docstrings)
builds with ``--strict``."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import types
from pathlib import Path

import pytest

from mnemo import argtypes
from mnemo.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
# the README, the home page and every page of the site's Guides section (mkdocs.yml's nav)
PAGES = [
    ROOT / "README.md",
    ROOT / "docs" / "index.md",
    *sorted((ROOT / "docs" / "guides").glob("*.md")),
    *(
        ROOT / "docs" / name
        for name in (
            "benchmarks/notes.md",
            "adding_a_mixer.md",
            "memory.md",
            "interop.md",
            "testing.md",
            "mutation.md",
        )
    ),
]
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
    assert len(PAGES) >= 16
    assert sum(len(_blocks(p, "python")) for p in PAGES) >= 14
    assert sum(len(_commands(b)) for p in PAGES for b in _blocks(p, "bash")) >= 60


def test_every_guide_of_the_site_is_checked():
    """A page added to the nav's Guides section is added here too (or this fails)."""
    nav = (ROOT / "mkdocs.yml").read_text().split("\n  - Guides:\n", 1)[1].split("\n  - ", 1)[0]
    guides = re.findall(r"^ {6}- [^:]+: (\S+\.md)$", nav, re.M)
    assert len(guides) >= 15
    assert {ROOT / "docs" / g for g in guides} <= set(PAGES)


@pytest.mark.parametrize("page", [p for p in PAGES if _blocks(p, "python")], ids=lambda p: p.name)
def test_every_python_block_runs(page, tmp_path, monkeypatch):
    """The blocks of a page run in order in one namespace, in an empty folder."""
    from mnemo.layers import MIXERS

    if "import transformers" in page.read_text():
        pytest.importorskip("transformers")  # the [hf] extra's pages
    monkeypatch.chdir(tmp_path)  # blocks that save write here
    mixers = dict(MIXERS)  # a page that registers a mixer (adding_a_mixer.md) leaves no trace
    # the namespace is a module, as a reader's script would have (dataclasses look theirs up)
    module = types.ModuleType("__docs__")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    try:
        for i, block in enumerate(_blocks(page, "python")):
            # dont_inherit: the block runs without this file's `from __future__ import annotations`
            code = compile(block, f"{page.name}, python block {i + 1}", "exec", dont_inherit=True)
            exec(code, module.__dict__)
    finally:
        MIXERS.clear()
        MIXERS.update(mixers)


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
