"""Pure-function recurrences, one module per memory. Every op returns ``(o, final_state)``.

Layout: ``q, k: [B, T, H, K]``, ``v: [B, T, H, V]``, scalar gates ``[B, T, H]``, per-channel gates
``[B, T, H, K]``, matrix state ``[B, H, K, V]``. Forms are selected with ``mode=`` and agree.

NaN/inf inputs raise :class:`NonFiniteError`; ``with finite_checks(False):`` (or
:func:`set_finite_checks`, or ``MNEMO_CHECK_FINITE=0``) turns the checks off; that variable, read at
import, takes ``0``/``false``/``off``/``no`` or ``1``/``true``/``on``/``yes`` (any case; another value
raises ``ValueError``). Inside the modules ``<op>_chunk`` is the chunk form's fast path and
``<op>_chunk_autograd`` / ``*_torch`` its fallbacks (see :mod:`mnemo.ops._common`).

The chunk forms take their large CPU tensors from a cache of buffers reused across calls (no fresh
pages, hence no page faults, after the first call of a shape): :func:`workspace_stats`,
:func:`release_workspaces` and :func:`set_workspace_limit` inspect and bound it
(``MNEMO_WORKSPACE_MB``; see :mod:`mnemo.ops._workspace`).

Backends: ``gated_delta_rule``, ``delta_rule``, ``gated_linear_attention``, ``linear_attention`` and
``ssd`` pick an implementation per call (``torch``, ``native``, ``fla``, ``mamba_ssm``; ``auto`` by
default): :func:`backends` lists what this machine can run, ``with use_backend("fla"):`` or
``MNEMO_BACKEND`` forces one (:class:`BackendError` when it cannot serve a call), and
:func:`dispatch_log` counts the choices made. See :mod:`mnemo.ops.dispatch`.
"""

from . import _workspace
from ._common import NonFiniteError, RangeWarning, decay_matrix, finite_checks, set_finite_checks
from .delta_rule import delta_rule, delta_rule_map, gated_delta_rule
from .dispatch import BackendError, BackendRow, backends, current_backend, dispatch_log, use_backend
from .feature_maps import FavorPlus, elu_plus_one, identity, relu, resolve_feature_map, taylor
from .gated_linear_attention import gated_linear_attention, gated_linear_attention_map
from .linear_attention import linear_attention, linear_attention_map
from .selective_scan import selective_scan, selective_scan_map
from .softmax_attention import KVCache, attention_mask, softmax_attention, softmax_attention_map
from .ssd import ssd, ssd_map


def workspace_stats() -> dict:
    """The chunk forms' buffer cache: held bytes, buffers (in use), hits, misses, limit (see
    :func:`mnemo.ops._workspace.stats`)."""
    return _workspace.stats()


def release_workspaces() -> int:
    """Give the chunk forms' free cached buffers back to ``malloc``; returns the bytes released."""
    return _workspace.release()


def set_workspace_limit(nbytes: int) -> None:
    """Bound the chunk forms' buffer cache to ``nbytes`` bytes (``0`` turns it off; default 1 GiB
    or ``MNEMO_WORKSPACE_MB``). Raises ``ValueError`` for a negative or non-integer ``nbytes``."""
    _workspace.set_limit(nbytes)


__all__ = [
    "NonFiniteError",
    "RangeWarning",
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
    "workspace_stats",
    "release_workspaces",
    "set_workspace_limit",
    # the backend table (mnemo.ops.dispatch)
    "backends",
    "use_backend",
    "current_backend",
    "dispatch_log",
    "BackendError",
    "BackendRow",
]
