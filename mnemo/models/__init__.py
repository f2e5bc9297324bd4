"""Language models composed from mixers, and the registry of named configurations."""

from .config import ModelConfig
from .lm import LanguageModel
from .registry import MODELS, build_config, model_names, register_model

__all__ = ["ModelConfig", "LanguageModel", "MODELS", "build_config", "model_names", "register_model"]
