"""Building a run's model: the checks that must pass before anything is allocated (learned
positions cover every length, a step and the evaluations fit in memory, the model can run
context-parallel), the model on its device, and its starting weights: another run's
(``TrainConfig.init_from``) or, on resume, the checkpoint's. The seed is set here: the model's
initial weights are the first draws of the run's torch RNG stream (exact resume depends on the
order of the draws).

Extension point: a new architecture is a registered model (:func:`mnemo.models.build_config`);
what must be true of a model before a run allocates it goes in :func:`build_model`."""

from __future__ import annotations

import shlex
import warnings
from pathlib import Path

import torch

from ..models import LanguageModel, build_config
from ..models.lm import CONFIG_NAME, WEIGHTS_NAME, _legacy_retnet_width
from . import memory_estimate
from .checkpoint import resolve_checkpoint
from .config import TrainConfig
from .distributed import _check_recurrent
from .memory_estimate import GiB, check_forward_memory, check_memory, check_sequences_memory, estimate_memory
from .optim import load_with_fresh, match_saved_groups
from .sharded import is_sharded, load_sharded
from .strategy import ContextParallel, Strategy
from .task_eval import eval_batch_size


def _count_parameters(model_cfg) -> int:
    """Parameters of the model ``model_cfg`` describes, counted on the meta device (nothing is
    allocated; 0 if a layer cannot be built there — the estimate then leaves parameters out)."""
    try:
        with torch.device("meta"):
            return LanguageModel(model_cfg).num_parameters()
    except Exception:  # a layer that computes with its tensors at construction
        return 0


