"""Memory time scales: the distribution of effective decay half-lives per layer (DESIGN §7).

A log decay ``g ≤ 0`` per token keeps ``exp(g)`` of a memory, so information halves after
``−ln 2 / g`` tokens. Data-dependent gates are measured on real input (the gates the model actually
produces on a text, as recorded by each mixer's ``hook_g``), fixed gates (RetNet) too. Mamba's decay
is ``Δ_t A`` per (channel, state); Titans' is ``log(1 − α_t)`` of its retention gate; a CMS level's
time scale is its update period.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

LN2 = math.log(2.0)


def decay_kind(g: torch.Tensor) -> str:
    """What a log-decay tensor's entries are: one for the whole memory per token (``[B, T]``:
    ``"per-token"``, HOPE's self-modifying Titans), one per head (``[B, T, H]``: ``"per-head"``) or
    one per channel (``[B, T, H, K]``; Mamba's ``[B, T, D, N]``, per channel and state:
    ``"per-channel"``)."""
    return {2: "per-token", 3: "per-head"}.get(g.ndim, "per-channel")


def decay_hook(model, layer: int) -> str | None:
    """The full name of the hook carrying layer ``layer``'s log decay: the mixer's own ``hook_g``,
    else the ``hook_g`` of the memory inside it whose map is the mixer's (Titans MAC/MAG/MAL:
    ``memory.hook_g``), else the only ``hook_g`` below the mixer; ``None`` without one."""
    base = f"blocks.{layer}.mixer."
    if base + "hook_g" in model.hook_points:
        return base + "hook_g"
    below = [n for n in model.hook_points if n.startswith(base) and n.endswith(".hook_g")]
    mixing = [base + h for h in getattr(model.blocks[layer].mixer, "mixing_hooks", ())]
    for n in below:
        if n in mixing:
            return n
    return below[0] if len(below) == 1 else None


def _quantiles(values: torch.Tensor, ps: tuple[float, ...]) -> list[float]:
    """The ``ps`` quantiles of ``values`` (1-D, non-empty), linearly interpolated as
    ``torch.quantile`` does, but by sorting: ``torch.quantile`` refuses more than ``2**24`` values,
    which a Mamba layer's per-(channel, state) gates reach within a few thousand tokens."""
    s = values.sort().values
    n = s.numel()
    out = []
    for p in ps:
        pos = p * (n - 1)
        lo = int(math.floor(pos))
        hi = min(lo + 1, n - 1)
        out.append(float(s[lo] + (s[hi] - s[lo]) * (pos - lo)))
    return out


def summarize(half_lives: torch.Tensor) -> dict:
    """Quantiles (tokens) and a log-spaced histogram of half-lives (``inf`` = no decay), of any
    number of half-lives.

    The histogram's 28 bins run from 1 to 1e7 tokens (four per decade); a half-life outside is
    counted in the end bin nearest to it: ``"below_first_edge"`` says how many of the first bin's
    are under one token, ``"above_last_edge"`` how many of the last bin's are over 1e7 tokens
    (``"note"`` says so in the JSON)."""
    h = half_lives.flatten().double()
    finite = h[torch.isfinite(h)]
    out = {"count": int(h.numel()), "never_decays": int((~torch.isfinite(h)).sum())}
    if finite.numel():
        qs = _quantiles(finite, (0.1, 0.5, 0.9))
        out.update(
            min=float(finite.min()),
            p10=float(qs[0]),
            median=float(qs[1]),
            p90=float(qs[2]),
            max=float(finite.max()),
        )
        edges = torch.logspace(0, 7, 29, dtype=torch.float64)
        counts = torch.histogram(finite.clamp(1.0, 1e7), bins=edges).hist
        out["histogram"] = {
            "edges": edges.tolist(),
            "counts": counts.long().tolist(),
            "below_first_edge": int((finite < 1.0).sum()),
            "above_last_edge": int((finite > 1e7).sum()),
            "note": "half-lives under 1 token are counted in the first bin, over 1e7 tokens in the last bin",
        }
    return out


def _call_rows(g: torch.Tensor, time_dim: int | None, T: int) -> torch.Tensor:
    """The rows of a recorded ``hook_g`` value that are the call's ``T`` tokens: the last ``T``
    along ``time_dim``. A recorded value ends at the call's last token (``run_with_cache`` joins a
    call's pieces up to it); rows before its first are a learned prefix the memory read first
    (:func:`~mnemo.layers.hooks.span`: negative positions)."""
    if time_dim is None or g.ndim <= time_dim or g.shape[time_dim] <= T:
        return g
    return g.narrow(time_dim, g.shape[time_dim] - T, T)


