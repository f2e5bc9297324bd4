"""``mnemo continual``: does a multi-frequency Continuum Memory System forget less *in context*?

The Nested Learning claim under test (Behrouz et al. 2025, §7.1): a CMS whose levels update at
several frequencies (level ``ℓ`` takes one inner step every ``C^(ℓ)`` tokens) keeps old in-context
knowledge longer than a single-frequency memory. Every experiment here is an *in-context* task:
each stream draws fresh random associations, so nothing about them can be stored in the slow
(outer-loop) weights, and the models have **no attention** — the only thing that can carry a
stream's earlier content to its end is the CMS fast weights.

The model (:class:`ContinualNet`), identical for every task::

    h_t = E[x_t] + P[x_{t−1}] (+ U f_t + V f_{t−1} for vector inputs)     one-token lag, no mixer
    y, state = ContinuumMemory(h)                                           the only memory
    logits_t = head(LayerNorm(h_t + y_t))

The one-token lag lets a key and its value meet in one position: at a value token ``v`` preceded by
its key ``k``, ``h = E[v] + P[k]``; a query is written ``k ?`` so that at ``?``, ``h = E[?] + P[k]``
— the same ``P[k]`` under which the pair was written — and the answer is predicted there.

Models compared (defaults: ``d_model = 16``, per-level expansion ``e = 1``, periods ``1, 4, 16, 64``):

* ``cms-1`` … ``cms-4``: the first 1…4 levels of that chain (learned inner rates, ``lr = 1``);
* ``static-4``: ``cms-4`` with every level's ``lr = 0`` (its fast weights never move: a static MLP
  chain; no in-context learning — chance level is the floor);
* ``wide-1``: one period-1 level whose hidden width is chosen so its parameter count matches
  ``cms-4`` (the capacity control: same parameters, one frequency).

Tasks (all positions unsupervised except the query answers; ``?`` is the query marker):

``abab`` (in-context A → B → A): keys and values are tokens (32 keys, 16 values). Each stream takes
a random permutation of the keys: the first ``n_a = 8`` form map A, the next ``n_b = 24`` map B (**disjoint
key sets**), values drawn uniformly (with replacement). Two stream types of equal length, half of
every batch each:

* *interference*: ``A pairs | B pairs | queries of all A keys and n_a random B keys, shuffled``;
* *baseline*: ``A pairs | queries of A | B pairs | queries of the same n_a B keys``.

Metrics: ``A_after_B`` (A queries of the interference stream), ``B`` (its B queries) and
``A_before_B`` (A queries of the baseline stream — the capacity baseline: what the memory recalls of
A with no B in between), ``forgetting = A_before_B − A_after_B``.

``forgetting_mqar``: ``n = 16`` keys with values, then ``m = 8`` of them reassigned to a new value
(``≠`` the old one), then queries of all ``n`` keys (shuffled); the target is the *latest* value.
Metrics: ``reassigned`` and ``untouched`` accuracy, and ``reassigned_old`` (the fraction of
reassigned queries answered with the stale value).

``class_incremental`` (in-context, within one stream): ``P`` phases, each introducing ``k`` new
classes whose labels are drawn without replacement from 16 label tokens (label sets disjoint across
phases, never seen before in the stream). A class is a random Gaussian prototype in ``R^16`` drawn
per stream; an example is ``prototype + σ·noise`` presented as a vector input followed by its label
token. Phase ``p`` shows ``s`` examples per class, then ``q`` queries per class of that phase
(``x ?``: accuracy just after learning phase ``p``, ``R[p, p]``); after the last phase ``q_final``
queries per class of every phase (final accuracy ``R[P, p]``). Metrics: ``avg_acc = mean_p R[P, p]`` and
``BWT = mean_{p<P} (R[P, p] − R[p, p])``. Defaults: ``P = 4, k = 2, s = 3, q = 1, q_final = 2, σ = 1``.

Training: every model is trained on its task by AdamW (:func:`mnemo.train.optim.make_optimizer`,
warm-up + cosine schedule, gradient clipping at 1.0), the same streams for every model of a seed.
Evaluation: ``eval_streams`` held-out streams per seed. A seed fixes the model initialisation, the
training streams and the evaluation streams. Results: mean ± 95% t-interval over seeds.

    mnemo continual --experiment all --seeds 3 --out runs/continual
"""

from __future__ import annotations

