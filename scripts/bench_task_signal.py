"""Training-step time of the HOPE presets with the task objective over the reconstruction objective.

One process, interleaved (the two models alternate, in both orders, so a drift of the CPU's speed
hits both alike). A step is forward, mean next-token loss, backward and an AdamW step on one batch;
each CMS level of periods 8/16/32 gets the named objective. Prints per preset and size the median
step times and the median of the per-round ratios task / reconstruction (with min and max).

    python scripts/bench_task_signal.py [--models hope_attention,hope] [--sizes 64x2x128x4,256x2x256x8]
        [--rounds 9] [--threads 2]

``--sizes`` entries are ``d_model x n_layers x T x B``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from mnemo.argtypes import positive_int  # (a count or size of 0 or less is refused by name)
from mnemo.models import LanguageModel, build_config

VOCAB = 256


def _model(name: str, objective: str, d: int, layers: int) -> LanguageModel:
    levels = [{"period": p, "objective": objective} for p in (8, 16, 32)]
    torch.manual_seed(0)
    cfg = build_config(name, vocab_size=VOCAB, d_model=d, n_layers=layers, mlp_options={"levels": levels})
    return LanguageModel(cfg)


def _step(model, opt, ids) -> float:
    t0 = time.perf_counter()
    logits, _ = model(ids[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return time.perf_counter() - t0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="hope_attention,hope")
    ap.add_argument("--sizes", default="64x2x128x4")
    ap.add_argument("--rounds", type=positive_int, default=9)
    ap.add_argument("--threads", type=positive_int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    for size in args.sizes.split(","):
        d, layers, T, B = (int(v) for v in size.split("x"))
        ids = torch.randint(0, VOCAB, (B, T + 1), generator=torch.Generator().manual_seed(0))
        for name in args.models.split(","):
            models = {o: _model(name, o, d, layers) for o in ("reconstruction", "task")}
            opts = {o: torch.optim.AdamW(m.parameters(), 1e-3) for o, m in models.items()}
            for o in models:  # warm-up
                _step(models[o], opts[o], ids)
            times = {o: [] for o in models}
            for r in range(args.rounds):
                for o in ("reconstruction", "task") if r % 2 == 0 else ("task", "reconstruction"):
                    times[o].append(_step(models[o], opts[o], ids))
            ratios = [a / b for a, b in zip(times["task"], times["reconstruction"])]
            print(
                f"{name:15s} d={d} L={layers} T={T} B={B}: reconstruction "
                f"{statistics.median(times['reconstruction']) * 1e3:7.1f} ms, task "
                f"{statistics.median(times['task']) * 1e3:7.1f} ms, task/reconstruction median "
                f"{statistics.median(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f})",
                flush=True,
            )


if __name__ == "__main__":
    main()
