"""Where a run's evaluation records come from and go: the training metrics of a logging interval
(:class:`IntervalMeter`, completed by :func:`evaluation_record`), ``metrics.jsonl``
(:class:`MetricsFile`), TensorBoard (:class:`TensorBoard`) and the progress bar's one-line
summaries (:class:`ProgressBar`). Only rank 0 logs.

A record is a flat dict: ``step``, ``train_loss`` (nats/token, the mean over the evaluation
interval's steps), the evaluation's metrics (``val_loss`` in nats/token, ``val_bpc`` or
``val_acc``/``val_seq_acc``, ``val_*@L`` at the final evaluation), ``tokens_per_s`` (global
tokens per second of step time), ``lr`` (the learning rate step ``step``'s update used),
``elapsed_s``, the auxiliary losses' metrics
(``moe_*``), then what callbacks add.

Extension point: a new logger is any object with ``log(record: dict) -> None`` and ``close() ->
None`` (:class:`Sink`), passed as ``Trainer(..., sinks=[...])``; it gets every record after
``metrics.jsonl`` and TensorBoard, and ``close()`` at the end of every ``fit`` (a trainer may fit
again: keep the sink usable). The trainer holds a process's sinks as a :class:`Logbook`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Protocol

from tqdm.auto import tqdm

METRICS_NAME = "metrics.jsonl"
#: the field of a record that names its non-finite values (:func:`dumps_record`)
NONFINITE_KEY = "nonfinite"
_NONFINITE_TEXT = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _pointer_part(key) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")


def _strict(value, path: str, found: dict):
    """``value`` with each non-finite float replaced by ``None``, its place noted in ``found``."""
    if isinstance(value, float) and not math.isfinite(value):
        found[path] = "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
        return None
    if isinstance(value, dict):
        return {
            k: _strict(v, f"{path}/{_pointer_part(k)}" if path else _pointer_part(k), found)
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [_strict(v, f"{path}/{i}" if path else str(i), found) for i, v in enumerate(value)]
    return value


def dumps_record(record: dict) -> str:
    """``record`` as one line of strict JSON (what ``jq`` and JavaScript accept, RFC 8259): a
    non-finite float (NaN, ±inf, which ``json.dumps`` writes as the bare tokens ``NaN`` and
    ``Infinity``) is written as ``null``, and the record's field ``"nonfinite"`` maps where it
    was (a JSON Pointer without its leading ``/``: the key itself for a top-level value,
    ``curve/3/val_loss`` inside) to ``"NaN"``, ``"Infinity"`` or ``"-Infinity"``.
    :func:`loads_record` restores the floats."""
    found: dict[str, str] = {}
    strict = _strict(record, "", found)
    if found and isinstance(strict, dict):
        strict[NONFINITE_KEY] = found
    return json.dumps(strict, allow_nan=False)


def loads_record(line: str):
    """A line of :func:`dumps_record` (or of a file written before it, with bare ``NaN``) as the
    record it was written from: the values its ``"nonfinite"`` field names are floats again and
    the field is dropped. Raises ``json.JSONDecodeError`` for a line that is not JSON."""
    record = json.loads(line)
    if not isinstance(record, dict) or not isinstance(record.get(NONFINITE_KEY), dict):
        return record
    for path, text in record.pop(NONFINITE_KEY).items():
        if text not in _NONFINITE_TEXT or not isinstance(path, str):
            continue
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")]
        node = record
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else _index(node, part)
        if isinstance(node, dict) and node.get(last, 0) is None:
            node[last] = _NONFINITE_TEXT[text]
        elif isinstance(node, list) and (i := _int(last)) is not None and i < len(node) and node[i] is None:
            node[i] = _NONFINITE_TEXT[text]
    return record


def _int(part: str) -> int | None:
    return int(part) if part.isdigit() else None


def _index(node, part: str):
    i = _int(part)
    return node[i] if isinstance(node, list) and i is not None and i < len(node) else None


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


class IntervalMeter:
    """The training metrics of one logging interval (the steps since the last evaluation): the
    mean step loss and the global tokens per second of step time. The loss sums are checkpointed
    (:meth:`state_dict`), so a resumed run's first record averages the same steps as an
    uninterrupted run's; the throughput's sums start again with the process."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """A new interval: nothing measured yet."""
        self.loss, self.n, self.tokens, self.seconds = 0.0, 0, 0, 0.0

    def add(self, loss: float, tokens: int, seconds: float) -> None:
        """One step: its loss, its global tokens and its time."""
        self.loss += loss
        self.n += 1
        self.tokens += tokens
        self.seconds += seconds

    def record(self, step: int, lr: float, extra: dict) -> dict:
        """The interval's record at step ``step``, and a reset: ``step``, ``train_loss``,
        ``tokens_per_s``, ``lr`` (the rate of the last update), then ``extra`` (the auxiliary
        losses' metrics). Without an evaluation (ranks other than 0) it is the whole record."""
        record = {
            "step": step,
            "train_loss": self.loss / max(self.n, 1),
            "tokens_per_s": self.tokens / max(self.seconds, 1e-9),
            "lr": lr,
            **extra,
        }
        self.reset()
        return record

    def state_dict(self) -> dict:
        """What a checkpoint holds of the interval (the keys of the trainer state it joins)."""
        return {"acc_loss": self.loss, "acc_n": self.n}

    def load_state_dict(self, state: dict) -> None:
        """Resume the interval of a checkpoint's trainer ``state``."""
        self.loss, self.n = state["acc_loss"], state["acc_n"]


_TRAINING_KEYS = ("step", "train_loss", "tokens_per_s", "lr")


def evaluation_record(record: dict, metrics: dict, elapsed_s: float) -> dict:
    """An interval's ``record`` (:meth:`IntervalMeter.record`) completed with an evaluation's
    ``metrics`` and the run's ``elapsed_s``, in the documented order (the module's docstring)."""
    extra = {k: v for k, v in record.items() if k not in _TRAINING_KEYS}
    return {
        "step": record["step"],
        "train_loss": record["train_loss"],
        **metrics,
        "tokens_per_s": record["tokens_per_s"],
        "lr": record["lr"],
        "elapsed_s": elapsed_s,
        **extra,
    }


class Sink(Protocol):
    def log(self, record: dict) -> None:
        """Take one evaluation record (rank 0 only)."""

    def close(self) -> None:
        """The end of a ``fit``: flush what is buffered."""


class MetricsFile:
    """Appends each record as one line of strict JSON to ``out/metrics.jsonl`` (opened per record:
    a crash loses at most a torn last line, which resume drops); a non-finite value is written as
    ``null`` and named in the record's ``"nonfinite"`` field (:func:`dumps_record`; read it back
    with :func:`loads_record`)."""

    def __init__(self, out: Path):
        self.path = out / METRICS_NAME

    def log(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(dumps_record(record) + "\n")

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
    loss's moving average (``0.9 · ema + 0.1 · loss``, from this ``fit``'s first step) and
    tokens/s, and one summary line per record: ``step, train loss, val loss, bpc (text) or
    accuracy (task; at the final evaluation also at every eval length), tok/s``."""

    def __init__(self, cfg, initial: int, enabled: bool, task: bool):
        self.task, self.eval_lengths = task, list(cfg.eval_lengths)
        self.ema: float | None = None
        self.bar = tqdm(
            total=cfg.steps,
            initial=initial,
            disable=not enabled,
            dynamic_ncols=True,
            desc=f"train {cfg.model}",
            unit="step",
            mininterval=0.5,
        )

    def update(self, loss: float, tokens_per_s: float) -> None:
        """One step done, with its ``loss``."""
        self.ema = loss if self.ema is None else 0.9 * self.ema + 0.1 * loss
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{self.ema:.3f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)

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


class Logbook:
    """The sinks of one process of the run in ``out``: on rank 0 (``enabled``) the built-in ones
    (:func:`default_sinks`; TensorBoard with ``tensorboard``), then ``extra`` (the caller's); on
    the other ranks none. Default ``enabled=True``."""

    def __init__(self, out: Path, tensorboard: bool, extra=(), enabled: bool = True):
        self.enabled = enabled
        self.sinks: list[Sink] = [*default_sinks(out, tensorboard), *extra] if enabled else []

    def log(self, record: dict, *more: Sink) -> None:
        """``record`` to every sink, then to ``more`` (a ``fit``'s progress bar); nothing on the
        other ranks."""
        for sink in (*self.sinks, *more) if self.enabled else ():
            sink.log(record)

    def close(self) -> None:
        """The end of a ``fit``: every sink's ``close()`` (not ``more``'s)."""
        for sink in self.sinks:
            sink.close()
