"""Hook points: the named places where a model's intermediates pass, to read or replace them.

A :class:`HookPoint` is an identity module. A mixer computes each intermediate once, in its
``forward``, and passes it through a hook point attribute named by the field's term (``hook_q``,
``hook_k``, ``hook_v``, ``hook_g`` — the log decay —, ``hook_beta``, ``hook_dt``, ``hook_state``,
``hook_o``, ``hook_pattern``); the full name is the module path, e.g. ``blocks.3.mixer.hook_k``.
A mixture-of-experts MLP passes its router decisions the same way (``blocks.3.mlp.hook_router_logits``,
``hook_topk_indices``, ``hook_topk_weights``; :class:`mnemo.layers.MoE`).
Hooks are ordinary PyTorch forward hooks, so a hook that returns a value replaces the
intermediate downstream; :meth:`mnemo.models.LanguageModel.run_with_cache` and
:meth:`~mnemo.models.LanguageModel.run_with_hooks` are the public way to attach them.

Values that cost extra to build (the softmax ``hook_pattern``, a ``T × T`` matrix the fused
kernel never forms) are built only while a hook is attached: see :attr:`HookPoint.active`.

**Pieces.** A model may read one call's tokens in consecutive pieces (a task-signal model reads
segment by segment, :mod:`mnemo.models.task_signal`), so each hook fires once per piece.
:func:`join_pieces` puts the pieces' values back together into the value one pass over the call
would have passed: tensors are concatenated along their time axis (:attr:`HookPoint.time_dim`,
``1`` by the layout convention ``[B, T, ...]``); a pattern over keys (:attr:`HookPoint.key_dim`)
gets each piece's key columns placed at their positions in the call; a ``hook_state`` (the state
after the call) and any non-tensor keep the last piece's value.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn
from torch.nn.modules import module as _module


class HookPoint(nn.Module):
    """Identity on any value (a tensor, a state record, ``None``); hooks attach to it.

    ``name`` is filled in by :func:`name_hook_points` with the module path
    (``blocks.0.mixer.hook_q``) so a hook function learns where it was called. ``time_dim``: the
    time axis of a tensor value (segments are joined along it, :func:`join_pieces`), ``None`` for a
    value without one; ``key_dim`` likewise for attention patterns' key axis. Defaults:
    ``time_dim=1``.
    """

    def __init__(self, time_dim: int | None = 1, key_dim: int | None = None):
        super().__init__()
        self.name: str | None = None
        #: the axis of the value that indexes this call's tokens (``1`` for ``[B, T, ...]``;
        #: ``None``: the value is not per token) — how :func:`join_pieces` concatenates pieces
        self.time_dim = time_dim
        #: for a map over keys (``hook_pattern [B, H, T, S]``: ``3``): the axis of the keys, whose
        #: last column is the piece's last token (``None`` for other values)
        self.key_dim = key_dim

    def forward(self, x: Any) -> Any:
        return x

    def __call__(self, x: Any) -> Any:
        # the common case, nothing attached: skip nn.Module's call machinery (a hook point sits on
        # every intermediate, so this is most of its cost in one-token decoding)
        if not self.hooked:
            return x
        return super().__call__(x)

    @property
    def hooked(self) -> bool:
        """Whether calling this point runs any hook (its own forward or pre-forward hooks, or a global
        module hook); when ``False`` it returns its input untouched, so a mixer may skip building
        the value it would pass (and use a cheaper equivalent)."""
        return bool(
            self._forward_hooks
            or self._forward_pre_hooks
            or _module._global_forward_hooks
            or _module._global_forward_pre_hooks
        )

    @property
    def active(self) -> bool:
        """Whether any forward hook is attached (lets a mixer skip building a costly value)."""
        return bool(self._forward_hooks)

    def add(self, fn: Callable[[Any, str], Any]):
        """Attach ``fn(value, name) -> replacement or None``; returns the handle (``.remove()``)."""
        name = self.name

        def hook(module, inputs, output):
            return fn(output, name)

        return self.register_forward_hook(hook)


def add_hook_points(module: nn.Module, *names: str) -> None:
    """Give ``module`` a fresh :class:`HookPoint` attribute ``hook_<name>`` for each ``name``."""
    for name in names:
        setattr(module, f"hook_{name}", HookPoint())


def name_hook_points(root: nn.Module) -> dict[str, HookPoint]:
    """``{full name: hook point}`` of every :class:`HookPoint` below ``root`` (names set on them)."""
    points = {}
    for name, module in root.named_modules():
        if isinstance(module, HookPoint):
            module.name = name
            points[name] = module
    return points


def select(points: dict[str, HookPoint], names) -> list[str]:
    """The hook names chosen by ``names``: ``None`` (all), a string (one name, or a suffix such as
    ``"hook_k"`` matching every layer's), a list of those, or a predicate ``f(name) -> bool``.

    Raises ``KeyError`` listing close names when a requested name matches nothing."""
    if names is None:
        return list(points)
    if callable(names):
        return [n for n in points if names(n)]
    wanted = [names] if isinstance(names, str) else list(names)
    chosen: list[str] = []
    for w in wanted:
        hits = [n for n in points if n == w or n.endswith("." + w)]
        if not hits:
            suffixes = sorted({n.rsplit(".", 1)[-1] for n in points})
            raise KeyError(f"no hook point named {w!r}; hook names end in one of {suffixes}")
        chosen += [n for n in hits if n not in chosen]
    return chosen


@contextmanager
def attached(points: dict[str, HookPoint], hooks: Iterable[tuple[str, Callable]]) -> Iterator[None]:
    """Attach ``(name, fn)`` pairs for the duration of a ``with`` block (removed on exit, also on
    error). A name selects like :func:`select` (a suffix attaches to every layer's hook)."""
    handles = []
    try:
        for name, fn in hooks:
            for n in select(points, name):
                handles.append(points[n].add(fn))
        yield
    finally:
        for h in handles:
            h.remove()


def join_pieces(point: HookPoint, values: list, lengths: list[int]) -> Any:
    """The value one pass over a call would have passed hook ``point``, from the values it passed
    while the call was read in consecutive pieces of ``lengths`` tokens (one value per piece, in
    order).

    * a ``hook_state``, a non-tensor or a point with ``time_dim=None``: the last value (the state
      after the call);
    * a tensor: the values concatenated along ``point.time_dim`` (each must have its piece's length
      there);
    * a map over keys (``point.key_dim`` set, e.g. attention's ``hook_pattern [B, H, n, S]``): each
      piece's ``S`` key columns end at the piece's last token; they are placed at those positions
      in a zero map whose key axis spans from the earliest key any piece saw to the call's end
      (keys from an earlier call, a window's cache, come first), and the pieces are concatenated
      along ``time_dim``. A causal map is zero on the columns a piece did not see, so this equals
      the map of one pass (for a cache that keeps every key, or a sliding window; not with
      attention sinks, whose columns come first — such a point sets ``key_dim=None`` and
      ``time_dim=None``).

    Raises:
        ValueError: ``values`` and ``lengths`` differ in number, or a value's time axis does not
            have its piece's length (the message names the hook, the piece and both sizes).
    """
    import torch

    name = point.name or "hook"
    if len(values) != len(lengths):
        raise ValueError(f"{name}: expected one value per piece ({len(lengths)}), got {len(values)}")
    last = values[-1]
    if (
        len(values) == 1
        or point.time_dim is None
        or name.rsplit(".", 1)[-1] == "hook_state"
        or not all(isinstance(v, torch.Tensor) for v in values)
    ):
        return last
    td = point.time_dim
    for i, (v, n) in enumerate(zip(values, lengths)):
        if v.ndim <= td or v.shape[td] != n:
            raise ValueError(
                f"{name}: piece {i} covers {n} tokens, but its value {list(v.shape)} has "
                f"{v.shape[td] if v.ndim > td else 'no'} entries along time_dim={td}"
            )
    if point.key_dim is None:
        return torch.cat(values, td)
    kd = point.key_dim
    ends, end = [], 0
    for n in lengths:
        end += n
        ends.append(end)
    first = min(e - v.shape[kd] for v, e in zip(values, ends))  # the earliest key (≤ 0: cached keys)
    width = end - first
    out = []
    for v, e in zip(values, ends):
        start = e - v.shape[kd] - first
        pad = [0, 0] * (v.ndim - 1 - kd) + [start, width - start - v.shape[kd]]
        out.append(torch.nn.functional.pad(v, pad))  # zero columns: keys this piece did not see
    return torch.cat(out, td)
