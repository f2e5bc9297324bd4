"""A lower bound on the memory one training step needs, checked before anything is allocated.

The bound counts only what certainly exists at the peak of a step: the fp32 parameters, their
gradients and two optimizer moments; the token batch (int64 windows and their index); per block, a
few ``d_model``-wide fp32 activations kept for the backward pass (one per block with activation
checkpointing); and the fp32 logits of one evaluation batch, which both evaluators compute whole.
A training step's ``[rows, T, vocab]`` logits are counted only where the forward holds them
(``full_logits``): the chunked head of a text run (:mod:`mnemo.models.fused_loss`) and a task's
head (its supervised positions only) never do. The real peak is higher (attention scores, MLP
hidden states, recurrent states), so a refusal based on it is never a false alarm; a run it lets
through can still run out of memory.

The sizes hold for ``precision="bf16"`` too: the parameters, gradients and optimizer state stay
fp32 (master weights), and under autocast the residual stream (each block's input, the tensor kept
with activation checkpointing) stays fp32, while the bf16 copies the matmuls keep come on top; the
tensors saved for the backward measure 3.6× or more of the ``activations`` term in fp32 and bf16.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

# fp32 tensors of width d_model that every block keeps for its backward pass, at least: the block
# input, the normalised input, the mixer output and the MLP input and output
ACTS_PER_BLOCK = 5
GiB = 1024**3


@dataclass
class MemoryEstimate:
    """Bytes (lower bounds) of one training step and of one evaluation batch."""

    parameters: int  # weights + gradients + two optimizer moments, fp32
    batch: int  # int64 token windows and the index that gathers them
    logits: int  # logits, log-softmax and their gradient for one micro-batch (``full_logits``; else 0)
    activations: int  # per-block activations kept for the backward pass
    eval_logits: int  # fp32 logits (and log-softmax: ``eval_log_softmax``) of one evaluation batch

    @property
    def step(self) -> int:
        return self.parameters + self.batch + self.logits + self.activations

    @property
    def peak(self) -> int:
        return max(self.step, self.parameters + self.batch + self.eval_logits)


def estimate_memory(
    *,
    n_params: int,
    vocab_size: int,
    d_model: int,
    n_layers: int,
    batch_size: int,
    micro_rows: int,
    seq_len: int,
    activation_checkpointing: bool = False,
    full_logits: bool = False,
    eval_log_softmax: bool = False,
) -> MemoryEstimate:
    """Lower bounds (bytes) for a step on ``micro_rows`` rows of a global ``batch_size`` batch of
    ``seq_len`` tokens, and for an evaluation batch of ``batch_size`` rows.
    ``activation_checkpointing`` as in :class:`~mnemo.train.TrainConfig`. ``full_logits``: the
    training forward holds a micro-batch's ``[rows, T, vocab]`` logits with their log-softmax and
    gradient (packed documents, context parallelism, CMS levels learning from the task signal);
    ``eval_log_softmax``: the evaluation holds the log-softmax of its whole batch too (a text run's
    validation loss). Without them the bound counts neither, since the chunked head and a task's
    head never hold them: a bound that counted them would refuse runs that fit. Defaults
    ``activation_checkpointing=False``, ``full_logits=False``, ``eval_log_softmax=False``."""
    f32, i64 = 4, 8
    tokens = micro_rows * seq_len
    kept = 1 if activation_checkpointing else ACTS_PER_BLOCK
    return MemoryEstimate(
        parameters=4 * n_params * f32,
        batch=2 * batch_size * (seq_len + 1) * i64,
        logits=3 * tokens * vocab_size * f32 if full_logits else 0,
        activations=n_layers * kept * tokens * d_model * f32,
        eval_logits=(2 if eval_log_softmax else 1) * batch_size * seq_len * vocab_size * f32,
    )


def available_memory(device: torch.device) -> tuple[int | None, str]:
    """Bytes free for this process on ``device`` and where the number comes from (``None`` when
    it cannot be read)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), f"free memory of {device}"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "physical memory"
    except (ValueError, OSError, AttributeError):  # pragma: no cover - exotic platforms
        return None, "unknown"


def check_memory(est: MemoryEstimate, device: torch.device, *, what: str) -> None:
    """Raise ``ValueError`` when ``est.peak`` exceeds the memory available on ``device``; the
    message gives the estimate, its parts and the machine's memory. ``what`` describes the step."""
    have, source = available_memory(device)
    if have is None or est.peak <= have:
        return
    if est.parameters > have:  # no batch fits: the model itself is too large
        raise ValueError(
            f"TrainConfig.model: the model's parameters + optimizer state alone need "
            f"{est.parameters / GiB:,.1f} GiB, but only {have / GiB:,.1f} GiB are available ({source}); "
            "choose a smaller model (lower --d-model or --n-layers)"
        )
    accum = ", or split the step with --grad-accum" if est.step >= est.peak else ""
    raise ValueError(
        f"TrainConfig.batch_size: {what} needs at least {est.peak / GiB:,.1f} GiB (logits "
        f"{est.logits / GiB:,.1f}, evaluation logits {est.eval_logits / GiB:,.1f}, activations "
        f"{est.activations / GiB:,.1f}, parameters + optimizer {est.parameters / GiB:,.2f}, token "
        f"batch {est.batch / GiB:,.1f} GiB), but only {have / GiB:,.1f} GiB are available "
        f"({source}); lower --batch-size or --seq-len{accum}"
    )


def check_sequences_memory(
    n_sequences: int, length: int, device, *, flag: str, bytes_per_token: int = 16
) -> None:
    """Refuse a set of ``n_sequences`` sequences of ``length`` tokens that cannot fit in the memory
    available on ``device``. ``bytes_per_token`` (default ``bytes_per_token=16``): int64 inputs
    and labels; a test set adds int32 answer units (:meth:`~mnemo.data.tasks.base.Task.answer_units`):
    20.

    Raises:
        ValueError: it cannot (the message gives both numbers and names ``flag``).
    """
    need = bytes_per_token * n_sequences * length
    have, source = available_memory(torch.device(device))
    if have is not None and need > have:
        raise ValueError(
            f"{flag}: {n_sequences:,} sequence(s) of {length:,} tokens need at least {need / GiB:,.1f} GiB "
            f"at {bytes_per_token} bytes a token, but only {have / GiB:,.1f} GiB are available ({source}); "
            f"lower {flag}"
        )


def check_forward_memory(
    model_config, batch: int, length: int, device, *, flag: str, maps: bool = False
) -> None:
    """Refuse, before anything is allocated, a forward pass over ``batch`` sequences of
    ``length`` tokens (no gradients) that cannot fit in the memory available on ``device``.
    The lower bound counts the logits (fp32) and a few ``d_model``-wide activations per block;
    ``maps`` (default ``maps=False``) adds one ``length × length`` fp32 map per sequence and layer
    (the attention or implicit-attention maps the circuit probes read). ``flag`` names the options
    to lower.

    Raises:
        ValueError: the bound exceeds the available memory (the message gives both).
    """
    f32 = 4
    tokens = batch * length
    need = tokens * model_config.vocab_size * f32 + model_config.n_layers * ACTS_PER_BLOCK * tokens * (
        model_config.d_model * f32
    )
    if maps:
        need += model_config.n_layers * batch * length * length * f32
    have, source = available_memory(torch.device(device))
    if have is not None and need > have:
        raise ValueError(
            f"{flag}: {batch:,} sequence(s) of {length:,} tokens need at least {need / GiB:,.1f} GiB, "
            f"but only {have / GiB:,.1f} GiB are available ({source}); lower {flag}"
        )
