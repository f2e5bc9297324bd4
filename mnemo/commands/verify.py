"""``mnemo verify``: run the equivalence contract (:mod:`mnemo.testing`) and print a pass/FAIL table.

By default every spec of mnemo's own ops (:data:`mnemo.testing.SPECS`: each fast form against the
op's ``mode="recurrent"`` token loop) and, when fla-core is installed, fla-core's pure-PyTorch
reference functions against mnemo's recurrent references. A backend forced by ``MNEMO_BACKEND``
runs the fast forms it can serve; each row then says which backends served its calls (counted in the
dispatch log), and a check the forced backend served no call of is listed as n/a: a form it cannot
serve, an op without a backend table (selective_scan), a token-loop row (run on mnemo's PyTorch
code); such a check that failed still counts as failed. Exit status: 0 when every check
passed, 1 when one failed, 2 for a usage error (an ``--ops`` or ``--checks`` pattern that matches
nothing, a ``--json`` path that cannot be written, or an explicitly requested third-party package
that is missing — reported in one line), 3 when a forced backend served none of the checked calls
(nothing was verified on it: e.g. ``MNEMO_BACKEND=fla`` without fla-core, or on a CPU without
``TRITON_INTERPRET=1``; a warning line says so).

    mnemo verify                          # everything
    mnemo verify --quick --ops 'gla*'     # fewer lengths, fast gradcheck; gated linear attention only
    mnemo verify --third-party fla --ops gated_delta_rule
"""

from __future__ import annotations

import argparse
import fnmatch
import math
import sys
import time
from pathlib import Path

from .. import argtypes as kinds

HELP = "check every op against its reference (the equivalence contract) and print a pass/FAIL table"
#: ``mnemo verify --help``: the module docstring's usage (its first paragraph said HELP again)
_DESCRIPTION = (
    "Check every op against its reference (the equivalence contract) and print a pass/FAIL table. "
    + kinds.plain_text(__doc__.split("\n\n", 1)[1].split("\n\n")[0].replace("\n", " "))
)


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ops",
        type=kinds.Text("comma-separated names or patterns"),
        help="comma-separated names or glob patterns of the specs to check, matched against the spec "
        "name, the op name and the recurrence it claims (e.g. 'gla*', 'gated_delta_rule'); default all",
    )
    p.add_argument(
        "--checks",
        type=kinds.Text("comma-separated patterns"),
        help="comma-separated glob patterns of check names (e.g. 'forms*,grad*'); default all",
    )
    p.add_argument(
        "--third-party",
        default="auto",
        choices=["auto", "fla", "none"],
        help="also check a third-party package's references against mnemo's: 'fla' (fla-core's "
        "fla/ops/*/naive.py functions), 'auto' (default: fla when installed) or 'none'",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="one or two lengths per check instead of six, gradcheck in its fast mode",
    )
    p.add_argument("--list", action="store_true", help="list the specs that would be checked and exit")
    p.add_argument(
        "--json", metavar="PATH", type=kinds.OutFile(suffix=".json"), help="also write the rows as JSON"
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace the --json file if it exists (default: refuse)"
    )
    p.add_argument("-v", "--verbose", action="store_true", help="print each row as it finishes")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``verify`` subcommand to an ``argparse`` subparsers object (``set_defaults(func=run)``)."""
    p = subparsers.add_parser("verify", help=HELP, description=_DESCRIPTION)
    _add_arguments(p)
    p.set_defaults(func=run)
    return p


def add_commands(subparsers) -> None:
    """The hook ``mnemo.cli`` calls for each command module (see ``mnemo.cli._COMMAND_MODULES``)."""
    add_parser(subparsers)


def build_parser() -> argparse.ArgumentParser:
    p = kinds.Parser(prog="mnemo verify", description=HELP)
    _add_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """``mnemo verify`` as a function: ``main(["--ops", "gla*"])`` returns the exit status."""
    return run(build_parser().parse_args(argv))


def _keys(spec) -> set[str]:
    from mnemo.testing import get_spec

    keys = {spec.name}
    op = spec.op
    if spec.claims:
        keys.add(spec.claims)
        try:
            op = op or get_spec(spec.claims).op
        except KeyError:
            pass
    if op is not None and getattr(op, "__name__", None):
        keys.add(op.__name__)
    return keys


def _select(specs, patterns):
    if not patterns:
        return list(specs)
    return [s for s in specs if any(fnmatch.fnmatchcase(k, p) for k in _keys(s) for p in patterns)]


def _split(text: str | None) -> list[str]:
    return [t.strip() for t in (text or "").split(",") if t.strip()]


def _row_json(group: str, r, na: bool = False, served: dict | None = None) -> dict:
    """One row of ``--json``: ``status`` is ``"pass"``, ``"FAIL"`` or ``"n/a"`` (a check the forced
    backend served no call of: ``passed`` is then ``None`` and ``message`` the reason); under a
    forced backend ``served`` (``{backend: calls}`` from the dispatch log) says which backends
    served the row's op calls (``{}``: none went through the backend table)."""

    def num(x):
        return None if x is None or not math.isfinite(x) else x

    return {
        "group": group,
        "op": r.op,
        "check": r.check,
        "status": "n/a" if na else "pass" if r.passed else "FAIL",
        "passed": None if na else r.passed,
        "error": num(r.error),
        "tol": num(r.tol),
        "message": r.message,
        **({} if served is None else {"served": dict(served)}),
    }


