"""Qwen3-Next (Gated DeltaNet / gated-attention hybrids) in and out of mnemo.

:func:`import_qwen3_next` turns a ``transformers`` Qwen3-Next config (a dict, as in
``config.json``) and its state dict into a :class:`~mnemo.models.ModelConfig` and a state dict that
``LanguageModel(config).load_state_dict(sd, strict=True)`` accepts; :func:`export_qwen3_next` does
the reverse (a config dict and a state dict that ``Qwen3NextForCausalLM`` loads). Both functions
work on plain dicts and tensors: neither imports ``transformers``.

The correspondence, layer by layer:

* ``linear_attention`` layers → ``"gated_deltanet"``
  (:class:`~mnemo.layers.delta.DeltaNet` with ``gated=True``): ``n_heads`` = key heads,
  ``n_v_heads`` = value heads (grouped), ``head_dim`` / ``value_head_dim`` = key / value widths,
  no conv bias, no β bias, ``qk_norm_eps = 1e-6`` (the kernel's ``l2norm``), output norm epsilon
  ``rms_norm_eps`` and ``silu(z)`` output gate. ``in_proj_qkvz`` (per key head ``[q | k | v | z]``)
  and ``in_proj_ba`` (per key head ``[b | a]``) are re-laid out as mnemo's ``qkv_proj`` (``[q |
  k | v]``, each head-major), ``g_proj`` (z), ``beta_proj`` (b) and ``a_proj`` (a).
* ``full_attention`` layers → ``"attention"`` with ``qk_norm``, ``output_gate`` (the second half
  of each head's ``q_proj`` rows), partial rotary (``rotary_dim = head_dim ·
  partial_rotary_factor``) and ``bias = attention_bias``.
* dense MLPs (``Qwen3NextMLP``) → SwiGLU ``w_in = [gate; up]``; sparse MoE MLPs
  (``Qwen3NextSparseMoeBlock``) → :class:`~mnemo.layers.MoE` (``mlp="moe"``) with
  ``n_experts = num_experts``, ``top_k = num_experts_per_tok``, ``expert_hidden =
  moe_intermediate_size``, ``norm_topk_prob``, a shared expert of ``shared_expert_intermediate_size``
  with its sigmoid gate, no capacity limit and no balancing bias: the router ``gate.weight`` →
  ``router.weight``; the experts' ``gate_up_proj [E, 2I, d]`` (in memory) or per-expert
  ``experts.{e}.gate_proj / up_proj / down_proj`` (the files ``save_pretrained`` writes) →
  ``w_in [E, 2I, d]`` (``[gate; up]``) and ``w_out [E, d, I]``; ``shared_expert.*`` →
  ``shared_expert`` (SwiGLU) and ``shared_expert_gate`` → ``shared_gate``. The routing is the
  same: softmax over all experts, top-k of the probabilities, renormalised when ``norm_topk_prob``.
  A checkpoint mixing dense and MoE layers (``mlp_only_layers`` / ``decoder_sparse_step`` selecting
  some) keeps the dense ones as mnemo's ``mlp_only_layers`` (SwiGLUs of ``intermediate_size``).
  ``router_aux_loss_coef`` ``c`` becomes ``aux_loss_coef = c · k / L`` (``L`` the sparse layers;
  training only): transformers pools the sparse layers and counts ``k`` choices per token in its
  version of the loss (:func:`~mnemo.hf.fields.aux_loss_coef_from_hf`, as the Llama-family MoE
  classes).
  Export of MoE models is not supported yet.
* Qwen3-Next's RMSNorms (block norms, final norm, q/k norms) are zero-centred (``x̂ · (1 + w)``);
  mnemo's multiply by the weight, so ``w + 1`` is stored on import (in float32, or float64 for a
  float64 checkpoint — the exact value Qwen3-Next multiplies by) and ``w − 1`` on export. The gated
  norm of the linear-attention layers multiplies by ``w`` directly and is copied.

Anything mnemo cannot express exactly raises ``ValueError`` naming the option; nothing is
approximated. RoPE is plain, or YaRN as ``transformers`` computes it, both ways: a checkpoint's
``rope_type`` ``"yarn"`` (in ``rope_parameters``, or in a non-empty legacy ``rope_scaling``, which
``transformers`` reads in its place) becomes mnemo's ``"yarn_hf"``
(:func:`~mnemo.layers.rotary.check_rope_scaling`; the same frequencies and cos/sin factor), and
back on export; any other ``rope_type`` is refused on import, and a mnemo model's other
``mixer_options['attention']['rope_scaling']`` (linear, NTK, the paper's YaRN) on export.
``attention_dropout`` acts only in training and is not carried; multi-token
prediction weights (``mtp.*``, unused by ``Qwen3NextForCausalLM``) are dropped on import.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..layers.mlp import swiglu_hidden
from ..layers.rotary import check_rope_scaling
from ..models.config import ModelConfig
from .fields import (
    ConfigFormat,
    Weights,
    aux_loss_coef_from_hf,
    decoder_fields,
    export_head,
    import_head,
    is_int,
    mixer_options,
    refuse_unexpressed,
    rope_fields,
    rope_parameters,
    tied_as_loaded,
)

#: ``Qwen3NextConfig``'s defaults for the fields the conversion reads (a ``config.json`` may
#: leave defaults out)
HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "decoder_sparse_step": 1,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "norm_topk_prob": True,
    "router_aux_loss_coef": 0.001,
    "mlp_only_layers": None,
    "layer_types": None,
    "initializer_range": 0.02,
    "max_position_embeddings": 32768,
}
LINEAR, FULL = "linear_attention", "full_attention"
GDN, ATTN = "gated_deltanet", "attention"
#: the L2-normalisation epsilon of Qwen3-Next's delta-rule kernel (fixed, not a config field)
QK_L2NORM_EPS = 1e-6


#: config fields that are true / false (a string "no" would read as true)
_BOOL_FIELDS = ("attention_bias", "tie_word_embeddings", "norm_topk_prob")

#: the config fields that decide the shape of each weight, by the end of its name in the file
#: (the longest matching end counts)
SHAPE_FIELDS: dict[str, tuple[str, ...]] = {
    "embed_tokens.weight": ("vocab_size", "hidden_size"),
    "lm_head.weight": ("vocab_size", "hidden_size"),
    "norm.weight": ("hidden_size",),
    "input_layernorm.weight": ("hidden_size",),
    "post_attention_layernorm.weight": ("hidden_size",),
    "mlp.gate_proj.weight": ("intermediate_size", "hidden_size"),
    "mlp.up_proj.weight": ("intermediate_size", "hidden_size"),
    "mlp.down_proj.weight": ("intermediate_size", "hidden_size"),
    "linear_attn.in_proj_qkvz.weight": (
        "linear_num_key_heads", "linear_key_head_dim", "linear_num_value_heads", "linear_value_head_dim",
        "hidden_size",
    ),
    "linear_attn.in_proj_ba.weight": ("linear_num_value_heads", "hidden_size"),
    "linear_attn.conv1d.weight": (
        "linear_num_key_heads", "linear_key_head_dim", "linear_num_value_heads", "linear_value_head_dim",
        "linear_conv_kernel_dim",
    ),
    "linear_attn.A_log": ("linear_num_value_heads",),
    "linear_attn.dt_bias": ("linear_num_value_heads",),
    "linear_attn.norm.weight": ("linear_value_head_dim",),
    "linear_attn.out_proj.weight": ("hidden_size", "linear_num_value_heads", "linear_value_head_dim"),
    "self_attn.q_proj.weight": ("num_attention_heads", "head_dim", "hidden_size"),
    "self_attn.q_proj.bias": ("num_attention_heads", "head_dim"),
    "self_attn.k_proj.weight": ("num_key_value_heads", "head_dim", "hidden_size"),
    "self_attn.k_proj.bias": ("num_key_value_heads", "head_dim"),
    "self_attn.v_proj.weight": ("num_key_value_heads", "head_dim", "hidden_size"),
    "self_attn.v_proj.bias": ("num_key_value_heads", "head_dim"),
    "self_attn.o_proj.weight": ("hidden_size", "num_attention_heads", "head_dim"),
    "self_attn.o_proj.bias": ("hidden_size",),
    "self_attn.q_norm.weight": ("head_dim",),
    "self_attn.k_norm.weight": ("head_dim",),
    "mlp.gate.weight": ("num_experts", "hidden_size"),
    "mlp.experts.gate_up_proj": ("num_experts", "moe_intermediate_size", "hidden_size"),
    "mlp.experts.down_proj": ("num_experts", "moe_intermediate_size", "hidden_size"),
    "gate_proj.weight": ("moe_intermediate_size", "hidden_size"),  # experts.{e}.*
    "up_proj.weight": ("moe_intermediate_size", "hidden_size"),
    "down_proj.weight": ("moe_intermediate_size", "hidden_size"),
    "shared_expert.gate_proj.weight": ("shared_expert_intermediate_size", "hidden_size"),
    "shared_expert.up_proj.weight": ("shared_expert_intermediate_size", "hidden_size"),
    "shared_expert.down_proj.weight": ("shared_expert_intermediate_size", "hidden_size"),
    "shared_expert_gate.weight": ("hidden_size",),
}  # fmt: skip


#: the format: its refusals say "Qwen3-Next conversion: …"
QWEN3_NEXT = ConfigFormat("Qwen3-Next", HF_DEFAULTS, SHAPE_FIELDS)
_refuse, _get, _require = QWEN3_NEXT.refuse, QWEN3_NEXT.get, QWEN3_NEXT.require
_init_std, _is_int, _options = QWEN3_NEXT.init_std, is_int, mixer_options


def _rope(cfg: dict) -> tuple[float, float, dict | None]:
    """``(rope_theta, partial_rotary_factor, rope_scaling)``
    (:func:`~mnemo.hf.fields.rope_fields`): ``rope_scaling`` is ``None`` for ``rope_type``
    ``"default"`` and mnemo's ``"yarn_hf"`` mapping (``transformers``' YaRN, exactly) for ``"yarn"``;
    other RoPE types are refused. ``partial_rotary_factor`` defaults to Qwen3-Next's 0.25."""
    kinds = {"default": "plain RoPE", "yarn": "transformers' YaRN"}
    return rope_fields(QWEN3_NEXT, cfg, kinds=kinds, partial_default=0.25)


