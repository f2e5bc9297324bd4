"""DeepSeek-V3 (``DeepseekV3ForCausalLM``, ``model_type`` ``"deepseek_v3"``: DeepSeek-V3 / R1,
Moonlight, and Kimi K2 under its ``model_type`` ``"kimi_k2"``) and DeepSeek-V2
(``DeepseekV2ForCausalLM``, ``"deepseek_v2"``: DeepSeek-V2 / V2-Lite / V2.5, DeepSeek-Coder-V2) in
and out of mnemo.

:func:`import_deepseek_v3` / :func:`import_deepseek_v2` turn a ``transformers`` config (a dict, as
in ``config.json``) and the state dict into a :class:`~mnemo.models.ModelConfig` and a state dict
that ``LanguageModel(config).load_state_dict(sd, strict=True)`` accepts; :func:`export_deepseek_v3`
/ :func:`export_deepseek_v2` do the reverse. Plain dicts and tensors: nothing here imports
``transformers``, and no checkpoint's remote code is run.

The computation (``transformers`` 5.25, ``models/deepseek_v3/modeling_deepseek_v3.py``) is a stack
of ``x + attn(RMSNorm(x))``, ``x + mlp(RMSNorm(x))`` with a final RMSNorm (``rms_norm_eps``):

* attention: multi-head latent attention, mnemo's ``"mla"`` mixer
  (:class:`~mnemo.layers.mla.MultiHeadLatentAttention`) with ``n_heads = num_attention_heads`` and
  the sizes of the same names (``q_lora_rank`` null: a full ``q_proj``; ``kv_lora_rank``,
  ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``); its two latent RMSNorms
  (``q_a_layernorm``, ``kv_a_layernorm``) have ``transformers``' fixed epsilon 1e-6 (not
  ``rms_norm_eps``): MLA's ``norm_eps=1e-6``. ``attention_bias`` biases ``q_a_proj``,
  ``kv_a_proj_with_mqa`` and ``o_proj`` (never ``q_proj``): MLA's ``bias``. Weights: ``q_proj`` /
  ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj`` / ``kv_a_proj_with_mqa`` / ``kv_a_layernorm`` /
  ``kv_b_proj`` / ``o_proj`` → ``q_proj`` / ``q_a_proj`` / ``q_a_norm`` / ``q_b_proj`` /
  ``kv_a_proj`` / ``kv_a_norm`` / ``kv_b_proj`` / ``o_proj`` (the same per-head layouts).
* rotary positions over the ``qk_rope_head_dim`` channels: with ``rope_interleave`` (the class's
  default and the released checkpoints') ``transformers`` rotates the pairs ``(2i, 2i + 1)``, mnemo
  the ``rotate_half`` pairs ``(i, i + d/2)``; the rotary rows of ``q_proj`` / ``q_b_proj`` (per head)
  and of ``kv_a_proj_with_mqa`` (its last ``qk_rope_head_dim`` rows, and their bias) are permuted
  (evens, then odds) on import and back on export, which is exact. The export writes
  ``rope_interleave`` true.
* RoPE scaling: ``"default"``, or ``"yarn"`` → mnemo's ``"yarn_hf"`` (``transformers``' frequencies,
  and its cos/sin factor: ``m(s, mscale) / m(s, mscale_all_dim)``, ``m(s, a) = 0.1 a ln s + 1``,
  where both are set and non-zero, else ``0.1 ln s + 1``, and an explicit ``attention_factor`` in
  its place). DeepSeek-V3 also multiplies the logit scale ``(qk_nope_head_dim + qk_rope_head_dim) **
  -0.5`` by ``m(s, mscale_all_dim)²`` where ``mscale_all_dim`` is set (``yarn_apply_mscale``): MLA's
  ``softmax_scale``, computed here as ``transformers`` computes it; the export checks that a model's
  ``softmax_scale`` is that value (to 1e-12, relative) and refuses another.
  ``partial_rotary_factor`` other than 1 and every other ``rope_type`` are refused.
* MLP: the first ``first_k_dense_replace`` layers a dense SwiGLU of ``intermediate_size``
  (mnemo's ``mlp_only_layers = [0, …, k − 1]`` with ``mlp_hidden = intermediate_size``; ``k ≥
  num_hidden_layers``: every layer dense, ``mlp="swiglu"``; a file whose dense / sparse layers
  contradict ``k`` is refused naming ``first_k_dense_replace``), the others ``DeepseekV3MoE``: mnemo's
  :class:`~mnemo.layers.MoE` with ``n_experts = n_routed_experts``, ``top_k =
  num_experts_per_tok``, ``expert_hidden = moe_intermediate_size``, ``score="sigmoid"``,
  ``norm_topk_prob``, ``routed_scaling_factor``, ``n_group`` / ``topk_group`` (groups scored by
  their two best biased scores, the others masked to ``−inf``: the same function) and an ungated
  shared expert of ``n_shared_experts × moe_intermediate_size`` (none for 0). The router's
  ``e_score_correction_bias`` is the MoE's balancing bias (``bias_balancing=True``, buffer
  ``expert_bias``): added to the scores for the choice only, as there; the forward pass never
  changes it (mnemo's trainer steps it after each optimizer step, DeepSeek-V3's auxiliary-loss-free
  balancing). Experts from ``transformers`` 5's fused ``mlp.experts.gate_up_proj`` / ``down_proj``
  or the Hub's per-expert ``mlp.experts.{e}.{gate,up,down}_proj`` (read by
  :mod:`mnemo.hf.llama`'s reader); the export writes the per-expert layout. ``transformers``
  renormalises by ``Σ s + 1e-20``, mnemo by the softmax of the chosen ``log σ(z)`` (the same value
  where ``Σ s ≫ 1e-20``).

DeepSeek-V2 (``models/deepseek_v2/modeling_deepseek_v2.py``) is the same stack with another router
and rotary code: its ``apply_rotary_emb`` multiplies the pairs ``(2i, 2i + 1)``, read as complex
numbers, by ``e^{i θ_i t}`` (times YaRN's factor): the same rotation as ``rope_interleave`` (there
is no such field: always interleaved), permuted the same way. ``DeepseekV2Moe``'s router scores by
a softmax over all experts (float32), chooses the top ``num_experts_per_tok`` (``topk_method``
``"greedy"``), or within the ``topk_group`` of ``n_group`` groups of best *largest* score
(``"group_limited_greedy"``: mnemo's ``group_score="max"``; the other groups' scores set to 0,
mnemo's to ``−inf``: the same choice unless a kept score underflows to 0), and weighs each chosen
expert by its softmax score times ``routed_scaling_factor``, never renormalised (mnemo's
``score="softmax"``, ``norm_topk_prob=False``); no correction bias (``bias_balancing=False``), a
shared expert as V3's. ``mlp_bias`` must be false (mnemo's SwiGLU has no biases). Its training
losses are those of DeepSeek-V2's own code (its released ``config.json``'s ``aux_loss_alpha``,
``seq_aux``; ``transformers``' class computes none): ``seq_aux`` false is ``α · E Σ_e f_e P_e`` with
``f`` over the routing's choices, mnemo's ``L_aux`` (``aux_loss_coef = α``); ``seq_aux`` true is
the same per sequence, mnemo's ``L_seq`` (``seq_aux_loss_coef = α``) where the choice is the plain
top-k (``"greedy"``); with group-limited routing that loss counts the group-limited choice while
``L_seq`` counts the unbiased top-k, so it is not carried (both weights 0: training-only, the
function is unchanged). A config without ``aux_loss_alpha`` (``transformers``') gets no loss.
The export writes them back where they correspond.

Not carried (they do not change the function): ``attention_dropout``, ``pretraining_tp``,
``output_router_logits``, ``use_cache``, ``ep_size``; for DeepSeek-V3 the auxiliary losses are off
(``aux_loss_coef=0``: it balances by the bias; ``transformers`` computes no such loss for this
class). The multi-token-prediction modules (``num_nextn_predict_layers`` / ``num_mtp_layers``, saved
as layers ``num_hidden_layers …``) are not part of the causal LM's forward pass: their weights are
dropped on import; the export writes ``num_mtp_layers`` 0.

Router precision: ``transformers`` keeps the router's ``gate.weight`` in float32 in a bf16 model
(``_keep_in_fp32_modules_strict``) and computes its logits as ``F.linear(x.float(), W.float())``.
The import reads it as stored (a foreign folder loads as a float32 mnemo model by default: the
same routing); the export writes ``mlp.gate.weight`` (and V3's ``e_score_correction_bias``) in
float32 whatever ``dtype`` (:data:`KEEP_FLOAT32`, registered with the formats in
:mod:`mnemo.hf.convert`). A mnemo model cast to bf16 still rounds its router to bf16 (mnemo's MoE
router is an ``nn.Linear`` in the model's dtype), which changed the chosen experts of 1 token in
128 in a tiny bf16 model (review 49g). The released DeepSeek-V3 / R1 and Kimi K2 weights are FP8
(a ``quantization_config``), which the conversion refuses; their bf16 copies import.

Kimi K2 (``moonshotai/Kimi-K2-*``) ships ``architectures`` ``["DeepseekV3ForCausalLM"]`` with
``model_type`` ``"kimi_k2"`` and an ``auto_map`` to its copy of DeepSeek's code: read as DeepSeek-V3
(:data:`MODEL_TYPES`) under the same checks; its ``auto_map`` is not used.

Refused by name (``ValueError`` ``"DeepSeek-V3 conversion: …"`` / ``"DeepSeek-V2 conversion: …"``):
``num_key_value_heads`` other than ``num_attention_heads`` (MLA has no grouped keys), ``hidden_act``
other than ``"silu"``, null sizes, groups that ``transformers`` cannot run (V3: fewer than two
experts per group — its group score takes the top 2 and fails on a group of one, whatever
``topk_group``; V2: ``n_group`` not dividing the experts), and the fields of the released
``config.json`` files that ``transformers`` ignores but that would describe another routing than
the one it computes: V3's ``topk_method`` other than ``"noaux_tc"``, ``scoring_func`` other than
``"sigmoid"`` (V2: ``"softmax"``), ``moe_layer_freq`` other than 1, V2's ``norm_topk_prob`` true
(with ``num_experts_per_tok`` > 1); V2's ``topk_method`` other than ``"greedy"`` /
``"group_limited_greedy"``; any missing, mis-shaped or unexpected weight.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..layers.mlp import swiglu_hidden
from ..layers.moe import MOE_OPTIONS
from ..layers.rotary import check_rope_scaling
from ..models.config import ModelConfig
from .fields import (
    ConfigFormat,
    Weights,
    export_head,
    import_head,
    is_int,
    mixer_options,
    refuse_unexpressed,
    rope_fields,
    rope_parameters,
    tied_as_loaded,
)
from .llama import _Class, _Experts, _export_experts, _import_experts, _swiglu_in, _swiglu_out

ARCH, MODEL_TYPE, MLA = "DeepseekV3ForCausalLM", "deepseek_v3", "mla"
#: the ``model_type`` values read as ``DeepseekV3ForCausalLM``: ``transformers``' own and Kimi K2's
#: ``"kimi_k2"`` (the same class under Moonshot's name, which ``transformers`` runs only as remote code)
MODEL_TYPES = (MODEL_TYPE, "kimi_k2")
ARCH_V2, MODEL_TYPE_V2 = "DeepseekV2ForCausalLM", "deepseek_v2"
#: the exported weights kept in float32 whatever the export's dtype, as ``transformers`` keeps them in
#: both classes (``_keep_in_fp32_modules_strict``): the routers (and V3's ``e_score_correction_bias``,
#: :data:`mnemo.hf.convert.KEEP_FLOAT32`)
KEEP_FLOAT32 = ("mlp.gate.weight",)

#: ``DeepseekV3Config``'s defaults (``transformers`` 5.25) of the fields the conversion reads
DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": None,  # num_attention_heads
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_interleave": True,
    "attention_bias": False,
    "num_nextn_predict_layers": 1,
}
_Q = ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim")
SHAPE_FIELDS = {
    "embed_tokens.weight": ("vocab_size", "hidden_size"),
    "lm_head.weight": ("vocab_size", "hidden_size"),
    "norm.weight": ("hidden_size",),
    "layernorm.weight": ("hidden_size",),
    "q_proj.weight": (*_Q, "hidden_size"),
    "q_a_proj.weight": ("q_lora_rank", "hidden_size"),
    "q_a_layernorm.weight": ("q_lora_rank",),
    "q_b_proj.weight": (*_Q, "q_lora_rank"),
    "kv_a_proj_with_mqa.weight": ("kv_lora_rank", "qk_rope_head_dim", "hidden_size"),
    "kv_a_layernorm.weight": ("kv_lora_rank",),
    "kv_b_proj.weight": ("num_attention_heads", "qk_nope_head_dim", "v_head_dim", "kv_lora_rank"),
    "o_proj.weight": ("hidden_size", "num_attention_heads", "v_head_dim"),
    "mlp.gate_proj.weight": ("intermediate_size", "hidden_size"),
    "mlp.up_proj.weight": ("intermediate_size", "hidden_size"),
    "mlp.down_proj.weight": ("intermediate_size", "hidden_size"),
    "gate.weight": ("n_routed_experts", "hidden_size"),
    "e_score_correction_bias": ("n_routed_experts",),
    "experts.gate_up_proj": ("n_routed_experts", "moe_intermediate_size", "hidden_size"),
    "experts.down_proj": ("n_routed_experts", "moe_intermediate_size", "hidden_size"),
    **{
        f"{w}.weight": ("moe_intermediate_size", "hidden_size")
        for w in ("gate_proj", "up_proj", "down_proj")  # experts.{e}.*
    },
    **{
        f"shared_experts.{w}.weight": ("n_shared_experts", "moe_intermediate_size", "hidden_size")
        for w in ("gate_proj", "up_proj", "down_proj")
    },
}
FMT = ConfigFormat("DeepSeek-V3", DEFAULTS, SHAPE_FIELDS)

#: ``DeepseekV2Config``'s defaults (``transformers`` 5.25) of the fields the conversion reads
DEFAULTS_V2: dict[str, Any] = {
    "vocab_size": 102400,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "moe_intermediate_size": 1407,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": None,  # num_attention_heads
    "n_shared_experts": 2,
    "n_routed_experts": 64,
    "routed_scaling_factor": 1.0,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "n_group": None,
    "topk_group": None,
    "topk_method": "greedy",
    "num_experts_per_tok": None,
    "first_k_dense_replace": 0,
    "norm_topk_prob": False,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_interleave": True,  # (no such field: apply_rotary_emb always pairs (2i, 2i + 1))
    "attention_bias": False,
    "mlp_bias": False,
    "num_nextn_predict_layers": 0,  # (no such field)
}
FMT_V2 = ConfigFormat(
    "DeepSeek-V2", DEFAULTS_V2, {k: v for k, v in SHAPE_FIELDS.items() if k != "e_score_correction_bias"}
)

#: the sparse block as :mod:`mnemo.hf.llama`'s expert reader and writer see it (``transformers``
#: 5's ``mlp.experts.*`` or the Hub's per-expert names; the shared experts are read here)
_CLASS = _Class(
    ARCH,
    MODEL_TYPE,
    FMT,
    bias=None,
    qk_norm=False,
    windows=None,
    moe=_Experts(
        count=("n_routed_experts",),
        hidden="moe_intermediate_size",
        norm=None,
        shared=False,
        sparse_step=False,
        block="mlp.",
        names=("gate_proj", "up_proj", "down_proj"),
    ),
)

#: the released ``config.json`` fields ``transformers`` does not read, and the one value each may
#: have for its routing to be the one ``transformers`` computes (and how it routes)
_HUB_ONLY = {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1}
_ROUTES = "sigmoid scores, the e_score_correction_bias for the choice, groups"
_HUB_ONLY_V2 = {"scoring_func": "softmax", "moe_layer_freq": 1}
_ROUTES_V2 = "softmax scores, a sparse block in every layer from first_k_dense_replace on"

#: MLA's latent norms: ``DeepseekV3RMSNorm``'s default epsilon, which the attention does not override
LATENT_EPS = 1e-6


def _int(cfg: dict, key: str, low: int, *, nullable: bool = False, fmt: ConfigFormat = FMT) -> int | None:
    """``cfg[key]`` (the class default where the key is left out: an explicit null is a value), an
    int ``>= low`` (or null where ``nullable``), refused by name otherwise."""
    v = cfg[key] if key in cfg else fmt.defaults[key]
    if v is None and nullable:
        return None
    if not is_int(v) or v < low:
        fmt.refuse(f"field {key!r}: expected an int >= {low}{' or null' if nullable else ''}, got {v!r}")
    return v


def _number(cfg: dict, key: str, fmt: ConfigFormat = FMT) -> float:
    v = cfg[key] if key in cfg else fmt.defaults[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v < float("inf")):
        fmt.refuse(f"field {key!r}: expected a number > 0, got {v!r}")
    return float(v)


def _bool(cfg: dict, key: str, fmt: ConfigFormat = FMT) -> bool:
    v = cfg[key] if key in cfg else fmt.defaults[key]
    if not isinstance(v, bool):
        fmt.refuse(f"field {key!r}: expected true or false, got {v!r}")
    return v


def rope_permutation(dr: int, interleave: bool) -> Tensor:
    """``perm [dr]``: mnemo's rotary channel ``c`` (``rotate_half`` pairs) is ``transformers``'
    channel ``perm[c]`` — with ``rope_interleave`` the even channels, then the odd ones (its pairs
    ``(2i, 2i + 1)``); the identity without."""
    return torch.cat([torch.arange(0, dr, 2), torch.arange(1, dr, 2)]) if interleave else torch.arange(dr)


def _permute_q(w: Tensor, H: int, dn: int, dr: int, perm: Tensor) -> Tensor:
    """The query projection's rows ``[H (dn + dr), …]``, each head's last ``dr`` (rotary) rows
    reordered by ``perm``."""
    v = w.reshape(H, dn + dr, *w.shape[1:])
    return torch.cat([v[:, :dn], v[:, dn:][:, perm]], 1).reshape(w.shape)


def _permute_kv(w: Tensor, r: int, perm: Tensor) -> Tensor:
    """``kv_a_proj_with_mqa``'s rows (or bias) ``[r + dr, …]``, the last ``dr`` reordered by ``perm``."""
    return torch.cat([w[:r], w[r:][perm]])


