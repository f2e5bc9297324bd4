"""OpSpecs of the ops under the equivalence contract (one line per op variant)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mnemo.ops import gated_linear_attention, linear_attention

from .contract import OpSpec


def _qkv(B, T, H, K, V, dtype, gen):
    return {
        "q": torch.randn(B, T, H, K, generator=gen, dtype=dtype),
        "k": torch.randn(B, T, H, K, generator=gen, dtype=dtype),
        "v": torch.randn(B, T, H, V, generator=gen, dtype=dtype),
    }


def _gla_inputs(gate):
    def make(B, T, H, K, V, dtype, gen):
        x = _qkv(B, T, H, K, V, dtype, gen)
        if gate == "scalar":
            x["g"] = F.logsigmoid(torch.randn(B, T, H, generator=gen, dtype=dtype) + 1.0)
        elif gate == "channel":
            x["g"] = F.logsigmoid(torch.randn(B, T, H, K, generator=gen, dtype=dtype) + 1.0)
        return x

    return make


def _gla_call(x, **kw):
    return gated_linear_attention(x["q"], x["k"], x["v"], x.get("g"), **kw)


def _la_call(feature_map, normalize):
    def call(x, **kw):
        return linear_attention(x["q"], x["k"], x["v"], feature_map=feature_map, normalize=normalize, **kw)

    return call


def _la_state(feature_dim, normalize):
    return lambda N, H, K, V: (N, H, feature_dim(K), V + int(normalize))


SPECS = [
    OpSpec("gla_nogate", _gla_inputs(None), _gla_call, lambda N, H, K, V: (N, H, K, V)),
    OpSpec(
        "gla_scalar",
        _gla_inputs("scalar"),
        _gla_call,
        lambda N, H, K, V: (N, H, K, V),
        grad_inputs=("q", "k", "v", "g"),
    ),
    OpSpec(
        "gla_channel",
        _gla_inputs("channel"),
        _gla_call,
        lambda N, H, K, V: (N, H, K, V),
        grad_inputs=("q", "k", "v", "g"),
        chunk_size=32,
    ),
    OpSpec("linear_identity", _gla_inputs(None), _la_call("identity", False), _la_state(lambda K: K, False)),
    OpSpec("linear_elu_norm", _gla_inputs(None), _la_call("elu", True), _la_state(lambda K: K, True)),
    OpSpec(
        "linear_taylor_norm",
        _gla_inputs(None),
        _la_call("taylor", True),
        _la_state(lambda K: 1 + K + K * K, True),
        big_dims=(1, 2, 256, 8, 32),
    ),
]


# --- delta rule / gated delta rule ------------------------------------------------------------

from mnemo.ops import delta_rule, gated_delta_rule  # noqa: E402


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


def _delta_call(x, **kw):
    return delta_rule(x["q"], x["k"], x["v"], x["beta"], **kw)


def _gated_delta_call(x, **kw):
    return gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)


SPECS += [
    OpSpec(
        "delta_rule",
        _delta_inputs(False),
        _delta_call,
        lambda N, H, K, V: (N, H, K, V),
        grad_inputs=("q", "k", "v", "beta"),
    ),
    OpSpec(
        "gated_delta_rule",
        _delta_inputs(True),
        _gated_delta_call,
        lambda N, H, K, V: (N, H, K, V),
        grad_inputs=("q", "k", "v", "beta", "g"),
    ),
]


# --- selective scan (Mamba / S6) and SSD (Mamba-2) ----------------------------------------------
# The contract's dims (B, H, K, V) map to selective_scan as D = H * V channels with N = K states
# (groups of B/C: G = H, so each group has V channels), and to ssd as H heads, N = K, P = V.
# Parameters that are not per-token (A, D, delta_bias / dt_bias) are fixed functions of the shape.

from mnemo.ops import selective_scan, ssd  # noqa: E402


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
        return x

    return make


def _ss_call(full):
    def call(x, **kw):
        u = x["u"]
        D, N = u.shape[-1], x["B"].shape[-1]
        A = -_fixed((D, N), 3, u.dtype, 0.5).exp()
        if not full:
            return selective_scan(u, x["delta"], A, x["B"], x["C"], **kw)
        return selective_scan(
            u,
            x["delta"],
            A,
            x["B"],
            x["C"],
            D=_fixed(D, 4, u.dtype),
            z=x["z"],
            delta_bias=_fixed(D, 5, u.dtype, 0.5),
            delta_softplus=True,
            **kw,
        )

    return call


def _ssd_inputs(groups):
    def make(B, T, H, K, V, dtype, gen):
        bc = (B, T, K) if groups is None else (B, T, groups(H), K)
        return {
            "x": torch.randn(B, T, H, V, generator=gen, dtype=dtype),
            "dt": torch.randn(B, T, H, generator=gen, dtype=dtype) - 1.0,
            "B": torch.randn(bc, generator=gen, dtype=dtype),
            "C": torch.randn(bc, generator=gen, dtype=dtype),
        }

    return make


def _ssd_call(x, **kw):
    X = x["x"]
    H = X.shape[2]
    return ssd(
        X,
        x["dt"],
        -_fixed(H, 6, X.dtype, 0.5).exp(),
        x["B"],
        x["C"],
        D=_fixed(H, 7, X.dtype),
        dt_bias=_fixed(H, 8, X.dtype, 0.5),
        dt_softplus=True,
        **kw,
    )


def _ss_state(N, H, K, V):
    return (N, H * V, K)


SPECS += [
    OpSpec(
        "selective_scan",
        _ss_inputs(False, False),
        _ss_call(False),
        _ss_state,
        grad_inputs=("u", "delta", "B", "C"),
        big_dims=(1, 2, 256, 16, 16),
    ),
    OpSpec(
        "selective_scan_grouped_gated",
        _ss_inputs(True, True),
        _ss_call(True),
        _ss_state,
        grad_inputs=("u", "delta", "B", "C", "z"),
        big_dims=(1, 2, 256, 16, 16),
    ),
    OpSpec(
        "ssd",
        _ssd_inputs(None),
        _ssd_call,
        lambda N, H, K, V: (N, H, K, V),
        grad_inputs=("x", "dt", "B", "C"),
    ),
    OpSpec(
        "ssd_grouped",
        _ssd_inputs(lambda H: max(H // 2, 1)),
        _ssd_call,
        lambda N, H, K, V: (N, H, K, V),
        grad_inputs=("x", "dt", "B", "C"),
        dims=(2, 4, 8, 6),
        big_dims=(1, 4, 256, 32, 32),
    ),
]
