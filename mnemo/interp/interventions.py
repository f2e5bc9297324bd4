"""Causal interventions on any mixer, through its hook points: ablation, activation patching, state
patching and steering.

Every intervention here is a list of ``(hook name, fn)`` pairs — the hooks argument of
:meth:`mnemo.models.LanguageModel.run_with_hooks`, where ``fn(value, name)`` returns the
replacement value (or ``None`` to leave it). Lists compose by concatenation (:func:`compose`);
hooks on one point run in list order, each seeing the previous one's replacement.

- **Ablation** (:func:`ablate`, :func:`ablate_head`, :func:`ablate_channel`, :func:`ablate_write`,
  :func:`ablate_state`): replace a part of a value — heads, positions, channels, a whole state — by
  zeros or by its mean (over a reference run's batch and positions, :func:`mean_activations`, or
  over the current run's own when no means are given).
- **Activation patching** (:func:`patch`, :func:`activation_patching`): run a *corrupted* input with
  a part of one hook's value taken from a *clean* run; :func:`activation_patching` sweeps it per
  layer, head and/or position and returns the metric (:func:`logit_difference`,
  :func:`next_token_loss`) of every patched run as a tensor; :func:`patching_figure` draws it.
- **State patching** (:func:`state_patch`): the recurrent analogue of patching. Run prompt A to
  token ``t``, run prompt B to token ``t``, and continue B after ``t`` from a state whose chosen
  layers hold A's memory (a matrix memory, an SSM state, a KV cache — whatever the mixer carries
  between calls, :mod:`mnemo.layers.state`).
- **Steering** (:func:`steer`): add a scaled direction to a hook's value.
- :func:`induction_ablation`: the causal check of induction circuits behind ``mnemo probe ablate``
  (ablate the top-K induction heads, or K random ones, and measure in-context learning).

Axes. Mixer hook values are ``[B, T, H, …]``, so the **head axis is 2** and the **position axis
is 1**; for ``hook_pattern`` ``[B, H, T, S]`` the head axis is 1 and the position (query) axis 2.
Channels are the last axis. The heads are those of the layer's map
(:attr:`mnemo.layers.Mixer.map_heads`): a value ``[B, T, H]`` (a per-head gate; Mamba's
``[B, T, D]`` channels, which are its heads in the maps) has them on axis 2, and a mixer whose map
has one head (HOPE's self-modifying Titans, a memory over the whole ``d_model``) has it whole in
every value (``heads=0`` selects all of it). A value without such an axis (the residual stream,
Mamba's ``hook_B [B, T, N]``) takes no ``heads``. A state after the call (``hook_state``) has no
position axis; a tensor one (a matrix memory ``[B, H, K, V]``, Mamba's ``[B, D, N]``) has its heads
on axis 1. Typed states (``hook_state`` of a KV cache, a Titans memory …) are ablated whole.

Positions are the call's tokens (``0 … T − 1`` of ``input_ids``), also where a hook fires once per
piece of the call — a task-signal model's segments, Titans MAC's or the self-modifying projections'
own segments, a memory's learned prefix: each piece knows where it sits
(:func:`mnemo.layers.hooks.span`), so ``positions=[2]`` acts on token 2 only, a patch takes each
piece's rows from a clean value recorded over the whole call (``run_with_cache`` joins the
pieces), and per-position means are cut the same way.

Errors: an unknown hook name raises ``KeyError`` listing the known suffixes; a layer, head,
position or channel out of range (or not an integer) raises ``ValueError`` naming it, the hook and
the value's shape.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

from ..layers.hooks import attached, piece_stop, select, span
from ..layers.state import cat_rows, map_tensors
from .maps import _index as _an_int  # an int, a numpy or 0-d tensor integer too; None otherwise
from .maps import layer_indices

Hooks = list[tuple[str, Callable]]

__all__ = [
    "Hooks",
    "compose",
    "hook_names",
    "mean_activations",
    "ablate",
    "ablate_head",
    "ablate_channel",
    "ablate_write",
    "ablate_state",
    "patch",
    "activation_patching",
    "Patching",
    "logit_difference",
    "next_token_loss",
    "patching_figure",
    "state_patch",
    "steer",
    "induction_ablation",
]


# ----------------------------------------------------------------------------------------- names


def compose(*interventions: Iterable[tuple[str, Callable]]) -> Hooks:
    """One hooks list from several (applied in the order given)."""
    return [h for hooks in interventions for h in hooks]


def hook_names(model, names) -> list[str]:
    """The full hook names ``names`` selects on ``model`` (a full name, a suffix such as ``"hook_o"``
    matching every layer's, a list, or a predicate). Raises ``KeyError`` listing the known suffixes
    when a name matches nothing, or naming ``names`` when the selection is empty (``[]``, a
    predicate true for no hook point): an intervention on nothing would be a silent no-op."""
    chosen = select(model.hook_points, names)
    if not chosen:
        raise KeyError(f"names: selects no hook point (got {names!r}); see model.hook_points for the names")
    return chosen


def _mixer_hook(model, layer: int, hook: str) -> str:
    """``blocks.{layer}.mixer.{hook}``, validated (``ValueError`` for the layer, ``KeyError`` for
    the hook). A mixer whose map is a submodule's (Titans MAC/MAG/MAL: ``memory.hook_*``) and that
    has no ``hook`` of its own gives that submodule's (``blocks.{layer}.mixer.memory.hook_o``): the
    hook whose heads are the map's heads."""
    n = len(model.blocks)
    given, layer = layer, _an_int(layer)  # (a numpy or 0-d tensor integer too)
    if layer is None or not 0 <= layer < n:
        raise ValueError(f"layer: expected an int in [0, {n}) (the model has {n} layers), got {given!r}")
    base = f"blocks.{layer}.mixer."
    name = base + hook
    if name in model.hook_points:
        return name
    mixer = model.blocks[layer].mixer
    owners = {h.rsplit(".", 1)[0] for h in getattr(mixer, "mixing_hooks", ()) if "." in h}
    if len(owners) == 1 and "." not in hook:
        sub = f"{base}{owners.pop()}.{hook}"
        if sub in model.hook_points:
            return sub
    known = sorted(nm for nm in model.hook_points if nm.startswith(base))
    raise KeyError(f"no hook point named {name!r}; layer {layer}'s mixer has {known}")


def _axes(name: str) -> tuple[int, int | None]:
    """``(head axis, position axis)`` of hook ``name``'s value; a ``hook_state`` (the state after
    the call, ``[B, H, …]`` for a matrix memory) has no position axis (``None``)."""
    if name.endswith("hook_state"):
        return 1, None
    return (1, 2) if name.endswith("hook_pattern") else (2, 1)


def _as_index(what: str, idx, size: int, name: str, shape, unit: str = "") -> torch.Tensor:
    """``idx`` (an int, a sequence, a slice, a bool/long tensor) as a boolean mask of ``size``.
    ``ValueError`` naming ``what`` for an entry out of range or not an integer."""
    mask = torch.zeros(size, dtype=torch.bool)
    if idx is None:
        return ~mask
    if isinstance(idx, slice):
        try:
            mask[idx] = True
        except (TypeError, ValueError) as e:  # a zero step, a bound that is not an int
            raise ValueError(f"{what}: {e} (got {idx!r})") from None
        return mask
    try:
        t = torch.as_tensor(idx).cpu()
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(
            f"{what}: expected an int, a sequence of ints, a slice or a boolean mask, got {idx!r}"
        ) from None
    if t.dtype == torch.bool:
        if t.shape != (size,):
            raise ValueError(
                f"{what}: a boolean mask must have {size} entries for {name} {shape}, got {list(t.shape)}"
            )
        return t.clone()
    if (t.is_floating_point() or t.is_complex()) and t.numel():  # [] is an empty selection
        raise ValueError(f"{what}: expected integer indices, got {idx!r} ({t.dtype})")
    t = t.reshape(-1).long()
    bad = [int(i) for i in t if not -size <= int(i) < size]
    if bad:
        raise ValueError(
            f"{what} {bad[0] if len(bad) == 1 else bad} out of range: {name} has {size} "
            f"{unit or what + 's'}" + (f" (value of shape {shape})" if shape is not None else "")
        )
    mask[t] = True
    return mask


def _layer_of(model, name: str):
    """The mixer hook ``name`` belongs to (``blocks.{i}.mixer…``), else ``None``."""
    parts = name.split(".")
    if len(parts) > 3 and parts[0] == "blocks" and parts[2] == "mixer" and parts[1].isdigit():
        return model.blocks[int(parts[1])].mixer
    return None


def _head_axis(model, name: str, value: torch.Tensor) -> tuple[int | None, int]:
    """``(axis, heads)`` of the map's heads in the value now passing hook ``name``: ``axis=None``
    when the value is one head's whole (a mixer whose map has one head). ``ValueError`` naming
    ``heads`` for a value without a head axis."""
    if name.endswith("hook_pattern") or (name.endswith("hook_state") and value.ndim >= 3):
        return 1, value.shape[1]
    mixer = _layer_of(model, name)
    H = getattr(mixer, "map_heads", None) if mixer is not None else None
    if value.ndim >= 4:
        return 2, value.shape[2]
    if H is not None and value.ndim == 3 and value.shape[2] == H:
        return 2, H
    if H == 1 and value.ndim >= 2:
        return None, 1
    maps = f"; the layer's map has {H} head(s)" if H is not None else ""
    raise ValueError(
        f"heads: {name} has no head axis (value of shape {list(value.shape)}{maps}); select channels "
        "with channels=, or name a hook with heads (hook_o, hook_v …)"
    )


def _rows(value: torch.Tensor, name: str) -> tuple[int, int, int | None, int | None]:
    """``(position axis, offset, n, length)``: the value's ``n`` rows along its position axis are
    the call's tokens ``offset … offset + n − 1`` of ``length`` (:func:`~mnemo.layers.hooks.span`;
    one pass: ``offset = 0``, ``length = n``). ``n`` is ``None`` for a value without that axis."""
    p_ax = _axes(name)[1]
    n = value.shape[p_ax] if p_ax is not None and value.ndim > p_ax else None
    offset, length = span()
    if length is None:
        return p_ax, 0, n, n
    return p_ax, offset, n, length


def _pieced(value: torch.Tensor, name: str) -> bool:
    """Whether the value now passing is a piece of the call: it does not reach from the call's first
    token (or before it: a learned prefix) to its last."""
    _, offset, n, length = _rows(value, name)
    return n is not None and length is not None and (offset > 0 or offset + n != length)


def _position_rows(positions, value: torch.Tensor, name: str) -> torch.Tensor:
    """Boolean ``[n]``: which rows of the value now passing are among the call's ``positions``."""
    p_ax, offset, n, length = _rows(value, name)
    shape = list(value.shape)
    if n is None or length is None:
        raise ValueError(f"position: {name} has no position axis (value of shape {shape})")
    call = _as_index(
        "position", positions, length, name, shape, unit=f"positions in a call of {length} tokens"
    )
    idx = torch.arange(offset, offset + n)
    inside = (idx >= 0) & (idx < length)
    rows = torch.zeros(n, dtype=torch.bool)
    rows[inside] = call[idx[inside]]
    return rows


def _mask(
    model, value: torch.Tensor, name: str, heads=None, positions=None, channels=None
) -> torch.Tensor | None:
    """A boolean mask broadcastable to ``value`` selecting the given heads × positions × channels
    (``None`` for an axis: all of it); ``None`` when everything is selected."""
    if heads is None and positions is None and channels is None:
        return None
    shape = list(value.shape)
    mask = torch.ones([1] * value.ndim, dtype=torch.bool)

    def along(m, ax):
        view = [1] * value.ndim
        view[ax] = m.shape[0]
        return m.view(view)

    if heads is not None:
        ax, H = _head_axis(model, name, value)
        m = _as_index("head", heads, H, name, shape)
        mask = mask & (along(m, ax) if ax is not None else m.all().view([1] * value.ndim))
    if positions is not None:
        mask = mask & along(_position_rows(positions, value, name), _axes(name)[1])
    if channels is not None:
        mask = mask & along(_as_index("channel", channels, shape[-1], name, shape), value.ndim - 1)
    return mask.to(value.device)


def _aligned(ref: torch.Tensor, value: torch.Tensor, name: str, model, what: str) -> torch.Tensor:
    """``ref`` — a value recorded over a whole call of the same length (``run_with_cache``, pieces
    joined) — cut to the value now passing hook ``name``. In one pass the two have one shape. Where
    the call is read in pieces (:func:`_rows`) the value's rows are the call's tokens ``offset …
    offset + n − 1``: they take ``ref``'s rows there (rows before the call — a segment run again —
    keep the value's own); a map over keys takes the piece's key columns too. A value that starts
    before the call and covers all of ``ref`` (a learned prefix) takes it whole. ``ValueError``
    naming ``what`` when they cannot match (another length or shape)."""

    def differ(detail: str = "") -> ValueError:
        return ValueError(
            f"{name}: {what} {list(ref.shape)} does not match the value {list(value.shape)}{detail} "
            "(record it on an input of the same shape)"
        )

    p_ax, offset, n, length = _rows(value, name)
    if span()[1] is None or n is None or ref.ndim != value.ndim:  # one pass: the same shape
        if ref.shape != value.shape:
            raise differ()
        return ref
    R = ref.shape[p_ax]
    where = f" (the call's tokens {offset} … {offset + n - 1} of {length})"
    if R == n and offset <= 0 and offset + n == length:  # starts before the call (a prefix), covers it
        out = ref
    elif R == length:
        lo, hi = max(offset, 0), min(offset + n, length)
        if lo >= hi:
            return value
        out = ref.narrow(p_ax, lo, hi - lo)
        kd = model.hook_points[name].key_dim if name in model.hook_points else None
        if kd is not None and value.ndim > kd:  # a map over keys: the piece's columns end at its end
            if (lo, hi) != (offset, offset + n):
                raise differ(where)
            W, S = ref.shape[kd], value.shape[kd]
            c0 = (offset + n - S) - (length - W)
            if c0 < 0 or c0 + S > W:
                raise differ(where)
            out = out.narrow(kd, c0, S)
        if (lo, hi) != (offset, offset + n):  # rows outside the call keep the value's own
            if [s for i, s in enumerate(out.shape) if i != p_ax] != [
                s for i, s in enumerate(value.shape) if i != p_ax
            ]:
                raise differ(where)
            full = value.clone()
            full.narrow(p_ax, lo - offset, hi - lo).copy_(out)
            out = full
    else:
        raise differ(where)
    if out.shape != value.shape:
        raise differ(where)
    return out


def _rows_of_call(s: torch.Tensor, p_ax: int, offset: int, n: int, length: int) -> torch.Tensor:
    """``s`` (``length`` rows along ``p_ax``: one per call token) cut to the ``n`` rows of the value
    now passing, the call's tokens ``offset … offset + n − 1``; rows outside the call (a learned
    prefix before it, a segment run again) get zeros (keeping ``s``'s gradient)."""
    lo = min(max(offset, 0), length)
    inside = s.narrow(p_ax, lo, max(min(offset + n, length) - lo, 0))
    before = min(max(-offset, 0), n)
    after = n - before - inside.shape[p_ax]
    if before == 0 and after == 0:
        return inside

    def zeros(rows):
        shape = list(s.shape)
        shape[p_ax] = rows
        return s.new_zeros(shape)

    return torch.cat([zeros(before), inside, zeros(after)], p_ax)


def _at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32, or float64 where it is float64 (a metric of a float64 model is not rounded)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _tensor_value(value, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"{name} carries a {type(value).__name__}, not a tensor; ablate whole states with "
            f"ablate_state, patch states with state_patch"
        )
    return value


# ----------------------------------------------------------------------------------------- means


@torch.no_grad()
def mean_activations(model, input_ids: torch.Tensor, names, over: str = "batch_position") -> dict:
    """Means of hook values on a reference input, for mean-ablation: ``{full name: mean}``.

    ``over="batch_position"`` (default): the mean over the batch and position axes, kept as size-1
    axes (``[1, 1, H, V]`` for ``hook_o``), so it replaces a value of any length;
    ``over="batch"``: the mean over the batch only (``[1, T, H, V]``: per position, the same
    length only). A state after the call (``hook_state``: a matrix memory ``[B, H, K, V]``, a typed
    state such as a cache) has no position axis: it is averaged over its batch rows only. A hook
    whose values are integers (a mixture-of-experts MLP's ``hook_topk_indices``: expert ids) has no
    mean and gets no entry (so ``names=None``, every hook, works on such a model).
    Raises ``KeyError`` for an unknown name, ``ValueError`` for an unknown ``over``."""
    if over not in ("batch_position", "batch"):
        raise ValueError(f"over: expected 'batch_position' or 'batch', got {over!r}")
    _, cache = model.run_with_cache(input_ids, names=hook_names(model, names))
    out = {}
    for name, v in cache.items():
        if isinstance(v, torch.Tensor):
            if not (v.is_floating_point() or v.is_complex()):
                continue  # indices (an MoE's expert ids): no mean
            p_ax = _axes(name)[1]
            dims = (0,) if over == "batch" or p_ax is None else (0, p_ax)
            out[name] = v.mean(dims, keepdim=True)
        else:
            out[name] = map_tensors(lambda t: t.mean(0, keepdim=True), v)
    return out


def _mean_for(value: torch.Tensor, name: str, means, model) -> torch.Tensor:
    if not (value.is_floating_point() or value.is_complex()):
        raise ValueError(
            f"how='mean': {name} carries {value.dtype} values (indices, e.g. an MoE's expert ids), which "
            "have no mean; ablate it with how='zero' or replace it with patch"
        )
    if means is None:  # the current run's own mean over its batch and positions
        if _pieced(value, name):
            _, offset, n, length = _rows(value, name)
            raise ValueError(
                f"means: {name} passes the call in pieces (now tokens {offset} … {offset + n - 1} of "
                f"{length}: a task-signal model's or a mixer's own segments), so the run's own mean over "
                "its positions is not known when a piece is read; pass means=mean_activations(model, ids, "
                "names) from a reference input"
            )
        p_ax = _axes(name)[1]
        return value.mean((0,) if p_ax is None else (0, p_ax), keepdim=True).expand_as(value)
    if name not in means:
        raise KeyError(f"means has no entry for {name!r} (it has {sorted(means)}); see mean_activations")
    m = means[name].to(value.device, value.dtype)
    p_ax = _axes(name)[1]
    if p_ax is not None and m.ndim == value.ndim and m.shape[p_ax] != 1:  # per-position means
        if m.shape[0] == 1:  # one mean for every row of the batch
            m = m.expand(value.shape[0], *m.shape[1:])
        m = _aligned(m, value, name, model, f"means[{name!r}]")
    try:
        return torch.broadcast_to(m, value.shape)
    except RuntimeError:
        raise ValueError(
            f"means[{name!r}] of shape {list(m.shape)} does not broadcast to the value {list(value.shape)} "
            f"(per-position means need inputs of the same length)"
        ) from None


# -------------------------------------------------------------------------------------- ablation


def ablate(
    model,
    names,
    *,
    heads=None,
    positions=None,
    channels=None,
    how: str = "zero",
    means: dict | None = None,
) -> Hooks:
    """Hooks replacing the selected part of every hook ``names`` selects by zeros or its mean.

    Args:
        names: a full hook name (``blocks.0.mixer.hook_o``), a suffix (``"hook_o"``: every layer's),
            a list, or a predicate (as :func:`hook_names`).
        heads, positions, channels: what to replace on the head axis (the layer's map heads: axis
            2, 1 for ``hook_pattern``; a one-head map's value whole — see the module docstring),
            the position axis (the call's tokens; axis 1, 2 for ``hook_pattern``) and the last
            axis: an int, a sequence, a slice or a boolean mask; ``None`` = all of that axis.
        how: ``"zero"`` or ``"mean"``. The mean is ``means[name]`` (from :func:`mean_activations` on
            a reference input) broadcast to the value (per-position means cut to the piece passing),
            or, with ``means=None``, the value's own mean over the current run's batch and
            positions (not where the hook passes the call in pieces: ``ValueError``).
    Returns:
        ``[(full name, fn), …]`` for ``run_with_hooks``; each ``fn`` returns a new tensor of the
        value's shape and dtype (the input is not modified in place).
    Raises:
        KeyError: an unknown hook name (listing the known suffixes), a selection of no hook point,
            or ``means`` without the name.
        ValueError: ``how`` unknown; at run time, a head/position/channel out of range or not an
        integer (naming the hook and the value's shape), a value without that axis (``heads`` on
        ``hook_resid_pre``), ``how="mean"`` without ``means`` on a hook that passes the call
        in pieces, or ``how="mean"`` on integer values (an MoE's ``hook_topk_indices``).
    """
    if how not in ("zero", "mean"):
        raise ValueError(f"how: expected 'zero' or 'mean', got {how!r}")
    chosen = hook_names(model, names)

    def fn(value, name):
        value = _tensor_value(value, name)
        mask = _mask(model, value, name, heads, positions, channels)
        new = torch.zeros_like(value) if how == "zero" else _mean_for(value, name, means, model)
        return new.clone() if mask is None else torch.where(mask, new, value)

    return [(n, fn) for n in chosen]


def ablate_head(
    model, layer: int, heads, *, hook: str = "hook_o", how: str = "zero", means=None, positions=None
) -> Hooks:
    """Ablate head(s) ``heads`` of layer ``layer``'s mixer at ``hook`` (default ``hook_o``, the
    heads' outputs before the output projection: ``[B, T, H, V]``; Mamba's ``[B, T, D]`` channels;
    a one-head map's whole ``[B, T, d]``, HOPE's self-modifying Titans). The heads are the layer's
    map heads (those :func:`~mnemo.interp.probe.circuit_scores` scores); a mixer whose map is a
    submodule's and that has no ``hook`` of its own ablates that submodule's (Titans MAC/MAG/MAL:
    ``memory.hook_o``). ``hook="hook_v"`` removes the heads' values instead (what they write into
    the memory; with grouped-query attention ``hook_k``/``hook_v`` have the ``H_kv`` key/value
    heads).

    Zero-ablating ``hook_o`` head ``h`` of attention equals zeroing rows ``h·D … (h+1)·D − 1`` of
    the output projection's input. See :func:`ablate` for ``how``, ``means``, ``positions`` and
    the errors; ``heads`` out of range or not integers raises ``ValueError`` naming ``heads``, the
    hook and its head count (at once where the layer's head count is known)."""
    name = _mixer_hook(model, layer, hook)
    layer = _an_int(layer)
    H = getattr(model.blocks[layer].mixer, "map_heads", None)
    if heads is not None and H is not None and hook == "hook_o":
        _as_index("head", heads, H, name, None, unit=f"heads (layer {layer}'s map)")
    return ablate(model, name, heads=heads, positions=positions, how=how, means=means)


def ablate_channel(model, names, channels, *, how: str = "zero", means=None, positions=None) -> Hooks:
    """Ablate channels (the last axis) of the hook(s) ``names`` — e.g. residual-stream directions
    at ``blocks.1.hook_resid_pre`` ``[B, T, d_model]``, or Mamba channels at ``hook_o``. See
    :func:`ablate`."""
    return ablate(model, names, channels=channels, positions=positions, how=how, means=means)


def ablate_write(
    model, layer: int, positions, *, hook: str = "hook_v", heads=None, how: str = "zero", means=None
) -> Hooks:
    """Ablate the memory **writes** of layer ``layer`` at token ``positions``: ``hook_v`` (default,
    the value written; ``[B, T, H, V]``, the KV cache's values for attention) or the write strength
    (``hook="hook_beta"`` for the delta rules, ``"hook_theta"`` for Titans, ``"hook_dt"`` for
    Mamba …). With ``how="zero"`` on ``hook_beta``/``hook_v`` of a delta rule, nothing is written
    at those positions (and a zero ``v`` still erases along ``k`` — that is the delta rule). Reads
    at earlier positions are untouched. See :func:`ablate` for the arguments and errors."""
    return ablate(
        model, _mixer_hook(model, layer, hook), heads=heads, positions=positions, how=how, means=means
    )


def ablate_state(model, layer: int, *, how: str = "zero", means=None, hook: str = "hook_state") -> Hooks:
    """Replace the state layer ``layer``'s mixer hands on (``hook_state``: the memory after the
    call, a tensor such as ``[B, H, K, V]``, or a typed state such as a KV cache) by zeros or its
    mean (``means[name]`` from :func:`mean_activations`, else the mean over the batch rows),
    every tensor inside alike.

    The state after a call is what the *next* call continues from: the ablation acts on
    streaming/decoding (run a prefix with these hooks, continue from the returned state), not on
    the outputs of the call itself — also where the hook fires once per piece of the call (a
    task-signal model's segments, a mixer's own segments): only the state after the last piece is
    replaced, never one that the call's next piece reads. Raises ``KeyError``/``ValueError`` as
    :func:`ablate`."""
    if how not in ("zero", "mean"):
        raise ValueError(f"how: expected 'zero' or 'mean', got {how!r}")
    name = _mixer_hook(model, layer, hook)

    def fn(value, name):
        stop, length = piece_stop(), span()[1]
        if length is not None and stop is not None and stop != length:
            return None  # a state between two pieces of the call: the call itself continues from it
        if how == "zero":
            return map_tensors(torch.zeros_like, value)
        if means is not None:
            if name not in means:
                raise KeyError(f"means has no entry for {name!r} (it has {sorted(means)})")
            leaves, spec = pytree.tree_flatten(value)
            refs = pytree.tree_flatten(means[name])[0]
            if len(refs) != len(leaves):
                raise ValueError(f"means[{name!r}] is structured differently from the state")
            new = []
            for i, (t, r) in enumerate(zip(leaves, refs)):
                if isinstance(t, torch.Tensor):
                    try:
                        t = torch.broadcast_to(r.to(t), t.shape).clone()
                    except RuntimeError:
                        raise ValueError(
                            f"means[{name!r}]: leaf {i} of shape {list(r.shape)} does not broadcast to the "
                            f"state's {list(t.shape)} (record the means on an input of the same length)"
                        ) from None
                new.append(t)
            return pytree.tree_unflatten(new, spec)
        return map_tensors(
            lambda t: t.mean(0, keepdim=True).expand_as(t).clone() if t.is_floating_point() else t, value
        )

    return [(name, fn)]


# ---------------------------------------------------------------------------------------- steering


def steer(model, names, direction: torch.Tensor, *, scale: float = 1.0, positions=None) -> Hooks:
    """Hooks adding ``scale · direction`` to the value of every hook ``names`` selects.

    ``direction`` matches the value's trailing axes: ``[d_model]`` at a residual hook
    (``blocks.1.hook_resid_pre``), ``[H, V]`` (or ``[V]``, every head) at a mixer's ``hook_o`` …;
    it broadcasts over the batch and positions (all positions, or ``positions`` only: the call's
    tokens, also where the hook passes the call in pieces). The result
    is ``value + scale · direction`` computed in the value's dtype (default ``scale=1.0``; a
    tensor too — one value, or one axis per axis of the value with 1 on the direction's axes, e.g.
    ``[B, 1, 1]`` per row at a residual hook, or ``[1, T, 1]`` per position over the call's ``T``
    tokens, also where the hook passes the call in pieces or with rows outside the call, a learned
    prefix's, which such a scale leaves unsteered — which keeps its gradient where it requires one).
    Raises ``KeyError`` for an unknown name and, at run time, ``ValueError`` when the direction's
    shape is not a suffix of the value's or a tensor scale's shape is not such a one, and when
    built ``ValueError`` for a ``scale`` that is not a finite real number."""
    chosen = hook_names(model, names)
    if isinstance(scale, torch.Tensor):  # a 0-d scale, or one per row ([B, 1, 1]) that broadcasts
        if scale.dtype == torch.bool or scale.is_complex() or not bool(torch.isfinite(scale.detach()).all()):
            raise ValueError(f"scale: expected a finite real number (or a tensor of them), got {scale!r}")
        if scale.numel() == 1:
            scale = scale.reshape(())  # a one-value scale of any shape is 0-d
        if scale.ndim == 0 and not scale.requires_grad:
            scale = scale.item()  # (a scale being optimised keeps its gradient)
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite real number, got {scale!r}")
    try:
        direction = torch.as_tensor(direction)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"direction: expected a tensor (or numbers), got {direction!r}") from None

    def fn(value, name):
        value = _tensor_value(value, name)
        d = direction.to(value.device, value.dtype)
        if d.ndim > value.ndim - 2 or list(value.shape[value.ndim - d.ndim :]) != list(d.shape):
            raise ValueError(
                f"direction: shape {list(d.shape)} must match the trailing axes of {name} "
                f"{list(value.shape)} (after batch and position)"
            )
        s = scale.to(value.device, value.dtype) if isinstance(scale, torch.Tensor) else scale
        if isinstance(s, torch.Tensor) and s.ndim == value.ndim:  # per position over the call's tokens
            p_ax, offset, n, length = _rows(value, name)  # a piece of the call: its rows of the scale
            # (a length-1 axis broadcasts, a per-row [B, 1, 1] scale over a one-token call included:
            # it steers a learned prefix's rows as a float scale and longer calls do)
            if n is not None and n != length and s.shape[p_ax] == length > 1:
                s = _rows_of_call(s, p_ax, offset, n, length)
        if (
            isinstance(s, torch.Tensor)
            and s.ndim
            and (
                s.ndim != value.ndim
                or any(n != 1 for n in s.shape[value.ndim - d.ndim :])
                or any(n not in (1, v) for n, v in zip(s.shape, value.shape))
            )
        ):  # (a [B] scale would meet the direction's axes: per channel, or torch's bare error)
            raise ValueError(
                f"scale: shape {list(s.shape)} does not scale {name} {list(value.shape)} per row or "
                f"position: give one axis per axis of the value, size 1 on its last "
                f"{d.ndim} (the direction's; e.g. [B, 1, 1] per row at a residual hook), or one number"
            )
        shifted = value + s * d
        mask = _mask(model, value, name, positions=positions)
        return shifted if mask is None else torch.where(mask, shifted, value)

    return [(n, fn) for n in chosen]