#: ``transformers``' attention weight names → mnemo's MLA names (``*`` the ``q_lora_rank`` ones)
_ATTENTION_NAMES = {
    "q_proj": "q_proj",
    "q_a_proj": "q_a_proj",
    "q_a_layernorm": "q_a_norm",
    "q_b_proj": "q_b_proj",
    "kv_a_proj_with_mqa": "kv_a_proj",
    "kv_a_layernorm": "kv_a_norm",
    "kv_b_proj": "kv_b_proj",
    "o_proj": "o_proj",
}


def _mla_layer(config: ModelConfig):
    """The config's MLA layer, built on the meta device (its sizes as it resolves them)."""
    from ..layers import MIXERS

    with torch.device("meta"):
        return MIXERS[MLA](config.d_model, **config.mixer_options.get(MLA, {}))


def _move_attention(w: Weights, src: str, dst: str, layer, perm: Tensor, export: bool = False):
    """One attention layer's weights from prefix ``src`` to ``dst``: ``transformers``' names to
    mnemo's (or back, ``export``), each parameter of the MLA ``layer`` (built on the meta device:
    names and shapes; its biases are ``attention_bias``'s: ``q_a_proj``, ``kv_a_proj_with_mqa``,
    ``o_proj``), the rotary rows of the query projection and of ``kv_a_proj_with_mqa`` reordered by
    ``perm`` (:func:`rope_permutation` on import, its inverse on export)."""
    H, r, dn, dr = layer.n_heads, layer.kv_lora_rank, layer.qk_nope_head_dim, layer.qk_rope_head_dim
    out = {}
    for hf_name, ours in _ATTENTION_NAMES.items():
        module = getattr(layer, ours)
        if module is None:  # (q_proj, or the q_lora_rank ones)
            continue
        for kind, t in module.named_parameters(recurse=False):
            a, b = (ours, hf_name) if export else (hf_name, ours)
            value = w.pop(f"{src}{a}.{kind}", tuple(t.shape))
            if ours in ("q_proj", "q_b_proj"):
                value = _permute_q(value, H, dn, dr, perm)
            elif ours == "kv_a_proj":
                value = _permute_kv(value, r, perm)
            out[f"{dst}{b}.{kind}"] = value
    return out


