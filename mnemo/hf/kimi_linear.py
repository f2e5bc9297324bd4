"""Moonshot's Kimi Linear (``KimiLinearForCausalLM``, ``model_type`` ``"kimi_linear"``; Kimi Team 2025,
"Kimi Linear: An Expressive, Efficient Attention Architecture", arXiv 2510.26692), the released
hybrid of Kimi Delta Attention (KDA) and multi-head latent attention (MLA) layers with DeepSeek-V3's
mixture of experts, in and out of mnemo.

:func:`import_kimi_linear` turns a ``transformers`` config (a dict, as in ``config.json``) and the
state dict into a :class:`~mnemo.models.ModelConfig` and a state dict that
``LanguageModel(config).load_state_dict(sd, strict=True)`` accepts; :func:`export_kimi_linear` does
the reverse. Plain dicts and tensors: nothing here imports ``transformers``, and no checkpoint's
remote code is run.

The function (``transformers`` 5.25, ``models/kimi_linear/modeling_kimi_linear.py``): blocks
``x + mixer(RMSNorm(x))``, ``x + mlp(RMSNorm(x))`` (``input_layernorm``,
``post_attention_layernorm``; ``norm`` at the top; every one ``rms_norm_eps``), and per layer ``i``:

* the mixer, by ``layer_types[i]`` → mnemo's ``layers=[...]``: ``"linear_attention"`` is KDA
  (``KimiLinearDeltaAttention``) → ``"kda"`` (:class:`~mnemo.layers.KimiDeltaAttention`) with
  ``n_heads = linear_num_heads``, ``head_dim = linear_head_dim`` (keys and values; the low-rank
  gates' inner width too: ``gate_rank = head_dim``), ``conv_size = linear_conv_kernel_dim``, its
  output RMSNorm's ``norm_eps = rms_norm_eps``, the L2 norms' ``1e-6``; ``"full_attention"`` is MLA
  without positions (``KimiLinearAttention``: it keeps ``qk_rope_head_dim`` decoupled channels but
  never rotates them, the paper's NoPE, §4) → ``"mla"``
  (:class:`~mnemo.layers.mla.MultiHeadLatentAttention`) with ``rope=False`` and the sizes of
  :mod:`mnemo.hf.deepseek` (``num_attention_heads``, ``q_lora_rank``, ``kv_lora_rank``,
  ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``, ``attention_bias``, the latent norms'
  fixed ``1e-6``), logits scaled by ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``. The layer
  kinds come from ``layer_types``; a config without it states them as ``linear_attn_config``'s
  1-based ``kda_layers`` / ``full_attn_layers`` (Moonshot's released files), else the class's
  default (``"full_attention"`` at ``i > 0`` with ``i % 4 == 0``) — ``KimiLinearConfig.__post_init__``'s
  order. The KDA sizes likewise come from ``linear_attn_config``'s ``num_heads`` / ``head_dim`` /
  ``short_conv_kernel_size`` before ``linear_num_heads`` / ``linear_head_dim`` /
  ``linear_conv_kernel_dim``. ``rope_theta`` / ``rope_parameters`` are not read (no rotation).
* the MLP, by ``mlp_layer_types[i]`` (else ``"dense"`` for the first ``first_k_dense_replace``
  layers, default 1): ``"dense"`` a SwiGLU of ``intermediate_size`` → mnemo's ``mlp_only_layers``
  (``mlp_hidden = intermediate_size``; ``mlp="swiglu"`` where no layer is sparse), ``"sparse"``
  ``KimiLinearMoE`` → :class:`~mnemo.layers.MoE` as DeepSeek-V3's (``score="sigmoid"``, the router's
  ``e_score_correction_bias`` as the balancing bias ``expert_bias``, groups scored by their two best
  biased scores, ``routed_scaling_factor``, an ungated shared expert ``num_shared_experts ×
  moe_intermediate_size`` wide) with Moonshot's field names, which ``KimiLinearConfig``'s
  ``attribute_map`` reads and ``save_pretrained`` writes: ``num_experts`` (``num_local_experts``),
  ``num_experts_per_token`` (``num_experts_per_tok``), ``num_shared_experts`` (``n_shared_experts``),
  ``moe_renormalize`` (``norm_topk_prob``), ``num_expert_group`` (``n_group``), ``topk_group``; a
  config holding both spellings of a field with different values is refused. ``transformers``
  computes no balance loss for this class (``aux_loss_coef=0``: it balances by the bias).

Weights: ``transformers``' own names (``self_attn.conv1d.weight [3 H K, 1, W]`` over ``[q | k |
v]``, ``self_attn.forget_gate.{f_a_proj, f_b_proj, dt_bias, A_log}``, ``mlp.experts.gate_up_proj``
/ ``down_proj`` fused) or the Hub's, which ``save_pretrained`` writes and ``transformers`` converts
on load (``self_attn.{q,k,v}_conv1d.weight`` one per projection, ``self_attn.{f_a_proj, f_b_proj,
dt_bias, A_log}``, the MLP under ``block_sparse_moe.`` with ``experts.{e}.w1`` / ``w3`` / ``w2`` =
gate / up / down); ``A_log`` is ``[1, 1, H, 1]`` there, ``[H]`` in mnemo. The export writes the
Hub's layout (dense MLPs under ``mlp.``, sparse ones under ``block_sparse_moe.``, as Moonshot's
checkpoints), the routers' ``gate.weight``, ``e_score_correction_bias`` and KDA's ``dt_bias`` in
float32 whatever ``dtype`` (:data:`KEEP_FLOAT32`: the class's ``_keep_in_fp32_modules_strict``).

``KimiLinearForCausalLM`` never ties its head (``_tied_weights_keys = {}``): whatever
``tie_word_embeddings`` says, ``lm_head.weight`` is its own weight, so the import reads both
(untied; a file without ``lm_head.weight`` is refused: ``transformers`` would draw a random head) and
a tied mnemo model exports both tensors (equal) with ``tie_word_embeddings`` false.

Not carried (no effect on the function): ``attention_dropout``, ``pretraining_tp``,
``output_router_logits``, ``use_cache``, ``model_max_length`` (no positions); the token ids are
carried by :mod:`mnemo.hf.convert`.

Refused by name (``ValueError``, ``"Kimi Linear conversion: …"``): ``hidden_act`` other than
``"silu"`` (the MLPs' and KDA's conv activation), ``num_key_value_heads`` other than
``num_attention_heads`` where there is an MLA layer, layer lists that do not name every layer once
(1-based), a ``layer_types`` / ``mlp_layer_types`` contradicting ``linear_attn_config`` /
``first_k_dense_replace`` (``transformers`` reads the former, Moonshot's code the latter), groups
``transformers``' router cannot run (fewer than two experts per group), a null or out-of-range size,
and the fields of Moonshot's ``config.json`` that ``transformers`` ignores but that would describe
another function than the one it computes: ``mla_use_nope`` false (rotated MLA),
``moe_router_activation_func`` other than ``"sigmoid"``, ``moe_layer_freq`` other than 1,
``use_grouped_topk`` false with a group limit, ``is_moe`` false with sparse layers,
``linear_attn_config``'s ``gate_lower_bound`` (a bounded forget gate) or ``use_full_rank_gate``; and
any missing, mis-shaped or unexpected weight. The export refuses a mixer other than ``"kda"`` /
``"mla"``, MLA with rotary positions or a ``softmax_scale``, KDA with another gate rank than its
``head_dim``, a gate bias, another L2-norm epsilon or an output-norm epsilon other than the model's
``norm_eps``, and a MoE ``KimiLinearMoE`` cannot express (as :func:`mnemo.hf.deepseek.export_deepseek_v3`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..layers.mlp import swiglu_hidden
from ..models.config import ModelConfig
from .deepseek import (
    LATENT_EPS,
    _bool,
    _check_groups,
    _common_moe_options,
    _int,
    _mla_layer,
    _move_attention,
    _number,
    rope_permutation,
)
from .fields import ConfigFormat, Weights, export_head, import_head, mixer_options, refuse_unexpressed
from .llama import _Class, _Experts, _export_experts, _import_experts, _swiglu_in, _swiglu_out

ARCH, MODEL_TYPE, KDA, MLA = "KimiLinearForCausalLM", "kimi_linear", "kda", "mla"
#: ``layer_types`` values → mnemo mixers
MIXER_OF = {"linear_attention": KDA, "full_attention": MLA}
#: the exported weights kept in float32 whatever the export's dtype (``_keep_in_fp32_modules_strict``;
#: ``e_score_correction_bias`` is :data:`mnemo.hf.convert.KEEP_FLOAT32`'s)
KEEP_FLOAT32 = ("block_sparse_moe.gate.weight", "self_attn.dt_bias")
#: the L2 normalisation epsilon of ``transformers``' KDA (``l2norm(..., eps=1e-6)``)
QK_NORM_EPS = 1e-6

#: ``KimiLinearConfig``'s defaults (``transformers`` 5.25) of the fields the conversion reads, under
#: the names its ``save_pretrained`` writes (Moonshot's, through ``attribute_map``)
DEFAULTS: dict[str, Any] = {
    "vocab_size": 163840,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "moe_intermediate_size": 1024,
    "num_hidden_layers": 27,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "num_shared_experts": 1,
    "routed_scaling_factor": 2.446,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "num_expert_group": 1,
    "topk_group": 1,
    "num_experts_per_token": 8,
    "moe_renormalize": True,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "num_experts": 256,
    "linear_head_dim": 128,
    "linear_num_heads": 32,
    "linear_conv_kernel_dim": 4,
    "first_k_dense_replace": 1,  # (not a field: __post_init__'s default)
}
#: ``transformers``' attribute name → the name in the file (``KimiLinearConfig.attribute_map``)
ALIASES = {
    "num_local_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_token",
    "n_shared_experts": "num_shared_experts",
    "norm_topk_prob": "moe_renormalize",
    "n_group": "num_expert_group",
}
_LIN = ("linear_num_heads", "linear_head_dim")
_Q = ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim")
SHAPE_FIELDS = {
    "embed_tokens.weight": ("vocab_size", "hidden_size"),
    "lm_head.weight": ("vocab_size", "hidden_size"),
    "norm.weight": ("hidden_size",),
    "layernorm.weight": ("hidden_size",),
    "q_proj.weight": (*_LIN, *_Q, "hidden_size"),
    "k_proj.weight": (*_LIN, "hidden_size"),
    "v_proj.weight": (*_LIN, "hidden_size"),
    **{f"{x}conv1d.weight": (*_LIN, "linear_conv_kernel_dim") for x in ("", "q_", "k_", "v_")},
    "f_a_proj.weight": ("linear_head_dim", "hidden_size"),
    "f_b_proj.weight": (*_LIN,),
    "g_a_proj.weight": ("linear_head_dim", "hidden_size"),
    "g_b_proj.weight": (*_LIN,),
    "dt_bias": (*_LIN,),
    "A_log": ("linear_num_heads",),
    "b_proj.weight": ("linear_num_heads", "hidden_size"),
    "o_norm.weight": ("linear_head_dim",),
    "o_proj.weight": (*_LIN, "num_attention_heads", "v_head_dim", "hidden_size"),
    "q_a_proj.weight": ("q_lora_rank", "hidden_size"),
    "q_a_layernorm.weight": ("q_lora_rank",),
    "q_b_proj.weight": (*_Q, "q_lora_rank"),
    "kv_a_proj_with_mqa.weight": ("kv_lora_rank", "qk_rope_head_dim", "hidden_size"),
    "kv_a_layernorm.weight": ("kv_lora_rank",),
    "kv_b_proj.weight": ("num_attention_heads", "qk_nope_head_dim", "v_head_dim", "kv_lora_rank"),
    **{f"mlp.{w}_proj.weight": ("intermediate_size", "hidden_size") for w in ("gate", "up", "down")},
    **{f"{w}.weight": ("moe_intermediate_size", "hidden_size") for w in ("w1", "w2", "w3")},
    "gate.weight": ("num_experts", "hidden_size"),
    "e_score_correction_bias": ("num_experts",),
    "experts.gate_up_proj": ("num_experts", "moe_intermediate_size", "hidden_size"),
    "experts.down_proj": ("num_experts", "moe_intermediate_size", "hidden_size"),
    **{
        f"shared_experts.{w}_proj.weight": ("num_shared_experts", "moe_intermediate_size", "hidden_size")
        for w in ("gate", "up", "down")
    },
}
FMT = ConfigFormat("Kimi Linear", DEFAULTS, SHAPE_FIELDS)

#: the sparse block as :mod:`mnemo.hf.llama`'s expert reader and writer see it: the Hub's
#: ``block_sparse_moe.experts.{e}.w1 / w3 / w2`` (gate / up / down), or ``transformers``' fused
#: ``mlp.experts.*`` (the shared experts and the correction bias are read here)
_CLASS = _Class(
    ARCH,
    MODEL_TYPE,
    FMT,
    bias=None,
    qk_norm=False,
    windows=None,
    moe=_Experts(
        count=("num_experts",),
        hidden="moe_intermediate_size",
        norm=None,
        shared=False,
        sparse_step=False,
        block="block_sparse_moe.",
        names=("w1", "w3", "w2"),
    ),
)
_BLOCKS = ("mlp.", "block_sparse_moe.")

#: the fields of Moonshot's ``config.json`` that ``transformers`` does not read, and the one value each
#: may have for the checkpoint's function to be the one ``transformers`` computes
_HUB_ONLY = {"mla_use_nope": True, "moe_router_activation_func": "sigmoid", "moe_layer_freq": 1}
_COMPUTES = {
    "mla_use_nope": "never rotates the MLA layers' qk_rope_head_dim channels",
    "moe_router_activation_func": "scores the experts by a sigmoid",
    "moe_layer_freq": "makes every layer from first_k_dense_replace on sparse (mlp_layer_types)",
}


def _refuse_hub_fields(cfg: dict) -> None:
    for key, want in _HUB_ONLY.items():
        if cfg.get(key) is not None and cfg[key] != want:
            FMT.refuse(
                f"field {key!r} = {cfg[key]!r}: transformers' {ARCH} does not read it and "
                f"{_COMPUTES[key]}, as {key} = {want!r} says; the checkpoint and the class disagree "
                "(expected no such field or that value)"
            )


def _canonical(cfg: dict) -> dict:
    """``cfg`` with ``transformers``' attribute names of :data:`ALIASES` read under the file's names
    (refused by name where both spellings are given with different values)."""
    cfg = dict(cfg)
    for attr, name in ALIASES.items():
        if attr in cfg:
            v = cfg.pop(attr)
            if name in cfg and cfg[name] != v:
                FMT.refuse(
                    f"fields {attr!r} = {v!r} and {name!r} = {cfg[name]!r} name the same setting "
                    "(KimiLinearConfig.attribute_map) with different values; expected one of them"
                )
            cfg[name] = v
    return cfg


def _linear_attn_config(cfg: dict) -> dict:
    lac = cfg.get("linear_attn_config")
    lac = {} if lac is None else lac
    if not isinstance(lac, dict):
        FMT.refuse(f"field 'linear_attn_config': expected an object, got {lac!r}")
    if lac.get("gate_lower_bound") is not None:
        FMT.refuse(
            f"field 'linear_attn_config.gate_lower_bound' = {lac['gate_lower_bound']!r}: transformers' "
            f"{ARCH} computes KDA's forget gate without a lower bound (expected none or null)"
        )
    if lac.get("use_full_rank_gate", False) is not False:
        FMT.refuse(
            f"field 'linear_attn_config.use_full_rank_gate' = {lac['use_full_rank_gate']!r}: transformers' "
            f"{ARCH} computes KDA's gates through rank linear_head_dim (expected false)"
        )
    return lac


def _listed(field: str, v, n: int, kinds: tuple[str, ...]) -> list[str]:
    if not isinstance(v, list) or len(v) != n or any(t not in kinds for t in v):
        FMT.refuse(
            f"field {field!r}: expected a list of num_hidden_layers = {n} values of {list(kinds)}, got {v!r}"
        )
    return v


def _from_linear_attn_config(lac: dict, n: int) -> list[str]:
    """``layer_types`` of ``linear_attn_config``'s 1-based ``full_attn_layers`` / ``kda_layers``, each
    layer named exactly once (``transformers`` leaves an unnamed layer without a kind and wraps
    index 0 to the last layer)."""
    types: list[str | None] = [None] * n
    for key, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
        for j in lac[key] if isinstance(lac[key], list) else [None]:
            if not (isinstance(j, int) and not isinstance(j, bool) and 1 <= j <= n) or types[j - 1]:
                FMT.refuse(
                    f"field 'linear_attn_config.{key}' = {lac[key]!r}: expected 1-based layer numbers in "
                    f"1 … num_hidden_layers = {n}, each layer in exactly one of full_attn_layers / kda_layers"
                )
            types[j - 1] = kind
    if None in types:
        FMT.refuse(
            f"fields linear_attn_config.full_attn_layers / kda_layers name no kind for layer number(s) "
            f"{[i + 1 for i, t in enumerate(types) if t is None]} (1-based; expected every layer once)"
        )
    return types  # type: ignore[return-value]


def layer_kinds(cfg: dict, n: int) -> tuple[list[str], list[str]]:
    """``(layer_types, mlp_layer_types)`` of a Kimi Linear config (file names, :func:`_canonical`)
    as ``KimiLinearConfig.__post_init__`` derives them: ``layer_types``, else ``linear_attn_config``'s
    ``full_attn_layers`` / ``kda_layers`` (both present), else the class default; ``mlp_layer_types``,
    else ``"dense"`` below ``first_k_dense_replace`` (default 1). Given both ways (a file
    ``save_pretrained`` wrote), they must agree: Moonshot's code reads the second."""
    lac = _linear_attn_config(cfg)
    listed = "full_attn_layers" in lac and "kda_layers" in lac
    from_lac = _from_linear_attn_config(lac, n) if listed else None
    if cfg.get("layer_types") is not None:
        types = _listed("layer_types", cfg["layer_types"], n, tuple(MIXER_OF))
        if from_lac is not None and from_lac != types:
            FMT.refuse(
                f"field 'layer_types' = {types!r} contradicts linear_attn_config's full_attn_layers / "
                f"kda_layers ({from_lac!r}); transformers reads the former, Moonshot's code the latter"
            )
    else:
        types = from_lac or ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    k = _int(cfg, "first_k_dense_replace", 0, fmt=FMT)
    by_k = ["dense" if i < k else "sparse" for i in range(n)]
    if cfg.get("mlp_layer_types") is not None:
        mlp = _listed("mlp_layer_types", cfg["mlp_layer_types"], n, ("dense", "sparse"))
        if "first_k_dense_replace" in cfg and mlp != by_k:
            FMT.refuse(
                f"field 'mlp_layer_types' = {mlp!r} contradicts first_k_dense_replace = {k} ({by_k!r}); "
                "transformers reads the former, Moonshot's code the latter"
            )
    else:
        mlp = by_k
    return types, mlp


