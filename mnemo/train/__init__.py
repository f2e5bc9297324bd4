"""Training: the loop, configs, checkpoints."""

from .checkpoint import resolve_checkpoint
from .config import TrainConfig, load_config_file
from .trainer import Trainer, TrainingDiverged, generate_text

__all__ = [
    "Trainer",
    "TrainConfig",
    "TrainingDiverged",
    "generate_text",
    "load_config_file",
    "resolve_checkpoint",
]
