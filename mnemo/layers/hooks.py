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
kernel never forms) are built only while a hook of any kind — forward, pre-forward, backward — is
attached to the point: see :attr:`HookPoint.active`.

**Pieces.** A model may read one call's tokens in consecutive pieces (a task-signal model reads
segment by segment, :mod:`mnemo.models.task_signal`), so each hook fires once per piece.
:func:`join_pieces` puts the pieces' values back together into the value one pass over the call
would have passed: tensors are concatenated along their time axis (:attr:`HookPoint.time_dim`,
``1`` by the layout convention ``[B, T, ...]``); a pattern over keys (:attr:`HookPoint.key_dim`)
gets each piece's key columns placed at their positions in the call; a ``hook_state`` (the state
after the call) and any non-tensor keep the last piece's value. A mixer that reads its input in
segments of its own (Titans MAC, the self-modifying projections) fires its hooks once per segment
the same way. Whoever reads in pieces says where each piece sits in the call (:func:`set_span`,
:func:`enter_piece` / :func:`leave_pieces`); a hook function learns it from :func:`span` — so an
intervention's ``positions`` are the call's tokens and a value recorded over the whole call can be
cut to a piece (:mod:`mnemo.interp`). The span is module state: one hooked call at a time per
process (as the hooks themselves, which are attached to the model's modules).

**Replacements are checked.** A hook function that returns a value replaces the intermediate; the
replacement must have the value's shape, dtype and device (a state record: the same type, and the
same shape and dtype leaf by leaf), or the call raises ``ValueError`` naming the hook — nothing
downstream broadcasts a wrong shape (:meth:`HookPoint.add`).

