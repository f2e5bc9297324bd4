"""``mnemo probe capacity``: the memory-capacity probe's command, its claims, table and figure.

The probe itself (the variants, the writes and reads, the sweep over pair counts) is library code
in :mod:`mnemo.interp.capacity`; this module judges its claims on the recipe standard's paired
intervals (:func:`mnemo.sweep.recipe.judge_claim`) and writes the results folder.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from .. import argtypes as kinds

#: the claims the probe judges: (name, better, than)
CLAIMS = (
    ("a deep memory stores more pairs than a matrix", "mlp", "matrix"),
    ("... at equal parameters (hidden K/2, a rank-K/2 bottleneck)", "mlp_equal", "matrix"),
    ("... without residual and norm", "mlp_plain", "matrix_plain"),
)


def _ok(r) -> bool:
    """A recall that was measured (``None`` marks a cell whose reads were not finite)."""
    return r is not None and math.isfinite(r)


def _cell(result: dict, variant: str, n: int, p: int) -> dict | None:
    for c in result["cells"]:
        if c["variant"] == variant and c["n_pairs"] == n and c["passes"] == p:
            return c
    return None


def capacity_claims(result: dict, ceiling: float = 0.99) -> list[dict]:
    """Each claim of :data:`CLAIMS` whose two variants ran, per (passes, ``N``): the paired difference
    in recall over the reported seeds (the same pairs on a seed) and its verdict
    (:func:`mnemo.sweep.recipe.judge_claim`; both at or above ``ceiling`` on every seed: not testable)."""
    from ..sweep.recipe import judge_claim

    out = []
    for name, better, than in CLAIMS:
        for p in result["settings"]["passes"]:
            for n in result["settings"]["n_pairs"]:
                a, b = _cell(result, better, n, p), _cell(result, than, n, p)
                if a is None or b is None:
                    continue

                def stats(c):
                    ok = [(s, r) for s, r in zip(c["seeds"], c["recall"]) if _ok(r)]
                    return {"seeds": [s for s, _ in ok], "values": [r for _, r in ok], "plateau": None}

                j = judge_claim(
                    {"name": name, "better": better, "than": than},
                    stats(a),
                    stats(b),
                    metric="recall",
                    threshold=ceiling,
                )
                j.update(n_pairs=n, passes=p)
                out.append(j)
    return out


def capacity_markdown(result: dict) -> str:
    """The page's tables: recall (mean ± 95% t-interval over the reported seeds) and the chosen ``θ``
    per variant and ``N``, one table per number of passes; then the claims."""
    from ..sweep.stats import mean_interval

    s = result["settings"]
    variants = list(s["variants"])
    momentum = "no momentum" if s.get("momentum") is None else f"momentum {s['momentum']:g}"
    lines = [
        f"Memory preset {s.get('base', '?')!r}, chunk size {s.get('chunk_size', '?')}, {momentum}, "
        f"key dimension {s['key_dim']}, {s.get('dtype', 'float32')}, {s['streams']} streams a seed, "
        f"seeds {s['seeds']} reported, "
        f"θ per cell chosen on seed {s['select_seed']} from {s['theta_grid']}; chance = 1/N. A cell over "
        "fewer seeds gives its n (the others' reads were not finite).",
        "",
    ]
    for p in s["passes"]:
        lines += [
            f"**{p} pass{'es' if p > 1 else ''} over the pairs** — recall (θ):",
            "",
            "| N | " + " | ".join(variants) + " |",
            "|---" * (len(variants) + 1) + "|",
        ]
        for n in s["n_pairs"]:
            row = [str(n)]
            for v in variants:
                c = _cell(result, v, n, p)
                if c is None:
                    row.append("—")
                    continue
                vals = [r for r in c["recall"] if _ok(r)]
                st = mean_interval(vals)
                if not vals:
                    row.append(f"diverged (θ {c['theta']:g})")
                else:
                    ci = "" if st["half_width"] is None else f" ± {st['half_width']:.3f}"
                    n_of = "" if len(vals) == len(c["recall"]) else f", n = {len(vals)}"
                    row.append(f"{st['mean']:.3f}{ci} (θ {c['theta']:g}{n_of})")
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    judged = capacity_claims(result)
    if judged:
        lines += [
            "| claim | passes | N | n | recall difference [95% CI] | verdict |",
            "|---|---|---|---|---|---|",
        ]
        for j in judged:
            d = "—" if j["mean"] is None else f"{j['mean']:+.3f}"
            if j["low"] is not None:
                d += f" [{j['low']:+.3f}, {j['high']:+.3f}]"
            verdict = j["verdict"]
            if verdict == "not reproduced":
                verdict += ": the opposite holds" if j["high"] < 0 else ": no difference"
            lines.append(
                f"| {j['claim']} ({j['better']} − {j['than']}) | {j['passes']} | {j['n_pairs']} | {j['n']} | "
                f"{d} | {verdict} |"
            )
    return "\n".join(lines) + "\n"


def capacity_figure(result: dict, title: str | None = None):
    """Recall against the number of pairs (log scale), one panel per number of passes, one line per
    variant with its 95% interval; chance ``1/N`` dashed. Returns the matplotlib figure."""
    import matplotlib.pyplot as plt

    from ..sweep.stats import mean_interval

    s = result["settings"]
    ps = s["passes"]
    fig, axes = plt.subplots(1, len(ps), figsize=(5.2 * len(ps), 4.0), squeeze=False, sharey=True)
    ns = s["n_pairs"]
    for ax, p in zip(axes[0], ps):
        for v in s["variants"]:
            xs, ms, lo, hi = [], [], [], []
            for n in ns:
                c = _cell(result, v, n, p)
                vals = [] if c is None else [r for r in c["recall"] if _ok(r)]
                if not vals:
                    continue
                st = mean_interval(vals)
                h = st["half_width"] or 0.0
                xs.append(n), ms.append(st["mean"]), lo.append(st["mean"] - h), hi.append(st["mean"] + h)
            if xs:
                (line,) = ax.plot(xs, ms, marker="o", label=v)
                ax.fill_between(xs, lo, hi, alpha=0.2, color=line.get_color())
        ax.plot(ns, [1 / n for n in ns], "k--", lw=1, label="chance 1/N")
        ax.axvline(s["key_dim"], color="grey", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"pairs N (dotted: key dimension {s['key_dim']})")
        ax.set_title(f"{p} pass{'es' if p > 1 else ''}")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("recall (nearest value)")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(title or "What a test-time-trained memory can store: write N pairs, read every key")
    fig.tight_layout()
    return fig


#: ``mnemo probe capacity``'s default θ grid: 1-2-5 steps over seven decades
_THETA_GRID = ",".join(f"{m}e{e}" for e in range(-6, 1) for m in (1, 2, 5))


def add_parser(ps) -> None:
    """Add ``capacity`` to ``mnemo probe``'s sub-command parser ``ps``."""
    cap = ps.add_parser(
        "capacity",
        help="how many key-value pairs a test-time-trained memory stores: write N pairs, read every key "
        "(JSON + table + plot; no checkpoint)",
        description="Write N random key-value pairs (unit keys, N(0, 1) values) into a fresh memory by its "
        "own inner update, --passes times, then read every key back from the final weights; a key counts "
        "as recalled when its value is the nearest by cosine. Each (variant, N, passes) cell takes its "
        "inner rate θ from --theta-grid on --select-seed, then reports seeds 0..--seeds-1 (at least 3) "
        "with 95% intervals and the paired verdicts of the deep-memory claims. Writes capacity.json "
        "(everything), capacity.md (the tables) and capacity.png (recall against N) into --out.",
    )
    cap.add_argument(
        "--base",
        type=kinds.Text("a memory preset with a deep memory"),
        default="titans",
        help="the memory preset the variants are built on (default titans)",
    )
    cap.add_argument(
        "--variants",
        type=kinds.Text("comma-separated variant names"),
        default="mlp,matrix,mlp_equal,matrix_plain,mlp_plain",
        help="which of mlp, matrix, mlp_equal, matrix_plain, mlp_plain (default: all)",
    )
    cap.add_argument(
        "--pairs",
        type=kinds.IntList(1),
        default="4,8,16,32,64,128,256",
        help="pair counts N (default 4..256)",
    )
    cap.add_argument(
        "--passes", type=kinds.IntList(1), default="1,4", help="writes of the stream (default 1,4)"
    )
    cap.add_argument(
        "--theta-grid",
        type=kinds.FloatList(),
        default=_THETA_GRID,
        help="inner learning rates; each cell's is chosen on --select-seed (default 1e-6..5 in 1-2-5 steps: "
        "a matrix memory with a norm, started at zero, wants ~1e-5)",
    )
    cap.add_argument(
        "--seeds", type=kinds.Int(3), default=5, help="reported seeds 0..N-1, N >= 3 (default 5)"
    )
    cap.add_argument(
        "--select-seed", type=kinds.seed, default=1000, help="the seed that chooses θ (default 1000)"
    )
    cap.add_argument(
        "--key-dim", type=kinds.Int(1, 4096), default=16, help="key (and value) dimension (default 16)"
    )
    cap.add_argument(
        "--streams", type=kinds.Int(1, 1_000_000), default=256, help="streams per seed (default 256)"
    )
    cap.add_argument(
        "--chunk-size",
        type=kinds.Int(1, 65536),
        default=1,
        help="tokens per inner step (default 1: online GD)",
    )
    cap.add_argument(
        "--momentum",
        type=kinds.Float(0, 1, hi_open=True),
        help="momentum eta of the inner update, S <- eta S - theta grad, W <- W + S (default: plain GD)",
    )
    cap.add_argument("--float64", action="store_true", help="compute in float64 (default float32)")
    cap.add_argument("--threads", type=kinds.threads, help="intra-op threads (default: torch's)")
    cap.add_argument("--out", type=kinds.OutDir(not_a_run=True), required=True, help="folder for the results")
    cap.add_argument(
        "--overwrite", action="store_true", help="replace output files that exist (default: refuse)"
    )
    cap.add_argument("--no-progress", action="store_true")
    cap.set_defaults(func=run)


