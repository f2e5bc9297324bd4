"""``mnemo continual``: a continual-learning demonstration for the Continuum Memory System.

Task A is character-level tinyshakespeare; task B is the same text written in a new "alphabet" (a
fixed random permutation of the characters), so B shares A's structure but none of its symbols.
A model is trained on A, then on B, and evaluated on A again; *forgetting* is the rise of A's
validation loss over the B phase. Evaluation streams long validation contexts (``eval_len`` tokens,
fed ``seq_len`` at a time with the fast state carried), and reports the loss on the first piece
(a fresh context) and on the last (after the CMS levels have adapted in context) — the multi-level
CMS's slow levels can re-learn within a stream what the outer loop overwrote. The demonstration
runs the same model with a 1-level CMS and with a multi-level CMS of about the same size, and prints
a table and a plot::

    mnemo continual --steps 300 --out runs/continual
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..data import TokenStream, build_tokenizer, load_text, split_text
from ..models import LanguageModel, build_config
from ..train.config import TrainConfig
from ..train.trainer import lr_factor, make_optimizer


def permuted_text(text: str, seed: int = 0) -> str:
    """``text`` with its characters replaced by a fixed random permutation of its alphabet."""
    chars = sorted(set(text))
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(chars), generator=gen).tolist()
    table = str.maketrans({c: chars[p] for c, p in zip(chars, perm)})
    return text.translate(table)


def level_configs(levels: int, expansion_total: float = 6.0, base_period: int = 16):
    """``levels`` CMS levels with periods ``16, 64, 256, …`` sharing ``expansion_total``."""
    return [{"period": base_period * 4**i, "expansion": expansion_total / levels} for i in range(levels)]


@torch.no_grad()
def _stream_loss(
    model, stream: TokenStream, seq_len: int, eval_len: int, n_streams: int
) -> tuple[float, float]:
    """Mean loss on the first and on the last ``seq_len`` tokens of ``n_streams`` validation
    contexts of ``eval_len`` tokens, processed as streams (state carried between pieces)."""
    model.eval()
    ids = stream.ids
    starts = torch.linspace(0, ids.numel() - eval_len - 2, n_streams).long()
    first, last = [], []
    for s0 in starts.tolist():
        x = ids[s0 : s0 + eval_len][None]
        y = ids[s0 + 1 : s0 + eval_len + 1][None]
        state = None
        for a in range(0, eval_len, seq_len):
            logits, state = model(x[:, a : a + seq_len], state)
            loss = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), y[:, a : a + seq_len].flatten()
            ).item()
            if a == 0:
                first.append(loss)
        last.append(loss)
    model.train()
    return sum(first) / len(first), sum(last) / len(last)


def run(
    model: str = "hope_attention",
    levels=(1, 3),
    steps: int = 300,
    d_model: int = 64,
    n_layers: int = 2,
    seq_len: int = 64,
    batch_size: int = 16,
    lr: float = 3e-3,
    eval_every: int = 50,
    seed: int = 0,
    eval_len: int = 512,
    eval_streams: int = 4,
    out: str | Path | None = None,
    progress: bool = True,
) -> dict:
    """Train on A then B for every CMS depth in ``levels``; return (and optionally write) results.

    Every ``eval_every`` steps both validation sets are scored as ``eval_streams`` streams of
    ``eval_len`` tokens: ``val_X`` is the loss on the first ``seq_len`` tokens (a fresh context),
    ``val_X_adapted`` the loss on the last ``seq_len`` tokens (after the fast levels adapted).

    Raises:
        ValueError: ``eval_len`` shorter than ``seq_len``.
        RuntimeError: the training loss became NaN/inf (the message names the step).
    """
    if eval_len < seq_len:
        raise ValueError(f"eval_len must be >= seq_len = {seq_len}, got {eval_len}")
    text_a = load_text("tinyshakespeare")
    text_b = permuted_text(text_a, seed=1234)
    tok = build_tokenizer("char", text_a)
    streams = {}
    for name, text in (("A", text_a), ("B", text_b)):
        train, val = split_text(text)
        streams[name] = (TokenStream(tok.encode(train), seq_len), TokenStream(tok.encode(val), seq_len))
    results = {}
    for n_levels in levels:
        torch.manual_seed(seed)
        cfg = build_config(
            model,
            vocab_size=tok.vocab_size,
            d_model=d_model,
            n_layers=n_layers,
            mlp="cms",
            mlp_options={"levels": level_configs(n_levels)},
        )
        lm = LanguageModel(cfg)
        tcfg = TrainConfig(lr=lr, steps=2 * steps, warmup_steps=min(20, steps))
        opt = make_optimizer(lm, tcfg)
        gen = torch.Generator().manual_seed(seed + 1)
        curve = []
        record = {}
        bar = tqdm(total=2 * steps, disable=not progress, desc=f"continual {n_levels}-level CMS")
        for phase in ("A", "B"):
            train = streams[phase][0]
            for i in range(steps):
                step = (0 if phase == "A" else steps) + i
                for g in opt.param_groups:
                    g["lr"] = lr * lr_factor(step, tcfg.warmup_steps, 2 * steps, tcfg.min_lr_ratio)
                x, y = train.sample(batch_size, gen)
                logits, _ = lm(x)
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
                if not math.isfinite(loss.item()):
                    raise RuntimeError(f"continual: loss became {loss.item()} at step {step + 1}")
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(lm.parameters(), 1.0)
                opt.step()
                bar.update(1)
                if (step + 1) % eval_every == 0 or i == steps - 1:
                    point = {"step": step + 1, "phase": phase}
                    for name in ("A", "B"):
                        fresh, adapted = _stream_loss(lm, streams[name][1], seq_len, eval_len, eval_streams)
                        point[f"val_{name}"], point[f"val_{name}_adapted"] = fresh, adapted
                    curve.append(point)
            record[f"after_{phase}"] = {k: v for k, v in curve[-1].items() if k.startswith("val_")}
        bar.close()
        record["forgetting_A"] = record["after_B"]["val_A"] - record["after_A"]["val_A"]
        record["forgetting_A_adapted"] = (
            record["after_B"]["val_A_adapted"] - record["after_A"]["val_A_adapted"]
        )
        record["curve"] = curve
        record["parameters"] = lm.num_parameters()
        results[f"{n_levels}-level"] = record
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "continual.json").write_text(json.dumps(results, indent=2))
        try:
            plot(results, out / "continual.png")
        except ImportError:  # pragma: no cover - matplotlib is an optional extra
            pass
    return results


def table(results: dict) -> str:
    """A markdown table of the runs."""
    lines = [
        "| CMS | params | A loss after A | A loss after B | forgetting on A | "
        "same, end of stream (adapted) | B loss after B |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['parameters']:,} | {r['after_A']['val_A']:.3f} | {r['after_B']['val_A']:.3f} | "
            f"{r['forgetting_A']:+.3f} | {r['after_B']['val_A_adapted']:.3f} "
            f"({r['forgetting_A_adapted']:+.3f}) | {r['after_B']['val_B']:.3f} |"
        )
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results.items():
        steps = [c["step"] for c in r["curve"]]
        line = ax.plot(steps, [c["val_A"] for c in r["curve"]], label=f"{name}: task A")[0]
        ax.plot(
            steps, [c["val_B"] for c in r["curve"]], "--", color=line.get_color(), label=f"{name}: task B"
        )
    half = max(c["step"] for r in results.values() for c in r["curve"] if c["phase"] == "A")
    ax.axvline(half, color="grey", lw=0.8)
    ax.set_xlabel("step (task A, then task B)")
    ax.set_ylabel("validation loss (nats/char)")
    ax.set_title("Continual learning: forgetting of task A")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_commands(sub) -> None:
    p = sub.add_parser(
        "continual", help="train on task A then B, measure forgetting of A (1 vs multi-level CMS)"
    )
    p.add_argument("--model", default="hope_attention")
    p.add_argument("--levels", default="1,3", help="comma-separated CMS depths to compare")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per task")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-len", type=int, default=512, help="validation stream length (tokens)")
    p.add_argument("--out", default="runs/continual")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_cmd)


def _cmd(args) -> int:
    levels = [int(x) for x in args.levels.split(",")]
    results = run(
        args.model,
        levels,
        args.steps,
        args.d_model,
        args.n_layers,
        args.seq_len,
        args.batch_size,
        args.lr,
        seed=args.seed,
        eval_len=args.eval_len,
        out=args.out,
        progress=not args.no_progress,
    )
    print(table(results))
    print(f"\nwrote {Path(args.out) / 'continual.json'} and continual.png")
    return 0
