""":class:`~mnemo.testing.OpSpec` of every recurrent op variant of mnemo under the contract.

Each spec calls the op through ``arguments(inputs) -> (args, kwargs)`` in the op's own signature, so
:func:`~mnemo.testing.claim` tests any op with the same signature against mnemo's recurrent form
(``spec.with_op(other)`` swaps the op too, but then ``other``'s own recurrent mode is the reference:
its forms are checked against each other only).
Input draws: ``q, k, v ~ N(0, 1)``; log gates ``g = logsigmoid(N(0, 1) + 1)``; the delta rules use
L2-normalised keys and ``beta = sigmoid(N(0, 1))``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops import delta_rule, gated_delta_rule, gated_linear_attention, linear_attention, selective_scan, ssd
from .contract import OpSpec


def _qkv(B, T, H, K, V, dtype, gen):
    return {
        "q": torch.randn(B, T, H, K, generator=gen, dtype=dtype),
        "k": torch.randn(B, T, H, K, generator=gen, dtype=dtype),
        "v": torch.randn(B, T, H, V, generator=gen, dtype=dtype),
    }


def _kv_state(N, H, K, V):
    return (N, H, K, V)


# --- (gated) linear attention --------------------------------------------------------------------


def _gla_inputs(gate):
    def make(B, T, H, K, V, dtype, gen):
        x = _qkv(B, T, H, K, V, dtype, gen)
        if gate == "scalar":
            x["g"] = F.logsigmoid(torch.randn(B, T, H, generator=gen, dtype=dtype) + 1.0)
        elif gate == "channel":
            x["g"] = F.logsigmoid(torch.randn(B, T, H, K, generator=gen, dtype=dtype) + 1.0)
        return x

    return make


def _gla_args(x):
    return (x["q"], x["k"], x["v"], x.get("g")), {}


def _la_args(feature_map, normalize):
    def arguments(x):
        return (x["q"], x["k"], x["v"]), {"feature_map": feature_map, "normalize": normalize}

    return arguments


def _la_state(feature_dim, normalize):
    return lambda N, H, K, V: (N, H, feature_dim(K), V + int(normalize))


SPECS = [
    OpSpec(
        "gla_nogate",
        _gla_inputs(None),
        op=gated_linear_attention,
        arguments=_gla_args,
        state_shape=_kv_state,
        note="gated_linear_attention, g=None",
    ),
    OpSpec(
        "gla_scalar",
        _gla_inputs("scalar"),
        op=gated_linear_attention,
        arguments=_gla_args,
        state_shape=_kv_state,
        grad_inputs=("q", "k", "v", "g"),
        note="gated_linear_attention, g [B, T, H]",
    ),
    OpSpec(
        "gla_channel",
        _gla_inputs("channel"),
        op=gated_linear_attention,
        arguments=_gla_args,
        state_shape=_kv_state,
        grad_inputs=("q", "k", "v", "g"),
        chunk_size=32,
        note="gated_linear_attention, g [B, T, H, K]",
    ),
    OpSpec(
        "linear_identity",
        _gla_inputs(None),
        op=linear_attention,
        arguments=_la_args("identity", False),
        state_shape=_la_state(lambda K: K, False),
        note="linear_attention, identity features",
    ),
    OpSpec(
        "linear_elu_norm",
        _gla_inputs(None),
        op=linear_attention,
        arguments=_la_args("elu", True),
        state_shape=_la_state(lambda K: K, True),
        note="linear_attention, elu+1 features, normalised",
    ),
    OpSpec(
        "linear_taylor_norm",
        _gla_inputs(None),
        op=linear_attention,
        arguments=_la_args("taylor", True),
        state_shape=_la_state(lambda K: 1 + K + K * K, True),
        big_dims=(1, 2, 256, 8, 32),
        note="linear_attention, 2nd-order Taylor features, normalised",
    ),
]


# --- delta rule / gated delta rule ---------------------------------------------------------------


def _delta_inputs(gated):
    """L2-normalised keys, ``beta = sigmoid(randn)``, ``g = logsigmoid(randn + 1)``."""

    def make(B, T, H, K, V, dtype, gen):
        x = _qkv(B, T, H, K, V, dtype, gen)
        x["k"] = F.normalize(x["k"], dim=-1)
        x["beta"] = torch.randn(B, T, H, generator=gen, dtype=dtype).sigmoid()
        if gated:
            x["g"] = F.logsigmoid(torch.randn(B, T, H, generator=gen, dtype=dtype) + 1.0)
        return x

    return make


SPECS += [
    OpSpec(
        "delta_rule",
        _delta_inputs(False),
        op=delta_rule,
        arguments=lambda x: ((x["q"], x["k"], x["v"], x["beta"]), {}),
        state_shape=_kv_state,
        grad_inputs=("q", "k", "v", "beta"),
        note="delta_rule",
    ),
    OpSpec(
        "gated_delta_rule",
        _delta_inputs(True),
        op=gated_delta_rule,
        arguments=lambda x: ((x["q"], x["k"], x["v"], x["g"], x["beta"]), {}),
        state_shape=_kv_state,
        grad_inputs=("q", "k", "v", "beta", "g"),
        note="gated_delta_rule",
    ),
]


# --- selective scan (Mamba / S6) and SSD (Mamba-2) -----------------------------------------------
# The contract's dims (B, H, K, V) map to selective_scan as D = H * V channels with N = K states
# (groups of B/C: G = H, so each group has V channels), and to ssd as H heads, N = K, P = V.
# Parameters that are not per-token (A, D, delta_bias / dt_bias) are fixed functions of the shape
# (``_fixed``, a seed of its own), drawn with the inputs as ``OpSpec.static`` entries so that the
# gradient checks cover them too.


def _fixed(shape, seed, dtype, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype) * scale


def _ss_inputs(grouped, full):
    def make(B, T, H, K, V, dtype, gen):
        D = H * V
        bc = (B, T, H, K) if grouped else (B, T, K)
        delta = torch.randn(B, T, D, generator=gen, dtype=dtype) - 1.0
        x = {
            "u": torch.randn(B, T, D, generator=gen, dtype=dtype),
            "delta": delta if full else F.softplus(delta),
            "B": torch.randn(bc, generator=gen, dtype=dtype),
            "C": torch.randn(bc, generator=gen, dtype=dtype),
        }
        if full:
            x["z"] = torch.randn(B, T, D, generator=gen, dtype=dtype)
        x["A"] = -_fixed((D, K), 3, dtype, 0.5).exp()
        if full:
            x["D"] = _fixed(D, 4, dtype)
            x["delta_bias"] = _fixed(D, 5, dtype, 0.5)
        return x

    return make


def _ss_args(full):
    def arguments(x):
        args = (x["u"], x["delta"], x["A"], x["B"], x["C"])
        if not full:
            return args, {}
        return args, dict(D=x["D"], z=x["z"], delta_bias=x["delta_bias"], delta_softplus=True)

    return arguments


def _ssd_inputs(groups):
    def make(B, T, H, K, V, dtype, gen):
        bc = (B, T, K) if groups is None else (B, T, groups(H), K)
        return {
            "x": torch.randn(B, T, H, V, generator=gen, dtype=dtype),
            "dt": torch.randn(B, T, H, generator=gen, dtype=dtype) - 1.0,
            "B": torch.randn(bc, generator=gen, dtype=dtype),
            "C": torch.randn(bc, generator=gen, dtype=dtype),
            "A": -_fixed(H, 6, dtype, 0.5).exp(),
            "D": _fixed(H, 7, dtype),
            "dt_bias": _fixed(H, 8, dtype, 0.5),
        }

    return make


def _ssd_args(x):
    kwargs = dict(D=x["D"], dt_bias=x["dt_bias"], dt_softplus=True)
    return (x["x"], x["dt"], x["A"], x["B"], x["C"]), kwargs


def _ss_state(N, H, K, V):
    return (N, H * V, K)


SPECS += [
    OpSpec(
        "selective_scan",
        _ss_inputs(False, False),
        op=selective_scan,
        arguments=_ss_args(False),
        state_shape=_ss_state,
        grad_inputs=("u", "delta", "B", "C", "A"),
        static=("A",),
        big_dims=(1, 2, 256, 16, 16),
        note="selective_scan, one B/C group",
    ),
    OpSpec(
        "selective_scan_grouped_gated",
        _ss_inputs(True, True),
        op=selective_scan,
        arguments=_ss_args(True),
        state_shape=_ss_state,
        grad_inputs=("u", "delta", "B", "C", "z", "A", "D", "delta_bias"),
        static=("A", "D", "delta_bias"),
        big_dims=(1, 2, 256, 16, 16),
        note="selective_scan, grouped B/C, D, z gate, delta bias + softplus",
    ),
    OpSpec(
        "ssd",
        _ssd_inputs(None),
        op=ssd,
        arguments=_ssd_args,
        state_shape=_kv_state,
        grad_inputs=("x", "dt", "B", "C", "A", "D", "dt_bias"),
        static=("A", "D", "dt_bias"),
        note="ssd, one B/C group",
    ),
    OpSpec(
        "ssd_grouped",
        _ssd_inputs(lambda H: max(H // 2, 1)),
        op=ssd,
        arguments=_ssd_args,
        state_shape=_kv_state,
        grad_inputs=("x", "dt", "B", "C", "A", "D", "dt_bias"),
        static=("A", "D", "dt_bias"),
        dims=(2, 4, 8, 6),
        big_dims=(1, 4, 256, 32, 32),
        note="ssd, grouped B/C",
    ),
]

#: Aliases: an op name of :mod:`mnemo.ops` -> the spec of its most general variant.
ALIASES = {
    "gated_linear_attention": "gla_channel",
    "linear_attention": "linear_identity",
}


def spec_names() -> list[str]:
    """The names of :data:`SPECS` (and of :data:`ALIASES`)."""
    return [s.name for s in SPECS] + list(ALIASES)


def get_spec(name: str) -> OpSpec:
    """The spec called ``name`` (a name of :data:`SPECS` or an alias such as
    ``"gated_linear_attention"``). Raises ``KeyError`` naming the known specs."""
    name = ALIASES.get(name, name)
    for s in SPECS:
        if s.name == name:
            return s
    raise KeyError(f"no contract spec {name!r}; known: {', '.join(spec_names())}")
