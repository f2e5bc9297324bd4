"""Pure-function recurrences, one module per memory. Every op returns ``(o, final_state)``.

Layout: ``q, k: [B, T, H, K]``, ``v: [B, T, H, V]``, scalar gates ``[B, T, H]``, per-channel gates
``[B, T, H, K]``, matrix state ``[B, H, K, V]``. Forms are selected with ``mode=`` and agree.

NaN/inf inputs raise :class:`NonFiniteError`; ``with finite_checks(False):`` (or
:func:`set_finite_checks`, or ``MNEMO_CHECK_FINITE=0``) turns the checks off. Inside the modules
``<op>_chunk`` is the chunk form's fast path and ``<op>_chunk_autograd`` / ``*_torch`` its
fallbacks (see :mod:`mnemo.ops._common`).
"""

from ._common import NonFiniteError, decay_matrix, finite_checks, set_finite_checks
from .delta_rule import delta_rule, delta_rule_map, gated_delta_rule
from .feature_maps import FavorPlus, elu_plus_one, identity, relu, resolve_feature_map, taylor
from .gated_linear_attention import gated_linear_attention, gated_linear_attention_map
from .linear_attention import linear_attention, linear_attention_map
from .selective_scan import selective_scan, selective_scan_map
from .softmax_attention import KVCache, attention_mask, softmax_attention, softmax_attention_map
from .ssd import ssd, ssd_map

__all__ = [
    "NonFiniteError",
    "finite_checks",
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
    # the T x T matrix each parallel form multiplies the values by (implicit attention)
    "softmax_attention_map",
    "linear_attention_map",
    "gated_linear_attention_map",
    "delta_rule_map",
    "selective_scan_map",
    "ssd_map",
    "decay_matrix",
]
