"""IBM Granite in and out of mnemo: Granite 4.0-H (``GraniteMoeHybridForCausalLM``, the Mamba-2 /
attention hybrids ``granite-4.0-h-micro`` / ``-tiny`` / ``-small``) and dense Granite
(``GraniteForCausalLM``, Granite 3.x).

:func:`import_granitemoehybrid` turns a ``transformers`` ``GraniteMoeHybridForCausalLM`` config (a
dict, as in ``config.json``) and its weights into a :class:`~mnemo.models.ModelConfig` and a state
dict that ``LanguageModel(config).load_state_dict(sd, strict=True)`` accepts;
:func:`export_granitemoehybrid` does the reverse; :func:`import_granite` / :func:`export_granite` the
same for dense Granite. Plain dicts and tensors: nothing here imports ``transformers``.

Granite's four scalars (``transformers`` 5.25's ``modeling_granitemoehybrid.py`` and
``modeling_granite.py``): the token embedding is multiplied by ``embedding_multiplier``, each
residual branch by ``residual_multiplier`` (``x + m · mixer(norm(x))``, ``x + m · mlp(norm(x))``),
the attention logits by ``attention_multiplier`` (in place of ``head_dim ** -0.5``) and the output
logits divided by ``logits_scaling``: mnemo's :class:`~mnemo.models.ModelConfig` fields of the same
names and the attention's ``softmax_scale``. Only these two formats carry them: every other format's
export refuses a model that sets them (:func:`mnemo.hf.convert._refuse_multipliers`).

Granite 4.0-H, the rest of the function: blocks ``x + m · mixer(RMSNorm(x))``, ``x + m ·
mlp(RMSNorm(x))`` (``input_layernorm``, ``post_attention_layernorm``; ``norm`` at the top; every norm
``rms_norm_eps``) and

* a mixer per layer by ``layer_types``: ``"mamba"`` (``transformers`` 5 writes
  ``"linear_attention"``) → ``"mamba2"``, Bamba's Mamba-2 layer exactly (``GraniteMoeHybridMambaLayer``
  is ``BambaMixer``; the fields and weights are read and written by :mod:`mnemo.hf.bamba`'s
  functions); ``"attention"`` (``"full_attention"``) → ``"attention"``: ``num_attention_heads``,
  ``num_key_value_heads``, ``head_dim = hidden_size // num_attention_heads`` (or a ``head_dim``
  field), biases on q, k, v and o by ``attention_bias``, ``softmax_scale = attention_multiplier``,
  and by ``position_embedding_type`` no positions at all (``null`` / ``"nope"``: the released 4.0-H
  models) or RoPE over the whole head (``"rope"``; ``rope_parameters`` as the Llama family reads
  them: ``"default"``, ``"linear"``, ``"llama3"``, ``"yarn"`` → ``"yarn_hf"``);
* an MLP in every layer: the dense ``shared_mlp`` alone (``num_local_experts`` 0) → mnemo
  ``"swiglu"`` of ``shared_intermediate_size`` (``input_linear`` rows are ``[gate; up]``:
  ``silu(first half) · second half``, mnemo's ``w_in`` as it is; ``output_linear`` → ``w_out``), or a
  top-k mixture plus that shared MLP → mnemo ``"moe"`` (:class:`~mnemo.layers.MoE`) with
  ``n_experts = num_local_experts``, ``top_k = num_experts_per_tok``, ``expert_hidden =
  intermediate_size``, ``shared_expert_hidden = shared_intermediate_size`` and no shared gate (the
  two outputs are added). Granite's router takes the softmax of the top-k logits; mnemo's takes the
  top-k of the softmax over all experts and renormalises (``norm_topk_prob=True``): the same weights
  (``softmax(z)_e / Σ_{TopK} softmax(z) = exp z_e / Σ_{TopK} exp z``) and the same experts (softmax
  is monotone). The experts' ``input_linear`` ``[E, 2·I, d]`` (``[gate; up]`` per expert) is mnemo's
  ``w_in``, ``output_linear`` ``[E, d, I]`` its ``w_out``, ``router.layer`` its ``router``; a state
  dict of ``transformers`` 5 (``experts.gate_up_proj``, ``experts.down_proj``, ``router.weight``) is
  read too, and an export writes the file names (what ``save_pretrained`` writes).

``router_aux_loss_coef`` ``c`` becomes ``aux_loss_coef = c · k / L`` and goes back as
``aux_loss_coef · L / k``, as for Mixtral (:mod:`mnemo.hf.llama`): ``transformers`` computes
Granite 4.0-H's balance loss with Mixtral's function (``k`` times mnemo's ``L_aux``, its statistics
pooled over the ``L`` layers, every one of which has the MoE, where mnemo sums the layers' losses:
the same objective where the layers route alike, and for one layer; a training-only term).

Not carried (no effect on the function): ``output_router_logits``, ``attention_dropout``,
``mamba_chunk_size``'s blocking (carried as the Mamba-2 ``chunk_size``), ``pad_token_id``'s
``padding_idx``.

Refused by name (``ValueError``, "Granite 4.0-H conversion: …" / "Granite conversion: …"): a
``hidden_act`` other than ``"silu"`` (the MLPs' and the Mamba conv's activation), a layer type that
is neither Mamba nor attention, a ``position_embedding_type`` other than ``null`` / ``"nope"`` /
``"rope"``, a multiplier that is not a finite number > 0, ``num_experts_per_tok`` outside ``1 …
num_local_experts``, Bamba's Mamba-2 refusals (``mamba_n_groups`` not dividing ``mamba_n_heads``,
heads that do not tile ``mamba_expand · hidden_size``, …), a scaled RoPE over part of the head, and
a missing, mis-shaped or unexpected weight. Export refuses what the class cannot express: another
mixer or MLP, a model without an attention layer (``transformers`` 5.25's model raises in its
forward pass without one whenever it keeps a cache: ``use_cache``, its default, and ``generate``),
learned positions, an attention window, sinks, q/k norms, output gate, an odd ``head_dim`` (its
config checks the rotary fields even without positions), partial rotary, ``bias="qkv"``, mnemo's own
YaRN (``rope_type`` ``"yarn"``), and of a MoE sigmoid scores, ``norm_topk_prob=False``, no shared
expert or a gated one, a routed scaling factor, group-limited routing, a balancing bias or a
capacity limit. Known difference, as for Bamba: ``transformers``' one-token Mamba-2 step does not
apply ``time_step_limit``; mnemo applies it in every form (the default ``(0, inf)`` changes
nothing).

Dense Granite is a Llama (:mod:`mnemo.hf.llama`, whose reading and writing it reuses) with the four
scalars; ``mlp_bias`` is refused (mnemo's SwiGLU has no biases).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from torch import Tensor

from ..layers.mlp import swiglu_hidden
from ..layers.moe import MOE_OPTIONS
from ..layers.rotary import check_rope_scaling
from ..models.config import ModelConfig
from . import llama
from .bamba import (
    ATTN,
    MAMBA2,
    _attention_weights,
    _count,
    _mamba2_opts,
    _mamba_weights,
    mamba2_fields,
)
from .bamba import HF_DEFAULTS as _BAMBA_DEFAULTS
from .bamba import SHAPE_FIELDS as _BAMBA_SHAPES
from .fields import (
    ConfigFormat,
    Weights,
    aux_loss_coef_from_hf,
    aux_loss_coef_to_hf,
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

ARCH, MODEL_TYPE = "GraniteMoeHybridForCausalLM", "granitemoehybrid"
DENSE_ARCH, DENSE_MODEL_TYPE = "GraniteForCausalLM", "granite"
#: Granite's scalars and their :class:`ModelConfig` fields (``attention_multiplier``: ``softmax_scale``)
MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "logits_scaling")
#: ``layer_types`` entries: ``transformers`` 5's names and the legacy ones the released configs use
MAMBA_TYPES, ATTN_TYPES = ("mamba", "linear_attention"), ("attention", "full_attention")

#: ``GraniteMoeHybridConfig``'s defaults (``transformers`` 5.25) for the fields the conversion reads
HF_DEFAULTS: dict[str, Any] = {
    **{k: v for k, v in _BAMBA_DEFAULTS.items() if k.startswith("mamba_")},
    "vocab_size": 32000,
    "tie_word_embeddings": False,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "shared_intermediate_size": 1024,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": None,  # num_attention_heads
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048,
    "attention_bias": False,
    "embedding_multiplier": 1.0,
    "residual_multiplier": 1.0,
    "logits_scaling": 1.0,
    "attention_multiplier": 1.0,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "position_embedding_type": None,
    "layer_types": None,  # every layer Mamba
}

_MOE_I = ("num_local_experts", "intermediate_size", "hidden_size")
_SHARED_I = ("shared_intermediate_size", "hidden_size")
SHAPE_FIELDS: dict[str, tuple[str, ...]] = {
    **{
        k: v
        for k, v in _BAMBA_SHAPES.items()
        if k.startswith(("embed_", "lm_head", "input_", "mamba.", "self_"))
    },
    "model.norm.weight": ("hidden_size",),
    "post_attention_layernorm.weight": ("hidden_size",),
    "shared_mlp.input_linear.weight": _SHARED_I,
    "shared_mlp.output_linear.weight": _SHARED_I,
    "block_sparse_moe.input_linear.weight": _MOE_I,
    "block_sparse_moe.output_linear.weight": _MOE_I,
    "block_sparse_moe.router.layer.weight": ("num_local_experts", "hidden_size"),
}

#: the format: its refusals say "Granite 4.0-H conversion: …"
GRANITE_H = ConfigFormat("Granite 4.0-H", HF_DEFAULTS, SHAPE_FIELDS)
_refuse, _get = GRANITE_H.refuse, GRANITE_H.get

#: ``transformers`` 5's state-dict names of the MoE weights → the names in the files
_RENAMED = {
    "block_sparse_moe.experts.gate_up_proj": "block_sparse_moe.input_linear.weight",
    "block_sparse_moe.experts.down_proj": "block_sparse_moe.output_linear.weight",
    "block_sparse_moe.router.weight": "block_sparse_moe.router.layer.weight",
}


def _scalar(fmt: ConfigFormat, cfg: dict, key: str) -> float:
    """A Granite scalar (``embedding_multiplier`` …): a finite number > 0 (the class's default 1
    where the config leaves it out)."""
    v = fmt.get(cfg, key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
        fmt.refuse(f"field {key!r}: expected a finite number > 0, got {v!r}")
    return float(v)


def _scalars(fmt: ConfigFormat, cfg: dict) -> tuple[dict[str, float], float]:
    """``({ModelConfig field: value}, attention_multiplier)`` of a Granite config."""
    return {k: _scalar(fmt, cfg, k) for k in MULTIPLIERS}, _scalar(fmt, cfg, "attention_multiplier")


def _layer_types(cfg: dict, n: int) -> list[str]:
    """mnemo's mixer per layer from ``layer_types`` (or its alias ``layers_block_type``; every layer
    Mamba when neither is given, as ``GraniteMoeHybridConfig``); refused by name otherwise."""
    key = "layer_types" if cfg.get("layer_types") is not None else "layers_block_type"
    types = cfg.get(key)
    if types is None:
        return [MAMBA2] * n
    if not isinstance(types, list) or len(types) != n:
        _refuse(f"field {key!r}: expected a list of num_hidden_layers = {n} layer types, got {types!r}")
    out = []
    for i, t in enumerate(types):
        if t not in (*MAMBA_TYPES, *ATTN_TYPES):
            _refuse(
                f"field {key!r}: layer {i} has type {t!r}; Granite 4.0-H layers are Mamba "
                f"({' / '.join(map(repr, MAMBA_TYPES))}) or attention ({' / '.join(map(repr, ATTN_TYPES))})"
            )
        out.append(MAMBA2 if t in MAMBA_TYPES else ATTN)
    return out


def _attention_opts(cfg: dict, d: int, eps: float, scale: float) -> dict[str, Any]:
    """:class:`~mnemo.layers.attention.Attention`'s options for ``GraniteMoeHybridAttention``."""
    H = _count(cfg, "num_attention_heads", GRANITE_H)
    H_kv = cfg.get("num_key_value_heads")
    H_kv = H if H_kv is None else H_kv
    if not is_int(H_kv) or H_kv < 1 or H % H_kv:
        _refuse(f"num_key_value_heads = {H_kv!r}: expected a positive int dividing num_attention_heads = {H}")
    D = cfg.get("head_dim")
    D = d // H if D is None else D
    kind = cfg.get("position_embedding_type")
    if kind not in (None, "nope", "rope"):
        _refuse(
            f"field 'position_embedding_type' = {kind!r}: expected null or 'nope' (no positions) or 'rope'"
        )
    rope = kind == "rope"
    if not is_int(D) or D < 1 or (rope and D % 2):
        _refuse(
            f"head_dim = {D!r} (hidden_size // num_attention_heads unless given): expected a positive int"
            + (", even for RoPE (it rotates pairs of channels)" if rope else "")
        )
    opts: dict[str, Any] = dict(
        n_heads=H, n_kv_heads=H_kv, head_dim=D, rope=rope, window=None, qk_norm=False, output_gate=False,
        bias=bool(_get(cfg, "attention_bias")), norm_eps=eps, softmax_scale=scale,
    )  # fmt: skip
    if rope:
        theta, partial, scaling = rope_fields(
            GRANITE_H, cfg, kinds=llama.ROPE_KINDS, partial_default=1.0, reasons=llama._ROPE_REFUSED
        )
        if scaling is not None and int(D * partial) != D:
            _refuse(
                f"partial_rotary_factor = {partial} with rope_type {scaling['rope_type']!r}: the class "
                "rotates the whole head (a scaled RoPE over part of it is not reproduced)"
            )
        opts["rope_theta"] = theta
        if scaling is not None:
            opts["rope_scaling"] = scaling
    return opts


