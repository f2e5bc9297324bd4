"""Multi-process helpers on ``torch.distributed`` (launched with ``torchrun``; gloo on CPU, nccl on
CUDA): process-group setup, the data-parallel batch split (used by :class:`~mnemo.train.Trainer`
for ``torchrun --nproc_per_node N -m mnemo train``), and sequence (context) parallelism.

Context parallelism cuts every sequence into ``world_size`` consecutive slices; rank ``r`` holds
slice ``r`` and the model runs layer by layer (:func:`context_parallel_forward`): a recurrent layer
starts from the state the same layer of rank ``r − 1`` ended with and passes its final state on
(the streaming contract, DESIGN §4.2; in the backward pass the state's gradient goes from ``r + 1``
back to ``r``), a softmax-attention layer runs ring attention
(:func:`~mnemo.ops.ring_attention.ring_attention`, Liu et al. 2023) over all slices. Outputs and
gradients equal the single-process pass to float rounding, for recurrent models, transformers and
hybrids.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.utils.checkpoint import checkpoint


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


_LEFT_KEY = "mnemo/cleanup/left"
_cleanups = 0  # this process's cleanups so far: one store key per process-group lifetime


def cleanup(timeout_s: float = 60.0, failed: bool | None = None) -> None:
    """Leave the process group (if one was joined). All ranks meet at a barrier first, so no rank
    tears its connections down while a peer still uses them (gloo aborts the peer otherwise).
    The barrier is skipped when it fails (a peer already gone): leaving must not raise.

    Rank 0 leaves last: every other rank counts itself out in the group's store once its
    ``destroy_process_group`` has returned, and rank 0 waits for that count (at most
    ``timeout_s`` seconds; a warning if it runs out) before it returns. Where rank 0 hosts the
    store (the ``env://`` rendezvous: ``MASTER_ADDR``/``MASTER_PORT`` without torchrun's agent
    store) rank 0 could otherwise exit while a peer's teardown still talks to the store, and that
    peer may then hang on the closed connection (seen once in the two-process tests); under
    torchrun's agent-hosted store the wait is harmless. No wait when the barrier failed (a peer is
    already gone).

    A process that leaves because of an error its peers do not share (an exception on this rank
    only: bad data, out of memory) must not wait for them: they may be blocked in a collective of
    the step this rank never reached, which the barrier would never match (or would match
    wrongly), so both would wait until the group's timeout. With ``failed`` (by default: when
    called while an exception propagates, e.g. from a ``finally`` block) the barrier and the wait
    are skipped; the process leaves at once, its peers' collectives fail on the closed connection
    (and torchrun stops the other workers when this one exits with an error).

    Args:
        timeout_s: how long rank 0 waits for the others to count themselves out, in seconds;
            default ``60.0``.
        failed: leave without meeting the others (see above); default ``None``: whether an
            exception is propagating (``sys.exc_info()``).
    """
    global _cleanups
    if not (dist.is_available() and dist.is_initialized()):
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    _cleanups += 1
    key = f"{_LEFT_KEY}/{_cleanups}"
    store = None
    if failed is None:  # called from a ``finally`` while an exception propagates
        failed = sys.exc_info()[0] is not None
    if world > 1 and not failed:
        try:
            dist.barrier()
            # the default group's store; private in torch, so its absence only loses the ordering
            store = dist.distributed_c10d._get_default_store()
        except Exception:  # a failed barrier (a peer gone) or no store: leave without waiting
            store = None
    dist.destroy_process_group()
    if store is None:
        return
    import time

    try:
        if rank != 0:
            store.add(key, 1)
            return
        deadline = time.monotonic() + timeout_s
        while (left := store.add(key, 0)) < world - 1 and time.monotonic() < deadline:
            time.sleep(0.01)
    except Exception:  # a peer or the store already gone: leaving must not raise
        return
    if left < world - 1:
        import warnings

        warnings.warn(
            f"cleanup: {left} of {world - 1} other ranks left the process group within {timeout_s} s; "
            "rank 0 leaves anyway",
            RuntimeWarning,
            stacklevel=2,
        )


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


def check_context_parallel(model) -> list[int]:
    """Check that ``model`` can run under :func:`context_parallel_forward`; returns the indices of
    its softmax-attention blocks (they run ring attention; every other block relays its state).

    Raises:
        ValueError: CMS levels of objective ``'task'`` (their state carries the model state at the
            start of an unfinished segment); an attention block with a stateful MLP (a CMS: its
            state would have to be relayed while the ring runs); attention with sinks; a
            recurrent mixer holding softmax attention inside (its KV state grows with the tokens
            seen: the relay would ship the whole cache rank to rank).
    """
    from ..layers import Attention

    if getattr(model, "task_segment", None) is not None:
        raise ValueError(
            "context parallelism is not supported with CMS levels of objective 'task' (their state "
            "carries the model state at the start of an unfinished segment); use data parallelism"
        )
    ring = []
    for i, b in enumerate(model.blocks):
        if isinstance(b.mixer, Attention):
            if b.stateful_mlp:
                raise ValueError(
                    f"layer {i}: softmax attention followed by a stateful MLP (CMS) cannot run under "
                    "context parallelism (ring attention for the mixer, a state relay for the MLP); "
                    "use a plain MLP there, or data parallelism"
                )
            if getattr(b.mixer, "n_sink", 0):
                raise ValueError(
                    f"layer {i}: attention sinks (n_sink = {b.mixer.n_sink}) are not supported by "
                    "ring attention; use data parallelism"
                )
            ring.append(i)
        elif any(isinstance(m, Attention) for m in b.mixer.modules()):
            raise ValueError(
                f"layer {i}: mixer {type(b.mixer).__name__} holds softmax attention inside, whose KV "
                "state grows with the tokens seen; context parallelism would relay the whole cache rank "
                "to rank (use data parallelism)"
            )
    return ring


def _check_recurrent(model) -> None:
    """Backwards-compatible name: :func:`check_context_parallel` without the result."""
    check_context_parallel(model)


# ------------------------------------------------------------------------------------------------
# the layer-by-layer schedule
# ------------------------------------------------------------------------------------------------


def _send_shapes(tensors, dst: int, group) -> None:
    """Send the shapes of ``tensors`` to ``dst`` (one int64 message: their count of dimensions, then
    every size). A state's structure is known to both ranks (the dry run), its sizes need not be:
    a meta-learned nested CMS keeps ``position mod period`` inputs per slower level."""
    device = tensors[0].device if tensors else None
    dims = [d for t in tensors for d in t.shape]
    dist.send(torch.tensor([len(dims), *dims], dtype=torch.int64, device=device), dst=dst, group=group)


def _recv_shapes(templates, src: int, group) -> list:
    """``[(shape, template)]``: the shapes :func:`_send_shapes` sent for tensors like ``templates``."""
    k = sum(t.dim() for t in templates)
    device = templates[0].device if templates else None
    got = torch.empty(k + 1, dtype=torch.int64, device=device)
    dist.recv(got, src=src, group=group)
    sizes = got.tolist()[1:]
    out, at = [], 0
    for t in templates:
        out.append((tuple(sizes[at : at + t.dim()]), t))
        at += t.dim()
    return out


class _RecvState(torch.autograd.Function):
    """Forward: receive a block's initial state from rank ``r − 1`` (``x`` passes through, to tie
    the node into the chain of block inputs). Backward: send the state's gradient back to ``r − 1``
    (zeros where the state was not used)."""

    @staticmethod
    def forward(ctx, x, src, group, *templates):
        got = [torch.empty(s, dtype=t.dtype, device=t.device) for s, t in _recv_shapes(templates, src, group)]
        for t in got:
            dist.recv(t, src=src, group=group)
        ctx.src, ctx.group = src, group
        ctx.meta = [(t.shape, t.dtype, t.device, t.is_floating_point()) for t in got]
        ctx.mark_non_differentiable(*[t for t in got if not t.is_floating_point()])
        return (x.view_as(x), *got)

    @staticmethod
    def backward(ctx, gx, *grads):
        for g, (shape, dtype, device, fl) in zip(grads, ctx.meta):
            if fl:
                g = torch.zeros(shape, dtype=dtype, device=device) if g is None else g
                dist.send(g.contiguous(), dst=ctx.src, group=ctx.group)
        return (gx, None, None, *[None] * len(grads))


class _SendState(torch.autograd.Function):
    """Forward: send a block's final state to rank ``r + 1`` (``x``, the block output, passes
    through). Backward: receive the state's gradient from ``r + 1`` and return it to the block."""

    @staticmethod
    def forward(ctx, x, dst, group, *state):
        _send_shapes(state, dst, group)
        for t in state:
            dist.send(t.detach().contiguous(), dst=dst, group=group)
        ctx.dst, ctx.group = dst, group
        ctx.meta = [(t.shape, t.dtype, t.device, t.is_floating_point()) for t in state]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, gx):
        grads = []
        for shape, dtype, device, fl in ctx.meta:
            if fl:
                g = torch.empty(shape, dtype=dtype, device=device)
                dist.recv(g, src=ctx.dst, group=ctx.group)
                grads.append(g)
            else:
                grads.append(None)
        return (gx, None, None, *grads)