def _check_capacity_memory(args, specs, pairs: list[int], passes: list[int]) -> None:
    """Refuse, before any work, a probe whose largest cell cannot fit in memory: per stream the
    written sequence and its per-token work (``6K + 3h`` numbers a token, ``h`` the widest layer),
    the chunk form's ``[C, C]`` matrices, the ``N × N`` similarity matrix and the memory's own
    weights, a few copies of them (the weights, their gradient, the stepped weights, the momentum)."""
    import torch

    from ..train.memory_estimate import GiB, available_memory

    width = max(max(o for _, o in s.layer_dims(args.key_dim, args.key_dim)) for s in specs)
    weights = max(sum(i * o for i, o in s.layer_dims(args.key_dim, args.key_dim)) for s in specs)
    n, p = max(pairs), max(passes)
    chunk = min(args.chunk_size, n * p)  # the chunk form's [C, C] coefficients and scores, a few
    copies = 3 + (args.momentum is not None)
    per_stream = n * p * (6 * args.key_dim + 3 * width) + n * n + 8 * chunk * chunk + copies * weights
    need = args.streams * per_stream * (8 if args.float64 else 4)
    have, source = available_memory(torch.device("cpu"))
    if have is not None and need > have:
        raise ValueError(
            f"--streams / --pairs / --passes / --key-dim / --chunk-size: the largest cell ({args.streams:,} "
            f"streams of {n:,} pairs x {p} passes, key dim {args.key_dim}, chunk {args.chunk_size}) needs "
            f"about {need / GiB:,.1f} GiB, but only "
            f"{have / GiB:,.1f} GiB are available ({source}); lower one of them"
        )


