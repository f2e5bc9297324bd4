"""Pure-function recurrences, one module per memory. Every op returns ``(o, final_state)``.

Layout: ``q, k: [B, T, H, K]``, ``v: [B, T, H, V]``, scalar gates ``[B, T, H]``, per-channel gates
``[B, T, H, K]``, matrix state ``[B, H, K, V]``. Forms are selected with ``mode=`` and agree.
"""

from ._common import NonFiniteError, set_finite_checks
from .delta_rule import delta_rule, gated_delta_rule
from .feature_maps import FavorPlus, elu_plus_one, identity, relu, resolve_feature_map, taylor
from .gated_linear_attention import gated_linear_attention
from .linear_attention import linear_attention
from .selective_scan import selective_scan
from .softmax_attention import KVCache, attention_mask, softmax_attention
from .ssd import ssd

__all__ = [
    "NonFiniteError",
    "set_finite_checks",
    "softmax_attention",
    "KVCache",
    "attention_mask",
    "linear_attention",
    "gated_linear_attention",
    "delta_rule",
    "gated_delta_rule",
    "selective_scan",
    "ssd",
    "FavorPlus",
    "identity",
    "elu_plus_one",
    "relu",
    "taylor",
    "resolve_feature_map",
]