def yarn_softmax_scale(qk_head_dim: int, scaling: dict | None) -> float | None:
    """``transformers``' logit scale of ``DeepseekV3Attention`` (``yarn_apply_mscale``):
    ``qk_head_dim ** -0.5 · m²`` with ``m = 0.1 · mscale_all_dim · ln(factor) + 1`` (1 for ``factor
    ≤ 1``) where the scaling sets a non-zero ``mscale_all_dim``; ``None`` (MLA's default
    ``qk_head_dim ** -0.5``) otherwise. Computed in the same order of operations."""
    a = (scaling or {}).get("mscale_all_dim")
    if not a:
        return None
    s = scaling["factor"]
    m = 1.0 if s <= 1 else 0.1 * a * math.log(s) + 1.0
    return qk_head_dim ** (-0.5) * m * m


def import_deepseek_v3(hf_config: dict, weights: dict[str, Tensor]) -> tuple[ModelConfig, dict[str, Tensor]]:
    """``DeepseekV3ForCausalLM`` import (``model_type`` one of :data:`MODEL_TYPES`): ``(config dict,
    state dict)`` → a mnemo ``(ModelConfig, state dict)`` (see :mod:`mnemo.hf.deepseek`). Raises
    ``ValueError`` ("DeepSeek-V3 conversion: …") naming the field or weight that cannot be reproduced
    exactly."""
    cfg = _aliases(FMT, dict(hf_config), {"num_local_experts": "n_routed_experts"})
    if cfg.get("model_type", MODEL_TYPE) not in MODEL_TYPES:
        FMT.refuse(f"model_type {cfg['model_type']!r} is not one of {list(MODEL_TYPES)}")
    _refuse_hub_only(FMT, ARCH, cfg, _HUB_ONLY, _ROUTES)
    return _import_mla(FMT, ARCH, cfg, weights, _moe_options)


