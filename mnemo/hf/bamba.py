"""Bamba (IBM's Mamba-2 / attention hybrid with SwiGLU MLPs, the design behind Granite 4) in and
out of mnemo.

:func:`import_bamba` turns a ``transformers`` ``BambaForCausalLM`` config (a dict, as in
``config.json``) and its state dict into a :class:`~mnemo.models.ModelConfig` and a state dict that
``LanguageModel(config).load_state_dict(sd, strict=True)`` accepts; :func:`export_bamba` does the
reverse. Plain dicts and tensors: nothing here imports ``transformers``.

The function (``transformers`` 5's ``modeling_bamba.py``): blocks ``x + mixer(RMSNorm(x))``,
``x + mlp(RMSNorm(x))`` (``input_layernorm``, ``pre_ff_layernorm``; ``final_layernorm`` at the top;
every norm ``rms_norm_eps``, weights multiplied as mnemo's are), the SwiGLU MLP ``down(silu(gate(x))
· up(x))`` in every layer (``feed_forward``, ``intermediate_size``), and a mixer per layer: the
layers listed in ``attn_layer_indices`` are attention, the others Mamba-2. The correspondence:

* Mamba-2 layers (``BambaMixer``) → ``"mamba2"`` (:class:`~mnemo.layers.ssm.Mamba2`):
  ``d_inner = mamba_expand · hidden_size``, ``mamba_n_heads`` heads of ``mamba_d_head`` channels
  (``"auto"``: ``d_inner / mamba_n_heads``), ``mamba_n_groups`` B/C groups of ``mamba_d_state``,
  a ``mamba_d_conv`` causal conv with SiLU (bias ``mamba_conv_bias``), biases on ``in_proj`` /
  ``out_proj`` by ``mamba_proj_bias``, ``Δ = clamp(softplus(dt + dt_bias), time_step_limit)``,
  ``A = −exp(A_log)``, one ``D`` per head, and the gated norm ``RMSNorm(y ⊙ silu(z))`` per group
  of ``d_inner / mamba_n_groups`` channels with epsilon ``rms_norm_eps`` (mnemo's
  ``norm_before_gate=False``, ``norm_groups = n_groups``, ``norm_eps``). The ``in_proj`` rows are
  ``[z | x B C | dt]`` in both. ``mamba_chunk_size`` sets only how ``transformers`` blocks the scan
  (not the function); it is carried as mnemo's ``chunk_size``.
* attention layers (``BambaAttention``) → ``"attention"``: ``num_attention_heads`` query heads,
  ``num_key_value_heads`` (grouped-query), ``head_dim`` (``hidden_size // num_attention_heads``
  unless the config gives one), logits scaled by ``head_dim ** -0.5``, biases on q, k, v and o by
  ``attention_bias``, and RoPE (``rotate_half`` pairing) on the first ``rotary_dim = int(head_dim
  · partial_rotary_factor)`` channels of each head: ``BambaConfig`` sets ``partial_rotary_factor
  = 0.5`` unless ``rope_parameters`` holds one (a top-level ``partial_rotary_factor`` field is
  ignored there, and here). ``k_proj`` / ``v_proj`` are stacked as mnemo's ``kv_proj``.

Refused by name (``ValueError``, "Bamba conversion: …"): a ``hidden_act`` other than ``"silu"`` (it
is both the MLP's and the Mamba conv's activation), ``mlp_bias`` (mnemo's SwiGLU has no biases), a
``rope_type`` other than ``"default"``, an odd or empty rotary width, an ``attn_layer_indices``
entry that is not a layer index, sizes that do not divide (``mamba_n_heads · mamba_d_head ≠
mamba_expand · hidden_size``, ``mamba_n_groups`` not dividing the heads), an ``attn_rotary_emb``
(the original ``fms`` config's rotary width) that contradicts the rotary width ``transformers``
uses, and a missing, mis-shaped (naming the fields that set its shape) or unexpected weight. Not
carried (no effect on the function): ``attention_dropout`` (training only), ``z_loss_coefficient``
(a training loss term), ``num_logits_to_keep`` (which logits ``generate`` computes),
``pad_token_id``'s ``padding_idx`` on the embedding (it zeroes that row's gradient, not its value).

Known difference, as for Mamba-2: ``transformers``' one-token Mamba-2 step does not apply
``time_step_limit``; mnemo applies it in every form (the default ``(0, inf)`` changes nothing).
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
from .mamba import _d_inner_expand, _dt_limit

ARCH, MODEL_TYPE = "BambaForCausalLM", "bamba"
MAMBA2, ATTN = "mamba2", "attention"
#: ``BambaConfig``'s hard-coded rotary share (its ``__post_init__``), unless ``rope_parameters`` has one
PARTIAL_ROTARY_FACTOR = 0.5

#: ``BambaConfig``'s defaults (``transformers`` 5.25) for the fields the conversion reads
HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 128000,
    "tie_word_embeddings": False,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 262144,
    "attn_layer_indices": None,
    "mamba_n_heads": 128,
    "mamba_d_head": "auto",
    "mamba_n_groups": 1,
    "mamba_d_state": 256,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 256,
    "mamba_conv_bias": True,
    "mamba_proj_bias": False,
    "attention_bias": False,
    "mlp_bias": False,
}

_MAMBA_IN = ("hidden_size", "mamba_expand", "mamba_n_groups", "mamba_d_state", "mamba_n_heads")
_ATTN_Q = ("num_attention_heads", "head_dim", "hidden_size")
_ATTN_KV = ("num_key_value_heads", "head_dim", "hidden_size")
#: the config fields that set each weight's shape, by the end of its name in the file
SHAPE_FIELDS: dict[str, tuple[str, ...]] = {
    "embed_tokens.weight": ("vocab_size", "hidden_size"),
    "lm_head.weight": ("vocab_size", "hidden_size"),
    "final_layernorm.weight": ("hidden_size",),
    "input_layernorm.weight": ("hidden_size",),
    "pre_ff_layernorm.weight": ("hidden_size",),
    "feed_forward.gate_proj.weight": ("intermediate_size", "hidden_size"),
    "feed_forward.up_proj.weight": ("intermediate_size", "hidden_size"),
    "feed_forward.down_proj.weight": ("intermediate_size", "hidden_size"),
    "mamba.in_proj.weight": _MAMBA_IN,
    "mamba.in_proj.bias": _MAMBA_IN,
    "mamba.conv1d.weight": (*_MAMBA_IN[:4], "mamba_d_conv"),
    "mamba.conv1d.bias": _MAMBA_IN[:4],
    "mamba.dt_bias": ("mamba_n_heads",),
    "mamba.A_log": ("mamba_n_heads",),
    "mamba.D": ("mamba_n_heads",),
    "mamba.norm.weight": ("hidden_size", "mamba_expand"),
    "mamba.out_proj.weight": ("hidden_size", "mamba_expand"),
    "mamba.out_proj.bias": ("hidden_size",),
    "self_attn.q_proj.weight": _ATTN_Q,
    "self_attn.q_proj.bias": _ATTN_Q[:2],
    "self_attn.k_proj.weight": _ATTN_KV,
    "self_attn.k_proj.bias": _ATTN_KV[:2],
    "self_attn.v_proj.weight": _ATTN_KV,
    "self_attn.v_proj.bias": _ATTN_KV[:2],
    "self_attn.o_proj.weight": ("hidden_size", *_ATTN_Q[:2]),
    "self_attn.o_proj.bias": ("hidden_size",),
}

#: the format: its refusals say "Bamba conversion: …"
BAMBA = ConfigFormat("Bamba", HF_DEFAULTS, SHAPE_FIELDS)
_refuse, _get = BAMBA.refuse, BAMBA.get

_BOOL_FIELDS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "mamba_conv_bias", "mamba_proj_bias")
_INT_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "mamba_n_heads", "mamba_n_groups", "mamba_d_state", "mamba_d_conv",
)  # fmt: skip


def _count(cfg: dict, key: str, fmt: ConfigFormat = BAMBA) -> int:
    v = fmt.get(cfg, key)
    if not is_int(v) or v < 1:
        fmt.refuse(f"field {key!r}: expected a positive int, got {v!r}")
    return v


def _layer_types(cfg: dict, n: int) -> list[str]:
    """``"attention"`` at the ``attn_layer_indices``, ``"mamba2"`` elsewhere (``BambaConfig``'s
    ``layers_block_type``); an entry that is not a layer index ``0 … n − 1`` is refused by name."""
    idx = _get(cfg, "attn_layer_indices") or []
    if not isinstance(idx, list) or not all(is_int(i) and 0 <= i < n for i in idx):
        _refuse(
            f"field 'attn_layer_indices': expected a list of layer indices in 0 … num_hidden_layers − 1 = "
            f"{n - 1}, got {idx!r}"
        )
    return [ATTN if i in idx else MAMBA2 for i in range(n)]


def _mamba2_opts(cfg: dict, d: int, eps: float, fmt: ConfigFormat = BAMBA) -> dict[str, Any]:
    """:class:`~mnemo.layers.ssm.Mamba2`'s options for ``BambaMixer`` (``d``: ``hidden_size``); ``fmt``:
    the format whose fields and defaults these are (Granite 4.0-H's ``mamba_*`` fields are Bamba's)."""
    where = f"{fmt.name} conversion"
    e = _d_inner_expand(where, d, fmt.get(cfg, "mamba_expand"), "mamba_expand")
    d_inner = e * d
    H, G = _count(cfg, "mamba_n_heads", fmt), _count(cfg, "mamba_n_groups", fmt)
    P = fmt.get(cfg, "mamba_d_head")
    if P == "auto":
        P = d_inner // H
    if not is_int(P) or P < 1 or H * P != d_inner:
        fmt.refuse(
            f"mamba_n_heads · mamba_d_head = {H} · {fmt.get(cfg, 'mamba_d_head')!r} ≠ mamba_expand · "
            f"hidden_size = {d_inner} (the heads must tile the Mamba channels)"
        )
    if H % G:
        fmt.refuse(f"mamba_n_groups = {G} does not divide mamba_n_heads = {H}")
    lo, hi = _dt_limit(where, "time_step_limit", cfg.get("time_step_limit"))
    opts = {
        "d_state": _count(cfg, "mamba_d_state", fmt),
        "head_dim": P,
        "expand": e,
        "n_groups": G,
        "conv_size": _count(cfg, "mamba_d_conv", fmt),
        "bias": bool(fmt.get(cfg, "mamba_proj_bias")),
        "conv_bias": bool(fmt.get(cfg, "mamba_conv_bias")),
        "norm_eps": eps,
        "chunk_size": _count(cfg, "mamba_chunk_size", fmt),
    }
    if (lo, hi) != (0.0, math.inf):
        opts["dt_limit"] = [lo, hi]
    return opts


def _attention_opts(cfg: dict, d: int, eps: float) -> dict[str, Any]:
    """:class:`~mnemo.layers.attention.Attention`'s options for ``BambaAttention``."""
    H = _count(cfg, "num_attention_heads")
    H_kv = cfg.get("num_key_value_heads")
    H_kv = H if H_kv is None else H_kv  # (BambaConfig: null means one per query head)
    if not is_int(H_kv) or H_kv < 1 or H % H_kv:
        _refuse(f"num_key_value_heads = {H_kv!r}: expected a positive int dividing num_attention_heads = {H}")
    D = cfg.get("head_dim")
    D = d // H if D is None else D
    if not is_int(D) or D < 1:
        _refuse(
            f"head_dim = {D!r}: expected a positive int (hidden_size // num_attention_heads unless given)"
        )
    # transformers' BambaConfig overwrites a top-level partial_rotary_factor with 0.5: only
    # rope_parameters' own (or a legacy rope_scaling's) counts
    fields = {k: v for k, v in cfg.items() if k != "partial_rotary_factor"}
    theta, factor, _ = rope_fields(
        BAMBA, fields, kinds={"default": "plain RoPE"}, partial_default=PARTIAL_ROTARY_FACTOR
    )
    R = int(D * factor)
    if R < 2 or R % 2:
        _refuse(
            f"partial_rotary_factor = {factor} gives {R} rotary channels of head_dim = {D}: expected an even "
            "number >= 2 (RoPE rotates pairs of channels)"
        )
    given = cfg.get("attn_rotary_emb")
    if given is not None and given != R:
        _refuse(
            f"field 'attn_rotary_emb' = {given!r} (the rotary width of the original fms config) contradicts "
            f"the {R} rotary channels transformers uses (head_dim = {D} · partial_rotary_factor = {factor}); "
            "fix one of the two in config.json"
        )
    opts = dict(
        n_heads=H, n_kv_heads=H_kv, head_dim=D, rope=True, rope_theta=theta, window=None, qk_norm=False,
        output_gate=False, bias=bool(_get(cfg, "attention_bias")), norm_eps=eps,
    )  # fmt: skip
    if R != D:
        opts["rotary_dim"] = R
    return opts