def _moe_options(cfg: dict) -> dict[str, Any] | None:
    """``mlp_options`` of the :class:`~mnemo.layers.MoE` equal to ``GraniteMoeHybridMoE`` plus the
    shared MLP; ``None`` for ``num_local_experts`` 0 (the shared MLP alone)."""
    E = _get(cfg, "num_local_experts")
    if not is_int(E) or E < 0:
        _refuse(f"field 'num_local_experts': expected an int >= 0 (0: the shared MLP alone), got {E!r}")
    if E == 0:
        return None
    k = _get(cfg, "num_experts_per_tok")
    if not is_int(k) or not 1 <= k <= E:
        _refuse(f"field 'num_experts_per_tok' = {k!r}: expected an int in 1 … num_local_experts = {E}")
    coef = cfg.get("router_aux_loss_coef", 0.001)  # (GraniteMoeHybridConfig's default)
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not coef >= 0:
        _refuse(f"field 'router_aux_loss_coef': expected a number >= 0, got {coef!r}")
    return {
        "n_experts": E,
        "top_k": k,
        "aux_loss_coef": aux_loss_coef_from_hf(coef, k, _get(cfg, "num_hidden_layers")),  # (all sparse)
        "expert_hidden": _count(cfg, "intermediate_size", GRANITE_H),
        "shared_expert_hidden": _count(cfg, "shared_intermediate_size", GRANITE_H),
        "shared_expert_gate": False,
        "norm_topk_prob": True,
    }