def import_deepseek_v2(hf_config: dict, weights: dict[str, Tensor]) -> tuple[ModelConfig, dict[str, Tensor]]:
    """``DeepseekV2ForCausalLM`` import: ``(config dict, state dict)`` → a mnemo ``(ModelConfig,
    state dict)`` (see :mod:`mnemo.hf.deepseek`: DeepSeek-V3's stack with a softmax router, greedy
    or group-limited by each group's largest score, and always-interleaved rotary pairs). Raises
    ``ValueError`` ("DeepSeek-V2 conversion: …") naming the field or weight that cannot be
    reproduced exactly."""
    cfg = _aliases(FMT_V2, dict(hf_config), {"num_experts": "n_routed_experts"})
    if cfg.get("model_type", MODEL_TYPE_V2) != MODEL_TYPE_V2:
        FMT_V2.refuse(f"model_type {cfg['model_type']!r} is not {MODEL_TYPE_V2!r}")
    _refuse_hub_only(FMT_V2, ARCH_V2, cfg, _HUB_ONLY_V2, _ROUTES_V2)
    if _bool(cfg, "mlp_bias", FMT_V2):
        FMT_V2.refuse("field 'mlp_bias' = true: mnemo's SwiGLU MLPs have no biases (expected false)")
    cfg.pop("rope_interleave", None)  # (not a field of DeepseekV2Config: always interleaved)
    return _import_mla(FMT_V2, ARCH_V2, cfg, weights, _moe_options_v2)


def _aliases(fmt: ConfigFormat, cfg: dict, names: dict[str, str]) -> dict:
    """``cfg`` with the config class's ``attribute_map`` spellings (``{alias: field}``) read as the
    field, as ``transformers`` reads them (review 50g: ``"num_experts"`` fell back to the default);
    the two given with different values is refused by name."""
    for alias, name in names.items():
        if cfg.get(alias) is None:
            cfg.pop(alias, None)
            continue
        if cfg.get(name) is not None and cfg[name] != cfg[alias]:
            fmt.refuse(
                f"fields {name!r} = {cfg[name]!r} and {alias!r} = {cfg[alias]!r} (its alias) differ; "
                "expected one value"
            )
        cfg[name] = cfg.pop(alias)
    return cfg


