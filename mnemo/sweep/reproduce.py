"""Rebuild a results page from its sweep files: ``mnemo reproduce docs/results/PAGE.md``.

A results page names the sweeps it reports with one directive line each::

    <!-- mnemo:reproduce configs/standard/zoology_equal_state.yaml -->

and keeps the generated part of each between two markers::

    <!-- mnemo:begin zoology_equal_state -->
    ... (the commands, the report's table and claims, the figure) ...
    <!-- mnemo:end zoology_equal_state -->

A ``mnemo continual`` experiment (which is not a sweep: its runs are kept in its ``--out`` folder's
``runs/``) is named by its command line instead; its block is named after the ``--out`` folder
(``continual_retention`` below; ``continual_`` is put in front of a name that lacks it)::

    <!-- mnemo:continual --experiment retention --seeds 3 ... --out docs/results/continual_retention -->

:func:`reproduce_page` runs (or resumes: finished runs are never rerun) every named sweep with
:func:`~mnemo.sweep.runner.run_sweep`, writes its report (:func:`~mnemo.sweep.report.write_report`:
``NAME.md``, ``NAME.json`` and the figures) into the page's folder ``docs/results/PAGE/``, and
replaces the text between the sweep's markers (appending the block at the end of the page the
first time). Everything outside the markers — the claim, the discussion, the verdict in words — is
the author's and is left as it is. The page is written atomically (a temporary file, then a rename).

A ``mnemo probe capacity`` command (:mod:`mnemo.commands.capacity`) is named the same way,
``<!-- mnemo:capacity ARGS -->``; its block is named after its ``--out`` folder as it is.

For a continual line, :func:`mnemo.commands.continual.run` runs or resumes the command (finished
runs whose code is unchanged are read from ``--out/runs/``, :func:`~mnemo.commands.continual.run_key`),
rewrites ``--out``'s ``continual.json``, ``continual.md`` and figures, and the block gets the command,
the tables with the claims (:func:`~mnemo.commands.continual.table`) and the figures.
"""

from __future__ import annotations

import os
import re
import time
from collections import Counter
from pathlib import Path

from .db import SweepDB
from .report import write_report
from .runner import PENDING, default_paths, run_sweep, sweep_plan
from .spec import SweepSpec

DIRECTIVE = re.compile(r"^<!--\s*mnemo:reproduce\s+(\S+)\s*-->\s*$", re.M)
CONTINUAL = re.compile(r"^<!--\s*mnemo:continual\s+(.+?)\s*-->\s*$", re.M)
#: the command lines a page may name besides sweep files: ``<!-- mnemo:KIND ARGS -->``
LINE_KINDS = ("continual", "capacity")


def _line_re(kind: str) -> re.Pattern:
    return re.compile(rf"^<!--\s*mnemo:{kind}\s+(.+?)\s*-->\s*$", re.M)


def _shown(p: str | Path) -> str:
    """``p`` relative to the working directory when it lies below it (as a user types it)."""
    p = Path(p)
    try:
        return p.resolve().relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return p.as_posix()


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- mnemo:begin {name} -->", f"<!-- mnemo:end {name} -->"


def _argv(line: str, kind: str = "continual") -> list[str]:
    import shlex

    return shlex.split(_line_re(kind).fullmatch(line).group(1))


def page_continual(page: str | Path) -> list[tuple[int, list[str]]]:
    """The ``mnemo continual`` command lines a page names (its ``<!-- mnemo:continual ARGS -->``
    lines) as ``(line number, argv)``; ``[]`` when it names none.

    Raises:
        ValueError: a line that does not parse as shell words.
    """
    return page_lines(page, "continual")


