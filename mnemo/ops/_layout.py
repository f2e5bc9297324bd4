"""``rearrange`` and ``repeat`` for mnemo's own layout changes: einops' functions, each one call in a
``torch.compile`` graph.

With einops 0.8.2 and torch ≥ 2.8 dynamo traces einops line by line, its pattern parser included:
about 4,000 bytecodes a call, 60–75% of a model's trace (gated linear attention's one-layer forward:
41,000 of its 55,000 bytecodes). These two functions call einops unchanged and are marked
``allow_in_graph`` once dynamo is imported (:func:`mnemo._compile_marks.in_graph`, the mechanism
torch itself applied to einops up to 2.7): dynamo records one call per use without stepping into it,
and AOTAutograd then traces the call into the same ATen views and copies einops makes in eager mode
(einops computes its shapes from symbolic sizes as well, so one graph serves every length). Only
mnemo's own calls are marked: ``einops.rearrange`` called by a user's code is traced as torch
decides.
"""

from __future__ import annotations

import einops
import torch

from mnemo._compile_marks import in_graph

__all__ = ["rearrange", "repeat"]


@in_graph
def rearrange(tensor: torch.Tensor, pattern: str, **axes_lengths) -> torch.Tensor:
    """``einops.rearrange(tensor, pattern, **axes_lengths)``."""
    return einops.rearrange(tensor, pattern, **axes_lengths)


@in_graph
def repeat(tensor: torch.Tensor, pattern: str, **axes_lengths) -> torch.Tensor:
    """``einops.repeat(tensor, pattern, **axes_lengths)``."""
    return einops.repeat(tensor, pattern, **axes_lengths)
