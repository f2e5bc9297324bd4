"""The decoder language model: a stack of (mixer, MLP) blocks over a token embedding."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import sys
import types
import warnings
import weakref
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_model, save_model
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..layers import MIXERS, RMSNorm, SwiGLU
from ..layers.cms import ContinuumMemory
from ..layers.hooks import (
    HookPoint,
    attached,
    checkpoint_hooks,
    join_pieces,
    name_hook_points,
    reading_again,
    select,
    span,
)
from ..layers.moe import MoE
from ..layers.state import BlockState
from ..layers.state import detach as detach_state
from ..ops._common import assert_on_device, avoid_host_reads, pad_packed, unpad_packed, varlen_index
from ..ops.dispatch import recompute_as_chosen
from . import task_signal
from .config import ModelConfig
from .fused_loss import chunked_cross_entropy

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


class Block(nn.Module):
    """``x + m · mixer(norm(x))`` then ``x + m · mlp(norm(x))`` (pre-norm residual block; ``m`` the
    ``residual_multiplier``, default ``residual_multiplier=1.0``: no multiplication,
    ``ModelConfig.residual_multiplier``).

    Hook points (all ``[B, T, d_model]``): ``hook_resid_pre`` (the block input), ``hook_mixer_out``
    (the mixer's output, before ``m``), ``hook_resid_mid`` (after the mixer's residual add:
    ``resid_pre + m · mixer_out``), ``hook_mlp_out`` (only in a block with an MLP; before ``m``) and
    ``hook_resid_post`` (the block output, ``resid_mid + m · mlp_out``).
    """

    def __init__(
        self,
        mixer: nn.Module,
        d_model: int,
        mlp: nn.Module | None,
        eps: float,
        residual_multiplier: float = 1.0,
    ):
        super().__init__()
        self.residual_multiplier = float(residual_multiplier)
        self.mixer_norm = RMSNorm(d_model, eps)
        self.mixer = mixer
        self.mlp_norm = RMSNorm(d_model, eps) if mlp is not None else None
        self.mlp = mlp
        self.stateful_mlp = isinstance(mlp, ContinuumMemory)
        self.hook_resid_pre = HookPoint()
        self.hook_mixer_out = HookPoint()
        self.hook_resid_mid = HookPoint()
        if mlp is not None:  # a block without an MLP (Mamba's) has no point that would never fire
            self.hook_mlp_out = HookPoint()
        self.hook_resid_post = HookPoint()

    def forward(self, x, state: BlockState | None = None, mode=None, cu_seqlens=None):
        if cu_seqlens is not None:
            return self._forward_packed(x, cu_seqlens, mode)
        x = self.hook_resid_pre(x)
        y, mixer_state = self.mixer(self.mixer_norm(x), state.mixer if state is not None else None, mode=mode)
        x = self.hook_resid_mid(x + self._branch(self.hook_mixer_out(y)))
        mlp_state = None
        if self.mlp is not None:
            if self.stateful_mlp:
                y, mlp_state = self.mlp(self.mlp_norm(x), state.mlp if state is not None else None)
            else:
                y = self.mlp(self.mlp_norm(x))
            x = x + self._branch(self.hook_mlp_out(y))
        return self.hook_resid_post(x), BlockState(mixer=mixer_state, mlp=mlp_state)

    def _branch(self, y):
        """A residual branch's output as added to the stream: ``residual_multiplier · y`` (``y``
        itself at the default 1)."""
        m = self.residual_multiplier
        return y if m == 1.0 else y * m

    def _forward_packed(self, x, cu_seqlens, mode):
        """Packed documents (``x [1, N, d]``): the mixer (and a stateful MLP) see each document
        alone; the norms and a plain MLP act per token. Returns ``(x, None)``."""
        x = self.hook_resid_pre(x)
        y = self.mixer.forward_packed(self.mixer_norm(x), cu_seqlens, mode=mode)
        x = self.hook_resid_mid(x + self._branch(self.hook_mixer_out(y)))
        if self.mlp is not None:
            h = self.mlp_norm(x)
            if self.stateful_mlp:  # right-padded into one batch, as Mixer.forward_packed
                idx, valid, _ = varlen_index(cu_seqlens, h.device)
                y = unpad_packed(self.mlp(pad_packed(h, idx, valid), None)[0], valid)
            else:
                y = self.mlp(h)
            x = x + self._branch(self.hook_mlp_out(y))
        return self.hook_resid_post(x), None


def _recompute_kwargs(block: nn.Module) -> dict:
    """``torch.utils.checkpoint`` keyword arguments for one block: its recomputation in the
    backward pass runs the hooks attached at the forward (:func:`~mnemo.layers.hooks.
    checkpoint_hooks`) under the forward's backend choice (:func:`mnemo.ops.dispatch.
    recompute_as_chosen`: the ``use_backend`` block and ``suppressed`` C kernels of the forward's
    thread), whichever thread runs the backward. ``{}`` while ``torch.compile`` traces."""
    if torch.compiler.is_compiling():
        return {}
    hooks = checkpoint_hooks(block).get("context_fn")
    again = recompute_as_chosen()

    def context_fn():
        fwd, rec = hooks() if hooks is not None else (contextlib.nullcontext(), contextlib.nullcontext())

        @contextlib.contextmanager
        def recompute():
            with again(), rec:
                yield

        return fwd, recompute()

    return {"context_fn": context_fn}


#: files that mark a training run's folder or one of its checkpoints (mnemo.train.run_folder,
#: mnemo.train.checkpoint); save_pretrained refuses to write among them
_RUN_FILES = ("metrics.jsonl", "latest", ".lock", "trainer_state.pt", "manifest.json")


class LanguageModel(nn.Module):
    """Decoder LM built from a :class:`ModelConfig`.

    ``forward(input_ids [B, T] long, state=None) -> (logits [B, T, vocab], state)``. Logits are
    float32 for bf16/fp16 models and in the model's dtype otherwise. ``state`` is the list of
    per-layer :class:`~mnemo.layers.state.BlockState` (the cache: each block's mixer state and,
    for a CMS, its MLP state); passing it back continues the sequence exactly (streaming /
    decoding). The functions of :mod:`mnemo.layers.state` (``detach``, ``to``, ``select_rows``,
    ``cat_rows``, ``nbytes``) work on it whole.

    **Hook points.** Every intermediate passes through a named :class:`~mnemo.layers.hooks.HookPoint`:
    ``hook_embed`` (token embedding times ``embedding_multiplier``, plus the position embedding
    ``[B, T, d]``), each block's ``hook_resid_pre``,
    ``hook_mixer_out``, ``hook_resid_mid``, ``hook_mlp_out`` (blocks with an MLP), ``hook_resid_post``,
    and each mixer's own (``blocks.{i}.mixer.hook_q`` …; see the mixer's docstring for its names and
    shapes), and a mixture-of-experts MLP's router decisions (``blocks.{i}.mlp.hook_router_logits`` …,
    :class:`~mnemo.layers.MoE`; its auxiliary losses: :meth:`aux_loss`).
    :meth:`run_with_cache` records them, :meth:`run_with_hooks` reads or replaces them;
    :attr:`hook_points` lists them.

    ``activation_checkpointing`` (attribute, default ``False``; the trainer sets it from
    ``TrainConfig.activation_checkpointing``): when true, a training forward (``model.train()``,
    gradients enabled, no ``state`` passed in) keeps only each block's input and recomputes the
    block's activations in the backward pass (``torch.utils.checkpoint``, non-reentrant) — less
    activation memory for about one more forward pass; outputs and gradients are unchanged.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config.validate()
        c = config
        self.embed = nn.Embedding(c.vocab_size, c.d_model)
        self.pos_embed = nn.Embedding(c.max_position, c.d_model) if c.pos_embedding == "learned" else None
        blocks = []
        dense = set(c.mlp_only_layers or ())  # (mlp="moe": these layers' MLP is a SwiGLU)
        for i, name in enumerate(c.layer_mixers()):
            opts = c.mixer_options.get(name, {})
            try:
                mixer = MIXERS[name](c.d_model, **opts)
            except (TypeError, ValueError, ZeroDivisionError) as e:
                if not opts:  # no option of the user's: a bug, shown as it is
                    raise
                raise ValueError(f"ModelConfig.mixer_options[{name!r}] = {opts}: {e}") from e
            if c.mlp == "swiglu" or (c.mlp == "moe" and i in dense):
                mlp = SwiGLU(c.d_model, c.mlp_hidden)
            elif c.mlp == "cms":
                mlp = ContinuumMemory(c.d_model, **c.mlp_options)
            elif c.mlp == "moe":
                opts = dict(c.mlp_options)
                if opts.get("expert_hidden") is None:
                    opts["expert_hidden"] = c.mlp_hidden
                mlp = MoE(c.d_model, **opts)
            else:
                mlp = None
            blocks.append(Block(mixer, c.d_model, mlp, c.norm_eps, c.residual_multiplier))
        self.blocks = nn.ModuleList(blocks)
        self.task_segment = task_signal.segment_length(self)
        self.activation_checkpointing = False
        self.norm = RMSNorm(c.d_model, c.norm_eps)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        self.hook_embed = HookPoint()
        self.reset_parameters()
        if c.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.hook_points: dict[str, HookPoint] = name_hook_points(self)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embedding as the blocks read it: ``embed(input_ids) · embedding_multiplier``
        (``[B, T, d]``; no multiplication at the default 1; Granite's ``embedding_multiplier``,
        :class:`ModelConfig`). A learned position embedding is added by the caller, after it. The packed
        forward and context parallelism call it; the main forward writes the same two lines out."""
        x = self.embed(input_ids)
        m = self.config.embedding_multiplier
        return x if m == 1.0 else x * m

    def unembed(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of final-normed hidden states ``h [..., d]``: ``lm_head(h) / logits_scaling``
        (``[..., vocab]``, in ``h``'s dtype; no division at the default 1; Granite's
        ``logits_scaling``, :class:`ModelConfig`). The packed forward, context parallelism and the
        main forward's ``logits_at`` rows call it (its full-sequence head writes the same lines out);
        the chunked training loss takes the same ``logits_scaling``
        (:func:`~mnemo.models.fused_loss.chunked_cross_entropy`)."""
        logits = self.lm_head(h)
        s = self.config.logits_scaling
        return logits if s == 1.0 else logits / s

    def run_with_hooks(self, input_ids: torch.Tensor, hooks, state=None, *, mode: str | None = None):
        """``forward`` with ``hooks`` attached for this call only: ``[(name, fn), ...]`` where
        ``fn(value, name)`` returns ``None`` (read only) or a replacement value of the same kind
        (an intervention). ``name`` is a full hook name (``blocks.1.mixer.hook_k``) or a suffix
        that attaches to every layer's (``hook_k``). Returns ``(logits, state)``.

        A replacement must have the value's shape, dtype and device (a state record: its type and
        shapes leaf by leaf; :meth:`~mnemo.layers.hooks.HookPoint.add`). Where a call is read in
        pieces (a task-signal model's segments, a mixer's own segments) a hook fires once per piece
        and :func:`~mnemo.layers.hooks.span` tells it where the piece sits in the call. With
        :attr:`activation_checkpointing` on (training), the hooks run again in the backward's
        recomputation, so the gradients are those of the hooked forward.

        Raises ``KeyError`` naming the unknown hook (and listing the known suffixes), ``ValueError``
        for ``hooks`` that are not a list of ``(name, fn)`` pairs or a replacement of the wrong
        shape, dtype or device (naming the hook)."""
        with attached(self.hook_points, hooks):
            return self(input_ids, state, mode=mode)

    def run_with_cache(
        self,
        input_ids: torch.Tensor,
        names=None,
        state=None,
        *,
        mode: str | None = None,
        detach: bool = True,
    ) -> tuple[torch.Tensor, dict]:
        """``forward`` that also records intermediates: returns ``(logits, cache)`` with
        ``cache[name]`` the value that passed hook ``name`` (detached unless ``detach=False``;
        default ``detach=True``).

        ``names``: ``None`` (every hook point), a name or suffix (``"hook_q"``), a list of them, or a
        predicate ``f(name) -> bool``. Costly values (``hook_pattern``) are built only when
        requested.

        A call read in pieces — a model whose CMS levels learn from the next-token loss reads it
        segment by segment (:mod:`mnemo.models.task_signal`), Titans MAC and the self-modifying
        projections read their input in segments of their own — fires a hook once per piece, each
        placed in the call (:func:`~mnemo.layers.hooks.span`); the cache holds each hook's values
        joined over the pieces (:func:`~mnemo.layers.hooks.join_pieces`: concatenated along time, a
        ``hook_state`` the state after the call), the same keys and shapes as one pass over the
        call. A segment run again to take its signal (streaming, when its reads began in an
        earlier call) lies before the call and is not recorded. A hook that fires more than once
        for the same tokens keeps its last value; one whose pieces do not tile the call keeps its
        last piece, with a ``UserWarning`` naming it.
        """
        firings: dict = {}  # name -> [(offset, value)] in firing order

        def keep(value, name):
            if reading_again():  # a segment run again for its signal: not what the call read
                return
            firings.setdefault(name, []).append((span()[0], detach_state(value) if detach else value))

        chosen = select(self.hook_points, names)
        with attached(self.hook_points, [(n, keep) for n in chosen]):
            logits, _ = self(input_ids, state, mode=mode)
        T = input_ids.shape[1]
        cache = {}
        for name, fired in firings.items():
            by_offset = dict(fired)  # the last firing for the same tokens
            if len(by_offset) == 1:
                cache[name] = fired[-1][1]
                continue
            point = self.hook_points[name]
            offsets = sorted(by_offset)
            values = [by_offset[o] for o in offsets]
            td = point.time_dim
            tiles = td is not None and all(isinstance(v, torch.Tensor) and v.ndim > td for v in values)
            lengths = [v.shape[td] for v in values] if tiles else []
            if tiles:
                ends = [o + n for o, n in zip(offsets, lengths)]
                tiles = ends[-1] == T and all(e == o for e, o in zip(ends, offsets[1:]))
            if name.rsplit(".", 1)[-1] == "hook_state" or not tiles:
                if not (name.rsplit(".", 1)[-1] == "hook_state" or td is None):
                    warnings.warn(
                        f"run_with_cache: {name} fired {len(values)} times at call positions {offsets}, "
                        f"pieces that do not tile the call's {T} tokens; the cache keeps the last one",
                        stacklevel=2,
                    )
                cache[name] = fired[-1][1]
                continue
            cache[name] = join_pieces(point, values, lengths)
        return logits, cache

    def reset_parameters(self) -> None:
        """Normal(0, init_std) weights, zero biases, residual outputs scaled by ``1/sqrt(2 L)``.

        Mixers and MLPs may define ``_init_special()`` for parameters with their own init (gates, A_log…);
        so may a module nested in a mixer or MLP without one (the memory inside Titans MAC / MAG /
        MAL): each is called once, the outermost first (a module that has one inits its own parts).
        """
        std = self.config.init_std
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=std)
        out_std = std / math.sqrt(2 * self.config.n_layers)
        for block in self.blocks:
            for proj in (getattr(block.mixer, "o_proj", None), getattr(block.mlp, "w_out", None)):
                if isinstance(proj, nn.Linear):
                    nn.init.normal_(proj.weight, std=out_std)
            for part in _special_init_parts(block):
                part._init_special()
            if isinstance(block.mlp, MoE):  # stacked expert weights: inputs std, outputs out_std
                block.mlp.init_weights(std, out_std)

    def forward(
        self,
        input_ids: torch.Tensor,
        state: list[BlockState] | None = None,
        *,
        mode: str | None = None,
        cu_seqlens: torch.Tensor | None = None,
        logits_at: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        ignore_index: int = -100,
    ):
        """``(logits [B, T, vocab], state)``.

        ``targets`` (``[B, T]`` integer, ``ignore_index`` where unsupervised; default
        ``ignore_index=-100``):
        return ``(loss, state)`` instead, ``loss`` the **summed** next-token cross-entropy (0-d
        float32; float64 for a float64 model) of the head at every position against ``targets``, equal to
        ``F.cross_entropy(forward(input_ids)[0].float().flatten(0, 1), targets.flatten(),
        ignore_index=ignore_index, reduction="sum")`` (to float rounding, gradients too) but
        computed without the ``[B, T, vocab]`` logits (:func:`mnemo.models.fused_loss.
        chunked_cross_entropy`) — the training loss. Hooks and cached values are the same (there is
        no hook on the logits). A model whose CMS levels learn from the next-token loss computes
        its logits anyway (the signal needs them) and takes the plain loss of them. Not with
        ``logits_at`` nor ``cu_seqlens``. A target outside ``[0, vocab)`` that is not
        ``ignore_index`` raises ``ValueError`` naming ``targets`` (read on the CPU; asserted on
        the device elsewhere); ``ignore_index`` must be an int.

        ``logits_at`` (``[B, T]`` bool): apply the output head only where it is true and return
        ``logits [M, vocab]`` (``M`` = its number of true entries), equal to
        ``forward(input_ids)[0][logits_at]`` — training on sparse targets (a synthetic task's
        supervised positions) then skips the ``[B, T, vocab]`` head. Not with ``cu_seqlens`` nor
        for models whose CMS levels learn from the next-token loss. A mask on the CPU for a model on
        another device is resolved on the host (its positions are copied in, the selection is an
        ``index_select``): a mask on the device costs a host synchronisation (``M`` is read).

        ``cu_seqlens`` (document packing): ``input_ids [1, N]`` holds several documents back to
        back, ``cu_seqlens [D + 1]`` (long) their boundaries ``0 = c_0 < … < c_D = N``. Every
        mixer then starts each document from an empty state (its own packed op where it has one,
        else one call on the documents right-padded into a batch) and learned positions restart
        at 0, so the logits equal running each document alone; the returned state is ``None``
        (there is no single stream to continue). Not with ``state``, nor for models whose CMS
        levels learn from the task loss. Raises ``ValueError`` naming the argument and what was expected.
        """
        if input_ids.ndim != 2 or input_ids.dtype not in (torch.long, torch.int32):
            raise ValueError(
                f"input_ids must be an integer tensor [B, T], got {input_ids.dtype} {list(input_ids.shape)}"
            )
        self._check_ids(input_ids)
        if state is not None and (isinstance(state, BlockState) or not hasattr(state, "__len__")):
            raise ValueError(
                f"state must be the list of per-layer BlockState that forward returned "
                f"({len(self.blocks)} entries), got {type(state).__name__}"
            )
        if state is not None and len(state) != len(self.blocks):
            raise ValueError(f"state must hold one entry per layer ({len(self.blocks)}), got {len(state)}")
        if state is not None:
            bad = next(((i, s) for i, s in enumerate(state) if not isinstance(s, BlockState)), None)
            if bad is not None:  # (an AttributeError deep inside a block otherwise, or a silent restart)
                raise ValueError(
                    f"state[{bad[0]}]: expected the BlockState that forward returned for that layer, got "
                    f"{type(bad[1]).__name__} (pass state=None to start from empty states)"
                )
        if logits_at is not None:
            if logits_at.dtype != torch.bool or logits_at.shape != input_ids.shape:
                raise ValueError(
                    f"logits_at must be a bool tensor shaped like input_ids {list(input_ids.shape)}, got "
                    f"{logits_at.dtype} {list(logits_at.shape)}"
                )
            if cu_seqlens is not None or self.task_segment is not None:
                raise ValueError(
                    "logits_at: not with cu_seqlens, nor for a model whose CMS levels learn from the "
                    "next-token loss (they need every position's logits)"
                )
        if targets is not None:
            if not isinstance(targets, torch.Tensor):
                raise TypeError(f"targets must be a torch.Tensor of class ids, got {type(targets).__name__}")
            if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
                raise TypeError(
                    f"ignore_index must be an int (the target value left out of the loss), got "
                    f"{type(ignore_index).__name__} {ignore_index!r}"
                )
            if targets.shape != input_ids.shape or targets.dtype not in (torch.long, torch.int32):
                raise ValueError(
                    f"targets must be an integer tensor shaped like input_ids {list(input_ids.shape)}, got "
                    f"{targets.dtype} {list(targets.shape)}"
                )
            if logits_at is not None or cu_seqlens is not None:
                raise ValueError(
                    "targets: not with logits_at nor cu_seqlens (the loss covers every position)"
                )
            self._check_targets(targets, ignore_index)
        if cu_seqlens is not None:
            return self._forward_packed(input_ids, state, mode, cu_seqlens)
        if self.task_segment is not None:  # CMS levels learning from the next-token loss
            logits, state = task_signal.forward(self, input_ids, state, mode)
            if targets is None:
                return logits, state
            # (float32 for a bf16/fp16 model's float32 logits, float64 kept for a float64 model)
            loss = F.cross_entropy(
                logits.to(torch.promote_types(logits.dtype, torch.float32)).flatten(0, 1),
                targets.flatten().long(),
                ignore_index=ignore_index,
                reduction="sum",
            )
            return loss, state
        return self._forward(
            input_ids, state, mode, logits_at=logits_at, targets=targets, ignore_index=ignore_index
        )

    def _check_ids(self, input_ids: torch.Tensor) -> None:
        """The vocabulary range of ``input_ids``. On CPU the values are read and a ``ValueError``
        names the range found. On another device reading them would be a host synchronisation per
        forward (and on ``meta`` it raises), so the check runs there without a read
        (``torch._assert_async``: on CUDA an out-of-range id fails the stream with a device-side
        assert, as the embedding itself would; a no-op on ``meta``). Skipped while
        ``torch.compile`` traces (a graph break at every call otherwise); the embedding still
        rejects an out-of-range id."""
        if not input_ids.numel() or torch.compiler.is_compiling():
            return
        V = self.config.vocab_size
        if avoid_host_reads(input_ids):
            assert_on_device(
                ((input_ids >= 0) & (input_ids < V)).all(), f"input_ids must lie in [0, vocab_size = {V})"
            )
        elif int(input_ids.min()) < 0 or int(input_ids.max()) >= V:
            raise ValueError(
                f"input_ids must lie in [0, vocab_size = {V}), got values in "
                f"[{int(input_ids.min())}, {int(input_ids.max())}]"
            )

    def _check_targets(self, targets: torch.Tensor, ignore_index: int) -> None:
        """``targets`` are class ids in ``[0, vocab_size)`` or ``ignore_index``: read and named on
        the CPU (one read), asserted on the device elsewhere, skipped while ``torch.compile``
        traces (as :meth:`_check_ids`)."""
        if not targets.numel() or torch.compiler.is_compiling():
            return
        V = self.config.vocab_size
        bad = (targets != ignore_index) & ((targets < 0) | (targets >= V))
        if avoid_host_reads(targets):
            assert_on_device(~bad.any(), f"targets must lie in [0, vocab_size = {V}) or be ignore_index")
        elif bool(bad.any()):
            values = targets[bad]
            raise ValueError(
                f"targets must be class ids in [0, vocab_size = {V}) or ignore_index ({ignore_index}); "
                f"{values.numel()} of {targets.numel()} are not (e.g. {int(values[0])})"
            )

    def _forward_packed(self, input_ids, state, mode, cu_seqlens):
        if state is not None:
            raise ValueError("cu_seqlens: packed documents start from empty states; got a state as well")
        if self.task_segment is not None:
            raise ValueError(
                "cu_seqlens: packing is not supported for models whose CMS levels learn from the task loss"
            )
        cu = check_cu_seqlens(cu_seqlens, input_ids)
        x = self.embed_tokens(input_ids)
        if self.pos_embed is not None:
            lengths = cu[1:] - cu[:-1]
            if int(lengths.max()) > self.config.max_position:
                raise ValueError(
                    f"learned positions cover max_position = {self.config.max_position} tokens, but a "
                    f"packed document has {int(lengths.max())}"
                )
            starts = torch.repeat_interleave(cu[:-1], lengths)
            pos = torch.arange(input_ids.shape[1], device=cu.device) - starts
            x = x + self.pos_embed(pos.to(x.device))
        x = self.hook_embed(x)
        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for block in self.blocks:
            if recompute:
                x, _ = checkpoint(
                    block, x, None, mode=mode, cu_seqlens=cu, use_reentrant=False, **_recompute_kwargs(block)
                )
            else:
                x, _ = block(x, None, mode=mode, cu_seqlens=cu)
        logits = self.unembed(self.norm(x))
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        return logits, None

    def _forward(
        self,
        input_ids: torch.Tensor,
        state,
        mode,
        allow_checkpoint: bool = True,
        logits_at=None,
        targets=None,
        ignore_index: int = -100,
    ):
        """Embedding → blocks → head on validated ``input_ids`` (one pass, no task signal); the
        head only at ``logits_at`` (``[B, T]`` bool) when given; with ``targets`` the summed
        cross-entropy in place of the logits (chunked, :func:`~mnemo.models.fused_loss.
        chunked_cross_entropy`)."""
        # ``embed_tokens`` / ``unembed`` written out in this path: under ``generate(compile=True)`` of a
        # model with eager regions (hope) each call of theirs here cost its own graph (14 instead of 12)
        x = self.embed(input_ids)
        if self.config.embedding_multiplier != 1.0:
            x = x * self.config.embedding_multiplier
        if self.pos_embed is not None:
            offset = state[0].offset if state is not None else 0
            T = input_ids.shape[1]
            if offset + T > self.config.max_position:
                raise ValueError(
                    f"learned positions cover max_position = {self.config.max_position} tokens, "
                    f"but the sequence reaches {offset + T}"
                )
            x = x + self.pos_embed(torch.arange(offset, offset + T, device=x.device))
        x = self.hook_embed(x)
        new_state = []
        recompute = (
            allow_checkpoint
            and self.activation_checkpointing
            and self.training
            and state is None
            and torch.is_grad_enabled()
        )
        for i, block in enumerate(self.blocks):
            if recompute:
                x, s = checkpoint(block, x, None, mode=mode, use_reentrant=False, **_recompute_kwargs(block))
            else:
                x, s = block(x, state[i] if state is not None else None, mode=mode)
            new_state.append(s)
        h = self.norm(x)
        if targets is not None:
            loss = chunked_cross_entropy(
                h,
                self.lm_head.weight,
                targets,
                ignore_index=ignore_index,
                logits_scaling=self.config.logits_scaling,
            )
            return loss, new_state
        if logits_at is None:
            logits = self.lm_head(h)
            if self.config.logits_scaling != 1.0:
                logits = logits / self.config.logits_scaling
        elif logits_at.device.type == "cpu" and h.device.type != "cpu":
            # a host mask for a device model: its positions found on the host (no device sync)
            rows = logits_at.reshape(-1).nonzero().squeeze(1).to(h.device)
            logits = self.unembed(h.reshape(-1, h.shape[-1]).index_select(0, rows))
        else:
            logits = self.unembed(h[logits_at.to(h.device)])
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        return logits, new_state

    def loss(self, input_ids: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """Mean next-token cross-entropy (nats per token) of ``targets [B, T]`` (without the MoE
        auxiliary losses: add :meth:`aux_loss` for the training objective). Targets equal to
        ``ignore_index`` are left out (default ``ignore_index=-100``). Computed without the
        ``[B, T, vocab]`` logits (``forward(targets=)``)."""
        total, _ = self(input_ids, targets=targets, ignore_index=ignore_index)
        return total / (targets != ignore_index).sum()

    def moe_layers(self) -> list[tuple[int, MoE]]:
        """``[(block index, MoE)]`` for the blocks whose MLP is a :class:`~mnemo.layers.MoE`."""
        return [(i, b.mlp) for i, b in enumerate(self.blocks) if isinstance(b.mlp, MoE)]

    def aux_loss(self) -> torch.Tensor | None:
        """The auxiliary training loss of the last forward pass: the sum over MoE layers of
        ``aux_loss_coef · L_aux + z_loss_coef · L_z + seq_aux_loss_coef · L_seq``
        (:meth:`mnemo.layers.MoE.loss`; 0-d, with its graph), or ``None`` for a model without MoE
        layers."""
        layers = self.moe_layers()
        if not layers:
            return None
        return sum(m.loss() for _, m in layers)

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
        attention_mask: torch.Tensor | None = None,
        compile: bool = False,
        on_token=None,
        eos_token_id: int | Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Sample ``max_new_tokens`` continuation tokens; returns ``[B, T + max_new_tokens]``
        (fewer new tokens when ``eos_token_id`` stops every row earlier).

        The prompt is processed in one pass (prefill), then one token at a time with the per-layer
        state, so recurrent models decode in constant memory. ``temperature = 0`` is greedy
        (default ``temperature=1.0``); ``top_k``: sample among the ``top_k`` likeliest tokens (those
        tied with the ``k``-th too; default ``None``: every token); ``top_p``: nucleus sampling
        (Holtzman et al. 2020), among the fewest likeliest tokens whose probability sums to at
        least ``top_p``, renormalised (default ``None``: every token); applied in the order
        temperature, ``top_k``, ``top_p`` (as ``transformers`` does). A ``temperature`` that is not
        a finite number ``>= 0``, a ``top_k`` that is not an int ``>= 1``, a ``top_p`` outside
        ``(0, 1]``, and (learned positions) a prompt plus ``max_new_tokens`` past ``max_position``
        raise ``ValueError`` before any work.

        ``attention_mask [B, T]`` (1 = token, 0 = padding) batches prompts of different lengths,
        **left-padded** (each row ``0 … 0 1 … 1``; ``ValueError`` naming the row otherwise). Pad
        tokens never enter any state: rows of equal length are prefilled together without their
        pads, and the new tokens are appended after the padded prompt. Decoding then runs as one
        batch when every mixer is :attr:`~mnemo.layers.base.Mixer.offset_free` (and no MLP keeps
        a state) — the joined state's ``offset`` then counts the longest prompt — and otherwise
        per group of equal length (rotary positions, windows and periods are per stream). Each row
        equals generating its prompt alone (exactly for greedy decoding; sampling draws from one
        ``generator`` in another order).

        ``compile=True`` runs the prefill and the one-token decode step under ``torch.compile``
        (left-padded prompts, ``attention_mask``, are prefilled eagerly): on CPU it fuses the step's
        few hundred small kernels into a handful; the decode steps of a 6-layer Mamba-2 at d_model
        256 ran 2x faster than eager on 2 cores (``docs/benchmarks/models_cpu_2core.txt``), its
        128-token prefill 1.3-1.4x (batch 8) and 1.8-2.2x (batch 1); smaller models gain more
        (per-op overhead dominates them): at d_model 128 and 4 layers, batch 1, decoding ran
        3.0x (transformer) to 7.2x (Mamba-2) faster
        (``docs/benchmarks/generate_compiled_cpu_2core.txt``). Batches of 2-8 rows of a model whose
        weights exceed the last-level cache multiply by their weights in a C kernel
        (:mod:`mnemo.ops.small_mm`): at d_model 512 and batch 8 the compiled step ran 1.4-1.8x faster
        than with inductor's own loops, 2.6x faster than eager decoding through ``mnemo bench``
        (Mamba-2, gated DeltaNet; ``docs/benchmarks/notes.md``). The first call compiles (tens of
        seconds); later calls with the same model, batch size, prompt length and dtype reuse the
        graphs. A second prompt length compiles once more, with the length symbolic from then on,
        except where a chunked form unrolls its loop over chunks (Mamba-2's SSD: one more graph per
        number of chunks); past
        dynamo's ``recompile_limit`` (8 graphs per model and function) new shapes run eagerly. The
        tokens equal eager decoding up to float rounding (greedy argmax ties aside). Memories that
        take a gradient inside the forward (HOPE's CMS levels with the next-token objective when a
        segment completes, the self-modifying Titans' one-token DGD step) run those pieces eagerly
        between the compiled graphs. Where compiling fails (no C compiler, an unsupported op) a
        ``RuntimeWarning`` says why and the generation continues eagerly. Default ``compile=False``.

        ``on_token``: called with each new token ``[B]`` (int64) as soon as it is sampled, so a
        caller can show or keep what was made before an interruption (without ``attention_mask``
        only: ``ValueError`` with it). Default ``None``.

        ``eos_token_id``: an end-of-text id, or several. A row that samples one has finished: its
        later tokens are that row's first sampled end id again (``transformers`` pads with
        ``pad_token_id`` instead), and generation stops as soon as every row has finished, so the
        result may have fewer than ``max_new_tokens`` new tokens. Checking costs a host
        synchronisation per token (on a GPU). Not with ``attention_mask`` (``ValueError``). Default
        ``None``: every row runs ``max_new_tokens`` steps. Raises ``ValueError`` for an id outside
        ``[0, vocab_size)``.
        """
        step = _DecodeStep(self, compile)
        eos = _eos_ids(eos_token_id, self.config.vocab_size)
        if on_token is not None and not callable(on_token):
            raise ValueError(f"on_token: expected a function of the new tokens [B] or None, got {on_token!r}")
        if attention_mask is not None:
            if on_token is not None:
                raise ValueError(
                    "on_token: not supported with attention_mask (groups decode one after another)"
                )
            if eos is not None:
                raise ValueError(
                    "eos_token_id: not supported with attention_mask (groups decode one after another); "
                    "generate each prompt length alone, or cut the rows at their first end id"
                )
            return self._generate_padded(
                input_ids, attention_mask, max_new_tokens, temperature, top_k, generator, step, top_p
            )
        self._check_generate(input_ids, max_new_tokens, temperature, top_k, top_p)
        self._check_positions(input_ids.shape[1], max_new_tokens)
        was_training = self.training
        self.eval()
        try:  # (the training mode comes back also when a step fails or the caller interrupts)
            logits, state = step.prefill(input_ids)
            out = [input_ids]
            ended = None  # per row: the end id it sampled first (-1: not yet); with eos_token_id only
            for i in range(max_new_tokens):
                nxt = sample_next(logits[:, -1], temperature, top_k, generator, top_p)
                if eos is not None:
                    if ended is None:
                        ended, eos = torch.full_like(nxt, -1), eos.to(nxt.device)
                    nxt = torch.where(ended >= 0, ended, nxt)
                    ended = torch.where((ended < 0) & torch.isin(nxt, eos), nxt, ended)
                out.append(nxt[:, None])
                if on_token is not None:
                    on_token(nxt)
                if eos is not None and bool((ended >= 0).all()):
                    break
                if i + 1 < max_new_tokens:  # the last token's logits are never read
                    logits, state = step(nxt[:, None], state)
        finally:
            self.train(was_training)
        return torch.cat(out, dim=1)

    def _check_generate(self, input_ids, max_new_tokens, temperature, top_k, top_p=None) -> None:
        """:meth:`generate`'s arguments (``ValueError`` naming the argument, expected vs received)."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2 or input_ids.shape[1] < 1:
            got = list(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise ValueError(f"input_ids must be [B, T] with T >= 1, got {got}")
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
            raise ValueError(
                f"max_new_tokens: expected an int >= 0, got {max_new_tokens!r} "
                f"({type(max_new_tokens).__name__})"
            )
        try:
            ok = not isinstance(temperature, bool) and math.isfinite(temperature) and temperature >= 0
        except (TypeError, ValueError, RuntimeError):  # not a number (a tensor of several values)
            ok = False
        if not ok:
            raise ValueError(f"temperature: expected a finite number >= 0 (0: greedy), got {temperature!r}")
        if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
            raise ValueError(f"top_k: expected an int >= 1 or None, got {top_k!r} ({type(top_k).__name__})")
        if top_p is not None and (
            isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1
        ):
            raise ValueError(f"top_p: expected a number in (0, 1] or None, got {top_p!r}")

    def _check_positions(self, longest: int, max_new_tokens: int) -> None:
        """Refuse, before any work, a generation whose tokens would run past the learned positions
        (the last new token is returned, not read)."""
        P = self.config.max_position
        need = longest + max_new_tokens - 1
        if self.pos_embed is not None and longest > P:
            raise ValueError(
                f"input_ids: a prompt of {longest} tokens is longer than the learned positions, which "
                f"cover max_position = {P} tokens: shorten the prompt to at most {P} tokens"
            )
        if self.pos_embed is not None and need > P:
            raise ValueError(
                f"max_new_tokens: a prompt of {longest} tokens and {max_new_tokens} new ones read {need} "
                f"positions, but the learned positions cover max_position = {P}: at most "
                f"{P - longest + 1} new tokens fit"
            )

    @property
    def offset_free(self) -> bool:
        """Whether streams of different lengths can share one batch of states: every mixer is
        :attr:`~mnemo.layers.base.Mixer.offset_free`, no MLP keeps a state and there are no learned
        positions."""
        if self.pos_embed is not None:  # learned positions are per stream
            return False
        return all(getattr(b.mixer, "offset_free", False) and not b.stateful_mlp for b in self.blocks)

    def _padded_groups(self, input_ids, attention_mask) -> dict[int, list[int]]:
        """Rows of a left-padded batch grouped by prompt length (validated)."""
        if not isinstance(attention_mask, torch.Tensor):
            raise ValueError(
                f"attention_mask: expected a tensor [B, T] of 0 and 1, got {type(attention_mask).__name__}"
            )
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask must have the shape of input_ids {list(input_ids.shape)}, "
                f"got {list(attention_mask.shape)}"
            )
        if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
            found = attention_mask[(attention_mask != 0) & (attention_mask != 1)]
            raise ValueError(
                f"attention_mask: expected 1 (token) and 0 (padding) only, got {found[0].item()!r} too"
            )
        mask = attention_mask.to(torch.bool)
        T = input_ids.shape[1]
        groups: dict[int, list[int]] = {}
        for b, L in enumerate(mask.sum(1).tolist()):
            if L < 1 or not bool(mask[b, T - L :].all()):
                raise ValueError(
                    f"attention_mask row {b} must be left padding then at least one token (0 … 0 1 … 1), "
                    f"got {mask[b].int().tolist()}"
                )
            groups.setdefault(L, []).append(b)
        return groups

    def _prefill_groups(self, input_ids, groups):
        T = input_ids.shape[1]
        return [(rows, *self(input_ids[rows, T - L :])) for L, rows in groups.items()]

    def prefill_left_padded(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        """Prefill of left-padded prompts ``input_ids [B, T]`` (``attention_mask``: 0 … 0 1 … 1 per
        row) without the pads: returns ``(logits [B, T, vocab], state)`` with each row's logits
        right-aligned (zeros at its pad positions) and one batch of states, whose ``offset`` counts
        the longest prompt. Needs :attr:`offset_free` (``ValueError`` otherwise: a mixer with
        positions or periods cannot share one state batch across lengths)."""
        from ..layers.state import cat_rows, select_rows

        if not self.offset_free:
            names = sorted(
                {type(b.mixer).__name__ for b in self.blocks if not getattr(b.mixer, "offset_free", False)}
            )
            if self.pos_embed is not None:
                names.append("the learned position embedding")
            if any(b.stateful_mlp for b in self.blocks):
                names.append("a stateful MLP (CMS)")
            raise ValueError(
                f"attention_mask: left-padded prompts of different lengths share one state batch only "
                f"when nothing uses positions; {', '.join(names)} does — give prompts of one length "
                f"per call"
            )
        groups = self._padded_groups(input_ids, attention_mask)
        runs = self._prefill_groups(input_ids, groups)
        B, T = input_ids.shape
        logits = None
        for rows, lg, _ in runs:
            if logits is None:
                logits = lg.new_zeros(B, T, lg.shape[-1])
            logits[rows, T - lg.shape[1] :] = lg
        order = [r for rows, _, _ in runs for r in rows]
        longest = max(groups)
        per_layer = []
        for i in range(len(self.blocks)):
            parts = [state[i] for _, _, state in runs]
            for p in parts:  # bookkeeping only, for offset-free mixers
                p.mixer.offset = longest
            per_layer.append(cat_rows(parts))
        inverse = torch.empty(B, dtype=torch.long)
        inverse[torch.tensor(order)] = torch.arange(B)
        return logits, select_rows(per_layer, inverse)

    @torch.no_grad()
    def _generate_padded(
        self, input_ids, attention_mask, max_new_tokens, temperature, top_k, generator, step, top_p=None
    ):
        self._check_generate(input_ids, max_new_tokens, temperature, top_k, top_p)
        groups = self._padded_groups(input_ids, attention_mask)
        self._check_positions(max(groups), max_new_tokens)
        was_training = self.training
        self.eval()
        try:  # (the training mode comes back also when a step fails or the caller interrupts)
            B = input_ids.shape[0]
            new = input_ids.new_empty(B, max_new_tokens, dtype=torch.long)  # (int32 prompts too)
            if self.offset_free:  # one batch: rows back in their order
                logits, state = self.prefill_left_padded(input_ids, attention_mask)
                runs = [(list(range(B)), logits[:, -1], state)]
            else:  # per group of equal length (positions, windows, periods are per stream)
                runs = [(rows, lg[:, -1], st) for rows, lg, st in self._prefill_groups(input_ids, groups)]
            for rows, last, state in runs:
                for i in range(max_new_tokens):
                    nxt = sample_next(last, temperature, top_k, generator, top_p)
                    new[rows, i] = nxt
                    if i + 1 < max_new_tokens:
                        logits, state = step(nxt[:, None], state)
                        last = logits[:, -1]
        finally:
            self.train(was_training)
        return torch.cat([input_ids, new], dim=1)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())

    def state_size_bytes(self, batch_size: int = 1, seq_len: int = 0, *, pending: bool = True) -> int:
        """Bytes of the decoding state after ``seq_len`` tokens (KV caches grow with it). Defaults:
        ``batch_size=1``, ``seq_len=0``, ``pending=True``. Raises ``ValueError`` naming an argument
        that is not an int >= 0.

        A model whose CMS levels learn from the task signal (``task_segment`` ``S``) also carries
        its pending segment: the state at the segment's start (a snapshot, free at the first
        segment) and the segment's token ids so far (counted as int64). That part is counted in full:
        an upper bound, as the snapshot shares with the current state the tensors the segment has
        not changed (exact for ``seq_len <= S``). ``pending=False`` leaves it out: the state a
        decoding step reads (the snapshot is read once per segment)."""
        for name, v in (("batch_size", batch_size), ("seq_len", seq_len)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"state_size_bytes: {name} expected an int >= 0, got {v!r}")
        total = self._state_bytes(batch_size, seq_len)
        S = self.task_segment
        if S is not None and seq_len > 0 and pending:
            start = (seq_len - 1) // S * S  # where the pending segment began
            total += (self._state_bytes(batch_size, start) if start else 0) + 8 * batch_size * (
                seq_len - start
            )
        return total

    def _state_bytes(self, batch_size: int, seq_len: int) -> int:
        """The per-layer states' bytes after ``seq_len`` tokens (no pending segment)."""
        total = 0
        for b in self.blocks:
            total += b.mixer.state_size_bytes(batch_size, seq_len)
            if b.stateful_mlp:
                total += b.mlp.state_size_bytes(batch_size)
        return total

    def save_pretrained(self, directory: str | Path) -> None:
        """Write ``config.json`` and ``model.safetensors`` into ``directory`` (created if needed).

        Raises ``ValueError`` when ``directory`` is a training run's folder or one of its
        checkpoints (it holds ``metrics.jsonl``, ``latest``, ``.lock``, ``trainer_state.pt`` or
        ``manifest.json``): writing there would replace a checkpoint's verified weights or mix an
        export into the run; ``NotADirectoryError`` when it is a file."""
        d = Path(directory)
        if d.exists() and not d.is_dir():
            raise NotADirectoryError(f"save_pretrained: directory {str(d)!r} is a file, expected a folder")
        owned = [n for n in _RUN_FILES if (d / n).exists()]
        if owned:
            raise ValueError(
                f"save_pretrained: directory {str(d)!r} belongs to a training run (it holds "
                f"{', '.join(owned)}); writing here would replace the run's own files: choose a new folder"
            )
        d.mkdir(parents=True, exist_ok=True)
        self.config.save(d / CONFIG_NAME)
        save_model(self, str(d / WEIGHTS_NAME))

    @classmethod
    def from_pretrained(
        cls, directory: str | Path, map_location: str | torch.device = "cpu", dtype=None
    ) -> LanguageModel:
        """Load a model written by :meth:`save_pretrained` (raises ``FileNotFoundError`` /
        ``ValueError`` naming the missing or corrupt file).

        ``dtype``: ``None`` / ``"auto"`` (default) keeps the dtype the weights are stored in (that
        of most of ``model.safetensors``' floating elements: a float64 or bfloat16 model comes back as
        it was saved; another library's folder, converted in memory, in float32 — a bfloat16 or
        float16 one included, as ``mnemo convert`` stores it —, or float64 when stored in float64); a
        ``torch.dtype`` or its name (``"float32"``, ``"float64"``, ``"bfloat16"``, ``"float16"``)
        casts to it. ``ValueError`` naming ``dtype`` otherwise.

        A folder whose ``config.json`` is another library's is converted in memory once the
        converters are registered (``import mnemo.hf``, which the ``mnemo`` command does;
        :mod:`mnemo.models.formats`): every format :mod:`mnemo.hf.convert` registers —
        ``transformers``' Mamba, Mamba-2, FalconMamba, Bamba, Qwen3-Next, Llama, Qwen2 (Qwen2.5),
        Qwen3, Mistral, Mixtral, Qwen3-MoE, Qwen2-MoE (:mod:`mnemo.hf.llama`), Granite and Granite
        4.0-H (:mod:`mnemo.hf.granite`), DeepSeek-V3 (Kimi K2's ``model_type`` too) and DeepSeek-V2
        (:mod:`mnemo.hf.deepseek`), Jamba (:mod:`mnemo.hf.jamba`), Kimi Linear
        (:mod:`mnemo.hf.kimi_linear`), flash-linear-attention's fla-hub GLA / RetNet / DeltaNet /
        Gated DeltaNet — and the original ``mamba-ssm``
        layout; its weights in ``model.safetensors``, sharded safetensors or
        ``pytorch_model.bin`` (sharded or not). An unsupported architecture or option, or a quantized
        checkpoint (``quantization_config``), raises ``ValueError`` naming it."""
        d = Path(directory)
        if d.is_file():
            raise NotADirectoryError(
                f"from_pretrained: {str(d)!r} is a file; expected a checkpoint folder (config.json and "
                "model.safetensors)"
            )
        cfg_path, w_path = d / CONFIG_NAME, d / WEIGHTS_NAME
        check_device(map_location)
        dtype = _check_dtype(dtype)
        import dataclasses

        try:  # another library's config: a model_type other than mnemo's, or fields mnemo lacks
            raw = json.loads(cfg_path.read_text()) if cfg_path.is_file() else None
        except (OSError, json.JSONDecodeError, UnicodeDecodeError):
            raw = None  # reported below
        if isinstance(raw, dict) and (
            raw.get("model_type") not in (None, "mnemo")
            or set(raw) - {f.name for f in dataclasses.fields(ModelConfig)} - {"model_type"}
        ):
            from .formats import FOREIGN_LOADERS, load_foreign

            found = load_foreign(d)
            if found is not None:
                config, weights = found
                if dtype is None:  # float32, or float64 for a float64 checkpoint
                    stored = next((v.dtype for v in weights.values() if v.is_floating_point()), None)
                    dtype = torch.float64 if stored == torch.float64 else torch.float32
                model = cls(config).to(dtype)
                model.load_state_dict(weights, strict=True)
                return model.to(map_location)
            if not FOREIGN_LOADERS:
                raise ValueError(
                    f"{cfg_path} is another library's config (model_type {raw.get('model_type')!r}): "
                    '`import mnemo.hf` registers the converters (pip install "mnemo[hf]" is not needed '
                    "for them), or convert the folder once with `mnemo convert SRC OUT`"
                )
        for p in (cfg_path, w_path):
            if not p.is_file():
                raise FileNotFoundError(f"checkpoint file missing: {p}")
        try:
            config = ModelConfig.load(cfg_path)
        except (json.JSONDecodeError, TypeError) as e:
            raise ValueError(f"corrupt model config {cfg_path}: {e}") from e
        config = _legacy_retnet_width(config, w_path)
        model = cls(config)
        if dtype is None:
            dtype = _stored_dtype(w_path) or torch.float32
        model = model.to(dtype)  # before loading: the values are copied in, not rounded to float32
        try:
            load_model(model, str(w_path), strict=True, device=str(map_location))
        except Exception as e:  # safetensors raises several error types for damaged files
            raise ValueError(f"corrupt or incompatible weights file {w_path}: {e}") from e
        return model.to(map_location)


_FLOAT_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_SAFETENSORS_FLOATS = {
    "F64": torch.float64,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
}


def _check_dtype(dtype) -> torch.dtype | None:
    """``from_pretrained``'s ``dtype`` as a floating ``torch.dtype`` (``None``: the stored one)."""
    if dtype is None or dtype == "auto":
        return None
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in _FLOAT_DTYPES:
        return _FLOAT_DTYPES[dtype.removeprefix("torch.")]
    if isinstance(dtype, torch.dtype) and dtype in _FLOAT_DTYPES.values():
        return dtype
    raise ValueError(f"dtype: expected None, 'auto' or one of {sorted(_FLOAT_DTYPES)}, got {dtype!r}")


def _legacy_retnet_width(config: ModelConfig, weights: Path) -> ModelConfig:
    """``config`` with ``mixer_options["retnet"]["expand_v"] = 1.0`` when it does not name
    ``expand_v`` and the ``retnet`` weights in ``weights`` have that width: the ``retnet`` preset's
    value width before it became the paper's ``expand_v = 2.0`` (a saved config names only the
    options given, so such a folder would not load). Else ``config`` unchanged."""
    names = config.layer_mixers()
    opts = config.mixer_options.get("retnet", {})
    if "retnet" not in names or not isinstance(opts, dict) or "expand_v" in opts:
        return config
    from safetensors import safe_open

    key = f"blocks.{names.index('retnet')}.mixer.o_proj.weight"
    try:
        with safe_open(str(weights), framework="pt") as f:
            stored = list(f.get_slice(key).get_shape()) if key in f.keys() else None
        old = {**opts, "expand_v": 1.0}
        with torch.device("meta"):
            now, then = (list(MIXERS["retnet"](config.d_model, **o).o_proj.weight.shape) for o in (opts, old))
    except Exception:  # unreadable weights or bad options: reported by what follows
        return config
    if stored != then or then == now:
        return config
    return ModelConfig.from_dict(
        {**config.to_dict(), "mixer_options": {**config.mixer_options, "retnet": old}}
    )


def _stored_dtype(weights: Path) -> torch.dtype | None:
    """The floating dtype holding most of the elements of the safetensors file ``weights`` (a bf16
    model's float32 buffers, such as MoE's ``expert_bias``, do not decide it); ``None``: no such
    file, not readable, or no floating tensor."""
    if not weights.is_file():
        return None
    from safetensors import safe_open

    sizes: dict[torch.dtype, int] = {}
    try:
        with safe_open(str(weights), framework="pt") as f:
            for k in f.keys():
                t = f.get_slice(k)
                dtype = _SAFETENSORS_FLOATS.get(t.get_dtype())
                if dtype is not None:
                    sizes[dtype] = sizes.get(dtype, 0) + math.prod(t.get_shape())
    except Exception:  # a damaged file: reported by the load that follows, naming it
        return None
    return max(sizes, key=sizes.get) if sizes else None


def check_cu_seqlens(cu_seqlens, input_ids: torch.Tensor) -> torch.Tensor:
    """Validate packed-document boundaries for ``input_ids [1, N]``; returns them as a long tensor
    on the ids' device. Raises ``ValueError`` naming what is wrong."""
    if input_ids.shape[0] != 1:
        raise ValueError(f"cu_seqlens: packed input_ids must be one row [1, N], got {list(input_ids.shape)}")
    cu = torch.as_tensor(cu_seqlens, device=input_ids.device)
    N = input_ids.shape[1]
    if cu.ndim != 1 or cu.numel() < 2 or cu.dtype.is_floating_point or cu.dtype == torch.bool:
        raise ValueError(
            f"cu_seqlens: expected a 1-D integer tensor [D + 1], got {cu.dtype} {list(cu.shape)}"
        )
    cu = cu.long()
    if int(cu[0]) != 0 or int(cu[-1]) != N or not bool((cu[1:] > cu[:-1]).all()):
        raise ValueError(
            f"cu_seqlens: expected strictly increasing boundaries from 0 to N = {N}, got {cu.tolist()}"
        )
    return cu


def check_device(device: str | torch.device) -> None:
    """Raise ``ValueError`` naming ``device`` when it cannot be used on this machine (a CUDA device
    without CUDA, or an index past the GPUs present), before anything is loaded onto it."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device: {device!r} is not a device name ({e})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device: {str(device)!r} needs CUDA, which is not available on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(
                f"device: {str(device)!r} does not exist; this machine has {torch.cuda.device_count()} GPU(s)"
            )


def _one_token(model, ids, state):
    return model(ids, state)


def _prefill(model, ids):
    return model(ids)


_compiled_fns: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_compiled_serial = itertools.count()
_COMPILED_KINDS = {"prefill": _prefill, "step": _one_token}


def _decode_options(kernel: bool = True) -> dict | None:
    """``torch.compile`` options of the one-token step: :class:`mnemo.models._matvec.MatvecPass`
    (small CPU matrix products through :func:`mnemo.ops.small_mm.small_mm`'s C kernel or as fused
    multiply-sums; ``kernel=False``: multiply-sums only), or ``None`` where this torch's inductor
    lacks the custom-pass interface it needs (then the step calls BLAS, as before)."""
    try:
        from ._matvec import MatvecPass

        return {"post_grad_custom_pre_pass": MatvecPass(kernel=kernel)}
    except Exception:  # an inductor without the interfaces the pass is built on: BLAS products
        return None


def _compiled(model: nn.Module, kind: str, batch: int | None = None):
    """``model``'s compiled prefill ``(model, ids) -> (logits, state)`` (``kind="prefill"``) or
    one-token step ``(model, ids, state) -> (logits, state)`` (``kind="step"``), made once per model
    and kind (and dropped with the model). Dynamo keeps its graphs per code object, up to
    ``torch._dynamo.config.recompile_limit`` (8) of them: one function shared by every model would
    run out after a few families or batch sizes in one process and silently run eagerly, so each
    model and kind gets a copy of the code object and so a cache of its own (its batch sizes,
    dtypes, prompt and cache lengths). The step computes its small CPU matrix products as fused
    multiply-sums or, for 2-8 rows of large weights, with :func:`mnemo.ops.small_mm.small_mm`'s C
    kernel (:func:`_decode_options`, :class:`mnemo.models._matvec.MatvecPass`); both need the batch
    dimension static: given
    ``batch`` up to ``mnemo.models._matvec.MAX_ROWS``, the step is one function per batch size (a
    function that has seen two batch sizes makes the dimension dynamic and keeps BLAS products);
    larger or unknown batches share one."""
    key = kind
    if kind == "step" and batch is not None:
        try:
            from ._matvec import MAX_ROWS
        except Exception:  # no pass (see _decode_options): one step for every batch size
            MAX_ROWS = 0
        if batch <= MAX_ROWS:
            key = (kind, batch)
    fns = _compiled_fns.get(model)
    if fns is None:
        fns = _compiled_fns[model] = {}
    fn = fns.get(key)
    if fn is None:
        fn = fns[key] = _compile_kind(kind)
    return fn


def _compile_kind(kind: str, matvec: bool = True, kernel: bool = True):
    """A new compiled function of ``kind`` (``"prefill"`` or ``"step"``) with a dynamo cache of its
    own (nothing compiled yet): what :func:`_compiled` keeps per model. ``matvec=False`` compiles
    the step without :func:`_decode_options`' pass (BLAS products; for benchmarks), ``kernel=False``
    with the pass's multiply-sums only (no C kernel; for benchmarks). Its code
    object is a copy with a name of its own (``_one_token_3``): dynamo keeps its graphs per code
    object, and its record of which dimensions changed between calls (automatic dynamic shapes)
    per file, line and name, so a shared name would compile a second model's first batch size as a
    dynamic dimension when another model had seen two batch sizes."""
    src = _COMPILED_KINDS[kind]
    name = f"{src.__name__}_{next(_compiled_serial)}"
    names = {"co_name": name} | ({"co_qualname": name} if sys.version_info >= (3, 11) else {})
    code = src.__code__.replace(**names)
    fresh = types.FunctionType(code, src.__globals__, name)
    if kind == "step" and matvec:
        return torch.compile(fresh, options=_decode_options(kernel))
    return torch.compile(fresh)


#: the stream counters of the decode states (``SelfModifyingTitansState.offset``, a CMS level's
#: ``position``, ``updates``, ``absorbed``), as ``torch.compiler.config.dynamic_sources`` patterns:
#: the compiled step (and the frames its graph breaks leave to dynamo) takes them as symbolic ints
#: from its first trace. Specialised, they change at every token: dynamo traced each frame that
#: reads one once for the first step and again at the second (automatic dynamic shapes; hope,
#: titans_lmm: ``tests/models/test_hope_compiled_recompiles_46.py``).
_COUNTERS = r".*\.(offset|position|updates|absorbed)$"


def _counters_dynamic(cfg=None):
    """:data:`_COUNTERS` added to ``torch.compiler.config.dynamic_sources`` (or ``cfg``'s) for one
    compiled call (a user's own patterns kept); nothing where this torch has no such setting
    (before 2.7: the counters then specialise at the first step and recompile once at the second,
    as before)."""
    cfg = getattr(torch.compiler, "config", None) if cfg is None else cfg
    if cfg is None or not hasattr(cfg, "dynamic_sources"):
        return contextlib.nullcontext()
    mine = cfg.dynamic_sources
    return cfg.patch(dynamic_sources=f"{mine},{_COUNTERS}" if mine else _COUNTERS)


#: per state dataclass, its field names (:func:`_steady_layout`)
_FIELD_NAMES: dict = {}


def _steady_layout(state, known: dict | None = None, found: dict | None = None):
    """``state`` (a model's per-layer states: lists, tuples and state dataclasses of tensors) in the
    layout its later decode steps have, for the compiled step (whose graphs guard on strides and
    on which inputs are the same tensor): every tensor expanded over a dimension (a stride-0 view:
    a fresh stream's initial weights broadcast over the batch) is materialised, and a tensor that
    one state object holds in two fields (a memory's running and chunk-start weights at a chunk
    boundary) is copied in the second. The values are unchanged; a state object that needs no
    change is returned as it is, and one held in several places (the task signal's pending
    segment, shared by the task blocks) gives one result shared in the same places.

    ``known``: the ``found`` of the previous call (state objects already in this layout, by
    ``id``: ``(object, result)``), not walked again (the task signal's snapshot of a segment's
    start state lives for a whole segment); ``found`` collects this call's. Costs a walk of the
    state objects that are new since the previous call and, where something changes, a copy of
    that tensor (the initial weights once per stream, a chunk-start weight once per chunk)."""
    known = {} if known is None else known
    found = {} if found is None else found
    plain = (int, float, bool, str, type(None))

    def leaf(v, seen: set):
        if isinstance(v, torch.Tensor):
            st = v.stride()
            if id(v) in seen or (0 in st and any(s == 0 and n > 1 for s, n in zip(st, v.shape))):
                v = v.clone(memory_format=torch.contiguous_format)
            seen.add(id(v))
            return v
        t = type(v)
        if t is tuple or t is list:
            out = [leaf(u, seen) for u in v]
            return v if all(a is b for a, b in zip(out, v)) else t(out)
        return v if t in plain else node(v)

    def node(x):
        t = type(x)
        if t is list or t is tuple:
            out = [node(u) for u in x]
            return x if all(a is b for a, b in zip(out, x)) else t(out)
        names = _FIELD_NAMES.get(t)
        if names is None:
            if not dataclasses.is_dataclass(t):
                return x
            names = _FIELD_NAMES[t] = tuple(f.name for f in dataclasses.fields(t))
        hit = found.get(id(x)) or known.get(id(x))
        if hit is not None and hit[0] is x:
            found[id(x)], found[id(hit[1])] = hit, (hit[1], hit[1])
            return hit[1]
        seen: set[int] = set()
        changed = {}
        for name in names:
            v = getattr(x, name)
            if type(v) not in plain:
                new = leaf(v, seen)
                if new is not v:
                    changed[name] = new
        res = dataclasses.replace(x, **changed) if changed else x
        found[id(x)] = (x, res)
        found[id(res)] = (res, res)
        return res

    return node(state)


class _DecodeStep:
    """:meth:`LanguageModel.generate`'s prefill ``prefill(ids [B, T]) -> (logits, state)`` and
    one-token step ``(ids [B, 1], state) -> (logits, state)``: the model itself, or with
    ``compile=True`` the model's :func:`_compiled` functions (dynamo's guards recompile for another
    batch size, dtype, prompt or cache length, so any call may compile). A compilation error on any
    call (``torch._dynamo.exc.TorchDynamoException`` and its subclasses, which dynamo and inductor
    raise: no C compiler, an unsupported op) is reported once as a ``RuntimeWarning`` and that call
    and the rest of the generation run eagerly; any other error (a bad input, out of memory)
    propagates unchanged. Compiled, the state each call returns is put in the layout of the later
    steps (:func:`_steady_layout`) and the stream counters are symbolic ints from the first trace
    (:data:`_COUNTERS`), so the second and later steps reuse the first step's graphs."""

    def __init__(self, model: nn.Module, compile: bool):
        if not isinstance(compile, bool):
            raise ValueError(f"compile: expected True or False, got {compile!r}")
        self.model = model
        self.compile = compile
        # the last state's objects in the steady layout (_steady_layout); None: the prompt's state
        # needed no change, and the steps' are not walked
        self._steady: dict | None = {}

    def prefill(self, ids):
        return self._run("prefill", ids)

    def __call__(self, ids, state):
        return self._run("step", ids, state)

    def _run(self, kind, *args):
        if not self.compile:
            return self.model(*args)
        fn = _compiled(self.model, kind, args[0].shape[0])
        try:
            with _counters_dynamic():
                logits, state = fn(self.model, *args)
            if self._steady is not None:
                found: dict = {}
                steady = _steady_layout(state, self._steady, found)
                # a prompt's state already steady (a KV cache, a Mamba state): no walks after it
                self._steady = None if kind == "prefill" and steady is state else found
                state = steady
            return logits, state
        except torch._dynamo.exc.TorchDynamoException as e:  # dynamo compiles a graph before running it
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            warnings.warn(
                f"generate(compile=True): torch.compile failed ({type(e).__name__}: {' '.join(lines[:2])}); "
                "running eagerly",
                RuntimeWarning,
                stacklevel=_caller_level(),
            )
            self.compile = False
            return self.model(*args)


def _caller_level() -> int:
    """``stacklevel`` for a warning raised here that names the first frame outside mnemo and torch
    (the user's call of ``generate``, through ``torch.no_grad``'s wrappers)."""
    import inspect
    import os

    skip = (os.path.dirname(os.path.dirname(__file__)), os.path.dirname(torch.__file__))
    # frame 0 is this function, frame 1 the caller of warnings.warn (stacklevel 1), and so on
    for level, info in enumerate(inspect.stack(0)):
        if level >= 1 and not info.filename.startswith(skip):
            return level
    return 2


def _special_init_parts(block: nn.Module) -> list[nn.Module]:
    """The modules of ``block`` whose ``_init_special`` :meth:`LanguageModel.reset_parameters`
    calls: each outermost module that defines one (its own parts are its business), in order."""
    parts: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        if hasattr(module, "_init_special"):
            parts.append(module)
            return
        for child in module.children():
            visit(child)

    for part in (block.mixer, block.mlp):
        if part is not None:  # (a block without an MLP)
            visit(part)
    return parts


def _eos_ids(eos_token_id, vocab_size: int) -> torch.Tensor | None:
    """``eos_token_id`` (an int, a sequence of ints or ``None``) as a long tensor of ids, checked
    against the vocabulary (``ValueError`` naming ``eos_token_id``)."""
    if eos_token_id is None:
        return None
    ids = [eos_token_id] if not isinstance(eos_token_id, (list, tuple)) else list(eos_token_id)
    bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab_size]
    if not ids or bad:
        raise ValueError(
            f"eos_token_id: expected a token id or a non-empty list of them in [0, {vocab_size}), "
            f"got {eos_token_id!r}"
        )
    return torch.tensor(ids, dtype=torch.long)


def sample_next(
    logits: torch.Tensor, temperature: float, top_k: int | None, generator, top_p: float | None = None
) -> torch.Tensor:
    """Draw one token per row from ``logits [B, vocab]`` (greedy when ``temperature == 0``), among
    the ``top_k`` likeliest (ties with the ``k``-th kept) and then the nucleus of ``top_p`` (the
    fewest likeliest tokens whose probabilities sum to ``>= top_p``; among equal probabilities at
    its edge, the lower ids first). Default ``top_p=None``: no nucleus.

    The logits are shifted by their row maximum before the division by ``temperature``: the same
    distribution, and a tiny temperature (``1e-40`` on float64 logits) gives the greedy limit (the
    top tokens at probability 1, ties shared) instead of ``inf / inf``. A temperature below the
    logits' dtype's smallest normal number (``1.2e-38`` for float32; it would round to 0 or lose
    its digits) is greedy: ``argmax``, as ``temperature == 0``."""
    if temperature == 0 or temperature < torch.finfo(logits.dtype).smallest_normal:
        return logits.argmax(-1)
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if top_p is not None and top_p < 1:
        sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
        # the mass of the likelier tokens: the running sum up to the token before (``cumsum − p``
        # rounds, and kept a second token when top_p equals the likeliest token's probability)
        before = F.pad(sorted_p.cumsum(-1)[..., :-1], (1, 0))
        outside = before >= top_p  # in sorted order; the likeliest token is always kept
        drop = torch.empty_like(outside).scatter_(-1, order, outside)  # back to vocabulary order
        probs = probs.masked_fill(drop, 0.0)  # (multinomial renormalises)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]