def import_bamba(hf_config: dict, weights: dict[str, Tensor]) -> tuple[ModelConfig, dict[str, Tensor]]:
    """A ``transformers`` ``BambaForCausalLM`` checkpoint as a mnemo ``(ModelConfig, state dict)``:
    ``"mamba2"`` and ``"attention"`` layers (``layers=[...]``, attention at ``attn_layer_indices``)
    with SwiGLU MLPs (see the module docstring).

    ``hf_config``: the config dict (``config.json`` or ``BambaConfig.to_dict()``); ``weights``: the
    ``BambaForCausalLM`` state dict (``model.*``, ``lm_head.weight``). Raises ``ValueError``
    ("Bamba conversion: …") naming the field and the received value for anything not reproduced
    exactly."""
    cfg = dict(hf_config)
    if cfg.get("model_type", MODEL_TYPE) != MODEL_TYPE:
        _refuse(f"model_type {cfg['model_type']!r} is not {MODEL_TYPE!r}")
    for k in _BOOL_FIELDS:
        if cfg.get(k) is not None and not isinstance(cfg[k], bool):
            _refuse(f"field {k!r}: expected true or false, got {cfg[k]!r}")
    for k in _INT_FIELDS:
        _count(cfg, k)
    act = _get(cfg, "hidden_act")
    if act != "silu":
        _refuse(
            f"hidden_act {act!r} is not supported (only 'silu': it is the activation of the SwiGLU MLP and "
            "of the Mamba-2 convolution, both SiLU in mnemo)"
        )
    if _get(cfg, "mlp_bias"):
        _refuse("mlp_bias true is not supported: mnemo's SwiGLU MLP has no biases")
    n, d = _count(cfg, "num_hidden_layers"), _count(cfg, "hidden_size")
    eps = _get(cfg, "rms_norm_eps")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < math.inf:
        _refuse(f"field 'rms_norm_eps': expected a finite number >= 0, got {eps!r}")
    eps = float(eps)
    types = _layer_types(cfg, n)
    options: dict[str, dict[str, Any]] = {}
    if MAMBA2 in types:
        options[MAMBA2] = _mamba2_opts(cfg, d, eps)
    if ATTN in types:
        options[ATTN] = _attention_opts(cfg, d, eps)
    hidden = _count(cfg, "intermediate_size")
    tie = tied_as_loaded(BAMBA, cfg, weights)
    config = ModelConfig(
        vocab_size=_count(cfg, "vocab_size"),
        d_model=d,
        n_layers=n,
        layers=types,
        mixer_options=options,
        mlp="swiglu",
        mlp_hidden=hidden,
        pos_embedding="none",
        tie_embeddings=tie,
        norm_eps=eps,
        init_std=BAMBA.init_std(_get(cfg, "initializer_range")),
    ).validate()

    w = Weights(BAMBA, weights, cfg=cfg)
    sd: dict[str, Tensor] = import_head(w, config.vocab_size, d, tie)
    sd["norm.weight"] = w.pop("model.final_layernorm.weight", (d,))
    m = options.get(MAMBA2)
    a = options.get(ATTN)
    for i, t in enumerate(types):
        p, q = f"model.layers.{i}.", f"blocks.{i}."
        sd[q + "mixer_norm.weight"] = w.pop(p + "input_layernorm.weight", (d,))
        sd[q + "mlp_norm.weight"] = w.pop(p + "pre_ff_layernorm.weight", (d,))
        f = p + "feed_forward."
        gate, up = w.pop(f + "gate_proj.weight", (hidden, d)), w.pop(f + "up_proj.weight", (hidden, d))
        sd[q + "mlp.w_in.weight"] = torch.cat([gate, up], 0)
        sd[q + "mlp.w_out.weight"] = w.pop(f + "down_proj.weight", (d, hidden))
        if t == MAMBA2:
            sd.update(_mamba_weights(w, p + "mamba.", q + "mixer.", m, d, importing=True))
        else:
            sd.update(_attention_weights(w, p + "self_attn.", q + "mixer.", a, d, importing=True))
    w.finish()
    return config, sd


