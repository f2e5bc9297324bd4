"""``nn.Module`` token mixers and blocks over :mod:`mnemo.ops`.

:data:`MIXERS` maps a mixer name (used in model configs) to a constructor
``(d_model, **options) -> Mixer``. Each mixer registers itself in its own file
(``@register_mixer``); the imports below are what registers the built-in ones.
"""

from .attention import Attention
from .base import Mixer, Mixing
from .cms import CMSLevel, ContinuumMemory, Level
from .conv import ShortConvolution
from .delta import DeltaNet, KimiDeltaAttention
from .linear_attention import GatedLinearAttention, LinearAttention
from .mla import MultiHeadLatentAttention
from .mlp import SwiGLU
from .moe import MoE
from .norm import RMSNorm
from .registry import MIXERS, register_mixer
from .rotary import RotaryEmbedding
from .self_modifying import SelfModifyingTitans
from .self_modifying_projections import SelfModifyingProjections
from .ssm import Mamba, Mamba2
from .titans import NeuralMemory
from .titans_architectures import TitansMAC, TitansMAG, TitansMAL

__all__ = [
    "MIXERS",
    "register_mixer",
    "Mixer",
    "Mixing",
    "Attention",
    "MultiHeadLatentAttention",
    "LinearAttention",
    "GatedLinearAttention",
    "DeltaNet",
    "KimiDeltaAttention",
    "Mamba",
    "Mamba2",
    "NeuralMemory",
    "TitansMAC",
    "TitansMAG",
    "TitansMAL",
    "SelfModifyingTitans",
    "SelfModifyingProjections",
    "ContinuumMemory",
    "CMSLevel",
    "Level",
    "ShortConvolution",
    "SwiGLU",
    "MoE",
    "RMSNorm",
    "RotaryEmbedding",
]