def _refuse_hub_only(fmt: ConfigFormat, arch: str, cfg: dict, fields: dict, routes: str) -> None:
    for key, want in fields.items():
        if cfg.get(key) is not None and cfg[key] != want:
            fmt.refuse(
                f"field {key!r} = {cfg[key]!r}: transformers' {arch} ignores it and routes as {key} = "
                f"{want!r} would ({routes}), so the checkpoint and the class disagree; expected no such "
                "field or that value"
            )


def _import_mla(fmt: ConfigFormat, arch: str, cfg: dict, weights: dict[str, Tensor], moe_options):
    """The stack both classes share (:mod:`mnemo.hf.deepseek`); ``moe_options(cfg)`` reads the
    sparse block's options; a DeepSeek-V3 router's ``e_score_correction_bias`` is its balancing bias."""
    act = fmt.get(cfg, "hidden_act")
    if act != "silu":
        fmt.refuse(f"hidden_act {act!r} is not supported (only 'silu': mnemo's MLP is SwiGLU)")
    n, d, H = (
        _int(cfg, "num_hidden_layers", 1, fmt=fmt),
        _int(cfg, "hidden_size", 1, fmt=fmt),
        _int(cfg, "num_attention_heads", 1, fmt=fmt),
    )
    H_kv = cfg.get("num_key_value_heads")
    if H_kv is not None and H_kv != H:
        fmt.refuse(
            f"num_key_value_heads = {H_kv!r}: expected num_attention_heads = {H} (or null); multi-head "
            "latent attention expands its latent into every head's keys and values (no grouped heads)"
        )
    q_rank = _int(cfg, "q_lora_rank", 1, nullable=True, fmt=fmt)
    r, dn = _int(cfg, "kv_lora_rank", 1, fmt=fmt), _int(cfg, "qk_nope_head_dim", 1, fmt=fmt)
    dr, dv = _int(cfg, "qk_rope_head_dim", 2, fmt=fmt), _int(cfg, "v_head_dim", 1, fmt=fmt)
    if dr % 2:
        fmt.refuse(f"field 'qk_rope_head_dim' = {dr}: RoPE rotates pairs of channels (expected even)")
    interleave, bias = _bool(cfg, "rope_interleave", fmt), _bool(cfg, "attention_bias", fmt)
    theta, partial, scaling = rope_fields(
        fmt, cfg, kinds={"default": "plain RoPE", "yarn": "transformers' YaRN"}, partial_default=1.0
    )
    if partial != 1.0:
        fmt.refuse(
            f"partial_rotary_factor = {partial}: {arch} rotates all qk_rope_head_dim = {dr} channels "
            "(expected 1)"
        )
    eps = fmt.get(cfg, "rms_norm_eps")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        fmt.refuse(f"field 'rms_norm_eps': expected a number > 0, got {eps!r}")
    mla: dict[str, Any] = dict(
        n_heads=H, kv_lora_rank=r, q_lora_rank=q_rank, qk_nope_head_dim=dn, qk_rope_head_dim=dr,
        v_head_dim=dv, rope_theta=theta, bias=bias, norm_eps=LATENT_EPS,
    )  # fmt: skip
    if scaling is not None:
        mla["rope_scaling"] = scaling
    scale = yarn_softmax_scale(dn + dr, scaling)
    if scale is not None:
        mla["softmax_scale"] = scale
    k_field = _int(cfg, "first_k_dense_replace", 0, fmt=fmt)
    k_dense = min(k_field, n)
    moe = moe_options(cfg) if k_dense < n else None
    tie = tied_as_loaded(fmt, cfg, weights)
    hidden = _int(cfg, "intermediate_size", 1, fmt=fmt)
    config = ModelConfig(
        vocab_size=_int(cfg, "vocab_size", 1, fmt=fmt),
        d_model=d,
        n_layers=n,
        mixer=MLA,
        mixer_options={MLA: mla},
        mlp="swiglu" if moe is None else "moe",
        mlp_hidden=hidden,
        mlp_options=moe or {},
        mlp_only_layers=list(range(k_dense)) if moe is not None and k_dense else None,
        pos_embedding="none",
        tie_embeddings=tie,
        norm_eps=float(eps),
        init_std=fmt.init_std(fmt.get(cfg, "initializer_range")),
    ).validate()

    mtp_key = "num_mtp_layers" if "num_mtp_layers" in cfg else "num_nextn_predict_layers"
    mtp = _int(cfg, mtp_key, 0, fmt=fmt)
    ignore = tuple(f"model.layers.{j}." for j in range(n, n + mtp))  # (not in the causal LM's forward)
    w = Weights(fmt, weights, ignore=ignore, cfg=cfg)
    perm, layer = rope_permutation(dr, interleave), _mla_layer(config)
    sd = import_head(w, config.vocab_size, d, tie)
    sd["norm.weight"] = w.pop("model.norm.weight", (d,))
    for i in range(n):
        p, q, a = f"model.layers.{i}.", f"blocks.{i}.", f"model.layers.{i}.self_attn."
        sd[q + "mixer_norm.weight"] = w.pop(p + "input_layernorm.weight", (d,))
        sd[q + "mlp_norm.weight"] = w.pop(p + "post_attention_layernorm.weight", (d,))
        sd |= _move_attention(w, a, f"blocks.{i}.mixer.", layer, perm)
        dense = moe is None or i < k_dense
        _check_dense_layer(fmt, w, p, i, dense, k_field, n)
        if dense:
            sd[q + "mlp.w_in.weight"], sd[q + "mlp.w_out.weight"] = _swiglu_in(w, p + "mlp.", hidden, d)
            continue
        sd |= _import_experts(_CLASS, w, p, q + "mlp.", moe, d)
        if moe["bias_balancing"]:  # DeepSeek-V3's e_score_correction_bias
            sd[q + "mlp.expert_bias"] = w.pop(p + "mlp.gate.e_score_correction_bias", (moe["n_experts"],))
        S = moe["shared_expert_hidden"]
        if S is None:  # n_shared_experts = 0: transformers' shared MLP has width 0 (outputs 0)
            for x in ("gate_proj", "up_proj", "down_proj"):
                if p + f"mlp.shared_experts.{x}.weight" in w:
                    w.pop(p + f"mlp.shared_experts.{x}.weight")
        else:
            w_in, w_out = _swiglu_in(w, p + "mlp.shared_experts.", S, d)
            sd[q + "mlp.shared_expert.w_in.weight"], sd[q + "mlp.shared_expert.w_out.weight"] = w_in, w_out
    w.finish()
    return config, sd