def _mamba_sizes(o: dict[str, Any], d: int) -> tuple[int, int, int, int]:
    """``(d_inner, heads, conv channels, in_proj rows)`` of a Mamba-2 layer with options ``o``."""
    d_inner = o["expand"] * d
    H = d_inner // o["head_dim"]
    conv = d_inner + 2 * o["n_groups"] * o["d_state"]
    return d_inner, H, conv, d_inner + conv + H


def _mamba_weights(w: Weights, src: str, dst: str, o: dict, d: int, importing: bool) -> dict[str, Tensor]:
    """One Mamba-2 layer's weights, ``transformers``' names (``…mamba.``) ↔ mnemo's (``…mixer.``):
    the same tensors (``in_proj`` rows ``[z | x B C | dt]`` in both, the conv ``[C, 1, W]``)."""
    d_inner, H, C, rows = _mamba_sizes(o, d)
    names = [  # (transformers, mnemo, shape)
        ("in_proj.weight", "in_proj.weight", (rows, d)),
        ("conv1d.weight", "conv.weight", (C, 1, o["conv_size"])),
        ("dt_bias", "dt_bias", (H,)),
        ("A_log", "A_log", (H,)),
        ("D", "D", (H,)),
        ("norm.weight", "norm.weight", (d_inner,)),
        ("out_proj.weight", "o_proj.weight", (d, d_inner)),
    ]
    if o["bias"]:
        names += [("in_proj.bias", "in_proj.bias", (rows,)), ("out_proj.bias", "o_proj.bias", (d,))]
    if o["conv_bias"]:
        names.append(("conv1d.bias", "conv.bias", (C,)))
    if importing:
        return {dst + ours: w.pop(src + theirs, shape) for theirs, ours, shape in names}
    return {dst + theirs: w.pop(src + ours, shape) for theirs, ours, shape in names}


