"""flash-linear-attention's released models (the ``fla-hub`` checkpoints) in mnemo: GLA, RetNet,
DeltaNet and Gated DeltaNet, import only.

A ``config.json`` written by flash-linear-attention (fla) 0.6 carries fla's ``model_type``
(``"gla"``, ``"retnet"``, ``"delta_net"``, ``"gated_deltanet"``) and its weights carry fla's module names
(``model.embeddings``, ``model.layers.{i}.attn.q_proj``, ``…attn.q_conv1d``, ``…mlp.gate_proj``,
``lm_head``). :func:`import_gla`, :func:`import_retnet`, :func:`import_delta_net` and
:func:`import_gated_deltanet` turn such
a config (a dict) and its state dict into a :class:`~mnemo.models.ModelConfig` and a state dict that
``LanguageModel(config).load_state_dict(sd, strict=True)`` accepts; neither imports fla or
``transformers``. They are registered in :mod:`mnemo.hf.convert` (``mnemo convert``,
``LanguageModel.from_pretrained``) under fla's class names ``GLAForCausalLM``, ``RetNetForCausalLM``,
``DeltaNetForCausalLM`` and ``GatedDeltaNetForCausalLM``.

What fla's blocks compute and how mnemo expresses it (read from fla 0.6.0's
``fla/models/{gla,retnet,delta_net,gated_deltanet}`` and ``fla/layers``):

* every model: pre-norm blocks ``x + attn(attn_norm(x))``, ``x + mlp(mlp_norm(x))``, a final norm
  and an output head, as mnemo's :class:`~mnemo.models.lm.Block`. The norms are RMSNorms of epsilon
  ``norm_eps`` (fla's default ``1e-6``; fused with the residual add or ``nn.RMSNorm`` with
  ``fuse_norm`` false: the same function). The MLP is fla's ``GatedMLP``:
  ``down(silu(gate(x)) ⊙ up(x))``, mnemo's SwiGLU with ``w_in = [gate; up]``; its width is
  ``intermediate_size``, or where that is null ``int(hidden_size · hidden_ratio · 2/3)`` rounded up
  to a multiple of 256 (``hidden_ratio`` null: 4), as fla derives it. The head is tied when
  ``tie_word_embeddings`` (fla's default: false), as ``transformers`` ties it on load.
* GLA (``GatedLinearAttention``) → mnemo ``"gla"``: ``q, k, v`` projections (sizes
  ``hidden_size · expand_k`` and ``· expand_v``, split over ``num_heads``) with, where
  ``use_short_conv``, three causal depthwise convolutions of ``conv_size`` taps and SiLU, without
  bias (mnemo's one convolution over ``[q | k | v]`` gets a zero bias); the low-rank gate
  ``logsigmoid(W₂ W₁ x + b) / 16`` (fla's layer fixes ``gate_low_rank_dim`` and
  ``gate_logit_normalizer`` at 16, mnemo's ``gate_rank`` / ``gate_normalizer`` defaults); scale
  ``K^{-1/2}``; the read-out ``o_proj(RMSNorm(o) ⊙ silu(g_proj x))`` per head with epsilon
  ``norm_eps`` (mnemo's ``norm_eps`` option of the GLA mixer) and weight ``g_norm_swish_gate``
  (``fuse_norm``) or ``g_norm``, ones where ``elementwise_affine`` is false or null.
  ``use_gk`` / ``use_gv`` are not read by fla's model and are not by the import either.
* RetNet (``MultiScaleRetention``) → mnemo ``"retnet"``: GLA's layer with the fixed per-head decays
  ``γ_h = 1 − 2^{−5−h}`` in place of the gate and rotary positions on ``q, k`` (fla's
  ``RotaryEmbedding``: base 10000, halves rotated, frequencies ``1 / 10000^{2i/K}`` in float32, as
  mnemo's); fla's ``RetNetBlock`` passes no ``use_short_conv``, so its layers have no convolution
  whatever the config says, and the import reads none.
* DeltaNet (``DeltaNet``) → mnemo ``"deltanet"``: ``q, k, v`` (``expand_k`` / ``expand_v``), the
  short convolutions (bias-free, SiLU) or SiLU alone without them, ``q, k`` L2-normalised in fla's
  kernel as ``x / sqrt(Σx² + 1e-6)`` (mnemo's ``qk_norm_eps = 1e-6``), ``β = sigmoid(b_proj x)``
  without bias (``2 · sigmoid`` with ``allow_neg_eigval``), the read-out RMSNorm ``o_norm`` with
  epsilon ``norm_eps``, gated by ``silu(g_proj x)`` where ``use_gate``. fla 0.6's layer takes
  ``use_output_norm`` into ``**kwargs`` and ignores it (the norm is always there); so does the import.
* Gated DeltaNet (``GatedDeltaNet``) → mnemo ``"gated_deltanet"``: as DeltaNet with key size
  ``head_dim``, value size ``head_dim · expand_v``, ``num_v_heads`` value heads (key head ``h``
  serving the consecutive value heads ``h·G … h·G + G − 1``, as fla's kernels index them) and the
  decay ``g = −exp(A_log) · softplus(a_proj x + dt_bias)``; output gate ``silu`` where ``use_gate``.

Refused by name, with the config field and the value received, because mnemo would compute
something else: ``attn`` (fla's hybrid softmax-attention layers: fla's ``Attention`` runs only on
flash-attn, on a GPU, so its function could not be checked here), ``attnres_block_size`` (attention
residuals), ``hidden_act`` other than ``"swish"``, GLA's and RetNet's ``num_kv_heads`` that does not
divide ``num_heads``, ``feature_map``, ``use_output_gate`` false, GLA's ``clamp_min``, DeltaNet's
``qk_activation`` other than ``"silu"``, ``qk_norm`` other than ``"l2"``, ``use_beta`` false, Gated
DeltaNet's ``output_gate_activation`` ``"sigmoid"`` and ``num_v_heads`` not a multiple of
``num_heads``; sizes that fla itself would not build (``hidden_size · expand_k`` not a whole
number of channels per head); a missing, mis-shaped (naming the config fields that set the shape)
or unexpected weight. ``attn_mode`` (fla's kernel choice), the ``fuse_*`` flags and ``use_l2warp``
change no output (a forward pass) and are not read.

Export back to fla's format is not provided (import only): :func:`mnemo.hf.convert.export_hf` writes
``transformers``' own classes, which have no GLA, RetNet or DeltaNet (a pure Gated DeltaNet stack
goes out as Qwen3-Next where its options allow).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..models.config import ModelConfig
from .fields import ConfigFormat, Weights, import_head, is_int, tied_as_loaded

#: fla's embedding (``FLAModel.embeddings``)
EMBED = "model.embeddings.weight"
#: the L2-normalisation epsilon of fla's delta-rule kernels (``l2norm_fwd``; fixed, not a config field)
QK_L2NORM_EPS = 1e-6
#: fla's GLA layer builds its gate with these (``gate_low_rank_dim``, ``gate_logit_normalizer``;
#: ``GLABlock`` does not pass them from the config)
GLA_GATE_RANK, GLA_GATE_NORMALIZER = 16, 16.0

#: the defaults every fla config class shares, for the fields read here (fla 0.6.0)
_COMMON_DEFAULTS: dict[str, Any] = {
    "hidden_size": 2048,
    "hidden_ratio": 4,
    "intermediate_size": None,
    "hidden_act": "swish",
    "norm_eps": 1e-6,
    "attn": None,
    "attnres_block_size": None,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "fuse_norm": True,
    "vocab_size": 32000,
    "use_short_conv": True,
    "conv_size": 4,
}
#: ``GLAConfig``'s defaults
GLA_DEFAULTS = _COMMON_DEFAULTS | {
    "num_hidden_layers": 24,
    "expand_k": 0.5,
    "expand_v": 1.0,
    "num_heads": 4,
    "num_kv_heads": None,
    "feature_map": None,
    "use_short_conv": False,
    "use_output_gate": True,
    "clamp_min": None,
    "elementwise_affine": True,
}
#: ``RetNetConfig``'s defaults
RETNET_DEFAULTS = _COMMON_DEFAULTS | {
    "num_hidden_layers": 24,
    "hidden_ratio": 2,
    "expand_k": 1.0,
    "expand_v": 2.0,
    "num_heads": 8,
    "use_short_conv": False,  # (not read: fla's RetNetBlock does not pass it)
    "num_kv_heads": None,
    "feature_map": None,
    "use_output_gate": True,
    "elementwise_affine": True,
}
#: ``DeltaNetConfig``'s defaults
DELTA_NET_DEFAULTS = _COMMON_DEFAULTS | {
    "num_hidden_layers": 24,
    "expand_k": 1.0,
    "expand_v": 1.0,
    "num_heads": 16,
    "use_gate": False,
    "use_beta": True,
    "allow_neg_eigval": False,
    "qk_norm": "l2",
    "qk_activation": "silu",
}
#: ``GatedDeltaNetConfig``'s defaults
GATED_DELTANET_DEFAULTS = _COMMON_DEFAULTS | {
    "num_hidden_layers": 21,
    "expand_v": 2.0,
    "head_dim": 256,
    "num_heads": 6,
    "num_v_heads": None,
    "use_gate": True,
    "allow_neg_eigval": False,
    "output_gate_activation": "swish",
}

_MLP = ("intermediate_size", "hidden_ratio", "hidden_size")
_COMMON_SHAPES: dict[str, tuple[str, ...]] = {
    "embeddings.weight": ("vocab_size", "hidden_size"),
    "lm_head.weight": ("vocab_size", "hidden_size"),
    "norm.weight": ("hidden_size",),
    "attn_norm.weight": ("hidden_size",),
    "mlp_norm.weight": ("hidden_size",),
    "mlp.gate_proj.weight": _MLP,
    "mlp.up_proj.weight": _MLP,
    "mlp.down_proj.weight": _MLP,
    "attn.o_proj.weight": ("hidden_size", "expand_v", "num_heads"),
}
_KV = ("hidden_size", "expand_k", "num_heads")
_VV = ("hidden_size", "expand_v", "num_heads")
GLA = ConfigFormat("fla GLA", GLA_DEFAULTS, _COMMON_SHAPES | {
    "attn.q_proj.weight": _KV, "attn.k_proj.weight": _KV, "attn.v_proj.weight": _VV,
    "attn.g_proj.weight": _VV, "attn.q_conv1d.weight": (*_KV, "conv_size"),
    "attn.k_conv1d.weight": (*_KV, "conv_size"), "attn.v_conv1d.weight": (*_VV, "conv_size"),
    "attn.gk_proj.0.weight": ("hidden_size",), "attn.gk_proj.1.weight": _KV, "attn.gk_proj.1.bias": _KV,
    "g_norm_swish_gate.weight": _VV, "g_norm.weight": _VV,
})  # fmt: skip
RETNET = ConfigFormat("fla RetNet", RETNET_DEFAULTS, GLA.shape_fields)
DELTA_NET = ConfigFormat("fla DeltaNet", DELTA_NET_DEFAULTS, _COMMON_SHAPES | {
    "attn.q_proj.weight": _KV, "attn.k_proj.weight": _KV, "attn.v_proj.weight": _VV,
    "attn.g_proj.weight": _VV, "attn.q_conv1d.weight": (*_KV, "conv_size"),
    "attn.k_conv1d.weight": (*_KV, "conv_size"), "attn.v_conv1d.weight": (*_VV, "conv_size"),
    "attn.b_proj.weight": ("num_heads", "hidden_size"), "attn.o_norm.weight": _VV,
})  # fmt: skip
_GK = ("num_heads", "head_dim", "hidden_size")
_GV = ("num_v_heads", "head_dim", "expand_v", "hidden_size")
GATED_DELTANET = ConfigFormat("fla Gated DeltaNet", GATED_DELTANET_DEFAULTS, _COMMON_SHAPES | {
    "attn.q_proj.weight": _GK, "attn.k_proj.weight": _GK, "attn.v_proj.weight": _GV,
    "attn.g_proj.weight": _GV, "attn.q_conv1d.weight": (*_GK, "conv_size"),
    "attn.k_conv1d.weight": (*_GK, "conv_size"), "attn.v_conv1d.weight": (*_GV, "conv_size"),
    "attn.a_proj.weight": ("num_v_heads", "num_heads", "hidden_size"),
    "attn.b_proj.weight": ("num_v_heads", "num_heads", "hidden_size"),
    "attn.A_log": ("num_v_heads", "num_heads"), "attn.dt_bias": ("num_v_heads", "num_heads"),
    "attn.o_norm.weight": ("head_dim", "expand_v"), "attn.o_proj.weight": _GV,
})  # fmt: skip


# --- config fields ------------------------------------------------------------------------------


def _bool(fmt: ConfigFormat, cfg: dict, key: str) -> bool:
    """``cfg[key]`` (the class default where left out), refused unless true or false."""
    v = cfg.get(key, fmt.defaults[key])
    if not isinstance(v, bool):
        fmt.refuse(f"field {key!r}: expected true or false, got {v!r}")
    return v


def _int(fmt: ConfigFormat, cfg: dict, key: str) -> int:
    """``cfg[key]`` (the default where left out or null), refused unless an int ``>= 1``."""
    v = fmt.get(cfg, key)
    if not is_int(v) or v < 1:
        fmt.refuse(f"field {key!r}: expected a positive int, got {v!r}")
    return v


def _number(fmt: ConfigFormat, cfg: dict, key: str) -> float:
    """``cfg[key]`` (the default where left out or null), refused unless a finite number ``> 0``."""
    v = fmt.get(cfg, key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
        fmt.refuse(f"field {key!r}: expected a finite number > 0, got {v!r}")
    return float(v)


def _only(fmt: ConfigFormat, cfg: dict, key: str, allowed: tuple, why: str) -> Any:
    """``cfg[key]`` (the default where left out), refused unless one of ``allowed`` (``why``: what
    mnemo computes instead)."""
    v = cfg.get(key, fmt.defaults[key])
    if not any(v is a or (type(v) is type(a) and v == a) for a in allowed):  # (1 is not true)
        said = " or ".join(repr(a) for a in allowed)
        fmt.refuse(f"field {key!r} = {v!r} is not supported (expected {said}): {why}")
    return v


def _per_head(fmt: ConfigFormat, cfg: dict, ratio: str, d: int, H: int) -> int:
    """fla's channels per head from ``hidden_size · ratio`` over ``H`` heads (``expand_k`` /
    ``expand_v``), refused where fla would not build the layer (not a whole number, or not divisible
    by the heads)."""
    r = _number(fmt, cfg, ratio)
    width = round(d * r)
    if not math.isclose(d * r, width) or width < H or width % H:
        fmt.refuse(
            f"field {ratio!r} = {r!r}: hidden_size · {ratio} = {d * r:g} is not a whole number of channels "
            f"divisible by num_heads = {H} (fla builds no such layer)"
        )
    return width // H


def _mlp_hidden(fmt: ConfigFormat, cfg: dict, d: int) -> int:
    """fla's ``GatedMLP`` width: ``intermediate_size``, else ``int(d · hidden_ratio · 2/3)`` rounded
    up to a multiple of 256 (``hidden_ratio`` left out: the config class's default, 2 for RetNet and
    4 for the others; null: ``GatedMLP``'s 4)."""
    if cfg.get("intermediate_size") is not None:
        return _int(fmt, cfg, "intermediate_size")
    ratio = cfg.get("hidden_ratio", fmt.defaults["hidden_ratio"])
    ratio = 4 if ratio is None else _number(fmt, {"hidden_ratio": ratio}, "hidden_ratio")
    width = int(d * ratio * 2 / 3)
    return 256 * ((width + 255) // 256)


def _common(fmt: ConfigFormat, cfg: dict, model_type: str) -> tuple[int, int, float]:
    """The checks and fields every fla model shares: ``(num_hidden_layers, hidden_size, norm_eps)``."""
    if cfg.get("model_type", model_type) != model_type:
        fmt.refuse(f"field 'model_type' = {cfg['model_type']!r}: expected {model_type!r}")
    attn = cfg.get("attn")
    if attn is not None:
        specs = attn if isinstance(attn, list) else [attn]
        layers = [i for spec in specs if isinstance(spec, dict) for i in spec.get("layers") or []]
        fmt.refuse(
            f"field 'attn' = {attn!r}: fla's hybrid softmax-attention layers (layers {layers!r}) are not "
            "imported: fla's Attention runs only on flash-attn (a GPU), so mnemo's attention was not "
            "checked against it; expected null"
        )
    if cfg.get("attnres_block_size") is not None:
        fmt.refuse(
            f"field 'attnres_block_size' = {cfg['attnres_block_size']!r}: attention residuals (each block "
            "reading a learned mix of earlier blocks' outputs) are not expressible in mnemo's residual "
            "blocks; expected null"
        )
    _only(fmt, cfg, "hidden_act", ("swish",), "mnemo's MLP is SwiGLU (fla's 'swish' GatedMLP)")
    _bool(fmt, cfg, "fuse_norm")  # (fused or not: the same function; its kind checked)
    return _int(fmt, cfg, "num_hidden_layers"), _int(fmt, cfg, "hidden_size"), _number(fmt, cfg, "norm_eps")


def _model_config(fmt, cfg, weights, d, n, mixer, options, eps) -> ModelConfig:
    return ModelConfig(
        vocab_size=_int(fmt, cfg, "vocab_size"),
        d_model=d,
        n_layers=n,
        mixer=mixer,
        mixer_options={mixer: options},
        mlp="swiglu",
        mlp_hidden=_mlp_hidden(fmt, cfg, d),
        pos_embedding="none",
        tie_embeddings=tied_as_loaded(fmt, cfg, weights, embed=EMBED),
        norm_eps=eps,
        init_std=fmt.init_std(fmt.get(cfg, "initializer_range")),
    ).validate()


# --- weights ------------------------------------------------------------------------------------


def _import_weights(fmt: ConfigFormat, cfg: dict, weights: dict[str, Tensor], config: ModelConfig, mixer_fn):
    """The embedding and head, each block's norms, MLP and (``mixer_fn(w, src, dst)``) mixer, the
    final norm; every weight of the file consumed or refused."""
    d, n, hidden = config.d_model, config.n_layers, config.mlp_hidden
    w = Weights(fmt, weights, cfg=cfg)
    sd = import_head(w, config.vocab_size, d, config.tie_embeddings, embed=EMBED)
    sd["norm.weight"] = w.pop("model.norm.weight", (d,))
    for i in range(n):
        p, q = f"model.layers.{i}.", f"blocks.{i}."
        sd[q + "mixer_norm.weight"] = w.pop(p + "attn_norm.weight", (d,))
        sd[q + "mlp_norm.weight"] = w.pop(p + "mlp_norm.weight", (d,))
        gate = w.pop(p + "mlp.gate_proj.weight", (hidden, d))
        sd[q + "mlp.w_in.weight"] = torch.cat([gate, w.pop(p + "mlp.up_proj.weight", (hidden, d))], 0)
        sd[q + "mlp.w_out.weight"] = w.pop(p + "mlp.down_proj.weight", (d, hidden))
        sd.update(mixer_fn(w, p + "attn.", q + "mixer."))
    w.finish()
    return sd


def _tiled(t: Tensor, heads: int, G: int) -> Tensor:
    """``t [heads · C, ...]``, the rows of ``heads`` heads, with each head's rows repeated for the
    ``G`` consecutive heads it serves (``[heads · G · C, ...]``; fla's ``repeat('... (h d) -> ...
    (h g) d')`` of grouped key/value heads)."""
    return t if G == 1 else t.unflatten(0, (heads, -1)).repeat_interleave(G, dim=0).flatten(0, 1)


def _qkv(
    w: Weights,
    a: str,
    q: str,
    d: int,
    widths: tuple[int, int, int],
    conv: int | None,
    kv_heads=None,
    G: int = 1,
) -> dict:
    """fla's ``q_proj, k_proj, v_proj`` (and with ``conv`` taps its ``q_conv1d, k_conv1d, v_conv1d``)
    as mnemo's ``qkv_proj`` (``[q | k | v]``) and one short convolution over those channels. With
    ``G > 1`` (GLA's / RetNet's ``num_kv_heads = kv_heads``), fla's ``k`` and ``v`` weights hold
    ``kv_heads`` heads, each tiled to ``G`` heads (``widths`` are the tiled widths); the convolution
    is depthwise, so tiling its taps is exact too."""
    names = ("q", "k", "v")

    def take(n: str, c: int, tail: tuple[int, ...], what: str) -> Tensor:
        if n == "q" or G == 1:
            return w.pop(f"{a}{n}{what}", (c, *tail))
        return _tiled(w.pop(f"{a}{n}{what}", (c // G, *tail)), kv_heads, G)

    sd = {q + "qkv_proj.weight": torch.cat([take(n, c, (d,), "_proj.weight") for n, c in zip(names, widths)])}
    if conv is not None:
        sd[q + "conv.weight"] = torch.cat(
            [take(n, c, (1, conv), "_conv1d.weight") for n, c in zip(names, widths)]
        )
    return sd


def import_gla(hf_config: dict, weights: dict[str, Tensor]) -> tuple[ModelConfig, dict[str, Tensor]]:
    """An fla ``GLAForCausalLM`` checkpoint (``config.json`` as a dict, its state dict) as a mnemo
    ``(ModelConfig, state dict)`` of ``"gla"`` layers with SwiGLU MLPs (see the module docstring).
    Raises ``ValueError`` naming the field and the value received for anything not reproduced
    exactly, and naming the weight for a missing, mis-shaped or unexpected one."""
    return _import_gated_linear(GLA, dict(hf_config), weights, "gla")


def import_retnet(hf_config: dict, weights: dict[str, Tensor]) -> tuple[ModelConfig, dict[str, Tensor]]:
    """An fla ``RetNetForCausalLM`` checkpoint as a mnemo ``(ModelConfig, state dict)`` of ``"retnet"``
    layers with SwiGLU MLPs (see the module docstring). Raises ``ValueError`` as :func:`import_gla`."""
    return _import_gated_linear(RETNET, dict(hf_config), weights, "retnet")


def _import_gated_linear(fmt: ConfigFormat, cfg: dict, weights: dict[str, Tensor], kind: str):
    """GLA (``kind`` ``"gla"``) or RetNet (``"retnet"``): the same layer but for the decay (GLA's
    low-rank gate; RetNet's fixed per-head ``γ`` and rotary positions) and RetNet's missing short
    convolutions (fla's ``RetNetBlock`` does not pass ``use_short_conv``)."""
    n, d, eps = _common(fmt, cfg, kind)
    H = _int(fmt, cfg, "num_heads")
    what = "GLA" if kind == "gla" else "RetNet"
    kv = cfg.get("num_kv_heads")
    if kv is not None and (not is_int(kv) or kv < 1 or H % kv):
        fmt.refuse(f"field 'num_kv_heads' = {kv!r}: expected null or a divisor of num_heads = {H}")
    # grouped key/value heads: fla projects k, v (and GLA's gate) for num_kv_heads heads and repeats
    # each to G consecutive heads; the import tiles those rows (exact; fine-tuning unties the copies)
    Hk = H if kv is None else kv
    G = H // Hk
    refused = (("feature_map", "a feature map on q and k"), ("clamp_min", "a floor on the log gates"))
    for key, said in refused[: 2 if kind == "gla" else 1]:
        if cfg.get(key) is not None:
            fmt.refuse(
                f"field {key!r} = {cfg[key]!r}: {said} is not supported by mnemo's {what} (expected null)"
            )
    _only(fmt, cfg, "use_output_gate", (True,), f"mnemo's {what} gates its read-out with silu(g_proj x)")
    affine = _only(fmt, cfg, "elementwise_affine", (True, False, None), "the read-out norm's weight")
    conv = None
    if kind == "gla" and _bool(fmt, cfg, "use_short_conv"):
        conv = _int(fmt, cfg, "conv_size")
    fused = _bool(fmt, cfg, "fuse_norm")
    K, V = _per_head(fmt, cfg, "expand_k", d, H), _per_head(fmt, cfg, "expand_v", d, H)
    expand_k, expand_v = _number(fmt, cfg, "expand_k"), _number(fmt, cfg, "expand_v")
    if (max(1, int(d * expand_k) // H), max(1, int(d * expand_v) // H)) != (K, V):  # (a float's rounding)
        fmt.refuse(
            f"fields 'expand_k' = {expand_k!r}, 'expand_v' = {expand_v!r}: mnemo's {what} rounds them apart"
        )
    if kind == "retnet" and K % 2:
        fmt.refuse(
            f"field 'expand_k' = {expand_k!r}: rotary positions need an even key size per head, got {K}"
        )
    options = dict(
        n_heads=H, expand_k=expand_k, expand_v=expand_v, short_conv=conv is not None, conv_size=conv or 4,
        norm_eps=eps,
    )  # fmt: skip
    if kind == "gla":
        options |= dict(gate_rank=GLA_GATE_RANK, gate_normalizer=GLA_GATE_NORMALIZER)
    config = _model_config(fmt, cfg, weights, d, n, kind, options, eps)

    def mixer(w: Weights, a: str, q: str) -> dict:
        sd = _qkv(w, a, q, d, (H * K, H * K, H * V), conv, Hk, G)
        if conv is not None:  # (fla's convolutions have no bias; mnemo's GLA convolution has one)
            sd[q + "conv.bias"] = torch.zeros(H * (2 * K + V), dtype=sd[q + "conv.weight"].dtype)
        if kind == "gla":
            sd[q + "gate_proj.0.weight"] = w.pop(a + "gk_proj.0.weight", (GLA_GATE_RANK, d))
            gk = (
                w.pop(a + "gk_proj.1.weight", (Hk * K, GLA_GATE_RANK)),
                w.pop(a + "gk_proj.1.bias", (Hk * K,)),
            )
            sd[q + "gate_proj.1.weight"], sd[q + "gate_proj.1.bias"] = (_tiled(t, Hk, G) for t in gk)
        sd[q + "out_gate.weight"] = w.pop(a + "g_proj.weight", (H * V, d))
        if affine:
            norm = a + ("g_norm_swish_gate.weight" if fused else "g_norm.weight")
            sd[q + "norm.weight"] = w.pop(norm, (V,))
        else:
            sd[q + "norm.weight"] = torch.ones(V, dtype=sd[q + "out_gate.weight"].dtype)
        sd[q + "o_proj.weight"] = w.pop(a + "o_proj.weight", (d, H * V))
        return sd

    return config, _import_weights(fmt, cfg, weights, config, mixer)


def _delta_weights(w: Weights, a: str, q: str, d: int, sizes: tuple[int, int, int, int], conv, gate) -> dict:
    """The weights DeltaNet and Gated DeltaNet share: ``q, k, v`` (and convolutions), ``b_proj`` →
    ``beta_proj``, ``g_proj`` (where ``gate``), ``o_norm`` → ``norm``, ``o_proj``; ``sizes``:
    ``(key heads, K, value heads, V)``."""
    Hk, K, Hv, V = sizes
    sd = _qkv(w, a, q, d, (Hk * K, Hk * K, Hv * V), conv)
    sd[q + "beta_proj.weight"] = w.pop(a + "b_proj.weight", (Hv, d))
    if gate:
        sd[q + "g_proj.weight"] = w.pop(a + "g_proj.weight", (Hv * V, d))
    sd[q + "norm.weight"] = w.pop(a + "o_norm.weight", (V,))
    sd[q + "o_proj.weight"] = w.pop(a + "o_proj.weight", (d, Hv * V))
    return sd


def import_delta_net(hf_config: dict, weights: dict[str, Tensor]) -> tuple[ModelConfig, dict[str, Tensor]]:
    """An fla ``DeltaNetForCausalLM`` checkpoint as a mnemo ``(ModelConfig, state dict)`` of
    ``"deltanet"`` layers with SwiGLU MLPs (see the module docstring). Raises ``ValueError`` as
    :func:`import_gla` does."""
    fmt, cfg = DELTA_NET, dict(hf_config)
    n, d, eps = _common(fmt, cfg, "delta_net")
    H = _int(fmt, cfg, "num_heads")
    _only(fmt, cfg, "qk_activation", ("silu",), "mnemo's DeltaNet applies SiLU to q and k")
    _only(fmt, cfg, "qk_norm", ("l2",), "mnemo's DeltaNet L2-normalises q and k")
    _only(fmt, cfg, "use_beta", (True,), "mnemo's DeltaNet writes with beta = sigmoid(b_proj x)")
    conv = _int(fmt, cfg, "conv_size") if _bool(fmt, cfg, "use_short_conv") else None
    gate, neg = _bool(fmt, cfg, "use_gate"), _bool(fmt, cfg, "allow_neg_eigval")
    K, V = _per_head(fmt, cfg, "expand_k", d, H), _per_head(fmt, cfg, "expand_v", d, H)
    options = dict(
        n_heads=H, head_dim=K, value_head_dim=V, short_conv=conv is not None, conv_size=conv or 4,
        output_gate=gate, conv_bias=False, beta_bias=False, allow_neg_eigval=neg, qk_norm_eps=QK_L2NORM_EPS,
        norm_eps=eps,
    )  # fmt: skip
    config = _model_config(fmt, cfg, weights, d, n, "deltanet", options, eps)

    def mixer(w: Weights, a: str, q: str) -> dict:
        return _delta_weights(w, a, q, d, (H, K, H, V), conv, gate)

    return config, _import_weights(fmt, cfg, weights, config, mixer)


def import_gated_deltanet(
    hf_config: dict, weights: dict[str, Tensor]
) -> tuple[ModelConfig, dict[str, Tensor]]:
    """An fla ``GatedDeltaNetForCausalLM`` checkpoint as a mnemo ``(ModelConfig, state dict)`` of
    ``"gated_deltanet"`` layers with SwiGLU MLPs (see the module docstring). Raises ``ValueError`` as
    :func:`import_gla` does."""
    fmt, cfg = GATED_DELTANET, dict(hf_config)
    n, d, eps = _common(fmt, cfg, "gated_deltanet")
    H, K = _int(fmt, cfg, "num_heads"), _int(fmt, cfg, "head_dim")
    Hv = _int(fmt, cfg, "num_v_heads") if cfg.get("num_v_heads") is not None else H
    if Hv % H:
        fmt.refuse(
            f"field 'num_v_heads' = {Hv}: expected a multiple of num_heads = {H} (grouped value heads)"
        )
    ratio = _number(fmt, cfg, "expand_v")
    V = int(K * ratio)
    if V < 1 or not math.isclose(K * ratio, V, rel_tol=1e-5):
        fmt.refuse(f"field 'expand_v' = {ratio!r}: head_dim · expand_v = {K * ratio:g} is not a whole number")
    _only(fmt, cfg, "output_gate_activation", ("swish", "silu"), "mnemo gates the read-out with silu")
    conv = _int(fmt, cfg, "conv_size") if _bool(fmt, cfg, "use_short_conv") else None
    gate, neg = _bool(fmt, cfg, "use_gate"), _bool(fmt, cfg, "allow_neg_eigval")
    options = dict(
        n_heads=H, head_dim=K, value_head_dim=V, n_v_heads=Hv, short_conv=conv is not None,
        conv_size=conv or 4,
        output_gate=gate, conv_bias=False, beta_bias=False, allow_neg_eigval=neg, qk_norm_eps=QK_L2NORM_EPS,
        norm_eps=eps,
    )  # fmt: skip
    config = _model_config(fmt, cfg, weights, d, n, "gated_deltanet", options, eps)

    def mixer(w: Weights, a: str, q: str) -> dict:
        sd = _delta_weights(w, a, q, d, (H, K, Hv, V), conv, gate)
        sd[q + "a_proj.weight"] = w.pop(a + "a_proj.weight", (Hv, d))
        sd[q + "A_log"] = w.pop(a + "A_log", (Hv,))
        sd[q + "dt_bias"] = w.pop(a + "dt_bias", (Hv,))
        return sd

    return config, _import_weights(fmt, cfg, weights, config, mixer)


#: ``(architecture, model_type, import function)`` of each format, as :mod:`mnemo.hf.convert` registers them
FORMATS = (
    ("GLAForCausalLM", "gla", import_gla),
    ("RetNetForCausalLM", "retnet", import_retnet),
    ("DeltaNetForCausalLM", "delta_net", import_delta_net),
    ("GatedDeltaNetForCausalLM", "gated_deltanet", import_gated_deltanet),
)