def _served_text(served: dict) -> str:
    return ", ".join(f"{b} {n}" for b, n in sorted(served.items())) or "- (no backend table)"


def _verbose_widths(specs, quick: bool, patterns: list[str]) -> list[int]:
    """``-v``: the widths of the op, check, result, worst-error and tolerance columns of every row
    line printed as it finishes, fixed before the first one from the names of every selected spec
    and of its planned checks that ``patterns`` (``--checks``; none: all) keep, so the lines of ops
    or checks with names of different lengths line up."""
    from mnemo.testing.contract import plan

    def kept(name: str) -> bool:  # (as run_contract matches them)
        return not patterns or any(
            fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name.split("[")[0], p) for p in patterns
        )

    ops = ["op", *(s.name for s in specs)]
    checks = ["check", *(name for s in specs for name, _ in plan(s, quick) if kept(name))]
    # ("1.0e-05": the width of a formatted error or tolerance; "inf", "0", "-" are shorter)
    return [max(map(len, ops)), max(map(len, checks)), len("result"), len("worst err"), len("1.0e-05")]


def _verbose_line(r, widths: list[int], na: str | None = None, served: str | None = None) -> str:
    """One ``-v`` line of row ``r`` in the columns ``widths`` (:func:`_verbose_widths`): ``op  check
    result  worst err  tol``, then (under a forced backend) ``served`` and, for a failed check, its
    message; ``na``: the row is n/a on the forced backend, said in place of the result columns."""
    from mnemo.testing.contract import _fmt

    cells = [r.op.ljust(widths[0]), r.check.ljust(widths[1])]
    if na is not None:
        return "  ".join(cells + [na]).rstrip()
    cells += [
        ("pass" if r.passed else "FAIL").rjust(widths[2]),
        _fmt(r.error).rjust(widths[3]),
        _fmt(r.tol).rjust(widths[4]),
    ]
    cells += [] if served is None else [served]
    cells += [] if r.passed or not r.message else [r.message]
    return "  ".join(cells).rstrip()