def _check_dense_layer(fmt: ConfigFormat, w: Weights, p: str, i: int, dense: bool, k: int, n: int) -> None:
    """Refuse, naming ``first_k_dense_replace``, a layer whose weights are of the other kind than
    the field makes it (a router where it makes a dense MLP, or the reverse): the config and the
    file disagree (else reported as a missing weight)."""
    router, mlp = p + "mlp.gate.weight", p + "mlp.gate_proj.weight"
    if dense and router in w and mlp not in w:
        fmt.refuse(
            f"field 'first_k_dense_replace' = {k} makes layer {i} a dense MLP (the first k layers; every "
            f"layer where k >= num_hidden_layers = {n}), but the weights hold its router {router!r}: the "
            "config and the weights disagree"
        )
    if not dense and mlp in w and router not in w:
        fmt.refuse(
            f"field 'first_k_dense_replace' = {k} makes layer {i} a mixture of experts (layers k and on), "
            f"but the weights hold a dense MLP there ({mlp!r}): the config and the weights disagree"
        )


def _sparse_sizes(cfg: dict, fmt: ConfigFormat) -> dict[str, Any]:
    """The sizes both sparse blocks share, as :class:`~mnemo.layers.MoE` options: ``n_experts``,
    ``top_k``, ``expert_hidden`` and the ungated shared expert ``n_shared_experts ×
    moe_intermediate_size`` wide (``None`` for 0)."""
    E, k = _int(cfg, "n_routed_experts", 1, fmt=fmt), _int(cfg, "num_experts_per_tok", 1, fmt=fmt)
    I, shared = _int(cfg, "moe_intermediate_size", 1, fmt=fmt), _int(cfg, "n_shared_experts", 0, fmt=fmt)
    if k > E:
        fmt.refuse(f"field 'num_experts_per_tok' = {k}: expected at most n_routed_experts = {E}")
    return dict(n_experts=E, top_k=k, expert_hidden=I, shared_expert_hidden=shared * I or None,
                shared_expert_gate=False)  # fmt: skip


