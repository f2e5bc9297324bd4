"""How many key–value pairs a test-time-trained memory can store: write, then recall.

The probe behind the claim that a *deep* memory holds more than a matrix (Titans, Behrouz et al.
2024, §3.1 and Table 5's "deep memory" ablation), taken apart from any outer training: a stream of
``N`` random pairs ``(k_i, v_i)`` is written into a fresh memory by its own inner update
(:func:`mnemo.memory.neural_memory`: ``W ← W − θ ∇_W ½‖M_W(k_i) − v_i‖²`` per token, or per
``chunk_size`` tokens as mini-batch GD), ``passes`` times over in the same order; then every key is
read from the final weights, ``y_i = M_W(k_i)``, and the read counts as recalled when its nearest
value by cosine among the stream's ``N`` values is ``v_i``. Chance is ``1/N``.

Data. Keys are unit vectors (the Titans layer L2-normalises ``q`` and ``k``), values have unit
variance per coordinate (the scale a ``x + LN(·)`` memory produces); both are drawn first from the
seed's generator (in float64, then cast), so every variant sees the same pairs on a seed (paired
comparisons), whatever the dtype.

Initial weights, as mnemo's Titans layer initialises its memory (``mnemo/layers/titans.py``): a
matrix memory at zero (normed or not: the first step of ``k + LN(W k)`` from ``W = 0`` is scaled by
``1/√eps`` of the norm, so such a memory wants a very small ``θ``, which the sweep's grid must
reach), each layer of a deep memory ``N(0, 1/in)`` (the layer starts TTT-MLP's at ``N(0, 0.02²)``,
TTT's reference: :func:`mnemo.layers.titans.initial_weight_std`; the probe keeps fan-in for every
deep memory, its published runs' choice). In the layer these are learned starting points; here
they stay at their initialisation.

Chunks run over the repeated stream as over any stream: with ``chunk_size = C`` and ``N < C`` one
chunk holds every pair of a pass (and of several passes), so its gradients are all taken at the
same weights.

What this is not: a trained model's recall. In a model the keys are learned projections and the
initial weights are meta-learned; here they are random, which isolates what the update rule and the
architecture can store. Retention (forgetting) is off (``retention="none"``): the question is what
fits, not what is kept. Momentum is off by default (``optimizer="gd"``); variants built with
``capacity_variants(momentum=True)`` and written with ``eta=η`` take Titans' surprise with
momentum, ``S ← η S − θ ∇``, ``W ← W + S`` (a constant ``η``), which keeps applying each gradient
over the tokens after it.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F

from ..memory import MemorySpec, init_state, neural_memory, preset
from ..memory.objective import memory_apply
from ..ops._common import RangeWarning

__all__ = [
    "capacity_variants",
    "initial_weights",
    "random_pairs",
    "recall_accuracy",
    "write_and_recall",
    "capacity_sweep",
]


def capacity_variants(
    base: str = "titans", chunk_size: int = 1, max_lr: float = 10.0, momentum: bool = False
) -> dict:
    """Memory variants to compare, ``name -> (MemorySpec, description)``, all built on the preset
    ``base`` (default ``"titans"``: ``x + LN(W₂ σ(W₁ x))``, hidden ``4K``) with retention off, the
    given ``chunk_size`` (tokens per inner step, default ``chunk_size=1``: online GD) and ``max_lr``
    (the clamp of ``θ``, default ``max_lr=10.0``; set it at or above the grid's top);
    ``momentum=True`` gives every variant the momentum optimizer (its ``η`` is
    :func:`write_and_recall`'s ``eta``; default ``momentum=False``: plain GD).

    - ``mlp``: the deep memory (2 layers, expansion 4: ``8K²`` weights per head);
    - ``matrix``: ``x + LN(W x)`` (``K²``), the Titans ablation's linear memory;
    - ``mlp_equal``: the deep memory at expansion 1/2, ``K²`` weights (an even ``K``; an odd one
      rounds the hidden width): depth at equal parameters
      (its hidden width ``K/2`` is also a rank bottleneck: ``W₂``'s output spans ``K/2`` dimensions);
    - ``matrix_plain``: ``W x``, no residual, no norm (the delta rule with ``chunk_size = 1``);
    - ``mlp_plain``: ``W₂ σ(W₁ x)``, no residual, no norm.

    Raises:
        ValueError: ``base`` is not a memory preset with an MLP architecture and the ``l2`` objective
            (the probe writes ``½‖M(k) − v‖²``), or ``chunk_size`` / ``max_lr`` is not positive.
    """
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    if not (isinstance(max_lr, (int, float)) and max_lr > 0 and math.isfinite(max_lr)):
        raise ValueError(f"max_lr must be a positive number, got {max_lr!r}")
    try:
        spec = preset(base)
    except (KeyError, ValueError) as e:
        raise ValueError(f"base must be a memory preset name, got {base!r} ({e})") from None
    if spec.objective != "l2":
        raise ValueError(
            f"base must be a memory preset with the l2 objective ½‖M(k) − v‖² (titans, ttt_mlp), got "
            f"{base!r} (objective {spec.objective!r})"
        )
    if spec.architecture != "mlp":
        raise ValueError(
            f"base must be a memory preset with a deep (mlp) memory, got {base!r} ({spec.architecture})"
        )
    opt = "momentum" if momentum else "gd"
    s = spec.replace(retention="none", optimizer=opt, chunk_size=chunk_size, max_lr=float(max_lr))
    h = s.expansion
    return {
        "mlp": (
            s,
            f"{base}'s deep memory: {'x + LN(MLP(x))' if s.norm else 'MLP(x)'}, hidden {h:g}K",
        ),
        "matrix": (s.replace(architecture="matrix"), "the matrix memory in the same form (K² weights)"),
        "mlp_equal": (
            s.replace(expansion=0.5),
            "the deep memory at hidden K/2 (rounded): K² weights for an even K, as the matrix (and a "
            "rank-K/2 bottleneck)",
        ),
        "matrix_plain": (
            s.replace(architecture="matrix", residual=False, norm=False),
            "W x, no residual, no norm (the delta rule at chunk_size 1)",
        ),
        "mlp_plain": (s.replace(residual=False, norm=False), f"MLP(x), no residual, no norm, hidden {h:g}K"),
    }


def random_pairs(n_pairs: int, key_dim: int, streams: int, generator: torch.Generator, dtype=torch.float32):
    """``(k, v)``, each ``[streams, n_pairs, 1, key_dim]``: unit-norm keys, values ``N(0, 1)`` per
    coordinate (one head)."""
    d = torch.float64  # drawn in float64 whatever ``dtype``: the same pairs in every precision
    k = F.normalize(torch.randn(streams, n_pairs, 1, key_dim, generator=generator, dtype=d), dim=-1)
    v = torch.randn(streams, n_pairs, 1, key_dim, generator=generator, dtype=d)
    return k.to(dtype), v.to(dtype)


def initial_weights(
    spec: MemorySpec, key_dim: int, streams: int, generator: torch.Generator, dtype=torch.float32
):
    """One initial weight set shared by the streams, ``[streams, 1, in, out]`` per layer: zeros for a
    matrix memory, ``N(0, 1/in)`` for each layer of a deep one (drawn in float64, then cast), as the
    Titans layer initialises its memory except TTT's two (the normed matrix ``x + LN(W x)`` and the
    TTT-MLP), which the layer starts at ``N(0, 0.02²)`` (TTT's reference ``W_0``) and the probe at
    zero and at fan-in (its published runs)."""
    out = []
    for i, o in spec.layer_dims(key_dim, key_dim):
        if spec.architecture == "matrix":
            w = torch.zeros(1, 1, i, o, dtype=dtype)
        else:
            w = (torch.randn(1, 1, i, o, generator=generator, dtype=torch.float64) * i**-0.5).to(dtype)
        out.append(w.expand(streams, 1, i, o))
    return out


def _unit(x: torch.Tensor) -> torch.Tensor:
    """``x / ‖x‖`` over the last dim; a vector whose norm overflows (a finite read of ``|x| ≳ 2e19``
    squares past float32's range) or underflows is first scaled by its largest entry. Every other
    vector is normalised as ``F.normalize`` does, rounding included (the published recalls: a
    rescaled vector's cosines round differently, which flips near-ties). A zero vector stays zero."""
    top = x.abs().amax(-1, keepdim=True)
    plain = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    scaled = F.normalize(x / torch.where(top > 0, top, torch.ones_like(top)), dim=-1)
    return torch.where(torch.isfinite(plain) & (plain > 1e-12), F.normalize(x, dim=-1), scaled)


def recall_accuracy(y: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Per stream, the share of reads ``y_i`` whose nearest value by cosine among ``v_1 … v_N`` is
    ``v_i`` alone. ``y, v: [B, N, H, D]`` → ``[B]`` (averaged over heads and pairs, in float32 at
    least: a bf16 share would round 999 of 1000 to 1). A read as near
    another value as ``v_i`` (a tie) is a miss, and so is a read of zero norm or with a non-finite
    entry; the cosine is scale-free also for reads whose squared norm overflows.

    Raises:
        ValueError: ``y`` and ``v`` differ in shape or are not 4-D; ``v`` has no pairs or no
            channels; ``v`` has a non-finite entry.
    """
    if y.shape != v.shape or y.ndim != 4:
        raise ValueError(
            f"y and v must have the same shape [B, N, H, D], got {list(y.shape)} and {list(v.shape)}"
        )
    if v.shape[1] == 0 or v.shape[3] == 0:
        raise ValueError(f"v: expected N >= 1 pairs and D >= 1 channels, got shape {list(v.shape)}")
    if not bool(torch.isfinite(v).all()):
        raise ValueError(
            f"v: expected finite values, got {int((~torch.isfinite(v)).sum())} non-finite entries"
        )
    ok = torch.isfinite(y).all(-1) & (y != 0).any(-1)  # [B, N, H]: a read that points somewhere
    sim = torch.einsum("bihd,bjhd->bhij", _unit(torch.where(ok[..., None], y, 0)), _unit(v))
    own = sim.diagonal(dim1=-2, dim2=-1).clone()  # [B, H, N]
    sim.diagonal(dim1=-2, dim2=-1).fill_(float("-inf"))  # (in place: no second [N, N] per stream)
    others = sim.amax(-1)  # the nearest other value; -inf with a single pair
    hit = (own > others) & ok.transpose(1, 2)
    return hit.to(torch.promote_types(y.dtype, torch.float32)).mean(dim=(1, 2))  # (bf16 rounds 0.999 to 1)


@torch.no_grad()
def write_and_recall(
    spec: MemorySpec,
    k: torch.Tensor,
    v: torch.Tensor,
    theta: float,
    weights: Sequence[torch.Tensor],
    passes: int = 1,
    eta: float | None = None,
) -> dict:
    """Write the pairs ``passes`` times with inner rate ``theta``, then read every key.

    Args:
        spec: the memory (retention ``"none"``; optimizer ``"gd"``, or ``"momentum"`` with ``eta``).
        k, v: ``[B, N, H, K]`` keys and ``[B, N, H, V]`` values.
        theta: the inner learning rate ``θ`` of every token (> 0; ``spec.max_lr`` clamps it).
        weights: the initial weights ``[B, H, in, out]`` per layer.
        passes: how many times the stream is written, in the same order (≥ 1; default ``passes=1``).
        eta: the momentum ``η ∈ [0, 1)`` of every token, for a spec with optimizer ``"momentum"``
            (default ``eta=None``: plain GD).

    Returns:
        ``{"recall": [B], "nmse": [B]}``: recall by nearest value (:func:`recall_accuracy`) and
        ``mean_i ‖y_i − v_i‖² / ‖v_i‖²`` per stream (a non-finite read gives ``nan`` in both). The
        memory runs as :func:`~mnemo.memory.neural_memory` does (float32 weights for bf16 pairs);
        the read is rounded to the pairs' dtype, and both numbers are computed in float32 at least.

    Raises:
        ValueError: a spec with retention, a momentum spec without ``eta`` (or ``eta`` without
            one, or outside [0, 1)), ``theta`` ≤ 0, ``passes`` < 1.
    """
    if spec.retention != "none" or spec.optimizer not in ("gd", "momentum"):
        raise ValueError(
            "write_and_recall needs retention='none' and optimizer 'gd' or 'momentum', got "
            f"{spec.retention!r} / {spec.optimizer!r}"
        )
    if (spec.optimizer == "momentum") != (eta is not None):
        raise ValueError(
            f"eta goes with optimizer='momentum' (and only with it), got {spec.optimizer!r}, eta={eta!r}"
        )
    if eta is not None and not (isinstance(eta, (int, float)) and 0 <= eta < 1):
        raise ValueError(f"eta must be a number in [0, 1), got {eta!r}")
    if not (isinstance(theta, (int, float)) and theta > 0 and math.isfinite(theta)):
        raise ValueError(f"theta must be a positive number, got {theta!r}")
    if not isinstance(passes, int) or passes < 1:
        raise ValueError(f"passes must be a positive integer, got {passes!r}")
    kk, vv = k.repeat(1, passes, 1, 1), v.repeat(1, passes, 1, 1)
    th = torch.full(kk.shape[:3], float(theta), dtype=k.dtype, device=k.device)
    et = None if eta is None else torch.full_like(th, float(eta))
    st0 = init_state(spec, list(weights))
    _, st = neural_memory(spec, kk, kk, vv, th, eta=et, initial_state=st0, output_final_state=True)
    y, _, _ = memory_apply(spec, st.weights, k.transpose(1, 2).to(st.weights[0].dtype))  # [B, H, N, V]
    cd = torch.promote_types(v.dtype, torch.float32)  # the error and recall of bf16 pairs in float32
    y, v = y.transpose(1, 2).to(v.dtype).to(cd), v.to(cd)  # (the read rounded to the pairs' dtype)
    nmse = (((y - v) ** 2).sum(-1) / (v**2).sum(-1)).mean(dim=(1, 2))
    bad = ~torch.isfinite(y).all(dim=-1).all(dim=-1).all(dim=-1)
    recall = recall_accuracy(y, v)
    recall[bad] = float("nan")
    nmse[bad] = float("nan")  # (an inf read would give inf, a NaN one NaN)
    return {"recall": recall, "nmse": nmse}


def _one(spec, n_pairs, key_dim, streams, seed, theta, passes, dtype, eta=None) -> dict:
    """Mean recall and error over the seed's streams; ``None`` (JSON ``null``) where not finite."""
    g = torch.Generator().manual_seed(int(seed))
    k, v = random_pairs(n_pairs, key_dim, streams, g, dtype)
    w = initial_weights(spec, key_dim, streams, g, dtype)
    r = write_and_recall(spec, k, v, theta, w, passes, eta)
    out = {name: float(x.mean()) for name, x in r.items()}
    return {name: (x if math.isfinite(x) else None) for name, x in out.items()}


def capacity_sweep(
    variants: dict,
    n_pairs: Iterable[int],
    passes: Iterable[int] = (1,),
    theta_grid: Sequence[float] = (0.01, 0.03, 0.1, 0.3, 1.0),
    seeds: Sequence[int] = (0, 1, 2),
    select_seed: int = 1000,
    key_dim: int = 16,
    streams: int = 256,
    dtype=torch.float32,
    progress: bool = True,
    eta: float | None = None,
) -> dict:
    """Recall per variant, pair count and number of passes, each at its own ``θ``.

    ``θ`` is chosen per (variant, ``N``, passes) as the grid value with the highest mean recall on
    ``select_seed`` (not reported; default ``select_seed=1000``); the reported ``seeds`` then run at
    that ``θ``. Each seed draws ``streams`` streams (default ``streams=256``) of keys in ``key_dim``
    dimensions (default ``key_dim=16``); a progress bar shows unless ``progress=False`` (default
    ``progress=True``). ``eta`` is the momentum of variants built with ``momentum=True`` (default
    ``eta=None``: plain GD; :func:`write_and_recall`). A ``θ`` whose
    reads are not finite scores ``None`` and is never chosen; a reported seed's ``None`` is left
    out of the statistics.

    Returns:
        ``{"settings", "cells": [{"variant", "n_pairs", "passes", "theta", "selection": {θ: recall},
        "seeds", "recall": [...], "nmse": [...]}]}`` (JSON-ready).

    Raises:
        ValueError: an empty grid or seed list, a ``select_seed`` among the reported seeds, a pair
            count or ``key_dim`` below 1, two ``θ`` alike to 6 significant digits, a ``θ`` above a
            variant's ``max_lr``.
    """
    from tqdm.auto import tqdm

    n_pairs, passes, theta_grid, seeds = list(n_pairs), list(passes), list(theta_grid), list(seeds)
    if not theta_grid or not seeds or not n_pairs or not passes:
        raise ValueError("capacity_sweep: theta_grid, seeds, n_pairs and passes must be non-empty")
    if len({f"{th:g}" for th in theta_grid}) != len(theta_grid):  # the cells key θ by its %g text
        raise ValueError(f"theta_grid: expected distinct values (to 6 significant digits), got {theta_grid}")
    if select_seed in seeds:
        raise ValueError(f"select_seed {select_seed} must not be a reported seed {seeds}")
    if min(n_pairs) < 1 or key_dim < 1 or streams < 1:
        raise ValueError(f"n_pairs, key_dim and streams must be ≥ 1, got {n_pairs}, {key_dim}, {streams}")
    for name, (spec, _) in variants.items():  # θ above max_lr is clamped: the cell would misreport it
        if spec.max_lr is not None and max(theta_grid) > spec.max_lr:
            raise ValueError(
                f"theta_grid: expected values ≤ the max_lr {spec.max_lr:g} of variant {name!r} (θ is "
                f"clamped to it, so a cell would record a θ it did not run), got {max(theta_grid):g}"
            )
    cells = []
    jobs = [(name, n, p) for p in passes for n in n_pairs for name in variants]
    bar = tqdm(jobs, desc="capacity", disable=not progress, leave=False)
    for name, n, p in bar:
        spec = variants[name][0]
        bar.set_postfix_str(f"{name} N={n} passes={p}")
        with warnings.catch_warnings():  # θ > 2 on the delta rule is a grid point, on purpose
            warnings.filterwarnings("ignore", category=RangeWarning)
            sel = {
                th: _one(spec, n, key_dim, streams, select_seed, th, p, dtype, eta)["recall"]
                for th in theta_grid
            }
            finite = {th: r for th, r in sel.items() if r is not None}
            theta = max(finite, key=finite.get) if finite else theta_grid[0]
            runs = [_one(spec, n, key_dim, streams, s, theta, p, dtype, eta) for s in seeds]
        cells.append(
            {
                "variant": name,
                "n_pairs": n,
                "passes": p,
                "theta": theta,
                "selection": {f"{th:g}": r for th, r in sel.items()},
                "seeds": seeds,
                "recall": [r["recall"] for r in runs],
                "nmse": [r["nmse"] for r in runs],
            }
        )
    settings = {
        "variants": {name: {"spec": s.to_dict(), "description": d} for name, (s, d) in variants.items()},
        "n_pairs": n_pairs,
        "passes": passes,
        "theta_grid": theta_grid,
        "seeds": seeds,
        "select_seed": select_seed,
        "key_dim": key_dim,
        "streams": streams,
        "dtype": str(dtype).replace("torch.", ""),
        "momentum": eta,
    }
    return {"settings": settings, "cells": cells}