def _file_names(weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """``weights`` with ``transformers`` 5's state-dict names of the MoE weights as in the files;
    a file that holds a weight under both names is refused by name."""
    out: dict[str, Tensor] = {}
    for key, v in weights.items():
        for new, old in _RENAMED.items():
            if key.endswith("." + new):
                key = key[: -len(new)] + old
                if key in weights:
                    _refuse(f"weight {key!r} is given twice (also as {key[: -len(old)] + new!r})")
                break
        out[key] = v
    return out


def import_granitemoehybrid(
    hf_config: dict, weights: dict[str, Tensor]
) -> tuple[ModelConfig, dict[str, Tensor]]:
    """A ``transformers`` ``GraniteMoeHybridForCausalLM`` checkpoint (Granite 4.0-H) as a mnemo
    ``(ModelConfig, state dict)``: ``"mamba2"`` and ``"attention"`` layers by ``layer_types``, a SwiGLU
    MLP or a MoE with a shared expert, and Granite's scalars (see the module docstring).

    ``hf_config``: the config dict (``config.json`` or ``GraniteMoeHybridConfig.to_dict()``);
    ``weights``: the state dict (the file's names or ``transformers`` 5's). Raises ``ValueError``
    ("Granite 4.0-H conversion: …") naming the field and the received value for anything not
    reproduced exactly."""
    cfg = dict(hf_config)
    if cfg.get("model_type", MODEL_TYPE) != MODEL_TYPE:
        _refuse(f"model_type {cfg['model_type']!r} is not {MODEL_TYPE!r}")
    for k in ("tie_word_embeddings", "attention_bias", "mamba_conv_bias", "mamba_proj_bias"):
        if cfg.get(k) is not None and not isinstance(cfg[k], bool):
            _refuse(f"field {k!r}: expected true or false, got {cfg[k]!r}")
    act = _get(cfg, "hidden_act")
    if act != "silu":
        _refuse(
            f"hidden_act {act!r} is not supported (only 'silu': it is the activation of the MLPs and of the "
            "Mamba-2 convolution, both SiLU in mnemo)"
        )
    n, d = _count(cfg, "num_hidden_layers", GRANITE_H), _count(cfg, "hidden_size", GRANITE_H)
    eps = _get(cfg, "rms_norm_eps")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < math.inf:
        _refuse(f"field 'rms_norm_eps': expected a finite number >= 0, got {eps!r}")
    eps = float(eps)
    scalars, attn_scale = _scalars(GRANITE_H, cfg)
    types = _layer_types(cfg, n)
    options: dict[str, dict[str, Any]] = {}
    if MAMBA2 in types:
        options[MAMBA2] = _mamba2_opts(cfg, d, eps, GRANITE_H)
    if ATTN in types:
        options[ATTN] = _attention_opts(cfg, d, eps, attn_scale)
    moe = _moe_options(cfg)
    shared = _count(cfg, "shared_intermediate_size", GRANITE_H)
    tie = tied_as_loaded(GRANITE_H, cfg, weights)
    config = ModelConfig(
        vocab_size=_count(cfg, "vocab_size", GRANITE_H),
        d_model=d,
        n_layers=n,
        layers=types,
        mixer_options=options,
        mlp="moe" if moe else "swiglu",
        mlp_hidden=None if moe else shared,
        mlp_options=moe or {},
        pos_embedding="none",
        tie_embeddings=tie,
        norm_eps=eps,
        init_std=GRANITE_H.init_std(_get(cfg, "initializer_range")),
        **scalars,
    ).validate()

    w = Weights(GRANITE_H, _file_names(weights), cfg=cfg)
    sd: dict[str, Tensor] = import_head(w, config.vocab_size, d, tie)
    sd["norm.weight"] = w.pop("model.norm.weight", (d,))
    sd.update(_layer_weights(w, types, options, moe, shared, d, importing=True))
    w.finish()
    return config, sd


def _layer_weights(
    w: Weights, types: list[str], o: dict, moe: dict | None, shared: int, d: int, importing: bool
) -> dict[str, Tensor]:
    """Every layer's weights, the file's names (``model.layers.{i}.``) ↔ mnemo's (``blocks.{i}.``):
    the norms, the MLP (:func:`_mlp_weights`) and the mixer (Bamba's Mamba-2 and attention mappings;
    ``o``: the mixers' options by name)."""
    sd: dict[str, Tensor] = {}
    for i, t in enumerate(types):
        p, q = f"model.layers.{i}.", f"blocks.{i}."
        for theirs, ours in (("input_layernorm", "mixer_norm"), ("post_attention_layernorm", "mlp_norm")):
            src, dst = (p + theirs, q + ours) if importing else (q + ours, p + theirs)
            sd[dst + ".weight"] = w.pop(src + ".weight", (d,))
        sd.update(_mlp_weights(w, p, q + "mlp.", moe, shared, d, importing))
        mixer, theirs = (_mamba_weights, "mamba.") if t == MAMBA2 else (_attention_weights, "self_attn.")
        src, dst = (p + theirs, q + "mixer.") if importing else (q + "mixer.", p + theirs)
        sd.update(mixer(w, src, dst, o[t], d, importing))
    return sd


def _mlp_weights(
    w: Weights, p: str, q: str, moe: dict | None, shared: int, d: int, importing: bool
) -> dict[str, Tensor]:
    """One layer's MLP weights, the file's names (prefix ``p`` = ``model.layers.{i}.``) ↔ mnemo's
    (prefix ``q`` = ``blocks.{i}.mlp.``): the same tensors (``[gate; up]`` rows in both)."""
    dense = "" if moe is None else "shared_expert."
    names = [  # (transformers, mnemo, shape)
        ("shared_mlp.input_linear.weight", dense + "w_in.weight", (2 * shared, d)),
        ("shared_mlp.output_linear.weight", dense + "w_out.weight", (d, shared)),
    ]
    if moe is not None:
        E, I = moe["n_experts"], moe["expert_hidden"]
        names += [
            ("block_sparse_moe.router.layer.weight", "router.weight", (E, d)),
            ("block_sparse_moe.input_linear.weight", "w_in", (E, 2 * I, d)),
            ("block_sparse_moe.output_linear.weight", "w_out", (E, d, I)),
        ]
    if importing:
        return {q + ours: w.pop(p + theirs, shape) for theirs, ours, shape in names}
    return {p + theirs: w.pop(q + ours, shape) for theirs, ours, shape in names}


def _export_moe(config: ModelConfig) -> dict[str, Any] | None:
    """The MoE's options as Granite expresses them (``None`` for a SwiGLU MLP), refused by name
    where they are not Granite's: ``n_experts``, ``top_k``, ``expert_hidden`` and
    ``shared_expert_hidden`` are read, ``aux_loss_coef`` as ``router_aux_loss_coef`` (module
    docstring); the other training-only ones (``z_loss_coef``, ``seq_aux_loss_coef``,
    ``bias_update_rate``, ``dispatch``) are not carried."""
    if config.mlp == "swiglu":
        return None
    if config.mlp != "moe":
        _refuse(f"mlp {config.mlp!r} is not supported (only 'swiglu', the shared MLP alone, or 'moe')")
    o = {**MOE_OPTIONS, **config.mlp_options}
    where = "mlp_options"
    fixed = dict(
        score="softmax", norm_topk_prob=True, shared_expert_gate=False, routed_scaling_factor=1.0,
        n_group=1, topk_group=1, bias_balancing=False, capacity_factor=None,
    )  # fmt: skip
    for key, val in fixed.items():
        GRANITE_H.require(where, o, key, val)
    if o["shared_expert_hidden"] is None:
        _refuse(
            f"{where} option shared_expert_hidden=None has no Granite 4.0-H equivalent (its shared MLP is in "
            "every layer: needs a shared expert)"
        )
    o["expert_hidden"] = o["expert_hidden"] or config.mlp_hidden or swiglu_hidden(config.d_model)
    return o


def export_granitemoehybrid(
    config: ModelConfig, weights: dict[str, Tensor]
) -> tuple[dict, dict[str, Tensor]]:
    """A mnemo ``(ModelConfig, state dict)`` as a ``transformers`` ``GraniteMoeHybridForCausalLM``
    ``(config dict, state dict)`` (the file's weight names): ``"mamba2"`` and ``"attention"`` layers,
    a SwiGLU MLP or a MoE with an ungated shared expert, and Granite's scalars (``softmax_scale``
    ``None`` is written as ``attention_multiplier = head_dim ** -0.5``). Anything the class cannot
    express raises ``ValueError`` naming the option and the received value (module docstring)."""
    config = config.validate()
    refuse_unexpressed(GRANITE_H.name, config, multipliers=True)
    types = config.layer_mixers()
    for i, mixer in enumerate(types):
        if mixer not in (MAMBA2, ATTN):
            _refuse(f"layer {i} uses mixer {mixer!r}; Granite 4.0-H layers are {MAMBA2!r} or {ATTN!r}")
    if ATTN not in types:
        _refuse(
            f"layers {sorted(set(types))} without an attention layer: transformers 5.25's "
            "GraniteMoeHybridModel cannot run one (its causal mask asks the cache for attention layers and "
            "raises)"
        )
    if config.pos_embedding != "none":
        _refuse(
            f"pos_embedding {config.pos_embedding!r} is not supported (Granite uses RoPE or no positions)"
        )
    moe = _export_moe(config)
    d = config.d_model
    shared = moe["shared_expert_hidden"] if moe else (config.mlp_hidden or swiglu_hidden(d))
    m, a = mixer_options(MAMBA2, config), mixer_options(ATTN, config)
    where_a = f"mixer_options[{ATTN!r}]"
    mamba = mamba2_fields(GRANITE_H, config, m, MAMBA2 in types)
    H = a["n_heads"]
    H_kv = a["n_kv_heads"] or H
    D = a["head_dim"] or d // H
    if D % 2:  # (transformers 5.25 validates the RoPE fields of a "nope" model too: review 49e)
        _refuse(
            f"head_dim = {D} is odd: GraniteMoeHybridConfig checks its rotary parameters even with "
            "position_embedding_type 'nope' and refuses an odd head_dim, so no class would load the export"
        )
    for key, val in dict(window=None, qk_norm=False, output_gate=False, n_sink=0).items():
        GRANITE_H.require(where_a, a, key, val)
    if a.get("rotary_dim") not in (None, D):
        GRANITE_H.require(where_a, a, "rotary_dim", D)  # (the whole head)
    if a.get("bias") == "qkv":
        _refuse(
            f"{where_a}['bias'] = 'qkv' (q, k, v biased; o not) has no Granite 4.0-H equivalent: "
            "attention_bias biases q, k, v and o"
        )
    scaling = check_rope_scaling(a.get("rope_scaling")) if a["rope"] else None
    if scaling is not None and scaling["rope_type"] not in ("linear", "llama3", "yarn_hf"):
        _refuse(
            f"{where_a}['rope_scaling'] = {a['rope_scaling']!r}: only plain RoPE, 'linear', 'llama3' and "
            "transformers' YaRN ('yarn_hf') are exported; another scaled RoPE is refused, not approximated"
        )
    scale = a["softmax_scale"] if a.get("softmax_scale") is not None else D**-0.5
    rope = rope_parameters(a["rope_theta"], scaling)
    hf = decoder_fields(
        config,
        ARCH,
        MODEL_TYPE,
        heads=(H, H_kv, D),
        hidden=moe["expert_hidden"] if moe else shared,
        rope=rope,
    )
    if D == d // H:  # (GraniteMoeHybridConfig has no head_dim field: left out where it is the default)
        del hf["head_dim"]
    hf |= mamba
    hf |= {
        "shared_intermediate_size": shared,
        "attention_bias": bool(a["bias"]),
        "position_embedding_type": "rope" if a["rope"] else "nope",
        "layer_types": ["mamba" if t == MAMBA2 else "attention" for t in types],
        "num_local_experts": moe["n_experts"] if moe else 0,
        "num_experts_per_tok": moe["top_k"] if moe else 1,
        **(
            {"router_aux_loss_coef": aux_loss_coef_to_hf(moe["aux_loss_coef"], moe["top_k"], config.n_layers)}
            if moe
            else {}
        ),
        **{k: float(getattr(config, k)) for k in MULTIPLIERS},
        "attention_multiplier": float(scale),
    }

    w = Weights(GRANITE_H, weights)
    sd: dict[str, Tensor] = export_head(w, config)
    sd["model.norm.weight"] = w.pop("norm.weight", (d,))
    sd.update(_layer_weights(w, types, {MAMBA2: m, ATTN: a}, moe, shared, d, importing=False))
    w.finish()
    return hf, {k: v.contiguous() for k, v in sd.items()}


# --- dense Granite (GraniteForCausalLM): a Llama with the four scalars (mnemo.hf.llama) -------------

#: ``GraniteConfig``'s defaults (``transformers`` 5.25): Llama's, plus the scalars
GRANITE = llama._Class(
    DENSE_ARCH,
    DENSE_MODEL_TYPE,
    ConfigFormat(
        "Granite",
        {
            **llama.LLAMA.fmt.defaults,
            "embedding_multiplier": 1.0,
            "residual_multiplier": 1.0,
            "logits_scaling": 1.0,
            "attention_multiplier": 1.0,
        },
        llama.SHAPE_FIELDS,
    ),
    bias="field",
    qk_norm=False,
    windows=None,
)


def import_granite(hf_config: dict, weights: dict[str, Tensor]) -> tuple[ModelConfig, dict[str, Tensor]]:
    """A ``transformers`` ``GraniteForCausalLM`` checkpoint as a mnemo ``(ModelConfig, state dict)``:
    the Llama import (:mod:`mnemo.hf.llama`) with Granite's scalars (``embedding_multiplier``,
    ``residual_multiplier``, ``logits_scaling``; ``attention_multiplier`` → ``softmax_scale``).
    Raises ``ValueError`` ("Granite conversion: …") naming what is not reproduced exactly
    (``mlp_bias`` among it)."""
    fmt = GRANITE.fmt
    if hf_config.get("mlp_bias") is not None and not isinstance(hf_config["mlp_bias"], bool):
        fmt.refuse(f"field 'mlp_bias': expected true or false, got {hf_config['mlp_bias']!r}")
    if hf_config.get("mlp_bias"):
        fmt.refuse("mlp_bias true is not supported: mnemo's SwiGLU MLP has no biases")
    scalars, attn_scale = _scalars(fmt, hf_config)
    config, sd = llama._import(GRANITE, hf_config, weights)
    opts = {**config.mixer_options[ATTN], "softmax_scale": attn_scale}
    config = dataclasses.replace(config, mixer_options={ATTN: opts}, **scalars).validate()
    return config, sd


def export_granite(config: ModelConfig, weights: dict[str, Tensor]) -> tuple[dict, dict[str, Tensor]]:
    """A mnemo ``(ModelConfig, state dict)`` as a ``transformers`` ``GraniteForCausalLM`` ``(config
    dict, state dict)``: what the Llama export expresses (:mod:`mnemo.hf.llama`; no window, no q/k
    norm), with Granite's scalars (``softmax_scale`` ``None``: ``attention_multiplier = head_dim **
    -0.5``). Raises ``ValueError`` ("Granite conversion: …") naming what it cannot express."""
    config = config.validate()
    refuse_unexpressed(GRANITE.fmt.name, config, multipliers=True)
    a = mixer_options(ATTN, config)
    plain = {k: v for k, v in config.mixer_options.get(ATTN, {}).items() if k != "softmax_scale"}
    base = dataclasses.replace(
        config,
        mixer_options={**config.mixer_options, ATTN: plain},
        **{k: 1.0 for k in MULTIPLIERS},
    )
    hf, sd = llama._export(GRANITE, base, weights)
    D = hf["head_dim"]
    scale = a["softmax_scale"] if a.get("softmax_scale") is not None else D**-0.5
    hf |= {
        "mlp_bias": False,
        **{k: float(getattr(config, k)) for k in MULTIPLIERS},
        "attention_multiplier": float(scale),
    }
    return hf, sd


#: ``(name, model_type, import function, export function)`` of the two formats, for the registry
FORMATS = (
    (ARCH, MODEL_TYPE, import_granitemoehybrid, export_granitemoehybrid, {MAMBA2, ATTN}),
    (DENSE_ARCH, DENSE_MODEL_TYPE, import_granite, export_granite, {ATTN}),
)