# ---------------------------------------------------------------------------------------- patching


def patch(model, clean_cache: dict, names, *, heads=None, positions=None, channels=None) -> Hooks:
    """Hooks replacing the selected part of every hook ``names`` selects by the value recorded in
    ``clean_cache`` (``model.run_with_cache(clean_ids, names=...)``; same shapes: clean and
    corrupted inputs of one length). ``heads``/``positions``/``channels`` as :func:`ablate`;
    ``None`` everywhere patches the whole value, and an empty selection (``positions=[]``) patches
    nothing. Where a hook passes the call in pieces (a task-signal model's segments, a mixer's own
    segments) each piece takes its rows of the clean value, which ``run_with_cache`` recorded over
    the whole call — so patching a model with its own cache reproduces its outputs. On a model
    whose CMS levels learn from the next-token loss inside the forward, a replaced value is a
    constant: the levels' training signal no longer flows through it (the intervention
    ``do(value = clean)``), so from the next segment on a self-patch that replaces a value between
    a level's read and the loss differs from the unpatched run by what that signal would have
    written (``mnemo.models.task_signal``). Raises
    ``KeyError`` for an unknown name or one the cache lacks, and at run time ``ValueError`` for an
    index out of range or a clean value that does not cover the value passing (another shape or
    length)."""
    chosen = hook_names(model, names)
    missing = [n for n in chosen if n not in clean_cache]
    if missing:
        raise KeyError(
            f"clean_cache has no value for {missing}; record them with run_with_cache(clean_ids, names=...)"
        )

    def fn(value, name):
        value = _tensor_value(value, name)
        clean = _tensor_value(clean_cache[name], name)
        mask = _mask(model, value, name, heads, positions, channels)
        if mask is not None and not bool(mask.any()):  # nothing of this piece is selected
            return None
        clean = _aligned(clean, value, name, model, "the clean value").to(value.device, value.dtype)
        return clean.clone() if mask is None else torch.where(mask, clean, value)

    return [(n, fn) for n in chosen]


