"""Short causal depthwise convolution with a streaming state."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn


class ShortConvolution(nn.Module):
    """Causal depthwise 1-D convolution over time, followed by SiLU (as in H3, Mamba, GLA, DeltaNet).

        y_t = silu( Σ_{i=0}^{W−1} w_i ⊙ x_{t−W+1+i} + b )

    Args:
        channels: ``C``. kernel_size: ``W`` (taps, including the current token).
        activation: apply SiLU after the convolution (default True).

    ``forward(x [B, T, C], state [B, C, W−1] | None) -> (y [B, T, C], state [B, C, W−1])``:
    ``state`` holds the last ``W − 1`` inputs (zeros at the start), so any ``T`` (also
    ``T < W − 1``) continues a stream exactly.
    """

    def __init__(self, channels: int, kernel_size: int = 4, *, activation: bool = True, bias: bool = True):
        super().__init__()
        if kernel_size < 1:
            raise ValueError(f"kernel_size must be >= 1, got {kernel_size}")
        self.channels, self.kernel_size, self.activation = channels, kernel_size, activation
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))
        self.bias = nn.Parameter(torch.zeros(channels)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)

    def forward(
        self, x: torch.Tensor, state: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, C = x.shape
        W = self.kernel_size
        if state is None:
            state = x.new_zeros(B, C, W - 1)
        elif tuple(state.shape) != (B, C, W - 1):
            raise ValueError(
                f"conv state must have shape [B, C, W-1] = [{B}, {C}, {W - 1}], got {list(state.shape)}"
            )
        xt = torch.cat([state.to(x.dtype), rearrange(x, "b t c -> b c t")], dim=-1)  # [B, C, W-1+T]
        y = F.conv1d(
            xt, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype), groups=C
        )
        y = rearrange(y, "b c t -> b t c")
        if self.activation:
            y = F.silu(y)
        return y, xt[:, :, xt.shape[-1] - (W - 1) :]