@torch.no_grad()
def timescales(model, input_ids: torch.Tensor) -> dict:
    """``{layer: {"mixer", "kind", "hook", "half_life": summary}}`` (plus ``"cms_periods"``) on
    ``input_ids``.

    The log decays are what each mixer's ``hook_g`` carries on this input (recorded with
    ``run_with_cache``): the gates the model actually produces — the mixer's own, or that of the
    memory inside it (Titans MAC/MAG/MAL: ``memory.hook_g``; :func:`decay_hook`; ``"hook"`` names
    it); ``"kind"`` says what one gate is (:func:`decay_kind`). The gates are those of the input's
    ``T`` tokens: a memory that reads a learned prefix before them (Titans' persistent tokens, whose
    rows its ``hook_g`` passes first, before the call's token 0) decays by the prefix's gates once,
    before any token of the input is written, so they are no time scale of the input's memory and
    are left out (``"count"`` counts the gates of the ``T`` tokens; the prefix would otherwise add
    its ``P`` rows, the same at every call, to every sequence's). A mixer without a ``hook_g`` has no
    decaying memory (``"kind": "no decay"``)."""
    param = next(model.parameters(), None)
    if param is not None:
        input_ids = input_ids.to(param.device)
    T = input_ids.shape[-1]
    hooks = {i: decay_hook(model, i) for i in range(len(model.blocks))}
    names = [n for n in hooks.values() if n is not None]
    cache = model.run_with_cache(input_ids, names=names)[1] if names else {}
    out = {}
    for i, block in enumerate(model.blocks):
        entry = {"mixer": type(block.mixer).__name__}
        g = cache.get(hooks[i]) if hooks[i] is not None else None
        if g is not None:
            g = _call_rows(g, model.hook_points[hooks[i]].time_dim, T)
            g = (g if g.dtype == torch.float64 else g.float()).clamp(max=0.0)  # float64 kept
            hl = torch.where(g < 0, -LN2 / g, torch.full_like(g, float("inf")))
            entry.update(kind=decay_kind(g), hook=hooks[i], half_life=summarize(hl))
        else:
            entry["kind"] = "no decay"
        periods = getattr(block.mlp, "periods", None)
        if periods is not None:
            entry["cms_periods"] = list(periods)
        out[str(i)] = entry
    return out


def figure(result: dict, title: str | None = None):
    """Half-lives per layer on a log axis (boxes p10–p90, line at the median, whiskers min and max;
    red marks: CMS update periods). Half-lives under one token are drawn at their value below a
    dotted "1 token" line; the axis always reaches the smallest value shown."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .figure_text import fit_text

    width = max(5.5, 0.8 * len(result) + 2)
    fig, ax = plt.subplots(figsize=(width, 4.4), layout="constrained")
    stats, positions, labels, shown = [], [], [], []
    for j, (layer, e) in enumerate(result.items(), start=1):
        labels.append(f"L{layer}\n{e['mixer'][:10]}")
        hl = e.get("half_life")
        if hl and "median" in hl:
            stats.append(
                {
                    "whislo": hl["min"],
                    "q1": hl["p10"],
                    "med": hl["median"],
                    "q3": hl["p90"],
                    "whishi": hl["max"],
                }
            )
            positions.append(j)
            shown += [hl["min"], hl["max"]]
        else:  # no decaying memory here (attention), or every gate at exactly zero
            ax.text(
                j,
                0.5,
                "no decay",
                transform=ax.get_xaxis_transform(),
                ha="center",
                va="center",
                rotation=90,
                color="0.4",
                fontsize=9,
            )
        periods = e.get("cms_periods", [])
        if periods:
            ax.plot([j] * len(periods), periods, "r_", ms=14, mew=2)
            shown += list(periods)
    if stats:
        ax.bxp(stats, positions=positions, showfliers=False, manage_ticks=False)
    ax.set_yscale("log")
    lo, hi = (min(shown), max(shown)) if shown else (1.0, 10.0)
    ax.set_ylim(min(lo, 1.0) / 2, max(hi, 1.0) * 2)  # reaches below the smallest half-life
    ax.set_xlim(0.4, len(result) + 0.6)
    ax.set_xticks(range(1, len(result) + 1), labels)
    ax.axhline(1.0, color="0.5", ls=":", lw=1)
    ax.annotate(
        "1 token",
        (1.0, 1.0),
        xycoords=("axes fraction", "data"),
        xytext=(-3, 2),
        textcoords="offset points",
        ha="right",
        va="bottom",
        fontsize=8,
        color="0.4",
    )
    ax.set_ylabel("half-life (tokens, log scale)")
    ax.set_title(
        fit_text("boxes p10–p90, line median, whiskers min–max; red: CMS update periods", width, 9),
        fontsize=9,
    )
    fig.suptitle(fit_text("Memory time scales" + (f" · {title}" if title else ""), width, 11), fontsize=11)
    return fig


def plot(result: dict, path, title: str | None = None):
    """Write :func:`figure` to ``path`` (a PNG); returns the path."""
    import matplotlib.pyplot as plt

    fig = figure(result, title)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
