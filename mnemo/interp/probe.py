"""``mnemo probe``: circuit scores and memory time scales of a checkpoint, and training curves.

    mnemo probe circuits --checkpoint DIR      per-layer/head scores (JSON on stdout) + heatmaps
    mnemo probe timescales --checkpoint DIR    half-life distributions per layer (JSON) + a plot
    mnemo probe plot-training DIR              loss and tracked circuit scores against steps

Each figure is titled with the model and the checkpoint (or run) it shows; each command names the
PNG it wrote (``wrote PATH``: on stderr where stdout carries the JSON).

``CircuitTracker`` is the training callback behind ``mnemo train --track-circuits``.
"""

from __future__ import annotations

import json
import math
import re
import sys
import textwrap
from pathlib import Path

import torch

from .maps import capture_maps
from .scores import (
    copying_score,
    duplicate_token_score,
    induction_score,
    previous_token_score,
    repeated_random_tokens,
)


def circuit_scores(model, length: int = 32, batch: int = 8, seed: int = 0, vocab_offset: int = 0) -> dict:
    """Per layer and head: previous-token, duplicate-token and induction scores on random tokens
    repeated twice (``length`` each), and the copying score of softmax heads."""
    from ..layers import Attention

    gen = torch.Generator().manual_seed(seed)
    V = model.config.vocab_size
    ids = repeated_random_tokens(batch, length, V, gen, offset=min(vocab_offset, V - 1))
    param = next(model.parameters(), None)
    if param is not None:
        ids = ids.to(param.device)  # the generator draws on CPU (same tokens on every device)
    maps = capture_maps(model, ids)
    out = {}
    for layer, m in maps.items():
        entry = {
            "mixer": type(model.blocks[layer].mixer).__name__,
            "previous_token": previous_token_score(m).tolist(),
            "duplicate_token": duplicate_token_score(m, ids).tolist(),
            "induction": induction_score(m, length).tolist(),
        }
        if isinstance(model.blocks[layer].mixer, Attention):
            entry["copying"] = copying_score(model, layer).tolist()
        out[str(layer)] = entry
    return out


class CircuitTracker:
    """Training callback: every evaluation, add the circuit scores (max over heads per layer, and the
    overall max of the induction and previous-token scores) to the metrics record.

    Uses its own random generator (the trainer's batch order is untouched)."""

    def __init__(self, length: int = 32, batch: int = 8, seed: int = 1234, vocab_offset: int = 0):
        self.length, self.batch, self.seed, self.vocab_offset = length, batch, seed, vocab_offset

    def __call__(self, trainer, record: dict) -> dict:
        model = trainer.model
        was = model.training
        model.eval()
        try:
            scores = circuit_scores(model, self.length, self.batch, self.seed, self.vocab_offset)
        finally:
            model.train(was)
        extra = {}
        for name in ("induction", "previous_token", "duplicate_token"):
            per_layer = [max(v[name]) for v in scores.values()]
            if per_layer:
                extra[f"{name}_max"] = max(per_layer)
                extra[f"{name}_by_layer"] = per_layer
        return extra


def _load(checkpoint):
    from ..models import LanguageModel
    from ..train import resolve_checkpoint

    ckpt = resolve_checkpoint(checkpoint)
    return ckpt, LanguageModel.from_pretrained(ckpt).eval()


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}


def _short_path(path) -> str:
    """``path`` as the user would type it: relative to the working directory when it lies below it,
    and cut to its last three parts (``…/run/ckpt-000500``) when still long."""
    p = Path(path)
    if p.is_absolute():
        try:
            p = p.relative_to(Path.cwd())
        except ValueError:
            pass
    text = str(p)
    if len(text) > 48 and len(p.parts) > 3:
        text = str(Path("…", *p.parts[-3:]))
    return text


def _model_description(ckpt: Path) -> str:
    """``transformer (2 layers) on repeat_segment`` from a checkpoint's train_config.json and
    config.json (the mixers when there is no train config)."""
    from ..models.lm import CONFIG_NAME
    from ..train.checkpoint import TRAIN_CONFIG_NAME

    tcfg, cfg = _read_json(ckpt / TRAIN_CONFIG_NAME), _read_json(ckpt / CONFIG_NAME)
    name = tcfg.get("model")
    if not name:
        mixers = cfg.get("layers") or cfg.get("pattern") or ([cfg["mixer"]] if cfg.get("mixer") else [])
        name = "+".join(dict.fromkeys(mixers)) or "model"
    n = cfg.get("n_layers")
    text = f"{name} ({n} layer{'s' if n != 1 else ''})" if n else str(name)
    on = tcfg.get("task") or tcfg.get("data")
    return f"{text} on {on}" if on else text