def _moe_options(cfg: dict) -> dict[str, Any]:
    """The ``mlp_options`` of the :class:`~mnemo.layers.MoE` equal to ``KimiLinearMoE``."""
    E, k = _int(cfg, "num_experts", 1, fmt=FMT), _int(cfg, "num_experts_per_token", 1, fmt=FMT)
    I, shared = _int(cfg, "moe_intermediate_size", 1, fmt=FMT), _int(cfg, "num_shared_experts", 0, fmt=FMT)
    G, M = _int(cfg, "num_expert_group", 1, fmt=FMT), _int(cfg, "topk_group", 1, fmt=FMT)
    if k > E:
        FMT.refuse(f"field 'num_experts_per_token' = {k}: expected at most num_experts = {E}")
    if E % G or E // G < 2:
        FMT.refuse(
            f"fields num_experts = {E}, num_expert_group = {G}: expected groups of at least two experts "
            "(num_expert_group dividing num_experts; transformers scores a group by the top 2 of its "
            "experts, which fails on a group of one whatever topk_group)"
        )
    _check_groups(FMT, E, k, G, M)
    if cfg.get("use_grouped_topk") is False and M < G:
        FMT.refuse(
            f"field 'use_grouped_topk' = false with topk_group = {M} < num_expert_group = {G}: transformers' "
            f"{ARCH} always limits the choice to the topk_group best groups (expected no such field or true)"
        )
    return dict(
        n_experts=E, top_k=k, expert_hidden=I, shared_expert_hidden=shared * I or None,
        shared_expert_gate=False, norm_topk_prob=_bool(cfg, "moe_renormalize", FMT), score="sigmoid",
        routed_scaling_factor=_number(cfg, "routed_scaling_factor", FMT), n_group=G, topk_group=M,
        bias_balancing=True, aux_loss_coef=0.0,
    )  # fmt: skip


