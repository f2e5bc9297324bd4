"""Rotary position embeddings (RoPE, Su et al. 2021), optionally scaled: Position Interpolation,
NTK-aware, YaRN (Peng et al. 2023) and Llama 3.1's frequency-dependent scaling."""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import nn

from .base import buffer_dtype, off_meta

#: the keys a ``rope_scaling`` mapping may hold (the names of ``transformers``' ``rope_scaling`` /
#: ``rope_parameters``, so that interop can pass them through); ``"type"`` is an alias of ``"rope_type"``
ROPE_SCALING_KEYS = (
    "rope_type",
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "attention_factor",
    *("rope_theta", "partial_rotary_factor"),
    *("mscale", "mscale_all_dim", "truncate"),
    *("low_freq_factor", "high_freq_factor"),
)
#: the keys only ``"yarn_hf"`` (``transformers``' YaRN) reads
YARN_HF_KEYS = ("mscale", "mscale_all_dim", "truncate")
#: the keys of ``"llama3"`` (Llama 3.1's scaling), all required, as ``transformers``' ``rope_parameters``
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
#: keys of ``transformers`` 5's ``rope_parameters`` that describe the plain RoPE rather than its
#: scaling (the base ``θ`` and the rotated share of each head): accepted in any mapping, checked
#: (a number > 0; ``partial_rotary_factor`` in ``(0, 1]``) and left out of the returned mapping;
#: :meth:`RotaryEmbedding.set_scaling` refuses them where they disagree with its ``theta`` /
#: ``rotary_dim``
ROPE_BASE_KEYS = ("rope_theta", "partial_rotary_factor")