def _attention_weights(w: Weights, src: str, dst: str, o: dict, d: int, importing: bool) -> dict[str, Tensor]:
    """One attention layer's weights: ``q_proj`` / ``o_proj`` as they are, ``k_proj`` and
    ``v_proj`` stacked as mnemo's ``kv_proj`` (``[k; v]``), biases alike."""
    H, H_kv = o["n_heads"], o["n_kv_heads"] or o["n_heads"]
    D = o["head_dim"] or d // H
    out: dict[str, Tensor] = {}
    if importing:
        out[dst + "q_proj.weight"] = w.pop(src + "q_proj.weight", (H * D, d))
        k, v = w.pop(src + "k_proj.weight", (H_kv * D, d)), w.pop(src + "v_proj.weight", (H_kv * D, d))
        out[dst + "kv_proj.weight"] = torch.cat([k, v], 0)
        out[dst + "o_proj.weight"] = w.pop(src + "o_proj.weight", (d, H * D))
        if o["bias"]:
            out[dst + "q_proj.bias"] = w.pop(src + "q_proj.bias", (H * D,))
            k, v = w.pop(src + "k_proj.bias", (H_kv * D,)), w.pop(src + "v_proj.bias", (H_kv * D,))
            out[dst + "kv_proj.bias"] = torch.cat([k, v])
            out[dst + "o_proj.bias"] = w.pop(src + "o_proj.bias", (d,))
        return out
    out[dst + "q_proj.weight"] = w.pop(src + "q_proj.weight", (H * D, d))
    out[dst + "k_proj.weight"], out[dst + "v_proj.weight"] = w.pop(
        src + "kv_proj.weight", (2 * H_kv * D, d)
    ).split(H_kv * D, 0)
    out[dst + "o_proj.weight"] = w.pop(src + "o_proj.weight", (d, H * D))
    if o["bias"]:
        out[dst + "q_proj.bias"] = w.pop(src + "q_proj.bias", (H * D,))
        out[dst + "k_proj.bias"], out[dst + "v_proj.bias"] = w.pop(
            src + "kv_proj.bias", (2 * H_kv * D,)
        ).split(H_kv * D, 0)
        out[dst + "o_proj.bias"] = w.pop(src + "o_proj.bias", (d,))
    return out


