"""Loss and accuracy of a language model on a synthetic task, at any length (streaming).

A sequence longer than ``piece_len`` is fed in consecutive pieces with the model state carried
between them — the chunk form inside each piece, the recurrent state across pieces — so memory stays
bounded for the recurrent models and softmax attention keeps (only) its KV cache. By the
equivalence contract (DESIGN.md §4) this equals one pass over the whole sequence.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from ..data.tasks import IGNORE_INDEX, Task


@torch.no_grad()
def task_metrics(
    model,
    input_ids: torch.Tensor,
    targets: torch.Tensor,
    *,
    batch_size: int,
    piece_len: int | None = None,
    device: str | torch.device = "cpu",
    autocast=contextlib.nullcontext,
    units: torch.Tensor | None = None,
) -> dict:
    """Mean cross-entropy and accuracy of ``model`` on the supervised positions of a test set.

    Args:
        model: a :class:`~mnemo.models.LanguageModel` (put in eval mode for the call).
        input_ids, targets: ``[N, T]`` long; ``targets == IGNORE_INDEX`` where unsupervised.
        batch_size: sequences per forward pass. piece_len: stream sequences longer than this in
            pieces of ``piece_len`` tokens, carrying the state (``None``: one pass).
        autocast: a context-manager factory (e.g. bf16 autocast).
        units: ``[N, T]`` integers, the answer each supervised position belongs to (``0, 1, …``; −1
            elsewhere) for sequences with several answers
            (:meth:`~mnemo.data.tasks.base.Task.answer_units`); ``None``: a sequence is one answer.
    Returns:
        ``{"loss": nats per supervised token, "acc": token accuracy, "seq_acc": fraction of
        answers (sequences, without ``units``) with every supervised token right, "answers": their
        number, "n": supervised tokens}``.
    Raises:
        ValueError: the shapes of ``input_ids``, ``targets`` and ``units`` differ, nothing is
        supervised, ``units`` puts no answer on some supervised position, ``batch_size`` is not
        an int ``>= 1``, or ``piece_len`` is neither ``None`` nor an int ``>= 1``.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size: expected an int >= 1 (sequences per pass), got {batch_size!r}")
    if piece_len is not None and (
        isinstance(piece_len, bool) or not isinstance(piece_len, int) or piece_len < 1
    ):
        raise ValueError(f"piece_len: expected an int >= 1 (tokens per piece) or None, got {piece_len!r}")
    if input_ids.shape != targets.shape or input_ids.ndim != 2:
        raise ValueError(
            f"input_ids and targets must both be [N, T], got {list(input_ids.shape)} and "
            f"{list(targets.shape)}"
        )
    if units is not None:
        if units.shape != targets.shape:
            raise ValueError(
                f"units: expected the targets' shape {list(targets.shape)}, got {list(units.shape)}"
            )
        bad = ((units < 0) & (targets != IGNORE_INDEX)).nonzero()
        if len(bad):
            r, t = bad[0].tolist()
            raise ValueError(
                f"units: every supervised position needs an answer index >= 0, got {int(units[r, t])} at "
                f"sequence {r}, position {t}"
            )
    was = model.training
    model.eval()
    N, T = input_ids.shape
    piece = T if piece_len is None else piece_len
    total_loss, correct, count, seq_ok, n_answers = 0.0, 0, 0, 0, 0
    n_units = int(units.max()) + 1 if units is not None and units.numel() else 1
    try:
        for b in range(0, N, batch_size):
            x = input_ids[b : b + batch_size].to(device)
            y = targets[b : b + batch_size].to(device)
            state = None
            # per row and answer: one of its positions supervised, one missed
            u = units[b : b + batch_size].to(device) if units is not None else None
            has = torch.zeros(x.shape[0], n_units, dtype=torch.bool, device=device)
            missed = torch.zeros_like(has)
            for a in range(0, T, piece):
                yp = y[:, a : a + piece]
                with autocast():
                    logits, state = model(x[:, a : a + piece], state)
                mask = yp != IGNORE_INDEX
                if not mask.any():
                    continue
                lg = (logits if logits.dtype == torch.float64 else logits.float())[mask]
                tg = yp[mask]
                total_loss += F.cross_entropy(lg, tg, reduction="sum").item()
                # logits that overflowed (NaN, +inf) predict nothing (argmax would read a NaN as the
                # largest); a -inf logit is a masked token (a vocabulary mask), not an overflow
                hit = (lg.argmax(-1) == tg) & ~(lg.isnan() | lg.isposinf()).any(-1)
                correct += int(hit.sum())
                count += int(mask.sum())
                # the misses scattered back to their rows (and answers)
                miss = torch.zeros_like(mask)
                miss[mask] = ~hit
                if u is None:
                    missed[:, 0] |= miss.any(dim=1)
                else:
                    up = u[:, a : a + piece].long()
                    has[mask.nonzero(as_tuple=True)[0], up[mask]] = True
                    missed[miss.nonzero(as_tuple=True)[0], up[miss]] = True
            if u is None:  # a sequence is one answer, scored even where nothing was supervised
                has[:, 0] = True
            seq_ok += int((has & ~missed).sum())
            n_answers += int(has.sum())
    finally:
        model.train(was)
    if count == 0:
        raise ValueError("the test set has no supervised positions (all targets are IGNORE_INDEX)")
    return {
        "loss": total_loss / count,
        "acc": correct / count,
        "seq_acc": seq_ok / n_answers,
        "answers": n_answers,
        "n": count,
    }


def eval_batch_size(batch_size: int, train_len: int, length: int) -> int:
    """Sequences per pass at ``length`` so a batch holds about as many tokens as in training."""
    return max(1, (batch_size * train_len) // max(length, 1))


def evaluate_task(
    model,
    task: Task,
    lengths: list[int],
    *,
    num_samples: int,
    batch_size: int,
    train_len: int,
    seed: int,
    device="cpu",
    autocast=contextlib.nullcontext,
    cache: dict | None = None,
) -> dict[int, dict]:
    """:func:`task_metrics` on ``num_samples`` test sequences (the test seed of ``seed``) per length.

    The metrics read :meth:`Task.scored <mnemo.data.tasks.base.Task.scored>` targets (for ``niah``
    the answer only: ``seq_acc`` is exact match) and, where the task has them,
    :meth:`~mnemo.data.tasks.base.Task.answer_units` (``seq_acc`` per answer). Sequences longer
    than ``train_len`` are streamed in pieces of ``train_len`` with ``eval_batch_size`` sequences
    per pass. ``cache`` (a dict) keeps generated test sets by ``(length, rows)``, those of one seed and
    task: its entry ``"for"`` names them, and a call for another seed or task empties it first (a
    cache shared by such calls never hands one of them another's test set).
    Returns ``{length: metrics}``.
    """
    out = {}
    if cache is not None:
        owner = (task.name, repr(sorted(task.options().items())), seed)
        if cache.get("for") != owner:
            cache.clear()
            cache["for"] = owner
    for L in lengths:
        key = (L, num_samples)
        if cache is not None and key in cache:
            x, y, units = cache[key]
        else:
            x, y = task.sample(num_samples, L, seed=seed, split="test")
            y = task.scored(x, y)
            units = task.answer_units(x, y)
            if cache is not None:
                cache[key] = (x, y, units)
        out[L] = task_metrics(
            model,
            x,
            y,
            batch_size=eval_batch_size(batch_size, train_len, L) if L > train_len else batch_size,
            piece_len=train_len if L > train_len else None,
            device=device,
            autocast=autocast,
            units=units,
        )
    return out
