"""Typed states: what each mixer carries between calls, as small dataclasses that are pytrees.

Every mixer declares its state as a dataclass decorated with :func:`state_dataclass`, which
registers it with PyTorch's pytree utilities, so the generic functions below work on any state —
a mixer's, a block's (:class:`BlockState`), or a model's list of them — without knowing its type:

* :func:`tensors` / :func:`map_tensors`: the tensors inside, or a copy with each one mapped;
* :func:`detach`, :func:`snapshot`, :func:`to`: gradients cut (and, for a snapshot, copied), or
  moved to a device / dtype;
* :func:`select_rows`, :func:`cat_rows`: one or several batch rows of a state, or states of
  several batches joined (every tensor's batch dimension is dim 0);
* :func:`nbytes`: bytes of the tensors inside — on ``meta`` tensors too, so a mixer's
  ``state_size_bytes`` is ``nbytes(self.state_spec(batch_size, seq_len))`` from the shapes and
  dtypes it declares (a bf16 cache counts 2 bytes per value), not a formula of its own.

Non-tensor leaves (``offset`` counters, flags) pass through unchanged.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.utils._pytree as pytree

T = TypeVar("T")


def state_dataclass(cls: type[T]) -> type[T]:
    """Make ``cls`` a keyword-only dataclass registered as a pytree node (its fields are children)."""
    cls = dataclass(kw_only=True)(cls) if not dataclasses.is_dataclass(cls) else cls
    names = [f.name for f in dataclasses.fields(cls)]
    pytree.register_dataclass(cls, field_names=names)
    return cls


@state_dataclass
class BlockState:
    """The state of one block: its mixer's and, for a stateful channel mixer (a CMS), its MLP's.

    ``offset`` is read through the mixer's state (tokens consumed so far)."""

    mixer: Any = None
    mlp: Any = None

    @property
    def offset(self) -> int:
        return getattr(self.mixer, "offset", 0)


def tensors(state) -> list[torch.Tensor]:
    """Every tensor inside ``state`` (depth first, in field order)."""
    return [x for x in pytree.tree_leaves(state) if isinstance(x, torch.Tensor)]


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], state):
    """A copy of ``state`` with every tensor ``t`` replaced by ``fn(t)``. A tensor that appears in
    several places (a record shared by several blocks: the task signal's pending segment) is mapped
    once and its result shared in the same places, so a copy or a move holds it once, as ``state``
    does."""
    done: dict[int, torch.Tensor] = {}

    def one(x):
        if not isinstance(x, torch.Tensor):
            return x
        if id(x) not in done:
            done[id(x)] = fn(x)
        return done[id(x)]

    return pytree.tree_map(one, state)


def detach(state):
    """``state`` with every tensor detached from the autograd graph (e.g. between training
    segments: truncated backpropagation through time)."""
    return map_tensors(torch.Tensor.detach, state)


def snapshot(state):
    """``state`` detached and copied: every tensor is a new one (``t.detach().clone()``), so no
    later in-place change reaches it. A state can hold the parameters themselves (a CMS level that
    has not stepped yet keeps its initial weights, a self-modifying memory the weights its chunk
    started from); carried across an optimizer step with :func:`detach` alone, those entries would
    change with the update. Taken right after the forward, a snapshot is the state the window ended
    with: what truncated back-propagation through time in ``mnemo train --carry-state`` carries
    (and what a checkpoint can save and restore exactly)."""
    return map_tensors(lambda t: t.detach().clone(), state)


def to(state, *args, **kwargs):
    """``state`` with every tensor moved like ``Tensor.to(*args, **kwargs)`` (device, dtype); as
    ``nn.Module.to``, a dtype converts the floating-point tensors only: integer entries (the token
    ids of a task signal's pending segment) keep theirs and move to the device alone. ``copy`` and
    ``memory_format`` apply to every tensor, as in ``Tensor.to``."""
    copy = kwargs.pop("copy", False)  # (which _parse_to refuses)
    device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    how = dict(non_blocking=non_blocking, copy=copy)
    if memory_format is not None:
        how["memory_format"] = memory_format

    def move(t: torch.Tensor) -> torch.Tensor:
        if dtype is not None and (t.is_floating_point() or t.is_complex()):
            return t.to(device, dtype, **how)
        return t.to(device, **how)

    return map_tensors(move, state)