def prepare(args) -> tuple[dict, list[str], list[int], list[int], list[float]]:
    """Every check of a ``mnemo probe capacity`` command that needs no work, as the CLI makes them:
    returns ``(variants, names, pairs, passes, theta grid)``.

    Raises:
        ValueError: naming the flag (``--base``, ``--variants``, ``--select-seed``, ``--pairs``,
            ``--passes``; the memory check).
    """
    from ..interp.capacity import capacity_variants

    grid = [float(x) for x in args.theta_grid.split(",")]
    if len({f"{x:g}" for x in grid}) != len(grid):  # results key θ by its %g text
        raise ValueError(
            f"--theta-grid: expected distinct values (to 6 significant digits), got {args.theta_grid}"
        )
    try:
        every = capacity_variants(
            args.base, chunk_size=args.chunk_size, max_lr=max(grid), momentum=args.momentum is not None
        )
    except ValueError as e:
        raise ValueError(f"--base: {e}") from None
    names = [v.strip() for v in args.variants.split(",")]
    if "" in names:
        raise ValueError(
            f"--variants: an empty name in {args.variants!r}; expected names among {sorted(every)}"
        )
    unknown = [v for v in names if v not in every]
    if unknown or len(set(names)) != len(names):
        raise ValueError(f"--variants: expected distinct names among {sorted(every)}, got {args.variants!r}")
    if args.select_seed < args.seeds:
        raise ValueError(
            f"--select-seed {args.select_seed} is one of the reported seeds 0..{args.seeds - 1}: "
            "choose another"
        )
    pairs, passes = ([int(x) for x in a.split(",")] for a in (args.pairs, args.passes))
    for flag, vals in (("--pairs", pairs), ("--passes", passes)):
        if len(set(vals)) != len(vals):
            raise ValueError(f"{flag}: expected distinct values, got {','.join(map(str, vals))}")
    pairs, passes = sorted(pairs), sorted(passes)
    _check_capacity_memory(args, [every[v][0] for v in names], pairs, passes)
    return every, names, pairs, passes, grid


