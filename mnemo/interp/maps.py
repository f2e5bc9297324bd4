"""Attention maps for every mixer: softmax probabilities, and the *implicit* ``T × T`` mixing matrix
of the linear, gated, delta-rule and state-space mixers — the matrix their parallel form multiplies
the values by (Ali et al. 2024, "The Hidden Attention of Mamba Models"; Zimerman et al. 2024).

Nothing here knows a mixer's internals. A mixer records its intermediates through its hook points
(:meth:`mnemo.models.LanguageModel.run_with_cache`) and builds its own map from them with its op's
map function (:meth:`mnemo.layers.Mixer.mixing`, e.g. :func:`mnemo.ops.delta_rule_map`). The
test-time-trained memories (Titans, TTT, Moneta, Yaad, Memora, HOPE's self-modifying memory) give
the attribution of each read to each written value (:mod:`mnemo.memory.attribution`): exact for
the memories linear in their values, an attribution — not a mixing matrix — for the nonlinear
ones (a mixer's ``mixing_exact`` says which); a mixer's hook names may be dotted paths of its
submodules (``memory.hook_q``).

``capture_maps(model, input_ids)`` returns every layer's map; ``mixing(mixer, x)`` one mixer's
:class:`~mnemo.layers.Mixing` on its (normalised) input ``x [B, T, d]``.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch

from ..layers.base import Mixing
from ..ops import (
    decay_matrix,
    delta_rule_map,
    gated_linear_attention_map,
    selective_scan_map,
)

# the ops' map functions under the names this module used to define (kept for existing code)
gla_map = gated_linear_attention_map
delta_map = delta_rule_map
scan_map = selective_scan_map

__all__ = ["Mixing", "capture_maps", "mixing", "decay_matrix", "gla_map", "delta_map", "scan_map"]


@torch.no_grad()
def mixing(mixer, x: torch.Tensor) -> Mixing:
    """The mixer's ``T × T`` map(s), values and op output for input ``x [B, T, d]`` (a fresh
    stream). Raises ``NotImplementedError`` for a mixer without an implicit attention map."""
    if not mixer.mixing_hooks:
        mixer.mixing({})  # raises NotImplementedError with the mixer's reason
    return mixer.mixing(mixer.mixing_acts(x))


def _index(x) -> int | None:
    """``x`` as an int — a numpy or 0-d torch integer too (``operator.index``) — or ``None`` (a bool,
    a float, anything else)."""
    if isinstance(x, bool) or (isinstance(x, torch.Tensor) and x.dtype == torch.bool):
        return None
    try:
        return operator.index(x)
    except TypeError:
        return None


def layer_indices(layers, n: int) -> list[int]:
    """``layers`` — a layer index (an int, a numpy or 0-d tensor integer) or a sequence of them — as a
    list of ints in ``[0, n)``. Raises ``ValueError`` naming ``layers``, the model's ``n`` layers
    and what was received otherwise."""
    one = _index(layers)
    if one is not None:
        given = [layers]
    elif (
        isinstance(layers, (str, bytes))
        or not isinstance(layers, Iterable)
        or (isinstance(layers, torch.Tensor) and layers.ndim == 0)
    ):
        raise ValueError(
            f"layers: expected a layer index or a sequence of them, ints in [0, {n}) (the model has {n} "
            f"layers), got {layers!r}"
        )
    else:
        given = list(layers)
    out = [_index(i) for i in given]
    bad = [i for i, j in zip(given, out) if j is None or not 0 <= j < n]
    if bad:
        raise ValueError(
            f"layers: {bad} out of range; the model has {n} layers (0 … {n - 1}); expected ints in "
            f"[0, {n}), got {layers!r}"
        )
    return out


@torch.no_grad()
def capture_maps(model, input_ids: torch.Tensor, layers=None) -> dict[int, torch.Tensor]:
    """``{layer: [B, H, T, T]}`` for every mixing layer of ``model`` on ``input_ids`` (layers without
    a map are skipped), or for the layers ``layers`` (ints) only. The keys are the blocks' int
    indices (``maps[0]``; :func:`~mnemo.interp.probe.circuit_scores` and
    :func:`~mnemo.interp.spectrum.memory_spectrum` key by str, ``"0"``, as their JSON files do, since
    the spectrum also has sub-layer keys such as ``"0.cms0"``). The hooks only read; the forward
    pass is unchanged. ``input_ids`` are moved to the model's device. ``layers``: an int (a numpy or
    0-d tensor integer too) or a sequence of them. Raises ``ValueError`` naming ``layers`` for an
    index out of range or not an integer."""
    n = len(model.blocks)
    if layers is not None:
        layers = layer_indices(layers, n)
    param = next(model.parameters(), None)
    if param is not None:
        input_ids = input_ids.to(param.device)
    wanted = {
        i: block.mixer.mixing_hooks
        for i, block in enumerate(model.blocks)
        if block.mixer.mixing_hooks and (layers is None or i in layers)
    }
    names = [f"blocks.{i}.mixer.{h}" for i, hooks in wanted.items() for h in hooks]
    if not names:
        return {}
    _, cache = model.run_with_cache(input_ids, names=names)
    maps = {}
    for i, hooks in wanted.items():
        # (a hook that never fired is left out, and its mixer says what that means: TitansMAC's
        # memory hooks on 0 tokens, which run no segment, give an empty map)
        empty = input_ids.shape[-1] == 0  # (only there: a hook that did not fire is an error otherwise)
        acts = {
            h: cache[f"blocks.{i}.mixer.{h}"] for h in hooks if not empty or f"blocks.{i}.mixer.{h}" in cache
        }
        mixer = model.blocks[i].mixer
        try:
            maps[i] = mixer.mixing(acts).maps
        except KeyError:
            if not empty or len(acts) == len(hooks):
                raise
            missing = [h for h in hooks if h not in acts]
            raise ValueError(
                f"input_ids: 0 tokens (shape {list(input_ids.shape)}); layer {i}'s mixer "
                f"{type(mixer).__name__} records no {', '.join(missing)} on them, so it has no map: "
                "expected T >= 1 tokens"
            ) from None
    return maps
