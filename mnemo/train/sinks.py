"""Where a run's evaluation records go: ``metrics.jsonl`` (:class:`MetricsFile`), TensorBoard
(:class:`TensorBoard`) and the progress bar's one-line summaries (:class:`ProgressBar`). Only rank
0 logs.

A record is a flat dict: ``step``, ``train_loss`` (nats/token, the mean over the evaluation
interval's steps), the evaluation's metrics (``val_loss`` in nats/token, ``val_bpc`` or
``val_acc``/``val_seq_acc``, ``val_*@L`` at the final evaluation), ``tokens_per_s`` (global
tokens per second of step time), ``lr`` (the learning rate step ``step``'s update used),
``elapsed_s``, the auxiliary losses' metrics
(``moe_*``), then what callbacks add.

Extension point: a new logger is any object with ``log(record: dict) -> None`` and ``close() ->
None`` (:class:`Sink`), passed as ``Trainer(..., sinks=[...])``; it gets every record after
``metrics.jsonl`` and TensorBoard, and ``close()`` at the end of every ``fit`` (a trainer may fit
again: keep the sink usable).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

from tqdm.auto import tqdm

METRICS_NAME = "metrics.jsonl"


def metrics_lines(path: str | Path, torn_last: bool = False) -> list[str]:
    """The lines of a ``metrics.jsonl`` file, decoded one by one: a line that is not UTF-8 raises
    ``ValueError`` naming the file and the line (the rest of the file is not read as text as a
    whole, so the message says where, not at which byte offset). ``torn_last``: the last line may
    be a write cut by a crash (possibly inside a multi-byte character): it is decoded with
    replacement characters for the caller to drop as torn (default ``torn_last=False``)."""
    raws = Path(path).read_bytes().splitlines()
    lines = []
    for i, raw in enumerate(raws, 1):
        try:
            lines.append(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            if torn_last and i == len(raws):
                lines.append(raw.decode("utf-8", errors="replace"))
                continue
            raise ValueError(
                f"{path}, line {i}: not valid UTF-8 ({e.reason} at column {e.start + 1}): {raw[:60]!r}; "
                "it is not a line mnemo wrote (the file was left as it is)"
            ) from None
    return lines


class Sink(Protocol):
    def log(self, record: dict) -> None:
        """Take one evaluation record (rank 0 only)."""

    def close(self) -> None:
        """The end of a ``fit``: flush what is buffered."""


class MetricsFile:
    """Appends each record as one JSON line to ``out/metrics.jsonl`` (opened per record: a crash
    loses at most a torn last line, which resume drops)."""

    def __init__(self, out: Path):
        self.path = out / METRICS_NAME

    def log(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def close(self) -> None:
        pass


class TensorBoard:
    """Every numeric value of a record (but ``step``) as a scalar at ``record["step"]``, in
    ``out/tb`` (needs the ``tensorboard`` package)."""

    def __init__(self, out: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError(
                "TrainConfig.tensorboard needs the 'tensorboard' package: pip install tensorboard"
            ) from e
        self.writer = SummaryWriter(str(out / "tb"))

    def log(self, record: dict) -> None:
        for k, v in record.items():
            if k != "step" and isinstance(v, (int, float)):
                self.writer.add_scalar(k, v, record["step"])

    def close(self) -> None:
        self.writer.flush()  # (stays open: the trainer may fit again)


class ProgressBar:
    """A tqdm bar over the ``cfg.steps`` of a run (one per ``fit``, from step ``initial``;
    ``enabled=False`` shows nothing; ``task``: a task run, which reports accuracy) with the
    loss's moving average and tokens/s, and one summary line per record: ``step, train loss, val
    loss, bpc (text) or accuracy (task; at the final evaluation also at every eval length),
    tok/s``."""

    def __init__(self, cfg, initial: int, enabled: bool, task: bool):
        self.task, self.eval_lengths = task, list(cfg.eval_lengths)
        self.bar = tqdm(
            total=cfg.steps,
            initial=initial,
            disable=not enabled,
            dynamic_ncols=True,
            desc=f"train {cfg.model}",
            unit="step",
            mininterval=0.5,
        )

    def update(self, loss_ema: float, tokens_per_s: float) -> None:
        """One step done."""
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{loss_ema:.3f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)

    def log(self, record: dict) -> None:
        if not self.task:
            quality = f"({record['val_bpc']:.3f} bpc)"
        else:  # the longer lengths are in the final evaluation's record only
            quality = f"acc {record['val_acc']:.4f}" + "".join(
                f"  acc@{L} {record[f'val_acc@{L}']:.4f}"
                for L in self.eval_lengths
                if f"val_acc@{L}" in record
            )
        self.bar.write(
            f"step {record['step']:>6}  train {record['train_loss']:.4f}  val {record['val_loss']:.4f} "
            f"{quality}  {record['tokens_per_s']:,.0f} tok/s"
        )

    def close(self) -> None:
        self.bar.close()


def default_sinks(out: Path, tensorboard: bool) -> list[Sink]:
    """Rank 0's built-in sinks: ``out/metrics.jsonl``, and TensorBoard in ``out/tb`` when asked."""
    return [MetricsFile(out), *([TensorBoard(out)] if tensorboard else [])]