def select_rows(state, rows):
    """The batch rows ``rows`` (an int, a slice, a list or an index tensor) of every tensor in ``state``.
    An int ``i`` keeps the batch dimension (one row) and counts from the end when negative, as
    ``t[i]`` does; ``IndexError`` naming ``rows`` when it is outside ``[−B, B)``. An integer scalar
    of another type (``numpy.int64``, a 0-d integer tensor such as an ``argmax``) counts as an int
    (indexing with it as it is would drop the batch dimension). A list or a tuple of row numbers
    is an index (``t[(0, 2)]`` itself would have read element ``[0, 2]`` of the first two
    dimensions)."""
    if isinstance(rows, tuple):
        rows = list(rows)
    if isinstance(rows, torch.Tensor) and rows.ndim == 0 and not rows.is_floating_point():
        if rows.dtype != torch.bool:
            rows = int(rows)
    elif isinstance(rows, numbers.Integral) and not isinstance(rows, bool):
        rows = int(rows)
    if isinstance(rows, int) and not isinstance(rows, bool):
        i = rows

        def row(t: torch.Tensor) -> torch.Tensor:
            n = t.shape[0]
            if not -n <= i < n:
                raise IndexError(f"rows: expected an int in [{-n}, {n}) (the batch size is {n}), got {i}")
            j = i % n
            return t[j : j + 1]

        return map_tensors(row, state)
    return map_tensors(lambda t: t[rows], state)


def cat_rows(states: list):
    """States of several batches, joined along the batch dimension (all must share one structure);
    a tensor shared between places of every state is joined once and stays shared.

    Raises ``ValueError`` naming the first position where the structures differ, or a tensor whose
    shape differs beyond the batch dimension (e.g. KV caches of different lengths)."""
    if not states:
        raise ValueError("cat_rows: expected at least one state, got none")
    flat = [pytree.tree_flatten(s) for s in states]
    spec = flat[0][1]
    for i, (_, other) in enumerate(flat[1:], 1):
        if other != spec:
            raise ValueError(f"cat_rows: state {i} is structured differently from state 0")
    leaves, done = [], {}  # (tensors shared between places stay shared, as in map_tensors)
    for n, parts in enumerate(zip(*(leaves for leaves, _ in flat))):
        if isinstance(parts[0], torch.Tensor):
            for i, p in enumerate(parts[1:], 1):  # (torch.cat's error names neither state nor entry)
                if p.shape[1:] != parts[0].shape[1:]:
                    raise ValueError(
                        f"cat_rows: tensor {n} of state {i} has shape {list(p.shape)}, of state 0 "
                        f"{list(parts[0].shape)}; all but the batch dimension (0) must agree (e.g. KV "
                        "caches of streams of different lengths cannot be joined)"
                    )
            key = tuple(id(p) for p in parts)
            if key not in done:
                done[key] = torch.cat(parts, dim=0)
            leaves.append(done[key])
        else:
            if any(p != parts[0] for p in parts):
                raise ValueError(
                    f"cat_rows: the non-tensor field {_leaf_path(states[0], n)} differs between states: "
                    f"{parts}"
                )
            leaves.append(parts[0])
    return pytree.tree_unflatten(leaves, spec)


def _leaf_path(state, n: int) -> str:
    """The path of leaf ``n`` of ``state`` (``[0].mixer.offset``), for an error message; its index
    where a node type has no keys."""
    try:
        return pytree.keystr(pytree.tree_flatten_with_path(state)[0][n][0])
    except Exception:  # (a pytree node registered without keys)
        return f"number {n}"


def nbytes(state) -> int:
    """Bytes of every tensor inside ``state`` (``numel × element size``; works on ``meta``).

    A tensor reached from two places counts twice: the size of the state with each entry held on
    its own, the quantity ``state_size_bytes`` declares (an upper bound). Where two entries are one
    tensor (a self-modifying memory's anchor at a chunk boundary *is* its weights), the resident
    size is smaller, and so is that of a copy or a move of it (:func:`snapshot`, :func:`to`: see
    :func:`map_tensors`, which keeps a shared tensor shared).
    """
    return sum(t.numel() * t.element_size() for t in tensors(state))


def spec(shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A ``meta`` tensor of ``shape`` and ``dtype``: a declared state entry that allocates nothing."""
    return torch.empty(shape, dtype=dtype, device="meta")