def checkpoint_label(ckpt) -> str:
    """What a figure of one checkpoint is of, e.g.
    ``transformer (2 layers) on repeat_segment · runs/x/ckpt-000500 (step 500)``."""
    ckpt = Path(ckpt)
    m = re.fullmatch(r"ckpt-(\d+)", ckpt.name)
    step = f" (step {int(m.group(1))})" if m else ""
    return f"{_model_description(ckpt)} · {_short_path(ckpt)}{step}"


def run_label(run_dir, steps=None) -> str:
    """What a figure of a training run is of, e.g.
    ``transformer (2 layers) on repeat_segment · runs/phase-2layer (1500 steps)``."""
    from ..train import resolve_checkpoint

    run_dir = Path(run_dir)
    try:
        model = _model_description(resolve_checkpoint(run_dir)) + " · "
    except (FileNotFoundError, OSError):
        model = ""  # metrics without a checkpoint: the run directory alone
    n = f" ({steps} steps)" if steps is not None else ""
    return f"{model}{_short_path(run_dir)}{n}"


def fit_text(text: str, width_in: float, fontsize: float) -> str:
    """``text`` wrapped to lines that fit ``width_in`` inches at ``fontsize`` points (a title is cut
    by the figure's edge, never shrunk, when one line is wider than the figure)."""
    chars = max(20, int(width_in * 72 / (0.62 * fontsize)))
    return "\n".join(textwrap.fill(line, chars) for line in text.splitlines())


CIRCUIT_PANELS = ("previous_token", "duplicate_token", "induction", "copying")


def circuits_figure(scores: dict, title: str | None = None):
    """One heatmap (layer × head) per score; a panel, or a layer's row, without a score (the copying
    score exists for softmax heads only) reads "n/a"."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = sorted(scores, key=int)
    H = max(len(scores[layer]["induction"]) for layer in layers)
    width = 3.2 * len(CIRCUIT_PANELS)
    fig, axes = plt.subplots(
        1, len(CIRCUIT_PANELS), figsize=(width, 0.5 * len(layers) + 2.2), layout="constrained"
    )
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="0.92")  # missing cells: light grey
    for ax, name in zip(axes, CIRCUIT_PANELS):
        grid = torch.full((len(layers), H), float("nan"))
        missing = []
        for r, layer in enumerate(layers):
            vals = scores[layer].get(name)
            if vals is not None:
                grid[r, : len(vals)] = torch.tensor(vals)
            else:
                missing.append(r)
        im = ax.imshow(grid.numpy(), vmin=-1 if name == "copying" else 0, vmax=1, cmap=cmap, aspect="auto")
        ax.set_title(name.replace("_", " "))
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_yticks(range(len(layers)), layers)
        if len(missing) == len(layers):
            why = "\n(softmax heads only)" if name == "copying" else ""
            ax.text(0.5, 0.5, "n/a" + why, transform=ax.transAxes, ha="center", va="center", color="0.3")
        else:
            for r in missing:
                ax.text((H - 1) / 2, r, "n/a", ha="center", va="center", fontsize=8, color="0.3")
        fig.colorbar(im, ax=ax, fraction=0.046)
    if title:
        fig.suptitle(fit_text(title, width, 11), fontsize=11)
    return fig


def _heatmaps(scores: dict, path: Path, title: str | None = None) -> Path:
    import matplotlib.pyplot as plt

    fig = circuits_figure(scores, title)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


SCORE_KEYS = (
    ("induction_max", "tab:red"),
    ("previous_token_max", "tab:orange"),
    ("duplicate_token_max", "tab:green"),
    ("val_acc", "tab:purple"),
)


def _read_metrics(run_dir: Path) -> list[dict]:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir} (a run directory written by `mnemo train`)")
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def training_figure(rows: list[dict], title: str | None = None):
    """Loss against steps; the tracked circuit scores and accuracy, when the run recorded any, on a
    labelled right axis (no right axis otherwise)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    width = 7.0
    fig, ax = plt.subplots(figsize=(width, 4), layout="constrained")
    ax.plot(steps, [r.get("train_loss", math.nan) for r in rows], label="train loss", color="tab:blue")
    ax.plot(steps, [r.get("val_loss", math.nan) for r in rows], label="val loss", color="tab:cyan")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    handles, labels = ax.get_legend_handles_labels()
    present = [(key, color) for key, color in SCORE_KEYS if any(key in r for r in rows)]
    if present:
        ax2 = ax.twinx()
        for key, color in present:
            ax2.plot(
                steps, [r.get(key, math.nan) for r in rows], label=key.replace("_", " "), color=color, ls="--"
            )
        scores = [k for k, _ in present if k != "val_acc"]
        ax2.set_ylabel(
            " / ".join(
                (["circuit score (max over heads)"] if scores else [])
                + (["accuracy"] if len(scores) < len(present) else [])
            )
        )
        ax2.set_ylim(0, 1.05)
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    ax.legend(handles, labels, fontsize=8, loc="center right")
    if title:
        ax.set_title(fit_text(title, width, 10), fontsize=10)
    return fig


