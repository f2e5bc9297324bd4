"""Activation patching on the 2-layer phase-change model: which heads carry the induction signal?

Clean input: a random segment A repeated ([A, A]); corrupted input: the first occurrence replaced by
other random tokens ([B, A]), so the second half cannot be predicted by copying. Each head's output
(``hook_o``) is patched from the clean run into the corrupted one, one head at a time, and the
next-token loss on the second half (clean targets) is measured; the figure shows the restored
fraction ``(corrupted − patched) / (corrupted − clean)``.

    mnemo train --config configs/circuits/phase_change_2layer.yaml --out runs/phase-2layer
    python scripts/patching_phase_change.py --checkpoint runs/phase-2layer \
        --out docs/figures/patching_phase_change_2layer.png
"""

from __future__ import annotations

import argparse
import json

import torch

from mnemo.interp.interventions import activation_patching, next_token_loss, patching_figure
from mnemo.models import LanguageModel
from mnemo.train import resolve_checkpoint


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--length", type=int, default=24, help="segment length (tokens)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="PNG path")
    args = p.parse_args()
    ckpt = resolve_checkpoint(args.checkpoint)
    model = LanguageModel.from_pretrained(ckpt).eval()
    g = torch.Generator().manual_seed(args.seed)
    V, L = model.config.vocab_size, args.length
    a = torch.randint(1, V, (args.batch, L), generator=g)
    b = torch.randint(1, V, (args.batch, L), generator=g)
    clean, corrupted = torch.cat([a, a], 1), torch.cat([b, a], 1)
    second_half = list(range(L, 2 * L - 1))  # targets inside the repeated segment
    metric = next_token_loss(clean, positions=second_half)
    with torch.no_grad():
        res = activation_patching(model, clean, corrupted, metric, names="hook_o", per="head")
    fig = patching_figure(res, title=f"activation patching of hook_o, per head · {ckpt}")
    fig.savefig(args.out, dpi=120, bbox_inches="tight")
    print(
        json.dumps(
            {
                "checkpoint": str(ckpt),
                "clean": float(res.clean),
                "corrupted": float(res.corrupted),
                "restored": res.restored.tolist(),
            }
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
