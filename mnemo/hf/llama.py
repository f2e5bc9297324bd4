"""The Llama family — Llama, Qwen2 (Qwen2.5), Qwen3, Mistral, and the mixture-of-experts Mixtral,
Qwen3-MoE, Qwen2-MoE — in and out of mnemo.

:func:`import_llama` / :func:`import_qwen2` / :func:`import_qwen3` / :func:`import_mistral` turn a
``transformers`` config (a dict, as in ``config.json``) and the ``…ForCausalLM`` state dict into a
:class:`~mnemo.models.ModelConfig` and a state dict that ``LanguageModel(config).load_state_dict(sd,
strict=True)`` accepts; :func:`export_llama` / :func:`export_qwen2` / :func:`export_qwen3` /
:func:`export_mistral` do the reverse; :func:`import_mixtral` / :func:`import_qwen3_moe` /
:func:`import_qwen2_moe` and their exports the same for the MoE classes. Plain dicts and tensors:
nothing here imports ``transformers``.

The four are one computation (``transformers`` 5's ``modeling_{llama,qwen2,qwen3,mistral}.py``):
blocks ``x + attn(RMSNorm(x))``, ``x + mlp(RMSNorm(x))``, a final RMSNorm (``rms_norm_eps``
everywhere, ``weight · x / √(mean(x²) + ε)``, so the weights are copied), the SwiGLU MLP
``down(silu(gate(x)) · up(x))`` and causal softmax attention with RoPE over the whole head
(``rotate_half`` pairing), grouped-query heads (``num_key_value_heads``) and ``head_dim`` (which
may differ from ``hidden_size / num_attention_heads``), logits scaled by ``head_dim ** -0.5``. Each
becomes mnemo ``"attention"`` layers (:class:`~mnemo.layers.attention.Attention`: ``n_heads``,
``n_kv_heads``, ``head_dim``, ``rope_theta``, ``norm_eps``) with ``mlp="swiglu"`` (``w_in = [gate;
up]``, ``w_out = down``), ``pos_embedding="none"``, ``tie_embeddings = tie_word_embeddings``; the
``k_proj`` / ``v_proj`` rows are stacked as mnemo's ``kv_proj`` (``[k; v]``). What differs:

* **Llama** (``LlamaForCausalLM``): ``attention_bias`` biases q, k, v *and* o — mnemo's ``bias``.
  ``mlp_bias`` is refused (mnemo's SwiGLU has no biases); so is a ``sliding_window`` (the class's
  forward ignores it while its cache and ``generate`` read it).
* **Qwen2** (``Qwen2ForCausalLM``): q, k and v are always biased and o never: mnemo's
  ``bias="qkv"`` (no ``o_proj.bias`` parameter at all, so fine-tuning cannot give it one). A Qwen2
  converted before that option holds ``bias=True`` with a zero ``o_proj.bias``, which still loads
  and exports as Qwen2 while that bias is zero.
* **Qwen3** (``Qwen3ForCausalLM``): ``attention_bias`` as Llama's, and an RMSNorm over each head's
  ``head_dim`` channels of q and k (``q_norm`` / ``k_norm``, epsilon ``rms_norm_eps``) before RoPE:
  mnemo's ``qk_norm`` (the same function: per head, before the rotary positions, ``norm_eps``).
* **Mistral** (``MistralForCausalLM``): no biases; ``sliding_window`` ``W`` (not null) in every layer
  (a ``layer_types`` that says otherwise is refused: the class's forward ignores it, its cache not).
* **Mixtral** (``MixtralForCausalLM``), **Qwen3-MoE** (``Qwen3MoeForCausalLM``) and **Qwen2-MoE**
  (``Qwen2MoeForCausalLM``): the attention of Mistral (no biases, ``sliding_window`` in every layer),
  of Qwen3 (``attention_bias``, q/k norms; its ``sliding_window`` in every layer where
  ``use_sliding_window``: Qwen3MoeModel reads no ``layer_types`` or ``max_window_layers``) and of
  Qwen2 (q/k/v biases as ``qkv_bias`` says, default true; ``layer_types`` as Qwen2's, whose default
  slides the even layers below ``max_window_layers`` where ``use_sliding_window``), with a sparse
  block in place of the MLP: mnemo's :class:`~mnemo.layers.MoE` (``mlp="moe"``). The router is the
  same function: logits ``W_r x`` (``gate.weight`` → ``router.weight``), softmax over all ``E``
  experts in float32 (float64 in a float64 mnemo model, where ``transformers`` keeps float32), the
  ``num_experts_per_tok`` largest probabilities (``torch.topk`` on both sides, so ties go alike),
  weighted by those probabilities renormalised to sum 1 — always in Mixtral, as
  ``norm_topk_prob`` says in the Qwen classes (mnemo's softmax over the chosen logits is the same
  value) — and summed over the chosen experts' SwiGLU ``down(silu(gate x) · up x)``; no capacity, no
  balancing bias. Experts: ``E = num_local_experts`` of width ``intermediate_size`` (Mixtral; the
  ``num_experts`` alias its config accepts read too) or ``num_experts`` of width
  ``moe_intermediate_size`` (Qwen; Qwen3-MoE's config writes its alias ``num_local_experts``), from
  ``transformers`` 5's fused ``experts.gate_up_proj [E, 2I, d]`` (per expert ``[gate; up]``, mnemo's
  ``w_in``) and ``experts.down_proj [E, d, I]`` (``w_out``) or the Hub's per-expert files, which
  ``transformers`` 5 fuses on load (Mixtral: ``block_sparse_moe.experts.{e}.w1`` / ``w3`` / ``w2`` =
  gate / up / down, and ``block_sparse_moe.gate``; Qwen: ``mlp.experts.{e}.gate_proj`` /
  ``up_proj`` / ``down_proj``). Qwen2-MoE adds a shared SwiGLU expert of
  ``shared_expert_intermediate_size`` scaled by ``σ(shared_expert_gate x)`` on every token: mnemo's
  ``shared_expert_hidden`` with ``shared_expert_gate``. The Qwen classes' ``decoder_sparse_step`` /
  ``mlp_only_layers`` may make some layers dense (``intermediate_size``, the layers where ``i`` is in
  ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``): mnemo's ``mlp_only_layers`` (those
  layers a SwiGLU of width ``mlp_hidden = intermediate_size``), written back on export as
  ``mlp_only_layers`` with ``decoder_sparse_step`` 1; a model whose layers are all dense imports as
  ``mlp="swiglu"``. Mixtral has no dense layers: its export refuses them. Training only, not carried:
  Mixtral's ``router_jitter_noise`` (multiplies the block's input by noise in training, as dropout);
  ``output_router_logits`` (an output switch; ``transformers`` adds its balance loss only with it).
  ``router_aux_loss_coef`` ``c`` becomes ``aux_loss_coef = c · k / L``: ``transformers``' loss is ``E
  Σ_e F_e P_e`` with ``F_e`` the share of the tokens routed to ``e`` (``k`` per token: ``k`` times
  mnemo's ``f_e``) and ``P_e`` the mean probability, both pooled over the ``L`` sparse layers (dense
  ones have no router), while mnemo
  adds each layer's ``L_aux`` (:mod:`mnemo.layers.moe`): the same objective where the layers' routing
  statistics agree (and for one layer); the export writes ``aux_loss_coef · L / k`` back.
* Sliding windows: ``transformers``' mask lets a query see the keys ``q − W < k ≤ q`` — ``W`` keys,
  itself included — which is mnemo's ``window = W``. Qwen2 and Qwen3 slide only where
  ``layer_types`` says ``"sliding_attention"`` (by default the layers from ``max_window_layers`` on,
  when ``use_sliding_window``); mnemo gives every attention layer one window, so a checkpoint that
  mixes sliding and full layers is refused, and one whose layers all slide (or none) is accepted.
* RoPE (:func:`~mnemo.hf.fields.rope_fields`): ``"default"``; ``"linear"`` (every frequency divided
  by ``factor``) and ``"llama3"`` (Llama 3.1's, :func:`~mnemo.layers.rotary.llama3_inv_freq`) map to
  mnemo's kinds of the same names, ``"yarn"`` to ``"yarn_hf"`` (``transformers``' frequencies and
  cos/sin factor); ``"dynamic"`` (frequencies recomputed from the sequence length) and every other
  kind are refused. These classes rotate the whole head: with plain RoPE they ignore a
  ``partial_rotary_factor`` (so does the import); with a scaled kind it is refused unless 1.
* ``hidden_act`` must be ``"silu"``; ``attention_dropout`` acts only in training and is not carried;
  ``pretraining_tp`` does not change the function (``transformers`` 5 ignores it).

Read as ``transformers`` 5 loads them: the ``self_attn.rotary_emb.inv_freq`` buffers that 4.28–4.31
saved in each layer are dropped once they agree with ``rope_theta`` / ``head_dim`` (refused by
name otherwise: the config would not describe the checkpoint); ``tie_word_embeddings`` true over a
file whose ``lm_head.weight`` differs from the embedding is imported untied, with a warning
(:func:`~mnemo.hf.fields.tied_as_loaded`). Anything else that mnemo cannot reproduce exactly — a
missing, mis-shaped or unexpected weight — is refused by name (``ValueError``, the field and the
expected vs received value).

Export: a stack of ``"attention"`` layers with SwiGLU MLPs, RoPE over the whole head, no output
gate and no attention sinks, as the first class that expresses it exactly: Llama (no window, no
q/k norm), Mistral (no bias, no q/k norm; a window or none), Qwen3 (q/k norms), Qwen2 (``bias="qkv"``,
or ``bias=True`` with a zero o bias) — :func:`mnemo.hf.convert.export_hf` tries a converted
checkpoint's own class first (and warns when another one writes it: a Qwen2 converted with a zero
o bias, before ``bias="qkv"``, whose o bias was trained goes out as Llama where it has no window;
with one, the Qwen2 refusal says why). ``bias="qkv"`` is Qwen2's alone: Llama's and Qwen3's
``attention_bias`` biases o too. These classes refuse ``mlp="moe"``; an attention stack with a
mixture of experts goes out as the first of Mixtral (renormalised top-k, no shared expert, no q/k
norm, no biases), Qwen3-MoE (q/k norms, either normalisation, no shared expert) and Qwen2-MoE (the
gated shared expert; q/k/v biases or none) that expresses it, in the Hub's per-expert layout
(``save_pretrained``'s). Sigmoid scores, a routed scaling factor, group-limited routing and a
balancing bias change the routing and are refused by name; ``capacity_factor`` (drops only in
training), ``z_loss_coef``, ``seq_aux_loss_coef`` and ``dispatch`` do not change the function and
are not carried.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..layers.mlp import swiglu_hidden
from ..layers.moe import MOE_OPTIONS
from ..layers.rotary import RotaryEmbedding, check_rope_scaling, plain_inv_freq
from ..models.config import ModelConfig
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
from .qwen3_next import SHAPE_FIELDS as _QWEN3_NEXT_SHAPE_FIELDS

ATTN = "attention"
FULL, SLIDING = "full_attention", "sliding_attention"

#: the config fields that set each weight's shape: the dense layers' entries of Qwen3-Next's table
_DENSE = ("embed_tokens.", "lm_head.", "norm.", "input_", "post_", "mlp.gate_proj.", "mlp.up_proj.")
SHAPE_FIELDS = {
    k: v
    for k, v in _QWEN3_NEXT_SHAPE_FIELDS.items()
    if k.startswith((*_DENSE, "mlp.down_proj.", "self_attn."))
}

#: the defaults the four config classes share (``transformers`` 5.25)
_SHARED = {
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "head_dim": None,  # hidden_size // num_attention_heads
    "attention_bias": False,
    "mlp_bias": False,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 0,
}
_QWEN = {
    **_SHARED,
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "max_position_embeddings": 32768,
    "sliding_window": 4096,
    "max_window_layers": 28,
}


@dataclass(frozen=True)
class _Experts:
    """The sparse MLP of a mixture-of-experts class: the config fields of the expert count
    (``count``: the class's own name first, then the alias its ``attribute_map`` accepts) and width
    (``hidden``); ``norm``: whether the top-k weights are always renormalised (Mixtral) or as
    ``norm_topk_prob`` says (``None``); ``shared``: a shared expert with a sigmoid gate
    (``shared_expert_intermediate_size``); ``sparse_step``: whether ``decoder_sparse_step`` /
    ``mlp_only_layers`` pick the sparse layers; ``block``: the block's prefix in the Hub's files
    (``transformers`` 5's modules are ``mlp.``); ``names``: the per-expert ``(gate, up, down)``
    weight names of those files."""

    count: tuple[str, ...]
    hidden: str
    norm: bool | None
    shared: bool
    sparse_step: bool
    block: str
    names: tuple[str, str, str]


@dataclass(frozen=True)
class _Class:
    """One ``…ForCausalLM`` class: its format (name and defaults), which biases it has (``"field"``:
    ``attention_bias`` on q, k, v and o; ``"qkv"``: always on q, k, v, never on o; ``"qkv_field"``:
    on q, k, v as ``qkv_bias`` says, never on o; ``None``: none), whether it has q/k norms, where
    its windows come from (``None``: nowhere; ``"all"``: ``sliding_window`` in every layer;
    ``"flag"``: the same where ``use_sliding_window``; ``"layers"``: ``layer_types`` /
    ``use_sliding_window`` / ``max_window_layers``; ``"alternate"``: the same with Qwen2-MoE's
    default ``layer_types``) and its sparse MLP (``moe``; ``None``: a dense SwiGLU)."""

    arch: str
    model_type: str
    fmt: ConfigFormat
    bias: str | None
    qk_norm: bool
    windows: str | None
    moe: _Experts | None = None


LLAMA = _Class(
    "LlamaForCausalLM",
    "llama",
    ConfigFormat(
        "Llama",
        {
            **_SHARED,
            "vocab_size": 32000,
            "hidden_size": 4096,
            "intermediate_size": 11008,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": None,  # num_attention_heads
            "max_position_embeddings": 2048,
        },
        SHAPE_FIELDS,
    ),
    bias="field",
    qk_norm=False,
    windows=None,
)
QWEN2 = _Class(
    "Qwen2ForCausalLM", "qwen2", ConfigFormat("Qwen2", _QWEN, SHAPE_FIELDS), "qkv", False, "layers"
)
QWEN3 = _Class(
    "Qwen3ForCausalLM",
    "qwen3",
    ConfigFormat("Qwen3", {**_QWEN, "head_dim": 128}, SHAPE_FIELDS),
    "field",
    True,
    "layers",
)
MISTRAL = _Class(
    "MistralForCausalLM",
    "mistral",
    ConfigFormat(
        "Mistral",
        {
            **_SHARED,
            "vocab_size": 32000,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "max_position_embeddings": 4096 * 32,
            "sliding_window": 4096,
        },
        SHAPE_FIELDS,
    ),
    bias=None,
    qk_norm=False,
    windows="all",
)

#: the config fields that set the shape of each sparse-MLP weight, by the end of its name
_MOE_SHAPES = {
    "gate.weight": ("num_experts", "hidden_size"),
    "experts.gate_up_proj": ("num_experts", "moe_intermediate_size", "hidden_size"),
    "experts.down_proj": ("num_experts", "moe_intermediate_size", "hidden_size"),
    **{
        f"{w}.weight": ("moe_intermediate_size", "hidden_size") for w in ("gate_proj", "up_proj", "down_proj")
    },
    **{
        f"shared_expert.{w}.weight": ("shared_expert_intermediate_size", "hidden_size")
        for w in ("gate_proj", "up_proj", "down_proj")
    },
    "shared_expert_gate.weight": ("hidden_size",),
}
_MIXTRAL_SHAPES = {
    "gate.weight": ("num_local_experts", "hidden_size"),
    "experts.gate_up_proj": ("num_local_experts", "intermediate_size", "hidden_size"),
    "experts.down_proj": ("num_local_experts", "intermediate_size", "hidden_size"),
    **{f"{w}.weight": ("intermediate_size", "hidden_size") for w in ("w1", "w2", "w3")},
}
#: the fields the MoE config classes share (``transformers`` 5.25)
_MOE = {"num_experts_per_tok": 2, "router_aux_loss_coef": 0.001, "output_router_logits": False}
_QWEN_MOE = {
    **_SHARED,
    **_MOE,
    "vocab_size": 151936,
    "hidden_size": 2048,
    "num_hidden_layers": 24,
    "max_position_embeddings": 32768,
    "sliding_window": 4096,
    "decoder_sparse_step": 1,
    "mlp_only_layers": None,
    "norm_topk_prob": False,
}
_QWEN_EXPERTS = dict(hidden="moe_intermediate_size", norm=None, sparse_step=True, block="mlp.")

MIXTRAL = _Class(
    "MixtralForCausalLM",
    "mixtral",
    ConfigFormat(
        "Mixtral",
        {
            **_SHARED,
            **_MOE,
            "vocab_size": 32000,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "max_position_embeddings": 4096 * 32,
            "rms_norm_eps": 1e-5,
            "rope_theta": 1e6,  # MixtralConfig.default_theta, where the config names none
            "num_local_experts": 8,
            "router_jitter_noise": 0.0,
        },
        {**SHAPE_FIELDS, **_MIXTRAL_SHAPES},
    ),
    bias=None,
    qk_norm=False,
    windows="all",
    moe=_Experts(
        count=("num_local_experts", "num_experts"),
        hidden="intermediate_size",
        norm=True,
        shared=False,
        sparse_step=False,
        block="block_sparse_moe.",
        names=("w1", "w3", "w2"),
    ),
)
QWEN3_MOE = _Class(
    "Qwen3MoeForCausalLM",
    "qwen3_moe",
    ConfigFormat(
        "Qwen3-MoE",
        {
            **_QWEN_MOE,
            "intermediate_size": 6144,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "moe_intermediate_size": 768,
            "num_experts_per_tok": 8,
            "num_experts": 128,
        },
        {**SHAPE_FIELDS, **_MOE_SHAPES},
    ),
    bias="field",
    qk_norm=True,
    windows="flag",
    moe=_Experts(
        ("num_experts", "num_local_experts"),
        shared=False,
        names=("gate_proj", "up_proj", "down_proj"),
        **_QWEN_EXPERTS,
    ),
)
QWEN2_MOE = _Class(
    "Qwen2MoeForCausalLM",
    "qwen2_moe",
    ConfigFormat(
        "Qwen2-MoE",
        {
            **_QWEN_MOE,
            "intermediate_size": 5632,
            "num_attention_heads": 16,
            "num_key_value_heads": None,  # num_attention_heads
            "moe_intermediate_size": 1408,
            "shared_expert_intermediate_size": 5632,
            "num_experts_per_tok": 4,
            "num_experts": 60,
            "max_window_layers": 28,
            "qkv_bias": True,
        },
        {**SHAPE_FIELDS, **_MOE_SHAPES},
    ),
    bias="qkv_field",
    qk_norm=False,
    windows="alternate",
    moe=_Experts(("num_experts",), shared=True, names=("gate_proj", "up_proj", "down_proj"), **_QWEN_EXPERTS),
)

#: the RoPE kinds read exactly, and why two common others are not
ROPE_KINDS = {
    "default": "plain RoPE",
    "linear": "Position Interpolation",
    "llama3": "Llama 3.1's scaling",
    "yarn": "transformers' YaRN",
}
_ROPE_REFUSED = {
    "dynamic": "it recomputes the frequencies from the length of each input (dynamic NTK), so one "
    "checkpoint computes another function at every length; mnemo's frequencies are static",
    "longrope": "its frequencies switch with the input's length; mnemo's are static",
}


def _bools(c: _Class, cfg: dict) -> None:
    for k in (
        "attention_bias", "mlp_bias", "tie_word_embeddings", "use_sliding_window", "qkv_bias",
        "norm_topk_prob", "output_router_logits",
    ):  # fmt: skip
        if cfg.get(k) is not None and not isinstance(cfg[k], bool):
            c.fmt.refuse(f"field {k!r}: expected true or false, got {cfg[k]!r}")


def _count(c: _Class, cfg: dict, key: str, low: int) -> int:
    v = c.fmt.get(cfg, key)
    if not is_int(v) or v < low:
        c.fmt.refuse(f"field {key!r}: expected an int >= {low}, got {v!r}")
    return v


def _window(c: _Class, cfg: dict, n: int) -> int | None:
    """The one window of every layer (``None``: full attention), as the class computes its masks;
    refused by name where the layers differ or the fields contradict each other."""
    if c.windows is None:
        if cfg.get("sliding_window") is not None:
            c.fmt.refuse(
                f"field 'sliding_window' = {cfg['sliding_window']!r}: {c.arch}'s forward pass ignores it "
                "while its cache and generate() read it (two functions); expected null or no such field"
            )
        return None
    W = cfg["sliding_window"] if "sliding_window" in cfg else c.fmt.defaults["sliding_window"]
    if c.windows != "all" and not c.fmt.get(cfg, "use_sliding_window"):
        W = None  # (the config classes set sliding_window = None, Qwen2-MoE's 0, then)
    if W is not None and (not is_int(W) or W < 1):
        c.fmt.refuse(
            f"field 'sliding_window': expected a positive int (keys a query sees) or null, got {W!r}"
        )
    if c.windows in ("all", "flag"):  # every layer, whatever layer_types says (the model ignores it)
        expected = [SLIDING if W is not None else FULL] * n
        types = cfg.get("layer_types")
        if types is not None and types != expected:
            c.fmt.refuse(
                f"field 'layer_types' = {types!r}: {c.arch} ignores it in its forward pass (every layer is "
                f"{expected[0]!r} with sliding_window = {W!r}) while its cache reads it; expected no such "
                "field (or one that agrees)"
            )
        return W
    types = cfg.get("layer_types")
    if types is None:
        mwl = _count(c, cfg, "max_window_layers", 0)
        if c.windows == "alternate":  # Qwen2MoeConfig: the even layers below max_window_layers
            types = [SLIDING if W is not None and i % 2 == 0 and i < mwl else FULL for i in range(n)]
        else:
            types = [SLIDING if W is not None and i >= mwl else FULL for i in range(n)]
    if not isinstance(types, list) or len(types) != n or any(t not in (FULL, SLIDING) for t in types):
        c.fmt.refuse(
            f"field 'layer_types': expected a list of num_hidden_layers = {n} entries {FULL!r} / "
            f"{SLIDING!r}, got {types!r}"
        )
    if SLIDING in types and W is None:
        c.fmt.refuse(
            f"layer_types names {SLIDING!r} layers but there is no window (use_sliding_window = "
            f"{cfg.get('use_sliding_window')!r}, sliding_window = {cfg.get('sliding_window')!r}): "
            "transformers cannot build their mask"
        )
    if len(set(types)) > 1:
        slide = [i for i, t in enumerate(types) if t == SLIDING]
        c.fmt.refuse(
            f"layers {slide} use sliding-window attention (sliding_window = {W}) and the others full "
            f"attention (layer_types / max_window_layers = {cfg.get('max_window_layers')!r}); mnemo gives "
            "every attention layer the same window"
        )
    return W if types and types[0] == SLIDING else None


def _moe_options(c: _Class, cfg: dict, n: int) -> tuple[dict[str, Any] | None, list[int]]:
    """The ``mlp_options`` of the :class:`~mnemo.layers.MoE` that computes the class's sparse block
    (``None``: every layer dense, which Qwen's ``num_experts = 0`` or ``mlp_only_layers`` can say) and
    the dense layers among sparse ones (mnemo's ``mlp_only_layers``; ``[]``: none); refused by name
    where a field is of the wrong kind."""
    m, fmt = c.moe, c.fmt
    given = {k: cfg[k] for k in m.count if cfg.get(k) is not None}
    if len(set(map(repr, given.values()))) > 1:
        fmt.refuse(f"fields {given}: the expert count is given twice, with two values; expected one")
    E = next(iter(given.values()), fmt.defaults[m.count[0]])
    if not is_int(E) or E < (0 if m.sparse_step else 1):
        fmt.refuse(f"field {m.count[0]!r}: expected an int >= {0 if m.sparse_step else 1}, got {E!r}")
    if m.sparse_step:  # the layers {Qwen2Moe,Qwen3Moe}DecoderLayer makes sparse
        only, step = fmt.get(cfg, "mlp_only_layers") or [], _count(c, cfg, "decoder_sparse_step", 1)
        if not isinstance(only, list) or not all(is_int(i) for i in only):
            fmt.refuse(f"field 'mlp_only_layers': expected a list of layer indices, got {only!r}")
        sparse = [i for i in range(n) if E > 0 and i not in only and (i + 1) % step == 0]
        if not sparse:
            return None, []
    else:
        sparse = list(range(n))
    k = _count(c, cfg, "num_experts_per_tok", 1)
    if k > E:
        fmt.refuse(f"field 'num_experts_per_tok' = {k}: expected at most the {E} experts")
    coef = fmt.get(cfg, "router_aux_loss_coef")
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not 0 <= coef < float("inf"):
        fmt.refuse(f"field 'router_aux_loss_coef': expected a number >= 0, got {coef!r}")
    opts: dict[str, Any] = dict(
        n_experts=E,
        top_k=k,
        expert_hidden=_count(c, cfg, m.hidden, 1),
        norm_topk_prob=m.norm if m.norm is not None else bool(fmt.get(cfg, "norm_topk_prob")),
        aux_loss_coef=aux_loss_coef_from_hf(coef, k, len(sparse)),  # (its docstring: the sparse layers)
    )
    if m.shared:
        opts |= dict(
            shared_expert_hidden=_count(c, cfg, "shared_expert_intermediate_size", 1), shared_expert_gate=True
        )
    return opts, [i for i in range(n) if i not in sparse]


def _swiglu_in(w: Weights, p: str, hidden: int, d: int, names=("gate_proj", "up_proj", "down_proj")):
    """``(w_in, w_out)`` of mnemo's SwiGLU (``w_in = [gate; up]``) from a ``transformers`` MLP's
    ``{p}{gate,up,down}.weight`` (``names``: those three names)."""
    gate, up, down = (p + x + ".weight" for x in names)
    w_in = torch.cat([w.pop(gate, (hidden, d)), w.pop(up, (hidden, d))], 0)
    return w_in, w.pop(down, (d, hidden))


def _import_experts(c: _Class, w: Weights, p: str, q: str, o: dict[str, Any], d: int) -> dict[str, Tensor]:
    """One sparse block of layer prefix ``p`` (``model.layers.{i}.``) as the :class:`~mnemo.layers.MoE`
    weights of prefix ``q``: the router ``gate.weight``, the experts either fused (``experts.gate_up_proj``
    ``[E, 2I, d]`` = per expert ``[gate; up]``, mnemo's ``w_in``; ``experts.down_proj`` ``[E, d, I]``,
    ``w_out``: a ``transformers`` 5 state dict) or one by one (``experts.{e}.{gate,up,down}``: the Hub's
    files, which ``transformers`` 5 fuses on load), and Qwen2-MoE's gated shared expert; under the
    block prefix of the Hub's files (Mixtral's ``block_sparse_moe.``) or ``transformers`` 5's ``mlp.``."""
    m, E, I = c.moe, o["n_experts"], o["expert_hidden"]
    b = next((p + x for x in (m.block, "mlp.") if p + x + "gate.weight" in w), p + m.block)
    sd = {q + "router.weight": w.pop(b + "gate.weight", (E, d))}
    if b + "experts.gate_up_proj" in w:
        sd[q + "w_in"] = w.pop(b + "experts.gate_up_proj", (E, 2 * I, d))
        sd[q + "w_out"] = w.pop(b + "experts.down_proj", (E, d, I))
    else:
        each = [_swiglu_in(w, f"{b}experts.{e}.", I, d, m.names) for e in range(E)]
        sd[q + "w_in"], sd[q + "w_out"] = (torch.stack(t) for t in zip(*each))
    if m.shared:
        S = o["shared_expert_hidden"]
        w_in, w_out = _swiglu_in(w, b + "shared_expert.", S, d)
        sd[q + "shared_expert.w_in.weight"], sd[q + "shared_expert.w_out.weight"] = w_in, w_out
        sd[q + "shared_gate.weight"] = w.pop(b + "shared_expert_gate.weight", (1, d))
    return sd


def _import(c: _Class, hf_config: dict, weights: dict[str, Tensor]) -> tuple[ModelConfig, dict[str, Tensor]]:
    cfg, fmt = dict(hf_config), c.fmt
    if cfg.get("model_type", c.model_type) != c.model_type:
        fmt.refuse(f"model_type {cfg['model_type']!r} is not {c.model_type!r}")
    _bools(c, cfg)
    act = fmt.get(cfg, "hidden_act")
    if act != "silu":
        fmt.refuse(
            f"hidden_act {act!r} is not supported (only 'silu': mnemo's MLP is SwiGLU, silu(gate) · up)"
        )
    if c.model_type == "llama" and fmt.get(cfg, "mlp_bias"):
        fmt.refuse("mlp_bias true is not supported: mnemo's SwiGLU MLP has no biases")
    n, d = _count(c, cfg, "num_hidden_layers", 1), _count(c, cfg, "hidden_size", 1)
    H = _count(c, cfg, "num_attention_heads", 1)
    H_kv = cfg["num_key_value_heads"] if "num_key_value_heads" in cfg else fmt.defaults["num_key_value_heads"]
    H_kv = H if H_kv is None else H_kv
    if not is_int(H_kv) or H_kv < 1 or H % H_kv:
        fmt.refuse(
            f"num_key_value_heads = {H_kv!r}: expected a positive int dividing num_attention_heads = {H}"
        )
    D = fmt.get(cfg, "head_dim") if c.model_type == "qwen3" else cfg.get("head_dim")
    D = d // H if D is None else D
    if not is_int(D) or D < 2 or D % 2:
        fmt.refuse(
            f"head_dim = {D!r} (hidden_size // num_attention_heads unless given): RoPE rotates pairs of "
            "channels, so it must be an even int"
        )
    if cfg.get("rope_theta") is None and "rope_theta" in fmt.defaults:  # (Mixtral's default_theta)
        cfg["rope_theta"] = fmt.defaults["rope_theta"]
    theta, partial, scaling = rope_fields(
        fmt, cfg, kinds=ROPE_KINDS, partial_default=1.0, reasons=_ROPE_REFUSED
    )
    if scaling is not None and int(D * partial) != D:
        fmt.refuse(
            f"partial_rotary_factor = {partial} with rope_type {scaling['rope_type']!r}: {c.arch} rotates "
            "the whole head (its scaled frequencies would cover only part of it, which transformers cannot "
            "run)"
        )
    window = _window(c, cfg, n)
    eps = fmt.get(cfg, "rms_norm_eps")
    tie, hidden = tied_as_loaded(fmt, cfg, weights), _count(c, cfg, "intermediate_size", 1)
    moe, dense = _moe_options(c, cfg, n) if c.moe is not None else (None, [])
    if moe is not None:
        cfg[c.moe.count[0]] = moe["n_experts"]  # (a shape refusal names the count's own field)
    qkv = c.bias == "qkv" or (c.bias == "qkv_field" and bool(fmt.get(cfg, "qkv_bias")))
    bias = qkv or (c.bias == "field" and bool(fmt.get(cfg, "attention_bias")))
    opts: dict[str, Any] = dict(
        n_heads=H, n_kv_heads=H_kv, head_dim=D, rope=True, rope_theta=theta, window=window,
        qk_norm=c.qk_norm, output_gate=False, bias="qkv" if qkv else bias, norm_eps=eps,
    )  # fmt: skip
    if scaling is not None:
        opts["rope_scaling"] = scaling
    config = ModelConfig(
        vocab_size=_count(c, cfg, "vocab_size", 1),
        d_model=d,
        n_layers=n,
        mixer=ATTN,
        mixer_options={ATTN: opts},
        mlp="swiglu" if moe is None else "moe",
        mlp_hidden=hidden,
        mlp_options=moe or {},
        mlp_only_layers=dense or None,
        pos_embedding="none",
        tie_embeddings=tie,
        norm_eps=eps,
        init_std=fmt.init_std(fmt.get(cfg, "initializer_range")),
    ).validate()

    w = Weights(fmt, weights, cfg=cfg)
    sd = import_head(w, config.vocab_size, d, tie)
    sd["norm.weight"] = w.pop("model.norm.weight", (d,))
    for i in range(n):
        p, q, a = f"model.layers.{i}.", f"blocks.{i}.", f"model.layers.{i}.self_attn."
        sd[q + "mixer_norm.weight"] = w.pop(p + "input_layernorm.weight", (d,))
        sd[q + "mlp_norm.weight"] = w.pop(p + "post_attention_layernorm.weight", (d,))
        if moe is None or i in dense:
            sd[q + "mlp.w_in.weight"], sd[q + "mlp.w_out.weight"] = _swiglu_in(w, p + "mlp.", hidden, d)
        else:
            sd |= _import_experts(c, w, p, q + "mlp.", moe, d)
        sd[q + "mixer.q_proj.weight"] = w.pop(a + "q_proj.weight", (H * D, d))
        wk, wv = w.pop(a + "k_proj.weight", (H_kv * D, d)), w.pop(a + "v_proj.weight", (H_kv * D, d))
        sd[q + "mixer.kv_proj.weight"] = torch.cat([wk, wv], 0)
        sd[q + "mixer.o_proj.weight"] = w.pop(a + "o_proj.weight", (d, H * D))
        if bias:
            sd[q + "mixer.q_proj.bias"] = w.pop(a + "q_proj.bias", (H * D,))
            bk, bv = w.pop(a + "k_proj.bias", (H_kv * D,)), w.pop(a + "v_proj.bias", (H_kv * D,))
            sd[q + "mixer.kv_proj.bias"] = torch.cat([bk, bv])
            if c.bias == "field":  # (Qwen2, bias="qkv": no o bias)
                sd[q + "mixer.o_proj.bias"] = w.pop(a + "o_proj.bias", (d,))
        if c.qk_norm:
            sd[q + "mixer.q_norm.weight"] = w.pop(a + "q_norm.weight", (D,))
            sd[q + "mixer.k_norm.weight"] = w.pop(a + "k_norm.weight", (D,))
        if a + _INV_FREQ in w:
            _check_inv_freq(c, a + _INV_FREQ, w.pop(a + _INV_FREQ), theta, D, scaling)
    w.finish()
    return config, sd


#: the rotary frequencies that ``transformers`` 4.28–4.31 saved in each Llama layer's state dict
#: (a buffer derived from ``rope_theta`` and ``head_dim``; later versions do not save it)
_INV_FREQ = "rotary_emb.inv_freq"


def _check_inv_freq(c: _Class, key: str, saved: Tensor, theta: float, D: int, scaling: dict | None) -> None:
    """A saved ``rotary_emb.inv_freq`` buffer (``[D/2]``) is dropped, as ``transformers`` drops it on
    load, once it agrees with the frequencies the config gives: the plain ``θ_i = rope_theta^{−2i/D}``
    (4.31's buffer with linear scaling, which scaled the positions instead) or the scaled ones mnemo
    uses, within the rounding of the buffer's dtype (2 ulps, relative; a float16 / bfloat16 checkpoint
    holds them rounded). One that disagrees is refused by name: the config would not describe the
    checkpoint (another ``rope_theta`` or ``head_dim`` than the one it was trained with)."""
    if tuple(saved.shape) != (D // 2,) or not saved.is_floating_point():
        c.fmt.refuse(
            f"weight {key!r} (rotary frequencies that older transformers saved) has shape "
            f"{list(saved.shape)} and dtype {saved.dtype}, expected a float tensor of shape [{D // 2}] "
            f"(head_dim = {D} / 2)"
        )
    got = saved.double()
    fi = torch.finfo(saved.dtype)
    tol = 2 * fi.eps * got.abs() + fi.smallest_normal * fi.eps  # (the last: a subnormal's spacing)
    plain = plain_inv_freq(theta, D, torch.float64)
    used = RotaryEmbedding(D, theta, scaling=scaling).double().inv_freq
    err = {n: (got - f).abs() for n, f in (("plain", plain), ("scaled", used))}
    if any(bool((e <= tol).all()) for e in err.values()):
        return
    rel = (err["plain"] / plain).max().item()
    c.fmt.refuse(
        f"weight {key!r} (rotary frequencies that older transformers saved, {saved.dtype}) disagrees with "
        f"those of rope_theta = {theta:g}, head_dim = {D} (max relative difference {rel:.3g}, more than "
        f"{saved.dtype}'s rounding): the config does not describe this checkpoint; fix rope_theta / "
        "head_dim (and rope_parameters) in config.json"
    )


def _export(c: _Class, config: ModelConfig, weights: dict[str, Tensor]) -> tuple[dict, dict[str, Tensor]]:
    fmt = c.fmt
    config = config.validate()
    refuse_unexpressed(fmt.name, config, mlp_only_layers=c.moe is not None and c.moe.sparse_step)
    for i, m in enumerate(config.layer_mixers()):
        if m != ATTN:
            fmt.refuse(f"layer {i} uses mixer {m!r}; {c.arch} layers are {ATTN!r}")
    if config.mlp != ("swiglu" if c.moe is None else "moe"):
        kind = "'swiglu'" if c.moe is None else "'moe', a mixture of experts in every layer"
        fmt.refuse(f"mlp {config.mlp!r} is not supported (only {kind}, {c.arch}'s MLP)")
    dense = list(config.mlp_only_layers or [])  # (Mixtral's refused above: every layer is sparse)
    if config.pos_embedding != "none":
        fmt.refuse(f"pos_embedding {config.pos_embedding!r} is not supported ({c.arch} uses RoPE only)")
    a, where = mixer_options(ATTN, config), f"mixer_options[{ATTN!r}]"
    d, eps, n = config.d_model, config.norm_eps, config.n_layers
    H = a["n_heads"]
    H_kv = a["n_kv_heads"] or H
    D = a["head_dim"] or d // H
    for key, val in dict(rope=True, output_gate=False, n_sink=0, qk_norm=c.qk_norm).items():
        fmt.require(where, a, key, val)
    if a.get("rotary_dim") not in (None, D):
        fmt.require(where, a, "rotary_dim", D)  # (the whole head)
    if c.qk_norm:
        fmt.require(where, a, "norm_eps", eps)  # (one epsilon: rms_norm_eps)
    bias, W = a["bias"], a["window"]
    if c.bias is None and bias:
        fmt.require(where, a, "bias", False)
    if c.bias == "field" and bias == "qkv":
        fmt.refuse(
            f"{where} option bias='qkv' (q, k and v biased, o not) has no {fmt.name} equivalent: "
            "attention_bias biases o too (Qwen2ForCausalLM has bias='qkv')"
        )
    if c.bias == "qkv" and not bias:
        fmt.require(where, a, "bias", "qkv")
    if c.windows is None and W is not None:
        fmt.require(where, a, "window", None)
    scaling = check_rope_scaling(a.get("rope_scaling"))
    if scaling is not None and scaling["rope_type"] not in ("linear", "llama3", "yarn_hf"):
        fmt.refuse(
            f"{where}['rope_scaling'] = {a['rope_scaling']!r}: only plain RoPE, 'linear', 'llama3' and "
            "transformers' YaRN ('yarn_hf') are exported; another scaled RoPE is refused, not approximated"
        )
    hidden = config.mlp_hidden or swiglu_hidden(d)
    moe = _export_moe_options(c, config) if c.moe is not None else None
    if moe is not None and c.moe.hidden == "intermediate_size":  # (Mixtral: the experts' width)
        hidden = moe["expert_hidden"]
    rope = rope_parameters(a["rope_theta"], scaling)
    hf = decoder_fields(config, c.arch, c.model_type, heads=(H, H_kv, D), hidden=hidden, rope=rope)
    if c.bias == "field":
        hf["attention_bias"] = bool(bias)
    if c.bias == "qkv_field":
        hf["qkv_bias"] = bool(bias)
    if moe is not None:
        hf |= _moe_fields(c, moe, n, dense)
    if c.model_type == "llama":
        hf["mlp_bias"] = False
    if c.windows == "all":
        hf["sliding_window"] = W
    elif c.windows == "flag":
        hf |= {"use_sliding_window": W is not None, "sliding_window": W}
    elif c.windows in ("layers", "alternate"):
        hf |= {
            "use_sliding_window": W is not None,
            "sliding_window": W,
            "max_window_layers": 0 if W is not None else n,
            "layer_types": [SLIDING if W is not None else FULL] * n,
        }

    w = Weights(fmt, weights)
    sd = export_head(w, config)
    sd["model.norm.weight"] = w.pop("norm.weight", (d,))
    for i in range(n):
        p, q, a_ = f"model.layers.{i}.", f"blocks.{i}.", f"model.layers.{i}.self_attn."
        sd[p + "input_layernorm.weight"] = w.pop(q + "mixer_norm.weight", (d,))
        sd[p + "post_attention_layernorm.weight"] = w.pop(q + "mlp_norm.weight", (d,))
        if moe is None or i in dense:
            sd |= _swiglu_out(w, q + "mlp.", p + "mlp.", hidden, d)
        else:
            sd |= _export_experts(c, w, q + "mlp.", p, moe, d)
        sd[a_ + "q_proj.weight"] = w.pop(q + "mixer.q_proj.weight", (H * D, d))
        sd[a_ + "k_proj.weight"], sd[a_ + "v_proj.weight"] = w.pop(
            q + "mixer.kv_proj.weight", (2 * H_kv * D, d)
        ).split(H_kv * D, 0)
        sd[a_ + "o_proj.weight"] = w.pop(q + "mixer.o_proj.weight", (d, H * D))
        if bias:
            sd[a_ + "q_proj.bias"] = w.pop(q + "mixer.q_proj.bias", (H * D,))
            sd[a_ + "k_proj.bias"], sd[a_ + "v_proj.bias"] = w.pop(
                q + "mixer.kv_proj.bias", (2 * H_kv * D,)
            ).split(H_kv * D, 0)
            o_bias = w.pop(q + "mixer.o_proj.bias", (d,)) if bias is True else None  # ("qkv": none)
            if o_bias is not None and c.bias == "field":
                sd[a_ + "o_proj.bias"] = o_bias
            elif o_bias is not None and bool(o_bias.ne(0).any()):
                fmt.refuse(
                    f"blocks.{i}.mixer.o_proj.bias is not zero (max |b| = {o_bias.abs().max().item():.3g}): "
                    f"{c.arch} has no bias on the output projection. The model's bias=True biases it: a "
                    "Qwen2 converted before bias='qkv' (q, k, v only) holds a zero one, and training moved "
                    "it: the o bias was trained. Llama (attention_bias) expresses it when the model has no "
                    "window; with one, convert the source again (Qwen2 now imports with bias='qkv', no o "
                    "bias) and fine-tune that, or export as Qwen2 only after training with that bias frozen "
                    "(requires_grad False on each blocks.N.mixer.o_proj.bias), or after setting it to zero, "
                    "which changes the model's outputs"
                )
        if c.qk_norm:
            sd[a_ + "q_norm.weight"] = w.pop(q + "mixer.q_norm.weight", (D,))
            sd[a_ + "k_norm.weight"] = w.pop(q + "mixer.k_norm.weight", (D,))
    w.finish()
    return hf, {k: v.contiguous() for k, v in sd.items()}


def _export_moe_options(c: _Class, config: ModelConfig) -> dict[str, Any]:
    """The model's :class:`~mnemo.layers.MoE` options (defaults filled in, ``expert_hidden``
    resolved as ``LanguageModel`` resolves it), refused by name where the class computes another
    routing or has another shared expert. The training-only options (``capacity_factor``, the
    ``z_loss_coef`` / ``seq_aux_loss_coef`` terms, ``dispatch``) do not change the function and are
    not carried."""
    fmt, m, where = c.fmt, c.moe, "mlp_options"
    o = {**MOE_OPTIONS, **config.mlp_options}
    o["expert_hidden"] = o["expert_hidden"] or config.mlp_hidden or swiglu_hidden(config.d_model)
    fixed = dict(score="softmax", routed_scaling_factor=1.0, n_group=1, topk_group=1, bias_balancing=False)
    if m.norm is not None:
        fixed["norm_topk_prob"] = m.norm
    for key, val in fixed.items():
        fmt.require(where, o, key, val)
    if not m.shared and o["shared_expert_hidden"] is not None:
        fmt.refuse(
            f"{where} option shared_expert_hidden={o['shared_expert_hidden']!r}: {c.arch} has no shared "
            "expert (Qwen2MoeForCausalLM has one, with a sigmoid gate); needs None"
        )
    if m.shared and (o["shared_expert_hidden"] is None or not o["shared_expert_gate"]):
        fmt.refuse(
            f"{where} options shared_expert_hidden={o['shared_expert_hidden']!r}, shared_expert_gate="
            f"{o['shared_expert_gate']!r}: {c.arch}'s shared expert is always there and always gated by "
            "sigmoid(shared_expert_gate x); needs a width and shared_expert_gate=True"
        )
    return o


def _moe_fields(c: _Class, o: dict[str, Any], n: int, dense: list[int]) -> dict[str, Any]:
    """The sparse block's ``config.json`` fields: ``router_aux_loss_coef = aux_loss_coef · L / k``
    (``L`` the sparse layers: the inverse of the import's mapping), ``output_router_logits`` false,
    Qwen's ``mlp_only_layers`` = ``dense`` (mnemo's) with ``decoder_sparse_step`` 1."""
    m = c.moe
    out = {
        m.count[0]: o["n_experts"],
        "num_experts_per_tok": o["top_k"],
        "router_aux_loss_coef": aux_loss_coef_to_hf(o["aux_loss_coef"], o["top_k"], n - len(dense)),
        "output_router_logits": False,
    }
    if m.hidden != "intermediate_size":
        out[m.hidden] = o["expert_hidden"]
    if m.norm is None:
        out["norm_topk_prob"] = o["norm_topk_prob"]
    if m.sparse_step:
        out |= {"decoder_sparse_step": 1, "mlp_only_layers": sorted(dense)}
    if m.shared:
        out["shared_expert_intermediate_size"] = o["shared_expert_hidden"]
    if c.model_type == "mixtral":
        out["router_jitter_noise"] = 0.0
    return out


def _swiglu_out(w: Weights, q: str, p: str, hidden: int, d: int, names=("gate_proj", "up_proj", "down_proj")):
    """mnemo's SwiGLU of prefix ``q`` (``w_in = [gate; up]``, ``w_out``) as a ``transformers`` MLP's
    ``{p}{gate,up,down}.weight`` (``names``: those three names); the inverse of :func:`_swiglu_in`."""
    gate, up, down = (p + x + ".weight" for x in names)
    out = dict(zip((gate, up), w.pop(q + "w_in.weight", (2 * hidden, d)).split(hidden, 0)))
    out[down] = w.pop(q + "w_out.weight", (d, hidden))
    return out


def _export_experts(c: _Class, w: Weights, q: str, p: str, o: dict[str, Any], d: int) -> dict[str, Tensor]:
    """The :class:`~mnemo.layers.MoE` of prefix ``q`` as the Hub's files hold a sparse block of layer
    prefix ``p`` (what ``save_pretrained`` writes and ``transformers`` 5 fuses on load): per-expert
    ``{block}experts.{e}.{gate,up,down}.weight``, the router ``{block}gate.weight``, Qwen2-MoE's
    ``shared_expert.*`` and ``shared_expert_gate.weight``."""
    m, E, I = c.moe, o["n_experts"], o["expert_hidden"]
    b = p + m.block
    sd = {b + "gate.weight": w.pop(q + "router.weight", (E, d))}
    w_in, w_out = w.pop(q + "w_in", (E, 2 * I, d)), w.pop(q + "w_out", (E, d, I))
    for e in range(E):
        gate, up, down = (f"{b}experts.{e}.{x}.weight" for x in m.names)
        sd[gate], sd[up] = w_in[e].split(I, 0)
        sd[down] = w_out[e]
    if m.shared:
        S = o["shared_expert_hidden"]
        sd |= _swiglu_out(w, q + "shared_expert.", b + "shared_expert.", S, d)
        sd[b + "shared_expert_gate.weight"] = w.pop(q + "shared_gate.weight", (1, d))
    return sd


def _pair(c: _Class) -> tuple[Callable, Callable]:
    def import_fn(hf_config: dict, weights: dict[str, Tensor]) -> tuple[ModelConfig, dict[str, Tensor]]:
        return _import(c, hf_config, weights)

    def export_fn(config: ModelConfig, weights: dict[str, Tensor]) -> tuple[dict, dict[str, Tensor]]:
        return _export(c, config, weights)

    for f, verb, args, returns in (
        (import_fn, "import", "``(config dict, state dict)``", "a mnemo ``(ModelConfig, state dict)``"),
        (export_fn, "export", "a mnemo ``(ModelConfig, state dict)``", "``(config dict, state dict)``"),
    ):
        f.__name__ = f.__qualname__ = f"{verb}_{c.model_type}"
        f.__doc__ = (
            f"{c.arch} {verb}: {args} → {returns} (see :mod:`mnemo.hf.llama`). Raises ``ValueError`` "
            f'("{c.fmt.name} conversion: …") naming the field or weight that cannot be reproduced exactly.'
        )
    return import_fn, export_fn


import_llama, export_llama = _pair(LLAMA)
import_qwen2, export_qwen2 = _pair(QWEN2)
import_qwen3, export_qwen3 = _pair(QWEN3)
import_mistral, export_mistral = _pair(MISTRAL)

#: ``(class, import function, export function)`` in the order an export tries them (the first
#: that expresses a model exactly)
CLASSES = (
    (LLAMA, import_llama, export_llama),
    (MISTRAL, import_mistral, export_mistral),
    (QWEN3, import_qwen3, export_qwen3),
    (QWEN2, import_qwen2, export_qwen2),
)

import_mixtral, export_mixtral = _pair(MIXTRAL)
import_qwen3_moe, export_qwen3_moe = _pair(QWEN3_MOE)
import_qwen2_moe, export_qwen2_moe = _pair(QWEN2_MOE)

#: the mixture-of-experts classes, as :data:`CLASSES`: an export of a ``mlp="moe"`` model tries them
#: in this order (no shared expert, renormalised, no q/k norm: Mixtral; q/k norms: Qwen3-MoE; a gated
#: shared expert: Qwen2-MoE)
MOE_CLASSES = (
    (MIXTRAL, import_mixtral, export_mixtral),
    (QWEN3_MOE, import_qwen3_moe, export_qwen3_moe),
    (QWEN2_MOE, import_qwen2_moe, export_qwen2_moe),
)
