"""Why a ``mnemo continual`` run diverges: retrain it step by step as ``train_one`` does and print
how close each CMS level's inner step comes to gradient descent's stability limit
(:func:`mnemo.commands.continual.inner_step_stats`: ``bound`` > 2 overshoots) every ``--every``
steps and on the batch whose loss is non-finite, with the fast weights' largest magnitude.

    OMP_NUM_THREADS=1 python scripts/cms_divergence.py --model cms-3 --lr 1e-2 --seed 0 --task n=48 \\
        --periods 1,4,16 --slow-rate-lr-scale 10 --steps 1500 --warmup 150

The arguments mirror ``mnemo continual --experiment retention`` (the run is the same run: the same
seed gives the same initialisation and training streams).
"""

from __future__ import annotations

import argparse
import math

import torch

from mnemo.commands.continual import (
    DEFAULTS,
    ContinualNet,
    Settings,
    _loss,
    inner_step_stats,
    make_task,
    model_specs,
)
from mnemo.train.config import TrainConfig
from mnemo.train.optim import lr_factor, make_optimizer


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experiment", default="retention", choices=sorted(DEFAULTS))
    p.add_argument("--model", default="cms-3")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--warmup", type=int, default=150)
    p.add_argument("--periods", default="1,4,16")
    p.add_argument("--slow-rate-lr-scale", type=float, default=10.0)
    p.add_argument("--task", action="append", default=[], metavar="KEY=INT")
    p.add_argument("--rate-per-period", action="store_true", help="Level.rate_per_period on every level")
    p.add_argument("--nlms", action="store_true", help="Level.nlms on every level")
    p.add_argument("--every", type=int, default=10, help="print the stats every N steps (default 10)")
    p.add_argument("--stop", type=int, default=None, help="stop after N steps (default: --steps)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    task_sizes = {k: int(v) for k, v in (t.split("=", 1) for t in args.task)}
    periods = tuple(int(x) for x in args.periods.split(","))
    s = Settings(
        **{
            **vars(DEFAULTS[args.experiment]),
            "steps": args.steps, "lr": args.lr, "warmup": args.warmup, "periods": periods,
            "slow_rate_lr_scale": args.slow_rate_lr_scale, "task": task_sizes,
            "rate_per_period": args.rate_per_period, "nlms": args.nlms,
        }
    )  # fmt: skip
    task = make_task(args.experiment, **task_sizes)
    levels = model_specs(s.d_model, s.expansion, s.periods, rate_per_period=s.rate_per_period, nlms=s.nlms)[
        args.model
    ]
    # as mnemo.commands.continual.train_one: the seed, then the model, then the streams' generator
    torch.manual_seed(args.seed)
    model = ContinualNet(task.vocab_size, s.d_model, levels, 0, s.slow_rate_lr_scale)
    tcfg = TrainConfig(lr=s.lr, steps=s.steps, warmup_steps=min(s.warmup, s.steps), weight_decay=0.0)
    opt = make_optimizer(model, tcfg)
    gen = torch.Generator().manual_seed(args.seed)
    base = [g["lr"] for g in opt.param_groups]
    print("step  loss    per level (period): bound = max Σ_t η_t‖a_t‖² (>2 overshoots), Σσ max, ‖a‖² max")
    for step in range(args.stop or s.steps):
        for g, b0 in zip(opt.param_groups, base):
            g["lr"] = b0 * lr_factor(step, tcfg.warmup_steps, s.steps, tcfg.min_lr_ratio)
        b = task.batch(s.batch_size, gen)
        loss, _ = _loss(model, b)
        bad = not math.isfinite(loss.item())
        if bad or step % args.every == 0:
            stats = inner_step_stats(model, b.ids)
            cells = "  ".join(
                f"L{r['level']}({r['period']}): {r['bound']:.3g}, {r['summed_sigma_max']:.3g}, "
                f"{r['a2_max']:.3g}"
                for r in stats
            )
            print(f"{step + 1:5d} {loss.item():7.3f}  {cells}", flush=True)
        if bad:
            print(f"non-finite loss at step {step + 1} (the weights after step {step})")
            return 1
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):  # as train_one: the last
        print(f"non-finite weights after the last step ({args.stop or s.steps}): a non-finite gradient")
        return 1
    print("no divergence")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
