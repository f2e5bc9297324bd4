"""Rebuild docs/results/context_extension.md: RoPE scalings fine-tuned at 4x the training length.

Stage 1 trains (or resumes) one passkey model per seed at T = 128
(``configs/context_extension/pretrain.yaml`` → ``runs/context_extension/pretrain-seedS``,
the seeds of stage 2's sweep); stage 2 is ``mnemo reproduce docs/results/context_extension.md``: the
sweep ``configs/standard/context_extension.yaml`` fine-tunes every seed's model at T = 512 with each
scaling (``init_from: .../pretrain-seed{seed}``) and rewrites the page's tables and claims. Both
stages resume: a finished run is never trained again, an interrupted one continues from its last
checkpoint. Between them, the zero-shot stage evaluates each stage-1 model with each scaling set at
evaluation time only (no training: every seed reported) and rewrites its own block of the page.

    python scripts/context_extension.py                 # every stage, two runs at a time
    python scripts/context_extension.py --stage 1       # only the pretrained models
    python scripts/context_extension.py --stage zero-shot
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from mnemo.sweep import SweepSpec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_runs import train_runs  # noqa: E402  (the scripts folder)

PRETRAIN = "configs/context_extension/pretrain.yaml"
SWEEP = "configs/standard/context_extension.yaml"
PAGE = "docs/results/context_extension.md"


def pretrain_commands(spec: SweepSpec, config: str, threads: int) -> list[tuple[Path, list[str]]]:
    """``(run folder, mnemo train argv)`` per seed of ``spec`` whose stage-1 run its
    ``init_from`` names; ``--resume`` where the folder already holds a checkpoint."""
    template = spec.base.get("init_from")
    if not isinstance(template, str) or "{seed}" not in template:
        raise SystemExit(f"{SWEEP}: base.init_from must name the stage-1 run with {{seed}}, got {template!r}")
    out = []
    for seed in spec.seeds or [0]:
        run = Path(template.replace("{seed}", str(seed)))
        argv = [sys.executable, "-m", "mnemo.cli", "train", "--config", config, "--seed", str(seed)]
        argv += ["--out", str(run), "--threads", str(threads), "--no-progress"]
        if (run / "latest").is_file():
            argv.append("--resume")
        out.append((run, argv))
    return out


def scalings(spec: SweepSpec) -> dict[str, dict | None]:
    """Each method's ``rope_scaling`` as the sweep file gives it (``None``: plain RoPE), by label."""
    out = {}
    for m in spec.models:
        opts = (m.get("model_overrides") or {}).get("mixer_options", {}).get("attention", {})
        out[m["label"]] = opts.get("rope_scaling")
    return out


def scaled(scaling: dict | None, factor: float) -> dict | None:
    """``scaling`` with its ``factor`` replaced (``None`` at factor 1 or for plain RoPE)."""
    return None if scaling is None or factor == 1 else {**scaling, "factor": factor}


def zero_shot(spec: SweepSpec, lengths: list[int], num_samples: int) -> dict:
    """Every stage-1 model with each method's scaling applied at evaluation time only (factor =
    length / training length, as ``mnemo eval --yarn`` does): exact match per method, length and
    seed. No training, so no learning rate: every seed is reported."""
    import torch

    from mnemo.models import LanguageModel
    from mnemo.train import TrainConfig, resolve_checkpoint
    from mnemo.train.checkpoint import TRAIN_CONFIG_NAME, load_json
    from mnemo.train.task_eval import evaluate_task

    torch.set_num_threads(1)
    template = spec.base["init_from"]
    out: dict = {}
    for seed in spec.seeds or [0]:
        ckpt = resolve_checkpoint(template.replace("{seed}", str(seed)))
        cfg = TrainConfig.from_dict(load_json(ckpt / TRAIN_CONFIG_NAME))
        model = LanguageModel.from_pretrained(ckpt).eval()
        layers = [m for m in model.modules() if getattr(m, "rotary", None) is not None]
        for label, scaling in scalings(spec).items():
            for L in lengths:
                for m in layers:
                    m.set_rope_scaling(scaled(scaling, L / cfg.seq_len))
                res = evaluate_task(
                    model,
                    cfg.build_task(),
                    [L],
                    num_samples=num_samples,
                    batch_size=16,
                    train_len=L,
                    seed=cfg.seed,
                )[L]
                out.setdefault(label, {}).setdefault(L, {})[seed] = res["seq_acc"]
    return out


