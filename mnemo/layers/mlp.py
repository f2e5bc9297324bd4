"""Channel mixers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def swiglu_hidden(d_model: int, multiple_of: int = 32) -> int:
    """``8/3 · d_model`` rounded up to a multiple of ``multiple_of`` (LLaMA's choice; default
    ``multiple_of=32``)."""
    h = int(8 * d_model / 3)
    return multiple_of * (-(-h // multiple_of))


class SwiGLU(nn.Module):
    """Gated MLP ``W_down (silu(W_gate x) ⊙ W_up x)`` (Shazeer 2020, "GLU Variants").

    ``x: [..., d_model] -> [..., d_model]``; ``hidden`` defaults to :func:`swiglu_hidden`.
    """

    def __init__(self, d_model: int, hidden: int | None = None):
        super().__init__()
        hidden = hidden or swiglu_hidden(d_model)
        self.w_in = nn.Linear(d_model, 2 * hidden, bias=False)
        self.w_out = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_in(x).chunk(2, dim=-1)
        return self.w_out(F.silu(gate) * up)