def page_lines(page: str | Path, kind: str) -> list[tuple[int, list[str]]]:
    """The ``<!-- mnemo:KIND ARGS -->`` lines of ``page`` (``kind`` one of :data:`LINE_KINDS`:
    ``continual`` for ``mnemo continual``, ``capacity`` for ``mnemo probe capacity``) as
    ``(line number, argv)``; ``[]`` when it names none.

    Raises:
        ValueError: an unknown ``kind``; a line that does not parse as shell words.
    """
    import shlex

    if kind not in LINE_KINDS:
        raise ValueError(f"kind must be one of {LINE_KINDS}, got {kind!r}")
    page = Path(page)
    text = page.read_text(encoding="utf-8")
    out = []
    for m in _line_re(kind).finditer(text):
        line = text[: m.start()].count("\n") + 1
        try:
            out.append((line, shlex.split(m.group(1))))
        except ValueError as e:
            raise ValueError(f"{page}:{line}: the mnemo:{kind} line does not parse ({e})") from None
    return out


def page_sweeps(page: str | Path) -> list[Path]:
    """The sweep files a page names (its ``<!-- mnemo:reproduce PATH -->`` lines), resolved
    against the page's folder and its parents (the page's own checkout), else against the working
    directory: the same page names the same files from any working directory. ``[]`` for a page
    that names only commands (``mnemo continual``, ``mnemo probe capacity``: :func:`page_lines`).

    Raises:
        FileNotFoundError: the page, or a sweep file it names, does not exist.
        ValueError: the page names no sweep and no continual command, or is not UTF-8 text.
    """
    page = Path(page)
    if not page.is_file():
        raise FileNotFoundError(f"page: {page} is not a file (a results page, e.g. docs/results/moe.md)")
    try:
        text = page.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"page: {page} is not a UTF-8 text file (byte {e.start}: {e.reason}); give a markdown results "
            "page such as docs/results/moe.md"
            + (" (a sweep database is read by `mnemo report`)" if page.suffix in (".sqlite", ".db") else "")
        ) from None
    found = []
    for m in DIRECTIVE.finditer(text):
        raw = Path(m.group(1))
        candidates = (
            [raw] if raw.is_absolute() else [*(p / raw for p in page.resolve().parents), Path.cwd() / raw]
        )
        hit = next((c for c in candidates if c.is_file()), None)
        if hit is None:
            line = text[: m.start()].count("\n") + 1
            raise FileNotFoundError(
                f"{page}:{line}: the sweep file {raw} does not exist (looked above the page and in the "
                "working directory)"
            )
        found.append(Path(_shown(hit)))
    if not found and not any(_line_re(k).search(text) for k in LINE_KINDS):
        raise ValueError(
            f"{page} names no sweep: add one line `<!-- mnemo:reproduce configs/....yaml -->` per sweep "
            "whose table the page reports (or `<!-- mnemo:continual ARGS -->` per mnemo continual command, "
            "`<!-- mnemo:capacity ARGS -->` per mnemo probe capacity command)"
        )
    return found


def _pending(plan) -> dict[str, int]:
    """``{state: count}`` of the runs of a :func:`sweep_plan` still to train."""
    return dict(Counter(state for _, state in plan if state in PENDING))


def _pending_text(pending: dict[str, int]) -> str:
    n = sum(pending.values())
    what = {"todo": "not run yet", "failed": "failed", "waiting": "waiting for their held-out seed"}
    parts = ", ".join(f"{k} {what[s]}" for s, k in sorted(pending.items()))
    return f"{n} run(s) of the sweep have not finished ({parts})"


def _replace_block(text: str, name: str, block: str, page: Path, after: int | None = None) -> str:
    """``text`` with sweep ``name``'s block replaced by ``block``; a page without the block gets it
    at its end, or below line ``after`` (1-based: a continual line's own) when that is given."""
    begin, end = _markers(name)
    for mark in (begin, end):
        second = text.find(mark, text.find(mark) + 1) if mark in text else -1
        if second >= 0:
            raise ValueError(
                f"{page}:{text[:second].count(chr(10)) + 1}: a second `{mark}`: sweep {name!r} may have "
                "one generated block (only one would be rewritten, the other would go stale); delete the "
                "extra block"
            )
    i, j = text.find(begin), text.find(end)
    if i < 0 and j < 0:
        if after is not None:
            lines = text.split("\n")
            lines[after:after] = ["", begin, block, end]
            return "\n".join(lines)
        return text.rstrip("\n") + f"\n\n{begin}\n{block}\n{end}\n"
    if i < 0 or j < i:
        raise ValueError(
            f"{page}: the markers of sweep {name!r} are broken (need `{begin}` before `{end}`); fix them by "
            "hand or delete both to have the block appended"
        )
    return text[:i] + f"{begin}\n{block}\n" + text[j:]