def zero_shot_block(results: dict, claims: list[dict], num_samples: int, wall_s: float) -> str:
    """The page's zero-shot table (exact match, mean [95% CI] over the seeds) and its claims,
    paired by seed at each length (:func:`mnemo.sweep.recipe.judge_claim`)."""
    from mnemo.sweep.recipe import claims_markdown, judge_claim
    from mnemo.sweep.stats import mean_interval

    labels = list(results)
    lengths = sorted(next(iter(results.values())))
    seeds = sorted(next(iter(results[labels[0]].values())))

    def cell(values):
        st = mean_interval(values)
        return f"{st['mean']:.3f} [{st['low']:.3f}, {st['high']:.3f}]" if st["low"] is not None else "–"

    lines = [
        "*Generated by `python scripts/context_extension.py` (zero-shot stage); edits between these "
        f"markers are replaced.* Exact match of the passkey on {num_samples} test sequences per seed "
        f"and length, mean over seeds {', '.join(map(str, seeds))} with its 95% Student-t interval in "
        "brackets; the scaling is set at "
        "evaluation time with factor = length / 128, nothing is trained.",
        "",
        "| method | " + " | ".join(f"{L} ({L // 128}×)" for L in lengths) + " |",
        "|---|" + "---|" * len(lengths),
    ]
    for label in labels:
        lines.append(
            f"| {label} | " + " | ".join(cell(list(results[label][L].values())) for L in lengths) + " |"
        )
    judged = []
    for L in lengths[1:] if len(lengths) > 1 else lengths:
        for c in claims:
            a = {"seeds": seeds, "values": [results[c["better"]][L][s] for s in seeds], "plateau": None}
            b = {"seeds": seeds, "values": [results[c["than"]][L][s] for s in seeds], "plateau": None}
            name = f"{c['better']} extends the context better than {c['than']} without fine-tuning"
            j = judge_claim({**c, "name": name}, a, b, metric="val_seq_acc", threshold=0.99)
            judged.append({**j, "claim": f"{j['claim']} (at {L} tokens)"})
    lines += ["", claims_markdown(judged), "", f"Wall time: {wall_s / 60:.1f} min (evaluation only)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--stage",
        choices=["1", "zero-shot", "2", "all"],
        default="all",
        help="1: pretrain; zero-shot: each scaling at evaluation time only; 2: the fine-tuning sweep (all)",
    )
    p.add_argument("--samples", type=int, default=256, help="test sequences per seed and length, zero-shot")
    p.add_argument("--jobs", type=int, default=2, help="runs trained at once (2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run (1)")
    args = p.parse_args(argv)
    if args.jobs < 1 or args.threads < 1:
        p.error(f"--jobs and --threads must be >= 1, got {args.jobs} and {args.threads}")
    spec = SweepSpec.load(SWEEP)
    if args.stage in ("1", "all"):
        train_runs(pretrain_commands(spec, PRETRAIN, args.threads), args.jobs, label="stage 1")
    if args.stage in ("zero-shot", "all"):
        import time

        from mnemo.sweep.reproduce import _replace_block

        t0 = time.time()
        res = zero_shot(spec, [256, 512, 1024], args.samples)
        Path("runs/context_extension").mkdir(parents=True, exist_ok=True)
        Path("runs/context_extension/zero_shot.json").write_text(json.dumps(res, indent=1))
        block = zero_shot_block(res, spec.claims, args.samples, time.time() - t0)
        print(block, flush=True)
        page = Path(PAGE)
        tmp = page.with_name(page.name + ".tmp")
        tmp.write_text(_replace_block(page.read_text(), "context_extension_zero_shot", block, page))
        tmp.replace(page)
    if args.stage in ("2", "all"):
        cmd = [sys.executable, "-m", "mnemo.cli", "reproduce", PAGE, "--jobs", str(args.jobs)]
        cmd += ["--threads", str(args.threads)]
        return subprocess.run(cmd).returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
