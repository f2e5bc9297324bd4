"""Third-party reference implementations under the contract, compared with mnemo's references.

``third_party_specs("fla")`` wraps the pure-PyTorch reference functions of fla-core
(``fla/ops/<op>/naive.py``, loaded by path: ``import fla.ops`` needs triton) as
:class:`~mnemo.testing.OpSpec` whose reference is mnemo's recurrent form of the recurrence they
implement. Each adapter maps the conventions:

* layout — fla's ``naive`` functions take ``[B, T, H, ...]`` except ``delta_rule_*`` and
  ``naive_retention``, which are head-first ``[B, H, T, ...]`` (transposed here);
* scale — fla's default ``K ** -0.5`` is mnemo's default; fla's ``scale`` multiplies ``q``
  (for normalised linear attention mnemo applies it *before* the feature map, so the adapter passes
  ``φ(scale · q)``, ``φ(k)`` with ``scale=1``);
* gates — log space in both (``exp(g)`` retained per token); argument order differs
  (``naive_recurrent_gated_delta_rule(q, k, v, beta, g)`` vs ``naive_chunk_…(q, k, v, g, beta)``);
  KDA's per-channel gate ``[B, T, H, K]`` is drawn as such and passed as given (mnemo's
  ``gated_delta_rule`` takes it too); retention's fixed decays ``1 − 2^(−5−h)`` are drawn as ``g``;
* states — ``[B, H, K, V]`` in both; normalised linear attention's ``(S, z)`` pair becomes
  mnemo's ``[B, H, K, V + 1]`` (``z`` the last column), ``z`` given as ``[B, 1, H, K]``;
* lengths — chunked forms that need ``T`` a multiple of the chunk are padded with no-op tokens
  (``k = v = q = 0``, ``β = 0``, ``g = 0``) and the output cut back.

Most of these functions compute in float32 whatever the input dtype, so their float64 checks use the
float32 tolerance ``2e-5`` (``f64_tol``); the ones that compute in the input dtype keep ``1e-10``.
Only checks that apply run: no ``cu_seqlens`` (varlen), no ``T = 0``; splits and decoding only for
functions that take an initial state and return a final state; no gradcheck (the reference is
mnemo's, checked by mnemo's own contract).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import pathlib
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .compare import F32_TOL, F64_TOL
from .contract import OpSpec
from .specs import get_spec


class ThirdPartyUnavailable(ImportError):
    """The third-party package is not installed or lacks what is needed (one-line message)."""


KNOWN = ("fla",)


def third_party_specs(package: str = "fla") -> list[OpSpec]:
    """The :class:`~mnemo.testing.OpSpec` of ``package``'s reference functions (``"fla"``:
    fla-core's ``naive`` functions). Raises :class:`ThirdPartyUnavailable` when the package is
    missing and ``ValueError`` for an unknown package."""
    _known(package)
    return _fla_specs()


def _known(package: str) -> None:
    if package not in KNOWN:
        raise ValueError(f"unknown third-party package {package!r}; known: {', '.join(KNOWN)}")


def available(package: str = "fla") -> bool:
    """Whether ``package`` can be checked here (installed, with its reference files). Raises
    ``ValueError`` for an unknown package."""
    _known(package)
    try:
        _fla_root()
    except ThirdPartyUnavailable:
        return False
    return True


def version(package: str = "fla") -> str:
    """The installed version of ``package`` (``"unknown version"`` if not installed). Raises
    ``ValueError`` for an unknown package."""
    _known(package)
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as _v

    try:
        return _v("fla-core")
    except PackageNotFoundError:
        return "unknown version"


# --- fla-core ------------------------------------------------------------------------------------


def _fla_root() -> pathlib.Path:
    try:
        spec = importlib.util.find_spec("fla")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ThirdPartyUnavailable(
            "fla-core is not installed (pip install --no-deps fla-core); no third-party checks"
        )
    root = pathlib.Path(list(spec.submodule_search_locations)[0]) / "ops"
    if not (root / "gated_delta_rule" / "naive.py").is_file():
        raise ThirdPartyUnavailable(f"fla is installed but has no naive reference files under {root}")
    return root


@functools.cache
def fla_naive(op: str):
    """fla-core's ``fla/ops/<op>/naive.py`` as a module, loaded by path (``import fla.ops`` needs
    triton; these files need only torch and einops). Raises :class:`ThirdPartyUnavailable`."""
    path = _fla_root() / op / "naive.py"
    if not path.is_file():
        raise ThirdPartyUnavailable(f"fla has no {path}")
    spec = importlib.util.spec_from_file_location(f"_mnemo_fla_naive_{op}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _fn(op: str, name: str) -> Callable:
    mod = fla_naive(op)
    if not hasattr(mod, name):
        raise ThirdPartyUnavailable(f"fla/ops/{op}/naive.py has no {name}")
    return getattr(mod, name)


def _no_varlen(cu_seqlens):
    if cu_seqlens is not None:
        raise NotImplementedError("fla's naive functions take no cu_seqlens")


def _pad_time(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """Pad dim 1 (time) with zeros to a multiple of ``multiple``."""
    T = x.shape[1]
    pad = (-T) % multiple
    if not pad:
        return x
    return torch.cat([x, x.new_zeros(x.shape[0], pad, *x.shape[2:])], 1)


def _hf(x: torch.Tensor) -> torch.Tensor:
    """``[B, T, H, ...] <-> [B, H, T, ...]``."""
    return x.transpose(1, 2)


def _f32(s):
    return None if s is None else s.float()


# Each adapter: (inputs, *, mode, initial_state, output_final_state, cu_seqlens, chunk_size) -> (o, S)


def _gla_recurrent(x, *, initial_state=None, cu_seqlens=None, **_):
    _no_varlen(cu_seqlens)
    f = _fn("gla", "naive_recurrent_gla")
    return f(x["q"], x["k"], x["v"], x["g"], initial_state=initial_state, output_final_state=True)


def _simple_gla_recurrent(x, *, initial_state=None, cu_seqlens=None, **_):
    _no_varlen(cu_seqlens)
    f = _fn("simple_gla", "naive_recurrent_simple_gla")
    return f(x["q"], x["k"], x["v"], x["g"], initial_state=initial_state, output_final_state=True)


def _simple_gla_chunk(x, *, initial_state=None, cu_seqlens=None, chunk_size=64, **_):
    _no_varlen(cu_seqlens)
    f = _fn("simple_gla", "naive_chunk_simple_gla")
    # it multiplies its float32 q by the state as given: pass the state in float32
    return f(
        x["q"],
        x["k"],
        x["v"],
        x["g"],
        initial_state=_f32(initial_state),
        output_final_state=True,
        chunk_size=chunk_size,
    )


def _simple_gla_parallel(x, *, cu_seqlens=None, **_):
    _no_varlen(cu_seqlens)
    o, _A = _fn("simple_gla", "naive_parallel_simple_gla")(x["q"], x["k"], x["v"], x["g"])
    return o, None


def _delta_recurrent(x, *, initial_state=None, cu_seqlens=None, **_):
    _no_varlen(cu_seqlens)
    f = _fn("delta_rule", "delta_rule_recurrence")
    o, S = f(
        _hf(x["q"]),
        _hf(x["k"]),
        _hf(x["v"]),
        _hf(x["beta"]),
        initial_state=initial_state,
        output_final_state=True,
    )
    return _hf(o), S


def _delta_chunkwise(x, *, cu_seqlens=None, chunk_size=32, **_):
    _no_varlen(cu_seqlens)
    T = x["q"].shape[1]
    q, k, v, beta = (_hf(_pad_time(x[n], chunk_size)) for n in ("q", "k", "v", "beta"))
    o, S = _fn("delta_rule", "delta_rule_chunkwise")(q, k, v, beta, chunk_size=chunk_size)
    return _hf(o)[:, :T], S


def _delta_parallel(x, *, cu_seqlens=None, **_):
    _no_varlen(cu_seqlens)
    T = x["q"].shape[1]
    q, k, v, beta = (_hf(_pad_time(x[n], 128)) for n in ("q", "k", "v", "beta"))  # BM = 128
    o, _A = _fn("delta_rule", "delta_rule_parallel")(q, k, v, beta)
    return _hf(o)[:, :T], None


def _gdr_recurrent(x, *, initial_state=None, cu_seqlens=None, **_):
    _no_varlen(cu_seqlens)
    f = _fn("gated_delta_rule", "naive_recurrent_gated_delta_rule")
    # note the order: beta before g
    return f(x["q"], x["k"], x["v"], x["beta"], x["g"], initial_state=initial_state, output_final_state=True)


def _gdr_chunk(x, *, initial_state=None, cu_seqlens=None, chunk_size=64, **_):
    _no_varlen(cu_seqlens)
    f = _fn("gated_delta_rule", "naive_chunk_gated_delta_rule")
    return f(
        x["q"],
        x["k"],
        x["v"],
        x["g"],
        x["beta"],
        chunk_size=chunk_size,
        initial_state=initial_state,
        output_final_state=True,
    )


def _kda_inputs(make):
    """mnemo's gated-delta-rule draw with ``g`` replaced by per-channel log gates
    ``logsigmoid(N(0, 1) + 1)`` of shape ``[B, T, H, K]`` (KDA's)."""

    def kda_make(B, T, H, K, V, dtype, gen):
        x = make(B, T, H, K, V, dtype, gen)
        x["g"] = F.logsigmoid(torch.randn(B, T, H, K, generator=gen, dtype=dtype) + 1.0)
        return x

    return kda_make


def _kda_gate(x):
    g = x["g"]
    return g if g.ndim == 4 else g.unsqueeze(-1).expand(*x["k"].shape)


def _kda_recurrent(x, *, initial_state=None, cu_seqlens=None, **_):
    _no_varlen(cu_seqlens)
    f = _fn("kda", "naive_recurrent_kda")
    return f(
        x["q"], x["k"], x["v"], _kda_gate(x), x["beta"], initial_state=initial_state, output_final_state=True
    )


def _kda_chunk(x, *, initial_state=None, cu_seqlens=None, chunk_size=64, **_):
    _no_varlen(cu_seqlens)
    T = x["q"].shape[1]
    q, k, v, g, beta = (_pad_time(t, chunk_size) for t in (x["q"], x["k"], x["v"], _kda_gate(x), x["beta"]))
    f = _fn("kda", "naive_chunk_kda")
    o, S = f(q, k, v, g, beta, initial_state=initial_state, output_final_state=True, chunk_size=chunk_size)
    return o[:, :T], S


def _linear_recurrent(x, *, initial_state=None, cu_seqlens=None, **_):
    _no_varlen(cu_seqlens)
    f = _fn("linear_attn", "naive_recurrent_linear_attn")
    # its state starts as float32 zeros plus the given state: pass the state in float32
    return f(x["q"], x["k"], x["v"], initial_state=_f32(initial_state), output_final_state=True)


def _linear_elu_norm_recurrent(x, *, initial_state=None, cu_seqlens=None, **_):
    _no_varlen(cu_seqlens)
    f = _fn("linear_attn", "naive_recurrent_linear_attn")
    q, k, v = x["q"], x["k"], x["v"]
    V = v.shape[-1]
    fq = F.elu(q * q.shape[-1] ** -0.5) + 1.0  # mnemo scales q before the feature map
    fk = F.elu(k) + 1.0
    init = None
    if initial_state is not None:  # [B, H, K, V + 1] -> (S [B, H, K, V], z [B, 1, H, K])
        init = (initial_state[..., :V].float(), initial_state[..., V].unsqueeze(1).float())
    o, (S, z) = f(fq, fk, v, scale=1.0, initial_state=init, output_final_state=True, normalize=True)
    return o, torch.cat([S, z.squeeze(1).unsqueeze(-1)], -1)


def _linear_chunk(x, *, cu_seqlens=None, **_):
    _no_varlen(cu_seqlens)
    T = x["q"].shape[1]
    q, k, v = (_pad_time(x[n], 64) for n in ("q", "k", "v"))  # its chunk is fixed at 64
    o = _fn("linear_attn", "naive_chunk_linear_attn")(q, k, v)
    return o[:, :T], None


def _retention_inputs(make):
    """mnemo's scalar-gate draw with ``g`` replaced by RetNet's decays ``log(1 − 2^(−5−h))``."""

    def retention_make(B, T, H, K, V, dtype, gen):
        x = make(B, T, H, K, V, dtype, gen)
        gamma = 1 - 2.0 ** (-5.0 - torch.arange(H, dtype=torch.float64))
        x["g"] = gamma.log().to(dtype).expand(B, T, H).contiguous()
        return x

    return retention_make


def _retention(x, *, cu_seqlens=None, **_):
    _no_varlen(cu_seqlens)
    o = _fn("retention", "naive_retention")(_hf(x["q"]), _hf(x["k"]), _hf(x["v"]))
    return _hf(o), None


_STATEFUL = frozenset({"initial_state", "final_state", "grad"})
_FINAL_ONLY = frozenset({"final_state", "grad"})
_STATELESS = frozenset({"grad"})

# (fla op dir, function, adapter, claims, supports, computes in float32, extra OpSpec fields)
_FLA = [
    ("gla", "naive_recurrent_gla", _gla_recurrent, "gla_channel", _STATEFUL, True, {}),
    ("simple_gla", "naive_recurrent_simple_gla", _simple_gla_recurrent, "gla_scalar", _STATEFUL, True, {}),
    ("simple_gla", "naive_chunk_simple_gla", _simple_gla_chunk, "gla_scalar", _STATEFUL, True, {}),
    ("simple_gla", "naive_parallel_simple_gla", _simple_gla_parallel, "gla_scalar", _STATELESS, True, {}),
    (
        "retention",
        "naive_retention",
        _retention,
        "gla_scalar",
        _STATELESS,
        True,
        {"grad_inputs": ("q", "k", "v")},
    ),
    ("linear_attn", "naive_recurrent_linear_attn", _linear_recurrent, "linear_identity", _STATEFUL, True, {}),
    (
        "linear_attn",
        "naive_recurrent_linear_attn",
        _linear_elu_norm_recurrent,
        "linear_elu_norm",
        _STATEFUL,
        True,
        {},
    ),
    ("linear_attn", "naive_chunk_linear_attn", _linear_chunk, "linear_identity", _STATELESS, False, {}),
    ("delta_rule", "delta_rule_recurrence", _delta_recurrent, "delta_rule", _STATEFUL, True, {}),
    ("delta_rule", "delta_rule_chunkwise", _delta_chunkwise, "delta_rule", _FINAL_ONLY, False, {}),
    ("delta_rule", "delta_rule_parallel", _delta_parallel, "delta_rule", _STATELESS, False, {}),
    (
        "gated_delta_rule",
        "naive_recurrent_gated_delta_rule",
        _gdr_recurrent,
        "gated_delta_rule",
        _STATEFUL,
        True,
        {},
    ),
    ("gated_delta_rule", "naive_chunk_gated_delta_rule", _gdr_chunk, "gated_delta_rule", _STATEFUL, True, {}),
    ("kda", "naive_recurrent_kda", _kda_recurrent, "gated_delta_rule", _STATEFUL, True, {}),
    ("kda", "naive_chunk_kda", _kda_chunk, "gated_delta_rule", _STATEFUL, True, {}),
]


def _mode_of(function: str) -> str:
    """The mode name a function's row shows: its form (``recurrent``, ``chunk``, ``parallel``)."""
    if "recurren" in function:
        return "recurrent"
    if "chunk" in function:
        return "chunk"
    return "parallel"  # naive_parallel_*, delta_rule_parallel, naive_retention (quadratic)


def _fla_specs() -> list[OpSpec]:
    _fla_root()  # raises ThirdPartyUnavailable with a one-line message
    out = []
    for op_dir, function, adapter, claims, supports, f32_compute, extra in _FLA:
        path = _fla_root() / op_dir / "naive.py"
        if not path.is_file():
            continue  # another fla version: this reference is not there
        base = get_spec(claims)
        name = f"fla.{function}"
        if adapter is _linear_elu_norm_recurrent:
            name += "(normalize)"
        fields = dict(
            name=name,
            call=adapter,
            op=None,
            arguments=None,
            modes=(_mode_of(function),),
            reference=base.reference_callable(),
            supports=supports,
            claims=base.name,
            f64_tol=F32_TOL if f32_compute else F64_TOL,
            note=f"fla/ops/{op_dir}/naive.py:{function} vs mnemo {base.name} (recurrent)",
        )
        if adapter is _retention:
            fields["make"] = _retention_inputs(base.make)
        if op_dir == "kda":
            fields["make"] = _kda_inputs(base.make)
        fields.update(extra)
        out.append(dataclasses.replace(base, **fields))
    return out
