"""AI21's Jamba (``JambaForCausalLM``; Lieber et al. 2024, "Jamba: A Hybrid Transformer-Mamba
Language Model", §2), the released attention + Mamba + mixture-of-experts hybrid, in and out of mnemo.

:func:`import_jamba` turns a ``transformers`` ``JambaForCausalLM`` config (a dict, as in
``config.json``) and its weights into a :class:`~mnemo.models.ModelConfig` and a state dict that
``LanguageModel(config).load_state_dict(sd, strict=True)`` accepts; :func:`export_jamba` does the
reverse. Plain dicts and tensors: nothing here imports ``transformers``.

The function (``transformers`` 5.25's ``modeling_jamba.py``): blocks ``x + mixer(RMSNorm(x))``,
``x + mlp(RMSNorm(x))`` (``input_layernorm``, ``pre_ff_layernorm``; ``final_layernorm`` at the top;
every norm ``rms_norm_eps``), and per layer ``i``:

* the mixer: attention where ``i % attn_layer_period == attn_layer_offset`` (``JambaConfig``'s
  ``layers_block_type``), Mamba elsewhere → mnemo's ``layers=[...]``;
* the MLP: a mixture of experts where ``i % expert_layer_period == expert_layer_offset`` and
  ``num_experts > 1`` (``layers_num_experts``), a dense SwiGLU ``down(silu(gate x) · up x)`` of
  ``intermediate_size`` elsewhere → mnemo ``mlp="moe"`` with the dense layers as ``mlp_only_layers``
  (``mlp_hidden = intermediate_size``), or ``mlp="swiglu"`` where no layer is sparse
  (``num_experts`` 1: every layer dense).

The correspondence:

* Mamba layers (``JambaMambaMixer``) → ``"mamba"`` (:class:`~mnemo.layers.ssm.Mamba`): Mamba-1 with
  ``d_inner = mamba_expand · hidden_size``, ``mamba_d_state``, a ``mamba_d_conv`` causal conv with
  SiLU (bias ``mamba_conv_bias``), ``in_proj`` / ``out_proj`` biases by ``mamba_proj_bias``,
  ``mamba_dt_rank`` (``"auto"``: ``ceil(hidden_size / 16)``), and Jamba's addition: RMSNorms with
  weights (epsilon ``rms_norm_eps``) on the Δ input before ``dt_proj``, on ``B`` and on ``C``
  (``dt_layernorm``, ``b_layernorm``, ``c_layernorm``) → mnemo's ``bcdt_norm=True`` with ``norm_eps``
  (``dt_norm``, ``b_norm``, ``c_norm``). The other weights are named as in ``MambaForCausalLM``
  (:data:`mnemo.hf.mamba.MAMBA_KEYS`'s table, under ``….mamba.``).
* attention layers (``JambaAttention``) → ``"attention"`` without positions (``rope=False``: Jamba
  has no positional encoding at all, §2), ``num_attention_heads`` query heads,
  ``num_key_value_heads`` (grouped-query; null: one per query head), ``head_dim`` (``hidden_size //
  num_attention_heads`` unless the config gives one, as the class reads it), no biases, logits
  scaled by ``head_dim ** -0.5``; ``k_proj`` / ``v_proj`` stacked as mnemo's ``kv_proj``.
* the sparse block (``JambaSparseMoeBlock``) → :class:`~mnemo.layers.MoE`: ``n_experts =
  num_experts`` (alias ``num_local_experts``), ``top_k = num_experts_per_tok``, ``expert_hidden =
  intermediate_size``; the router (``router.weight``) takes the softmax over all experts in float32
  and keeps the ``k`` largest probabilities *as they are* (``JambaTopKRouter``: not renormalised)
  → ``norm_topk_prob=False``, softmax scores, no shared expert. Experts from ``transformers`` 5's
  fused ``experts.gate_up_proj [E, 2I, d]`` (per expert ``[gate; up]``, mnemo's ``w_in``) and
  ``experts.down_proj [E, d, I]`` (``w_out``), or the Hub's per-expert files
  (``experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``, which ``save_pretrained`` writes and the
  export writes). ``router_aux_loss_coef`` → ``aux_loss_coef`` by
  :func:`~mnemo.hf.fields.aux_loss_coef_from_hf` over the sparse layers (``transformers`` pools the
  routers of the sparse layers only).

Not carried (no effect on the function): ``attention_dropout`` (training only),
``output_router_logits``, ``num_logits_to_keep`` / ``logits_to_keep`` (which logits ``generate``
computes), ``use_mamba_kernels`` / ``use_mambapy`` / ``use_associative_scan`` (how the scan is
computed), ``use_cache``, ``pad_token_id``'s ``padding_idx`` (it zeroes that embedding row's
gradient, not its value); ``max_position_embeddings`` and the token ids are carried by
:mod:`mnemo.hf.convert`.

Refused by name (``ValueError``, "Jamba conversion: …"): a ``hidden_act`` other than ``"silu"``
(the MLPs', the experts' and the Mamba conv's activation), an offset not below its period (as
``JambaConfig`` refuses it), a ``layers_block_type`` / ``layers_num_experts`` field that
contradicts the periods (``transformers`` derives both from them and cannot load a config that sets
them), a non-null ``sliding_window`` (older ``JambaConfig`` versions' window, which ``transformers``
5.25 no longer applies: the checkpoint's own attention is not known to be full), a
``num_experts_per_tok`` outside ``1 … num_experts``, and a missing, mis-shaped (naming the fields
that set its shape) or unexpected weight.

Export: ``"mamba"`` layers with ``bcdt_norm`` (``norm_eps`` the model's ``norm_eps``: Jamba has one
epsilon), selective, and ``"attention"`` layers without positions, biases, window, sinks, q/k norm,
output gate or softmax scale, whose layout is periodic (attention exactly at ``i % p == o``: the
smallest such ``p`` is written; at least one attention layer, without which ``transformers`` 5.25's
``JambaModel`` raises whenever it keeps a cache); a SwiGLU MLP (``num_experts`` 1) or a MoE (softmax
scores, not renormalised, no shared expert, routed scaling, group limit or balancing bias; at least
two experts: ``num_experts`` 1 means dense layers there) whose sparse layers are periodic as well and
whose dense layers, if any, have the experts' width (Jamba has one ``intermediate_size``).
``capacity_factor`` (drops only in training), ``z_loss_coef``, ``seq_aux_loss_coef`` and ``dispatch``
do not change the function and are not carried.

Known difference: ``transformers``' full-sequence scan (``mamba_selective_scan``) ignores a state
already in its cache, so a prefill in several pieces there (not what ``generate`` does) computes
another function; mnemo's scan continues from the state in every form.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..layers.mlp import swiglu_hidden
from ..layers.moe import MOE_OPTIONS
from ..models.config import ModelConfig
from .bamba import _attention_weights
from .bamba import _count as _bamba_count
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
    tied_as_loaded,
)
from .llama import _swiglu_in, _swiglu_out
from .mamba import MAMBA_KEYS, _d_inner_expand

ARCH, MODEL_TYPE = "JambaForCausalLM", "jamba"
MAMBA, ATTN = "mamba", "attention"

#: ``JambaConfig``'s defaults (``transformers`` 5.25) for the fields the conversion reads
HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 65536,
    "tie_word_embeddings": False,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,  # (null: num_attention_heads)
    "head_dim": None,  # hidden_size // num_attention_heads
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "router_aux_loss_coef": 0.001,
    "max_position_embeddings": 262144,
    "num_experts_per_tok": 2,
    "num_experts": 16,
    "expert_layer_period": 2,
    "expert_layer_offset": 1,
    "attn_layer_period": 8,
    "attn_layer_offset": 4,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_dt_rank": "auto",
    "mamba_conv_bias": True,
    "mamba_proj_bias": False,
}

_INNER = ("hidden_size", "mamba_expand")
_Q = ("num_attention_heads", "head_dim", "hidden_size")
_KV = ("num_key_value_heads", "head_dim", "hidden_size")
_FF = ("intermediate_size", "hidden_size")
_EXPERTS = ("num_experts", "intermediate_size", "hidden_size")
#: the config fields that set each weight's shape, by the end of its name in the file
SHAPE_FIELDS: dict[str, tuple[str, ...]] = {
    "embed_tokens.weight": ("vocab_size", "hidden_size"),
    "lm_head.weight": ("vocab_size", "hidden_size"),
    "final_layernorm.weight": ("hidden_size",),
    "input_layernorm.weight": ("hidden_size",),
    "pre_ff_layernorm.weight": ("hidden_size",),
    "gate_proj.weight": _FF,
    "up_proj.weight": _FF,
    "down_proj.weight": _FF,
    "feed_forward.router.weight": ("num_experts", "hidden_size"),
    "experts.gate_up_proj": _EXPERTS,
    "experts.down_proj": _EXPERTS,
    "mamba.in_proj.weight": _INNER,
    "mamba.in_proj.bias": _INNER,
    "mamba.conv1d.weight": (*_INNER, "mamba_d_conv"),
    "mamba.conv1d.bias": _INNER,
    "mamba.x_proj.weight": (*_INNER, "mamba_dt_rank", "mamba_d_state"),
    "mamba.dt_proj.weight": (*_INNER, "mamba_dt_rank"),
    "mamba.dt_proj.bias": _INNER,
    "mamba.A_log": (*_INNER, "mamba_d_state"),
    "mamba.D": _INNER,
    "mamba.out_proj.weight": _INNER,
    "mamba.out_proj.bias": ("hidden_size",),
    "mamba.dt_layernorm.weight": ("mamba_dt_rank", "hidden_size"),
    "mamba.b_layernorm.weight": ("mamba_d_state",),
    "mamba.c_layernorm.weight": ("mamba_d_state",),
    "self_attn.q_proj.weight": _Q,
    "self_attn.k_proj.weight": _KV,
    "self_attn.v_proj.weight": _KV,
    "self_attn.o_proj.weight": ("hidden_size", *_Q[:2]),
}

#: the format: its refusals say "Jamba conversion: …"
JAMBA = ConfigFormat("Jamba", HF_DEFAULTS, SHAPE_FIELDS)
_refuse, _get = JAMBA.refuse, JAMBA.get

#: one Mamba layer's weights, ``(the file's name under ….mamba., mnemo's under ….mixer.)``: Mamba's
#: table (:data:`mnemo.hf.mamba.MAMBA_KEYS`) and Jamba's three norms (mnemo's ``bcdt_norm``)
_P, _M = "backbone.layers.{i}.mixer.", "blocks.{i}.mixer."
MAMBA_NAMES: tuple[tuple[str, str], ...] = (
    *((t.removeprefix(_P), o.removeprefix(_M)) for t, o in MAMBA_KEYS if t.startswith(_P)),
    ("dt_layernorm.weight", "dt_norm.weight"),
    ("b_layernorm.weight", "b_norm.weight"),
    ("c_layernorm.weight", "c_norm.weight"),
)

_BOOL_FIELDS = ("tie_word_embeddings", "mamba_conv_bias", "mamba_proj_bias")


def _count(cfg: dict, key: str) -> int:
    """The field ``key`` (the class's default where left out), a positive int (refused by name)."""
    return _bamba_count(cfg, key, JAMBA)


def _periodic(cfg: dict, kind: str, n: int) -> list[bool]:
    """``[i % period == offset for i < n]`` of ``{kind}_layer_period`` / ``{kind}_layer_offset``
    (``kind``: ``"attn"`` or ``"expert"``); refused by name unless ``0 <= offset < period``."""
    p, o = _count(cfg, f"{kind}_layer_period"), _get(cfg, f"{kind}_layer_offset")
    if not is_int(o) or o < 0:
        _refuse(f"field '{kind}_layer_offset': expected an int >= 0, got {o!r}")
    if o >= p:
        _refuse(
            f"{kind}_layer_offset = {o}: expected less than {kind}_layer_period = {p} (as JambaConfig says)"
        )
    return [i % p == o for i in range(n)]


def _derived(cfg: dict, key: str, value: list) -> None:
    """A ``config.json`` field that ``JambaConfig`` derives (``layers_block_type``,
    ``layers_num_experts``) is accepted only where it says what the periods say."""
    given = cfg.get(key)
    if given is not None and given != value:
        _refuse(
            f"field {key!r} = {given!r} contradicts the periods (attn_layer_period / _offset, "
            f"expert_layer_period / _offset, num_experts), which give {value!r}; JambaConfig derives it "
            "from them (and cannot load a config that sets it)"
        )


def _layers(cfg: dict, n: int) -> tuple[list[str], list[int], int]:
    """``(mnemo's mixer per layer, the sparse layers, num_experts)``."""
    attn = _periodic(cfg, "attn", n)
    types = [ATTN if a else MAMBA for a in attn]
    _derived(cfg, "layers_block_type", ["attention" if a else "mamba" for a in attn])
    given = {k: cfg[k] for k in ("num_experts", "num_local_experts") if cfg.get(k) is not None}
    if len(set(map(repr, given.values()))) > 1:
        _refuse(f"fields {given}: the expert count is given twice, with two values; expected one")
    E = next(iter(given.values()), HF_DEFAULTS["num_experts"])
    if not is_int(E) or E < 1:
        _refuse(f"field 'num_experts': expected an int >= 1 (1: every layer dense), got {E!r}")
    expert = _periodic(cfg, "expert", n)
    _derived(cfg, "layers_num_experts", [E if x else 1 for x in expert])
    return types, [i for i in range(n) if expert[i] and E > 1], E


def _mamba_opts(cfg: dict, d: int, eps: float) -> dict[str, Any]:
    """:class:`~mnemo.layers.ssm.Mamba`'s options for ``JambaMambaMixer``."""
    rank = _get(cfg, "mamba_dt_rank")
    if rank == "auto":
        rank = math.ceil(d / 16)
    if not is_int(rank) or rank < 1:
        _refuse(f"field 'mamba_dt_rank': expected a positive int or 'auto', got {cfg.get('mamba_dt_rank')!r}")
    return {
        "d_state": _count(cfg, "mamba_d_state"),
        "expand": _d_inner_expand(f"{JAMBA.name} conversion", d, _get(cfg, "mamba_expand"), "mamba_expand"),
        "conv_size": _count(cfg, "mamba_d_conv"),
        "dt_rank": rank,
        "bias": bool(_get(cfg, "mamba_proj_bias")),
        "conv_bias": bool(_get(cfg, "mamba_conv_bias")),
        "bcdt_norm": True,
        "norm_eps": eps,
    }


def _attention_opts(cfg: dict, d: int, eps: float) -> dict[str, Any]:
    """:class:`~mnemo.layers.attention.Attention`'s options for ``JambaAttention``: no positions."""
    H = _count(cfg, "num_attention_heads")
    H_kv = cfg.get("num_key_value_heads", HF_DEFAULTS["num_key_value_heads"])
    H_kv = H if H_kv is None else H_kv  # (JambaConfig: null means one per query head)
    if not is_int(H_kv) or H_kv < 1 or H % H_kv:
        _refuse(f"num_key_value_heads = {H_kv!r}: expected a positive int dividing num_attention_heads = {H}")
    D = cfg.get("head_dim")
    D = d // H if D is None else D
    if not is_int(D) or D < 1:
        _refuse(f"head_dim = {D!r}: expected a positive int (hidden_size // num_attention_heads if null)")
    return dict(
        n_heads=H, n_kv_heads=H_kv, head_dim=D, rope=False, window=None, qk_norm=False, output_gate=False,
        bias=False, norm_eps=eps,
    )  # fmt: skip


def import_jamba(hf_config: dict, weights: dict[str, Tensor]) -> tuple[ModelConfig, dict[str, Tensor]]:
    """A ``transformers`` ``JambaForCausalLM`` checkpoint as a mnemo ``(ModelConfig, state dict)``:
    ``"mamba"`` (with ``bcdt_norm``) and ``"attention"`` (no positions) layers by the attention
    period, SwiGLU MLPs and a MoE by the expert period (see the module docstring).

    ``hf_config``: the config dict (``config.json`` or ``JambaConfig.to_dict()``); ``weights``: the
    state dict (the Hub's per-expert names or ``transformers`` 5's fused ones). Raises
    ``ValueError`` ("Jamba conversion: …") naming the field and the received value for anything not
    reproduced exactly."""
    cfg = dict(hf_config)
    if cfg.get("model_type", MODEL_TYPE) != MODEL_TYPE:
        _refuse(f"model_type {cfg['model_type']!r} is not {MODEL_TYPE!r}")
    for k in _BOOL_FIELDS:
        if cfg.get(k) is not None and not isinstance(cfg[k], bool):
            _refuse(f"field {k!r}: expected true or false, got {cfg[k]!r}")
    act = _get(cfg, "hidden_act")
    if act != "silu":
        _refuse(
            f"hidden_act {act!r} is not supported (only 'silu': it is the activation of the MLPs, the "
            "experts and the Mamba convolution, all SiLU in mnemo)"
        )
    if cfg.get("sliding_window") is not None:
        _refuse(
            f"field 'sliding_window' = {cfg['sliding_window']!r}: expected null (an older JambaConfig's "
            "attention window, which transformers 5.25 no longer applies; mnemo would not know which of "
            "the two functions the checkpoint was trained with)"
        )
    n, d = _count(cfg, "num_hidden_layers"), _count(cfg, "hidden_size")
    eps = _get(cfg, "rms_norm_eps")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < math.inf:
        _refuse(f"field 'rms_norm_eps': expected a finite number >= 0, got {eps!r}")
    eps = float(eps)
    types, sparse, E = _layers(cfg, n)
    options: dict[str, dict[str, Any]] = {}
    if MAMBA in types:
        options[MAMBA] = _mamba_opts(cfg, d, eps)
    if ATTN in types:
        options[ATTN] = _attention_opts(cfg, d, eps)
    hidden = _count(cfg, "intermediate_size")
    moe: dict[str, Any] = {}
    if sparse:
        k = _count(cfg, "num_experts_per_tok")
        if k > E:
            _refuse(f"field 'num_experts_per_tok' = {k}: expected at most num_experts = {E}")
        coef = _get(cfg, "router_aux_loss_coef")
        if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not 0 <= coef < math.inf:
            _refuse(f"field 'router_aux_loss_coef': expected a number >= 0, got {coef!r}")
        moe = dict(
            n_experts=E, top_k=k, expert_hidden=hidden, norm_topk_prob=False,
            aux_loss_coef=aux_loss_coef_from_hf(coef, k, len(sparse)),
        )  # fmt: skip
    tie = tied_as_loaded(JAMBA, cfg, weights)
    config = ModelConfig(
        vocab_size=_count(cfg, "vocab_size"),
        d_model=d,
        n_layers=n,
        layers=types,
        mixer_options=options,
        mlp="moe" if moe else "swiglu",
        mlp_hidden=hidden,
        mlp_options=moe,
        mlp_only_layers=[i for i in range(n) if i not in sparse] if moe else None,
        pos_embedding="none",
        tie_embeddings=tie,
        norm_eps=eps,
        init_std=JAMBA.init_std(_get(cfg, "initializer_range")),
    ).validate()

    w = Weights(JAMBA, weights, cfg=cfg)
    sd: dict[str, Tensor] = import_head(w, config.vocab_size, d, tie)
    sd["norm.weight"] = w.pop("model.final_layernorm.weight", (d,))
    sd.update(_layer_weights(w, config, sparse, importing=True))
    w.finish()
    return config, sd


def _mamba_shapes(o: dict[str, Any], d: int) -> dict[str, tuple[int, ...]]:
    """mnemo's weights of a Jamba Mamba layer with options ``o`` (under ``….mixer.``) → shape."""
    Di, N, R = o["expand"] * d, o["d_state"], o["dt_rank"] or math.ceil(d / 16)
    shapes = {
        "in_proj.weight": (2 * Di, d), "conv.weight": (Di, 1, o["conv_size"]), "A_log": (Di, N), "D": (Di,),
        "o_proj.weight": (d, Di), "x_proj.weight": (R + 2 * N, Di), "dt_proj.weight": (Di, R),
        "dt_proj.bias": (Di,), "dt_norm.weight": (R,), "b_norm.weight": (N,), "c_norm.weight": (N,),
    }  # fmt: skip
    if o["bias"]:
        shapes |= {"in_proj.bias": (2 * Di,), "o_proj.bias": (d,)}
    if o["conv_bias"]:
        shapes["conv.bias"] = (Di,)
    return shapes


def _layer_weights(w: Weights, config: ModelConfig, sparse: list[int], importing: bool) -> dict[str, Tensor]:
    """Every layer's weights, the file's names (``model.layers.{i}.``) ↔ mnemo's (``blocks.{i}.``):
    the two norms, the mixer (Mamba's table and Jamba's three norms; Bamba's attention mapping) and
    the MLP (:func:`_mlp_weights`)."""
    d, sd = config.d_model, {}
    m, a = mixer_options(MAMBA, config), mixer_options(ATTN, config)
    shapes = _mamba_shapes(m, d)
    for i, t in enumerate(config.layer_mixers()):
        p, q = f"model.layers.{i}.", f"blocks.{i}."
        for theirs, ours in (("input_layernorm", "mixer_norm"), ("pre_ff_layernorm", "mlp_norm")):
            src, dst = (p + theirs, q + ours) if importing else (q + ours, p + theirs)
            sd[dst + ".weight"] = w.pop(src + ".weight", (d,))
        if t == MAMBA:
            for theirs, ours in MAMBA_NAMES:
                if ours in shapes:
                    src, dst = (p + "mamba." + theirs, q + "mixer." + ours)
                    src, dst = (src, dst) if importing else (dst, src)
                    sd[dst] = w.pop(src, shapes[ours])
        else:
            src, dst = (p + "self_attn.", q + "mixer.") if importing else (q + "mixer.", p + "self_attn.")
            sd.update(_attention_weights(w, src, dst, a, d, importing))
        sd.update(_mlp_weights(w, config, p + "feed_forward.", q + "mlp.", i in sparse, importing))
    return sd


def _mlp_weights(
    w: Weights, config: ModelConfig, p: str, q: str, moe: bool, importing: bool
) -> dict[str, Tensor]:
    """One layer's MLP, the file's names (prefix ``p`` = ``model.layers.{i}.feed_forward.``) ↔
    mnemo's (prefix ``q`` = ``blocks.{i}.mlp.``): a dense SwiGLU (``gate_proj`` / ``up_proj`` /
    ``down_proj``), or the router (``router.weight``) and the experts, fused (``experts.gate_up_proj``
    / ``experts.down_proj``, ``transformers`` 5's state dict) or one by one
    (``experts.{e}.{gate,up,down}_proj.weight``: the Hub's files, which the export writes)."""
    d = config.d_model
    if not moe:
        hidden = config.mlp_hidden or swiglu_hidden(d)
        if not importing:
            return _swiglu_out(w, q, p, hidden, d)
        w_in, w_out = _swiglu_in(w, p, hidden, d)
        return {q + "w_in.weight": w_in, q + "w_out.weight": w_out}
    o = config.mlp_options
    E, I = o["n_experts"], o["expert_hidden"]
    if not importing:
        sd = {p + "router.weight": w.pop(q + "router.weight", (E, d))}
        w_in, w_out = w.pop(q + "w_in", (E, 2 * I, d)), w.pop(q + "w_out", (E, d, I))
        for e in range(E):
            b = f"{p}experts.{e}."
            sd[b + "gate_proj.weight"], sd[b + "up_proj.weight"] = w_in[e].split(I, 0)
            sd[b + "down_proj.weight"] = w_out[e]
        return sd
    sd = {q + "router.weight": w.pop(p + "router.weight", (E, d))}
    if p + "experts.gate_up_proj" in w:
        sd[q + "w_in"] = w.pop(p + "experts.gate_up_proj", (E, 2 * I, d))
        sd[q + "w_out"] = w.pop(p + "experts.down_proj", (E, d, I))
    else:
        each = [_swiglu_in(w, f"{p}experts.{e}.", I, d) for e in range(E)]
        sd[q + "w_in"], sd[q + "w_out"] = (torch.stack(t) for t in zip(*each))
    return sd


def _period(flags: list[bool], what: str) -> tuple[int, int]:
    """The smallest ``(period, offset)`` with ``flags[i] == (i % period == offset)`` for every layer;
    refused by name (``what``: the layers' kind) where none exists or no flag is set."""
    on = [i for i, f in enumerate(flags) if f]
    for p in range(1, len(flags) + 1):
        if on and on[0] < p and all((i % p == on[0]) == f for i, f in enumerate(flags)):
            return p, on[0]
    _refuse(
        f"{what} at layers {on} of {len(flags)}: Jamba places them at i % period == offset only "
        "(attn_layer_period / _offset, expert_layer_period / _offset); this layout has no such period"
    )


def _export_moe(config: ModelConfig, dense: list[int]) -> dict[str, Any]:
    """The MoE's options as Jamba expresses them, refused by name where they are not Jamba's."""
    o = {**MOE_OPTIONS, **config.mlp_options}
    fixed = dict(
        score="softmax", norm_topk_prob=False, shared_expert_hidden=None, routed_scaling_factor=1.0,
        n_group=1, topk_group=1, bias_balancing=False,
    )  # fmt: skip
    for key, val in fixed.items():
        JAMBA.require("mlp_options", o, key, val)
    if o["n_experts"] < 2:
        _refuse(
            f"mlp_options option n_experts={o['n_experts']!r}: a Jamba layer with num_experts 1 is a dense "
            "MLP (no router); export the model with mlp='swiglu' instead (needs at least 2 experts)"
        )
    dense_hidden = config.mlp_hidden or swiglu_hidden(config.d_model)
    o["expert_hidden"] = o["expert_hidden"] or dense_hidden
    if dense and o["expert_hidden"] != dense_hidden:
        _refuse(
            f"mlp_options option expert_hidden={o['expert_hidden']} differs from the dense layers' width "
            f"mlp_hidden = {dense_hidden} (layers {dense}): Jamba has one intermediate_size for both"
        )
    return o


def export_jamba(config: ModelConfig, weights: dict[str, Tensor]) -> tuple[dict, dict[str, Tensor]]:
    """A mnemo ``(ModelConfig, state dict)`` as a ``transformers`` ``JambaForCausalLM`` ``(config
    dict, state dict)`` (the Hub's per-expert names): ``"mamba"`` layers with ``bcdt_norm`` and
    ``"attention"`` layers without positions, periodic, with SwiGLU MLPs or a periodic MoE of Jamba's
    routing. Anything the class cannot express raises ``ValueError`` naming the option and the
    received value (module docstring)."""
    config = config.validate()
    refuse_unexpressed(JAMBA.name, config, mlp_only_layers=True)
    types, n, d = config.layer_mixers(), config.n_layers, config.d_model
    for i, mixer in enumerate(types):
        if mixer not in (MAMBA, ATTN):
            _refuse(f"layer {i} uses mixer {mixer!r}; Jamba layers are {MAMBA!r} or {ATTN!r}")
    if ATTN not in types:
        _refuse(
            f"layers {sorted(set(types))} without an attention layer: transformers 5.25's JambaModel cannot "
            "run one with a cache (its causal mask asks the cache for attention layers and raises)"
        )
    if config.pos_embedding != "none":
        _refuse(f"pos_embedding {config.pos_embedding!r} is not supported (Jamba has no positions)")
    p_attn, o_attn = _period([t == ATTN for t in types], "attention layers")
    if config.mlp == "moe":
        dense = list(config.mlp_only_layers or [])
        sparse = [i for i in range(n) if i not in dense]
        p_exp, o_exp = _period([i in sparse for i in range(n)], "mixture-of-experts layers")
        moe = _export_moe(config, dense)
    elif config.mlp == "swiglu":
        sparse, (p_exp, o_exp), moe = [], (1, 0), None
    else:
        _refuse(f"mlp {config.mlp!r} is not supported (only 'swiglu' and 'moe', Jamba's MLPs)")
    m, a = mixer_options(MAMBA, config), mixer_options(ATTN, config)
    if MAMBA in types:
        where = f"mixer_options[{MAMBA!r}]"
        for key, val in dict(selective=True, bcdt_norm=True, bcdt_rms_eps=None).items():
            JAMBA.require(where, m, key, val)
        if float(m["norm_eps"]) != float(config.norm_eps):
            JAMBA.require(where, m, "norm_eps", config.norm_eps)  # (one rms_norm_eps for every norm)
    where = f"mixer_options[{ATTN!r}]"
    fixed = dict(rope=False, window=None, qk_norm=False, output_gate=False, bias=False, n_sink=0)
    for key, val in fixed.items():
        JAMBA.require(where, a, key, val)
    H = a["n_heads"]
    H_kv = a["n_kv_heads"] or H
    D = a["head_dim"] or d // H
    hidden = moe["expert_hidden"] if moe else (config.mlp_hidden or swiglu_hidden(d))
    hf = decoder_fields(config, ARCH, MODEL_TYPE, heads=(H, H_kv, D), hidden=hidden, rope={})
    del hf["rope_parameters"]  # (no positions)
    if D == d // H:  # (no JambaConfig field; JambaAttention reads it where the config has one)
        del hf["head_dim"]
    hf |= {
        "attn_layer_period": p_attn,
        "attn_layer_offset": o_attn,
        "expert_layer_period": p_exp,
        "expert_layer_offset": o_exp,
        "num_experts": moe["n_experts"] if moe else 1,
        "num_experts_per_tok": moe["top_k"] if moe else 1,
        "output_router_logits": False,
        "mamba_d_state": m["d_state"],
        "mamba_d_conv": m["conv_size"],
        "mamba_expand": m["expand"],
        "mamba_dt_rank": m["dt_rank"] or math.ceil(d / 16),
        "mamba_conv_bias": bool(m["conv_bias"]),
        "mamba_proj_bias": bool(m["bias"]),
    }
    if moe:
        hf["router_aux_loss_coef"] = aux_loss_coef_to_hf(moe["aux_loss_coef"], moe["top_k"], len(sparse))
    resolved = config
    if moe:  # (the expert width resolved as LanguageModel resolves it)
        resolved = ModelConfig.from_dict({**config.to_dict(), "mlp_options": {**config.mlp_options, **moe}})
    w = Weights(JAMBA, weights)
    sd: dict[str, Tensor] = export_head(w, config)
    sd["model.final_layernorm.weight"] = w.pop("norm.weight", (d,))
    sd.update(_layer_weights(w, resolved, sparse, importing=False))
    w.finish()
    return hf, {k: v.contiguous() for k, v in sd.items()}
