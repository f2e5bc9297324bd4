"""``nn.Module`` token mixers and blocks over :mod:`mnemo.ops`.

:data:`MIXERS` maps a mixer name (used in model configs) to a constructor
``(d_model, **options) -> Mixer``.
"""

from functools import partial

from .attention import Attention
from .base import Mixer, MixerState, Mixing
from .registry import MIXERS, register_mixer
from .conv import ShortConvolution
from .delta import DeltaNet
from .linear_attention import GatedLinearAttention, LinearAttention
from .mlp import SwiGLU
from .norm import RMSNorm
from .rotary import RotaryEmbedding
from .ssm import Mamba, Mamba2
from .titans import NeuralMemory, TitansMAC, TitansMAG, TitansMAL

# the built-in mixers register themselves (``@register_mixer`` in each file); until every file
# carries its decorator, the remaining ones are registered here
_BUILTIN = {
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
for _name, _ctor in _BUILTIN.items():
    MIXERS.setdefault(_name, _ctor)


__all__ = [
    "MIXERS",
    "register_mixer",
    "Mixer",
    "MixerState",
    "Mixing",
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