def run(args) -> int:
    """``mnemo probe capacity``: run the sweep, write ``capacity.json``, ``.md`` and ``.png``.

    The cells are measured one (N, passes) at a time; an interrupt (Ctrl-C) saves those measured
    in ``--out/capacity.partial.json``, and the same command again, with the same code, measures
    only the others (a partial file of other settings or code is replaced, naming what differs). It
    is removed once the results are written; their ``wall_s`` counts the interrupted runs' wall time
    too (kept in the partial file)."""
    import matplotlib.pyplot as plt
    import torch

    every, names, pairs, passes, grid = prepare(args)
    out = Path(args.out)
    files = [out / "capacity.json", out / "capacity.md", out / "capacity.png"]
    for f in files:  # before any work: an existing result is replaced only with --overwrite
        kinds.refuse_existing(f, "--out", args.overwrite)
    partial = out / PARTIAL_NAME
    expected = json.loads(json.dumps({**_expected_settings(args), "sources": _sources_md5()}))
    done = _partial_cells(partial, expected)
    before = 0.0  # the interrupted runs' wall time: the results' wall_s is the whole measurement's
    if done:
        before = _partial_wall(partial)
        print(f"{partial}: {len(done)} measured cell(s) kept from an interrupted run", file=sys.stderr)
    threads_before = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter() - before
    try:
        cells = _measure(args, every, names, pairs, passes, grid, done, partial, expected, t0)
        dtype = torch.float64 if args.float64 else torch.float32
        result = {
            "settings": {  # as capacity_sweep records them
                "variants": {n: {"spec": every[n][0].to_dict(), "description": every[n][1]} for n in names},
                "n_pairs": pairs,
                "passes": passes,
                "theta_grid": grid,
                "seeds": list(range(args.seeds)),
                "select_seed": args.select_seed,
                "key_dim": args.key_dim,
                "streams": args.streams,
                "dtype": str(dtype).replace("torch.", ""),
                "momentum": args.momentum,
                "base": args.base,
                "chunk_size": args.chunk_size,
                "threads": torch.get_num_threads(),
            },
            "cells": cells,
        }
    finally:  # (a page's next line, or the caller, keeps its own thread count)
        torch.set_num_threads(threads_before)
    code = _write(args, result, files, t0, plt)
    partial.unlink(missing_ok=True)
    return code