def logit_difference(correct, wrong, position: int = -1) -> Callable[[torch.Tensor], torch.Tensor]:
    """Metric ``logits [B, T, V] -> scalar``: the mean over the batch of
    ``logits[b, position, correct[b]] − logits[b, position, wrong[b]]`` (``correct``, ``wrong``: an
    int or ``[B]`` token ids), in float32 (float64 for float64 logits). Default ``position=-1`` (the
    last position). Raises ``ValueError``
    naming the argument, when called, for a token id outside ``[0, V)``, ids that are not one per
    row, or a position outside ``[−T, T)`` (one that is not an int: at once)."""
    pos = _an_int(position)
    if pos is None:
        raise ValueError(f"position: expected an int (a position of the logits), got {position!r}")
    position = pos

    def metric(logits: torch.Tensor) -> torch.Tensor:
        B, T, V = logits.shape
        if not -T <= position < T:
            raise ValueError(
                f"position: expected an int in [-{T}, {T}) (logits of {T} positions), got {position}"
            )
        last = _at_least_float32(logits[:, position])
        ids = []
        for what, tok in (("correct", correct), ("wrong", wrong)):
            t = torch.as_tensor(tok, device=last.device)
            if t.is_floating_point() or t.ndim > 1 or (t.ndim == 1 and t.shape[0] not in (1, B)):
                raise ValueError(
                    f"{what}: expected an int token id or {B} of them (one per row), got {tok!r}"
                )
            t = t.long()
            if bool(((t < 0) | (t >= V)).any()):
                raise ValueError(
                    f"{what}: token ids must lie in [0, {V}) (the logits' vocabulary), got {tok!r}"
                )
            ids.append(t.expand(B))
        rows = torch.arange(B, device=last.device)
        return (last[rows, ids[0]] - last[rows, ids[1]]).mean()

    return metric


