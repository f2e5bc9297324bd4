"""Training: the loop, configs, checkpoints, optimizers (M3)."""

from .checkpoint import CorruptCheckpointError, ForeignCheckpointError, resolve_checkpoint, verify_checkpoint
from .config import TrainConfig, load_config_file
from .m3 import M3
from .trainer import Trainer, TrainingDiverged, generate_text, resume_config

__all__ = [
    "CorruptCheckpointError",
    "ForeignCheckpointError",
    "M3",
    "Trainer",
    "TrainConfig",
    "TrainingDiverged",
    "generate_text",
    "load_config_file",
    "resolve_checkpoint",
    "resume_config",
    "verify_checkpoint",
]
