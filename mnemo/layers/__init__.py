"""``nn.Module`` token mixers and blocks over :mod:`mnemo.ops`.

:data:`MIXERS` maps a mixer name (used in model configs) to a constructor
``(d_model, **options) -> Mixer``.
"""

from functools import partial

from .attention import Attention
from .base import Mixer, MixerState
from .conv import ShortConvolution
from .delta import DeltaNet
from .linear_attention import GatedLinearAttention, LinearAttention
from .mlp import SwiGLU
from .norm import RMSNorm
from .rotary import RotaryEmbedding
from .ssm import Mamba, Mamba2
from .titans import NeuralMemory, TitansMAC, TitansMAG, TitansMAL

MIXERS = {
    "attention": Attention,
    "linear_attention": LinearAttention,
    "retnet": partial(GatedLinearAttention, gate="retnet", expand_k=1.0),
    "gla": partial(GatedLinearAttention, gate="gla"),
    "gated_linear_attention": GatedLinearAttention,
    "deltanet": DeltaNet,
    "gated_deltanet": partial(DeltaNet, gated=True),
    "mamba": Mamba,
    "mamba2": Mamba2,
    "neural_memory": NeuralMemory,
    "titans_mac": TitansMAC,
    "titans_mag": TitansMAG,
    "titans_mal": TitansMAL,
}


def register_mixer(name: str, constructor) -> None:
    """Add a mixer to :data:`MIXERS` (used by modules above the layers, e.g. ``mnemo.nested``)."""
    if name in MIXERS and MIXERS[name] is not constructor:
        raise ValueError(f"mixer {name!r} is already registered")
    MIXERS[name] = constructor


__all__ = [
    "MIXERS",
    "register_mixer",
    "Mixer",
    "MixerState",
    "Attention",
    "LinearAttention",
    "GatedLinearAttention",
    "DeltaNet",
    "Mamba",
    "Mamba2",
    "NeuralMemory",
    "TitansMAC",
    "TitansMAG",
    "TitansMAL",
    "ShortConvolution",
    "SwiGLU",
    "RMSNorm",
    "RotaryEmbedding",
]
