"""``mnemo probe``: circuit scores and memory time scales of a checkpoint, and training curves.

    mnemo probe circuits --checkpoint DIR      per-layer/head scores (JSON on stdout) + heatmaps
    mnemo probe timescales --checkpoint DIR    half-life distributions per layer (JSON) + a plot
    mnemo probe plot-training DIR              loss and tracked circuit scores against steps

``CircuitTracker`` is the training callback behind ``mnemo train --track-circuits``.
"""

from __future__ import annotations

import json
import math
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


def _heatmaps(scores: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["previous_token", "duplicate_token", "induction", "copying"]
    layers = sorted(scores, key=int)
    H = max(len(scores[layer]["induction"]) for layer in layers)
    fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 0.5 * len(layers) + 1.8))
    for ax, name in zip(axes, names):
        grid = torch.full((len(layers), H), float("nan"))
        for r, layer in enumerate(layers):
            vals = scores[layer].get(name)
            if vals is not None:
                grid[r, : len(vals)] = torch.tensor(vals)
        im = ax.imshow(
            grid.numpy(), vmin=-1 if name == "copying" else 0, vmax=1, cmap="viridis", aspect="auto"
        )
        ax.set_title(name.replace("_", " "))
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_yticks(range(len(layers)), layers)
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_training(run_dir, path=None) -> Path:
    """Loss and tracked scores from ``RUN/metrics.jsonl`` against steps (``RUN/training.png``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir} (a run directory written by `mnemo train`)")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r.get("train_loss", math.nan) for r in rows], label="train loss", color="tab:blue")
    ax.plot(steps, [r.get("val_loss", math.nan) for r in rows], label="val loss", color="tab:cyan")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax2 = ax.twinx()
    plotted = False
    for key, color in (
        ("induction_max", "tab:red"),
        ("previous_token_max", "tab:orange"),
        ("duplicate_token_max", "tab:green"),
        ("val_acc", "tab:purple"),
    ):
        if any(key in r for r in rows):
            ax2.plot(
                steps, [r.get(key, math.nan) for r in rows], label=key.replace("_", " "), color=color, ls="--"
            )
            plotted = True
    if plotted:
        ax2.set_ylabel("score")
        ax2.set_ylim(0, 1.05)
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=8, loc="center right")
    ax.set_title(run_dir.name)
    fig.tight_layout()
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
    _heatmaps(scores, out / "circuits.png")
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
    plot(result, out / "timescales.png")
    print(json.dumps({"checkpoint": str(ckpt), "tokens": int(ids.shape[1]), "layers": result}))
    return 0


def _cmd_plot_training(args) -> int:
    path = plot_training(args.run_dir, args.out)
    print(f"wrote {path}")
    return 0