def _refuse_foreign_outputs(page: Path, folder: Path, text: str, specs) -> None:
    """``folder`` (``docs/results/PAGE/``) receives each sweep's ``NAME.md``, ``NAME.json`` and
    ``NAME_*.png``: never into a training run's folder, and never over files of those names that
    an earlier call did not write (the page has no generated block of that sweep yet).

    Raises:
        ValueError: naming the folder or the files (or the file where the folder goes), before
            anything is trained or written.
    """
    from ..argtypes import is_run_folder

    if folder.exists() and not folder.is_dir():
        raise ValueError(
            f"{page}: its figures and JSON go to the folder {folder}, which is a file: rename the page or "
            "move the file"
        )
    if is_run_folder(folder):
        raise ValueError(
            f"{page}: its figures and JSON go to {folder}, which is a training run's folder (they would mix "
            "with the run's files): rename the page or move the run"
        )
    for _, spec in specs:
        if _markers(spec.name)[0] in text:
            continue  # the page's own earlier output: replaced, as the block says
        clash = [folder / f"{spec.name}.{ext}" for ext in ("md", "json")]
        clash = [p for p in clash if p.exists()] + sorted(folder.glob(f"{spec.name}_*.png"))
        if clash:
            raise ValueError(
                f"{page}: sweep {spec.name!r} has no generated block on the page yet, but "
                f"{', '.join(map(str, clash))} exist: reproduce would replace files it did not write; "
                "move them away first"
            )


def _checkout(page: Path) -> Path | None:
    """The page's checkout: its nearest parent holding ``pyproject.toml`` or ``.git``."""
    return next(
        (p for p in page.resolve().parents if (p / "pyproject.toml").is_file() or (p / ".git").exists()), None
    )


#: a generated block's command line (``mnemo:continual`` and ``mnemo:capacity`` blocks)
_BLOCK_COMMAND = re.compile(r"^(?:OMP_NUM_THREADS=\S+ )?mnemo (?:continual|probe capacity) (.+)$", re.M)


def _block_out(page: Path, text: str, name: str) -> Path | None:
    """The folder the page's existing block ``name`` was made for: the ``--out`` of the command it
    shows, read as a page line's (``~`` expanded, a relative one against the page's checkout);
    ``None`` when the page has no such block or its command does not say."""
    import shlex

    begin, end = _markers(name)
    if begin not in text or end not in text:
        return None
    m = _BLOCK_COMMAND.search(text[text.index(begin) : text.index(end)])
    try:
        argv = shlex.split(m.group(1)) if m else []
    except ValueError:
        return None
    out = None
    for i, a in enumerate(argv):  # (argparse: the last --out wins)
        if a == "--out" and i + 1 < len(argv):
            out = argv[i + 1]
        elif a.startswith("--out="):
            out = a[len("--out=") :]
    if not out:
        return None
    path = Path(out).expanduser()
    return path if path.is_absolute() else (_checkout(page) or Path.cwd()) / path


def _refuse_foreign_results(page: Path, job: dict, module, text: str) -> None:
    """A command line's ``--out`` that holds results this run would replace and that are not the
    line's command's (``module.foreign_results``), while the page has no generated block made for
    that folder: they are not the page's own. (A block of the line's name made for the same folder
    means an earlier version of the line wrote them: replaced, as the block says; results of the
    very same command are adopted.)

    Raises:
        ValueError: naming the page, the line, the folder and why, before anything runs.
    """
    made_for = _block_out(page, text, job["name"])
    if made_for is not None and made_for.resolve() == Path(job["out"]).resolve():
        return
    why = module.foreign_results(page, job)
    if why is not None:
        raise ValueError(
            f"{page}:{job['line']}: the page has no generated block made for {_shown(job['out'])} yet, "
            f"but {why}: reproduce would replace results it did not write; move them away first, or "
            "give the line another --out"
        )


