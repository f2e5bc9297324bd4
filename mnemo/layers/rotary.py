"""Rotary position embeddings (RoPE, Su et al. 2021)."""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Rotate pairs ``(x_i, x_{i + d/2})`` of each head by angle ``pos · theta^{−2i/d}``.

    ``forward(x [B, T, H, D], offset) -> [B, T, H, D]`` for positions ``offset … offset+T−1``;
    computed in float32 (float64 for float64 inputs), returned in ``x``'s dtype. ``D`` must be even.
    """

    def __init__(self, head_dim: int, theta: float = 10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
        inv = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        T = x.shape[1]
        cd = torch.float64 if x.dtype == torch.float64 else torch.float32
        pos = torch.arange(offset, offset + T, device=x.device, dtype=cd)
        ang = pos[:, None] * self.inv_freq.to(device=x.device, dtype=cd)[None, :]  # [T, D/2]
        cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
        x1, x2 = x.to(cd).chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)
