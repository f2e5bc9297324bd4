"""Parallelism strategies: how the training forward is wrapped, how a global batch is split over
the processes, how gradients and decisions are synchronised. One object per run, chosen by
:func:`make_strategy` from ``TrainConfig`` and the process group (``torchrun``):

* :class:`SingleProcess` — one process (also any flag with ``world == 1``);
* :class:`DataParallel` — ``DistributedDataParallel``: each rank trains on ``batch_size / N`` rows
  of the same global batch; DDP averages the gradients, so the loss is scaled by ``N / tokens``;
* :class:`Sharded` (``cfg.fsdp``) — FSDP2 (``fully_shard``, :mod:`mnemo.train.sharded`): rows as
  DDP, parameters and optimizer state sharded; every rank evaluates and writes its shards;
* :class:`ContextParallel` (``cfg.context_parallel``) — every rank trains on the whole batch but on
  its slice ``[r·T/N, (r+1)·T/N)`` of each sequence (:func:`~mnemo.train.distributed.
  context_parallel_forward`: states cross ranks forward, their gradients backward); the parameter
  gradients are summed over ranks with ``all_reduce``, so the update equals one process's.

In each, every rank draws the same global batch of ``cfg.batch_size`` rows from the same
generator (so the generator state is rank-independent and a checkpoint resumes on any number of
processes), in ``cfg.grad_accum`` micro-batches, and the loss of a rank is its summed
cross-entropy divided by the *global* number of supervised tokens (times ``N`` under DDP's
average), so gradients and logged losses equal the single-process run's up to float rounding.
Launched by ``torchrun --nproc_per_node N``: gloo on CPU, nccl on CUDA, one GPU per process.
Only rank 0 evaluates, writes checkpoints, ``metrics.jsonl`` and TensorBoard events, prints and
shows the progress bar; the other ranks wait at a barrier meanwhile. Under FSDP every rank
evaluates and runs the callbacks (the sharded model needs all ranks), rank 0 logs; checkpoints are
DCP shards written by every rank, resumed on any number of processes (a single-file checkpoint is
not resumed sharded: start with ``init_from``). Context parallelism: softmax-attention layers run
ring attention (their key/value blocks circulate over the ranks), recurrent layers relay their
states, layer by layer, so transformers and hybrids train this way too; what the ring cannot carry
(attention sinks, an attention block with a CMS) is rejected naming the layer (on any number of
processes); ``grad_accum`` splits the global batch into micro-batches, each one's states and
gradients cross ranks in its own forward/backward, the parameter gradients are summed once per
step. With one process every flag changes nothing.

Extension point: a new parallelism subclasses :class:`Strategy` and overrides what differs —
``check`` (configuration it cannot run), ``prepare`` (the model before the optimizer, e.g.
sharding), ``wrap`` (the module the training forward runs through), ``split`` (this rank's part of
the global batch and the loss scale), ``micro_batch`` (gradient-sync context per micro-batch),
``forward`` (a forward that needs the ranks), ``sum_gradients``, ``discard_gradients`` (those a
failed step left outside ``.grad``), ``grad_norm`` — and is returned by
:func:`make_strategy`. The collectives ``agree``, ``reduce_loss`` and ``all_finite`` work for any
number of processes.
"""

from __future__ import annotations

import contextlib
import inspect
import math

import torch
import torch.distributed as dist

from .batches import _Logits
from .config import TrainConfig
from .distributed import context_parallel_forward, shard
from .sharded import shard_model


