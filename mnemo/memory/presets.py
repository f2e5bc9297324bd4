"""Named points of the design space (``mnemo models`` lists the models built on them)."""

from __future__ import annotations

from .spec import MemorySpec

_MLP = dict(architecture="mlp", depth=2, expansion=4.0, residual=True, norm=True)

#: name -> (spec, one-line description with the source)
PRESETS: dict[str, tuple[MemorySpec, str]] = {
    "linear_attention": (
        MemorySpec(objective="dot", retention="none"),
        "matrix · dot · none · GD = linear attention (Katharopoulos et al. 2020)",
    ),
    "retnet": (
        MemorySpec(objective="dot", retention="decay"),
        "matrix · dot · per-head decay · GD = RetNet (Sun et al. 2023) when the caller's g is a fixed "
        "decay per head; NeuralMemory computes g from the input (the mamba2 point), the retnet mixer "
        "has RetNet's fixed decays",
    ),
    "gla": (
        MemorySpec(objective="dot", retention="decay", decay_per_channel=True),
        "matrix · dot · per-channel data-dependent decay · GD = GLA (Yang et al. 2023)",
    ),
    "mamba2": (
        MemorySpec(objective="dot", retention="decay"),
        "matrix · dot · per-head data-dependent decay · GD = Mamba-2 / SSD (Dao & Gu 2024)",
    ),
    "deltanet": (
        MemorySpec(objective="l2", retention="none", chunk_size=1),
        "matrix · l2 · none · online GD = DeltaNet (Schlag et al. 2021)",
    ),
    "gated_deltanet": (
        MemorySpec(objective="l2", retention="decay", decay_first=True, chunk_size=1),
        "matrix · l2 · decay (before the error) · online GD = Gated DeltaNet (Yang et al. 2024)",
    ),
    "ttt_linear": (
        MemorySpec(objective="l2", retention="none", residual=True, norm=True, chunk_size=16),
        "x + LN(Wx) · l2 · none · mini-batch GD (16) = TTT-Linear (Sun et al. 2024)",
    ),
    "ttt_mlp": (
        MemorySpec(objective="l2", retention="none", chunk_size=16, **_MLP),
        "x + LN(MLP(x)) · l2 · none · mini-batch GD (16) = TTT-MLP (Sun et al. 2024)",
    ),
    "titans": (
        MemorySpec(
            objective="l2", retention="decay", optimizer="momentum", chunk_size=64, max_lr=1.0, **_MLP
        ),
        "deep MLP · l2 · weight decay · momentum ('surprise') = Titans LMM (Behrouz et al. 2024)",
    ),
    "moneta": (
        MemorySpec(objective="lp", p=3.0, retention="lq", q=4.0, chunk_size=64, max_lr=1.0, **_MLP),
        "deep MLP · lp (p=3) · lq retention (q=4) · GD = Moneta (Behrouz et al. 2025)",
    ),
    "yaad": (
        MemorySpec(
            objective="huber", huber_mode="token", retention="decay", chunk_size=64, max_lr=1.0, **_MLP
        ),
        "deep MLP · Huber switched per token on ‖M(k)−v‖ vs data-dependent δ (Miras Eq. 16) · weight "
        "decay · GD = Yaad (Behrouz et al. 2025)",
    ),
    "yaad_coordinate": (
        MemorySpec(
            objective="huber", huber_mode="coordinate", retention="decay", chunk_size=64, max_lr=1.0, **_MLP
        ),
        "deep MLP · coordinate-wise Huber (Miras Eq. 14) · weight decay · GD = Yaad with Huber variant 1",
    ),
    "memora": (
        MemorySpec(objective="l2", retention="kl", chunk_size=64, max_lr=1.0, **_MLP),
        "deep MLP · l2 · KL (softmax) retention · GD = Memora (Behrouz et al. 2025)",
    ),
}


def preset(name: str, **changes) -> MemorySpec:
    """The preset ``name`` with fields replaced (raises ``ValueError`` listing the presets)."""
    if name not in PRESETS:
        raise ValueError(f"unknown memory preset {name!r}; presets: {', '.join(sorted(PRESETS))}")
    spec = PRESETS[name][0]
    return spec.replace(**changes) if changes else spec.validate()
