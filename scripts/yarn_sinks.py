"""YaRN extrapolation and attention-sink streaming on a small transformer trained at a short length.

Trains the registered ``transformer`` (d_model 128, 4 layers, RoPE) on the default corpus
(tinyshakespeare, char level) at ``--seq-len`` tokens for each seed with ``mnemo train``, then:

1. **YaRN** (Peng et al. 2023): validation loss at 1×, 2×, 4×, 8× the training length with plain
   RoPE and with YaRN applied at evaluation time (no fine-tuning; factor = length / training
   length, original context = the training length) — the measurement ``mnemo eval --length
   64,128,256,512 [--yarn]`` prints (checked against it), plus the loss on the positions beyond the
   training length only, and a YaRN variant with ``beta_fast = 8``.
2. **Attention sinks** (Xiao et al. 2023): loss on streams of ``--stream`` tokens (16× the window)
   with full attention, a window-only cache (``window = W``), a window + 4 sinks with the same cache
   size (``n_sink = 4``, ``window = W − 4``), and sliding windows re-computed from scratch for every
   token (the paper's oracle baseline), per position range. One stream is also decoded token by
   token with the sink cache and compared with the parallel form.

    python scripts/yarn_sinks.py --out runs/yarn_sinks            # trains (or reuses) and prints tables
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch

from mnemo.data import load_corpus, load_tokenizer
from mnemo.interp import sink_score
from mnemo.models import LanguageModel
from mnemo.train import resolve_checkpoint
from mnemo.train.batches import with_bos


def train(out: Path, seed: int, seq_len: int, batch_size: int, steps: int) -> float:
    """``mnemo train`` for one seed (skipped when the run exists); returns the wall time (s)."""
    if (out / "latest").is_file():
        return (
            json.loads((out / "wall.json").read_text())["wall_s"]
            if (out / "wall.json").is_file()
            else math.nan
        )
    cmd = [sys.executable, "-m", "mnemo.cli", "train", "--model", "transformer", "--out", str(out)]
    cmd += ["--seq-len", str(seq_len), "--batch-size", str(batch_size), "--steps", str(steps)]
    cmd += ["--eval-interval", str(steps), "--eval-batches", "8", "--seed", str(seed)]
    cmd += ["--sample-tokens", "0", "--no-progress"]
    t0 = time.time()
    subprocess.run(cmd, check=True)
    wall = time.time() - t0
    (out / "wall.json").write_text(json.dumps({"wall_s": wall, "command": " ".join(cmd[1:])}))
    return wall


def set_yarn(model, scaling):
    for m in model.modules():
        if hasattr(m, "set_rope_scaling") and getattr(m, "rotary", None) is not None:
            m.set_rope_scaling(scaling)


def set_window(model, window, n_sink):
    for m in model.modules():
        if hasattr(m, "n_sink") and hasattr(m, "window"):
            m.window, m.n_sink = window, n_sink


@torch.no_grad()
def token_losses(model, x, y) -> torch.Tensor:
    logits, _ = model(x)
    return torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), y, reduction="none")  # [B, T]


def yarn_table(ckpt, train_len, lengths, batch_size, max_batches):
    model = LanguageModel.from_pretrained(ckpt).eval()
    tok = load_tokenizer(ckpt)
    val = load_corpus("tinyshakespeare").split()[1]
    variants = {
        "RoPE": lambda L: None,
        "YaRN": lambda L: {
            "rope_type": "yarn",
            "factor": L / train_len,
            "original_max_position_embeddings": train_len,
        },
        "YaRN beta_fast=8": lambda L: {
            "rope_type": "yarn",
            "factor": L / train_len,
            "original_max_position_embeddings": train_len,
            "beta_fast": 8,
        },
    }
    out = {}
    for name, scaling in variants.items():
        for L in lengths:
            set_yarn(model, scaling(L) if L > train_len else None)
            stream = val.stream(tok, L)
            losses = torch.cat(
                [token_losses(model, x, y) for x, y in stream.eval_batches(batch_size, max_batches)]
            )
            out[name, L] = (
                losses.mean().item(),
                losses[:, train_len:].mean().item() if L > train_len else math.nan,
            )
    set_yarn(model, None)
    return out


def cli_eval(ckpt, lengths, yarn: bool) -> dict[int, float]:
    from mnemo.cli import main

    buf = io.StringIO()
    argv = ["eval", "--checkpoint", str(ckpt), "--length", ",".join(map(str, lengths))] + (
        ["--yarn"] if yarn else []
    )
    with contextlib.redirect_stdout(buf):
        assert main(argv) == 0
    return {r["seq_len"]: r["val_loss"] for r in map(json.loads, buf.getvalue().strip().splitlines())}


def sink_table(ckpt, window, n_sink, stream_len, n_streams, ranges, bos=None):
    """Loss per position range on ``n_streams`` validation streams under each cache; ``bos`` (a
    token id, for a model trained with ``--bos``): every stream starts with it, and the
    re-computed sliding windows are ``[BOS, last W − 1 tokens]``."""
    model = LanguageModel.from_pretrained(ckpt).eval()
    tok = load_tokenizer(ckpt)
    ids = load_corpus("tinyshakespeare").split()[1].stream(tok, stream_len).ids
    starts = torch.arange(n_streams) * (stream_len + 1)
    idx = starts[:, None] + torch.arange(stream_len + 1)[None]
    x, y = with_bos(ids[idx][:, :-1], bos), ids[idx][:, 1:]
    rows = {}
    for name, w, s in (
        ("full attention", None, 0),
        (f"window {window} (no sinks)", window, 0),
        (f"window {window - n_sink} + {n_sink} sinks", window - n_sink, n_sink),
        (f"window {window - 1} + 1 sink", window - 1, 1),
    ):
        set_window(model, w, s)
        rows[name] = token_losses(model, x, y)
    set_window(model, None, 0)
    # sliding window with re-computation: token t predicted from tokens t−W+1 … t run from scratch
    # (for t < W that is the full-attention prefix)
    W = window
    losses = rows["full attention"].clone()
    wins = x.unfold(1, W, 1)  # [B, T − W + 1, W]: window ending at t = W − 1 + n
    flat = with_bos(wins.reshape(-1, W), bos)
    last = []
    with torch.no_grad():
        for i in range(0, flat.shape[0], 512):
            logits, _ = model(flat[i : i + 512])
            last.append(logits[:, -1].float())
    last = torch.cat(last).view(n_streams, -1, logits.shape[-1])
    losses[:, W - 1 :] = torch.nn.functional.cross_entropy(
        last.transpose(1, 2), y[:, W - 1 :], reduction="none"
    )
    rows["sliding window, re-computed"] = losses
    table = {name: [v[:, a:b].mean().item() for a, b in ranges] for name, v in rows.items()}
    # decoding with the sink cache, token by token, equals the parallel form
    set_window(model, window - n_sink, n_sink)
    with torch.no_grad():
        par, _ = model(x[:1])
        state, steps = None, []
        for t in range(stream_len):
            lg, state = model(x[:1, t : t + 1], state)
            steps.append(lg)
        cache = max(s.mixer.kv.k.shape[1] for s in state)
    diff = (torch.cat(steps, 1) - par).abs().max().item()
    return table, diff, cache


def first_token_mass(ckpt, length: int, n: int = 8, bos=None, per_head: bool = False) -> list:
    """Per layer: the mean attention probability on the window's first token from queries in the
    second half of ``n`` validation windows of ``length`` tokens (max over heads;
    :func:`mnemo.interp.sink_score`), to compare with the ``1 / (i + 1)`` of uniform attention — a
    sink takes far more. ``bos``: the windows start with that token id. ``per_head``: every
    head's weight (a list per layer) instead of the largest."""
    model = LanguageModel.from_pretrained(ckpt).eval()
    ids = load_corpus("tinyshakespeare").split()[1].stream(load_tokenizer(ckpt), length).ids
    x = with_bos(ids[: n * length].view(n, length), bos)
    with torch.no_grad():
        _, cache = model.run_with_cache(x, names="hook_pattern")
    heads = [sink_score(cache[f"blocks.{i}.mixer.hook_pattern"])[0] for i in range(len(model.blocks))]
    return [h.tolist() for h in heads] if per_head else [h.max().item() for h in heads]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/yarn_sinks")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--stream", type=int, default=1024, help="stream length for the sink table")
    p.add_argument("--window", type=int, default=64, help="cache size of the sink table (window + sinks)")
    p.add_argument(
        "--sink-seq-len",
        type=int,
        default=256,
        help="also train at this length (same tokens per step) for the sink table: a window shorter "
        "than the training length, as in the paper",
    )
    p.add_argument("--streams", type=int, default=8)
    args = p.parse_args()
    torch.set_num_threads(1)
    seeds = [int(s) for s in args.seeds.split(",")]
    L0 = args.seq_len
    lengths = [L0, 2 * L0, 4 * L0, 8 * L0]
    W = args.window
    ranges = [(0, W), (W, 4 * W), (4 * W, args.stream), (args.stream - 256, args.stream)]
    yarn_all, sink_all, long_all, report = [], [], [], {"seeds": seeds}
    for seed in seeds:
        run = Path(args.out) / f"seed{seed}"
        wall = train(run, seed, L0, args.batch_size, args.steps)
        ckpt = resolve_checkpoint(run)
        t0 = time.time()
        yt = yarn_table(ckpt, L0, lengths, 16, 8)
        cli = {"RoPE": cli_eval(ckpt, lengths, False), "YaRN": cli_eval(ckpt, lengths, True)}
        for name in cli:
            for L in lengths:
                assert abs(cli[name][L] - yt[name, L][0]) < 1e-4, (name, L, cli[name][L], yt[name, L])
        t1 = time.time()
        st, diff, cache = sink_table(ckpt, W, 4, args.stream, args.streams, ranges)
        t2 = time.time()
        long_run = Path(args.out) / f"len{args.sink_seq_len}-seed{seed}"
        long_batch = max(1, args.batch_size * L0 // args.sink_seq_len)
        long_wall = train(long_run, seed, args.sink_seq_len, long_batch, args.steps)
        t3 = time.time()
        lt, long_diff, _ = sink_table(resolve_checkpoint(long_run), W, 4, args.stream, args.streams, ranges)
        mass = {
            L0: first_token_mass(ckpt, L0),
            args.sink_seq_len: first_token_mass(resolve_checkpoint(long_run), args.sink_seq_len),
        }
        t4 = time.time()
        yarn_all.append(yt)
        sink_all.append(st)
        long_all.append(lt)
        report[f"seed{seed}"] = {
            "train_wall_s": wall,
            "yarn_eval_wall_s": t1 - t0,
            "sink_eval_wall_s": t2 - t1,
            "decode_vs_parallel_max_abs_logit_diff": diff,
            "max_cache_len": cache,
            f"train_len{args.sink_seq_len}_wall_s": long_wall,
            f"sink_eval_len{args.sink_seq_len}_wall_s": t4 - t3,
            f"decode_vs_parallel_len{args.sink_seq_len}": long_diff,
            "first_token_attention_per_layer": {str(k): v for k, v in mass.items()},
            "uniform_attention_second_half": {
                str(k): sum(1 / (i + 1) for i in range(k // 2, k)) / (k - k // 2) for k in mass
            },
        }
        print(json.dumps(report[f"seed{seed}"]), flush=True)

    def cell(values):
        values = [v for v in values if not math.isnan(v)]
        if not values:
            return "–"
        m = sum(values) / len(values)
        return f"{m:.3f} ± {(max(values) - min(values)) / 2:.3f}"

    print(f"\nYaRN: validation loss (nats/char), mean ± half-range over seeds {seeds}; training length {L0}")
    print("| variant | " + " | ".join(f"{L // L0}× ({L})" for L in lengths) + " |")
    print("|---|" + "---|" * len(lengths))
    for name in ("RoPE", "YaRN", "YaRN beta_fast=8"):
        print(
            f"| {name}, all positions | "
            + " | ".join(cell([t[name, L][0] for t in yarn_all]) for L in lengths)
            + " |"
        )
    for name in ("RoPE", "YaRN", "YaRN beta_fast=8"):
        print(
            f"| {name}, positions ≥ {L0} | "
            + " | ".join(cell([t[name, L][1] for t in yarn_all]) for L in lengths)
            + " |"
        )
    for train_len, tables in ((L0, sink_all), (args.sink_seq_len, long_all)):
        print(
            f"\nSinks: loss (nats/char) on {args.streams} streams of {args.stream} tokens, by position "
            f"range; model trained at {train_len} tokens"
        )
        print("| cache | " + " | ".join(f"[{a}, {b})" for a, b in ranges) + " |")
        print("|---|" + "---|" * len(ranges))
        for name in tables[0]:
            print(
                f"| {name} | "
                + " | ".join(cell([t[name][i] for t in tables]) for i in range(len(ranges)))
                + " |"
            )
    Path(args.out, "report.json").write_text(
        json.dumps(
            {
                **report,
                "yarn": [{f"{k[0]}@{k[1]}": v for k, v in t.items()} for t in yarn_all],
                "sinks": sink_all,
                f"sinks_len{args.sink_seq_len}": long_all,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
