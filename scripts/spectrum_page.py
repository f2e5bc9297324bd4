"""Rebuild docs/results/spectrum.md's table: train each model briefly, read its memory spectrum.

For each model M (default: gla, gated_deltanet, mamba, titans_lmm, hope_reconstruction) this runs::

    mnemo train --model M --steps 200 --d-model 64 --n-layers 2 --batch-size 8 --seq-len 64 --out RUNS/spec-M
    mnemo probe spectrum --checkpoint RUNS/spec-M --tokens 512 [--directions 128] --out RUNS/spec-M/spectrum

(a finished run is not trained again and a stopped one resumes; a spectrum already written is
read back), copies each ``spectrum.png`` to ``FIGURES/spectrum_M.png`` and rewrites the page's
block between ``<!-- mnemo:begin spectrum -->`` and ``<!-- mnemo:end spectrum -->`` (appended
the first time; the prose around it stays). ``hope_reconstruction`` stands for HOPE: the ``hope``
preset's CMS levels step on the task's error signal, a transition the probe cannot read from the
levels' input alone (they would show as "unsupported"). Test-time-trained memories get
``--directions`` exponents per head (their leading ones; the rest count as unresolved).

    python scripts/spectrum_page.py                          # everything, then the page
    python scripts/spectrum_page.py --models gla --no-page   # one model, print the table only
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

from mnemo.train.sinks import loads_record

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "results" / "spectrum.md"
FIGURES = ROOT / "docs" / "figures"
MODELS = ("gla", "gated_deltanet", "mamba", "titans_lmm", "hope_reconstruction")
TEST_TIME = ("titans", "hope")  # name prefixes of the models probed with --directions
BLOCK = "spectrum"
CLASSES = ("irrelevant", "intermediate", "marginal", "relevant", "unresolved")


def _run(argv: list[str]) -> float:
    """Run ``mnemo ARGV`` in a fresh process of this interpreter (``python -m mnemo.cli`` from the
    repository root; stdout discarded: the probe prints its whole JSON;
    ``CalledProcessError`` on a non-zero exit); returns the wall time in seconds."""
    cmd = [sys.executable, "-m", "mnemo.cli", *argv]
    print("$ mnemo", " ".join(argv), file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def train_argv(model: str, run: Path, args) -> list[str]:
    argv = ["train", "--model", model, "--steps", str(args.steps), "--d-model", str(args.d_model)]
    argv += ["--n-layers", str(args.n_layers), "--batch-size", str(args.batch_size)]
    argv += ["--seq-len", str(args.seq_len), "--sample-tokens", "0", "--no-progress", "--out", str(run)]
    return argv + (["--resume"] if (run / "latest").is_file() else [])


def probe_argv(model: str, run: Path, out: Path, args) -> list[str]:
    argv = ["probe", "spectrum", "--checkpoint", str(run), "--tokens", str(args.tokens), "--out", str(out)]
    return argv + (["--directions", str(args.directions)] if model.startswith(TEST_TIME) else [])


def _share(x: float) -> str:
    """A share of directions: 2 decimals, 3 below 0.01, one significant digit below 0.001 (a
    handful of directions out of thousands is not 0)."""
    if x == 0:
        return "0"
    if x < 0.001:
        return f"{x:.0e}"
    return f"{x:.3f}" if x < 0.01 else f"{x:.2f}"


def _half_life(x: float) -> str:
    if math.isinf(x):
        return "∞"
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}"


def _layer_label(key: str, entry: dict) -> str:
    if ".cms" in key:
        layer, level = key.split(".cms")
        return f"{layer}, CMS level {level} (period {entry['period']})"
    mixer = entry.get("mixer", "")
    return f"{key} (self-modifying Titans)" if mixer == "SelfModifyingTitans" else key


def _order(key: str) -> tuple[int, int]:
    layer, _, level = key.partition(".cms")
    return int(layer), -1 if not level else int(level)


def rows(model: str, spectrum: dict) -> list[str]:
    """The table's rows for one model's ``spectrum.json`` (``mnemo probe spectrum``'s record):
    the shares of each class of direction, the median half-life (tokens) and the slowest
    exponent λ (nats/token); a layer without a readable transition gets its kind and no numbers.
    The file as ``json.loads`` reads it too (a non-finite number null, mapped by "nonfinite")."""
    if isinstance(spectrum.get("nonfinite"), dict):
        spectrum = loads_record(json.dumps(spectrum))
    out = []
    for key in sorted(spectrum["layers"], key=_order):
        entry = spectrum["layers"][key]
        s = entry.get("summary")
        if s is None:  # attention, identity or unsupported
            out.append(
                f"| {model} | {_layer_label(key, entry)} | {entry.get('kind', '?')}: no spectrum" + " |" * 8
            )
            continue
        dirs = str(s["directions"])
        if s["computed"] < s["directions"]:  # only each head's leading exponents were computed
            dirs += f" ({s['computed'] // entry['heads']})"
        lam = f"{float(s['max_exponent']):+.4f}".replace("-", "−")
        half = _half_life(float(s["median_half_life"]))
        cells = [model, _layer_label(key, entry), dirs, *(_share(float(s[c])) for c in CLASSES), half, lam]
        out.append("| " + " | ".join(cells) + " |")
    return out


def table(results: dict[str, dict], walls: dict[str, float], args) -> str:
    head = [
        "| model | layer | directions (computed per head) | irrelevant | intermediate | marginal | relevant "
        "| unresolved | median half-life (tokens) | slowest λ (nats/token) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    wall = ", ".join(f"{m} {w:.0f} s" for m, w in walls.items()) or "every run and spectrum reused"
    note = (
        "*Generated by `python scripts/spectrum_page.py`; edits between these markers are replaced.* "
        f"Seed 0, one run per model: {args.steps} steps at d_model {args.d_model}, {args.n_layers} layers, "
        f"batch {args.batch_size} × {args.seq_len} tokens; spectra over {args.tokens} tokens of the training "
        f"text ({args.directions} directions per head of a test-time-trained memory). Wall time of training "
        f"and probing in this rebuild: {wall}."
    )
    return "\n".join([note, "", *head, *(r for m, spec in results.items() for r in rows(m, spec))])


def write_page(page: Path, block: str) -> None:
    from mnemo.sweep.reproduce import _replace_block

    text = page.read_text() if page.is_file() else "# The memory spectrum of small trained models\n"
    tmp = page.with_name(page.name + ".tmp")
    tmp.write_text(_replace_block(text, BLOCK, block, page))
    tmp.replace(page)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated registry names")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--tokens", type=int, default=512, help="tokens the spectra are read over")
    p.add_argument("--directions", type=int, default=128, help="exponents per head of a test-time memory")
    p.add_argument("--runs", default="runs", help="folder of the spec-M runs (default runs/)")
    p.add_argument("--figures", default=str(FIGURES), help="where spectrum_M.png is copied")
    p.add_argument("--page", default=str(PAGE), help="results page whose generated block is rewritten")
    p.add_argument("--no-page", action="store_true", help="print the table only")
    args = p.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    if not models:
        p.error("--models: expected at least one registry name")
    results, walls = {}, {}
    for m in models:
        run = Path(args.runs) / f"spec-{m}"
        out = run / "spectrum"
        wall = 0.0
        if not (run / f"ckpt-{args.steps:06d}").is_dir():  # absent, or stopped before its last step
            wall += _run(train_argv(m, run, args))
        if not (out / "spectrum.json").is_file():
            wall += _run(probe_argv(m, run, out, args))
        if wall:
            walls[m] = wall
        # null + "nonfinite" (an infinite half-life) restored; older files' "inf" strings read as they are
        results[m] = loads_record((out / "spectrum.json").read_text())
        Path(args.figures).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out / "spectrum.png", Path(args.figures) / f"spectrum_{m}.png")
    block = table(results, walls, args)
    print(block)
    if not args.no_page:
        write_page(Path(args.page), block)
        print(f"wrote {args.page}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