#: the cells an interrupted ``mnemo probe capacity`` measured (in ``--out``)
PARTIAL_NAME = "capacity.partial.json"


def _sources_md5() -> str:
    """md5 over mnemo's own sources (every ``.py`` file of the package, as imported) and torch's
    version: a partial file's cells are continued from only when the code that measured them is
    today's (as :func:`mnemo.commands.continual.run_key` keys its kept runs)."""
    import hashlib

    import torch

    package = Path(__file__).resolve().parents[1]
    h = hashlib.md5(torch.__version__.encode())
    for f in sorted(package.rglob("*.py")):
        h.update(f.relative_to(package).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def _partial_cells(partial: Path, expected: dict) -> dict:
    """The cells kept in ``partial`` by an interrupted run of the same settings and sources
    (:func:`_sources_md5`), keyed by ``(variant, n_pairs, passes)``; none when it is absent,
    unreadable, of other settings or of other code."""
    try:
        held = json.loads(partial.read_text())
        if held["expected"] != expected:  # (said before its cells are lost: it is replaced)
            was = held["expected"] if isinstance(held["expected"], dict) else {}
            keys = [k for k in expected if was.get(k) != expected[k]]
            why = "; ".join(
                "mnemo's code or torch changed"
                if k == "sources"
                else f"{k} {was.get(k)!r} there, {expected[k]!r} now"
                for k in keys
            )
            n = len(held.get("cells") or [])
            print(
                f"{partial}: its {n} measured cell(s) are of other settings or code ({why}): measuring "
                "every cell anew (the file is replaced once a cell is measured; Ctrl-C before that "
                "keeps it for the interrupted command)",
                file=sys.stderr,
            )
            return {}
        return {(c["variant"], c["n_pairs"], c["passes"]): c for c in held["cells"]}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def _partial_wall(partial: Path) -> float:
    """The wall time (s) the interrupted runs behind ``partial`` spent measuring (0 when unknown)."""
    try:
        wall = json.loads(partial.read_text()).get("wall_s", 0.0)
        return float(wall) if isinstance(wall, (int, float)) and wall >= 0 else 0.0
    except (OSError, ValueError, AttributeError):
        return 0.0


def _measure(args, every, names, pairs, passes, grid, done, partial, expected, t0: float) -> list[dict]:
    """Every cell in :func:`~mnemo.interp.capacity.capacity_sweep`'s order (passes, then N, then
    the variants), one (N, passes) at a time; those in ``done`` are not measured again. On an
    interrupt the measured cells are saved in ``partial``, with the wall time since ``t0`` (a
    ``time.perf_counter()`` moved back by the earlier runs' wall time)."""
    import torch
    from tqdm.auto import tqdm

    from ..interp.capacity import capacity_sweep
    from ..train.checkpoint import atomic_write_text

    cells = []
    jobs = [(n, p) for p in passes for n in pairs]
    try:
        bar = tqdm(jobs, desc="capacity", disable=args.no_progress, leave=False)
        for n, p in bar:
            todo = [v for v in names if (v, n, p) not in done]
            bar.set_postfix_str(f"N={n} passes={p}")
            new = {}
            if todo:
                got = capacity_sweep(
                    {v: every[v] for v in todo},
                    [n],
                    [p],
                    grid,
                    list(range(args.seeds)),
                    args.select_seed,
                    args.key_dim,
                    args.streams,
                    torch.float64 if args.float64 else torch.float32,
                    progress=False,
                    eta=args.momentum,
                )
                new = {c["variant"]: c for c in got["cells"]}
            cells += [new[v] if v in new else done[(v, n, p)] for v in names]
    except KeyboardInterrupt as e:
        kept = {(c["variant"], c["n_pairs"], c["passes"]): c for c in cells} | done
        if kept:
            partial.parent.mkdir(parents=True, exist_ok=True)
            record = {"expected": expected, "cells": list(kept.values()), "wall_s": time.perf_counter() - t0}
            atomic_write_text(partial, json.dumps(record, indent=1, allow_nan=False) + "\n")
            e.then = (
                f"; the {len(kept)} measured cell(s) of {len(jobs) * len(names)} are saved in {partial}: "
                "run the same mnemo probe capacity command again to continue"
            )
        else:
            e.then = "; no cell was measured yet: nothing was written"
        raise
    return cells


def _write(args, result: dict, files: list[Path], t0: float, plt) -> int:
    from ..train.checkpoint import atomic_write_text

    result["wall_s"] = time.perf_counter() - t0
    files[0].parent.mkdir(parents=True, exist_ok=True)

    atomic_write_text(files[0], json.dumps(result, indent=1, allow_nan=False) + "\n")
    atomic_write_text(files[1], capacity_markdown(result))
    fig = capacity_figure(
        result,
        f"memory capacity: {args.base}, key dim {args.key_dim}, chunk {args.chunk_size}"
        + (f", momentum {args.momentum:g}" if args.momentum is not None else "")
        + (", float64" if args.float64 else ""),
    )
    tmp = files[2].with_name(f".{files[2].name}.tmp")
    fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)
    os.replace(tmp, files[2])
    print(f"wrote {files[0]}, {files[1]} and {files[2]} ({result['wall_s']:.0f} s)", file=sys.stderr)
    return 0