def import_kimi_linear(hf_config: dict, weights: dict[str, Tensor]) -> tuple[ModelConfig, dict[str, Tensor]]:
    """``KimiLinearForCausalLM`` import: ``(config dict, state dict)`` → a mnemo ``(ModelConfig,
    state dict)`` (see :mod:`mnemo.hf.kimi_linear`): ``"kda"`` and ``"mla"`` (``rope=False``) layers,
    SwiGLU and DeepSeek-V3-routed MoE MLPs. Raises ``ValueError`` ("Kimi Linear conversion: …")
    naming the field or weight that cannot be reproduced exactly."""
    cfg = _canonical(hf_config)
    if cfg.get("model_type", MODEL_TYPE) != MODEL_TYPE:
        FMT.refuse(f"model_type {cfg['model_type']!r} is not {MODEL_TYPE!r}")
    _refuse_hub_fields(cfg)
    act = FMT.get(cfg, "hidden_act")
    if act != "silu":
        FMT.refuse(
            f"hidden_act {act!r} is not supported (only 'silu': mnemo's MLP is SwiGLU, KDA's conv SiLU)"
        )
    n, d = _int(cfg, "num_hidden_layers", 1, fmt=FMT), _int(cfg, "hidden_size", 1, fmt=FMT)
    types, mlp_types = layer_kinds(cfg, n)
    layers = [MIXER_OF[t] for t in types]
    sparse = [i for i, t in enumerate(mlp_types) if t == "sparse"]
    if sparse and cfg.get("is_moe") is False:
        FMT.refuse(
            f"field 'is_moe' = false, but layers {sparse} are sparse (mlp_layer_types / "
            f"first_k_dense_replace): transformers' {ARCH} builds their mixtures of experts, Moonshot's "
            "code dense MLPs"
        )
    eps = FMT.get(cfg, "rms_norm_eps")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        FMT.refuse(f"field 'rms_norm_eps': expected a number > 0, got {eps!r}")
    lac = _linear_attn_config(cfg)
    kda: dict[str, Any] = {}
    for key, field in (("num_heads", "linear_num_heads"), ("head_dim", "linear_head_dim"),
                       ("short_conv_kernel_size", "linear_conv_kernel_dim")):  # fmt: skip
        src = {field: lac[key]} if key in lac else cfg
        kda[field] = _int(src, field, 1, fmt=FMT)
    H_lin, K_lin = kda["linear_num_heads"], kda["linear_head_dim"]
    cfg |= kda  # (the values read, which a shape error then names)
    options: dict[str, dict[str, Any]] = {
        KDA: dict(
            n_heads=H_lin,
            head_dim=K_lin,
            conv_size=kda["linear_conv_kernel_dim"],
            gate_rank=K_lin,
            qk_norm_eps=QK_NORM_EPS,
            norm_eps=float(eps),
        ),  # fmt: skip
    }
    if MLA in layers:
        H = _int(cfg, "num_attention_heads", 1, fmt=FMT)
        H_kv = cfg.get("num_key_value_heads")
        if H_kv is not None and H_kv != H:
            FMT.refuse(
                f"num_key_value_heads = {H_kv!r}: expected num_attention_heads = {H} (or null); multi-head "
                "latent attention expands its latent into every head's keys and values (no grouped heads)"
            )
        options[MLA] = dict(
            n_heads=H, kv_lora_rank=_int(cfg, "kv_lora_rank", 1, fmt=FMT),
            q_lora_rank=_int(cfg, "q_lora_rank", 1, nullable=True, fmt=FMT),
            qk_nope_head_dim=_int(cfg, "qk_nope_head_dim", 1, fmt=FMT),
            qk_rope_head_dim=_int(cfg, "qk_rope_head_dim", 1, fmt=FMT),
            v_head_dim=_int(cfg, "v_head_dim", 1, fmt=FMT), bias=_bool(cfg, "attention_bias", FMT),
            norm_eps=LATENT_EPS, rope=False,
        )  # fmt: skip
    options = {m: o for m, o in options.items() if m in layers}
    moe = _moe_options(cfg) if sparse else None
    tie = _bool(cfg, "tie_word_embeddings", FMT)
    if tie and "lm_head.weight" not in weights:
        FMT.refuse(
            f"field 'tie_word_embeddings' is true and the file holds no lm_head.weight: transformers' {ARCH} "
            "never ties its head (_tied_weights_keys is empty) and would draw a random one"
        )
    config = ModelConfig(
        vocab_size=_int(cfg, "vocab_size", 1, fmt=FMT),
        d_model=d,
        n_layers=n,
        layers=layers,
        mixer_options=options,
        mlp="swiglu" if moe is None else "moe",
        mlp_hidden=_int(cfg, "intermediate_size", 1, fmt=FMT),
        mlp_options=moe or {},
        mlp_only_layers=[i for i in range(n) if i not in sparse] or None if moe is not None else None,
        pos_embedding="none",
        tie_embeddings=False,
        norm_eps=float(eps),
        init_std=FMT.init_std(FMT.get(cfg, "initializer_range")),
    ).validate()

    w = Weights(FMT, weights, cfg=cfg)
    sd = import_head(w, config.vocab_size, d, False)
    sd["norm.weight"] = w.pop("model.norm.weight", (d,))
    sd |= _layer_weights(w, config, sparse, moe, importing=True)
    w.finish()
    return config, sd


