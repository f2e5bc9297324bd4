"""Training configuration (a dataclass; YAML/JSON files and CLI flags fill it)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


@dataclass
class TrainConfig:
    """Everything that defines a training run (saved as ``train_config.json`` in checkpoints).

    Attributes:
        model: registered model name (``mnemo models``). model_overrides: ``ModelConfig`` fields
            to replace (e.g. ``{"d_model": 256, "n_layers": 6}``).
        data: ``"tinyshakespeare"`` (bundled) or a path to a UTF-8 text file.
        tokenizer: ``"char"`` (vocabulary = the characters of the file) or ``"byte"``.
        seq_len, batch_size: training window length and windows per step.
        steps: optimizer steps. lr: peak learning rate; warmup_steps linear warm-up, then cosine
            decay to ``lr · min_lr_ratio`` at ``steps``.
        weight_decay, beta1, beta2: AdamW (decay on matrices only). grad_clip: max global grad
            norm (``0`` disables).
        eval_interval: evaluate (and log to ``metrics.jsonl``) every this many steps and at the
            end; eval_batches: validation batches per evaluation.
        checkpoint_interval: save every this many steps (default: ``eval_interval``) and at the end.
        seed: seeds the weights and the batch order. device: ``"cpu"`` or ``"cuda"``.
        precision: ``"fp32"`` or ``"bf16"`` (autocast; states still accumulate in fp32).
        sample_tokens, sample_prompt, sample_temperature: the text sample printed at the end.
        tensorboard: also write TensorBoard event files to ``OUT/tb`` (needs ``tensorboard``).
    """

    model: str = "transformer"
    model_overrides: dict[str, Any] = field(default_factory=dict)
    data: str = "tinyshakespeare"
    tokenizer: str = "char"
    seq_len: int = 128
    batch_size: int = 32
    steps: int = 1000
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    eval_interval: int = 100
    eval_batches: int = 8
    checkpoint_interval: int | None = None
    seed: int = 0
    device: str = "cpu"
    precision: str = "fp32"
    sample_tokens: int = 400
    sample_prompt: str = "ROMEO:"
    sample_temperature: float = 0.8
    tensorboard: bool = False

    def validate(self) -> TrainConfig:
        """Raise ``ValueError`` naming the offending field; return self."""

        def bad(name, expected):
            raise ValueError(f"TrainConfig.{name}: expected {expected}, got {getattr(self, name)!r}")

        for name in ("seq_len", "batch_size", "steps", "eval_interval", "eval_batches"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                bad(name, "a positive int")
        for name in ("warmup_steps", "sample_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                bad(name, "a non-negative int")
        if self.checkpoint_interval is not None and (
            not isinstance(self.checkpoint_interval, int) or self.checkpoint_interval < 1
        ):
            bad("checkpoint_interval", "None or a positive int")
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
        if self.tokenizer not in ("char", "byte"):
            bad("tokenizer", "'char' or 'byte'")
        if self.precision not in ("fp32", "bf16"):
            bad("precision", "'fp32' or 'bf16'")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            bad("device", "'cpu' or 'cuda[:N]'")
        if not isinstance(self.model_overrides, dict):
            bad("model_overrides", "a mapping of ModelConfig fields")
        if self.sample_temperature < 0:
            bad("sample_temperature", "a number >= 0")
        return self

    @property
    def ckpt_every(self) -> int:
        return self.checkpoint_interval or self.eval_interval

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown TrainConfig field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**d).validate()


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON mapping of :class:`TrainConfig` fields (raises naming the file)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"config file not found: {str(path)!r}")
    try:
        text = p.read_text()
        d = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ValueError(f"cannot parse config file {str(path)!r}: {e}") from e
    if d is None:
        return {}
    if not isinstance(d, dict):
        raise ValueError(f"config file {str(path)!r} must hold a mapping of TrainConfig fields")
    return d
