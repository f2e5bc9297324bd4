"""What a diverged run raises: :class:`TrainingDiverged`, naming the step, the quantity that became
NaN/inf and the last good checkpoint. Raised by the training loop on every rank alike."""

from __future__ import annotations

from pathlib import Path


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm became NaN/inf; ``step`` is the step it happened at."""

    def __init__(
        self,
        step: int,
        what: str,
        value: float,
        last_checkpoint: Path | None,
        detail: str | None = None,
        precision: str = "fp32",
    ):
        self.step, self.what, self.value = step, what, value
        where = (
            f"the last good checkpoint is {last_checkpoint}"
            if last_checkpoint
            else "no checkpoint was written yet"
        )
        if detail:
            where = f"{detail}; {where}"
        super().__init__(
            f"training stopped at step {step}: the {what} became {value} ({where}); "
            + (
                "try a lower --lr, a smaller model, or --precision fp32"
                if precision == "bf16"
                else "try a lower --lr or a smaller model"
            )
        )


def _nonfinite_detail(e: Exception) -> str:
    """An op's NaN/inf report without its advice to turn the check off (which would only hide a
    diverged run): e.g. ``"an op's input A contains 0 NaN and 34 inf of 1024 values"``."""
    return "an op's input " + str(e).split(";")[0]


def _nonfinite_weights(names: list[str]) -> str:
    """Where the weights overflowed: the first three parameter names and how many more."""
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return f"NaN/inf after the optimizer step in {', '.join(names[:3])}{more}"