class Strategy:
    """Rank ``rank`` of ``world`` processes on ``device`` for the run ``cfg`` (defaults ``rank=0``,
    ``world=1``); the base is also the single process."""

    name = "single process"

    def __init__(self, cfg: TrainConfig, device: torch.device, rank: int = 0, world: int = 1):
        self.cfg, self.device, self.rank, self.world = cfg, device, rank, world
        self.ddp = None  # the DDP wrapper, when there is one

    def check(self) -> None:
        """Raise ``ValueError`` naming the field when the run's configuration cannot run this way."""
        cfg = self.cfg
        if cfg.batch_size % (self.world * cfg.grad_accum):
            raise ValueError(
                f"TrainConfig.batch_size: the global batch ({cfg.batch_size}) must be a multiple of "
                f"the number of processes ({self.world}) x grad_accum ({cfg.grad_accum}) = "
                f"{self.world * cfg.grad_accum}"
            )

    def prepare(self, model) -> None:
        """The model, before the optimizer is built (which must see the final parameters)."""

    def wrap(self, model) -> torch.nn.Module:
        """The module the training forward runs through: ``(input_ids[, first][, logits_at=]) ->
        logits``."""
        return _Logits(model)

    def split(self, x, y, first, n_tokens: int):
        """``(x, y, first, scale)``: this rank's rows of the global batch (``[B, T]``; ``first``
        may be ``None``) and the factor that turns its summed cross-entropy into its share of the
        loss (``world / n_tokens``: DDP averages the gradients over ranks)."""
        scale = self.world / n_tokens
        x, y = shard(x, self.rank, self.world), shard(y, self.rank, self.world)
        first = None if first is None else shard(first, self.rank, self.world)
        return x, y, first, scale

    def micro_batch(self, i: int, n: int):
        """Context for micro-batch ``i`` of ``n``: gradients are synchronised in the last one's
        backward only."""
        return contextlib.nullcontext()

    def forward(self, model, x):
        """A forward that needs the other ranks: ``(logits, handle)`` (``handle.backward(loss)``
        replaces ``loss.backward()``), or ``None`` to run the wrapped module."""
        return None

    def sum_gradients(self, model) -> None:
        """After the last backward: make every rank's gradients the global ones (DDP and FSDP do
        it in the backward)."""

    def discard_gradients(self, model) -> None:
        """A step raised before its update: drop the gradients its micro-batches left anywhere but
        the parameters' ``.grad`` (which the optimizer's ``zero_grad`` drops)."""

    def grad_norm(self, params: list, clip: float) -> torch.Tensor:
        """The global gradient norm of ``params``, clipped to ``clip`` when ``clip > 0``."""
        if clip > 0:
            return torch.nn.utils.clip_grad_norm_(params, clip)
        return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))

    def agree(self, flag: bool) -> bool:
        """Rank 0's ``flag`` on every rank (one broadcast; none with a single process)."""
        if self.world == 1:
            return bool(flag)
        t = torch.tensor([float(flag)], dtype=torch.float64, device=self.device)
        dist.broadcast(t, 0)
        return bool(t.item() > 0)

    def reduce_loss(self, ce: torch.Tensor | None, failed: bool) -> tuple[float, bool]:
        """The summed cross-entropy of this micro-batch over all ranks, and whether any rank's
        forward pass failed (one all-reduce; none with a single process)."""
        if self.world == 1:
            return (math.nan if ce is None else ce.item()), failed
        value = math.nan if ce is None else ce.detach().double()
        t = torch.tensor([0.0, float(failed)], dtype=torch.float64, device=self.device)
        t[0] = value
        dist.all_reduce(t)
        return t[0].item(), bool(t[1].item() > 0)

    def nonfinite_parameters(self, model) -> list[str]:
        """Names of the parameters that hold NaN/inf (one host read; with several processes the
        ranks agree, each checking its own copy or FSDP shard)."""
        named = [(n, p.to_local() if hasattr(p, "to_local") else p) for n, p in model.named_parameters()]
        flags = torch.stack([torch.isfinite(p.detach()).all() for _, p in named])
        ok = flags.all()
        if self.world > 1:
            t = (~ok).to(torch.float64).reshape(1)
            dist.all_reduce(t)
            ok = t[0] == 0
        if bool(ok):
            return []
        return [n for (n, _), f in zip(named, flags.tolist()) if not f] or ["another process's shard"]


class SingleProcess(Strategy):
    """One process: the model as it is."""