def build_model(cfg: TrainConfig, vocab_size: int, strategy: Strategy) -> LanguageModel:
    """Seed and build the model on ``strategy.device``, after checking that the learned positions
    cover the lengths, that a step fits in memory, and (context parallelism) that the model can run
    context-parallel, and that packing (``pack_documents``) does not split a CMS task signal; warns
    about CMS periods the training length never reaches; then
    ``strategy.prepare`` (e.g. FSDP sharding, before the optimizer)."""
    device, world = strategy.device, strategy.world
    context_parallel = isinstance(strategy, ContextParallel)
    torch.manual_seed(cfg.seed)
    model_cfg = build_config(cfg.model, vocab_size=vocab_size, **cfg.model_overrides)
    if model_cfg.pos_embedding == "learned":
        # every length a forward pass reads: training, the evaluations, the circuit tracker's
        # repeated sequence (2 L + 1 tokens, as its memory check below)
        lengths = [("seq_len", cfg.seq_len), *(("eval_lengths", L) for L in cfg.eval_lengths)]
        if cfg.track_circuits:
            lengths.append(("circuit_length", 2 * cfg.circuit_length + 1))
        name, longest = max(lengths, key=lambda nl: nl[1])
        if longest > model_cfg.max_position:
            raise ValueError(
                f"TrainConfig.{name}: {longest} tokens exceed the learned positions of model "
                f"{cfg.model!r} (max_position = {model_cfg.max_position}); raise "
                "model_overrides.max_position"
            )
    cp_world = world if context_parallel else 1
    rows = cfg.batch_size // ((1 if context_parallel else world) * cfg.grad_accum)
    # FSDP2: each process holds 1/world of the parameters, their gradients and moments (a layer is
    # gathered whole only while it runs); counted whole, a model that fits only sharded was refused
    shards = world if cfg.fsdp else 1
    total = _count_parameters(model_cfg)
    sizes = dict(
        n_params=total // shards,
        vocab_size=vocab_size,
        d_model=model_cfg.d_model,
        n_layers=model_cfg.n_layers,
        batch_size=cfg.batch_size,
        micro_rows=rows,
        seq_len=cfg.seq_len // cp_world,
        activation_checkpointing=cfg.activation_checkpointing,
        eval_log_softmax=cfg.task is None,  # a text run's validation loss: the batch's log-softmax
    )
    what = f"a step of {cfg.batch_size:,} x {cfg.seq_len} tokens"
    # packed documents and context parallelism hold a micro-batch's full logits (the chunked head
    # does not); so do CMS levels learning from the task signal, known once the model is built
    full_logits = cfg.pack_documents or context_parallel
    if shards > 1:  # but each process builds the whole model on its device before it is sharded
        have, source = memory_estimate.available_memory(device)
        whole = 4 * total  # fp32 weights
        if have is not None and whole > have:
            raise ValueError(
                f"TrainConfig.fsdp: each of the {world} processes builds the whole model on its device "
                f"before sharding it: {total:,} fp32 weights need {whole / GiB:,.2f} GiB, but only "
                f"{have / GiB:,.1f} GiB are available ({source}); choose a smaller model (lower "
                "--d-model or --n-layers)"
            )
    check_memory(estimate_memory(**sizes, full_logits=full_logits), device, what=what)
    if cfg.eval_lengths:  # the final evaluation's test sets at the longer lengths
        rows = cfg.eval_batches * cfg.batch_size
        for L in cfg.eval_lengths:
            check_sequences_memory(rows, L, device, flag="--eval-lengths", bytes_per_token=20)
            # streamed in pieces of seq_len with the state carried (evaluate_task): one piece's pass
            rows_L, piece = (
                (eval_batch_size(cfg.batch_size, cfg.seq_len, L), cfg.seq_len)
                if L > cfg.seq_len
                else (cfg.batch_size, L)
            )
            check_forward_memory(model_cfg, rows_L, piece, device, flag="--eval-lengths")
    if cfg.track_circuits:  # the tracker runs one repeated random sequence (and its maps) per evaluation
        check_forward_memory(
            model_cfg, 1, 2 * cfg.circuit_length + 1, device, flag="--circuit-length", maps=True
        )
    model = LanguageModel(model_cfg).to(device)
    model.activation_checkpointing = cfg.activation_checkpointing
    if model.task_segment is not None and not full_logits:  # before the first step's logits
        check_memory(estimate_memory(**sizes, full_logits=True), device, what=what)
    if cfg.pack_documents and model.task_segment is not None:  # before any work
        raise ValueError(
            f"pack_documents (--pack-documents): not with model {cfg.model!r}, whose CMS levels "
            "learn from the next-token loss over the whole window (packing would split it per "
            "document); train it unpacked, or use a CMS with a reconstruction objective (e.g. "
            "hope_reconstruction)"
        )
    for i, block in enumerate(model.blocks):
        window_problems = getattr(block.mlp, "window_problems", None)
        # with carry_state the state goes on from window to window: such a level steps every
        # `period` tokens of the stream (check_carry_state warns about periods beyond a stream)
        for msg in window_problems(cfg.seq_len) if window_problems and not cfg.carry_state else ():
            warnings.warn(
                f"model {cfg.model!r}, block {i}: {msg}; --carry-state carries the state from window "
                f"to window (truncated BPTT), so it steps every period tokens of the stream; or use "
                f"periods < seq_len = {cfg.seq_len} or a longer --seq-len",
                stacklevel=3,  # the caller of Trainer(...)
            )
    if cfg.context_parallel:
        try:
            _check_recurrent(model)
        except ValueError as e:
            raise ValueError(f"TrainConfig.context_parallel: model {cfg.model!r}: {e}") from None
    strategy.prepare(model)  # before the optimizer: it must hold the shards
    return model


