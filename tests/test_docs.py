"""The manual cannot rot (issue 38): every Python block of the README and the guides (every page of
the site's Guides section) runs, every ``mnemo`` command line in their shell blocks parses with
today's flags, and the mkdocs site (guides, design, results, API reference from the docstrings)
builds with ``--strict``."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shlex
import shutil
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


# ------------------------------------------------------------------------------------------------
# the shell blocks' commands, run at small sizes


#: flags appended to a command (argparse keeps the last value of a flag), by sub-command: the
#: documented command runs as written, only smaller
SMALL = {
    "train": ["--steps", "2", "--eval-interval", "2", "--eval-batches", "1", "--batch-size", "4"]
    + ["--sample-tokens", "0", "--no-progress"],
    "generate": ["--max-new-tokens", "8"],
    "eval": ["--max-batches", "1", "--batch-size", "2"],
    "probe circuits": ["--length", "32", "--batch", "2"],
    "probe ablate": ["--length", "32", "--batch", "2", "--draws", "1"],
    "probe timescales": ["--tokens", "512"],
    "probe spectrum": ["--tokens", "512"],
    "probe capacity": [
        "--pairs",
        "4",
        "--passes",
        "1",
        "--seeds",
        "3",
        "--streams",
        "2",
        "--theta-grid",
        "0.1",
    ]
    + ["--no-progress"],
    "verify": ["--quick"],
    # two of the nine models (one CMS chain, HOPE's levels): every model's runs are
    # tests/nested/test_continual.py's; here the page's command is the subject (36 runs took 55 s)
    "continual": ["--seeds", "1", "--steps", "2", "--workers", "1", "--no-progress"]
    + ["--models", "cms-2,hope-3", "--eval-streams", "16"],
    # the benchmark suites read different flags (and refuse the others)
    "bench ops": ["--lengths", "64", "--repeats", "1", "--dtypes", "fp32"],
    "bench decode": ["--contexts", "64", "--decode-steps", "2", "--decode-processes", "1"]
    + ["--d-model", "16", "--n-layers", "1"],
    "bench models": ["--model-shapes", "32x1", "--gen-batches", "1", "--prompt-len", "8", "--gen-tokens", "2"]
    + ["--d-model", "16", "--n-layers", "1"],
    "bench roofline": ["--model-shapes", "32x1", "--gen-batches", "1", "--d-model", "16", "--n-layers", "1"],
}
#: what a reader's machine has and this one does not (each a reason a command is parsed, not run)
ELSEWHERE = [
    (lambda a: any(w.startswith(("~/", "/shared")) for w in a), "a path on the reader's machine"),
    (lambda a: "cuda" in a or "--fsdp" in a, "needs a CUDA device or torchrun's processes"),
    (
        lambda a: a[0] == "bench" and ("--compile" in a or _suite(a) in ("peers", "all")),
        "a benchmark of every suite or of torch.compile: minutes by design (tests/test_bench_*.py)",
    ),
    (lambda a: a[0] == "harness", "needs the reader's lm-eval task folder"),
    (lambda a: a[0] == "sweep", "a whole sweep: its file sets the sizes (tests/tasks/test_sweep*.py)"),
    (lambda a: "corpus.jsonl" in a, "needs the reader's own corpus file"),
    (lambda a: a[:2] == ["verify", "--third-party"], "a third-party kernel check (tests/test_verify.py)"),
]


def _suite(argv: list[str]) -> str:
    return argv[argv.index("--suite") + 1] if "--suite" in argv[:-1] else "ops"


def _small(argv: list[str]) -> list[str]:
    cmd = " ".join(argv[:2]) if argv[0] == "probe" else argv[0]
    if argv[0] == "bench":
        cmd = f"bench {_suite(argv)}"
    extra = list(SMALL.get(cmd, []))
    if cmd in ("bench models", "bench roofline", "bench decode") and "--models" not in argv:
        extra += ["--models", "gla"]  # (every model of the registry, or seven, by default)
    if cmd == "bench models" and "--peers" not in argv:
        extra += ["--peers", "none"]
    if argv[0] == "train" and not {"--resume", "--task", "--config"} & set(argv):
        # a text run at 32 tokens a row (HOPE's runs took 5-12 s at the presets' 128, 2-3 s here);
        # not a task's (its long-length evaluation walks windows of the training length: slower)
        extra += ["--seq-len", "32"]
    if argv[0] == "train" and not {"--resume", "--config", "--init-from", "--d-model"} & set(argv):
        # a preset's model at width 32, its layers and mixers as they are (hope_long's 2 steps took
        # 3.5 s at its 128, writing a 99 MB checkpoint; 1.3 s here); a width the page sets, a config
        # file's and a run's own (resumed, fine-tuned) are kept
        extra += ["--d-model", "32"]
    if argv[0] == "train" and "--resume" in argv:
        # two steps more than the run it resumes where the page asks for more steps (and says how
        # the schedule changes); as written otherwise (a finished run's resume ends at once)
        extra = extra[2:] if "--steps" not in argv else ["--steps", "4", *extra[2:]]
    if argv[0] == "eval" and _is_task_run(_value(argv, "--checkpoint")):
        extra = ["--num-samples", "4", "--batch-size", "2"]  # (a task's fresh draws, not text batches)
    if argv[:2] == ["verify", "--list"]:
        extra = []
    return argv + extra


def _value(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv[:-1] else None


def _is_task_run(folder: str | None) -> bool:
    """Whether a run (any of its checkpoints) or a checkpoint folder was trained on a task."""
    cfgs = sorted(Path(folder or "-").glob("**/train_config.json"))
    return bool(cfgs) and bool(json.loads(cfgs[-1].read_text()).get("task"))


def _inputs(argv: list[str]) -> list[str]:
    """The runs or files a command reads (``--checkpoint``, ``--init-from``, ``export``'s source)."""
    out = [v for f in ("--checkpoint", "--init-from") if (v := _value(argv, f))]
    if argv[0] == "export":
        out += [w for w in argv[1:] if not w.startswith("-")][:1]
    return out


def _made_by(argv: list[str]) -> list[str]:
    """The folders or files a command writes (its ``--out``; ``convert``/``export``'s destination)."""
    out = [argv[i + 1] for i, w in enumerate(argv[:-1]) if w == "--out"]
    if argv[0] in ("convert", "export"):
        out += [w for w in argv[1:] if not w.startswith("-")][1:2]
    return out


#: sub-commands whose outcome is a function of their arguments alone (they read nothing the page's
#: folder holds): one that two pages run alike (``mnemo verify``, README and testing.md, 10-18 s;
#: ``tokenizer train``, checkpoints.md and interop.md; the ops suite) runs once in a session,
#: :func:`_once`
ONCE = ("verify", "tokenizer", "bench")


def _key(argv: list[str]) -> str | None:
    """The command as the parser reads it (flags repeated by :data:`SMALL` resolved, defaults filled
    in): equal keys, equal commands; ``None`` where it does not parse (it then runs, and says why)."""
    try:
        ns = build_parser().parse_args(argv)
    except SystemExit:
        return None
    return json.dumps({k: getattr(v, "__qualname__", str(v)) for k, v in vars(ns).items()}, sort_keys=True)


def _run(argv: list[str], capsys) -> tuple[int, str]:
    """``mnemo ARGV`` in this process: its exit code and the end of its stderr."""
    from mnemo.cli import main

    code = main(argv)
    return code, capsys.readouterr().err[-2000:]


def _once(argv: list[str], run, shared: Path) -> tuple[int, str]:
    """``run()``'s ``(exit code, stderr)`` for the :data:`ONCE` command ``argv``, and the files it
    wrote in the page's folder (``--out``, ``--json``): from the first page of the session that ran
    the same command (copied into this page's folder), else run here and kept in ``shared`` (the
    session's folder, which both xdist workers see; a lock makes the second wait for the first)."""
    from filelock import FileLock  # (torch's dependency)

    key = _key(argv)
    if key is None:
        return run()
    entry = shared / "docs-once" / hashlib.sha1(key.encode()).hexdigest()[:16]
    entry.mkdir(parents=True, exist_ok=True)
    outputs = [*_made_by(argv), *([v] if (v := _value(argv, "--json")) else [])]
    outputs = [out for out in outputs if not Path(out).is_absolute()]  # (the page's folder's only)
    with FileLock(str(entry) + ".lock"):
        done = entry / "result.json"
        if done.is_file():
            for out in outputs:
                kept = entry / "files" / out
                if kept.is_dir():
                    shutil.copytree(kept, out)
                elif kept.is_file():
                    Path(out).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(kept, out)
            code, err = json.loads(done.read_text())
            return code, err
        code, err = run()
        for out in outputs:
            if Path(out).is_dir():
                shutil.copytree(out, entry / "files" / out)
            elif Path(out).is_file():
                (entry / "files" / out).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(out, entry / "files" / out)
        done.write_text(json.dumps([code, err]))
        return code, err


@pytest.fixture
def decode_children_in_process(monkeypatch):
    """The decode suite starts one ``python -c CODE`` child per model and context (~4.5 s of imports
    each; streaming.md's command started four): here each child's CODE runs in this process, its
    stdout captured, as the child would, except that its ``tune_malloc()`` (glibc's settings for the
    child's lifetime) leaves this process's allocator as it is (tests/test_cli.py's
    ``test_bench_decode_suite_runs`` starts a real child)."""
    import contextlib
    import io

    import torch

    import mnemo.bench.decode as decode
    import mnemo.runtime

    monkeypatch.setattr(mnemo.runtime, "tune_malloc", lambda *a, **k: True)

    def run(cmd, **kw):
        assert cmd[:2] == [sys.executable, "-c"], cmd
        out = io.StringIO()
        with torch.random.fork_rng(), contextlib.redirect_stdout(out):  # (it seeds torch)
            exec(cmd[2], {})
        return subprocess.CompletedProcess(cmd, 0, stdout=out.getvalue(), stderr="")

    monkeypatch.setattr(decode, "subprocess", types.SimpleNamespace(run=run))


@pytest.mark.parametrize(
    "page", [p for p in PAGES if any(_commands(b) for b in _blocks(p, "bash"))], ids=lambda p: p.name
)
def test_every_command_line_runs_at_small_size(
    page, tmp_path, tmp_path_factory, monkeypatch, capsys, decode_children_in_process
):
    """The page's ``mnemo`` commands run in order, as a reader would type them, in an empty folder
    (``configs/`` linked in), each with :data:`SMALL`'s flags appended; exit 0 is required. A
    command that needs what only a reader's machine has (:data:`ELSEWHERE`), or the output of
    such a command, is only parsed (the test above). Every page runs at least one command. A
    :data:`ONCE` command another page ran alike in this session is not run again: its exit code
    and files are that run's."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # (the session's folder; each worker's basetemp is a folder in it)
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    monkeypatch.chdir(tmp_path)
    missing: dict[str, str] = {}  # outputs of the commands not run here -> why
    ran, skipped = [], []
    for block in _blocks(page, "bash"):
        for argv in _commands(block):
            if not argv or argv[0] in ("--help", "report"):
                continue  # (report reads a sweep's database: the sweep is not run here)
            why = next((w for test, w in ELSEWHERE if test(argv)), None)
            needs = next((missing[w] for w in argv if w in missing), None)
            absent = [w for w in _inputs(argv) if not Path(w).exists()]
            if absent and not (why or needs):
                needs = f"{absent[0]} is a run the page assumes, made by no command on it"
            if why or needs:
                skipped.append((argv, why or f"its input comes from a command not run here ({needs})"))
                for out in _made_by(argv):
                    missing[out] = why or needs
                continue
            small = _small(argv)
            run = functools.partial(_run, small, capsys)
            code, err = _once(small, run, shared) if argv[0] in ONCE else run()
            assert code == 0, f"{page.name}: `mnemo {' '.join(small)}` exited {code}:\n{err}"
            ran.append(argv)
    assert ran, f"{page.name}: no command of the page ran here (skipped: {skipped})"


def test_the_mutation_pages_show_command_shows_its_mutant(capsys):
    """docs/mutation.md's ``--show ID`` example names a mutant that exists (the other commands of
    that page run the targeted tests once per mutant: minutes by design, not run here)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("mutation_script", ROOT / "scripts" / "mutation.py")
    script = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = script  # (its dataclasses look their module up)
    spec.loader.exec_module(script)
    shows = [
        words[words.index("--show") + 1]
        for block in _blocks(ROOT / "docs" / "mutation.md", "bash")
        for line in block.splitlines()
        if "--show" in (words := shlex.split(line, comments=True))
    ]
    assert shows, "docs/mutation.md shows no --show example"
    for ident in shows:
        assert script.main(["--show", ident]) == 0, (
            f"docs/mutation.md: --show {ident!r} names no mutant now (the source moved): take an id "
            f"from `python scripts/mutation.py --files {ident.split(':')[0]} --list --no-coverage`"
        )
        diff = capsys.readouterr().out
        assert diff.startswith(f"--- a/{ident.split(':')[0]}") and "\n+" in diff


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