def _layer_types(cfg: dict, n: int) -> list[str]:
    types = cfg.get("layer_types")
    if types is None:
        interval = cfg.get("full_attention_interval", 4)
        types = [LINEAR if (i + 1) % interval else FULL for i in range(n)]
    if not isinstance(types, list):
        _refuse(
            f"field 'layer_types': expected a list of {LINEAR!r} / {FULL!r}, one per layer, got {types!r}"
        )
    if len(types) != n:
        _refuse(f"layer_types has {len(types)} entries for num_hidden_layers = {n}")
    for i, t in enumerate(types):
        if t not in (LINEAR, FULL):
            _refuse(f"layer_types[{i}] = {t!r}: expected {LINEAR!r} or {FULL!r}")
    return list(types)


def _moe_layers(cfg: dict, n: int) -> list[int]:
    """The layers with a sparse MoE MLP, as ``Qwen3NextDecoderLayer`` picks them; ``ValueError``
    naming ``num_experts``, ``decoder_sparse_step`` or ``mlp_only_layers`` when of the wrong kind."""
    only = _get(cfg, "mlp_only_layers") or []
    experts, step = _get(cfg, "num_experts"), _get(cfg, "decoder_sparse_step")
    if not isinstance(only, list) or not all(_is_int(i) for i in only):
        _refuse(f"field 'mlp_only_layers': expected a list of layer indices, got {only!r}")
    if not _is_int(experts) or experts < 0:
        _refuse(f"field 'num_experts': expected an int >= 0 (0: dense MLPs), got {experts!r}")
    if experts == 0:
        return []
    if not _is_int(step) or step < 1:
        _refuse(f"field 'decoder_sparse_step': expected a positive int, got {step!r}")
    return [i for i in range(n) if i not in only and (i + 1) % step == 0]