def reproduce_page(
    page: str | Path,
    *,
    run: bool = True,
    jobs: int = 1,
    threads: int | None = 1,
    progress: bool = True,
    partial: bool = False,
    only: list[str] | None = None,
    log=print,
    continual=None,
    capacity=None,
) -> dict:
    """Run or resume every sweep ``page`` names, then rewrite its generated blocks and figures.

    Args:
        page: a markdown results page with ``<!-- mnemo:reproduce PATH -->`` lines and/or
            ``<!-- mnemo:continual ARGS -->`` lines (those are run after the sweeps; their
            ``report`` and ``counts`` are ``None``).
        continual: what runs and writes a ``mnemo:continual`` line's block: the module
            :mod:`mnemo.commands.continual` (its ``page_jobs``, ``check_page_job`` and
            ``page_block``; passed in, since this layer does not import the commands); a page with
            such lines and no ``continual`` is refused.
        capacity: the same for ``<!-- mnemo:capacity ARGS -->`` lines (``mnemo probe capacity``):
            the module :mod:`mnemo.commands.capacity`.
        run: ``False`` rebuilds the page from the databases as they are (no training).
        jobs, threads: worker processes and torch threads each (:func:`run_sweep`).
        progress: a progress bar per sweep. log: where progress lines go.
        partial: with ``run=False``, write the page even when a sweep has runs left to train
            (its block then opens with a **Partial** line counting them); without it that is an
            error and the page is left as it is.
        only: the names of the sweeps (or command lines' blocks, named after their ``--out``) to run and
            rewrite (default: every one the page names); the page's other blocks are left as they are.

    The page reports exactly the runs each sweep file defines as it reads now
    (:func:`~mnemo.sweep.runner.sweep_plan`): runs that the database holds under the same sweep
    name but that the file no longer defines (an edited file, another file with the same
    ``name``) are left out, and the log says how many; its claims, seeds and held-out seed are the
    file's as it reads now too, not those the database stored when it last ran. A sweep still
    missing runs after this call (a failed run; ``run=False`` with ``partial``) gets the **Partial**
    line in its block.
    Returns:
        ``{sweep name: {"counts": run_sweep's counts or None, "report": write_report's entry,
        "elapsed_s": seconds this call spent in the sweep, "pending": {state: runs} still to
        train}}``.
    Raises:
        FileNotFoundError: the page, a sweep file, or (``run=False``) a sweep's database is missing.
        ValueError: the page names no sweep, or its markers are broken; a sweep file is invalid;
            ``only`` names a sweep the page does not (or none at all);
            ``run=False`` without ``partial`` and a sweep has runs left to train (checked for every
            sweep before anything is written).
    """
    page = Path(page)
    files = page_sweeps(page)
    folder = page.with_suffix("")  # docs/results/PAGE/ holds the figures and the JSON
    out: dict = {}
    text = page.read_text()
    specs = [(path, SweepSpec.load(path)) for path in files]
    handlers = {"continual": continual, "capacity": capacity}
    for kind, module in handlers.items():
        if module is None and page_lines(page, kind):
            raise ValueError(
                f"{page} has mnemo:{kind} lines: rebuild it with the `mnemo reproduce` command (or pass "
                f"{kind}=mnemo.commands.{kind})"
            )
    cjobs = [
        {**job, "kind": kind}
        for kind, module in handlers.items()
        if module is not None
        for job in module.page_jobs(page)
    ]
    seen = Counter(j["name"] for j in cjobs) + Counter(spec.name for _, spec in specs)
    twice = sorted(n for n, k in seen.items() if k > 1)
    if twice:
        raise ValueError(
            f"{page}: two of its sweeps or command lines write the block {', '.join(map(repr, twice))} "
            "(a line's block is named after its --out folder): give each its own --out"
        )
    if only is not None:
        names = [spec.name for _, spec in specs] + [j["name"] for j in cjobs]
        unknown = [n for n in only if n not in names]
        if unknown or not only:
            raise ValueError(
                f"--sweep: {', '.join(map(repr, unknown)) or 'no name given'}; {page} names the sweeps "
                f"{', '.join(map(repr, names))}"
            )
        specs = [(path, spec) for path, spec in specs if spec.name in only]
        cjobs = [j for j in cjobs if j["name"] in only]
    _refuse_foreign_outputs(page, folder, text, specs)
    for job in cjobs if not run else []:  # every selected line checked before anything is written
        handlers[job["kind"]].check_page_job(page, job)
    for job in cjobs if run else []:
        _refuse_foreign_results(page, job, handlers[job["kind"]], text)
    if not run:  # every sweep checked before any page or report file is written
        for path, spec in specs:
            db, _ = default_paths(spec, path)
            if not Path(db).is_file():
                raise FileNotFoundError(
                    f"{path}: its database {_shown(db)} does not exist; run the sweep (drop --no-run), or, "
                    "for a sweep stored under another working directory by an earlier version, run from there"
                )
            pending = _pending(sweep_plan(spec, db))
            if pending and not partial:
                raise ValueError(
                    f"{path}: {_pending_text(pending)} in {db}, so the page would report a partial sweep "
                    f"(`mnemo sweep {_shown(path)} --list` lists them); run them (drop --no-run), or add "
                    "--partial to write the page marked as partial; the page was left as it is"
                )
    for path, spec in specs:
        db, run_dir = default_paths(spec, path)
        counts, t0 = None, time.perf_counter()
        if run:
            counts = run_sweep(spec, db, run_dir, jobs=jobs, threads=threads, progress=progress, log=log)
        elapsed = time.perf_counter() - t0
        plan = sweep_plan(spec, db)
        pending = _pending(plan)
        ids = {r.run_id for r, _ in plan}
        with SweepDB(db, create=False) as handle:
            other = sum(r["run_id"] not in ids for r in handle.rows(spec.name))
        if other:
            log(
                f"{spec.name}: {db} holds {other} run(s) of sweep {spec.name!r} that {path} does not "
                "define (an earlier version of the file, or another file with this name); the page leaves "
                "them out"
            )
        reports = write_report(db, folder, sweep=spec.name, metric=spec.metric, run_ids=ids, meta=spec.meta())
        report = reports[spec.name]
        figures = [f for f in report["files"] if str(f).endswith(".png")]
        rel = os.path.relpath(folder, page.parent)
        block = "\n".join(
            [
                f"*Generated by `mnemo reproduce {_shown(page)}` from `{_shown(path)}`; "
                "edits between these markers are replaced.* Commands (the same, step by step):",
                "",
                "```bash",
                f"OMP_NUM_THREADS=1 mnemo sweep {_shown(path)} --jobs {jobs} --threads {threads or 1}",
                f"mnemo report {_shown(db)} --metric {spec.metric}",
                "```",
                "",
                *(
                    [
                        f"**Partial:** {_pending_text(pending)} when this block was written; the table "
                        "reports the finished runs only.",
                        "",
                    ]
                    if pending
                    else []
                ),
                report["markdown"].replace("## sweep", "#### sweep", 1).rstrip(),
                "",
                *(f"![{spec.name}]({rel}/{Path(f).name})" for f in figures),
            ]
        )
        text = _replace_block(text, spec.name, block, page)
        out[spec.name] = {"counts": counts, "report": report, "elapsed_s": elapsed, "pending": pending}
        if pending:
            log(f"{spec.name}: partial: {_pending_text(pending)}")
    for job in cjobs:
        t0 = time.perf_counter()
        block = handlers[job["kind"]].page_block(
            page, job, train=run, progress=progress, log=log, threads=threads
        )
        # a first block goes below its line (found again: earlier blocks have moved it)
        line_re = _line_re(job["kind"])
        at = next(
            i + 1
            for i, x in enumerate(text.split("\n"))
            if line_re.fullmatch(x) and _argv(x, job["kind"]) == job["argv"]
        )
        text = _replace_block(text, job["name"], block, page, after=at)
        out[job["name"]] = {
            "counts": None,
            "report": None,
            "elapsed_s": time.perf_counter() - t0,
            "pending": {},
        }
    tmp = page.with_name(f".{page.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, page)
    log(f"rewrote {page} ({', '.join(out)})" + (f"; figures and JSON in {folder}/" if specs else ""))
    return out