def check_carry_state(
    model: LanguageModel, cfg: TrainConfig, stream_tokens: int, world: int = 1, stacklevel: int = 2
) -> None:
    """What ``cfg.carry_state`` needs of the run: one process (``world``, default ``world=1``), a
    model that carries a recurrent state of a fixed size (its size after ``stream_tokens`` tokens,
    what one stream reads between two restarts, equals its size after twice as many; a softmax
    attention's KV cache grows), and learned positions (if any) covering ``stream_tokens``. Warns
    about CMS levels whose period is not shorter than ``stream_tokens`` (they never step before the
    streams restart), pointing ``stacklevel`` frames up from this function's caller, as
    :func:`warnings.warn` counts them (default ``stacklevel=2``: the caller's caller, the caller of
    ``Trainer(...)`` when the trainer calls this).

    Raises:
        ValueError: naming ``TrainConfig.carry_state``, what was expected and what was found.
    """
    if world != 1:
        raise ValueError(
            f"TrainConfig.carry_state: expected one process (the carried state is not split over "
            f"processes), got {world} processes under torchrun"
        )
    if model.state_size_bytes(1, stream_tokens) == 0:
        raise ValueError(
            f"TrainConfig.carry_state: expected a model with a recurrent state to carry, got model "
            f"{cfg.model!r}, whose state is empty (state_size_bytes = 0)"
        )
    for i, block in enumerate(model.blocks):
        here, later = (block.mixer.state_size_bytes(1, n) for n in (stream_tokens, 2 * stream_tokens))
        if later > here:
            raise ValueError(
                f"TrainConfig.carry_state: expected a state of fixed size, got model {cfg.model!r}, whose "
                f"block {i} ({type(block.mixer).__name__}) keeps a state that grows with the stream "
                f"({here:,} bytes per stream after {stream_tokens:,} tokens, {later:,} after twice as "
                "many: a KV cache); train it without --carry-state"
            )
    mc = model.config
    if mc.pos_embedding == "learned" and stream_tokens > mc.max_position:
        raise ValueError(
            f"TrainConfig.carry_state: expected a stream of at most max_position = {mc.max_position} "
            f"tokens (model {cfg.model!r} has learned positions), got {stream_tokens:,} tokens per "
            "stream; raise --batch-size (shorter streams) or model_overrides.max_position"
        )
    for i, block in enumerate(model.blocks):
        if getattr(block.mlp, "window_problems", None) is None:  # not a CMS
            continue
        for j, lv in enumerate(block.mlp.levels):
            if lv.level.period >= stream_tokens:
                warnings.warn(
                    f"model {cfg.model!r}, block {i}: CMS level {j} has period {lv.level.period} >= the "
                    f"{stream_tokens:,} tokens each of the {cfg.batch_size} streams reads before all "
                    "restart (--carry-state): it never steps in training; use a smaller --batch-size "
                    "or a longer text",
                    stacklevel=stacklevel + 1,  # (+1: this function's own frame)
                )


def load_weights(
    model: LanguageModel, source: str, model_name: str, device, sharded: bool, tokenizer=None
) -> Path:
    """Start ``model`` from the weights of another run's checkpoint ``source`` (same model shapes
    required; ``sharded``: this process keeps its FSDP shards); the optimizer, schedule and data
    stream start fresh. ``tokenizer``: this (text) run's, which must be the checkpoint's (when it
    holds one; default ``None``: not checked): the same shapes with other ids (a char vocabulary
    rebuilt from another text) would train every embedding row as another token, silently.
    Returns the checkpoint folder read (``source`` resolved: a run's newest intact checkpoint)."""
    from safetensors.torch import load_model

    ckpt = resolve_checkpoint(source)
    if tokenizer is not None and (ckpt / "tokenizer.json").is_file():
        from ..data.tokenizer import load_tokenizer

        theirs = load_tokenizer(ckpt)
        if theirs.to_dict() != tokenizer.to_dict():
            raise ValueError(
                f"TrainConfig.init_from: {ckpt} was trained with another tokenizer than this run's "
                f"({tokenizer.kind!r}; a char vocabulary is built from the run's text): its ids mean "
                f"other tokens (vocabulary {theirs.vocab_size} there, {tokenizer.vocab_size} here); "
                f"train with that checkpoint's vocabulary: tokenizer={str(ckpt)!r} (mnemo train: "
                f"--tokenizer {shlex.quote(str(ckpt))})"
            )
    try:
        if is_sharded(ckpt):
            load_sharded(ckpt, model)
        elif sharded:  # every process reads the whole file and keeps its shards
            from safetensors.torch import load_file
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            full = load_file(str(ckpt / WEIGHTS_NAME), device=str(device))
            set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))
        else:
            load_model(model, str(ckpt / WEIGHTS_NAME), device=str(device))
    except RuntimeError as e:  # missing/unexpected keys or shape mismatches
        raise ValueError(
            f"TrainConfig.init_from: the weights in {ckpt} do not fit model {model_name!r} "
            f"(it needs the same architecture, width, depth and vocabulary): {_misfit(model, ckpt, e)}"
        ) from None
    return ckpt