def _failure_code(error: Exception | None) -> float:
    from ..ops import NonFiniteError

    return 0.0 if error is None else (1.0 if isinstance(error, NonFiniteError) else 2.0)


def context_parallel_forward(model, input_ids: torch.Tensor, rank: int, world: int, group=None):
    """Run rank ``rank``'s slice of ``input_ids [B, T]`` (``T`` a multiple of ``world``; tokens
    ``[r·n, (r+1)·n)``, ``n = T / world``) through ``model``, layer by layer, with the other ranks;
    returns ``(logits [B, n, vocab] of the slice, handle)``. Call ``handle.backward(loss)`` (every
    rank, the same number of times): all cross-rank gradients flow inside autograd.

    **Schedule.** Every rank runs the embedding of its slice (learned positions from ``r·n``),
    then the blocks in order:

    * a **softmax-attention block** runs with every rank at once: inside
      :func:`~mnemo.ops.ring_attention.ring_context` its :class:`~mnemo.layers.Attention` attends
      over all ranks' keys (:func:`~mnemo.ops.ring_attention.ring_attention`: key/value blocks
      circulate, online-softmax accumulation; causal, with windows and grouped-query heads), its
      rotary positions starting at the global ``r·n`` (the block gets the state
      ``AttentionState(kv=None, offset=r·n)``);
    * a **recurrent block** (any state, a CMS MLP included) relays its state: rank ``r`` receives
      the block's state from rank ``r − 1`` (rank 0 starts empty), runs its slice from it and sends
      the block's final state to rank ``r + 1`` — its sizes first (one small message: a state's
      structure is known from a one-token dry run, not its sizes, e.g. a meta-learned nested
      CMS's ``position mod period`` kept inputs), then its tensors. Send and receive are autograd
      functions, so in the backward pass the state's gradient travels from ``r + 1`` back to ``r``.

    Rank ``r`` is in layer ``i`` only after rank ``r − 1`` finished layer ``i`` (a relay) and
    before any rank starts layer ``i + 1`` (an attention block is a barrier of its ring). A run of
    recurrent layers therefore forms a wavefront (rank ``r − 1`` runs layer ``i + 1`` while rank
    ``r`` runs layer ``i``): ``L + N − 1`` slice-layer steps instead of the ``N · L`` of relaying
    the whole model rank after rank, so this one schedule serves recurrent models, transformers
    and hybrids alike. The backward pass runs the same wavefront in reverse. Per step and layer:
    one sizes message and one per state tensor (recurrent) or ``2(N − 1) + N`` key/value and
    gradient messages (attention).

    Activation checkpointing (``model.activation_checkpointing`` in training) recomputes each
    block, the ring included (every rank recomputes the same layer together), never the
    state messages, on the backend its forward chose and with its hooks (as the model's own).

    **Failures.** When a block raises on one rank (e.g. :class:`~mnemo.ops.NonFiniteError`), that
    rank keeps the protocol going — it relays NaN states to rank ``r + 1`` in the remaining
    recurrent layers (which then fail there too) — and before every attention block all ranks
    agree (one all-reduce of a flag) on whether any rank failed; then every rank raises
    (``NonFiniteError`` if the first failure was one, else ``RuntimeError``). A failure after the
    last attention block surfaces in the loss (NaN) on the ranks that did not fail, and the
    failing rank raises its error at the end. Not covered: an exception *inside* an attention
    block's ring (e.g. out of memory mid-ring) or in the one-token dry run that sizes the states;
    the other ranks then wait until the process group's timeout (``init_process_group(timeout=)``,
    torchrun's default 10 minutes for gloo/nccl collectives) before they fail.

    Raises:
        ValueError: ``T`` is not a multiple of ``world``, learned positions run out, or
            :func:`check_context_parallel` refuses the model.
    """
    from ..layers.attention import AttentionState
    from ..layers.state import BlockState
    from ..models.lm import _recompute_kwargs
    from ..ops import NonFiniteError, finite_checks
    from ..ops.ring_attention import ProcessRing, ring_context

    ring_layers = set(check_context_parallel(model))
    B, T = input_ids.shape
    if T % world:
        raise ValueError(f"the sequence length ({T}) must be a multiple of the world size ({world})")
    n = T // world
    start = rank * n
    ids = input_ids[:, start : start + n]
    device = input_ids.device
    ring = ProcessRing(group) if ring_layers else None
    prev = None if rank == 0 else (rank - 1 if group is None else dist.get_global_rank(group, rank - 1))
    nxt = (
        None if rank == world - 1 else (rank + 1 if group is None else dist.get_global_rank(group, rank + 1))
    )
    recompute = model.activation_checkpointing and model.training and torch.is_grad_enabled()

    def ring_call(block, state):
        def call(x):
            with ring_context(ring):  # also when a checkpoint recomputes the block in the backward
                return block(x, state)[0]

        return call

    def relay_call(block, template, has_state: bool):
        def call(x, *flat):
            return block(x, _rebuild(template, list(flat)) if has_state else None)

        return call

    x = model.embed_tokens(ids)  # (times Granite's embedding_multiplier)
    if model.pos_embed is not None:
        if T > model.config.max_position:
            raise ValueError(
                f"learned positions cover max_position = {model.config.max_position} tokens, "
                f"but the sequence reaches {T}"
            )
        x = x + model.pos_embed(torch.arange(start, start + n, device=x.device))
    x = model.hook_embed(x)
    failed: Exception | None = None
    for i, block in enumerate(model.blocks):
        if i in ring_layers:
            flag = torch.tensor([_failure_code(failed)], dtype=torch.float32, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            code = flag.item()
            if code:
                if failed is not None:
                    raise failed
                kind = NonFiniteError if code == 1 else RuntimeError
                raise kind(f"context parallelism: another rank's forward pass failed before layer {i}")
            call = ring_call(block, BlockState(mixer=AttentionState(kv=None, offset=start), mlp=None))
            # (the recompute runs on the forward's backend, with its hooks, as the model's own)
            x = checkpoint(call, x, use_reentrant=False, **_recompute_kwargs(block)) if recompute else call(x)
            continue
        # a relayed block: its state's structure from a 1-token dry run (no finite checks: the
        # structure is needed even when the weights went bad)
        with torch.no_grad(), finite_checks(False):
            _, template = block(x[:, :1].detach(), None)
        shapes = _flatten(template, [], device)
        got_state = prev is None
        if failed is None:
            try:
                received = []
                if prev is not None:
                    x, *received = _RecvState.apply(x, prev, group, *shapes)
                got_state = True
                call = relay_call(block, template, prev is not None)
                if recompute:
                    y, final = checkpoint(call, x, *received, use_reentrant=False, **_recompute_kwargs(block))
                else:
                    y, final = call(x, *received)
                if nxt is not None:
                    y = _SendState.apply(y, nxt, group, *_flatten(final, [], device))
                x = y
                continue
            except Exception as e:  # keep the protocol going; every rank fails at the next agreement
                failed = e
        if not got_state:  # drain what rank r − 1 sends (its real or NaN state)
            for size, t in _recv_shapes(shapes, prev, group):
                dist.recv(torch.empty(size, dtype=t.dtype, device=t.device), src=prev, group=group)
        if nxt is not None:  # rank r + 1 waits for a state: let it fail as well
            _send_shapes(shapes, nxt, group)
            for t in shapes:  # NaN values; the dry run's integer counters, which fit its sizes (0
                # would not: a nested CMS's kept inputs number ``position mod period``)
                if t.is_floating_point():
                    t = torch.full(t.shape, float("nan"), dtype=t.dtype, device=t.device)
                dist.send(t.contiguous(), dst=nxt, group=group)
    if failed is not None:
        raise failed
    logits = model.unembed(model.norm(x))  # (divided by Granite's logits_scaling)
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return logits, _ContextHandle()


class _ContextHandle:
    """What :func:`context_parallel_forward` returns with the logits; its ``backward(loss)`` is
    ``loss.backward()`` (the state and key/value gradients cross ranks inside autograd)."""

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate ``loss`` through this rank's slice and everything that crosses ranks."""
        loss.backward()
