"""Normalisation layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019): ``y = x / sqrt(mean(x²) + eps) · weight``.

    Normalises the last dimension ``dim``; computed in at least float32 (float64 stays float64)
    and returned in ``x``'s dtype. Default ``eps=1e-5``.
    """

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xc = x if x.dtype in (torch.float32, torch.float64) else x.float()
        y = F.rms_norm(xc, (x.shape[-1],), self.weight.to(xc.dtype), self.eps)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