import json
import math
import platform
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from .. import argtypes as kinds
from ..data.tasks.continual import (  # noqa: F401  (the streams, also this module's names)
    BOS,
    EXPERIMENTS,
    QUERY,
    ABABTask,
    Batch,
    ClassIncrementalTask,
    ForgettingMQARTask,
    make_task,
)
from ..layers.cms import ContinuumMemory
from ..plotting import legend

# --------------------------------------------------------------------------------------------
# statistics


#: two-sided 95% Student-t quantiles t_{0.975, df} for df = 1 … 30
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def t_quantile_975(df: int) -> float:
    """``t_{0.975}`` with ``df`` degrees of freedom (table to 30, Cornish–Fisher expansion above)."""
    if df < 1:
        raise ValueError(f"df: expected an int >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def mean_ci95(values) -> dict:
    """Mean and half-width of the 95% t-interval, ``t_{0.975, n−1} · s / √n`` (``s``: sample standard
    deviation); non-finite values are dropped (and counted). ``ci95`` is ``nan`` for fewer than 2."""
    vals = [float(v) for v in values]
    good = [v for v in vals if math.isfinite(v)]
    n = len(good)
    if n == 0:
        return {"mean": float("nan"), "ci95": float("nan"), "n": 0, "dropped": len(vals)}
    mean = sum(good) / n
    if n < 2:
        half = float("nan")
    else:
        sd = math.sqrt(sum((v - mean) ** 2 for v in good) / (n - 1))
        half = t_quantile_975(n - 1) * sd / math.sqrt(n)
    return {"mean": mean, "ci95": half, "n": n, "dropped": len(vals) - n}


def backward_transfer(acc) -> float:
    """BWT of an accuracy matrix ``acc[i][j]`` (accuracy on phase ``j`` after learning phase ``i``):
    ``mean_{j < P−1} (acc[P−1][j] − acc[j][j])`` (Lopez-Paz & Ranzato 2017). Negative = forgetting."""
    P = len(acc)
    if P < 2:
        raise ValueError(f"acc: expected at least 2 phases, got {P}")
    return sum(acc[P - 1][j] - acc[j][j] for j in range(P - 1)) / (P - 1)


# --------------------------------------------------------------------------------------------
# models


class ContinualNet(nn.Module):
    """Embeddings with a one-token lag, a :class:`ContinuumMemory`, a head (module docstring).
    No attention or other mixer: the CMS fast weights are the only memory of the stream."""

    def __init__(self, vocab_size: int, d_model: int, levels, feat_dim: int = 0):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.prev = nn.Embedding(vocab_size, d_model)
        self.feat = nn.Linear(feat_dim, d_model, bias=False) if feat_dim else None
        self.feat_prev = nn.Linear(feat_dim, d_model, bias=False) if feat_dim else None
        self.cms = ContinuumMemory(d_model, levels)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, ids: torch.Tensor, feats: torch.Tensor | None = None, state=None):
        prev = F.pad(ids[:, :-1], (1, 0), value=BOS)
        h = self.embed(ids) + self.prev(prev)
        if self.feat is not None and feats is not None:
            h = h + self.feat(feats) + self.feat_prev(F.pad(feats[:, :-1], (0, 0, 1, 0)))
        y, state = self.cms(h, state)
        return self.head(self.norm(h + y)), state

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def _cms_params(d_model: int, levels) -> int:
    return sum(p.numel() for p in ContinuumMemory(d_model, levels).parameters())


def model_specs(d_model: int = 16, expansion: float = 1.0, periods=(1, 4, 16, 64), lr: float = 1.0) -> dict:
    """The compared models: name -> list of level dicts (see the module docstring)."""
    chain = [{"period": p, "expansion": expansion, "lr": lr} for p in periods]
    specs = {f"cms-{n}": chain[:n] for n in range(1, len(chain) + 1)}
    deepest = chain
    specs[f"static-{len(chain)}"] = [dict(lv, lr=0.0) for lv in deepest]
    target = _cms_params(d_model, deepest)
    per_hidden = _cms_params(d_model, [{"period": 1, "expansion": 2.0}]) - _cms_params(
        d_model, [{"period": 1, "expansion": 1.0}]
    )  # parameters per d_model hidden units
    base = _cms_params(d_model, [{"period": 1, "expansion": 1.0}]) - per_hidden
    hidden = max(1, round((target - base) / per_hidden * d_model))
    specs["wide-1"] = [{"period": periods[0], "expansion": hidden / d_model, "lr": lr}]
    return specs


