"""Training configuration (a dataclass; YAML/JSON files and CLI flags fill it)."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .. import argtypes as kinds


def _flag(help: str, **argparse_options) -> dict[str, Any]:
    """``dataclasses.field`` metadata that makes a :class:`TrainConfig` field a ``mnemo train``
    flag: ``--seq-len`` for ``seq_len``, with ``help`` and any ``argparse`` options (``choices``,
    ``metavar``, ``type`` — by default the type of the field's default; a ``bool`` field is a
    switch that sets ``True``). ``default_help`` (a string) names the default in the help where
    the field's default value would not (``None``); other defaults are shown as they are. The
    flag's own default is ``None``, "not given": the config file's (or the saved run's) value
    stands. See ``mnemo.cli.add_config_flags``."""
    return {"cli": {"help": help, **argparse_options}}


#: bounds that keep a typo from starting work that would never end (a billion steps; each
#: evaluation at most 100,000 validation batches)
MAX_STEPS = 10**9
MAX_EVAL_BATCHES = 100_000
#: the random tokens ``track_spectrum`` reads (``mnemo.interp.CircuitTracker``'s ``spectrum_tokens``)
SPECTRUM_TOKENS = 256


@dataclass
class TrainConfig:
    """Everything that defines a training run (saved as ``train_config.json`` in checkpoints).

    Attributes:
        model: registered model name (``mnemo models``). model_overrides: ``ModelConfig`` fields
            to replace (e.g. ``{"d_model": 256, "n_layers": 6}``).
        data: ``"tinyshakespeare"`` (bundled), a path to a UTF-8 text file (one document), a
            ``.jsonl``/``.json`` or ``.parquet`` file of records (one document each, read through
            ``datasets``, local files only), or a folder or glob of such files
            (:func:`mnemo.data.load_corpus`). Documents are joined by the tokenizer's end-of-text
            token (``"\\n\\n"`` for char and byte); the last 10% of the characters validate.
        text_field: the field of the JSONL/Parquet records that holds the text.
        pack_documents: document packing — each document inside a training or validation window
            is its own sequence (``cu_seqlens`` through the model: every mixer starts it from an
            empty state), so no attention and no state crosses a document boundary. The token
            after a document's last one (the separator's prediction) is still a target. Default
            ``False``.
        carry_state: truncated back-propagation through time over the text corpus: the batch is
            ``batch_size`` parallel streams (the training text cut into ``batch_size`` contiguous
            shards), every step feeds each stream its next ``seq_len``-token window, and the model
            starts from the recurrent state it returned on the previous window (detached and
            copied, :func:`mnemo.layers.state.snapshot`: the gradient stops at the window's start,
            the state goes on). Slow memories then step on the stream's time scale, e.g. CMS levels whose
            period is not shorter than ``seq_len`` (``hope_long``). All shards have one length, so
            all streams reach their end at the same step and all restart together from their
            shard's first token with a fresh state (:class:`mnemo.train.batches.CarriedStreams`).
            The stream positions follow from the step and the carried state is saved with every
            checkpoint, so a resumed run continues exactly. Text corpora on one process only: not
            with ``task``, ``pack_documents``, ``context_parallel``, ``fsdp``, ``compile`` or
            ``activation_checkpointing``, nor under ``torchrun`` with several processes, nor for a
            model without a recurrent state or whose state grows with the stream (a softmax
            attention's KV cache); the trainer raises ``ValueError`` naming the setting. Evaluation
            still runs the validation windows each from a fresh state. Default ``False``.
        bos: a fixed first token — every training and validation window of a text corpus starts
            with this text (the window's first token is replaced, so the model reads ``[BOS,
            t_1 … t_{T−1}]`` and predicts ``t_1 … t_T``), as documents start with a BOS token;
            StreamingLLM (Xiao et al. 2023, §3.3) pretrains with such a token and the attention
            sink forms on it. It must encode to exactly one token (with the char tokenizer a
            character absent from the text encodes to the unknown id 0, a token the text never
            holds). ``mnemo eval`` and ``mnemo generate`` apply it too (they read the run's
            config; generation reads ``[BOS] + prompt``). Text corpora only:
            not with ``task``, ``pack_documents`` or ``carry_state``. Default ``None``.
        tokenizer: ``"char"`` (vocabulary = the characters of the file), ``"byte"``, or a path to a
            Hugging Face ``tokenizer.json`` (BPE, Unigram, ...) or a folder holding one (e.g. from
            ``mnemo tokenizer train``; needs ``mnemo[hf]``). The checkpoints carry it.
        seq_len, batch_size: training window length and windows per optimizer step (defaults
            ``seq_len=128`` and ``batch_size=32``). The batch is global: with
            ``torchrun --nproc_per_node N`` every process draws the same batch and trains on its
            ``batch_size / N`` rows (the losses equal the single-process run's), so ``batch_size``
            must be a multiple of ``N · grad_accum`` (with ``context_parallel``: of ``grad_accum``).
        grad_accum: micro-batches per optimizer step — each process's rows are split into
            ``grad_accum`` equal micro-batches whose gradients are accumulated (same gradient as
            one big batch, less activation memory; gradients are synchronised across processes
            once per step). ``batch_size`` must be a multiple of it. Default ``1``.
        context_parallel: under ``torchrun --nproc_per_node N``, split every sequence instead of
            the batch: each process takes the whole global batch and runs tokens
            ``[r·T/N, (r+1)·T/N)`` of every sequence, layer by layer
            (:func:`mnemo.train.distributed.context_parallel_forward`): a recurrent layer starts
            from the state the same layer of process ``r − 1`` ended with, a softmax-attention
            layer runs ring attention over all processes' keys; the gradients are then summed over
            the processes (an all-reduce, no DDP), so the losses and updates equal the
            single-process run's. Activation memory per process shrinks about ``N``-fold;
            recurrent layers form a wavefront across the processes (partial overlap), attention
            layers run on all processes at once. Attention sinks and attention blocks with a CMS
            are rejected (with any number of processes). ``seq_len`` must be a multiple of ``N``;
            ``grad_accum`` splits the global batch (``batch_size`` a multiple of ``grad_accum``
            only); activation checkpointing recomputes every block (never the messages). With one process
            it changes nothing. Default ``False``.
        fsdp: under ``torchrun --nproc_per_node N``, train data-parallel with every block and the
            root sharded by FSDP2 (:mod:`mnemo.train.sharded`): parameters, gradients and
            optimizer state are split over the processes (same losses as one process, up to
            float rounding); checkpoints are DCP shards that resume on any number of processes
            and ``mnemo convert --from-dcp`` turns into a single file. Every process evaluates
            (and samples) in step, rank 0 logs. Not with ``context_parallel`` nor optimizer
            ``"m3"``. With one process (an FSDP run resumed there) it trains unsharded and saves
            single-file checkpoints with ``fsdp`` false. Default ``False``.
        activation_checkpointing: recompute each block's activations in the backward pass instead
            of keeping them (``torch.utils.checkpoint``): less memory, about one more forward pass;
            same losses and gradients. Default ``False``.
        steps: optimizer steps. lr: peak learning rate; warmup_steps linear warm-up, then cosine
            decay to ``lr · min_lr_ratio`` at ``schedule_steps``. Defaults: ``steps=1000``,
            ``lr=3e-3``, ``warmup_steps=50``, ``min_lr_ratio=0.1``.
        schedule_steps: length of the warm-up + cosine schedule in steps (default ``None``: equal
            to ``steps``); past it the learning rate stays at ``lr · min_lr_ratio``. Set when a
            resumed run gets more (or fewer) ``steps`` but should keep its cosine
            (``mnemo train --resume --steps N --reschedule hold``).
        optimizer: ``"adamw"``, ``"m3"`` (Multi-scale Momentum Muon, Nested Learning Algorithm 1,
            :class:`mnemo.train.m3.M3`: Newton–Schulz-orthogonalised fast and slow momenta over an
            accumulated second moment; its update size differs from Adam's, so tune ``lr`` for it
            — see the class docstring — with this trainer's weight decay, clipping and warm-up +
            cosine added) or ``"m3_paper"`` (Algorithm 1 alone: constant ``lr``, and
            ``weight_decay``, ``grad_clip``, ``warmup_steps``, ``min_lr_ratio`` and
            ``schedule_steps`` unused). The run's log names what is added
            (:func:`mnemo.train.optim.describe_optimizer`).
        m3_slow_every: M3's ``f``, steps per block of the slow momentum (a positive int; default
            ``10``).
        m3_beta3: M3's ``β3`` (slow-momentum factor, in ``[0, 1)``); ``β1, β2`` are ``beta1``,
            ``beta2``. m3_alpha: M3's ``α ≥ 0``, weight of the slow momentum. m3_ns_steps: M3's
            Newton–Schulz iterations ``T`` (an int ≥ 0). m3_eps: M3's ``ε > 0``
            (default ``1e-2``, not Adam's ``1e-8``: ``ε`` caps M3's per-element step at about
            ``lr / ε``, and with ``1e-8`` the 60-step transformer run diverged at every lr tried).
            m3_ema: ``False`` (Algorithm 1: momenta accumulate without decay) or ``True`` (a
            departure: exponential moving averages). Defaults: ``m3_beta3=0.99``, ``m3_alpha=0.5``,
            ``m3_ns_steps=5``, ``m3_eps=1e-2``, ``m3_ema=False``.
        weight_decay, beta1, beta2: AdamW / M3 (decay on matrices only; decoupled). grad_clip: max
            global grad norm (``0`` disables). Defaults: ``weight_decay=0.1``, ``beta1=0.9``,
            ``beta2=0.95``, ``grad_clip=1.0``.
        (Per-module learning rates: a module with a float attribute ``outer_lr_scale`` trains at
        ``lr · outer_lr_scale``; see :func:`mnemo.train.optim.make_optimizer`.)
        eval_interval: evaluate (and log to ``metrics.jsonl``) every this many steps and at the
            end; eval_batches: validation batches per evaluation. Defaults: ``eval_interval=100``,
            ``eval_batches=8``.
        checkpoint_interval: save every this many steps (default: ``eval_interval``) and at the end.
        seed: seeds the weights and the batch order (default ``0``). device: ``"cpu"`` or ``"cuda"``.
        precision: ``"fp32"`` or ``"bf16"`` (default ``"fp32"``). ``"bf16"`` is mixed precision:
            the forward runs under ``torch.autocast(device_type, torch.bfloat16)`` on the run's
            device (CUDA or CPU), so the matmuls and the ops' backends (fla-core's and mamba-ssm's
            kernels on CUDA) get bfloat16 ``q, k, v`` / ``x``; the parameters, gradients and
            optimizer state stay float32 (master weights); the ops' recurrent states (matrix
            memories, SSM states, the test-time-trained memories) accumulate and are returned in
            float32; the cross-entropy is computed on float32 logits. The KV caches and the short
            convolutions' windows hold activations, in bfloat16.
        compile: train under ``torch.compile`` (default ``False``): the model's training forward
            (and its backward, through AOTAutograd) is compiled once (tens of seconds on the first
            steps; a new shape recompiles); ``Trainer.model`` stays the uncompiled module, so
            checkpoints, evaluation, sampling and ``state_dict`` keys are unchanged (no
            ``_orig_mod.`` prefix) and a compiled run resumes eagerly and vice versa. Not with
            ``context_parallel`` (its ring exchanges run between the layers).
        sample_tokens, sample_prompt, sample_temperature: the text sample printed at the end
            (defaults ``sample_tokens=400``, ``sample_prompt="ROMEO:"``, ``sample_temperature=0.8``:
            400 tokens after ``"ROMEO:"``, sampled from logits / 0.8).
        tensorboard: also write TensorBoard event files to ``OUT/tb`` (needs ``tensorboard``;
            default ``False``).
        task: a synthetic task name (``mnemo tasks``: ``mqar``, ``selective_copying``, ``induction_heads``,
            ``passkey``, ``copying``, ``repeat_segment``) instead of text; then ``data`` and ``tokenizer`` are
            unused, the vocabulary comes from the task, batches are drawn from the task's train seed stream,
            evaluation (loss and accuracy on the supervised positions) uses a fixed test set of ``eval_batches
            · batch_size`` sequences from the disjoint test seed, and no text sample is printed.
        task_options: the task's options (e.g. ``{"num_pairs": 8, "vocab_size": 256}``).
        train_examples: tasks only: train on a fixed set of this many sequences instead of a fresh
            batch at every step (Zoology's recipe: 100,000 MQAR training examples). The set is drawn
            once from the run's train seed stream (so it never meets the test set) and read in
            order, ``batch_size`` rows per step, wrapping around at the end of each epoch without
            shuffling, as Zoology's loader does (a last partial batch is skipped); ``batch_size``
            must not exceed it. ``None`` (default): fresh batches.
        early_stop_acc: tasks only: stop training at the first evaluation whose ``val_acc`` is at
            least this value (Zoology stops at 0.99), writing the final checkpoint there; the
            cosine schedule keeps its length; a resumed early-stopped run stays stopped. The
            evaluation that stops the run is its final one: it adds the ``eval_lengths``.
            ``None`` (default): run all ``steps``.
        eval_lengths: further test lengths (tasks only), evaluated at the end of training with the
            models' streaming chunk/recurrent forms, e.g. ``[1024, 4096]`` for a model trained at
            256; metrics ``val_acc@L`` and ``val_loss@L``.
        track_circuits: at every evaluation also record the circuit scores of DESIGN.md §7
            (previous-token, duplicate-token and induction score, max over heads per layer and
            overall, on random tokens repeated twice; :class:`mnemo.interp.CircuitTracker`) in
            ``metrics.jsonl``; ``mnemo probe plot-training OUT`` draws them against the loss. The
            tracker is a callback the caller passes (``mnemo train`` and ``mnemo sweep`` do;
            from Python: ``Trainer(cfg, out, callbacks=mnemo.interp.circuit_callbacks)``): the
            trainer raises ``ValueError`` without one (``mnemo.train`` does not import
            ``mnemo.interp``). Default ``False``.
        init_from: start from the weights of another run (a run or checkpoint directory) instead of
            a fresh initialisation — fine-tuning, or a curriculum (e.g. MQAR at 64 tokens, then at
            128); the model must have the same shapes; the optimizer and schedule start fresh. A
            converted checkpoint's record of its source (``hf_config_carried.json``,
            ``generation_config.json``, which ``mnemo export --format hf`` writes back) is copied
            into the run's checkpoints while the run's model and vocabulary are the checkpoint's
            (:func:`mnemo.train.build.source_files`).
        circuit_length: length ``L`` of the random segment the tracker repeats (``2 L`` tokens,
            ``2 L + 1`` after a ``bos``; default ``32``).
        track_spectrum: at every evaluation also record the memory spectrum of every memory
            (:func:`mnemo.interp.spectrum.memory_spectrum` on 256 seeded random tokens: the shares
            of irrelevant / intermediate / marginal / relevant directions and the median half-life
            per layer and per CMS level), through the same tracker as ``track_circuits`` (which it
            turns on); ``mnemo probe plot-training OUT`` draws how the spectrum flows as training
            proceeds. Costs one spectrum per evaluation (seconds for test-time-trained memories).
            (default ``False``)
        spectrum_burn_in: the first tokens of those 256 that ``track_spectrum`` leaves out of its
            averages (the ``burn_in`` of :func:`~mnemo.interp.spectrum.memory_spectrum`, as
            ``mnemo probe spectrum --burn-in``): an int in ``[0, 256)``, read only with
            ``track_spectrum`` (default ``spectrum_burn_in=0``).
    """

    # ``metadata=_flag(...)``: the field is a ``mnemo train`` flag (``--seq-len`` for ``seq_len``);
    # the help and the argparse options are here, the parser is generated (mnemo.cli)
    model: str = field(
        default="transformer",
        metadata=_flag(
            "registered model name (see `mnemo models`)",
            metavar="NAME",
            type=kinds.Text("a model name (see `mnemo models`)"),
        ),
    )
    model_overrides: dict[str, Any] = field(default_factory=dict)  # flags --d-model, --n-layers
    data: str = field(
        default="tinyshakespeare",
        metadata=_flag(
            "'tinyshakespeare' (bundled), a UTF-8 text file, a .jsonl/.parquet file, or a folder or "
            "glob of them",
            metavar="TEXT",
            type=kinds.Text("'tinyshakespeare', a file, a folder or a glob"),
        ),
    )
    text_field: str = field(
        default="text",
        metadata=_flag(
            "JSONL/Parquet data: the field holding the text", metavar="NAME", type=kinds.Text("a field name")
        ),
    )
    pack_documents: bool = field(
        default=False,
        metadata=_flag(
            "document packing: each document in a window is its own sequence (cu_seqlens through every "
            "mixer), so no attention or state crosses a document boundary"
        ),
    )
    carry_state: bool = field(
        default=False,
        metadata=_flag(
            "truncated BPTT: the batch is B parallel streams over the text, each step feeds each stream "
            "its next window and carries the model's state over (detached); slow memories such as "
            "CMS levels with periods >= the window then step (all streams restart together at the end)"
        ),
    )
    bos: str | None = field(
        default=None,
        metadata=_flag(
            "a fixed first token: every training and validation window of the text starts with this "
            "text, which must be one token (char tokenizer: a character the text never holds is the "
            "unknown id, a token of its own)",
            metavar="TEXT",
            type=kinds.Token(),
        ),
    )
    tokenizer: str = field(
        default="char",
        metadata=_flag(
            "text tokenizer: char, byte, or a Hugging Face tokenizer.json (or a folder holding one)",
            metavar="char|byte|PATH",
            type=kinds.Text("'char', 'byte' or a tokenizer.json path"),
        ),
    )
    seq_len: int = field(
        default=128, metadata=_flag("training window length in tokens", metavar="T", type=kinds.positive_int)
    )
    batch_size: int = field(
        default=32,
        metadata=_flag(
            "sequences per optimizer step over all processes", metavar="B", type=kinds.positive_int
        ),
    )
    grad_accum: int = field(
        default=1,
        metadata=_flag(
            "micro-batches per optimizer step (gradient accumulation); the batch size must be a "
            "multiple of processes x grad-accum",
            metavar="N",
            type=kinds.positive_int,
        ),
    )
    context_parallel: bool = field(
        default=False,
        metadata=_flag(
            "under torchrun, split every sequence over the processes instead of the batch "
            "(ring attention for attention layers, state relay for recurrent ones; the sequence "
            "length must be a multiple of the processes)"
        ),
    )
    fsdp: bool = field(
        default=False,
        metadata=_flag(
            "under torchrun, shard parameters, gradients and optimizer state over the processes "
            "(FSDP2) and write sharded checkpoints (torch.distributed.checkpoint)"
        ),
    )
    activation_checkpointing: bool = field(
        default=False,
        metadata=_flag(
            "recompute each block's activations in the backward pass (less memory, ~1 more forward)"
        ),
    )
    compile: bool = field(
        default=False,
        metadata=_flag(
            "train the model under torch.compile (the first steps compile: tens of seconds; "
            "checkpoints, evaluation and sampling use the uncompiled model)"
        ),
    )
    steps: int = field(
        default=1000,
        metadata=_flag("optimizer steps, at most 10**9", metavar="N", type=kinds.Int(1, MAX_STEPS)),
    )
    schedule_steps: int | None = None  # set by --resume --reschedule
    lr: float = field(
        default=3e-3,
        metadata=_flag("peak learning rate (warm-up, then cosine decay)", type=kinds.positive_float),
    )
    min_lr_ratio: float = 0.1
    warmup_steps: int = field(
        default=50, metadata=_flag("linear learning-rate warm-up steps", metavar="N", type=kinds.nonneg_int)
    )
    optimizer: str = field(
        default="adamw",
        metadata=_flag(
            "outer optimizer (m3_paper: Nested Learning's Algorithm 1 alone: constant lr, no decay, no clip)",
            choices=["adamw", "m3", "m3_paper"],
        ),
    )
    m3_slow_every: int = 10
    m3_beta3: float = 0.99
    m3_alpha: float = 0.5
    m3_ns_steps: int = 5
    m3_eps: float = 1e-2
    m3_ema: bool = False
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    eval_interval: int = field(
        default=100,
        metadata=_flag(
            "evaluate (and log to OUT/metrics.jsonl) every N steps and at the end",
            metavar="N",
            type=kinds.positive_int,
        ),
    )
    eval_batches: int = field(
        default=8,
        metadata=_flag(
            "validation batches per evaluation, at most 100,000",
            metavar="N",
            type=kinds.Int(1, MAX_EVAL_BATCHES),
        ),
    )
    checkpoint_interval: int | None = field(
        default=None,
        metadata=_flag(
            "save a checkpoint every N steps and at the end",
            type=kinds.positive_int,
            metavar="N",
            default_help="--eval-interval",
        ),
    )
    seed: int = field(
        default=0, metadata=_flag("seeds the weights and the batch order", metavar="N", type=kinds.seed)
    )
    device: str = field(default="cpu", metadata=_flag("cpu or cuda[:N]", type=kinds.device))
    precision: str = field(
        default="fp32",
        metadata=_flag("bf16 = autocast, states accumulate in fp32", choices=["fp32", "bf16"]),
    )
    sample_tokens: int = field(
        default=400,
        metadata=_flag(
            "tokens to sample at the end (characters with the char tokenizer), 0 = none, at most 100,000",
            metavar="N",
            type=kinds.Int(0, 100_000),
        ),
    )
    sample_prompt: str = "ROMEO:"
    sample_temperature: float = 0.8
    tensorboard: bool = field(default=False, metadata=_flag("write TensorBoard events to OUT/tb"))
    init_from: str | None = field(
        default=None,
        metadata=_flag(
            "start from the weights of this run/checkpoint (same model shapes)",
            metavar="DIR",
            type=kinds.ExistingDir("a run or checkpoint folder"),
        ),
    )
    task: str | None = field(
        default=None,
        metadata=_flag(
            "train on a synthetic task instead of text (`mnemo tasks` lists them)",
            metavar="NAME",
            type=kinds.Text("a task name (see `mnemo tasks`)"),
        ),
    )
    task_options: dict[str, Any] = field(default_factory=dict)  # flag --task-option KEY=VALUE
    train_examples: int | None = field(
        default=None,
        metadata=_flag(
            "task runs: train on a fixed set of N sequences (read in order, epoch after epoch) "
            "instead of fresh batches (default: fresh batches)",
            metavar="N",
            type=kinds.positive_int,
        ),
    )
    early_stop_acc: float | None = field(
        default=None,
        metadata=_flag(
            "task runs: stop at the first evaluation with val_acc >= this (e.g. 0.99)",
            metavar="ACC",
            type=kinds.Float(0, 1, lo_open=True),
        ),
    )
    eval_lengths: list[int] = field(default_factory=list)  # flag --eval-lengths L1,L2
    track_circuits: bool = field(
        default=False,
        metadata=_flag(
            "record previous-token/duplicate/induction scores at every evaluation (metrics.jsonl)"
        ),
    )
    circuit_length: int = field(
        default=32,
        metadata=_flag("--track-circuits: repeated segment length", metavar="L", type=kinds.Int(2)),
    )
    track_spectrum: bool = field(
        default=False,
        metadata=_flag("record the memory spectrum (shares of directions, half-lives) at every evaluation"),
    )
    spectrum_burn_in: int = field(
        default=0,
        metadata=_flag(
            "--track-spectrum: first tokens left out of the spectrum's averages",
            metavar="T",
            type=kinds.Int(0, SPECTRUM_TOKENS - 1),
        ),
    )

    def validate(self) -> TrainConfig:
        """Raise ``ValueError`` naming the offending field; return self."""

        def bad(name, expected):
            got = getattr(self, name)
            hint = _yaml_hint(got, integer="int" in expected)
            raise ValueError(f"TrainConfig.{name}: expected {expected}, got {got!r}{hint}")

        # types first (a config file can hold anything): every later check compares values
        strings = ("model", "data", "text_field", "tokenizer", "device", "precision", "optimizer")
        for name in (*strings, "sample_prompt"):
            if not isinstance(getattr(self, name), str):
                bad(name, "a string")
        for name in ("task", "init_from"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                bad(name, "None or a string")
        for name in (
            "lr",
            "min_lr_ratio",
            "weight_decay",
            "beta1",
            "beta2",
            "grad_clip",
            "sample_temperature",
        ):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                bad(name, "a finite number")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2**63:
            bad("seed", "an int in 0 … 2**63 − 1 (what torch.manual_seed takes)")
        if not isinstance(self.tensorboard, bool):
            bad("tensorboard", "true or false")
        for name in ("seq_len", "batch_size", "grad_accum", "steps", "eval_interval", "eval_batches"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                bad(name, "a positive int")
        for name, hi in (("steps", MAX_STEPS), ("eval_batches", MAX_EVAL_BATCHES)):
            if getattr(self, name) > hi:
                bad(name, f"a positive int <= {hi:,}")
        if self.batch_size % self.grad_accum:
            bad("batch_size", f"a multiple of grad_accum ({self.grad_accum})")
        if not isinstance(self.activation_checkpointing, bool):
            bad("activation_checkpointing", "true or false")
        if not isinstance(self.context_parallel, bool):
            bad("context_parallel", "true or false")
        if not isinstance(self.fsdp, bool):
            bad("fsdp", "true or false")
        if not isinstance(self.compile, bool):
            bad("compile", "true or false")
        if self.compile and self.context_parallel:
            bad("compile", "false with context_parallel (the ring exchanges run between the layers, eagerly)")
        if self.fsdp and self.context_parallel:
            bad("fsdp", "false with context_parallel (sharded training splits the batch, not the sequences)")
        if self.fsdp and self.optimizer in ("m3", "m3_paper"):
            bad("fsdp", f"false with optimizer {self.optimizer!r} (Newton-Schulz needs whole matrices)")
        if not isinstance(self.pack_documents, bool):
            bad("pack_documents", "true or false")
        if self.pack_documents and (self.task is not None or self.context_parallel):
            bad("pack_documents", "false with --task or --context-parallel (packing is for text corpora)")
        self._validate_carry_state(bad)
        if self.bos is not None:
            if not isinstance(self.bos, str) or not self.bos:
                bad("bos", "None or a non-empty text (one token)")
            for name in ("task", "pack_documents", "carry_state"):
                if getattr(self, name) not in (None, False):
                    raise ValueError(
                        f"TrainConfig.bos: a fixed first token is for text windows; expected {name} = "
                        f"{None if name == 'task' else False} with bos = {self.bos!r}, got {name} = "
                        f"{getattr(self, name)!r}"
                    )
        if self.init_from is not None and not isinstance(self.init_from, str):
            bad("init_from", "None or a path to a run or checkpoint directory")
        if not isinstance(self.track_circuits, bool):
            bad("track_circuits", "true or false")
        if not isinstance(self.track_spectrum, bool):
            bad("track_spectrum", "true or false")
        if (
            not isinstance(self.circuit_length, int)
            or isinstance(self.circuit_length, bool)
            or self.circuit_length < 2
        ):
            bad("circuit_length", "an int >= 2")
        if self.circuit_length != 32 and not (self.track_circuits or self.track_spectrum):
            raise ValueError(
                f"TrainConfig.circuit_length ({self.circuit_length}) is read only by the circuit tracker: "
                "turn on track_circuits (--track-circuits) too, or leave it out"
            )
        b = self.spectrum_burn_in
        if not isinstance(b, int) or isinstance(b, bool) or not 0 <= b < SPECTRUM_TOKENS:
            bad(
                "spectrum_burn_in",
                f"an int in [0, {SPECTRUM_TOKENS}) (tokens of the spectrum's {SPECTRUM_TOKENS})",
            )
        if b != 0 and not self.track_spectrum:
            raise ValueError(
                f"TrainConfig.spectrum_burn_in ({b}) is read only by the spectrum tracker: "
                "turn on track_spectrum (--track-spectrum) too, or leave it out"
            )
        for name in ("warmup_steps", "sample_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                bad(name, "a non-negative int")
        if self.sample_tokens > 100_000:
            bad("sample_tokens", "an int in 0 … 100,000 (tokens sampled at the end of training)")
        if self.checkpoint_interval is not None and (
            not isinstance(self.checkpoint_interval, int)
            or isinstance(self.checkpoint_interval, bool)
            or self.checkpoint_interval < 1
        ):
            bad("checkpoint_interval", "None or a positive int")
        if self.schedule_steps is not None and (
            not isinstance(self.schedule_steps, int)
            or isinstance(self.schedule_steps, bool)
            or self.schedule_steps < 1
        ):
            bad("schedule_steps", "None or a positive int")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            bad("lr", "a positive number")
        if not (0 <= self.min_lr_ratio <= 1):
            bad("min_lr_ratio", "a number in [0, 1]")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            bad("beta1" if not 0 <= self.beta1 < 1 else "beta2", "a number in [0, 1)")
        if self.weight_decay < 0:
            bad("weight_decay", "a non-negative number")
        if self.grad_clip < 0:
            bad("grad_clip", "a non-negative number (0 disables clipping)")
        if not self.text_field:
            bad("text_field", "the name of a field of the records")
        if self.tokenizer not in ("char", "byte") and not _looks_like_path(self.tokenizer):
            bad("tokenizer", "'char', 'byte' or a path to a tokenizer.json (or a folder holding one)")
        if self.optimizer not in ("adamw", "m3", "m3_paper"):
            bad("optimizer", "'adamw', 'm3' or 'm3_paper'")
        for name, lo, what in (
            ("m3_slow_every", 1, "a positive int"),
            ("m3_ns_steps", 0, "a non-negative int"),
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                bad(name, what)
        for name, lo, hi, what in (
            ("m3_beta3", 0.0, 1.0, "a number in [0, 1)"),
            ("m3_alpha", 0.0, math.inf, "a number >= 0"),
            ("m3_eps", 0.0, math.inf, "a number > 0"),
        ):
            v = getattr(self, name)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            if not (ok and lo <= v < hi and (name != "m3_eps" or v > 0)):
                bad(name, what)
        if not isinstance(self.m3_ema, bool):
            bad("m3_ema", "true or false")
        if self.m3_ema and self.optimizer == "m3_paper":
            bad("m3_ema", "false with optimizer 'm3_paper' (Algorithm 1 accumulates; 'm3' has the EMA)")
        if self.precision not in ("fp32", "bf16"):
            bad("precision", "'fp32' or 'bf16'")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            bad("device", "'cpu' or 'cuda[:N]'")
        if not isinstance(self.model_overrides, dict):
            bad("model_overrides", "a mapping of ModelConfig fields")
        if "vocab_size" in self.model_overrides:
            raise ValueError(
                "TrainConfig.model_overrides: vocab_size is not a model override: the run's tokenizer "
                "(or --task-option vocab_size=N for a task) sets it"
            )
        if self.sample_temperature < 0:
            bad("sample_temperature", "a number >= 0")
        self._validate_task(bad)
        return self

    def _validate_carry_state(self, bad) -> None:
        """The settings ``carry_state`` cannot run with (the trainer checks the processes, the
        model and the text's length)."""
        if not isinstance(self.carry_state, bool):
            bad("carry_state", "true or false")
        if not self.carry_state:
            return
        why = {
            "task": "a task's examples are independent sequences, not one stream: leave task unset",
            "pack_documents": "packing starts every document from an empty state",
            "context_parallel": "the carried state is not split over processes",
            "fsdp": "the carried state is not split over processes",
            "compile": "the carried state's counters would recompile the forward at every window",
            "activation_checkpointing": "the model recomputes blocks only when no state is passed in",
        }
        for name, reason in why.items():
            value = getattr(self, name)
            if value not in (None, False):
                raise ValueError(
                    f"TrainConfig.carry_state: expected {name} = {None if name == 'task' else False} "
                    f"with carry_state = True ({reason}), got {name} = {value!r}"
                )

    def _validate_task(self, bad) -> None:
        if not isinstance(self.task_options, dict):
            bad("task_options", "a mapping of task options")
        if self.train_examples is not None:
            v = self.train_examples
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                bad("train_examples", "None or a positive int")
            if self.task is None:
                bad("train_examples", "None when no task is set (set TrainConfig.task)")
            if v < self.batch_size:
                bad("train_examples", f"None or at least batch_size ({self.batch_size})")
        if self.early_stop_acc is not None:
            v = self.early_stop_acc
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not (0 < v <= 1):
                bad("early_stop_acc", "None or a number in (0, 1]")
            if self.task is None:
                bad("early_stop_acc", "None when no task is set (set TrainConfig.task)")
        if not isinstance(self.eval_lengths, (list, tuple)) or any(
            not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in self.eval_lengths
        ):
            bad("eval_lengths", "a list of positive ints")
        if len(set(self.eval_lengths)) != len(self.eval_lengths):
            bad("eval_lengths", "distinct lengths (each is evaluated once)")
        self.eval_lengths = list(self.eval_lengths)
        if self.task is None:
            if self.task_options:
                bad("task_options", "no options when no task is set (set TrainConfig.task)")
            if self.eval_lengths:
                bad("eval_lengths", "an empty list when no task is set (set TrainConfig.task)")
            return
        from ..data.tasks import build_task, task_names

        if self.task not in task_names():
            bad("task", f"None or one of {task_names()}")
        try:
            task = build_task(self.task, self.task_options)
        except ValueError as e:
            raise ValueError(f"TrainConfig.task_options: {e}") from None
        for name, lengths in (("seq_len", [self.seq_len]), ("eval_lengths", self.eval_lengths)):
            for L in lengths:
                try:
                    task.check_length(L, f"TrainConfig.{name}")
                except ValueError as e:
                    raise ValueError(str(e)) from None

    def build_task(self):
        """The :class:`~mnemo.data.tasks.Task` of this run (``None`` for text)."""
        if self.task is None:
            return None
        from ..data.tasks import build_task

        return build_task(self.task, self.task_options)

    @property
    def cosine_steps(self) -> int:
        """Length of the warm-up + cosine schedule: ``schedule_steps``, else ``steps``."""
        return self.schedule_steps or self.steps

    @property
    def ckpt_every(self) -> int:
        return self.checkpoint_interval or self.eval_interval

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        if not isinstance(d, dict):
            raise ValueError(f"TrainConfig: expected a mapping of fields, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known, key=str)
        if unknown:
            raise ValueError(f"unknown TrainConfig field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**d).validate()


def _yaml_hint(value, integer: bool = False) -> str:
    """Why a number may have arrived as a string: YAML 1.1 (PyYAML) reads ``3e-3`` (no dot) or
    ``1_000.5`` as text. For an int field (``integer``) the hint spells the number as an int.
    Empty for anything else."""
    if not isinstance(value, str):
        return ""
    try:
        number = float(value)
    except ValueError:
        return ""
    if not math.isfinite(number):  # "NaN", "inf": no spelling of it is a valid value
        return ""
    try:
        unquoted = yaml.safe_load(value)
    except yaml.YAMLError:
        unquoted = value
    if not isinstance(unquoted, str):  # YAML reads it as a number: it was quoted (or came from JSON)
        return " (a string: write the number without quotes)"
    json_too = "; in a JSON file, without quotes"  # (which kind of file it came from is not known here)
    if integer:
        if not (math.isfinite(number) and number == int(number)):
            return ""
        return (
            f" (a string: YAML 1.1 reads {value} as text, not a number; write the int as {int(number)}"
            f"{json_too})"
        )
    return (
        f" (a string: YAML 1.1 reads {value} as text, not a number; write it with a dot and a signed "
        f"exponent, e.g. {number:.1e}, or as {number!r}{json_too})"
    )


def _looks_like_path(value: str) -> bool:
    """An existing path, or one spelled as a path (a separator, or ``.json``): a name such as
    ``"bpe"`` is a mistake, a missing path is reported when the tokenizer is read (a resumed run
    reads its tokenizer from the checkpoint instead)."""
    return bool(value) and (Path(value).exists() or "/" in value or "\\" in value or value.endswith(".json"))


class _RepeatedKey(yaml.YAMLError):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key written twice in one mapping (PyYAML keeps the last
    silently: ``steps: 2`` then ``steps: 3`` would train 3 steps without a word)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: the base class reports it
                continue
            if first is not None:
                raise _RepeatedKey(f"the key {key!r} is written twice (lines {first} and {line}); keep one")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _no_repeated_keys(pairs: list) -> dict:
    keys = [k for k, _ in pairs]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise ValueError(f"the key(s) {twice} are written twice in one object; keep one of each")
    return dict(pairs)


def load_config_file(
    path: str | Path, kind: str = "config file", holds: str = "TrainConfig fields", empty_ok: bool = False
) -> dict[str, Any]:
    """Read a YAML or JSON mapping of :class:`TrainConfig` fields (raises naming the file; ``kind``
    and ``holds`` name the file and its contents in the messages, e.g. for a sweep file).

    Raises:
        FileNotFoundError: no such file. ValueError: not UTF-8, not YAML/JSON, not a mapping, or
            a key written twice in one mapping, or empty (a 0-byte or comments-only file: an
            explicit ``{}`` is how to ask for defaults),
            unless ``empty_ok`` (then ``{}``: the caller says what an empty file lacks); default
            ``empty_ok=False``.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{kind} not found: {str(path)!r}")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{kind} {str(path)!r} is not UTF-8 text (a YAML or JSON file of {holds}): {e}"
        ) from e
    try:
        d = (
            json.loads(text, object_pairs_hook=_no_repeated_keys)
            if p.suffix == ".json"
            else yaml.load(text, Loader=_UniqueKeyLoader)
        )
    except (json.JSONDecodeError, yaml.YAMLError, ValueError) as e:
        where = " ".join(str(e).split())  # one line: YAML's message draws the place over several
        raise ValueError(f"cannot parse {kind} {str(path)!r}: {where}") from e
    if d is None:  # an empty file (or only comments): every setting would silently be a default
        if empty_ok:
            return {}
        raise ValueError(
            f"{kind} {str(path)!r} is empty (no {holds}); write the settings in it (an explicit `{{}}` "
            "asks for every default)"
        )
    if not isinstance(d, dict):
        raise ValueError(f"{kind} {str(path)!r} must hold a mapping of {holds}, got a {type(d).__name__}")
    return d