def _kda_weights(w: Weights, src: str, dst: str, o: dict[str, Any], d: int, importing: bool):
    """One KDA layer's weights: ``transformers``' (either layout, see :mod:`mnemo.hf.kimi_linear`) of
    prefix ``src`` → mnemo's of prefix ``dst`` (``importing``), or mnemo's → the Hub's."""
    H, K, W = o["n_heads"], o["head_dim"], o["conv_size"]
    HK = H * K
    plain = {
        "q_proj.weight": (HK, d), "k_proj.weight": (HK, d), "v_proj.weight": (HK, d),
        "f_a_proj.weight": (K, d), "f_b_proj.weight": (HK, K), "dt_bias": (HK,), "b_proj.weight": (H, d),
        "g_a_proj.weight": (K, d), "g_b_proj.weight": (HK, K), "o_norm.weight": (K,),
        "o_proj.weight": (d, HK),
    }  # fmt: skip
    gate = ("f_a_proj.weight", "f_b_proj.weight", "dt_bias")
    out: dict[str, Tensor] = {}
    if not importing:
        for k, shape in plain.items():
            out[dst + k] = w.pop(src + k, shape)
        out[dst + "A_log"] = w.pop(src + "A_log", (H,)).reshape(1, 1, H, 1)
        for x, t in zip("qkv", w.pop(src + "conv.weight", (3 * HK, 1, W)).split(HK)):
            out[f"{dst}{x}_conv1d.weight"] = t
        return out
    fused = src + "forget_gate.A_log" in w
    for k, shape in plain.items():
        out[dst + k] = w.pop(src + ("forget_gate." if fused and k in gate else "") + k, shape)
    out[dst + "A_log"] = w.pop(src + ("forget_gate." if fused else "") + "A_log", (1, 1, H, 1)).reshape(H)
    if src + "conv1d.weight" in w:
        out[dst + "conv.weight"] = w.pop(src + "conv1d.weight", (3 * HK, 1, W))
    else:
        out[dst + "conv.weight"] = torch.cat([w.pop(f"{src}{x}_conv1d.weight", (HK, 1, W)) for x in "qkv"])
    return out


