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
    OpSpec("gla_scalar", _gla_inputs("scalar"), _gla_call, lambda N, H, K, V: (N, H, K, V),
           grad_inputs=("q", "k", "v", "g")),
    OpSpec("gla_channel", _gla_inputs("channel"), _gla_call, lambda N, H, K, V: (N, H, K, V),
           grad_inputs=("q", "k", "v", "g"), chunk_size=32),
    OpSpec("linear_identity", _gla_inputs(None), _la_call("identity", False), _la_state(lambda K: K, False)),
    OpSpec("linear_elu_norm", _gla_inputs(None), _la_call("elu", True), _la_state(lambda K: K, True)),
    OpSpec("linear_taylor_norm", _gla_inputs(None), _la_call("taylor", True),
           _la_state(lambda K: 1 + K + K * K, True), big_dims=(1, 2, 256, 8, 32)),
]
