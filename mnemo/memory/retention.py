"""Retention: the map ``W = N(A)`` from accumulators to weights (identity, Moneta's ℓq
normalisation, Memora's scaled softmax) and the soft-thresholding of elastic-net retention."""

from __future__ import annotations

import torch

from .spec import MemorySpec

__all__ = ["retention_map", "soft_threshold"]


def soft_threshold(x: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """``S_γ(x) = sign(x) · max(|x| − γ, 0)`` (elementwise; ``gamma`` broadcasts against ``x``)."""
    return torch.sign(x) * torch.relu(x.abs() - gamma)


def retention_map(spec: MemorySpec, A: torch.Tensor) -> torch.Tensor:
    """``W = N(A)``: identity, ``A / (‖A‖_q + 10⁻⁶)^{q−2}`` (norm over each layer's matrix; the
    offset, not in Moneta's equation, keeps ``W`` and its gradient finite at ``A = 0``) or
    ``kl_scale · softmax(A)`` over the input axis (dim ``-2``)."""
    if spec.retention == "lq":
        # (vector_norm's backward is 0 at A = 0, where |A|^q summed then ^(1/q) gives 0 · ∞ = NaN)
        norm = torch.linalg.vector_norm(A, spec.q, dim=(-2, -1), keepdim=True)
        return A / (norm + 1e-6).pow(spec.q - 2)
    if spec.retention == "kl":
        return spec.kl_scale * torch.softmax(A, dim=-2)
    return A