def _layer_weights(
    w: Weights, config: ModelConfig, sparse: list[int], moe, importing: bool
) -> dict[str, Tensor]:
    """Every layer's weights, ``transformers``' → mnemo's (``importing``) or back; ``sparse``: the
    MoE layers, ``moe``: their options (every one filled in)."""
    d, hidden = config.d_model, config.mlp_hidden or swiglu_hidden(config.d_model)
    mla = _mla_layer(config) if MLA in config.layer_mixers() else None
    perm = rope_permutation(mla.qk_rope_head_dim, False) if mla is not None else None
    kda = mixer_options(KDA, config)
    kda["head_dim"] = kda["head_dim"] or d // kda["n_heads"]
    sd: dict[str, Tensor] = {}
    for i, mixer in enumerate(config.layer_mixers()):
        p, q = f"model.layers.{i}.", f"blocks.{i}."
        src, dst = (p, q) if importing else (q, p)
        for theirs, ours in (("input_layernorm", "mixer_norm"), ("post_attention_layernorm", "mlp_norm")):
            a, b = (theirs, ours) if importing else (ours, theirs)
            sd[dst + b + ".weight"] = w.pop(src + a + ".weight", (d,))
        a, m = p + "self_attn.", q + "mixer."
        if mixer == KDA:
            sd |= _kda_weights(w, *((a, m) if importing else (m, a)), kda, d, importing)
        else:
            sd |= _move_attention(w, *((a, m) if importing else (m, a)), mla, perm, export=not importing)
        sd |= (_import_mlp if importing else _export_mlp)(w, p, q, i, i in sparse, moe, hidden, d)
    return sd


