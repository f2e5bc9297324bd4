"""MoE vs dense at equal active parameters on tinyshakespeare (docs/results/moe.md).

Trains ``gated_deltanet_hybrid`` (dense SwiGLU, hidden H) and ``gated_deltanet_attention_moe``
(E experts, top-2, each hidden H/2: the same active MLP parameters per token) at a small width for
a short budget, for each seed, and prints one markdown table: final validation loss (nats/char),
bits per char, total and active parameters, wall time, and the final expert loads of the MoE runs.

    OMP_NUM_THREADS=1 python scripts/moe_experiment.py --steps 400 --seeds 0 1 --out runs/moe_exp

Each run's metrics.jsonl stays under --out. One thread (torch.set_num_threads(1)).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from mnemo.models import LanguageModel
from mnemo.train import TrainConfig, Trainer

D_MODEL, N_LAYERS, DENSE_HIDDEN = 64, 4, 192
PATTERN = ["gated_deltanet", "gated_deltanet", "gated_deltanet", "attention"]
MIXERS = {"gated_deltanet": {"n_heads": 2}, "attention": {"n_heads": 2}}
NAMES = ("gated_deltanet_hybrid", "gated_deltanet_attention_moe")


def overrides(moe: bool, balancing: str) -> dict:
    o = {
        "d_model": D_MODEL,
        "n_layers": N_LAYERS,
        "pattern": PATTERN,
        "mixer_options": MIXERS,
        "mlp_hidden": DENSE_HIDDEN,
    }
    if moe:
        opts = {"n_experts": 8, "top_k": 2, "expert_hidden": DENSE_HIDDEN // 2}
        if balancing == "aux":
            opts |= {"aux_loss_coef": 0.01}
        else:  # auxiliary-loss-free bias balancing
            opts |= {"aux_loss_coef": 0.0, "bias_balancing": True, "bias_update_rate": 1e-3}
        o["mlp_options"] = opts
    return o


def active_parameters(model: LanguageModel) -> int:
    """Parameters a token uses: everything but the experts it is not routed to."""
    total = model.num_parameters()
    for _, m in model.moe_layers():
        per_expert = m.w_in[0].numel() + m.w_out[0].numel()
        total -= (m.n_experts - m.top_k) * per_expert
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--balancing", choices=["aux", "bias"], default="aux")
    ap.add_argument("--out", default="runs/moe_experiment")
    ap.add_argument("--models", nargs="+", default=list(NAMES), choices=NAMES)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name in args.models:
        moe = name.endswith("moe")
        for seed in args.seeds:
            cfg = TrainConfig(
                model=name,
                model_overrides=overrides(moe, args.balancing),
                seq_len=128,
                batch_size=16,
                steps=args.steps,
                eval_interval=max(args.steps // 4, 1),
                eval_batches=8,
                lr=3e-3,
                warmup_steps=30,
                seed=seed,
                sample_tokens=0,
            )
            out = (
                Path(args.out) / f"{name}-{args.balancing}-s{seed}"
                if moe
                else Path(args.out) / f"{name}-s{seed}"
            )
            t0, c0 = time.perf_counter(), time.process_time()
            tr = Trainer(cfg, out, progress=False, log=lambda *a, **k: None)
            rec = tr.fit()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            row = {
                "model": name,
                "seed": seed,
                "val_loss": rec["val_loss"],
                "val_bpc": rec["val_bpc"],
                "params": tr.model.num_parameters(),
                "active": active_parameters(tr.model),
                "wall_s": wall,
                "cpu_s": cpu,
                "load": rec.get("moe_load"),
                "load_max": rec.get("moe_load_max"),
                "load_min": rec.get("moe_load_min"),
                "aux": rec.get("moe_aux_loss"),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| model | seed | val loss | bpc | params | active | wall s | CPU s | load min / max |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        load = f"{r['load_min']:.3f} / {r['load_max']:.3f}" if r["load"] else "—"
        print(
            f"| {r['model']} | {r['seed']} | {r['val_loss']:.4f} | {r['val_bpc']:.4f} | {r['params']:,} | "
            f"{r['active']:,} | {r['wall_s']:.0f} | {r['cpu_s']:.0f} | {load} |"
        )
    for name in args.models:
        v = [r["val_loss"] for r in rows if r["model"] == name]
        spread = f" ± {statistics.stdev(v):.4f} (sd)" if len(v) > 1 else ""
        print(f"{name}: mean val loss {statistics.mean(v):.4f}{spread} over seeds {args.seeds}")


if __name__ == "__main__":
    main()