class DataParallel(Strategy):
    """``DistributedDataParallel`` over ``world`` processes (gloo on CPU, nccl on CUDA)."""

    name = "data parallel"

    def wrap(self, model) -> torch.nn.Module:
        """``DistributedDataParallel(_Logits(model))``; DDP searches for unused parameters every
        step only when a probe forward/backward (one zero sequence of the training length) leaves
        some without a gradient (e.g. CMS levels that update less often than once per sequence), or
        when packed documents meet a CMS (a document may be shorter than a level's period)."""
        cfg = self.cfg
        probe = torch.zeros(1, cfg.seq_len, dtype=torch.long, device=self.device)
        logits, _ = model(probe)
        logits.float().sum().backward()
        unused = any(p.requires_grad and p.grad is None for p in model.parameters())
        # packed documents can be shorter than a CMS level's period: such a level may then get no
        # gradient in a step although the full-length probe reached it
        unused = unused or (cfg.pack_documents and any(b.stateful_mlp for b in model.blocks))
        model.zero_grad(set_to_none=True)
        ddp = torch.nn.parallel.DistributedDataParallel
        # buffers are constants (rotary frequencies, fixed decays): no per-forward broadcast
        # (``forward_sync_buffers`` replaces the deprecated ``broadcast_buffers`` in newer torch)
        no_sync_buffers = (
            {"forward_sync_buffers": False}
            if "forward_sync_buffers" in inspect.signature(ddp.__init__).parameters
            else {"broadcast_buffers": False}
        )
        self.ddp = ddp(
            _Logits(model),
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            find_unused_parameters=unused,
            **no_sync_buffers,
        )
        return self.ddp

    def micro_batch(self, i: int, n: int):
        # gradients are all-reduced once per step, in the last micro-batch's backward
        return self.ddp.no_sync() if i < n - 1 else contextlib.nullcontext()


class Sharded(Strategy):
    """FSDP2 over ``world`` processes: blocks and root sharded, the optimizer holds shards."""

    name = "sharded (FSDP2)"

    def prepare(self, model) -> None:
        # packed documents can be shorter than a CMS level's period: the level then gets a gradient
        # on some processes and not on others, and their reduce-scatters no longer match (gloo
        # aborts; DDP searches for unused parameters instead, see DataParallel.wrap)
        if self.cfg.pack_documents and any(b.stateful_mlp for b in model.blocks):
            raise ValueError(
                "TrainConfig.fsdp: not with pack_documents and a model with CMS levels (a packed "
                "document shorter than a level's period leaves the level without a gradient on some "
                "processes only, which FSDP2's reduce-scatter cannot match); train it without --fsdp "
                "(data-parallel) or unpacked"
            )
        shard_model(model, self.device)
        self._model = model

    def micro_batch(self, i: int, n: int):
        # FSDP2 likewise reduce-scatters in the last micro-batch's backward only
        self._model.set_requires_gradient_sync(i == n - 1)
        return contextlib.nullcontext()

    def discard_gradients(self, model) -> None:
        # FSDP2 keeps the gradients of a micro-batch run without sync unsharded, on its own
        # parameters (not the sharded .grad the optimizer sees) until the last one reduce-scatters;
        # torch has no public call that drops them, so this reaches into FSDP2's private fields
        # (see _fsdp_params) and raises where a torch release changed them, rather than let the
        # next step add a failed step's gradients to its own
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                for param in _fsdp_params(module):
                    param.unsharded_accumulated_grad = None
                    if hasattr(param, "_unsharded_param"):  # (absent before the first all-gather)
                        param._unsharded_param.grad = None

    def grad_norm(self, params: list, clip: float) -> torch.Tensor:
        # DTensor shards: the norm is reduced over the processes (inf: no clipping)
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else math.inf)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def _fsdp_params(module) -> list:
    """The ``FSDPParam`` objects of the FSDP2 module ``module`` — through torch's private
    ``FSDPModule._get_fsdp_state()``, ``FSDPState._fsdp_param_groups`` (``_fsdp_param_group`` in
    releases with one group per module), ``FSDPParamGroup.fsdp_params`` and
    ``FSDPParam.unsharded_accumulated_grad`` (all present in torch 2.13). Raises
    ``RuntimeError`` naming the field this torch release lacks."""

    def changed(what: str) -> RuntimeError:
        return RuntimeError(
            f"Sharded.discard_gradients: torch {torch.__version__}'s FSDP2 has no {what} (a private "
            "field mnemo uses to drop the unsynchronised gradients of a failed step's micro-batches; "
            "torch changed it): update mnemo.train.strategy for this torch release"
        )

    if not hasattr(module, "_get_fsdp_state"):
        raise changed("FSDPModule._get_fsdp_state()")
    state = module._get_fsdp_state()
    if hasattr(state, "_fsdp_param_groups"):
        groups = list(state._fsdp_param_groups)
    elif hasattr(state, "_fsdp_param_group"):
        groups = [state._fsdp_param_group]
    else:
        raise changed("FSDPState._fsdp_param_groups (nor _fsdp_param_group)")
    params = []
    for group in groups:
        if group is None:  # a module without parameters of its own
            continue
        if not hasattr(group, "fsdp_params"):
            raise changed("FSDPParamGroup.fsdp_params")
        for param in group.fsdp_params:
            if not hasattr(param, "unsharded_accumulated_grad"):
                raise changed("FSDPParam.unsharded_accumulated_grad")
            params.append(param)
    return params