def _import_mlp(w: Weights, p: str, q: str, i: int, sparse: bool, moe, hidden: int, d: int):
    """Layer ``i``'s MLP (prefix ``p``) as mnemo's (prefix ``q``): a SwiGLU or the MoE, under either
    of the Hub's block names (``save_pretrained`` writes ``block_sparse_moe.`` for both kinds)."""
    have = [b for b in _BLOCKS if p + b + "gate.weight" in w or p + b + "gate_proj.weight" in w]
    b = p + (have[0] if have else "mlp.")
    kind = "sparse" if b + "gate.weight" in w else "dense" if b + "gate_proj.weight" in w else None
    if kind is not None and kind != ("sparse" if sparse else "dense"):
        FMT.refuse(
            f"layer {i} is {'sparse' if sparse else 'dense'} by mlp_layer_types / first_k_dense_replace, but "
            f"the weights hold a {kind} MLP there ({b!r}): the config and the weights disagree"
        )
    if not sparse:
        w_in, w_out = _swiglu_in(w, b, hidden, d)
        return {q + "mlp.w_in.weight": w_in, q + "mlp.w_out.weight": w_out}
    sd = _import_experts(_CLASS, w, p, q + "mlp.", moe, d)
    blk = b.removeprefix(p)
    sd[q + "mlp.expert_bias"] = w.pop(b + "gate.e_score_correction_bias", (moe["n_experts"],))
    S = moe["shared_expert_hidden"]
    if S is None:  # num_shared_experts = 0: transformers' shared MLP has width 0 (outputs 0)
        for x in ("gate_proj", "up_proj", "down_proj"):
            if f"{p}{blk}shared_experts.{x}.weight" in w:
                w.pop(f"{p}{blk}shared_experts.{x}.weight")
    else:
        w_in, w_out = _swiglu_in(w, b + "shared_experts.", S, d)
        sd[q + "mlp.shared_expert.w_in.weight"], sd[q + "mlp.shared_expert.w_out.weight"] = w_in, w_out
    return sd