# --------------------------------------------------------------------------------------------
# results pages: a `<!-- mnemo:capacity ARGS -->` line (mnemo reproduce, mnemo.sweep.reproduce)


def parse_command(argv: list[str]):
    """The arguments of ``mnemo probe capacity ARGV`` (a results page's line), checked as the CLI
    checks them.

    Raises:
        ValueError: what the CLI would refuse, with argparse's message.
    """
    from .continual import _Parser

    if {"-h", "--help"} & set(argv):
        raise ValueError("-h/--help: a command line to run, not to print its help, is expected")
    parser = _Parser(prog="mnemo probe")
    add_parser(parser.add_subparsers(dest="probe_command"))
    return parser.parse_args(["capacity", *argv])


def page_jobs(page: Path) -> list[dict]:
    """Each ``mnemo:capacity`` line of ``page``: ``{"line", "argv", "name" (its block: ``--out``'s
    folder name), "out", "args"}``; a relative ``--out`` is resolved against the page's checkout
    (as a sweep file's path is) and checked there as the CLI checks a folder to write into.

    Raises:
        ValueError: a line the CLI refuses (any check that needs no work: :func:`prepare`), naming the
            page and line; two lines with one block name.
    """
    from ..sweep.reproduce import page_lines
    from .continual import _page_root, _parse_in, page_out

    jobs: list[dict] = []
    root = _page_root(page)
    for line, argv in page_lines(page, "capacity"):
        where = f"{page}:{line}"
        try:
            args = _parse_in(root or Path.cwd(), parse_command, argv)  # --out checked where it is written
            out = page_out(args, root)
            args.out = str(out)
            prepare(args)  # every check that needs no work, before any line runs
        except (ValueError, argparse.ArgumentTypeError) as e:
            raise ValueError(f"{where}: mnemo probe capacity {' '.join(argv)}: {e}") from None
        name = out.resolve().name
        first = next((j for j in jobs if j["name"] == name), None)
        if first is not None:
            raise ValueError(
                f"{where}: its block {name!r} (named after the --out folder's name) is also the block of"
                f" line {first['line']} (--out {first['out']}): give each line an --out"
                " folder of its own name"
            )
        jobs.append({"line": line, "argv": argv, "name": name, "out": out, "args": args})
    return jobs


def _expected_settings(args) -> dict:
    """The ``settings`` a run of ``args`` records (the fields a stored result is checked against)."""
    return {
        "variants": [v.strip() for v in args.variants.split(",")],
        "n_pairs": sorted(int(x) for x in args.pairs.split(",")),
        "passes": sorted(int(x) for x in args.passes.split(",")),
        "theta_grid": [float(x) for x in args.theta_grid.split(",")],
        "seeds": list(range(args.seeds)),
        "select_seed": args.select_seed,
        "key_dim": args.key_dim,
        "streams": args.streams,
        "dtype": "float64" if args.float64 else "float32",
        "base": args.base,
        "chunk_size": args.chunk_size,
        "momentum": args.momentum,
    }