def _plus_one(w: Tensor) -> Tensor:
    """``1 + w`` as Qwen3-Next multiplies by it: float32 (float64 for float64 weights)."""
    cd = torch.float64 if w.dtype == torch.float64 else torch.float32
    return w.to(cd) + 1.0


def _minus_one(w: Tensor) -> Tensor:
    cd = torch.float64 if w.dtype == torch.float64 else torch.float32
    return (w.to(cd) - 1.0).to(w.dtype)


def _Weights(weights: dict[str, Tensor], ignore: tuple[str, ...] = (), cfg: dict | None = None) -> Weights:
    """A state dict consumed key by key (:class:`~mnemo.hf.fields.Weights`), refusals as Qwen3-Next's."""
    return Weights(QWEN3_NEXT, weights, ignore, cfg)


def import_qwen3_next(hf_config: dict, weights: dict[str, Tensor]) -> tuple[ModelConfig, dict[str, Tensor]]:
    """A ``transformers`` Qwen3-Next checkpoint as a mnemo ``(ModelConfig, state dict)``.

    ``hf_config``: the config dict (``config.json`` or ``Qwen3NextConfig.to_dict()``);
    ``weights``: the ``Qwen3NextForCausalLM`` state dict (``model.*``, ``lm_head.weight``).
    Raises ``ValueError`` for RoPE scaling other than YaRN, another
    activation than SiLU, a true/false field (``attention_bias``, ``tie_word_embeddings``,
    ``norm_topk_prob``) of another kind, a missing, mis-shaped (naming the config fields that set
    the shape) or unexpected weight — anything not reproduced exactly.
    """
    cfg = dict(hf_config)
    if cfg.get("model_type", "qwen3_next") != "qwen3_next":
        _refuse(f"model_type {cfg['model_type']!r} is not 'qwen3_next'")
    for k in _BOOL_FIELDS:
        if cfg.get(k) is not None and not isinstance(cfg[k], bool):
            _refuse(f"field {k!r}: expected true or false, got {cfg[k]!r}")
    n, d = _get(cfg, "num_hidden_layers"), _get(cfg, "hidden_size")
    if _get(cfg, "hidden_act") != "silu":
        _refuse(f"hidden_act {cfg['hidden_act']!r} is not supported (only 'silu')")
    types = _layer_types(cfg, n)
    moe = _moe_layers(cfg, n)
    dense = sorted(set(range(n)) - set(moe)) if moe else []  # (mnemo's mlp_only_layers)
    moe_options = _moe_options(cfg, len(moe)) if moe else None
    eps = float(_get(cfg, "rms_norm_eps"))
    theta, factor, scaling = _rope(cfg)
    H, H_kv, D = _get(cfg, "num_attention_heads"), _get(cfg, "num_key_value_heads"), _get(cfg, "head_dim")
    rotary_dim = int(D * factor)
    if rotary_dim < 2 or rotary_dim % 2:
        _refuse(
            f"partial_rotary_factor {factor} gives {rotary_dim} rotary channels of head_dim {D}; "
            "expected an even number >= 2"
        )
    bias = bool(_get(cfg, "attention_bias"))
    Hk, Hv = _get(cfg, "linear_num_key_heads"), _get(cfg, "linear_num_value_heads")
    K, V = _get(cfg, "linear_key_head_dim"), _get(cfg, "linear_value_head_dim")
    W = _get(cfg, "linear_conv_kernel_dim")
    if LINEAR in types and Hv % Hk:
        _refuse(f"linear_num_value_heads ({Hv}) must be a multiple of linear_num_key_heads ({Hk})")
    G = Hv // Hk if Hk else 1
    hidden = _get(cfg, "intermediate_size")
    tie = tied_as_loaded(QWEN3_NEXT, cfg, weights)  # (a head unlike the embedding: untied, as loaded)

    options: dict[str, dict[str, Any]] = {}
    if LINEAR in types:
        options[GDN] = dict(
            n_heads=Hk, head_dim=K, value_head_dim=V, n_v_heads=Hv, short_conv=True, conv_size=W,
            output_gate=True, conv_bias=False, beta_bias=False, allow_neg_eigval=False,
            qk_norm_eps=QK_L2NORM_EPS, norm_eps=eps,
        )  # fmt: skip
    if FULL in types:
        options[ATTN] = dict(
            n_heads=H, n_kv_heads=H_kv, head_dim=D, rope=True, rope_theta=theta, window=None,
            qk_norm=True, output_gate=True, bias=bias, norm_eps=eps,
        )  # fmt: skip
        if rotary_dim != D:
            options[ATTN]["rotary_dim"] = rotary_dim
        if scaling is not None:
            options[ATTN]["rope_scaling"] = scaling
    config = ModelConfig(
        vocab_size=_get(cfg, "vocab_size"),
        d_model=d,
        n_layers=n,
        layers=[GDN if t == LINEAR else ATTN for t in types],
        mixer_options=options,
        mlp="moe" if moe else "swiglu",
        mlp_hidden=hidden,
        mlp_options=moe_options or {},
        mlp_only_layers=dense or None,
        pos_embedding="none",
        tie_embeddings=tie,
        norm_eps=eps,
        init_std=_init_std(_get(cfg, "initializer_range")),
    ).validate()

    w = _Weights(weights, ignore=("mtp.",), cfg=cfg)
    sd: dict[str, Tensor] = import_head(w, config.vocab_size, d, tie)
    sd["norm.weight"] = _plus_one(w.pop("model.norm.weight", (d,)))
    for i, t in enumerate(types):
        p, q = f"model.layers.{i}.", f"blocks.{i}."
        sd[q + "mixer_norm.weight"] = _plus_one(w.pop(p + "input_layernorm.weight", (d,)))
        sd[q + "mlp_norm.weight"] = _plus_one(w.pop(p + "post_attention_layernorm.weight", (d,)))
        if moe_options is not None and i not in dense:
            sd.update(_import_moe(w, p + "mlp.", q + "mlp.", moe_options, d))
        else:
            gate = w.pop(p + "mlp.gate_proj.weight", (hidden, d))
            up = w.pop(p + "mlp.up_proj.weight", (hidden, d))
            sd[q + "mlp.w_in.weight"] = torch.cat([gate, up], 0)
            sd[q + "mlp.w_out.weight"] = w.pop(p + "mlp.down_proj.weight", (d, hidden))
        if t == LINEAR:
            a = p + "linear_attn."
            qkvz = w.pop(a + "in_proj_qkvz.weight", (Hk * (2 * K + 2 * G * V), d)).reshape(Hk, -1, d)
            wq, wk, wv, wz = qkvz.split((K, K, G * V, G * V), dim=1)
            sd[q + "mixer.qkv_proj.weight"] = torch.cat(
                [wq.reshape(Hk * K, d), wk.reshape(Hk * K, d), wv.reshape(Hv * V, d)], 0
            )
            sd[q + "mixer.g_proj.weight"] = wz.reshape(Hv * V, d)
            ba = w.pop(a + "in_proj_ba.weight", (2 * Hv, d)).reshape(Hk, 2 * G, d)
            wb, wa = ba.split((G, G), dim=1)
            sd[q + "mixer.beta_proj.weight"] = wb.reshape(Hv, d)
            sd[q + "mixer.a_proj.weight"] = wa.reshape(Hv, d)
            sd[q + "mixer.conv.weight"] = w.pop(a + "conv1d.weight", (2 * Hk * K + Hv * V, 1, W))
            sd[q + "mixer.A_log"] = w.pop(a + "A_log", (Hv,))
            sd[q + "mixer.dt_bias"] = w.pop(a + "dt_bias", (Hv,))
            sd[q + "mixer.norm.weight"] = w.pop(a + "norm.weight", (V,))
            sd[q + "mixer.o_proj.weight"] = w.pop(a + "out_proj.weight", (d, Hv * V))
        else:
            a = p + "self_attn."
            wqg = w.pop(a + "q_proj.weight", (H * 2 * D, d)).reshape(H, 2 * D, d)
            sd[q + "mixer.q_proj.weight"] = wqg[:, :D].reshape(H * D, d)
            sd[q + "mixer.gate_proj.weight"] = wqg[:, D:].reshape(H * D, d)
            wk = w.pop(a + "k_proj.weight", (H_kv * D, d))
            wv = w.pop(a + "v_proj.weight", (H_kv * D, d))
            sd[q + "mixer.kv_proj.weight"] = torch.cat([wk, wv], 0)
            sd[q + "mixer.o_proj.weight"] = w.pop(a + "o_proj.weight", (d, H * D))
            if bias:
                bqg = w.pop(a + "q_proj.bias", (H * 2 * D,)).reshape(H, 2 * D)
                sd[q + "mixer.q_proj.bias"] = bqg[:, :D].reshape(H * D)
                sd[q + "mixer.gate_proj.bias"] = bqg[:, D:].reshape(H * D)
                bk = w.pop(a + "k_proj.bias", (H_kv * D,))
                sd[q + "mixer.kv_proj.bias"] = torch.cat([bk, w.pop(a + "v_proj.bias", (H_kv * D,))])
                sd[q + "mixer.o_proj.bias"] = w.pop(a + "o_proj.bias", (d,))
            sd[q + "mixer.q_norm.weight"] = _plus_one(w.pop(a + "q_norm.weight", (D,)))
            sd[q + "mixer.k_norm.weight"] = _plus_one(w.pop(a + "k_norm.weight", (D,)))
    w.finish()
    return config, sd