# --------------------------------------------------------------------------------------------
# training and evaluation


@dataclass
class Settings:
    """One experiment's sizes (the defaults are small CPU-sized runs; docs/results/continual.md
    gives their wall times)."""

    steps: int = 200
    batch_size: int = 32
    lr: float = 1e-2
    warmup: int = 20
    eval_streams: int = 256
    d_model: int = 16
    expansion: float = 1.0
    periods: tuple = (1, 4, 16, 64)
    task: dict = field(default_factory=dict)


DEFAULTS = {
    "abab": Settings(),
    "forgetting_mqar": Settings(),
    "class_incremental": Settings(),
}


def _loss(model, b: Batch):
    logits, _ = model(b.ids, b.feats)
    return F.cross_entropy(logits.flatten(0, 1), b.targets.flatten(), ignore_index=-100), logits


@torch.no_grad()
def evaluate(model, task, gen: torch.Generator, n_streams: int, batch_size: int) -> dict:
    """Accuracy per metric over ``n_streams`` fresh streams (``alt`` rates as ``<metric>_old``)."""
    model.eval()
    hit, alt, cnt = {}, {}, {}
    done = 0
    while done < n_streams:
        b = task.batch(min(batch_size, n_streams - done), gen)
        done += b.ids.shape[0]
        pred = model(b.ids, b.feats)[0].argmax(-1)
        for name, tag in task.metrics.items():
            m = b.tags == tag
            cnt[name] = cnt.get(name, 0) + int(m.sum())
            hit[name] = hit.get(name, 0) + int((pred[m] == b.targets[m]).sum())
            am = m & (b.alt >= 0)
            if am.any():
                alt[name] = alt.get(name, 0) + int((pred[am] == b.alt[am]).sum())
    model.train()
    out = {name: hit[name] / max(1, cnt[name]) for name in task.metrics}
    out.update({f"{name}_old": alt[name] / max(1, cnt[name]) for name in alt})
    return out


def _derived(experiment: str, task, acc: dict) -> dict:
    """Experiment-level metrics from the per-tag accuracies."""
    if experiment == "abab":
        return {**acc, "forgetting": acc["A_before_B"] - acc["A_after_B"]}
    if experiment != "class_incremental":
        return acc
    P = task.phases
    R = [[float("nan")] * P for _ in range(P)]
    for p in range(P):
        R[p][p] = acc[f"just_after_{p}"]
        R[P - 1][p] = acc[f"final_{p}"]
    return {
        "avg_acc": sum(R[P - 1]) / P,
        "BWT": backward_transfer(R),
        "just_after": [R[p][p] for p in range(P)],
        "final": list(R[P - 1]),
    }