def run(args) -> int:
    """Run the checks chosen by ``args`` (from :func:`add_parser` / :func:`build_parser`), print the
    tables, return the exit status (``--list``: print the chosen specs, and with ``--json`` write
    them as ``[{"group", "spec", "note"}]``)."""
    kinds.refuse_existing(args.json, "--json", args.overwrite)
    for flag, text in (("--ops", args.ops), ("--checks", args.checks)):
        if text is not None and not _split(text):  # ',' or ' ': not "all" by accident
            print(
                f"mnemo verify: {flag}: expected comma-separated names or patterns, got {text!r}",
                file=sys.stderr,
            )
            return 2
    import torch

    from mnemo.testing import Report, format_table, run_contract
    from mnemo.testing import specs as registered
    from mnemo.testing.third_party import ThirdPartyUnavailable, third_party_specs, version

    patterns, checks = _split(args.ops), _split(args.checks)
    groups = [("mnemo", "mnemo's ops: each fast form vs the op's mode='recurrent'", list(registered.SPECS))]

    tp = args.third_party
    if tp != "none":
        name = "fla" if tp == "auto" else tp
        try:
            specs = third_party_specs(name)
        except ThirdPartyUnavailable as e:
            if tp != "auto":
                print(f"mnemo verify: {e}", file=sys.stderr)
                return 2
            print(f"(third-party checks skipped: {e})")
        else:
            title = f"fla-core {version(name)}: fla/ops/*/naive.py vs mnemo's recurrent references"
            groups.append((name, title, specs))

    known = ", ".join(s.name for g in groups for s in g[2])
    every = [s for g in groups for s in g[2]]
    unmatched = [p for p in patterns if not _select(every, [p])]
    if unmatched:  # each pattern must match: a mistyped one would silently check less
        print(
            f"mnemo verify: --ops: {', '.join(map(repr, unmatched))} matches no spec; known: {known}",
            file=sys.stderr,
        )
        return 2
    groups = [(g, title, _select(specs, patterns)) for g, title, specs in groups]
    if checks:
        from mnemo.testing.contract import plan

        rows = {name for g in groups for spec in g[2] for name, _ in plan(spec, args.quick)}
        names = rows | {r.split("[")[0] for r in rows}
        missing = [p for p in checks if not any(fnmatch.fnmatchcase(n, p) for n in names)]
        if missing:
            print(
                f"mnemo verify: --checks: {', '.join(map(repr, missing))} matches no check of the "
                f"selected ops; known: {', '.join(sorted(names - rows))}",
                file=sys.stderr,
            )
            return 2

    if args.list:
        listed = []
        for group, title, specs in groups:
            if specs:
                print(f"# {title}")
                for s in specs:
                    print(f"{s.name:<44} {s.note}")
                    listed.append({"group": group, "spec": s.name, "note": s.note})
        if args.json:
            _write_json(args.json, listed)
        return 0

    import dataclasses
    from collections import Counter

    from mnemo.ops.dispatch import BackendError, current_backend, dispatch_log

    # a forced backend (MNEMO_BACKEND) runs the fast forms it serves; the token-loop reference runs
    # on mnemo's PyTorch code (OpSpec.run). Each row's calls are counted per backend (the dispatch
    # log, read after each row), and a check the forced backend served no call of is listed as n/a
    forced = current_backend()
    if forced != "auto":
        print(
            f"backend forced: {forced} (MNEMO_BACKEND); the checks it served no call of are listed as "
            "n/a (a failed one still counts as failed)"
        )

    def calls() -> Counter:
        out: Counter = Counter()
        for (_, b, _), n in dispatch_log().items():
            out[b] += n
        return out

    served_by: dict[int, dict] = {}  # id(row) -> {backend: calls} of its checks
    mark = [calls()]

    def unserved_row(r) -> bool:
        if forced == "auto":
            return False
        if isinstance(r.exception, BackendError):
            return True
        return r.passed and not served_by.get(id(r), {}).get(forced)

    def note(r) -> None:  # (after each row: count its calls; -v: print it)
        now = calls()
        served_by[id(r)] = {b: n for b, n in (now - mark[0]).items() if n > 0}
        mark[0] = now
        if args.verbose:
            show(r)

    def table(rows) -> str:  # under a forced backend: which backends served each row
        if forced == "auto":
            return format_table(rows)
        lines = format_table([dataclasses.replace(r, message="") for r in rows]).splitlines()
        width = max(len(x) for x in lines)
        out = [lines[0].ljust(width) + "  served by", lines[1].ljust(width) + "  " + "-" * 9]
        for line, r in zip(lines[2:], rows):
            extra = "" if r.passed else "  " + r.message
            out.append(line.ljust(width) + "  " + _served_text(served_by.get(id(r), {})) + extra)
        return "\n".join(out)

    def na_reason(r) -> str:
        if isinstance(r.exception, BackendError):
            return r.message
        return f"not run on {forced!r}: served by {_served_text(served_by.get(id(r), {}))}"

    # -v: each row's line as it finishes, in columns fixed beforehand (a table of one row each
    # would size them by that row's names: the lines of two ops did not line up)
    widths = _verbose_widths([s for g in groups for s in g[2]], args.quick, checks) if args.verbose else []

    def show(r) -> None:  # (-v: an unserved form is said as n/a, as in the summary, not FAIL)
        if unserved_row(r):
            why = "" if isinstance(r.exception, BackendError) else f" ({na_reason(r)})"
            line = _verbose_line(r, widths, na=f"n/a on {forced!r}{why}")
        else:
            served = None if forced == "auto" else _served_text(served_by.get(id(r), {}))
            line = _verbose_line(r, widths, served=served)
        print(line, flush=True)

    served_before = sum(n for (_, b, _), n in dispatch_log().items() if b == forced)
    rc = 0
    summary, rows_json, all_unserved = [], [], []
    t_all = time.perf_counter()
    for group, title, specs in groups:
        if not specs:
            continue
        report, unserved = Report(), []
        t0 = time.perf_counter()
        for spec in specs:
            mark[0] = calls()
            for row in run_contract(spec, quick=args.quick, checks=checks or None, progress=note):
                if unserved_row(row):
                    unserved.append(row)
                else:
                    report.append(row)
        dt = time.perf_counter() - t0
        print(f"\n== {title} (torch {torch.__version__}{', quick' if args.quick else ''})")
        print(table(report))
        if unserved:
            print(
                f"n/a on backend {forced!r} ({len(unserved)} checks): "
                + ", ".join(f"{r.op} {r.check}" for r in unserved)
            )
        n_fail = len(report.failures)
        na = f", {len(unserved)} n/a on {forced!r}" if unserved else ""
        summary.append(
            f"{group}: {len(specs)} ops, {len(report)} checks, {len(report) - n_fail} passed, "
            f"{n_fail} failed{na} ({dt:.1f} s)"
        )
        served_of = (lambda r: None) if forced == "auto" else (lambda r: served_by.get(id(r), {}))
        rows_json += [_row_json(group, r, served=served_of(r)) for r in report]
        rows_json += [
            _row_json(group, dataclasses.replace(r, message=na_reason(r)), na=True, served=served_of(r))
            for r in unserved
        ]
        all_unserved += unserved
        if n_fail:
            rc = 1
    print()
    for line in summary:
        print(line)
    served = sum(n for (_, b, _), n in dispatch_log().items() if b == forced) - served_before
    if forced != "auto" and served == 0:  # every check ran on mnemo's PyTorch code: "all passed" would lie
        why = f" (e.g. {all_unserved[0].exception})" if all_unserved else ""
        print(
            f"mnemo verify: WARNING: nothing verified on backend {forced!r} (MNEMO_BACKEND): it served "
            f"none of the checked calls{why}",
            file=sys.stderr,
        )
        print(f"nothing verified on backend {forced!r} in {time.perf_counter() - t_all:.1f} s")
        rc = rc or 3
    else:
        print(f"{'all passed' if rc == 0 else 'some checks FAILED'} in {time.perf_counter() - t_all:.1f} s")
    if args.json:
        _write_json(args.json, rows_json)
    return rc


def _write_json(path: str, rows: list[dict]) -> None:
    from mnemo.bench import write_json

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    # strict JSON: an error that came out NaN (a kernel that wrote NaN) is null there, and the row's
    # "nonfinite" map says which (mnemo.bench.loads_json restores it)
    write_json(path, rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
