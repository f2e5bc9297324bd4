"""Memory time scales: the distribution of effective decay half-lives per layer (DESIGN §7).

A log decay ``g ≤ 0`` per token keeps ``exp(g)`` of a memory, so information halves after
``−ln 2 / g`` tokens. Data-dependent gates are measured on real input (the gates the model actually
produces on a text); fixed gates (RetNet) are read off the weights. Mamba's decay is ``Δ_t A`` per
(channel, state); Titans' is its retention gate; a CMS level's time scale is its update period.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..layers import DeltaNet, GatedLinearAttention, Mamba, Mamba2, NeuralMemory
from ..nested import ContinuumMemory, SelfModifyingProjections, SelfModifyingTitans

LN2 = math.log(2.0)


def _mamba_log_decay(m: Mamba, x):
    u, _ = m.conv(m.in_proj(x).chunk(2, dim=-1)[0])
    if m.selective:
        dt = m.x_proj(u)[..., : m.dt_rank]
    else:
        dt = m.dt_lti.expand(*x.shape[:2], -1)
    delta = F.softplus(F.linear(dt, m.dt_proj.weight) + m.dt_proj.bias)  # [B, T, Dm]
    return delta[..., None] * -m.A_log.exp()  # [B, T, Dm, N]


def _mamba2_log_decay(m: Mamba2, x):
    dt = m.in_proj(x)[..., -m.n_heads :]
    return F.softplus(dt + m.dt_bias) * -m.A_log.exp()  # [B, T, H]


def log_decays(mixer, x: torch.Tensor):
    """``(kind, g)``: the log decays a mixer applies on input ``x [B, T, d]``, or ``None`` for a
    mixer without a decaying memory."""
    if isinstance(mixer, GatedLinearAttention):
        g = mixer.log_decay(x)
        return ("per-channel" if g.ndim == 4 else "per-head"), g
    if isinstance(mixer, DeltaNet):
        return ("per-head", mixer.log_decay(x)) if mixer.gated else None
    if isinstance(mixer, Mamba):
        return "per-channel-state", _mamba_log_decay(mixer, x)
    if isinstance(mixer, Mamba2):
        return "per-head", _mamba2_log_decay(mixer, x)
    if isinstance(mixer, NeuralMemory):
        _, g, _, _ = mixer._gates(x)
        return ("per-head", g) if g is not None else None
    if isinstance(mixer, SelfModifyingTitans):
        # one retention α_t per token for all five memories, generated in context by M_α
        return "per-head", mixer.log_decay(x)[..., None]
    if isinstance(mixer, SelfModifyingProjections):
        g = F.logsigmoid(x @ mixer.init["alpha"] + mixer.alpha_bias)
        return "per-head", g
    return None


def summarize(half_lives: torch.Tensor) -> dict:
    """Quantiles (tokens) and a log-spaced histogram of half-lives (``inf`` = no decay)."""
    h = half_lives.flatten().double()
    finite = h[torch.isfinite(h)]
    out = {"count": int(h.numel()), "never_decays": int((~torch.isfinite(h)).sum())}
    if finite.numel():
        qs = torch.quantile(finite, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64))
        out.update(
            min=float(finite.min()),
            p10=float(qs[0]),
            median=float(qs[1]),
            p90=float(qs[2]),
            max=float(finite.max()),
        )
        edges = torch.logspace(0, 7, 29, dtype=torch.float64)
        counts = torch.histogram(finite.clamp(1.0, 1e7), bins=edges).hist
        out["histogram"] = {"edges": edges.tolist(), "counts": counts.long().tolist()}
    return out


@torch.no_grad()
def timescales(model, input_ids: torch.Tensor) -> dict:
    """``{layer: {"mixer", "kind", "half_life": summary}}`` (plus ``"cms"`` periods) on ``input_ids``."""
    inputs = {}
    handles = [
        b.mixer.register_forward_pre_hook(lambda mod, args, i=i: inputs.__setitem__(i, args[0]))
        for i, b in enumerate(model.blocks)
    ]
    try:
        model(input_ids)
    finally:
        for h in handles:
            h.remove()
    out = {}
    for i, block in enumerate(model.blocks):
        entry = {"mixer": type(block.mixer).__name__}
        got = log_decays(block.mixer, inputs[i])
        if got is not None:
            kind, g = got
            g = g.float().clamp(max=0.0)
            hl = torch.where(g < 0, -LN2 / g, torch.full_like(g, float("inf")))
            entry.update(kind=kind, half_life=summarize(hl))
        else:
            entry["kind"] = "no decay"
        if isinstance(block.mlp, ContinuumMemory):
            entry["cms_periods"] = [lv.level.period for lv in block.mlp.levels]
        out[str(i)] = entry
    return out


def plot(result: dict, path) -> None:
    """Box plot of log10 half-lives per layer (CMS periods as markers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(5, 0.7 * len(result) + 2), 4))
    data, labels = [], []
    for layer, e in result.items():
        hl = e.get("half_life")
        if hl and "median" in hl:
            data.append(
                [math.log10(max(v, 1.0)) for v in (hl["min"], hl["p10"], hl["median"], hl["p90"], hl["max"])]
            )
        else:
            data.append([float("nan")] * 5)
        labels.append(f"L{layer}\n{e['mixer'][:10]}")
    ax.boxplot(data, whis=(0, 100), tick_labels=labels)
    for j, (_, e) in enumerate(result.items(), start=1):
        for p in e.get("cms_periods", []):
            ax.plot(j, math.log10(p), "r_", ms=14)
    ax.set_ylabel("log10 half-life (tokens)")
    ax.set_title("Memory time scales (boxes: p0/p10/median/p90/p100; red: CMS update periods)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