#: files of a checkpoint that say where its weights came from rather than what the model computes: a
#: converted checkpoint's ``hf_config_carried.json`` (the source ``config.json``'s fields mnemo does
#: not model: token ids, ``max_position_embeddings``, the source dtype, …;
#: :data:`mnemo.hf.convert.CARRIED_CONFIG_NAME`) and ``generation_config.json``
#: (:data:`mnemo.hf.convert.CARRIED_FILES`), which ``mnemo export --format hf`` writes back. A run
#: carries them from its ``init_from`` checkpoint into its own checkpoints (:func:`source_files`).
SOURCE_FILES = ("hf_config_carried.json", "generation_config.json")


def source_files(ckpt: Path, model: LanguageModel, tokenizer, *, resumed: bool, warn: bool = True) -> dict:
    """The :data:`SOURCE_FILES` of checkpoint ``ckpt`` (name -> bytes, copied verbatim) that this run's
    checkpoints carry, so that ``mnemo export --format hf`` of a fine-tuned converted model writes
    its source's fields back (``max_position_embeddings``, the dtype, the token ids) instead of the
    target class's defaults.

    ``resumed``: ``ckpt`` is the checkpoint a resumed run continues from; whatever it holds was
    judged when the run started and is carried on. Otherwise ``ckpt`` is the ``init_from``
    checkpoint, and the rule is: its files are carried only while they still describe the run's
    model, i.e. when

    1. the model is the checkpoint's: ``model.config`` equals its ``config.json`` field for field
       (a changed window, RoPE, norm or any other field — ``model_overrides`` — could make
       ``max_position_embeddings`` or the target class wrong), ``init_std`` aside (it only draws
       the initial weights, which ``init_from`` replaces), and
    2. the vocabulary is the checkpoint's: a text run whose ``tokenizer`` is the one the checkpoint
       holds (:func:`load_weights` refuses another; a task run's ids are the task's symbols, and
       without a ``tokenizer.json`` in the checkpoint nothing says what the carried token ids name).

    Otherwise nothing is carried (the export then writes what it writes for a model of mnemo's own:
    the class's defaults, the ids of the run's tokenizer), with a warning naming the reason when
    ``warn`` (default ``warn=True``) and the checkpoint has such files. Returns ``{}`` when ``ckpt``
    holds none."""
    import json

    from ..models import ModelConfig

    found = {n: (ckpt / n).read_bytes() for n in SOURCE_FILES if (ckpt / n).is_file()}
    if not found or resumed:
        return found
    why = None
    try:
        theirs = ModelConfig.load(ckpt / CONFIG_NAME).to_dict()
    except (OSError, ValueError, TypeError) as e:
        theirs, why = None, f"its {CONFIG_NAME} does not read as a model config ({e})"
    if theirs is not None:
        ours = json.loads(json.dumps(model.config.to_dict()))  # (as saved: tuples as lists)
        theirs = json.loads(json.dumps(theirs))
        for side in (theirs, ours):  # (init_std: the initial weights' spread; every weight is loaded)
            side.pop("init_std", None)
        diff = _differences(theirs, ours)
        if diff:
            why = f"the run's model is not the checkpoint's ({'; '.join(diff)})"
    if why is None and tokenizer is None:
        why = "a task run reads the task's symbols, not the checkpoint's tokens"
    elif why is None and not (ckpt / "tokenizer.json").is_file():
        why = f"{ckpt} holds no tokenizer.json, so nothing says which tokens the carried ids name"
    if why is None:
        return found
    if warn:
        warnings.warn(
            f"TrainConfig.init_from: {', '.join(found)} of {ckpt} (the fields `mnemo export --format hf` "
            f"writes back: the source's max_position_embeddings, dtype, token ids) are not carried into "
            f"this run's checkpoints: {why}; an export of the run writes the target class's defaults",
            stacklevel=3,
        )
    return {}