def _stored_difference(job: dict) -> str | None:
    """What the line's ``--out`` holds, when it is not the line's own results: ``None`` for no
    ``capacity.json`` or one made by the line's command, else why (a file that is not a result of
    the probe, or results of another command, naming the fields)."""
    path = job["out"] / "capacity.json"
    if not path.is_file():
        return None
    try:
        stored = json.loads(path.read_text())
        held = {**stored["settings"], "variants": list(stored["settings"]["variants"])}
        for key, kind in (("cells", list), ("wall_s", (int, float))):
            if not isinstance(stored[key], kind):
                raise TypeError(f"{key!r} is a {type(stored[key]).__name__}")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return f"is not a result of mnemo probe capacity ({type(e).__name__}: {e})"
    want = _expected_settings(job["args"])
    differ = [f"{k} {held.get(k)} against {v}" for k, v in want.items() if held.get(k) != v]
    if differ:
        return "holds results of another command than the page's line (" + "; ".join(differ) + ")"
    return None


def check_page_job(page: Path, job: dict) -> None:
    """``--no-run``: the line's ``--out`` must hold ``capacity.json`` made by the line's command.

    Raises:
        FileNotFoundError: no such results. ValueError: results of another command (names the fields),
            or a file that is not a result of the probe.
    """
    from ..sweep.reproduce import _shown

    where, path = f"{page}:{job['line']}", job["out"] / "capacity.json"
    if not path.is_file():
        raise FileNotFoundError(f"{where}: {_shown(path)} does not exist; run the command (drop --no-run)")
    why = _stored_difference(job)
    if why is not None:
        fix = "run the command" if why.startswith("is not") else "fix the line, or run it"
        raise ValueError(f"{where}: {_shown(path)} {why}: {fix} (drop --no-run)")


def foreign_results(page: Path, job: dict) -> str | None:
    """Before a run (:func:`mnemo.sweep.reproduce.reproduce_page`): why the line's ``--out`` holds
    results that running the line would replace and that are not its command's (``None``: nothing
    there, or the line's own)."""
    from ..sweep.reproduce import _shown

    why = _stored_difference(job)
    return None if why is None else f"{_shown(job['out'] / 'capacity.json')} {why}"


def page_block(
    page: Path, job: dict, *, train: bool, progress: bool = True, log=print, threads: int | None = None
) -> str:
    """The generated block of one ``mnemo:capacity`` line: with ``train`` the probe runs again (it
    is deterministic and takes minutes; its files in ``--out`` are replaced), on the line's
    ``--threads``, else ``threads`` (``mnemo reproduce --threads``; ``None``: torch's), else its
    stored ``capacity.json`` is read (:func:`check_page_job`); then the command, the tables with the
    claims judged again from the stored recalls, and the figure."""
    import shlex

    from ..sweep.reproduce import _shown

    if train:
        if (job["out"] / "capacity.json").is_file():
            log(f"{job['name']}: replacing the results in {_shown(job['out'])} (--no-run rebuilds from them)")
        args = vars(job["args"])
        run(
            argparse.Namespace(
                **{
                    **args,
                    "threads": args["threads"] or threads,
                    "overwrite": True,
                    "no_progress": not progress,
                }
            )
        )
    else:
        check_page_job(page, job)
    result = json.loads((job["out"] / "capacity.json").read_text())
    rel = os.path.relpath(job["out"], page.parent)
    return "\n".join(
        [
            f"*Generated by `mnemo reproduce {_shown(page)}` from its `mnemo:capacity` line; edits between "
            f"these markers are replaced.* Command (wall time {result['wall_s']:.0f} s, "
            f"{result['settings'].get('threads', '?')} thread(s)):",
            "",
            "```bash",
            f"mnemo probe capacity {shlex.join(job['argv'])}",
            "```",
            "",
            capacity_markdown(result).rstrip(),
            "",
            f"![capacity]({rel}/capacity.png)",
        ]
    )