def train_one(experiment: str, task, levels, s: Settings, seed: int, bar=None) -> dict:
    """Train one model for one seed; returns its metrics, parameter count, loss and timing.

    A non-finite loss stops training; ``diverged_at_step`` names the step (1-based), the metrics are
    ``nan`` (the means drop them and count them) and ``metrics_at_divergence`` holds the evaluation of
    the weights of the last finite step."""
    from ..train.config import TrainConfig
    from ..train.optim import lr_factor, make_optimizer

    t0 = time.time()
    torch.manual_seed(seed)
    model = ContinualNet(
        task.vocab_size,
        s.d_model,
        levels,
        getattr(task, "feat_dim", 0) if experiment == "class_incremental" else 0,
    )
    tcfg = TrainConfig(lr=s.lr, steps=s.steps, warmup_steps=min(s.warmup, s.steps), weight_decay=0.0)
    opt = make_optimizer(model, tcfg)
    gen = torch.Generator().manual_seed(seed)  # the same training streams for every model of a seed
    diverged, losses = None, []
    base_lrs = [g["lr"] for g in opt.param_groups]  # per-group (outer_lr_scale) rates
    for step in range(s.steps):
        for g, base in zip(opt.param_groups, base_lrs):
            g["lr"] = base * lr_factor(step, tcfg.warmup_steps, s.steps, tcfg.min_lr_ratio)
        loss, _ = _loss(model, task.batch(s.batch_size, gen))
        if not math.isfinite(loss.item()):
            diverged = step + 1
            if bar is not None:
                bar.write(f"{experiment} seed {seed}: loss {loss.item()} at step {step + 1}; stopped")
                bar.update(s.steps - step)
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if bar is not None:
            bar.update(1)
    acc = evaluate(model, task, torch.Generator().manual_seed(10_000 + seed), s.eval_streams, 64)
    tail = losses[-max(1, len(losses) // 10) :] if losses else [float("nan")]
    metrics = _derived(experiment, task, acc)
    if diverged is not None:  # reported as NaN (dropped from the means, counted); kept for the record
        at_divergence, metrics = metrics, {k: float("nan") for k in metrics}
        metrics["metrics_at_divergence"] = at_divergence
    return {
        "seed": seed,
        **metrics,
        "accuracy_by_tag": acc,
        "final_train_loss": sum(tail) / len(tail),
        "diverged_at_step": diverged,
        "wall_s": time.time() - t0,
    }


def _scalar_metrics(experiment: str, task) -> list[str]:
    if experiment == "abab":
        return ["A_after_B", "B", "A_before_B", "forgetting", "final_train_loss"]
    if experiment == "forgetting_mqar":
        return ["reassigned", "untouched", "reassigned_old", "final_train_loss"]
    return ["avg_acc", "BWT", "final_train_loss"]


def _worker(experiment, task, levels, s, seed):
    torch.set_num_threads(1)
    return train_one(experiment, task, levels, s, seed)


def run_experiment(
    experiment: str,
    seeds: int = 3,
    settings: Settings | None = None,
    progress: bool = True,
    models=None,
    workers: int = 1,
) -> dict:
    """Every model of :func:`model_specs` on ``experiment`` for seeds ``0 … seeds−1``, ``workers``
    runs at a time (separate single-threaded processes when ``workers > 1``)."""
    s = settings or DEFAULTS[experiment]
    task = make_task(experiment, **s.task)
    specs = model_specs(s.d_model, s.expansion, s.periods)
    if models is not None:
        unknown = set(models) - set(specs)
        if unknown:
            raise ValueError(f"models: expected names from {sorted(specs)}, got {sorted(unknown)}")
        specs = {k: v for k, v in specs.items() if k in models}
    cms_md5 = _git()["cms_md5"]
    t0 = time.time()
    bar = tqdm(total=len(specs) * seeds * s.steps, disable=not progress, desc=f"continual {experiment}")
    jobs = [(name, seed) for name in specs for seed in range(seeds)]
    done = {}
    if workers <= 1:
        for name, seed in jobs:
            bar.set_postfix_str(f"{name} seed {seed}")
            done[name, seed] = train_one(experiment, task, specs[name], s, seed, bar)
    else:  # one single-threaded process per run: results do not depend on the scheduling
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor, as_completed

        with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
            futs = {pool.submit(_worker, experiment, task, specs[n], s, seed): (n, seed) for n, seed in jobs}
            for f in as_completed(futs):
                done[futs[f]] = f.result()
                bar.set_postfix_str(f"{futs[f][0]} seed {futs[f][1]} done")
                bar.update(s.steps)
    results = {}
    for name, levels in specs.items():
        per_seed = [done[name, seed] for seed in range(seeds)]
        probe = ContinualNet(
            task.vocab_size,
            s.d_model,
            levels,
            getattr(task, "feat_dim", 0) if experiment == "class_incremental" else 0,
        )
        metrics = _scalar_metrics(experiment, task)
        results[name] = {
            "levels": levels,
            "parameters": probe.num_parameters(),
            "cms_parameters": sum(p.numel() for p in probe.cms.parameters()),
            "fast_weights_per_stream": sum(lv.W_in.numel() + lv.W_out.numel() for lv in probe.cms.levels),
            "per_seed": per_seed,
            "summary": {
                m: {**mean_ci95([r[m] for r in per_seed]), "values": [r[m] for r in per_seed]}
                for m in metrics
            },
            "diverged": [
                {"seed": r["seed"], "step": r["diverged_at_step"]}
                for r in per_seed
                if r["diverged_at_step"] is not None
            ],
            "wall_s": sum(r["wall_s"] for r in per_seed),
        }
    bar.close()
    return {
        "experiment": experiment,
        "seeds": list(range(seeds)),
        "settings": asdict(s),
        "task": asdict(task),
        "chance": _chance(experiment, task),
        "models": results,
        "workers": workers,
        "cms_md5": cms_md5,  # the cms.py the runs of this experiment imported (checked at its start)
        "wall_s": time.time() - t0,
    }


def _chance(experiment, task) -> float:
    return 1.0 / (task.n_values if experiment != "class_incremental" else task.n_labels)


# --------------------------------------------------------------------------------------------
# reporting

_TITLES = {
    "abab": "In-context A → B → A (disjoint keys): recall of A after B",
    "forgetting_mqar": "Forgetting-MQAR: reassigned keys must return the latest value",
    "class_incremental": "In-context class-incremental learning",
}


def table(result: dict) -> str:
    """A markdown table: mean ± 95% t-interval half-width over the seeds, per model and metric."""
    exp = result["experiment"]
    models = result["models"]
    metrics = list(next(iter(models.values()))["summary"])
    n = len(result["seeds"])
    lines = [
        f"**{exp}** — {n} seeds, mean ± 95% t-interval half-width; chance {result['chance']:.3f}; "
        f"wall time {result['wall_s']:.0f} s ({result.get('workers', 1)} worker processes); "
        f"{result['settings']['steps']} outer steps × batch {result['settings']['batch_size']}",
        "",
        "| model | levels (period×expansion, lr) | params | " + " | ".join(metrics) + " | diverged |",
        "|---|---|---|" + "---|" * len(metrics) + "---|",
    ]
    for name, r in models.items():
        lv = ", ".join(f"{v['period']}×{v['expansion']:.3g}" for v in r["levels"])
        lrs = sorted({v.get("lr", 1.0) for v in r["levels"]})
        cells = []
        for m in metrics:
            sm = r["summary"][m]
            ci = "n/a" if not math.isfinite(sm["ci95"]) else f"{sm['ci95']:.3f}"
            cells.append(f"{sm['mean']:.3f} ± {ci}" + (f" (n={sm['n']})" if sm["n"] != n else ""))
        div = ", ".join(f"seed {d['seed']} at step {d['step']}" for d in r["diverged"]) or "—"
        lines.append(
            f"| {name} | {lv} (lr {'/'.join(f'{x:g}' for x in lrs)}) | {r['parameters']:,} | "
            + " | ".join(cells)
            + f" | {div} |"
        )
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """Grouped bars (one group per model, one bar per metric) with 95% t-interval error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = result["models"]
    names = list(models)
    metrics = [m for m in next(iter(models.values()))["summary"] if m != "final_train_loss"]
    fig, ax = plt.subplots(figsize=(1.3 * len(names) + 2, 4))
    width = 0.8 / len(metrics)
    for i, m in enumerate(metrics):
        means = [models[n]["summary"][m]["mean"] for n in names]
        errs = [models[n]["summary"][m]["ci95"] for n in names]
        errs = [e if math.isfinite(e) else 0.0 for e in errs]
        xs = [j + (i - (len(metrics) - 1) / 2) * width for j in range(len(names))]
        ax.bar(xs, means, width, yerr=errs, capsize=3, label=m)
        for j, n in enumerate(names):  # per-seed points
            vals = models[n]["summary"][m]["values"]
            ax.plot([xs[j]] * len(vals), vals, "k.", ms=3)
    if result["experiment"] != "class_incremental":
        ax.axhline(result["chance"], color="grey", lw=0.8, ls="--", label="chance")
    ax.axhline(0, color="black", lw=0.5)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("accuracy" + (" / BWT" if result["experiment"] == "class_incremental" else ""))
    ax.set_title(
        f"{_TITLES[result['experiment']]}\n({len(result['seeds'])} seeds, 95% t-intervals)", fontsize=10
    )
    legend(ax, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _git() -> dict:
    package = Path(__file__).resolve().parents[1]  # mnemo/

    def sh(*cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=10, cwd=package).stdout.strip()
        except Exception:  # pragma: no cover - git missing
            return ""

    import hashlib
    import sys

    cms = Path(sys.modules[ContinuumMemory.__module__].__file__).resolve()  # the cms.py the runs use
    return {
        "head": sh("git", "rev-parse", "HEAD"),
        "cms_diff_stat": sh("git", "diff", "--stat", "--", str(cms.relative_to(package))),
        "cms_md5": hashlib.md5(cms.read_bytes()).hexdigest(),
    }


def _finite(x):
    """JSON-safe: non-finite floats become ``null``."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def run(
    experiments=EXPERIMENTS,
    seeds: int = 3,
    out: str | Path | None = None,
    progress: bool = True,
    overrides: dict | None = None,
    models=None,
    workers: int = 1,
) -> dict:
    """Run ``experiments``; write ``continual.json``, ``continual.md`` and ``<experiment>.png`` under
    ``out``. ``overrides`` replaces :class:`Settings` fields of every experiment (e.g. ``steps``)."""
    if seeds < 1:
        raise ValueError(f"seeds: expected >= 1, got {seeds}")
    results = {
        "git": _git(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "experiments": {},
    }
    for exp in experiments:
        s = Settings(**{**asdict(DEFAULTS[exp]), **(overrides or {})})
        results["experiments"][exp] = run_experiment(exp, seeds, s, progress, models, workers)
    if out is not None:
        from ..train.checkpoint import atomic_write_text

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        paths = [out / "continual.json", out / "continual.md"]
        atomic_write_text(paths[0], json.dumps(_finite(results), indent=2))
        md = [
            "# mnemo continual",
            "",
            f"git HEAD `{results['git']['head']}`; cms.py md5 `{results['git']['cms_md5']}` "
            f"(uncommitted diff: {results['git']['cms_diff_stat'] or 'none'}); torch {results['torch']}",
            "",
        ]
        for exp, r in results["experiments"].items():
            md += [table(r), ""]
            try:
                plot(r, out / f"{exp}.png")
                paths.append(out / f"{exp}.png")
            except ImportError:  # pragma: no cover - matplotlib is an optional extra
                pass
        atomic_write_text(paths[1], "\n".join(md))
        results["paths"] = [str(p) for p in paths]
    return results


def add_commands(sub) -> None:
    p = sub.add_parser(
        "continual",
        help="in-context continual learning of the CMS: A→B→A recall, forgetting-MQAR, class-incremental",
    )
    p.add_argument("--experiment", default="all", choices=(*EXPERIMENTS, "all"))
    p.add_argument("--seeds", type=kinds.Int(1, 1000), default=3, help="seeds 0..N-1 (model init + data)")
    p.add_argument(
        "--steps", type=kinds.positive_int, help="outer-loop steps per model (default: per experiment)"
    )
    p.add_argument(
        "--eval-streams",
        type=kinds.Int(1, 100_000),
        help="held-out streams per seed, at most 100,000 (default 256)",
    )
    p.add_argument(
        "--models",
        type=kinds.Text("comma-separated model names"),
        help="comma-separated subset, e.g. cms-1,cms-4 (default: all)",
    )
    p.add_argument(
        "--workers", type=kinds.Int(1, 256), default=2, help="runs in parallel (one process per run)"
    )
    p.add_argument(
        "--out", default="runs/continual", type=kinds.OutDir(not_a_run=True), help="folder for the results"
    )
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--force", action="store_true", help="replace the results already in --out")
    p.set_defaults(func=_cmd)


def _cmd(args) -> int:
    old = [p.name for p in (Path(args.out) / "continual.json", Path(args.out) / "continual.md") if p.exists()]
    if old and not args.force:
        raise ValueError(
            f"--out: {args.out} already holds results ({', '.join(old)}); pick another --out or pass --force"
        )
    exps = EXPERIMENTS if args.experiment == "all" else (args.experiment,)
    overrides = {}
    if args.steps is not None:
        overrides["steps"] = args.steps
        overrides["warmup"] = min(DEFAULTS[exps[0]].warmup, max(1, args.steps // 10))
    if args.eval_streams is not None:
        overrides["eval_streams"] = args.eval_streams
    models = args.models.split(",") if args.models else None
    res = run(exps, args.seeds, args.out, not args.no_progress, overrides, models, args.workers)
    for r in res["experiments"].values():
        print(table(r) + "\n")
    print("wrote " + ", ".join(res["paths"]))
    # --force replaced continual.json/.md: a plot of an experiment they no longer hold would read
    # as part of these results
    stale = [Path(args.out) / f"{e}.png" for e in EXPERIMENTS if e not in exps]
    stale = [p for p in stale if p.is_file()]
    for p in stale:
        p.unlink()
    if stale:
        print("removed the replaced results' plots: " + ", ".join(p.name for p in stale))
    return 0