def next_token_loss(input_ids: torch.Tensor, positions=None) -> Callable[[torch.Tensor], torch.Tensor]:
    """Metric ``logits [B, T, V] -> scalar``: the mean next-token cross-entropy (nats) of
    ``input_ids [B, T]`` — the logits at ``t`` predict ``input_ids[:, t + 1]`` — over the target
    positions ``positions`` (ints in ``1 … T − 1``: the tokens predicted; default all), in float32
    (float64 for float64 logits). Raises
    ``ValueError`` naming ``input_ids`` when they are not ``[B, T]`` with ``T ≥ 2`` (one token
    predicts nothing: the mean would be NaN), naming ``positions`` for one outside ``1 … T − 1``
    (position 0 has no prediction) or not an integer, and, when called, naming ``logits`` when they
    are not ``[B, T, vocab]`` for ``input_ids [B, T]``."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2 or input_ids.shape[1] < 2:
        got = list(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(
            f"input_ids: expected [B, T] token ids with T >= 2 (a next token to predict), got {got}"
        )
    T = input_ids.shape[-1]
    idx = None
    if positions is not None:
        t = torch.as_tensor(positions)
        if t.is_floating_point() or t.dtype == torch.bool:
            raise ValueError(f"positions: expected target positions (ints in 1 … {T - 1}), got {positions!r}")
        t = t.reshape(-1).long()
        bad = [int(i) for i in t if not 1 <= int(i) <= T - 1]
        if bad:
            raise ValueError(
                f"positions: target positions must lie in 1 … {T - 1} (input_ids has {T} tokens; position 0 "
                f"is not predicted), got {bad}"
            )
        idx = t - 1

    def metric(logits: torch.Tensor) -> torch.Tensor:
        if logits.ndim != 3 or logits.shape[:2] != input_ids.shape:
            raise ValueError(
                f"logits: expected [{', '.join(map(str, input_ids.shape))}, vocab] (input_ids "
                f"{list(input_ids.shape)}), got {list(logits.shape)}"
            )
        ids = input_ids.to(logits.device)
        loss = F.cross_entropy(
            _at_least_float32(logits[:, :-1]).transpose(1, 2), ids[:, 1:], reduction="none"
        )  # [B, T-1]
        if idx is None:
            return loss.mean()
        return loss[:, idx.to(loss.device)].mean()

    return metric


class Patching(NamedTuple):
    """Result of :func:`activation_patching`.

    ``values``: the metric of each patched run, ``[N]`` (``per="layer"``), ``[N, H]`` (``"head"``),
    ``[N, T]`` (``"position"``) or ``[N, H, T]`` (``"head_position"``), ``N = len(names)``
    (missing heads of a layer with fewer are NaN), float64 for a float64 metric (a float64 model's,
    or a metric that returns a Python float), else float32; ``clean``, ``corrupted``: the metric of
    the unpatched runs."""

    values: torch.Tensor
    names: list[str]
    clean: float
    corrupted: float
    per: str

    @property
    def restored(self) -> torch.Tensor:
        """``(values − corrupted) / (clean − corrupted)``: 0 = no effect, 1 = the clean metric."""
        gap = self.clean - self.corrupted
        return (self.values - self.corrupted) / (gap if gap != 0 else math.nan)


PER = ("layer", "head", "position", "head_position")


@torch.no_grad()
def activation_patching(
    model,
    clean_ids: torch.Tensor,
    corrupted_ids: torch.Tensor,
    metric: Callable[[torch.Tensor], torch.Tensor],
    names="hook_o",
    *,
    per: str = "head",
) -> Patching:
    """Patch one piece of a clean run into the corrupted run at a time and measure ``metric``.

    For each hook ``names`` selects (default every mixer's ``hook_o``) and, by ``per``, each head,
    position or head × position (``"layer"``: the whole value), run ``corrupted_ids`` with that
    piece replaced by its value on ``clean_ids`` and record ``metric(logits)``. Clean and corrupted
    inputs have one shape ``[B, T]``. One forward pass per piece (``N·H·T`` for
    ``"head_position"``).

    Returns a :class:`Patching` (``.values``, ``.restored``). Raises ``ValueError`` for an unknown
    ``per`` or inputs of different shapes, ``KeyError`` for an unknown hook name, an empty
    selection or a selected hook that does not fire on the clean run."""
    if per not in PER:
        raise ValueError(f"per: expected one of {PER}, got {per!r}")
    if clean_ids.shape != corrupted_ids.shape:
        raise ValueError(
            f"clean_ids {list(clean_ids.shape)} and corrupted_ids {list(corrupted_ids.shape)} "
            f"must have one shape"
        )
    chosen = hook_names(model, names)
    clean_logits, cache = model.run_with_cache(clean_ids, names=chosen)
    silent = [n for n in chosen if n not in cache]
    if silent:
        raise KeyError(
            f"names: {silent} did not fire on this model's forward (a point of a part the layer does not "
            "run, e.g. the MLP hooks of a block without an MLP), so there is nothing to patch; name "
            "the hooks that do"
        )
    corrupted_logits, _ = model(corrupted_ids)
    clean_raw = metric(clean_logits)
    clean_m, corrupted_m = float(clean_raw), float(metric(corrupted_logits))
    # the metric's precision: float64 for a float64 tensor or a Python/numpy float (a double)
    wide = isinstance(clean_raw, float) or torch.as_tensor(clean_raw).dtype == torch.float64
    dtype = torch.float64 if wide else torch.float32

    def run(hooks) -> float:
        return float(metric(model.run_with_hooks(corrupted_ids, hooks)[0]))

    sizes = []
    for n in chosen:
        v = _tensor_value(cache[n], n)
        H = 1
        if per in ("head", "head_position"):
            try:
                H = _head_axis(model, n, v)[1]
            except ValueError:
                raise ValueError(
                    f"per={per!r}: {n} has no head axis (value of shape {list(v.shape)})"
                ) from None
        sizes.append((H, clean_ids.shape[1]))  # positions: the call's tokens
    Hmax, T = max(s[0] for s in sizes), max(s[1] for s in sizes)
    shape = {"layer": [len(chosen)], "head": [len(chosen), Hmax], "position": [len(chosen), T]}.get(
        per, [len(chosen), Hmax, T]
    )
    values = torch.full(shape, math.nan, dtype=dtype)
    for i, n in enumerate(chosen):
        H, Tn = sizes[i]
        if per == "layer":
            values[i] = run(patch(model, cache, n))
        elif per == "head":
            for h in range(H):
                values[i, h] = run(patch(model, cache, n, heads=h))
        elif per == "position":
            for t in range(Tn):
                values[i, t] = run(patch(model, cache, n, positions=t))
        else:
            for h in range(H):
                for t in range(Tn):
                    values[i, h, t] = run(patch(model, cache, n, heads=h, positions=t))
    return Patching(values, chosen, clean_m, corrupted_m, per)


def patching_figure(result: Patching, title: str | None = None, restored: bool = True):
    """Heatmap of a :class:`Patching`: rows are the hooks (and heads, for ``"head_position"``),
    columns the heads or positions; colour = the restored fraction (default ``restored=True``:
    diverging around 0 with 1 = clean) or the raw metric. Returns the matplotlib figure (imported
    lazily)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = result.restored if restored else result.values
    labels = [n.replace(".mixer.", ".") for n in result.names]
    if result.per == "layer":
        grid, xlabel = grid[:, None], ""
    elif result.per == "head_position":
        H = grid.shape[1]
        labels = [f"{lab} h{h}" for lab in labels for h in range(H)]
        grid, xlabel = grid.reshape(-1, grid.shape[-1]), "position"
    else:
        xlabel = result.per
    rows, cols = grid.shape
    fig, ax = plt.subplots(figsize=(min(14, 2.5 + 0.35 * cols), 1.6 + 0.3 * rows), layout="constrained")
    finite = grid[torch.isfinite(grid)]
    lim = float(finite.abs().max()) if finite.numel() else 1.0
    lim = max(lim, 1.0) if restored else lim or 1.0
    cmap = matplotlib.colormaps["RdBu"].with_extremes(bad="0.92")
    im = ax.imshow(grid.numpy(), cmap=cmap, vmin=-lim, vmax=lim, aspect="auto")
    ax.set_yticks(range(rows), labels, fontsize=7)
    ax.set_xlabel(xlabel)
    fig.colorbar(im, ax=ax, label="restored fraction" if restored else "metric")
    sub = f"clean {result.clean:.3g}, corrupted {result.corrupted:.3g}"
    ax.set_title(f"{title} ({sub})" if title else f"activation patching per {result.per} ({sub})", fontsize=9)
    return fig


# ------------------------------------------------------------------------------------ state patching


@torch.no_grad()
def state_patch(
    model,
    source_ids: torch.Tensor,
    target_ids: torch.Tensor,
    at: int,
    layers=None,
    *,
    hooks: Hooks = (),
    mode: str | None = None,
):
    """Transplant the memory of one prompt into another at token ``at``.

    Runs ``source_ids[:, :at]`` and ``target_ids[:, :at]`` from empty states, builds the per-layer
    state whose layers ``layers`` (default all) are the source's and the others the target's
    (each :class:`~mnemo.layers.state.BlockState` whole: a matrix memory, an SSM state and its
    conv tail, a KV cache, a CMS memory), and continues ``target_ids[:, at:]`` from it (with
    ``hooks`` attached to that continuation only). With every layer patched this equals running
    ``cat(source_ids[:, :at], target_ids[:, at:])``. Both prefixes have ``at`` tokens, so
    positions (rotary, learned) stay aligned.

    Args:
        source_ids: ``[B, T_s]`` or ``[1, T_s]`` (one source for every target row), ``T_s ≥ at``.
        target_ids: ``[B, T]`` with ``1 ≤ at < T``.
        layers: layer indices (an int or a sequence) that take the source's state.
    Returns:
        ``(logits [B, T − at, vocab], state)``: the continuation's logits (position ``i`` is token
        ``at + i``) and the final state.
    Raises:
        ValueError: ``at`` out of range, batch sizes that do not match, a layer out of range.
    """
    if source_ids.ndim != 2 or target_ids.ndim != 2:
        raise ValueError(
            f"source_ids and target_ids must be [B, T], got {list(source_ids.shape)} and "
            f"{list(target_ids.shape)}"
        )
    B, T = target_ids.shape
    at_int = _an_int(at)  # a numpy / 0-d tensor integer too
    if at_int is None or not 1 <= at_int < T or at_int > source_ids.shape[1]:
        raise ValueError(
            f"at: expected an int with 1 ≤ at < {T} (target length) and at ≤ {source_ids.shape[1]} "
            f"(source length), got {at!r}"
        )
    at = at_int
    if source_ids.shape[0] not in (1, B):
        raise ValueError(f"source_ids: expected {B} rows (or 1), got {source_ids.shape[0]}")
    n = len(model.blocks)
    # an int (a numpy / 0-d tensor integer too, as ``at``) or a sequence of them
    chosen = list(range(n)) if layers is None else layer_indices(layers, n)
    _, source_state = model(source_ids[:, :at], mode=mode)
    if source_ids.shape[0] == 1 and B > 1:
        source_state = cat_rows([source_state] * B)
    _, target_state = model(target_ids[:, :at], mode=mode) if len(set(chosen)) < n else (None, None)
    state = [source_state[i] if i in chosen else target_state[i] for i in range(n)]
    with attached(model.hook_points, hooks):
        return model(target_ids[:, at:], state, mode=mode)


# ------------------------------------------------------------------------- induction-head ablation


def _heads_of(model, scores: dict) -> list[tuple[int, int, float]]:
    return [
        (int(layer), h, float(s)) for layer, entry in scores.items() for h, s in enumerate(entry["induction"])
    ]


@torch.no_grad()
def _icl_metrics(model, ids: torch.Tensor, length: int, hooks: Hooks, skip: int = 0) -> dict:
    """ICL score (:func:`~mnemo.interp.scores.icl_score`) and the losses on each half of a
    repeated sequence ``ids [B, skip + 2L]`` (``skip``: a BOS before the copies), with ``hooks``
    attached."""
    from .scores import icl_score

    with attached(model.hook_points, hooks):
        icl = icl_score(model, ids, skip=skip)
        logits, _ = model(ids)
    loss = F.cross_entropy(
        _at_least_float32(logits[:, :-1]).transpose(1, 2), ids[:, 1:], reduction="none"
    )  # target t+1
    # the copies' positions 1 … L−1: the first copy (unpredictable); L+1 … 2L−1: the repeat (by
    # induction); loss[:, t] predicts position t + 1, and the copies start at position ``skip``
    first = loss[:, skip : skip + length - 1].mean()
    repeat = loss[:, skip + length :].mean()
    return {"icl_score": icl, "repeat_loss": float(repeat), "first_half_loss": float(first)}


def induction_ablation(
    model,
    k: int,
    *,
    draws: int = 10,
    length: int = 32,
    batch: int = 16,
    seed: int = 0,
    how: str = "mean",
    random_from: str = "rest",
    hook: str = "hook_o",
    min_gain: float = 0.05,
    bos: int | None = None,
) -> dict:
    """The causal check of induction heads: ablate the ``k`` heads with the highest induction
    score (:func:`~mnemo.interp.probe.circuit_scores`, on random tokens repeated twice) at their
    mixer's ``hook`` (default ``hook_o``, the head outputs), and, as the control, ``k`` random heads
    (``draws`` draws, from the heads outside the top ``k`` with ``random_from="rest"``, or from all
    heads with ``"all"``).

    Measured on a fresh batch of ``batch`` random sequences of ``length`` tokens repeated twice:
    the in-context-learning score (late minus early loss, :func:`~mnemo.interp.scores.icl_score`),
    the loss on the repeated half (targets ``L+1 … 2L−1``, predictable by copying), the loss on
    the first half (targets ``1 … L−1``), and the in-context gain ``first − repeat``. Mean-ablation
    uses each hook's mean over the batch and positions of another such batch. Defaults:
    ``draws=10``, ``length=32``, ``batch=16``, ``seed=0``.

    ``bos``: the id of a run's fixed first token (``TrainConfig.bos``): every sequence (the scored
    ones, the mean-ablation reference, the ranking's) then starts with it, as the run's windows did,
    and the copies never hold it; the two halves' losses are taken on the copies (the BOS and the
    prediction of the first token from it count for neither; nor for the ICL score's spans), and
    mean-ablation's means are over all the reference's positions, the BOS's included.

    Returns a JSON-ready dict: ``baseline``, ``top_k`` (metrics and ``heads`` ``[[layer, head,
    score], …]``), ``random`` (per metric ``mean``, ``std``, ``values``; and the drawn ``heads``),
    each with its ``gain_removed`` (``1 − gain_after / gain_before``; for ``random``, per draw with
    its mean and std). When the baseline gain is below ``min_gain`` nats (default ``min_gain=0.05``: an
    untrained model, or one that does not use its context) the fractions are ``None`` with a
    ``note`` and a warning: a ratio of two near-zero gains says nothing.
    With ``random_from="rest"`` and fewer than ``k`` heads outside the top ``k``, the draws come from
    all heads, with a warning, and the result says ``"random_from": "all"``.
    Raises ``ValueError`` for ``k`` outside ``1 … number of heads − 1`` or a bad option."""
    from .probe import circuit_scores
    from .scores import repeated_random_tokens

    if how not in ("zero", "mean"):
        raise ValueError(f"how: expected 'zero' or 'mean', got {how!r}")
    if random_from not in ("rest", "all"):
        raise ValueError(f"random_from: expected 'rest' or 'all', got {random_from!r}")
    n_draws = _an_int(draws)
    if n_draws is None or n_draws < 1:
        raise ValueError(f"draws: expected an int ≥ 1, got {draws!r}")
    draws = n_draws
    k_int = _an_int(k)
    if k_int is None or k_int < 1:  # (its upper bound needs the heads: checked after the scores)
        raise ValueError(f"k: expected an int ≥ 1 (the number of top induction heads to ablate), got {k!r}")
    k = k_int
    was = model.training
    model.eval()
    try:
        scores = circuit_scores(model, length, batch, seed, bos=bos)
        heads = _heads_of(model, scores)
        if len(heads) < 2:
            raise ValueError(
                f"this model has {len(heads)} head(s) with an attention map (its mixers: "
                f"{sorted({type(b.mixer).__name__ for b in model.blocks})}); ablating the top-K against K "
                "random heads needs at least 2"
            )
        if not 1 <= k < len(heads):
            raise ValueError(
                f"k: expected an int in 1 … {len(heads) - 1} (fewer than the {len(heads)} heads with a map, "
                f"so that K random heads are a control and not the same heads), got {k!r}"
            )
        ranked = sorted(heads, key=lambda x: -x[2])
        top = ranked[:k]
        V = model.config.vocab_size
        device = next(model.parameters()).device
        ids, ref = (
            repeated_random_tokens(batch, length, V, torch.Generator().manual_seed(seed + i), bos=bos).to(
                device
            )
            for i in (1, 2)
        )
        skip = 0 if bos is None else 1
        layer_hooks = sorted({_mixer_hook(model, layer, hook) for layer, _, _ in heads})
        means = mean_activations(model, ref, layer_hooks) if how == "mean" else None

        def hooks_for(chosen) -> Hooks:
            by_layer: dict[int, list[int]] = {}
            for layer, h, _ in chosen:
                by_layer.setdefault(layer, []).append(h)
            return compose(
                *(
                    ablate_head(model, layer, hs, hook=hook, how=how, means=means)
                    for layer, hs in by_layer.items()
                )
            )

        base = _icl_metrics(model, ids, length, [], skip)
        top_m = _icl_metrics(model, ids, length, hooks_for(top), skip)
        pool = ranked[k:] if random_from == "rest" and len(ranked) - k >= k else ranked
        if random_from == "rest" and pool is ranked:
            warnings.warn(
                f"random_from='rest': only {len(ranked) - k} head(s) lie outside the top {k}, fewer than "
                f"the {k} a draw needs; the random heads are drawn from all {len(ranked)} heads (recorded as "
                "random_from='all' in the result)",
                stacklevel=2,
            )
        gen = torch.Generator().manual_seed(seed + 3)
        rand_runs, rand_heads = [], []
        for _ in range(draws):
            pick = [pool[int(i)] for i in torch.randperm(len(pool), generator=gen)[:k]]
            rand_heads.append([[layer, h, round(s, 4)] for layer, h, s in pick])
            rand_runs.append(_icl_metrics(model, ids, length, hooks_for(pick), skip))
    finally:
        model.train(was)

    def gain(m):
        return m["first_half_loss"] - m["repeat_loss"]

    def stats(key):
        vals = torch.tensor([r[key] for r in rand_runs], dtype=torch.float64)
        std = float(vals.std()) if len(vals) > 1 else 0.0
        return {"mean": float(vals.mean()), "std": std, "values": vals.tolist()}

    random = {key: stats(key) for key in ("icl_score", "repeat_loss", "first_half_loss")}
    gains = torch.tensor([gain(r) for r in rand_runs], dtype=torch.float64)
    g0 = gain(base)
    note = None
    if abs(g0) < min_gain:  # a ratio of a near-zero gain is noise over noise, not a fraction removed
        note = (
            f"the baseline in-context gain is {g0:.4g} nats (below min_gain = {min_gain}): the model does "
            "not use its context on this batch, so there is no gain to remove; gain_removed is null"
        )
        warnings.warn(f"induction_ablation: {note}", stacklevel=2)
        random["gain_removed"] = {"mean": None, "std": None, "values": [None] * len(rand_runs)}
        top_removed = None
    else:
        removed = 1 - gains / g0
        random["gain_removed"] = {
            "mean": float(removed.mean()),
            "std": float(removed.std()) if draws > 1 else 0.0,
            "values": removed.tolist(),
        }
        top_removed = 1 - gain(top_m) / g0
    return {
        "k": k,
        "how": how,
        "hook": hook,
        "length": length,
        "batch": batch,
        "seed": seed,
        "bos": bos,
        "draws": draws,
        "random_from": "rest" if pool is not ranked else "all",
        "baseline": {**base, "gain": g0},
        **({"note": note} if note else {}),
        "top_k": {
            **top_m,
            "gain": gain(top_m),
            "gain_removed": top_removed,
            "heads": [[layer, h, round(s, 4)] for layer, h, s in top],
        },
        "random": {**random, "heads": rand_heads},
    }