def _rotary_factor(R: int, D: int) -> float:
    """The ``partial_rotary_factor`` whose ``int(D · factor)`` is ``R`` (``R / D`` rounded down can
    give ``R − 1`` there: the next float up then)."""
    factor = R / D
    while int(D * factor) < R:
        factor = math.nextafter(factor, math.inf)
    if int(D * factor) != R:
        _refuse(f"rotary_dim {R} of head_dim {D} is not reproduced by a partial_rotary_factor ({factor})")
    return factor


def mamba2_fields(fmt: ConfigFormat, config: ModelConfig, m: dict, present: bool) -> dict[str, Any]:
    """The ``mamba_*`` / ``time_step_limit`` fields of ``BambaConfig`` (and Granite 4.0-H's, the same)
    for the Mamba-2 options ``m`` (:func:`~mnemo.hf.fields.mixer_options`; ``m["head_dim"]`` is
    clipped in place as :class:`~mnemo.layers.ssm.Mamba2` clips it); ``present``: the model has a
    Mamba-2 layer (else sizes the config class accepts: one head over the channels). Refused by
    name (``fmt.refuse``): a per-channel ``D``, the norm before the gate, a norm epsilon other than
    the model's ``norm_eps``, norm groups other than the B/C groups."""
    d, eps, where = config.d_model, config.norm_eps, f"mixer_options[{MAMBA2!r}]"
    if not present:
        return {"mamba_n_heads": 1, "mamba_d_head": 2 * d, "mamba_n_groups": 1, "mamba_expand": 2}
    for key, val in dict(D_has_hdim=False, norm_before_gate=False, norm_eps=eps).items():
        fmt.require(where, m, key, val)
    if m["norm_groups"] not in (None, m["n_groups"]):
        fmt.require(where, m, "norm_groups", m["n_groups"])
    d_inner = m["expand"] * d
    m["head_dim"] = min(m["head_dim"], d_inner)  # (as Mamba2 clips it)
    lo, hi = (float(v) for v in m["dt_limit"])
    return {
        "mamba_n_heads": d_inner // m["head_dim"], "mamba_d_head": m["head_dim"],
        "mamba_n_groups": m["n_groups"], "mamba_d_state": m["d_state"], "mamba_d_conv": m["conv_size"],
        "mamba_expand": m["expand"], "mamba_chunk_size": m["chunk_size"],
        "mamba_conv_bias": bool(m["conv_bias"]), "mamba_proj_bias": bool(m["bias"]),
        "time_step_limit": [lo, hi],
    }  # fmt: skip


