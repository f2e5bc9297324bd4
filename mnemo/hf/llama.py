"""The dense Llama family — Llama, Qwen2 (Qwen2.5), Qwen3, Mistral — in and out of mnemo.

:func:`import_llama` / :func:`import_qwen2` / :func:`import_qwen3` / :func:`import_mistral` turn a
``transformers`` config (a dict, as in ``config.json``) and the ``…ForCausalLM`` state dict into a
:class:`~mnemo.models.ModelConfig` and a state dict that ``LanguageModel(config).load_state_dict(sd,
strict=True)`` accepts; :func:`export_llama` / :func:`export_qwen2` / :func:`export_qwen3` /
:func:`export_mistral` do the reverse. Plain dicts and tensors: nothing here imports ``transformers``.

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
``attention_bias`` biases o too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..layers.mlp import swiglu_hidden
from ..layers.rotary import RotaryEmbedding, check_rope_scaling, plain_inv_freq
from ..models.config import ModelConfig
from .fields import (
    ConfigFormat,
    Weights,
    decoder_fields,
    export_head,
    import_head,
    is_int,
    mixer_options,
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
class _Class:
    """One ``…ForCausalLM`` class: its format (name and defaults), which biases it has (``"field"``:
    ``attention_bias`` on q, k, v and o; ``"qkv"``: always on q, k, v, never on o; ``None``: none),
    whether it has q/k norms, and where its windows come from (``None``: nowhere; ``"all"``:
    ``sliding_window`` in every layer; ``"layers"``: ``layer_types`` / ``use_sliding_window`` /
    ``max_window_layers``)."""

    arch: str
    model_type: str
    fmt: ConfigFormat
    bias: str | None
    qk_norm: bool
    windows: str | None


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
    for k in ("attention_bias", "mlp_bias", "tie_word_embeddings", "use_sliding_window"):
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
    if W is not None and (not is_int(W) or W < 1):
        c.fmt.refuse(
            f"field 'sliding_window': expected a positive int (keys a query sees) or null, got {W!r}"
        )
    if c.windows == "all":  # Mistral: every layer, whatever layer_types says (MistralModel ignores it)
        expected = [SLIDING if W is not None else FULL] * n
        types = cfg.get("layer_types")
        if types is not None and types != expected:
            c.fmt.refuse(
                f"field 'layer_types' = {types!r}: {c.arch} ignores it in its forward pass (every layer is "
                f"{expected[0]!r} with sliding_window = {W!r}) while its cache reads it; expected no such "
                "field (or one that agrees)"
            )
        return W
    if not c.fmt.get(cfg, "use_sliding_window"):  # the config class sets sliding_window = None
        W = None
    types = cfg.get("layer_types")
    if types is None:
        mwl = _count(c, cfg, "max_window_layers", 0)
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
    bias = c.bias == "qkv" or (c.bias == "field" and bool(fmt.get(cfg, "attention_bias")))
    opts: dict[str, Any] = dict(
        n_heads=H, n_kv_heads=H_kv, head_dim=D, rope=True, rope_theta=theta, window=window,
        qk_norm=c.qk_norm, output_gate=False, bias="qkv" if c.bias == "qkv" else bias, norm_eps=eps,
    )  # fmt: skip
    if scaling is not None:
        opts["rope_scaling"] = scaling
    config = ModelConfig(
        vocab_size=_count(c, cfg, "vocab_size", 1),
        d_model=d,
        n_layers=n,
        mixer=ATTN,
        mixer_options={ATTN: opts},
        mlp="swiglu",
        mlp_hidden=hidden,
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
        gate, up = (
            w.pop(p + "mlp.gate_proj.weight", (hidden, d)),
            w.pop(p + "mlp.up_proj.weight", (hidden, d)),
        )
        sd[q + "mlp.w_in.weight"] = torch.cat([gate, up], 0)
        sd[q + "mlp.w_out.weight"] = w.pop(p + "mlp.down_proj.weight", (d, hidden))
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
    for i, m in enumerate(config.layer_mixers()):
        if m != ATTN:
            fmt.refuse(f"layer {i} uses mixer {m!r}; {c.arch} layers are {ATTN!r}")
    if config.mlp != "swiglu":
        fmt.refuse(f"mlp {config.mlp!r} is not supported (only 'swiglu', {c.arch}'s MLP)")
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
    rope = rope_parameters(a["rope_theta"], scaling)
    hf = decoder_fields(config, c.arch, c.model_type, heads=(H, H_kv, D), hidden=hidden, rope=rope)
    if c.bias == "field":
        hf["attention_bias"] = bool(bias)
    if c.model_type == "llama":
        hf["mlp_bias"] = False
    if c.windows == "all":
        hf["sliding_window"] = W
    elif c.windows == "layers":
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
        sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"] = w.pop(
            q + "mlp.w_in.weight", (2 * hidden, d)
        ).split(hidden, 0)
        sd[p + "mlp.down_proj.weight"] = w.pop(q + "mlp.w_out.weight", (d, hidden))
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
