"""Rotary position embeddings (RoPE, Su et al. 2021)."""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Rotate pairs ``(x_i, x_{i + R/2})`` of each head by angle ``pos · theta^{−2i/R}``,
    ``i < R/2``, for the first ``R = rotary_dim`` channels; the remaining ``D − R`` pass unchanged.

    ``rotary_dim`` defaults to the whole head (``R = D``). A smaller ``R`` is *partial* rotary
    (GPT-NeoX, Qwen3-Next's ``partial_rotary_factor = R / D``): the frequencies then use ``R`` as
    the dimension, and the pairs are split halves of the rotated block (``rotate_half`` pairing).

    ``forward(x [B, T, H, D], offset) -> [B, T, H, D]`` for positions ``offset … offset+T−1``;
    computed in float32 (float64 for float64 inputs), returned in ``x``'s dtype. ``R`` must be even
    and at most ``D``.
    """

    def __init__(self, head_dim: int, theta: float = 10000.0, rotary_dim: int | None = None):
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(
                f"rotary_dim must be even and in (0, head_dim = {head_dim}], got {rotary_dim}"
                if rotary_dim != head_dim
                else f"rotary embeddings need an even head_dim, got {head_dim}"
            )
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        inv = theta ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        T = x.shape[1]
        cd = torch.float64 if x.dtype == torch.float64 else torch.float32
        pos = torch.arange(offset, offset + T, device=x.device, dtype=cd)
        ang = pos[:, None] * self.inv_freq.to(device=x.device, dtype=cd)[None, :]  # [T, R/2]
        cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
        R = self.rotary_dim
        xr = x[..., :R].to(cd)
        x1, x2 = xr.chunk(2, dim=-1)
        rot = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)
        return rot if R == x.shape[-1] else torch.cat([rot, x[..., R:]], dim=-1)