def _number(name: str, value, minimum: float, *, strict: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (value <= minimum if strict else value < minimum):
        bound = f"> {minimum}" if strict else f">= {minimum}"
        raise ValueError(f"rope_scaling[{name!r}]: expected a finite number {bound}, got {value!r}")
    return float(value)


def _check_base_keys(d: dict[str, Any]) -> None:
    """``rope_theta`` (a finite number > 0) and ``partial_rotary_factor`` (in ``(0, 1]``), when present."""
    if "rope_theta" in d:
        _number("rope_theta", d["rope_theta"], 0.0, strict=True)
    if (
        "partial_rotary_factor" in d
        and not 0 < _number("partial_rotary_factor", d["partial_rotary_factor"], 0.0, strict=True) <= 1
    ):
        raise ValueError(
            f"rope_scaling['partial_rotary_factor']: expected a number in (0, 1] (the rotated share of "
            f"each head), got {d['partial_rotary_factor']!r}"
        )


def check_rope_scaling(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """Validate a ``rope_scaling`` mapping and fill its defaults; ``None`` (or ``rope_type``
    ``"default"``) means plain RoPE and returns ``None``. ``transformers`` 5's ``rope_parameters``
    also hold the plain RoPE's ``rope_theta`` and ``partial_rotary_factor`` (:data:`ROPE_BASE_KEYS`):
    accepted with any type, checked and left out of the result (so ``{"rope_type": "default",
    "rope_theta": 1e4}`` is plain RoPE too).

    Position Interpolation (Chen et al. 2023, "Extending Context Window of Large Language Models
    via Positional Interpolation"): ``{"rope_type": "linear", "factor": s}`` — every frequency
    divided by ``s`` (positions squeezed into the trained range; ``transformers``' ``"linear"``).

    NTK-aware scaling (bloc97 2023; YaRN paper §3.1, eq. 16): ``{"rope_type": "ntk", "factor":
    s}`` — the base ``θ`` becomes ``θ · s^{R/(R−2)}`` (``R`` the rotary dimension), so the
    slowest frequency is divided by ``s`` and the fastest kept. This is the *static* form the YaRN
    paper compares against; ``transformers``' ``"dynamic"`` recomputes the base per length and is
    not this.

    YaRN: ``{"rope_type": "yarn", "factor": s, "original_max_position_embeddings": L,
    "beta_fast": 32, "beta_slow": 1, "attention_factor": None}`` (the paper's ramp, linear in the
    rotations ``r``; ``transformers``' ramp is linear in the dimension index and gives other
    frequencies inside the ramp: :func:`yarn_inv_freq`) — ``s ≥ 1`` the context
    extension, ``L`` the training context, ``beta_slow < beta_fast`` the ramp bounds ``α, β`` (in
    rotations per ``L`` tokens; the paper's defaults for LLaMA), ``attention_factor`` overrides
    ``√(1/t) = 0.1 ln s + 1``.

    ``transformers``' YaRN (``_compute_yarn_parameters``, the form of the authors' code and of
    released checkpoints such as Qwen2/Qwen3 and Llama configs with ``rope_type`` ``"yarn"``):
    ``{"rope_type": "yarn_hf", "factor": s, "original_max_position_embeddings": L, "beta_fast": 32,
    "beta_slow": 1, "attention_factor": None, "mscale": None, "mscale_all_dim": None, "truncate":
    True}`` — a separate name because its frequencies differ from the paper's inside the ramp
    (:func:`yarn_hf_inv_freq`) and its temperature scales only the rotated channels
    (:func:`yarn_hf_attention_factor`, :class:`RotaryEmbedding`). ``mscale`` / ``mscale_all_dim`` /
    ``truncate`` belong to it alone.

    Llama 3.1's scaling (``transformers``' ``"llama3"``): ``{"rope_type": "llama3", "factor": s,
    "low_freq_factor": a, "high_freq_factor": b, "original_max_position_embeddings": L}`` — every key
    required, ``s >= 1``, ``0 < a < b``, ``L`` a positive int; frequencies of
    :func:`llama3_inv_freq`, no attention factor.

    Raises:
        TypeError: ``scaling`` is not a mapping.
        ValueError: an unknown key or type, or a value out of range; the message names the key,
            the expected and the received value.
    """
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise TypeError(
            f"rope_scaling: expected a dict such as {{'rope_type': 'yarn', ...}} or None, got {scaling!r}"
        )
    d = dict(scaling)
    if "type" in d:
        if "rope_type" in d and d["rope_type"] != d["type"]:
            raise ValueError(
                f"rope_scaling: 'type' ({d['type']!r}) and 'rope_type' ({d['rope_type']!r}) disagree"
            )
        d["rope_type"] = d.pop("type")
    unknown = sorted(set(d) - set(ROPE_SCALING_KEYS))
    if unknown:
        raise ValueError(f"rope_scaling: unknown key(s) {unknown}; expected among {list(ROPE_SCALING_KEYS)}")
    _check_base_keys(d)
    for key in ROPE_BASE_KEYS:
        d.pop(key, None)
    kind = d.get("rope_type")
    if kind == "default" and len(d) == 1:
        return None
    if kind == "default":
        raise ValueError(
            "rope_scaling: rope_type 'default' (plain RoPE) takes no other keys, "
            f"got {sorted(set(d) - {'rope_type'})}"
        )
    if kind in ("linear", "ntk"):
        extra = sorted(set(d) - {"rope_type", "factor", "original_max_position_embeddings"})
        if extra:
            raise ValueError(f"rope_scaling: rope_type {kind!r} takes 'factor' only, got also {extra}")
        if "factor" not in d:
            raise ValueError(f"rope_scaling: rope_type {kind!r} needs 'factor', got keys {sorted(d)}")
        out = {"rope_type": kind, "factor": _number("factor", d["factor"], 1.0)}
        if "original_max_position_embeddings" in d:  # informative only (transformers' configs carry it)
            out["original_max_position_embeddings"] = d["original_max_position_embeddings"]
        return out
    if kind == "llama3":
        return _check_llama3(d)
    if kind not in ("yarn", "yarn_hf"):
        raise ValueError(
            "rope_scaling['rope_type']: expected 'yarn', 'linear', 'ntk', 'yarn_hf', 'llama3' "
            f"(or 'default'), got {kind!r}"
        )
    hf_only = sorted(set(d) & set(YARN_HF_KEYS))
    if kind == "yarn" and hf_only:
        raise ValueError(
            f"rope_scaling: unknown key(s) {hf_only} for the paper's YaRN (rope_type 'yarn'): they belong "
            "to transformers' YaRN (rope_type 'yarn_hf')"
        )
    for key in ("factor", "original_max_position_embeddings"):
        if key not in d:
            raise ValueError(f"rope_scaling: YaRN needs {key!r}, got keys {sorted(d)}")
    out: dict[str, Any] = {"rope_type": kind, "factor": _number("factor", d["factor"], 1.0)}
    L = d["original_max_position_embeddings"]
    if not isinstance(L, int) or isinstance(L, bool) or L < 1:
        raise ValueError(
            f"rope_scaling['original_max_position_embeddings']: expected a positive int, got {L!r}"
        )
    out["original_max_position_embeddings"] = L
    out["beta_fast"] = _number("beta_fast", d.get("beta_fast", 32), 0.0, strict=True)
    out["beta_slow"] = _number("beta_slow", d.get("beta_slow", 1), 0.0, strict=True)
    if not out["beta_slow"] < out["beta_fast"]:
        raise ValueError(
            f"rope_scaling: expected beta_slow < beta_fast, got beta_slow = {out['beta_slow']} and "
            f"beta_fast = {out['beta_fast']}"
        )
    turns = L / (2 * math.pi)  # rotations of the fastest dimension (θ = 1) over the training context
    if kind == "yarn" and out["beta_fast"] > turns:
        warnings.warn(
            f"rope_scaling: beta_fast = {out['beta_fast']:g} rotations, but over "
            f"original_max_position_embeddings = {L} tokens the fastest dimension turns only {turns:.3g} "
            f"times, so no dimension keeps its frequency and YaRN's ramp blends them all; the paper's 32 "
            f"assumes a context of thousands of tokens: choose beta_fast <= L / 2π = {turns:.3g}",
            stacklevel=2,
        )
    af = d.get("attention_factor")
    out["attention_factor"] = None if af is None else _number("attention_factor", af, 0.0, strict=True)
    if kind == "yarn_hf":
        for key in ("mscale", "mscale_all_dim"):
            v = d.get(key)
            out[key] = None if v is None else _number(key, v, 0.0)
        truncate = d.get("truncate", True)
        if not isinstance(truncate, bool):
            raise ValueError(f"rope_scaling['truncate']: expected true or false, got {truncate!r}")
        out["truncate"] = truncate
    return out


def _check_llama3(d: dict[str, Any]) -> dict[str, Any]:
    """The ``"llama3"`` mapping ``d`` (``rope_type`` already read) checked: :data:`LLAMA3_KEYS`, each
    present, and no other."""
    extra = sorted(set(d) - {"rope_type", *LLAMA3_KEYS})
    if extra:
        raise ValueError(f"rope_scaling: rope_type 'llama3' takes {list(LLAMA3_KEYS)}, got also {extra}")
    missing = [k for k in LLAMA3_KEYS if d.get(k) is None]
    if missing:
        raise ValueError(f"rope_scaling: rope_type 'llama3' needs {missing}, got keys {sorted(d)}")
    out: dict[str, Any] = {"rope_type": "llama3", "factor": _number("factor", d["factor"], 1.0)}
    low = _number("low_freq_factor", d["low_freq_factor"], 0.0, strict=True)
    high = _number("high_freq_factor", d["high_freq_factor"], 0.0, strict=True)
    if not low < high:
        raise ValueError(
            f"rope_scaling: rope_type 'llama3' needs low_freq_factor < high_freq_factor (the smoothing "
            f"divides by their difference), got low_freq_factor = {low} and high_freq_factor = {high}"
        )
    L = d["original_max_position_embeddings"]
    if not isinstance(L, int) or isinstance(L, bool) or L < 1:
        raise ValueError(
            f"rope_scaling['original_max_position_embeddings']: expected a positive int, got {L!r}"
        )
    out.update(low_freq_factor=low, high_freq_factor=high, original_max_position_embeddings=L)
    return out


def plain_inv_freq(theta: float, rotary_dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """RoPE's frequencies ``θ_i = theta^{−2i/R}``, ``i < R/2`` (``R = rotary_dim``), computed in
    ``dtype``: in float32 as ``transformers`` computes them (``1 / theta^{2i/R}``, the same operations
    in float32, so the same float32 numbers: ``theta^{−2i/R}`` rounds a third of them one ulp away,
    which reaches ~1e-4 in a converted model's logits at position 3000); in float64 (and any other
    dtype) as ``theta^{−2i/R}``. Returns ``[R/2]`` in ``dtype``."""
    i = torch.arange(0, rotary_dim, 2, dtype=dtype)
    if dtype == torch.float32:
        return 1.0 / (theta ** (i / rotary_dim))
    return theta ** (-i / rotary_dim)


def llama3_inv_freq(
    theta: float,
    rotary_dim: int,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position: int,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Llama 3.1's RoPE frequencies (Llama Team, "The Llama 3 Herd of Models", arXiv:2407.21783, 2024:
    the 3.1 models' long-context RoPE, whose equations are those of Meta's released reference code,
    ``apply_scaling`` in ``meta-llama/llama-models``; ``transformers``' ``_compute_llama3_parameters``
    computes the same). With the plain frequencies ``θ_i = theta^{−2i/R}``, ``i < R/2``,
    their wavelengths ``λ_i = 2π / θ_i`` and the training context ``L``:

        λ_i < L / high_freq_factor           h(θ_i) = θ_i                     (fast: kept)
        λ_i > L / low_freq_factor            h(θ_i) = θ_i / s                 (slow: interpolated)
        otherwise, with γ_i = (L / λ_i − low_freq_factor) / (high_freq_factor − low_freq_factor),
                                             h(θ_i) = (1 − γ_i) · θ_i / s + γ_i · θ_i

    (continuous at both bounds; static: the same at every sequence length, unlike ``"dynamic"``).
    ``s = factor`` (8 for Llama 3.1, ``low_freq_factor = 1``, ``high_freq_factor = 4``, ``L = 8192``).
    Computed in ``dtype`` (default float64) from :func:`plain_inv_freq`'s ``θ_i`` with
    ``transformers``' operations, so in float32 its float32 numbers. Returns ``[R/2]`` in ``dtype``."""
    inv = plain_inv_freq(theta, rotary_dim, dtype)
    wavelen = 2 * math.pi / inv
    gamma = (original_max_position / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smooth = (1 - gamma) * inv / factor + gamma * inv
    out = torch.where(wavelen > original_max_position / low_freq_factor, inv / factor, smooth)
    return torch.where(wavelen < original_max_position / high_freq_factor, inv, out)


def yarn_ramp(r: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
    """YaRN's ramp ``γ(r)`` (Peng et al. 2023, eq. 18): ``0`` for ``r < α``, ``1`` for ``r > β``,
    ``(r − α) / (β − α)`` in between. ``r`` any shape; same shape and dtype."""
    return ((r - alpha) / (beta - alpha)).clamp(0.0, 1.0)


def yarn_inv_freq(
    inv_freq: torch.Tensor,
    factor: float,
    original_max_position: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
) -> torch.Tensor:
    """YaRN's "NTK-by-parts" frequencies (Peng et al. 2023, §3.2, eqs. 17–19).

    For each frequency ``θ_d`` (``inv_freq: [R/2]``) the wavelength is ``λ_d = 2π / θ_d`` and
    ``r(d) = L / λ_d`` counts its rotations over the training context ``L``; then

        h(θ_d) = (1 − γ(r(d))) · θ_d / s + γ(r(d)) · θ_d

    with γ = :func:`yarn_ramp` (``α = beta_slow``, ``β = beta_fast``): dimensions turning more
    than ``β`` times in ``L`` tokens keep ``θ_d`` (extrapolate), those turning less than ``α``
    times are divided by ``s`` (interpolate, as Position Interpolation), and the ramp blends the
    two in between (defaults ``beta_fast=32.0``, ``beta_slow=1.0``, the paper's). The ramp is
    linear in ``r`` as the paper's eq. 18 writes it. This is *not* the frequencies of the authors'
    code nor of ``transformers``' ``_compute_yarn_parameters``: those ramp linearly in the
    dimension index ``d`` (i.e. in ``log r``) between the dimensions where ``r = β`` and ``r = α``
    (rounded down/up to whole dimensions), so inside the ramp their frequencies differ: mostly
    higher, up to 1.73× these, and at the ramp's rounded-down fast end lower (0.977× for ``s = 4``,
    ``L = 4096``, ``R = 128``, ``theta = 10000``); only the ends (``r > β`` kept, ``r < α`` divided
    by ``s``) and the temperature agree. A checkpoint trained with their YaRN is not
    reproduced by this one (``mnemo.hf`` refuses scaled RoPE for that reason). ``factor = 1``
    returns ``inv_freq`` unchanged.
    Returns ``[R/2]`` in ``inv_freq``'s dtype (computed in float64).
    """
    if factor == 1:
        return inv_freq.clone()
    th = inv_freq.double()
    r = original_max_position * th / (2 * math.pi)
    gamma = yarn_ramp(r, beta_slow, beta_fast)
    h = torch.where(
        gamma >= 1, th, torch.where(gamma <= 0, th / factor, (1 - gamma) * th / factor + gamma * th)
    )
    return h.to(inv_freq.dtype)


def yarn_hf_inv_freq(
    theta: float,
    rotary_dim: int,
    factor: float,
    original_max_position: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    truncate: bool = True,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """YaRN's frequencies as ``transformers``' ``_compute_yarn_parameters`` computes them (the
    authors' code form; not the paper's eq. 18, :func:`yarn_inv_freq`). With ``R = rotary_dim``,
    the plain frequencies ``θ_i = 1 / theta^{2i/R}``, ``i < R/2``, and the dimension (a real
    number) whose frequency turns ``n`` times over ``L`` tokens

        d(n) = R · ln(L / (2π n)) / (2 ln theta),

    the ramp runs in the *index* ``i`` from ``lo = d(beta_fast)`` to ``hi = d(beta_slow)``
    (``truncate``: ``lo`` rounded down and ``hi`` up; then ``lo ≥ 0``, ``hi ≤ R − 1``; ``hi`` moved
    by ``0.001`` when they meet): ``γ_i = clamp((i − lo) / (hi − lo), 0, 1)`` and

        h(θ_i) = γ_i · θ_i / s + (1 − γ_i) · θ_i

    (fast dimensions, ``i < lo``, kept; slow ones divided by ``s``). Defaults ``beta_fast=32.0``,
    ``beta_slow=1.0``, ``truncate=True``. Computed in ``dtype`` (default float64) with
    ``transformers``' operations (so in float32 its float32 numbers). Returns ``[R/2]`` in ``dtype``."""
    R = rotary_dim
    pos_freqs = theta ** (torch.arange(0, R, 2, dtype=dtype) / R)
    extra, inter = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)

    def dim_of(turns: float) -> float:
        return R * math.log(original_max_position / (turns * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = dim_of(beta_fast), dim_of(beta_slow)
    if truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, R - 1)
    if lo == hi:
        hi += 0.001
    kept = 1 - ((torch.arange(R // 2, dtype=dtype) - lo) / (hi - lo)).clamp(0.0, 1.0)  # 1 − γ_i
    return inter * (1 - kept) + extra * kept


def yarn_hf_attention_factor(
    factor: float, mscale: float | None = None, mscale_all_dim: float | None = None
) -> float:
    """The factor ``transformers``' YaRN multiplies ``cos`` and ``sin`` by (so the *rotated* channels
    of q and k): ``m(s, mscale) / m(s, mscale_all_dim)`` when both are given (non-zero; DeepSeek's
    form), else ``m(s, 1) = 0.1 ln s + 1``, with ``m(s, a) = 0.1 · a · ln s + 1`` (``1`` for
    ``s ≤ 1``). An explicit ``attention_factor`` in the mapping replaces it."""

    def m(a: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * a * math.log(factor) + 1.0

    return m(mscale) / m(mscale_all_dim) if mscale and mscale_all_dim else m(1.0)


def ntk_inv_freq(theta: float, rotary_dim: int, factor: float) -> torch.Tensor:
    """NTK-aware frequencies (bloc97 2023; Peng et al. 2023, eq. 16): RoPE's ``θ'^{−2i/R}``,
    ``i < R/2``, with the base ``θ' = θ · s^{R/(R−2)}``. Returns ``[R/2]`` float64. ``R = 2`` (one
    frequency, the fastest, 1 at every base) is returned unchanged."""
    R = rotary_dim
    base = theta * factor ** (R / (R - 2)) if R > 2 else theta
    return base ** (-torch.arange(0, R, 2, dtype=torch.float64) / R)


def yarn_attention_factor(factor: float) -> float:
    """YaRN's attention temperature as a factor on q and k (Peng et al. 2023, eq. 22):
    ``√(1/t) = 0.1 · ln s + 1`` (so the logits are multiplied by its square); ``1`` at ``s = 1``."""
    return 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0


class RotaryEmbedding(nn.Module):
    """Rotate pairs ``(x_i, x_{i + R/2})`` of each head by angle ``pos · theta^{−2i/R}``,
    ``i < R/2``, for the first ``R = rotary_dim`` channels; the remaining ``D − R`` pass unchanged.

    ``theta``: the base (default ``theta=10000.0``). ``rotary_dim`` defaults to the whole head
    (``R = D``). A smaller ``R`` is *partial* rotary (GPT-NeoX, Qwen3-Next's
    ``partial_rotary_factor = R / D``): the frequencies then use ``R`` as the dimension, and the
    pairs are split halves of the rotated block (``rotate_half`` pairing).

    ``scaling``: ``None`` (plain RoPE) or a YaRN mapping (:func:`check_rope_scaling`, the names of
    ``transformers``' ``rope_scaling``): the frequencies become :func:`yarn_inv_freq`'s and
    :attr:`attention_factor` is ``0.1 ln s + 1`` — a factor the *attention* applies to both q and k
    (its logits scale by the square); this module only rotates. :meth:`set_scaling` changes it on
    a built module (YaRN applied at evaluation time to a model trained at ``L`` tokens). The
    ``"linear"`` (Position Interpolation) and ``"ntk"`` mappings divide every frequency by ``s``,
    or use :func:`ntk_inv_freq`'s; their :attr:`attention_factor` is 1. ``"yarn_hf"``
    (``transformers``' YaRN) uses :func:`yarn_hf_inv_freq`'s frequencies and, as ``transformers``
    multiplies ``cos`` and ``sin``, scales the *rotated* channels of what :meth:`forward` rotates by
    :attr:`rotation_factor` (:func:`yarn_hf_attention_factor`; with partial rotary the other
    channels are not scaled); its :attr:`attention_factor` (the attention's part) is then 1.
    ``"llama3"`` (Llama 3.1) uses :func:`llama3_inv_freq`'s frequencies; its factors are 1.

    ``forward(x [B, T, H, D], offset) -> [B, T, H, D]`` for positions ``offset … offset+T−1``;
    :meth:`rotate` takes explicit positions. Computed in float32 (float64 for float64 inputs),
    returned in ``x``'s dtype; the frequencies are float32 (float64 when built under
    ``torch.set_default_dtype(torch.float64)``: :func:`~mnemo.layers.base.buffer_dtype`), stay
    float32 through a cast to half precision (float32 ones computed with ``transformers``'
    operations, so the same numbers as its Llama-family classes: :func:`plain_inv_freq`), and a
    float64 module (``.double()``) recomputes them in float64 (and a cast back, in float32: the
    float32 module's), and a module built on the ``meta`` device recomputes them when materialised
    (``to_empty``, or the owning mixer's ``load_state_dict(sd, assign=True)``:
    :func:`~mnemo.layers.base.refill_meta_constants`).
    ``R`` must be even and at most ``D``.

    Raises:
        ValueError: bad ``theta`` (named ``rope_theta``, the attention's argument), ``rotary_dim`` or
            ``scaling`` (the message names the argument).
    """

    def __init__(
        self,
        head_dim: int,
        theta: float = 10000.0,
        rotary_dim: int | None = None,
        scaling: dict[str, Any] | None = None,
    ):
        super().__init__()
        ok = isinstance(theta, (int, float)) and not isinstance(theta, bool) and math.isfinite(theta)
        if not ok or theta <= 0:
            raise ValueError(f"rope_theta: expected a finite number > 0 (the rotary base), got {theta!r}")
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(
                f"rotary_dim must be even and in (0, head_dim = {head_dim}], got {rotary_dim}"
                if rotary_dim != head_dim
                else f"rotary embeddings need an even head_dim, got {head_dim}"
            )
        self.head_dim, self.rotary_dim, self.theta = head_dim, rotary_dim, theta
        inv = self._base(buffer_dtype())
        self.register_buffer("base_inv_freq", inv, persistent=False)
        self.register_buffer("inv_freq", inv.clone(), persistent=False)
        self.scaling: dict[str, Any] | None = None
        self.attention_factor = 1.0
        self.rotation_factor = 1.0
        self.set_scaling(scaling)

    def _apply(self, fn, recurse=True):
        # move the frequencies with the module, but keep them in float32 through a cast to
        # half precision (``model.to(torch.bfloat16)``): rounded to bf16 they would be off by up to
        # 2⁻⁹ relative, i.e. rotations off by ~0.3 rad at position 3000
        kept = {name: getattr(self, name) for name in ("base_inv_freq", "inv_freq")}
        super()._apply(fn, recurse)
        for name, old in kept.items():
            new = getattr(self, name)
            if new.dtype not in (torch.float32, torch.float64):
                setattr(self, name, old.to(new.device, torch.float32))
        base = self.base_inv_freq
        # off the meta device (``to_empty`` after a ``with torch.device("meta")`` build): the new
        # buffers are uninitialised memory, and ``load_state_dict`` does not fill them (not persistent)
        materialised = kept["base_inv_freq"].is_meta and not base.is_meta
        if base.dtype != kept["base_inv_freq"].dtype or materialised:
            # recomputed in the new dtype, a function of it alone: a float64 module gets the
            # frequencies of the equation in float64, not float32's rounded ones cast up
            # (``10000^{-1/4}`` off by 1.5e-9: angles off by 1e-6 at position 1000), and a cast back
            # to float32 (or half precision) those of a float32 module, not float64's rounded down
            # (computed on the CPU inside a ``with torch.device("meta")`` block: :func:`off_meta`)
            with off_meta():
                self.base_inv_freq = self._base(base.dtype).to(base.device)
                inv = self._frequencies(self.scaling)[0]
            self.inv_freq = inv.to(self.inv_freq.device, self.inv_freq.dtype)
        return self

    def _base(self, dtype: torch.dtype) -> torch.Tensor:
        """RoPE's ``θ^{−2i/R}``, ``i < R/2``, computed in ``dtype`` (:func:`plain_inv_freq`)."""
        return plain_inv_freq(self.theta, self.rotary_dim, dtype)

    def set_scaling(self, scaling: dict[str, Any] | None) -> None:
        """Replace the frequency scaling (``None``: plain RoPE); see :func:`check_rope_scaling`. A
        ``rope_theta`` / ``partial_rotary_factor`` in ``scaling`` (``transformers`` 5's
        ``rope_parameters``) must describe this module (``theta``; ``int(head_dim · factor) =
        rotary_dim``, as ``transformers`` rounds): ``ValueError`` naming both values otherwise."""
        s = check_rope_scaling(scaling)
        theta = scaling.get("rope_theta") if scaling else None
        if theta is not None and float(theta) != float(self.theta):
            raise ValueError(
                f"rope_scaling['rope_theta']: {theta!r} disagrees with this rotary embedding's base "
                f"rope_theta = {self.theta!r}"
            )
        prf = scaling.get("partial_rotary_factor") if scaling else None
        if prf is not None and int(self.head_dim * prf) != self.rotary_dim:
            raise ValueError(
                f"rope_scaling['partial_rotary_factor']: {prf!r} rotates int({self.head_dim} · {prf!r}) = "
                f"{int(self.head_dim * prf)} channels of head_dim = {self.head_dim}, but this rotary "
                f"embedding rotates rotary_dim = {self.rotary_dim}"
            )
        inv, af = self._frequencies(s)
        self.inv_freq = inv.to(self.inv_freq.device)
        # transformers' YaRN scales cos and sin (the rotated channels); the paper's, the logits
        hf = s is not None and s["rope_type"] == "yarn_hf"
        self.scaling, self.attention_factor, self.rotation_factor = (
            s,
            (1.0 if hf else af),
            (af if hf else 1.0),
        )

    def _frequencies(self, s: dict[str, Any] | None) -> tuple[torch.Tensor, float]:
        """``(inv_freq, attention_factor)`` of a checked scaling ``s`` from ``base_inv_freq``."""
        base = self.base_inv_freq
        if s is None:
            inv, af = base.clone(), 1.0
        elif s["rope_type"] == "linear":
            inv, af = base / s["factor"], 1.0
        elif s["rope_type"] == "ntk":
            inv, af = ntk_inv_freq(self.theta, self.rotary_dim, s["factor"]).to(base.dtype), 1.0
        elif s["rope_type"] == "llama3":
            inv = llama3_inv_freq(
                self.theta, self.rotary_dim, s["factor"], s["low_freq_factor"], s["high_freq_factor"],
                s["original_max_position_embeddings"], dtype=base.dtype,
            )  # fmt: skip
            af = 1.0
        elif s["rope_type"] == "yarn_hf":
            inv = yarn_hf_inv_freq(
                self.theta, self.rotary_dim, s["factor"], s["original_max_position_embeddings"],
                s["beta_fast"], s["beta_slow"], s["truncate"], dtype=base.dtype,
            )  # fmt: skip
            af = s["attention_factor"]
            if af is None:
                af = yarn_hf_attention_factor(s["factor"], s["mscale"], s["mscale_all_dim"])
        else:
            inv = yarn_inv_freq(
                base, s["factor"], s["original_max_position_embeddings"], s["beta_fast"], s["beta_slow"]
            )
            af = (
                s["attention_factor"]
                if s["attention_factor"] is not None
                else yarn_attention_factor(s["factor"])
            )
        return inv, af

    def extra_repr(self) -> str:
        return f"rotary_dim={self.rotary_dim}, theta={self.theta}, scaling={self.scaling}"

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, factor: float = 1.0) -> torch.Tensor:
        """``x: [B, T, H, D]`` rotated at ``positions: [T]`` (any numbers, negative included: a
        rotation by ``−p`` undoes one by ``p``), the rotated channels times ``factor`` (default
        ``factor=1.0``: a pure rotation; :meth:`forward` passes :attr:`rotation_factor`). Same shape
        and dtype as ``x``."""
        cd = torch.float64 if x.dtype == torch.float64 else torch.float32
        pos = positions.to(device=x.device, dtype=cd)
        ang = pos[:, None] * self.inv_freq.to(device=x.device, dtype=cd)[None, :]  # [T, R/2]
        cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
        if factor != 1.0:  # as transformers: cos and sin scaled
            cos, sin = cos * factor, sin * factor
        R = self.rotary_dim
        xr = x[..., :R].to(cd)
        x1, x2 = xr.chunk(2, dim=-1)
        rot = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)
        return rot if R == x.shape[-1] else torch.cat([rot, x[..., R:]], dim=-1)

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """``x [B, T, H, D]`` rotated at positions ``offset … offset+T−1`` (default ``offset=0``)."""
        T = x.shape[1]
        cd = torch.float64 if x.dtype == torch.float64 else torch.float32
        pos = torch.arange(offset, offset + T, device=x.device, dtype=cd)
        return self.rotate(x, pos, self.rotation_factor)

    def undo(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """The inverse of :meth:`forward`: ``x [B, T, H, D]`` rotated back from positions ``offset …``
        (default ``offset=0``) and its rotated channels divided by :attr:`rotation_factor`."""
        T = x.shape[1]
        cd = torch.float64 if x.dtype == torch.float64 else torch.float32
        pos = -torch.arange(offset, offset + T, device=x.device, dtype=cd)
        return self.rotate(x, pos, 1.0 / self.rotation_factor)