**Global hooks see the live values.** A hook of the point's own (:meth:`HookPoint.add`,
``run_with_hooks``, ``register_forward_hook`` on the point) is shown a ``hook_state`` as a copy
(:func:`show_state`), so its edits in place go on downstream but never reach the model's
parameters. A global module hook (``torch.nn.modules.module.register_module_forward_hook``, a
``TorchDispatchMode``'s module tracker) is shown the live values, not copies (a copy for every
global hook would cost every call): a ``hook_state``'s tensors may then be the parameters
themselves (a fresh memory's initial weights, expanded over the batch). Read them there; do not
edit them in place (under ``no_grad`` such an edit writes the parameters) — attach a hook to the
point to edit a state.

**Backward hooks and recomputation.** A backward hook registered on a hook point fires (the point
leaves its fast path while one is attached). With activation checkpointing, the model passes
:func:`checkpoint_hooks` to ``torch.utils.checkpoint``, so the hooks attached at the forward run
again in the backward's recomputation and the gradients are those of the hooked forward.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.nn.modules import module as _module


class _Span:
    """Where the values the hook points pass now sit in the model call: ``offset`` (the call
    position of the value's first token along its time axis), ``length`` (the call's tokens;
    ``None`` while the call is read in one pass, every value then covering the whole call) and
    ``again`` (the tokens are being read again, e.g. a segment re-run for its training signal:
    not a new read of the call); ``stop``: the call token after the piece now read (``None`` in
    one pass)."""

    __slots__ = ("offset", "length", "again", "stop")

    def __init__(self):
        self.offset, self.length, self.again, self.stop = 0, None, False, None


_SPAN = _Span()


def span() -> tuple[int, int | None]:
    """``(offset, length)`` of the value a hook function is now called with: its first token (along
    the hook's time axis) is the call's token ``offset``, and the call has ``length`` tokens. While
    a call is read in one pass ``(0, None)``: the value covers the whole call. While it is read in
    pieces (a task-signal model's segments, a mixer's own segments, :func:`set_span`) each value
    covers ``[offset, offset + n)`` of the call's ``length`` tokens (``n`` its size along the time
    axis); a negative offset: tokens before the call (a learned prefix, a segment run again)."""
    return _SPAN.offset, _SPAN.length


def piece_stop() -> int | None:
    """The call token after the piece now read (``offset + n`` of :func:`span`; ``None`` while the
    call is read in one pass): a piece with ``piece_stop() == length`` is the call's last, whose
    ``hook_state`` is the state after the call (the states between pieces are what the call itself
    continues from)."""
    return _SPAN.stop


def reading_again() -> bool:
    """Whether the tokens now passing the hook points are read again (a task-signal model's segment
    re-run from its start state to take its training signal; :func:`set_span` ``again=True``):
    what the call returns was read before, so a recording skips these values."""
    return _SPAN.again


def set_span(offset: int, length: int | None, again: bool = False, stop: int | None = None) -> tuple:
    """Say that the values the hook points pass from now on start at the call's token ``offset``
    of ``length`` and end before token ``stop`` (see :func:`span`, :func:`piece_stop`; ``again``:
    see :func:`reading_again`; default ``again=False``); returns the previous setting, restored by
    ``set_span(*previous)``. A no-op while ``torch.compile`` traces (nothing is written from a
    compiled graph)."""
    if torch.compiler.is_compiling():
        return 0, None, False, None
    prev = _SPAN.offset, _SPAN.length, _SPAN.again, _SPAN.stop
    _SPAN.offset, _SPAN.length, _SPAN.again, _SPAN.stop = offset, length, again, stop
    return prev


def enter_piece(start: int, n: int, total: int) -> tuple | None:
    """For a module that reads its ``total`` input tokens in pieces: the piece of ``n`` tokens at
    ``start`` of its input begins (nested in the enclosing span, so a mixer's segments inside a
    task-signal segment are placed in the call). Returns what :func:`leave_pieces` restores;
    ``None`` (and nothing set) when the piece is the whole input."""
    if n == total or torch.compiler.is_compiling():
        return None
    prev = _SPAN.offset, _SPAN.length, _SPAN.again, _SPAN.stop
    _SPAN.offset = prev[0] + start
    _SPAN.length = prev[1] if prev[1] is not None else total
    _SPAN.stop = prev[0] + start + n
    return prev


def leave_pieces(prev: tuple | None) -> None:
    """Restore the span :func:`enter_piece` returned (a no-op for ``None``)."""
    if prev is not None:
        _SPAN.offset, _SPAN.length, _SPAN.again, _SPAN.stop = prev


#: replacements hook functions have returned in this process (:func:`replacement_count`)
_REPLACED = [0]


def replacement_count() -> int:
    """How many replacements hook functions attached with :meth:`HookPoint.add` have returned in this
    process so far (a counter: compare two readings to learn whether a stretch of a call was
    intervened on; an edit made in place does not count)."""
    return _REPLACED[0]


def _reset_span() -> None:
    _SPAN.offset, _SPAN.length, _SPAN.again, _SPAN.stop = 0, None, False, None


@contextmanager
def kept_span() -> Iterator[None]:
    """Restore the span as it was on entry when the block ends (also on error): a call made from
    inside another (a model run from a hook function, a task-signal model's pieces) leaves the
    enclosing call's span as it found it."""
    if torch.compiler.is_compiling():  # nothing is written from a compiled graph (set_span)
        yield
        return
    prev = _SPAN.offset, _SPAN.length, _SPAN.again, _SPAN.stop
    try:
        yield
    finally:
        _SPAN.offset, _SPAN.length, _SPAN.again, _SPAN.stop = prev


def before_hook(value: torch.Tensor) -> tuple[int | None, torch.Tensor | None]:
    """What :func:`left_unchanged` needs to tell, after a hook point, whether a hook only read
    ``value``: its version counter, or under ``torch.inference_mode`` (inference tensors have no
    counter) a copy of it."""
    if value.is_inference():
        return None, value.clone()
    return value._version, None


def left_unchanged(before: torch.Tensor, after: Any, mark: tuple[int | None, torch.Tensor | None]) -> bool:
    """Whether a hook point gave back ``before`` untouched (``mark`` from :func:`before_hook`):
    ``before`` itself with its version counter unmoved, or, under ``torch.inference_mode``, a tensor
    equal to the copy taken before the hook, NaN where it held NaN (no gradient flows there, so equal
    values are the same value). A hook that edited the value in place or returned another one replaced it."""
    version, copy = mark
    if copy is not None:
        return isinstance(after, torch.Tensor) and after.shape == copy.shape and _same_entries(after, copy)
    return after is before and not before.is_inference() and before._version == version


def _same_entries(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal``, with a NaN equal to a NaN where it stands (a hook that only read a value
    holding NaN left it as it was; ``torch.equal`` alone would count it replaced)."""
    if torch.equal(a, b):
        return True
    return (
        (a.is_floating_point() or a.is_complex())
        and (a.dtype, a.device) == (b.dtype, b.device)
        and bool(torch.isclose(a, b, rtol=0, atol=0, equal_nan=True).all())
    )


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{list(value.shape)} {value.dtype} on {value.device}"
    return type(value).__name__


def _same_kind(a: torch.Tensor, b: Any) -> bool:
    """Whether ``b`` is a tensor of ``a``'s shape, dtype and device."""
    return isinstance(b, torch.Tensor) and (b.shape, b.dtype, b.device) == (a.shape, a.dtype, a.device)


def check_replacement(name: str | None, value: Any, new: Any) -> None:
    """Raise ``ValueError`` naming hook ``name`` unless ``new`` can replace ``value``: a tensor of
    the same shape, dtype and device; for a structured value (a state record, a tuple), the same
    type and structure with tensors of the same shape, dtype and device leaf by leaf (and other
    leaves of the same type)."""
    name = name or "hook"
    if isinstance(value, torch.Tensor):
        if not _same_kind(value, new):
            raise ValueError(
                f"{name}: a hook returned a replacement {_describe(new)}; it must have the shape, "
                f"dtype and device of the value it replaces, {_describe(value)}"
            )
        return
    leaves, spec = pytree.tree_flatten(value)
    new_leaves, new_spec = pytree.tree_flatten(new)
    if new_spec != spec:
        what = (
            f"a {type(new).__name__}"
            if type(new) is not type(value)
            else f"a {type(new).__name__} of another structure ({len(new_leaves)} leaves, not {len(leaves)})"
        )
        raise ValueError(
            f"{name}: a hook returned {what}; it must be a {type(value).__name__} structured as the "
            f"value it replaces ({len(leaves)} leaves: {', '.join(_describe(x) for x in leaves[:4])}"
            f"{', …' if len(leaves) > 4 else ''})"
        )
    for i, (a, b) in enumerate(zip(leaves, new_leaves)):
        if isinstance(a, torch.Tensor) and not _same_kind(a, b):
            raise ValueError(
                f"{name}: a hook returned a {type(value).__name__} whose leaf {i} is {_describe(b)}; "
                f"it must have the shape, dtype and device of the one it replaces, {_describe(a)}"
            )
        if not isinstance(a, torch.Tensor) and type(b) is not type(a):
            raise ValueError(
                f"{name}: a hook returned a {type(value).__name__} whose leaf {i} is a "
                f"{type(b).__name__}; the value it replaces has a {type(a).__name__} there"
            )


# the global module hooks (``torch.nn.modules.module.register_module_forward_hook`` …): dicts that
# PyTorch mutates in place, bound here so the hook points' fast path reads them in one lookup
_GLOBAL_FORWARD = _module._global_forward_hooks
_GLOBAL_FORWARD_PRE = _module._global_forward_pre_hooks
_GLOBAL_BACKWARD = _module._global_backward_hooks
_GLOBAL_BACKWARD_PRE = _module._global_backward_pre_hooks


def _wake(module, args) -> None:
    """A forward pre-hook that does nothing (the marker of a hook point's backward hook)."""
    return None


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
        # every intermediate, so this is most of its cost in one-token decoding). A backward hook
        # of this point leaves a marker among its forward pre-hooks (see register_full_backward_hook),
        # so two instance checks and the four global ones cover every kind of hook.
        if not (
            self._forward_hooks
            or self._forward_pre_hooks
            or _GLOBAL_FORWARD
            or _GLOBAL_FORWARD_PRE
            or _GLOBAL_BACKWARD
            or _GLOBAL_BACKWARD_PRE
        ):
            return x
        return super().__call__(x)

    @property
    def hooked(self) -> bool:
        """Whether calling this point runs any hook (its own forward, pre-forward, backward or
        pre-backward hooks, or a global module hook); when ``False`` it returns its input untouched,
        so a mixer may skip building the value it would pass (and use a cheaper equivalent)."""
        return bool(
            self._forward_hooks
            or self._forward_pre_hooks
            or self._backward_hooks
            or self._backward_pre_hooks
            or _GLOBAL_FORWARD
            or _GLOBAL_FORWARD_PRE
            or _GLOBAL_BACKWARD
            or _GLOBAL_BACKWARD_PRE
        )

    def _marked(self, handle):
        """``handle`` (of a backward hook) also holds a no-op forward pre-hook under its id, so the
        fast path of :meth:`__call__` sends calls through ``nn.Module``'s (which runs backward
        hooks) while the backward hook is attached; ``handle.remove()`` removes both."""
        self._forward_pre_hooks[handle.id] = _wake
        handle.extra_dict_ref = (*handle.extra_dict_ref, weakref.ref(self._forward_pre_hooks))
        return handle

    def register_full_backward_hook(self, hook, prepend: bool = False):
        """``nn.Module.register_full_backward_hook`` (default ``prepend=False``); the hook fires (the
        point leaves its fast path while it is attached)."""
        return self._marked(super().register_full_backward_hook(hook, prepend))

    def register_full_backward_pre_hook(self, hook, prepend: bool = False):
        """``nn.Module.register_full_backward_pre_hook`` (default ``prepend=False``); the hook fires
        (see :meth:`register_full_backward_hook`)."""
        return self._marked(super().register_full_backward_pre_hook(hook, prepend))

    def register_backward_hook(self, hook):
        """``nn.Module.register_backward_hook`` (deprecated by PyTorch); the hook fires (see
        :meth:`register_full_backward_hook`)."""
        return self._marked(super().register_backward_hook(hook))

    @property
    def active(self) -> bool:
        """Whether any hook of this point's own is attached: a forward, pre-forward, backward or
        pre-backward hook. A mixer skips building a costly value (attention's ``hook_pattern``,
        Mamba's ``hook_g``) unless this is true, so every hook attached to the point sees it;
        PyTorch's global module hooks (:attr:`hooked` counts them) do not make it build one."""
        return bool(
            self._forward_hooks or self._forward_pre_hooks or self._backward_hooks or self._backward_pre_hooks
        )

    def add(self, fn: Callable[[Any, str], Any]):
        """Attach ``fn(value, name) -> replacement or None``; returns the handle (``.remove()``).

        A replacement is checked before it goes on (:func:`check_replacement`): a tensor must have
        the value's shape, dtype and device, a structured value (a state record) the same type and
        the same tensor shapes and dtypes leaf by leaf; otherwise the call raises ``ValueError``
        naming the hook (its full name), the expected and the received value. An edit made in
        place on the value passed (``v.mul_(0)``, returning ``None`` or ``v``) takes effect too."""
        name = self.name

        def hook(module, inputs, output):
            new = fn(output, name)
            if new is not None and new is not output:
                check_replacement(name, output, new)
                _REPLACED[0] += 1
            return new

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

    Raises ``KeyError`` listing the known suffixes when a requested name matches nothing,
    ``TypeError`` naming ``names`` for a value of another type (``3``, ``[3]``)."""
    if names is None:
        return list(points)
    if callable(names):
        return [n for n in points if names(n)]
    wanted = [names] if isinstance(names, str) else list(names) if isinstance(names, Iterable) else [names]
    chosen: list[str] = []
    for w in wanted:
        if not isinstance(w, str):
            raise TypeError(
                "names: expected a hook name or suffix, a list of them, a predicate or None, got "
                f"{w!r} ({type(w).__name__})" + (f" in {names!r}" if w is not names else "")
            )
        hits = [n for n in points if n == w or n.endswith("." + w)]
        if not hits:
            suffixes = sorted({n.rsplit(".", 1)[-1] for n in points})
            raise KeyError(f"no hook point named {w!r}; hook names end in one of {suffixes}")
        chosen += [n for n in hits if n not in chosen]
    return chosen


def check_hooks(hooks) -> list[tuple[Any, Callable]]:
    """``hooks`` as a list of ``(name, fn)`` pairs; ``ValueError`` naming ``hooks`` and the entry
    otherwise (a bare pair ``("hook_q", fn)`` instead of a list of pairs, a non-callable ``fn``)."""
    if isinstance(hooks, tuple) and len(hooks) == 2 and isinstance(hooks[0], str):
        raise ValueError(
            f"hooks: expected a list of (name, fn) pairs, got the pair itself ({hooks[0]!r}, ...); "
            f"pass [({hooks[0]!r}, fn)]"
        )
    if isinstance(hooks, (str, bytes, dict)) or not isinstance(hooks, Iterable):
        raise ValueError(f"hooks: expected a list of (name, fn) pairs, got a {type(hooks).__name__}")
    out = []
    for i, pair in enumerate(hooks):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not callable(pair[1]):
            got = type(pair).__name__ if not isinstance(pair, (tuple, list)) else f"{len(pair)} items"
            if isinstance(pair, (tuple, list)) and len(pair) == 2:
                got = f"a {type(pair[1]).__name__} as fn"
            raise ValueError(f"hooks[{i}]: expected a (name, fn) pair with a callable fn, got {got}")
        out.append((pair[0], pair[1]))
    return out


@contextmanager
def attached(points: dict[str, HookPoint], hooks: Iterable[tuple[str, Callable]]) -> Iterator[None]:
    """Attach ``(name, fn)`` pairs for the duration of a ``with`` block (removed on exit, also on
    error). A name selects like :func:`select` (a suffix attaches to every layer's hook). Raises
    ``ValueError`` for ``hooks`` that are not ``(name, fn)`` pairs (:func:`check_hooks`),
    ``KeyError`` for an unknown name."""
    handles = []
    pairs = check_hooks(hooks)
    with kept_span():  # a model run from inside another call's hook leaves that call's span as it was
        _reset_span()  # a call read in one pass, until a piecewise reader says otherwise
        try:
            for name, fn in pairs:
                for n in select(points, name):
                    handles.append(points[n].add(fn))
            yield
        finally:
            for h in handles:
                h.remove()


_POINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _points_below(module: nn.Module) -> list[HookPoint]:
    points = _POINTS.get(module)
    if points is None:
        points = [m for m in module.modules() if isinstance(m, HookPoint)]
        _POINTS[module] = points
    return points


def checkpoint_hooks(module: nn.Module) -> dict:
    """Keyword arguments for ``torch.utils.checkpoint.checkpoint(module, ..., use_reentrant=False,
    **checkpoint_hooks(module))``: while hooks are attached to ``module``'s hook points, the
    recomputation in the backward pass runs the same hooks (the ones attached at the forward, in
    their order, with the forward's :func:`span`), so a replacement holds there too and the
    gradients are those of the hooked forward (a reading hook is called again in the
    recomputation). ``{}`` when none is attached (the default context, no cost) and while
    ``torch.compile`` traces (a compiled graph runs no Python hooks of its own)."""
    if torch.compiler.is_compiling():
        return {}
    attached_now = [
        (p, OrderedDict(p._forward_hooks), OrderedDict(p._forward_pre_hooks))
        for p in _points_below(module)
        if p._forward_hooks or p._forward_pre_hooks
    ]
    if not attached_now:
        return {}
    forward_span = (_SPAN.offset, _SPAN.length, _SPAN.again, _SPAN.stop)
    flags = [
        (
            dict(p._forward_hooks_with_kwargs),
            dict(p._forward_hooks_always_called),
            dict(p._forward_pre_hooks_with_kwargs),
        )
        for p, _, _ in attached_now
    ]

    @contextmanager
    def recompute():
        saved = [
            (
                p,
                p._forward_hooks,
                p._forward_pre_hooks,
                p._forward_hooks_with_kwargs,
                p._forward_hooks_always_called,
                p._forward_pre_hooks_with_kwargs,
            )
            for p, _, _ in attached_now
        ]
        prev = (_SPAN.offset, _SPAN.length, _SPAN.again, _SPAN.stop)
        try:
            for (p, fwd, pre), (kw, always, pre_kw) in zip(attached_now, flags):
                p._forward_hooks, p._forward_pre_hooks = OrderedDict(fwd), OrderedDict(pre)
                p._forward_hooks_with_kwargs, p._forward_hooks_always_called = dict(kw), dict(always)
                p._forward_pre_hooks_with_kwargs = dict(pre_kw)
            set_span(*forward_span)
            yield
        finally:
            for p, fwd, pre, kw, always, pre_kw in saved:
                p._forward_hooks, p._forward_pre_hooks = fwd, pre
                p._forward_hooks_with_kwargs, p._forward_hooks_always_called = kw, always
                p._forward_pre_hooks_with_kwargs = pre_kw
            set_span(*prev)

    @contextmanager
    def forward():
        yield

    return {"context_fn": lambda: (forward(), recompute())}


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


def show_state(point: HookPoint, state, shown=None):
    """Pass a state through ``point`` (a ``hook_state``) and return the state the stream goes on from.

    A hook sees a copy of ``shown`` (``state`` as the hooks show it, e.g. with kept steps taken:
    :meth:`mnemo.layers.cms.CMSLevel.settle`; default ``state`` itself), every tensor its own: a
    fresh state's weights are the parameters expanded over the batch, a state's tensors may be held
    by the autograd graph of the call or shared between its fields (a chunk's anchor and the running
    weights), so an edit in place on the state itself would write a parameter, break the backward,
    or change two fields. As at every hook point (:meth:`HookPoint.add`) a replacement returned goes
    on, and so does an edit made in place on the copy shown (as a replacement with that edit); a hook
    that only read it leaves the stream on ``state`` (the same values; a deferred state stays
    deferred). An edit of the copy's fields (``st.weights = ...``, a dict entry set) is an edit in
    place too, checked as a replacement (:func:`check_replacement`).
    Without a hook of the point's own (:attr:`HookPoint.active`): ``state``, untouched (nothing
    copied); a global module hook alone (e.g. ``FlopCounterMode``'s module tracker) sees ``state``
    itself, to read."""
    if not point.active:
        return point(state)
    leaves, tree = pytree.tree_flatten(state if shown is None else shown)
    leaves = [x.clone() if isinstance(x, torch.Tensor) else x for x in leaves]
    shown = pytree.tree_unflatten(leaves, tree)
    as_shown = pytree.tree_unflatten(leaves, tree)  # the copy as shown: an edited one is checked on it
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    marks = [before_hook(x) for x in tensors]
    seen = point(shown)
    if seen is not shown:
        return seen
    now, now_tree = pytree.tree_flatten(shown)
    if now_tree != tree or any(not _same_leaf(a, b) for a, b in zip(now, leaves)):
        check_replacement(point.name, as_shown, shown)  # a field set anew: a replacement, checked
        return shown
    return state if all(left_unchanged(x, x, m) for x, m in zip(tensors, marks)) else shown


def _same_leaf(a, b) -> bool:
    """Whether a state's leaf ``a`` after a hook is still ``b``, the one shown: the same tensor, or
    an equal value of the same type (an int, a flag)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    return a is b or (type(a) is type(b) and a == b)
