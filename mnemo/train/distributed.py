"""Multi-process helpers on ``torch.distributed`` (launched with ``torchrun``; gloo on CPU, nccl on
CUDA): process-group setup, the data-parallel batch split (used by :class:`~mnemo.train.Trainer`
for ``torchrun --nproc_per_node N -m mnemo train``), and sequence (context) parallelism for
recurrent mixers.

Context parallelism is the recurrent analogue of ring attention: the sequence is cut into
``world_size`` consecutive slices, rank ``r`` runs slice ``r`` starting from the state rank ``r − 1``
ended with, and passes its final state on. The backward pass runs the chain in reverse: rank ``r``
sends the gradient of the state it received back to rank ``r − 1``, which continues its own backward
from there. Outputs and gradients equal the single-process pass (the streaming contract, DESIGN §4.2).
Every layer's state must have a fixed size (recurrent mixers; attention layers need the whole KV
cache and are rejected).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree


def init_from_env(backend: str | None = None) -> tuple[int, int]:
    """Join the process group torchrun describes (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` …);
    returns ``(rank, world_size)`` — ``(0, 1)`` when not launched by torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


def local_device(device: torch.device) -> torch.device:
    """The device this process trains on: under torchrun a CUDA device without an index becomes
    ``cuda:LOCAL_RANK`` (one GPU per process), made the current device; anything else is returned
    unchanged. Raises ``ValueError`` when CUDA is requested but not available."""
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("TrainConfig.device: 'cuda' was requested but no CUDA device is available")
    if device.type == "cuda" and device.index is None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    return device


def backend_for(device: torch.device) -> str:
    """``"nccl"`` for CUDA tensors, ``"gloo"`` for CPU tensors."""
    return "nccl" if device.type == "cuda" else "gloo"


def barrier() -> None:
    """``dist.barrier()`` when a process group with more than one rank is running; else nothing."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def cleanup() -> None:
    """Leave the process group (if one was joined). All ranks meet at a barrier first, so no rank
    tears its connections down while a peer still uses them (gloo aborts the peer otherwise).
    The barrier is skipped when it fails (a peer already gone): leaving must not raise."""
    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() > 1:
            try:
                dist.barrier()
            except RuntimeError:
                pass
        dist.destroy_process_group()


def shard(batch: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s rows of a global batch (the global batch size must divide evenly)."""
    if batch.shape[0] % world:
        raise ValueError(
            f"the global batch ({batch.shape[0]}) must be a multiple of the world size ({world})"
        )
    n = batch.shape[0] // world
    return batch[rank * n : (rank + 1) * n]


# ------------------------------------------------------------------------------------------------
# states <-> flat tensor lists
# ------------------------------------------------------------------------------------------------


def _flatten(obj, out: list, device=None):
    """Collect the tensors (and integer counters, as 0-d int64 tensors on ``device`` — nccl ships
    CUDA tensors only) of a nested state (any pytree: typed states, lists, tuples, dicts)."""
    for leaf in pytree.tree_leaves(obj):
        if isinstance(leaf, torch.Tensor):
            out.append(leaf)
        elif isinstance(leaf, bool) or leaf is None:
            continue
        elif isinstance(leaf, int):
            out.append(torch.tensor(leaf, dtype=torch.int64, device=device))
        else:
            raise TypeError(f"context parallelism cannot ship a state entry of type {type(leaf).__name__}")
    return out


def _rebuild(template, tensors: list):
    """A state shaped like ``template`` with its tensors replaced, in ``_flatten`` order."""
    leaves, spec = pytree.tree_flatten(template)
    it = iter(tensors)
    new = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            new.append(next(it))
        elif isinstance(leaf, int) and not isinstance(leaf, bool):
            new.append(int(next(it).item()))
        else:
            new.append(leaf)
    return pytree.tree_unflatten(new, spec)


def _check_recurrent(model) -> None:
    from ..layers import Attention

    if getattr(model, "task_segment", None) is not None:
        raise ValueError(
            "context parallelism is not supported with CMS levels of objective 'task' (their state "
            "carries the model state at the start of an unfinished segment); use data parallelism"
        )
    for i, b in enumerate(model.blocks):
        if isinstance(b.mixer, Attention):
            raise ValueError(
                f"context parallelism needs fixed-size states; layer {i} is softmax attention "
                "(use a recurrent mixer, or data parallelism)"
            )


def context_parallel_forward(model, input_ids: torch.Tensor, rank: int, world: int, group=None):
    """Run rank ``rank``'s slice of ``input_ids [B, T]`` (``T`` a multiple of ``world``) with the
    state received from rank ``rank − 1``; returns ``(logits of the slice, handle)``.

    Call ``handle.backward(loss)`` instead of ``loss.backward()``: it waits for the gradient of this
    rank's final state from rank ``rank + 1``, back-propagates, and sends the gradient of the
    received state to rank ``rank − 1``.

    When this rank's forward raises (e.g. a :class:`~mnemo.ops.NonFiniteError`), it still sends
    rank ``rank + 1`` a state (of NaNs), so the later ranks fail too instead of waiting forever;
    then it re-raises.
    """
    from ..ops import finite_checks

    _check_recurrent(model)
    B, T = input_ids.shape
    if T % world:
        raise ValueError(f"the sequence length ({T}) must be a multiple of the world size ({world})")
    n = T // world
    ids = input_ids[:, rank * n : (rank + 1) * n]
    device = input_ids.device
    # the state's structure (and sizes) from a 1-token dry run; values come from the previous rank
    # (no finite checks: the structure is needed even when the weights went bad, see below)
    with torch.no_grad(), finite_checks(False):
        _, template = model(ids[:, :1])
    shapes = _flatten(template, [], device)
    received = None
    state = None
    if rank > 0:
        received = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in shapes]
        for t in received:
            dist.recv(t, src=rank - 1, group=group)
        received = [t.requires_grad_(t.is_floating_point()) for t in received]
        state = _rebuild(template, received)
    try:
        logits, final = model(ids, state)
    except Exception:
        if rank < world - 1:  # rank + 1 waits for a state: let it fail as well
            for t in shapes:
                fill = float("nan") if t.is_floating_point() else 0
                bad = torch.full(t.shape, fill, dtype=t.dtype, device=t.device)
                dist.send(bad, dst=rank + 1, group=group)
        raise
    sent = _flatten(final, [], device) if rank < world - 1 else []
    for t in sent:
        dist.send(t.detach().contiguous(), dst=rank + 1, group=group)
    return logits, _ContextHandle(rank, world, received, sent, group)


class _ContextHandle:
    def __init__(self, rank, world, received, sent, group):
        self.rank, self.world, self.received, self.sent, self.group = rank, world, received, sent, group

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate ``loss`` through this rank's slice and the states that cross ranks."""
        outs, grads = [loss], [torch.ones_like(loss)]
        if self.rank < self.world - 1:
            for t in self.sent:
                g = torch.empty(t.shape, dtype=t.dtype, device=t.device)
                dist.recv(g, src=self.rank + 1, group=self.group)
                if t.requires_grad:
                    outs.append(t)
                    grads.append(g)
        torch.autograd.backward(outs, grads)
        if self.rank > 0:
            for t in self.received:
                g = t.grad if t.grad is not None else torch.zeros_like(t)
                dist.send(g.contiguous(), dst=self.rank - 1, group=self.group)

    # integer counters travel as int64 tensors; their "gradients" are zeros