def export_bamba(config: ModelConfig, weights: dict[str, Tensor]) -> tuple[dict, dict[str, Tensor]]:
    """A mnemo ``(ModelConfig, state dict)`` as a ``transformers`` ``BambaForCausalLM`` ``(config
    dict, state dict)``: a stack of ``"mamba2"`` and ``"attention"`` layers with SwiGLU MLPs, the
    Mamba-2 layers with a per-head ``D``, the gate before the gated norm, its groups the B/C groups
    and its epsilon the model's ``norm_eps``; the attention layers with plain RoPE over any leading
    share of the head (``partial_rotary_factor = rotary_dim / head_dim``), no window, sinks, q/k norm
    or output gate; at least one attention layer (``transformers`` 5.25's ``BambaModel`` raises in
    its forward pass without one). Anything else raises ``ValueError`` naming the option and the
    received value."""
    config = config.validate()
    refuse_unexpressed(BAMBA.name, config)
    types = config.layer_mixers()
    for i, mixer in enumerate(types):
        if mixer not in (MAMBA2, ATTN):
            _refuse(f"layer {i} uses mixer {mixer!r}; Bamba layers are {MAMBA2!r} or {ATTN!r}")
    if ATTN not in types:
        _refuse(
            f"layers {sorted(set(types))} without an attention layer: transformers 5.25's BambaModel cannot "
            "run one (its causal mask asks the cache for attention layers and raises; an empty "
            "attn_layer_indices)"
        )
    if config.mlp != "swiglu":
        _refuse(f"mlp {config.mlp!r} is not supported (only 'swiglu', Bamba's MLP in every layer)")
    if config.pos_embedding != "none":
        _refuse(f"pos_embedding {config.pos_embedding!r} is not supported (Bamba uses RoPE only)")
    d = config.d_model
    hidden = config.mlp_hidden or swiglu_hidden(d)
    m, a = mixer_options(MAMBA2, config), mixer_options(ATTN, config)
    where_a = f"mixer_options[{ATTN!r}]"
    mamba = mamba2_fields(BAMBA, config, m, MAMBA2 in types)
    H = a["n_heads"]
    H_kv = a["n_kv_heads"] or H
    D = a["head_dim"] or d // H
    for key, val in dict(rope=True, window=None, qk_norm=False, output_gate=False, n_sink=0).items():
        BAMBA.require(where_a, a, key, val)
    if check_rope_scaling(a.get("rope_scaling")) is not None:
        _refuse(
            f"{where_a}['rope_scaling'] = {a['rope_scaling']!r}: Bamba is exported with plain RoPE only "
            "(rope_type 'default'); a scaled RoPE is refused, not approximated"
        )
    if a.get("bias") == "qkv":  # (Qwen2's biases: attention_bias biases o too)
        _refuse(
            f"{where_a}['bias'] = 'qkv' (q, k, v biased; o not) has no Bamba equivalent: "
            "attention_bias biases q, k, v and o"
        )
    R = a["rotary_dim"] if a.get("rotary_dim") is not None else D
    rope = rope_parameters(a["rope_theta"], None, partial_rotary_factor=_rotary_factor(R, D))
    hf = decoder_fields(config, ARCH, MODEL_TYPE, heads=(H, H_kv, D), hidden=hidden, rope=rope)
    hf |= mamba
    hf |= {
        "attention_bias": bool(a["bias"]),
        "mlp_bias": False,
        "attn_layer_indices": [i for i, mixer in enumerate(types) if mixer == ATTN],
    }

    w = Weights(BAMBA, weights)
    sd: dict[str, Tensor] = export_head(w, config)
    sd["model.final_layernorm.weight"] = w.pop("norm.weight", (d,))
    for i, mixer in enumerate(types):
        p, q = f"model.layers.{i}.", f"blocks.{i}."
        sd[p + "input_layernorm.weight"] = w.pop(q + "mixer_norm.weight", (d,))
        sd[p + "pre_ff_layernorm.weight"] = w.pop(q + "mlp_norm.weight", (d,))
        f = p + "feed_forward."
        sd[f + "gate_proj.weight"], sd[f + "up_proj.weight"] = w.pop(
            q + "mlp.w_in.weight", (2 * hidden, d)
        ).split(hidden, 0)
        sd[f + "down_proj.weight"] = w.pop(q + "mlp.w_out.weight", (d, hidden))
        if mixer == MAMBA2:
            sd.update(_mamba_weights(w, q + "mixer.", p + "mamba.", m, d, importing=False))
        else:
            sd.update(_attention_weights(w, q + "mixer.", p + "self_attn.", a, d, importing=False))
    w.finish()
    return hf, {k: v.contiguous() for k, v in sd.items()}