def plot_training(run_dir, path=None) -> Path:
    """Loss and tracked scores from ``RUN/metrics.jsonl`` against steps (``RUN/training.png``)."""
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = _read_metrics(run_dir)
    fig = training_figure(rows, run_label(run_dir, rows[-1]["step"] if rows else None))
    path = Path(path) if path else run_dir / "training.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def add_commands(sub) -> None:
    p = sub.add_parser("probe", help="circuit scores, memory time scales, training curves")
    ps = p.add_subparsers(dest="probe_command", required=True)
    c = ps.add_parser("circuits", help="per-layer/head circuit scores of a checkpoint (JSON) + heatmaps")
    c.add_argument("--checkpoint", required=True)
    c.add_argument("--length", type=int, default=32, help="length of the random sequence (repeated twice)")
    c.add_argument("--batch", type=int, default=8)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--out", help="where to write circuits.png (default: the checkpoint directory)")
    c.set_defaults(func=_cmd_circuits)
    t = ps.add_parser("timescales", help="decay half-life distributions per layer (JSON) + a plot")
    t.add_argument("--checkpoint", required=True)
    t.add_argument("--data", help="text to measure data-dependent gates on (default: the training data)")
    t.add_argument("--tokens", type=int, default=2048)
    t.add_argument("--out", help="where to write timescales.png (default: the checkpoint directory)")
    t.set_defaults(func=_cmd_timescales)
    pt = ps.add_parser("plot-training", help="plot loss and tracked scores of a run against steps")
    pt.add_argument("run_dir")
    pt.add_argument("--out", help="PNG path (default: RUN/training.png)")
    pt.set_defaults(func=_cmd_plot_training)


def _cmd_circuits(args) -> int:
    ckpt, model = _load(args.checkpoint)
    scores = circuit_scores(model, args.length, args.batch, args.seed)
    out = Path(args.out) if args.out else ckpt
    out.mkdir(parents=True, exist_ok=True)
    path = _heatmaps(scores, out / "circuits.png", checkpoint_label(ckpt))
    print(f"wrote {path}", file=sys.stderr)  # stdout stays one JSON line
    print(json.dumps({"checkpoint": str(ckpt), "length": args.length, "layers": scores}))
    return 0


def _cmd_timescales(args) -> int:
    from ..data import load_text, load_tokenizer
    from ..train.checkpoint import TRAIN_CONFIG_NAME, load_json
    from .timescales import plot, timescales

    ckpt, model = _load(args.checkpoint)
    tcfg = load_json(ckpt / TRAIN_CONFIG_NAME) if (ckpt / TRAIN_CONFIG_NAME).is_file() else {}
    data = args.data or tcfg.get("data") or "tinyshakespeare"
    if tcfg.get("task") and not args.data:
        ids = torch.randint(
            0, model.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0)
        )
    else:
        ids = load_tokenizer(ckpt).encode(load_text(data)[: args.tokens])[None]
    result = timescales(model, ids)
    out = Path(args.out) if args.out else ckpt
    out.mkdir(parents=True, exist_ok=True)
    path = plot(result, out / "timescales.png", title=checkpoint_label(ckpt))
    print(f"wrote {path}", file=sys.stderr)  # stdout stays one JSON line
    print(json.dumps({"checkpoint": str(ckpt), "tokens": int(ids.shape[1]), "layers": result}))
    return 0


def _cmd_plot_training(args) -> int:
    path = plot_training(args.run_dir, args.out)
    print(f"wrote {path}")
    return 0