def _export_mlp(w: Weights, p: str, q: str, i: int, sparse: bool, moe, hidden: int, d: int):
    """mnemo's MLP of layer ``i`` (prefix ``q``) in the Hub's layout (prefix ``p``): a dense SwiGLU
    under ``mlp.``, the MoE under ``block_sparse_moe.`` (per-expert ``w1`` / ``w3`` / ``w2``, the
    router and its correction bias in float32, the shared experts)."""
    if not sparse:
        return _swiglu_out(w, q + "mlp.", p + "mlp.", hidden, d)
    b = p + _CLASS.moe.block
    sd = _export_experts(_CLASS, w, q + "mlp.", p, moe, d)
    sd[b + "gate.weight"] = sd[b + "gate.weight"].float()
    E = moe["n_experts"]
    sd[b + "gate.e_score_correction_bias"] = (
        w.pop(q + "mlp.expert_bias", (E,)).float() if moe["bias_balancing"] else torch.zeros(E)
    )
    S = moe["shared_expert_hidden"]
    if S is None:
        sd |= {b + f"shared_experts.{x}_proj.weight": torch.zeros(0, d) for x in ("gate", "up")}
        sd[b + "shared_experts.down_proj.weight"] = torch.zeros(d, 0)
    else:
        sd |= _swiglu_out(w, q + "mlp.shared_expert.", b + "shared_experts.", S, d)
    return sd


def _export_moe_options(config: ModelConfig) -> dict[str, Any]:
    """The model's :class:`~mnemo.layers.MoE` options (defaults filled in), refused by name where
    ``KimiLinearMoE`` computes another function (as DeepSeek-V3's router: sigmoid scores, groups of at
    least two experts scored by their two best; one-expert groups that limit nothing are written as
    one group)."""
    o = _common_moe_options(FMT, config, "sigmoid")
    E, G, M = o["n_experts"], o["n_group"], o["topk_group"]
    if M == G and E // G < 2:
        o["n_group"] = o["topk_group"] = G = M = 1
    if M < G:
        FMT.require("mlp_options", o, "group_score", "top2")
    if E // G < 2:
        FMT.refuse(
            f"mlp_options options n_experts={E}, n_group={G}: transformers scores a group by its two best "
            "experts (expected at least two experts per group)"
        )
    return o