def _moe_options(cfg: dict, n_sparse: int) -> dict[str, Any]:
    """``mlp_options`` of the :class:`~mnemo.layers.MoE` equivalent to ``Qwen3NextSparseMoeBlock``
    (``n_sparse``: the number of sparse layers, for the balance loss's coefficient)."""
    E, k = _get(cfg, "num_experts"), _get(cfg, "num_experts_per_tok")
    shared = _get(cfg, "shared_expert_intermediate_size")
    if not 1 <= k <= E:
        _refuse(f"num_experts_per_tok = {k}: expected 1 <= k <= num_experts = {E}")
    if shared < 1:
        _refuse(f"shared_expert_intermediate_size = {shared}: expected a shared expert (>= 1)")
    return {
        "n_experts": E,
        "top_k": k,
        "expert_hidden": _get(cfg, "moe_intermediate_size"),
        "shared_expert_hidden": shared,
        "shared_expert_gate": True,
        "norm_topk_prob": bool(_get(cfg, "norm_topk_prob")),
        "aux_loss_coef": aux_loss_coef_from_hf(_get(cfg, "router_aux_loss_coef"), k, n_sparse),
    }


def _import_moe(w: Weights, p: str, q: str, o: dict[str, Any], d: int) -> dict[str, Tensor]:
    """One sparse MoE block's weights (prefix ``p`` = ``model.layers.{i}.mlp.``) as mnemo's
    (prefix ``q``): fused expert tensors (a ``state_dict``) or per-expert ones (files)."""
    E, I, S = o["n_experts"], o["expert_hidden"], o["shared_expert_hidden"]
    sd = {q + "router.weight": w.pop(p + "gate.weight", (E, d))}
    if p + "experts.gate_up_proj" in w:
        sd[q + "w_in"] = w.pop(p + "experts.gate_up_proj", (E, 2 * I, d))
        sd[q + "w_out"] = w.pop(p + "experts.down_proj", (E, d, I))
    else:
        e = p + "experts.{}."
        gate = [w.pop(e.format(j) + "gate_proj.weight", (I, d)) for j in range(E)]
        up = [w.pop(e.format(j) + "up_proj.weight", (I, d)) for j in range(E)]
        sd[q + "w_in"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
        sd[q + "w_out"] = torch.stack([w.pop(e.format(j) + "down_proj.weight", (d, I)) for j in range(E)])
    s = p + "shared_expert."
    sd[q + "shared_expert.w_in.weight"] = torch.cat(
        [w.pop(s + "gate_proj.weight", (S, d)), w.pop(s + "up_proj.weight", (S, d))]
    )
    sd[q + "shared_expert.w_out.weight"] = w.pop(s + "down_proj.weight", (d, S))
    sd[q + "shared_gate.weight"] = w.pop(p + "shared_expert_gate.weight", (1, d))
    return sd


def export_qwen3_next(config: ModelConfig, weights: dict[str, Tensor]) -> tuple[dict, dict[str, Tensor]]:
    """A mnemo ``(ModelConfig, state dict)`` as a ``transformers`` Qwen3-Next ``(config dict,
    state dict)`` that ``Qwen3NextForCausalLM`` loads (``Qwen3NextConfig(**config_dict)``).

    The model must be a stack of ``"gated_deltanet"`` and ``"attention"`` layers with SwiGLU MLPs
    and the options Qwen3-Next fixes (see the module docstring: no conv or β bias, ``qk_norm_eps
    = 1e-6``, output gates, q/k norms, one RMSNorm epsilon throughout, plain RoPE or
    ``transformers``' YaRN: a ``mixer_options['attention']['rope_scaling']`` other than ``None`` or
    ``"yarn_hf"`` is refused, …); anything else raises ``ValueError`` naming the option and the
    received value.
    """
    config = config.validate()
    refuse_unexpressed(QWEN3_NEXT.name, config)
    types = config.layer_mixers()
    for i, m in enumerate(types):
        if m not in (GDN, ATTN):
            _refuse(f"layer {i} uses mixer {m!r}; Qwen3-Next layers are {GDN!r} or {ATTN!r}")
    if config.mlp != "swiglu":
        _refuse(
            f"mlp {config.mlp!r} is not supported (only 'swiglu', Qwen3-Next's dense MLP; exporting "
            "MoE models is not supported yet)"
        )
    if config.pos_embedding != "none":
        _refuse(f"pos_embedding {config.pos_embedding!r} is not supported (Qwen3-Next uses RoPE only)")
    d, eps = config.d_model, config.norm_eps
    hidden = config.mlp_hidden or swiglu_hidden(d)
    g, a = _options(GDN, config), _options(ATTN, config)
    for key, val in dict(
        gated=True, short_conv=True, output_gate=True, conv_bias=False, beta_bias=False,
        allow_neg_eigval=False, qk_norm_eps=QK_L2NORM_EPS, norm_eps=eps,
    ).items():  # fmt: skip
        if GDN in types:
            _require(f"mixer_options[{GDN!r}]", g, key, val)
    for key, val in dict(rope=True, window=None, qk_norm=True, output_gate=True, norm_eps=eps).items():
        if ATTN in types:
            _require(f"mixer_options[{ATTN!r}]", a, key, val)
    scaling = check_rope_scaling(a.get("rope_scaling")) if ATTN in types else None
    if scaling is not None and scaling["rope_type"] != "yarn_hf":
        _refuse(
            f"mixer_options[{ATTN!r}]['rope_scaling'] = {a['rope_scaling']!r}: only plain RoPE (rope_type "
            "'default', rope_scaling None) and transformers' YaRN (rope_type 'yarn_hf') are exported; "
            "another scaled RoPE is refused, not approximated"
        )
    Hk = g["n_heads"]
    K = g["head_dim"] or d // Hk
    V = g["value_head_dim"] or K
    Hv = g["n_v_heads"] or Hk
    G = Hv // Hk
    H = a["n_heads"]
    H_kv = a["n_kv_heads"] or H
    D = a["head_dim"] or d // H
    R = a["rotary_dim"] if a.get("rotary_dim") is not None else D
    factor = R / D
    while int(D * factor) < R:  # R / D rounded down (D = 47, R = 6): transformers' int() would give R − 1
        factor = math.nextafter(factor, math.inf)
    if int(D * factor) != R:
        _refuse(f"rotary_dim {R} of head_dim {D} is not reproduced by partial_rotary_factor {factor}")
    if a.get("bias") == "qkv":  # (Qwen2's biases: attention_bias biases the gate and o too)
        _refuse(
            f"mixer_options[{ATTN!r}] option bias='qkv' (q, k, v biased; gate and o not) has no "
            "Qwen3-Next equivalent: attention_bias biases every projection"
        )
    bias = bool(a["bias"])
    W = g["conv_size"]
    n = config.n_layers
    rope = rope_parameters(a["rope_theta"], scaling, partial_rotary_factor=factor)
    hf = decoder_fields(
        config, "Qwen3NextForCausalLM", "qwen3_next", heads=(H, H_kv, D), hidden=hidden, rope=rope
    )
    hf |= {
        "attention_bias": bias,
        "linear_conv_kernel_dim": W,
        "linear_key_head_dim": K,
        "linear_value_head_dim": V,
        "linear_num_key_heads": Hk,
        "linear_num_value_heads": Hv,
        "num_experts": 0,
        "mlp_only_layers": list(range(n)),
        "layer_types": [LINEAR if m == GDN else FULL for m in types],
    }  # fmt: skip

    w = _Weights(weights)
    sd: dict[str, Tensor] = export_head(w, config)
    sd["model.norm.weight"] = _minus_one(w.pop("norm.weight", (d,)))
    for i, m in enumerate(types):
        p, q = f"model.layers.{i}.", f"blocks.{i}."
        sd[p + "input_layernorm.weight"] = _minus_one(w.pop(q + "mixer_norm.weight", (d,)))
        sd[p + "post_attention_layernorm.weight"] = _minus_one(w.pop(q + "mlp_norm.weight", (d,)))
        gate, up = w.pop(q + "mlp.w_in.weight", (2 * hidden, d)).split(hidden, 0)
        sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"] = gate, up
        sd[p + "mlp.down_proj.weight"] = w.pop(q + "mlp.w_out.weight", (d, hidden))
        if m == GDN:
            a_ = p + "linear_attn."
            wq, wk, wv = w.pop(q + "mixer.qkv_proj.weight", (2 * Hk * K + Hv * V, d)).split(
                (Hk * K, Hk * K, Hv * V), 0
            )
            wz = w.pop(q + "mixer.g_proj.weight", (Hv * V, d))
            sd[a_ + "in_proj_qkvz.weight"] = torch.cat(
                [t.reshape(Hk, -1, d) for t in (wq, wk, wv, wz)], dim=1
            ).reshape(-1, d)
            wb = w.pop(q + "mixer.beta_proj.weight", (Hv, d))
            wa = w.pop(q + "mixer.a_proj.weight", (Hv, d))
            sd[a_ + "in_proj_ba.weight"] = torch.cat(
                [wb.reshape(Hk, G, d), wa.reshape(Hk, G, d)], dim=1
            ).reshape(-1, d)
            sd[a_ + "conv1d.weight"] = w.pop(q + "mixer.conv.weight", (2 * Hk * K + Hv * V, 1, W))
            sd[a_ + "A_log"] = w.pop(q + "mixer.A_log", (Hv,))
            sd[a_ + "dt_bias"] = w.pop(q + "mixer.dt_bias", (Hv,))
            sd[a_ + "norm.weight"] = w.pop(q + "mixer.norm.weight", (V,))
            sd[a_ + "out_proj.weight"] = w.pop(q + "mixer.o_proj.weight", (d, Hv * V))
        else:
            a_ = p + "self_attn."
            wq = w.pop(q + "mixer.q_proj.weight", (H * D, d)).reshape(H, D, d)
            wg = w.pop(q + "mixer.gate_proj.weight", (H * D, d)).reshape(H, D, d)
            sd[a_ + "q_proj.weight"] = torch.cat([wq, wg], 1).reshape(2 * H * D, d)
            sd[a_ + "k_proj.weight"], sd[a_ + "v_proj.weight"] = w.pop(
                q + "mixer.kv_proj.weight", (2 * H_kv * D, d)
            ).split(H_kv * D, 0)
            sd[a_ + "o_proj.weight"] = w.pop(q + "mixer.o_proj.weight", (d, H * D))
            if bias:
                bq = w.pop(q + "mixer.q_proj.bias", (H * D,)).reshape(H, D)
                bg = w.pop(q + "mixer.gate_proj.bias", (H * D,)).reshape(H, D)
                sd[a_ + "q_proj.bias"] = torch.cat([bq, bg], 1).reshape(2 * H * D)
                sd[a_ + "k_proj.bias"], sd[a_ + "v_proj.bias"] = w.pop(
                    q + "mixer.kv_proj.bias", (2 * H_kv * D,)
                ).split(H_kv * D, 0)
                sd[a_ + "o_proj.bias"] = w.pop(q + "mixer.o_proj.bias", (d,))
            sd[a_ + "q_norm.weight"] = _minus_one(w.pop(q + "mixer.q_norm.weight", (D,)))
            sd[a_ + "k_norm.weight"] = _minus_one(w.pop(q + "mixer.k_norm.weight", (D,)))
    w.finish()
    return hf, {k: v.contiguous() for k, v in sd.items()}


def transformers_reference_kernels_off_gpu() -> bool:
    """Make ``transformers``' Qwen3-Next run its own PyTorch gated delta rule when no GPU is
    available. ``transformers`` binds fla-core's Triton kernels at import whenever fla-core is
    installed (``use_kernel_func_from_hub_with_fallback``), whatever the device; without a GPU
    (and without Triton's interpreter) they fail ("0 active drivers"). Rebinds the module's
    ``torch_chunk_gated_delta_rule`` and ``torch_recurrent_gated_delta_rule`` to the PyTorch
    functions they wrap, once per process, and returns whether it did (``False``: CUDA available,
    fla-core absent, or nothing to rebind)."""
    import torch

    if torch.cuda.is_available():
        return False
    try:
        from transformers.models.qwen3_next import modeling_qwen3_next as m
    except ImportError:
        return False
    import functools
    import inspect

    done = False
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        fn = getattr(m, name, None)
        ref = getattr(fn, "__wrapped__", None)
        if ref is None or getattr(fn, "_mnemo_reference", False):
            continue
        params = set(inspect.signature(ref).parameters)

        @functools.wraps(ref)
        def reference(*args, _ref=ref, _params=params, _name=name, **kwargs):
            if kwargs.get("cu_seqlens") is not None:
                raise ValueError(f"{_name}: packed sequences (cu_seqlens) need fla-core's kernels, on a GPU")
            return _ref(*args, **{k: v for k, v in kwargs.items() if k in _params})

        reference._mnemo_reference = True
        setattr(m, name, reference)
        done = True
    return done
