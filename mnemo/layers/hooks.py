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
    (``blocks.0.mixer.hook_q``) so a hook function learns where it was called.
    """

    def __init__(self):
        super().__init__()
        self.name: str | None = None

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