def export_kimi_linear(config: ModelConfig, weights: dict[str, Tensor]) -> tuple[dict, dict[str, Tensor]]:
    """``KimiLinearForCausalLM`` export: a mnemo ``(ModelConfig, state dict)`` → ``(config dict,
    state dict)`` (see :mod:`mnemo.hf.kimi_linear`): ``"kda"`` and ``"mla"`` (``rope=False``) layers,
    SwiGLU MLPs and DeepSeek-V3-routed MoE layers in any order (``mlp_only_layers``). Raises
    ``ValueError`` ("Kimi Linear conversion: …") naming what the class cannot express."""
    config = config.validate()
    refuse_unexpressed(FMT.name, config, mlp_only_layers=True)
    mixers = config.layer_mixers()
    for i, mixer in enumerate(mixers):
        if mixer not in (KDA, MLA):
            FMT.refuse(f"layer {i} uses mixer {mixer!r}; {ARCH} layers are {KDA!r} or {MLA!r}")
    if MLA not in mixers:  # (as Jamba's and Bamba's exports)
        FMT.refuse(
            f"layers {mixers}: no {MLA!r} layer; expected at least one ({ARCH} fails with a cache, i.e. in "
            "its default forward and in generate, when no layer is full attention: transformers 5.25)"
        )
    if config.mlp not in ("moe", "swiglu"):
        FMT.refuse(
            f"mlp {config.mlp!r} is not supported (only 'moe', with dense layers among them, or 'swiglu')"
        )
    if config.pos_embedding != "none":
        FMT.refuse(f"pos_embedding {config.pos_embedding!r} is not supported ({ARCH} has no positions)")
    n, d = config.n_layers, config.d_model
    hidden = config.mlp_hidden or swiglu_hidden(d)
    kda = mixer_options(KDA, config)
    K = kda["head_dim"] or d // kda["n_heads"]
    if KDA in mixers:
        where = f"mixer_options[{KDA!r}]"
        if (kda["gate_rank"] or K) != K:
            FMT.refuse(
                f"{where} option gate_rank={kda['gate_rank']!r}: {ARCH}'s low-rank gates are head_dim = {K} "
                "wide (expected None or head_dim)"
            )
        FMT.require(where, kda, "output_gate_bias", False)
        FMT.require(where, kda, "qk_norm_eps", QK_NORM_EPS)
        FMT.require(where, kda, "norm_eps", config.norm_eps)  # (rms_norm_eps: one epsilon)
    mla = _mla_layer(config) if MLA in mixers else None
    if mla is not None:
        where = f"mixer_options[{MLA!r}]"
        opts = mixer_options(MLA, config)
        FMT.require(where, opts, "rope", False)
        FMT.require(where, opts, "norm_eps", LATENT_EPS)
    sparse = [i for i in range(n) if config.mlp == "moe" and i not in (config.mlp_only_layers or [])]
    mlp_types = ["sparse" if i in sparse else "dense" for i in range(n)]
    kda_layers = [i + 1 for i, m in enumerate(mixers) if m == KDA]
    full_layers = [i + 1 for i, m in enumerate(mixers) if m == MLA]
    hf: dict[str, Any] = {
        "architectures": [ARCH],
        "model_type": MODEL_TYPE,
        "vocab_size": config.vocab_size,
        "hidden_size": d,
        "intermediate_size": hidden,
        "num_hidden_layers": n,
        "hidden_act": "silu",
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": False,  # (the class never ties: both tensors are written)
        "attention_dropout": 0.0,
        "initializer_range": config.init_std,
        "layer_types": [t for m in mixers for t, x in MIXER_OF.items() if x == m],
        "mlp_layer_types": mlp_types,
        "linear_num_heads": kda["n_heads"],
        "linear_head_dim": K,
        "linear_conv_kernel_dim": kda["conv_size"],
        "linear_attn_config": {
            "kda_layers": kda_layers,
            "full_attn_layers": full_layers,
            "num_heads": kda["n_heads"],
            "head_dim": K,
            "short_conv_kernel_size": kda["conv_size"],
        },
    }
    if mla is not None:
        hf |= {
            "num_attention_heads": mla.n_heads,
            "num_key_value_heads": mla.n_heads,
            "q_lora_rank": mla.q_lora_rank,
            "kv_lora_rank": mla.kv_lora_rank,
            "qk_nope_head_dim": mla.qk_nope_head_dim,
            "qk_rope_head_dim": mla.qk_rope_head_dim,
            "v_head_dim": mla.v_head_dim,
            "attention_bias": mla.o_proj.bias is not None,
            "mla_use_nope": True,
        }
    k_dense = next((i for i, t in enumerate(mlp_types) if t == "sparse"), n)
    if mlp_types == ["dense"] * k_dense + ["sparse"] * (n - k_dense):  # (Moonshot's code reads it)
        hf["first_k_dense_replace"] = k_dense
    moe = None
    if sparse:
        moe = _export_moe_options(config)
        hf |= {
            "num_experts": moe["n_experts"],
            "num_experts_per_token": moe["top_k"],
            "moe_intermediate_size": moe["expert_hidden"],
            "num_shared_experts": (moe["shared_expert_hidden"] or 0) // moe["expert_hidden"],
            "moe_renormalize": moe["norm_topk_prob"],
            "routed_scaling_factor": moe["routed_scaling_factor"],
            "num_expert_group": moe["n_group"],
            "topk_group": moe["topk_group"],
            "moe_router_activation_func": "sigmoid",
        }

    w = Weights(FMT, weights)
    sd = export_head(w, config)
    sd["model.norm.weight"] = w.pop("norm.weight", (d,))
    sd |= _layer_weights(w, config, sparse, moe, importing=False)
    w.finish()
    return hf, {k: v.contiguous() for k, v in sd.items()}