def _differences(theirs: dict, ours: dict, prefix: str = "") -> list[str]:
    """``"field X there, Y here"`` for each field of two config dicts that differs (nested dicts
    field by field: ``mixer_options.attention.window 5 there, 8 here``)."""
    out = []
    for k in sorted(set(theirs) | set(ours), key=str):
        a, b = theirs.get(k), ours.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k} {a!r} there, {b!r} here")
    return out


def _misfit(model: LanguageModel, ckpt: Path, error: RuntimeError) -> str:
    """One line on why ``ckpt``'s weights do not load into ``model``: the config fields that
    differ (``d_model 32 there, 64 here``), else what to do for a ``retnet`` checkpoint of the preset's
    old value width, else the first line of torch's report and how many more it has (torch lists
    every tensor, one per line)."""
    import dataclasses
    import json

    try:
        theirs = json.loads((ckpt / CONFIG_NAME).read_text())
        ours = dataclasses.asdict(model.config)
        diff = [
            f"{k} {theirs[k]!r} there, {ours[k]!r} here"
            for k in ours
            if k in theirs and theirs[k] != ours[k] and not isinstance(ours[k], (dict, list))
        ]
    except (OSError, ValueError, TypeError):
        diff = []
    if diff:
        return "; ".join(diff)
    if _legacy_retnet_width(model.config, ckpt / WEIGHTS_NAME) != model.config:
        return (
            "its retnet layers have the preset's old value width (expand_v 1.0; it is now 2.0, the "
            "paper's 2·d_model): build that width with model_overrides: {mixer_options: {retnet: "
            "{expand_v: 1.0}}} in a --config file, and continue from these weights with --init-from "
            "(a --resume keeps the saved model)"
        )
    lines = [x.strip() for x in str(error).splitlines() if x.strip()]
    more = len(lines) - 2
    return " ".join(lines[:2]) + (f" (and {more} more)" if more > 0 else "")


def load_checkpoint(model: LanguageModel, optimizer, ckpt: Path, state: dict, device, sharded: bool) -> None:
    """Resume: the weights and optimizer state of checkpoint ``ckpt`` (DCP shards of an FSDP run
    load on any number of processes, sharded or not; a single-file one not ``sharded``). In a
    single-file one, parameters added since it was written (absent from its weights, filled on
    load) start with fresh optimizer state, with a warning (:func:`~mnemo.train.optim.load_with_fresh`),
    and the optimizer takes the older grouping its state was saved in
    (:func:`~mnemo.train.optim.match_saved_groups`), also both at once."""
    from safetensors.torch import load_model

    if is_sharded(ckpt):  # DCP shards of an FSDP run: any number of processes, sharded or not
        load_sharded(ckpt, model, optimizer)
    elif sharded:
        raise ValueError(
            f"TrainConfig.fsdp: {ckpt} is a single-file checkpoint; resuming it sharded is not "
            "supported (resume it without --fsdp, or start a new run with init_from)"
        )
    else:
        from safetensors import safe_open

        load_model(model, str(ckpt / WEIGHTS_NAME), device=str(device))
        with safe_open(str(ckpt / WEIGHTS_NAME), "pt") as f:  # parameters filled on load (added since)
            absent = {n for n, _ in model.named_parameters()} - set(f.keys())
        # a checkpoint of older groups (counted without the absent parameters: both may apply)
        match_saved_groups(optimizer, model, state["optimizer"], absent)
        load_with_fresh(optimizer, model, state["optimizer"], absent)