def _check_groups(fmt: ConfigFormat, E: int, k: int, G: int, M: int) -> None:
    if M > G or k > M * (E // G):
        fmt.refuse(
            f"fields num_experts_per_tok = {k}, topk_group = {M}: expected topk_group <= n_group = {G} and "
            f"num_experts_per_tok <= topk_group · n_routed_experts / n_group = {M * (E // G)}"
        )


def _moe_options(cfg: dict) -> dict[str, Any]:
    """The ``mlp_options`` of the :class:`~mnemo.layers.MoE` equal to ``DeepseekV3MoE``."""
    sizes = _sparse_sizes(cfg, FMT)
    E, k = sizes["n_experts"], sizes["top_k"]
    G, M = _int(cfg, "n_group", 1), _int(cfg, "topk_group", 1)
    if E % G or E // G < 2:
        FMT.refuse(
            f"fields n_routed_experts = {E}, n_group = {G}: expected groups of at least two experts "
            "(n_group dividing n_routed_experts; transformers scores a group by the top 2 of its experts, "
            "which fails on a group of one whatever topk_group)"
        )
    _check_groups(FMT, E, k, G, M)
    return dict(
        **sizes,
        norm_topk_prob=_bool(cfg, "norm_topk_prob"),
        score="sigmoid",
        routed_scaling_factor=_number(cfg, "routed_scaling_factor"),
        n_group=G,
        topk_group=M,
        bias_balancing=True,
        aux_loss_coef=0.0,
    )


#: DeepSeek-V2's ``topk_method`` values ``transformers`` computes
TOPK_METHODS = ("greedy", "group_limited_greedy")


def _moe_options_v2(cfg: dict) -> dict[str, Any]:
    """The ``mlp_options`` of the :class:`~mnemo.layers.MoE` equal to ``DeepseekV2Moe``."""
    fmt = FMT_V2
    sizes = _sparse_sizes(cfg, fmt)
    E, k = sizes["n_experts"], sizes["top_k"]
    method = cfg["topk_method"] if "topk_method" in cfg else fmt.defaults["topk_method"]
    if method not in TOPK_METHODS:
        fmt.refuse(
            f"field 'topk_method' = {method!r}: transformers' {ARCH_V2} routes by 'greedy' (the top "
            "num_experts_per_tok of the softmax) or 'group_limited_greedy' (within the topk_group groups "
            "of largest best score); expected one of them"
        )
    G = M = 1
    if method == "group_limited_greedy":
        G, M = _int(cfg, "n_group", 1, fmt=fmt), _int(cfg, "topk_group", 1, fmt=fmt)
        if E % G:
            fmt.refuse(
                f"fields n_routed_experts = {E}, n_group = {G}: expected n_group dividing n_routed_experts "
                "(transformers views the scores as n_group equal groups)"
            )
        _check_groups(fmt, E, k, G, M)
    if _bool(cfg, "norm_topk_prob", fmt) and k > 1:
        fmt.refuse(
            f"field 'norm_topk_prob' = true: transformers' {ARCH_V2} never renormalises the top-k weights "
            "(each is its softmax score times routed_scaling_factor), DeepSeek-V2's own code would divide "
            "them by their sum; expected false"
        )
    aux, seq = _v2_losses(cfg, grouped=M < G)
    return dict(
        **sizes,
        norm_topk_prob=False,
        score="softmax",
        routed_scaling_factor=_number(cfg, "routed_scaling_factor", fmt),
        n_group=G,
        topk_group=M,
        **({"group_score": "max"} if M < G else {}),
        bias_balancing=False,
        aux_loss_coef=aux,
        seq_aux_loss_coef=seq,
    )


def _v2_losses(cfg: dict, grouped: bool) -> tuple[float, float]:
    """``(aux_loss_coef, seq_aux_loss_coef)`` from DeepSeek-V2's ``aux_loss_alpha`` / ``seq_aux``
    (its own code's defaults: ``seq_aux`` true); ``(0, 0)`` without ``aux_loss_alpha`` and for the
    sequence-wise loss over a group-limited choice (see :mod:`mnemo.hf.deepseek`)."""
    alpha = cfg.get("aux_loss_alpha")
    if alpha is None:
        return 0.0, 0.0
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha < float("inf"):
        FMT_V2.refuse(f"field 'aux_loss_alpha': expected a number >= 0, got {alpha!r}")
    seq = cfg.get("seq_aux", True)
    if not isinstance(seq, bool):
        FMT_V2.refuse(f"field 'seq_aux': expected true or false, got {seq!r}")
    if not seq:
        return float(alpha), 0.0
    return (0.0, 0.0) if grouped else (0.0, float(alpha))


def export_deepseek_v3(config: ModelConfig, weights: dict[str, Tensor]) -> tuple[dict, dict[str, Tensor]]:
    """``DeepseekV3ForCausalLM`` export: a mnemo ``(ModelConfig, state dict)`` → ``(config dict,
    state dict)`` (see :mod:`mnemo.hf.deepseek`): ``"mla"`` layers, a SwiGLU MLP in the first ``k``
    layers (``mlp_only_layers = [0, …, k − 1]``) and DeepSeek-V3's MoE in the others (or SwiGLU
    everywhere). Raises ``ValueError`` ("DeepSeek-V3 conversion: …") naming what the class cannot
    express."""
    return _export_mla(FMT, ARCH, MODEL_TYPE, config, weights, _export_moe_options)


def export_deepseek_v2(config: ModelConfig, weights: dict[str, Tensor]) -> tuple[dict, dict[str, Tensor]]:
    """``DeepseekV2ForCausalLM`` export: as :func:`export_deepseek_v3` with DeepSeek-V2's router
    (softmax scores, not renormalised, no bias; ``topk_method`` ``"group_limited_greedy"`` for
    groups scored by their largest score, else ``"greedy"``). Raises ``ValueError`` ("DeepSeek-V2
    conversion: …") naming what the class cannot express."""
    return _export_mla(FMT_V2, ARCH_V2, MODEL_TYPE_V2, config, weights, _export_moe_options_v2)


def _export_mla(fmt: ConfigFormat, arch: str, model_type: str, config: ModelConfig, weights, moe_options):
    """The stack both classes share; ``moe_options(config) -> (options, config.json fields)``."""
    config = config.validate()
    refuse_unexpressed(fmt.name, config, mlp_only_layers=True, softmax_scale={"mla"})
    for i, mixer in enumerate(config.layer_mixers()):
        if mixer != MLA:
            fmt.refuse(f"layer {i} uses mixer {mixer!r}; {arch} layers are {MLA!r}")
    if config.mlp not in ("moe", "swiglu"):
        fmt.refuse(f"mlp {config.mlp!r} is not supported (only 'moe' with dense first layers, or 'swiglu')")
    if config.pos_embedding != "none":
        fmt.refuse(f"pos_embedding {config.pos_embedding!r} is not supported ({arch} uses RoPE only)")
    n, d = config.n_layers, config.d_model
    dense = sorted(config.mlp_only_layers or [])
    k_dense = n if config.mlp == "swiglu" else len(dense)
    if dense != list(range(len(dense))):
        fmt.refuse(
            f"mlp_only_layers {dense}: {arch}'s dense layers are the first first_k_dense_replace ones "
            f"(expected [0, …, k − 1])"
        )
    where = f"mixer_options[{MLA!r}]"
    opts = mixer_options(MLA, config)
    fmt.require(where, opts, "norm_eps", LATENT_EPS)
    fmt.require(where, opts, "rope", True)  # (rope=False, unrotated decoupled keys: Kimi Linear's MLA)
    layer = _mla_layer(config)
    H, r, q_rank = layer.n_heads, layer.kv_lora_rank, layer.q_lora_rank
    dn, dr, dv = layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.v_head_dim
    bias = bool(opts["bias"])
    scaling = check_rope_scaling(opts.get("rope_scaling"))
    if scaling is not None and scaling["rope_type"] != "yarn_hf":
        fmt.refuse(
            f"{where}['rope_scaling'] = {opts['rope_scaling']!r}: only plain RoPE and transformers' YaRN "
            "('yarn_hf') are exported"
        )
    want = yarn_softmax_scale(dn + dr, scaling) or (dn + dr) ** -0.5
    if not math.isclose(layer.scale, want, rel_tol=1e-12):
        fmt.refuse(
            f"{where} option softmax_scale={opts.get('softmax_scale')!r} gives the logit scale "
            f"{layer.scale!r}; {arch} computes (qk_nope_head_dim + qk_rope_head_dim) ** -0.5 times YaRN's "
            f"m(factor, mscale_all_dim)² = {want!r} for this rope_scaling"
        )
    hidden = config.mlp_hidden or swiglu_hidden(d)
    rope = rope_parameters(opts["rope_theta"], scaling)
    v3 = arch == ARCH
    hf: dict[str, Any] = {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": d,
        "intermediate_size": hidden,
        "num_hidden_layers": n,
        "num_attention_heads": H,
        "num_key_value_heads": H,
        "q_lora_rank": q_rank,
        "kv_lora_rank": r,
        "qk_nope_head_dim": dn,
        "qk_rope_head_dim": dr,
        "v_head_dim": dv,
        "first_k_dense_replace": k_dense,
        "hidden_act": "silu",
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "rope_parameters": rope,
        "attention_bias": bias,
        "attention_dropout": 0.0,
        "initializer_range": config.init_std,
        **({"rope_interleave": True, "num_mtp_layers": 0} if v3 else {"mlp_bias": False}),
    }
    if rope.get("rope_type") == "yarn":  # (transformers derives a missing factor from their ratio)
        hf["max_position_embeddings"] = int(round(rope["factor"] * rope["original_max_position_embeddings"]))
    moe = None
    if config.mlp == "moe":
        moe, fields = moe_options(config)
        hf |= {
            "n_routed_experts": moe["n_experts"],
            "num_experts_per_tok": moe["top_k"],
            "moe_intermediate_size": moe["expert_hidden"],
            "n_shared_experts": (moe["shared_expert_hidden"] or 0) // moe["expert_hidden"],
            "norm_topk_prob": moe["norm_topk_prob"],
            "routed_scaling_factor": moe["routed_scaling_factor"],
            **fields,
        }

    w = Weights(fmt, weights)
    perm = torch.argsort(rope_permutation(dr, True))  # (the inverse of the import's)
    sd = export_head(w, config)
    sd["model.norm.weight"] = w.pop("norm.weight", (d,))
    for i in range(n):
        p, q, a = f"model.layers.{i}.", f"blocks.{i}.", f"model.layers.{i}.self_attn."
        sd[p + "input_layernorm.weight"] = w.pop(q + "mixer_norm.weight", (d,))
        sd[p + "post_attention_layernorm.weight"] = w.pop(q + "mlp_norm.weight", (d,))
        sd |= _move_attention(w, f"blocks.{i}.mixer.", a, layer, perm, export=True)
        if moe is None or i < k_dense:
            sd |= _swiglu_out(w, q + "mlp.", p + "mlp.", hidden, d)
            continue
        sd |= _export_experts(_CLASS, w, q + "mlp.", p, moe, d)
        sd[p + "mlp.gate.weight"] = sd[p + "mlp.gate.weight"].float()  # (KEEP_FLOAT32)
        if v3:
            E = moe["n_experts"]
            bias_key = q + "mlp.expert_bias"
            sd[p + "mlp.gate.e_score_correction_bias"] = (
                w.pop(bias_key, (E,)).float() if moe["bias_balancing"] else torch.zeros(E)
            )
        S = moe["shared_expert_hidden"]
        if S is None:
            sd |= {p + f"mlp.shared_experts.{x}_proj.weight": torch.zeros(0, d) for x in ("gate", "up")}
            sd[p + "mlp.shared_experts.down_proj.weight"] = torch.zeros(d, 0)
        else:
            sd |= _swiglu_out(w, q + "mlp.shared_expert.", p + "mlp.shared_experts.", S, d)
    w.finish()
    return hf, {k: v.contiguous() for k, v in sd.items()}


def _common_moe_options(fmt: ConfigFormat, config: ModelConfig, score: str) -> dict[str, Any]:
    """The model's :class:`~mnemo.layers.MoE` options (defaults filled in), refused by name where
    both classes compute another function: another ``score``, a gated shared expert, a shared width
    that is not a multiple of the experts'."""
    where = "mlp_options"
    o = {**MOE_OPTIONS, **config.mlp_options}
    o["expert_hidden"] = o["expert_hidden"] or config.mlp_hidden or swiglu_hidden(config.d_model)
    fmt.require(where, o, "score", score)
    fmt.require(where, o, "shared_expert_gate", False)
    S, I = o["shared_expert_hidden"], o["expert_hidden"]
    if S is not None and S % I:
        fmt.refuse(
            f"{where} option shared_expert_hidden={S!r}: {fmt.name}'s shared experts are n_shared_experts × "
            f"moe_intermediate_size wide (expected a multiple of expert_hidden = {I}, or None)"
        )
    return o


def _export_moe_options(config: ModelConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's :class:`~mnemo.layers.MoE` options and DeepSeek-V3's group fields, refused by name
    where ``DeepseekV3MoE`` computes another function. ``bias_balancing`` false exports a zero
    ``e_score_correction_bias``; the training-only options (``capacity_factor``, the loss weights,
    ``bias_update_rate``, ``dispatch``) are not carried. Groups of one expert that limit nothing
    (``topk_group = n_group = n_experts``), which ``transformers``' router cannot run (it takes the
    top 2 of each group), are written as one group: the same function."""
    o = _common_moe_options(FMT, config, "sigmoid")
    E, G, M = o["n_experts"], o["n_group"], o["topk_group"]
    if M == G and E // G < 2:  # (nothing limited: one group, the same function, which transformers runs)
        G = M = 1
    if M < G:
        FMT.require("mlp_options", o, "group_score", "top2")
    if E // G < 2:
        FMT.refuse(
            f"mlp_options options n_experts={E}, n_group={G}: transformers scores a group by its two best "
            "experts (expected at least two experts per group)"
        )
    return o, {"n_group": G, "topk_group": M}


def _export_moe_options_v2(config: ModelConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's :class:`~mnemo.layers.MoE` options and DeepSeek-V2's routing fields, refused by
    name where ``DeepseekV2Moe`` computes another function (renormalised weights, a balancing bias,
    groups scored by their two best experts); ``aux_loss_coef`` / ``seq_aux_loss_coef`` as
    ``aux_loss_alpha`` / ``seq_aux`` where one alone is set and corresponds (see
    :mod:`mnemo.hf.deepseek`), else not carried."""
    where = "mlp_options"
    o = _common_moe_options(FMT_V2, config, "softmax")
    FMT_V2.require(where, o, "norm_topk_prob", False)
    FMT_V2.require(where, o, "bias_balancing", False)
    grouped = o["topk_group"] < o["n_group"]
    fields: dict[str, Any] = {"topk_method": "greedy", "n_group": None, "topk_group": None}
    if grouped:
        FMT_V2.require(where, o, "group_score", "max")
        fields = {
            "topk_method": "group_limited_greedy",
            "n_group": o["n_group"],
            "topk_group": o["topk_group"],
        }
    aux, seq = o["aux_loss_coef"], o["seq_aux_loss_coef"]
    if aux and not seq:
        fields |= {"aux_loss_alpha": aux, "seq_aux": False}
    elif seq and not aux and not grouped:
        fields |= {"aux_loss_alpha": seq, "seq_aux": True}
    return o, fields