class ContextParallel(Strategy):
    """Every rank the whole batch, its slice of each sequence; gradients summed with all-reduce."""

    name = "context parallel"

    def check(self) -> None:
        cfg = self.cfg
        if cfg.seq_len % self.world:
            raise ValueError(
                f"TrainConfig.seq_len: context parallelism over {self.world} processes needs a "
                f"multiple of {self.world}, got {cfg.seq_len}"
            )

    def split(self, x, y, first, n_tokens: int):
        # every row, this rank's slice of the targets (the inputs are cut by the forward)
        n = self.cfg.seq_len // self.world
        y = y[:, self.rank * n : (self.rank + 1) * n]
        return x, y, first, 1 / n_tokens  # sum / global count; the gradients are summed over ranks

    def forward(self, model, x):
        return context_parallel_forward(model, x, self.rank, self.world)

    def sum_gradients(self, model) -> None:
        """Sum every parameter's gradient over the ranks. Every rank issues the same collectives in
        the same order — one all-reduce of which parameters have a gradient, then one per parameter
        dtype over all of them (``None`` counts as zeros) — and a parameter no rank's slice reached
        keeps ``None``, as in a single process."""
        params = [p for p in model.parameters() if p.requires_grad]
        has = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=self.device)
        dist.all_reduce(has)
        reached = has.tolist()
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, p in enumerate(params):
            by_dtype.setdefault(p.dtype, []).append(i)
        for idx in by_dtype.values():
            parts = []
            for i in idx:
                g = params[i].grad
                parts.append((g if g is not None else torch.zeros_like(params[i])).reshape(-1))
            flat = torch.cat(parts)
            dist.all_reduce(flat)
            offset = 0
            for i in idx:
                p = params[i]
                k = p.numel()
                p.grad = flat[offset : offset + k].view_as(p) if reached[i] > 0 else None
                offset += k


def make_strategy(cfg: TrainConfig, device: torch.device, rank: int, world: int) -> Strategy:
    """The strategy for ``cfg`` on ``world`` processes (checked: ``ValueError`` naming the field).
    With one process every flag runs as :class:`SingleProcess`."""
    if world > 1 and cfg.context_parallel:
        kind = ContextParallel
    elif world > 1 and cfg.fsdp:
        kind = Sharded
    elif world > 1:
        kind = DataParallel
    else:
        kind = SingleProcess
    strategy = kind(cfg, device, rank, world)
    strategy.check()
    return strategy
