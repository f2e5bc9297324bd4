"""Mamba and Mamba-2 checkpoints: ``transformers``' ``MambaForCausalLM`` / ``Mamba2ForCausalLM``
and ``FalconMambaForCausalLM`` (import and export; FalconMamba is Mamba-1 with the RMS
normalisation of dt, B and C, mnemo's ``bcdt_rms_eps``) and the original ``mamba-ssm`` layout
(import), as registered formats of :mod:`mnemo.hf.convert` (which documents the formats, the
refusals and the weight files), plus the conversion of their decoding caches (``transformers``
keeps the last ``W`` convolution inputs, mnemo ``W − 1``; Mamba-2's ssm state is ``[B, H, P, N]``
there, ``[B, H, N, P]`` here).

Every import refuses, by name, an option it cannot reproduce exactly; every export refuses a mnemo
config the target class cannot express (:func:`_refuse`).
"""

from __future__ import annotations

import inspect
import math
import re
import warnings
from typing import Any

import torch
from torch import Tensor

from ..layers import MIXERS
from ..layers.ssm import Mamba2State, MambaState
from ..layers.state import BlockState
from ..models.config import ModelConfig
from .fields import refuse_unexpressed

# --- key renaming -------------------------------------------------------------------------------


def _rename(weights: dict[str, Tensor], table: list[tuple[str, str]], where: str) -> dict[str, Tensor]:
    """Rename every key by the first matching ``(pattern, replacement)`` of ``table`` (full
    matches; ``{i}`` stands for a layer index). Unmatched keys are refused by name."""
    compiled = [(re.compile(p.replace(".", r"\.").replace("{i}", r"(?P<i>\d+)") + "$"), r) for p, r in table]
    out, unknown = {}, []
    for k, v in weights.items():
        for pat, rep in compiled:
            m = pat.match(k)
            if m:
                out[rep.replace("{i}", m.group("i")) if "{i}" in rep else rep] = v
                break
        else:
            unknown.append(k)
    if unknown:
        raise ValueError(
            f"{where}: unsupported weights {sorted(unknown)[:8]} (not part of a model it can express)"
        )
    return out


def _invert(table: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(r, p) for p, r in table]


_COMMON = [
    ("backbone.embeddings.weight", "embed.weight"),
    ("backbone.norm_f.weight", "norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
    ("backbone.layers.{i}.norm.weight", "blocks.{i}.mixer_norm.weight"),
    ("backbone.layers.{i}.mixer.in_proj.weight", "blocks.{i}.mixer.in_proj.weight"),
    ("backbone.layers.{i}.mixer.in_proj.bias", "blocks.{i}.mixer.in_proj.bias"),
    ("backbone.layers.{i}.mixer.conv1d.weight", "blocks.{i}.mixer.conv.weight"),
    ("backbone.layers.{i}.mixer.conv1d.bias", "blocks.{i}.mixer.conv.bias"),
    ("backbone.layers.{i}.mixer.A_log", "blocks.{i}.mixer.A_log"),
    ("backbone.layers.{i}.mixer.D", "blocks.{i}.mixer.D"),
    ("backbone.layers.{i}.mixer.out_proj.weight", "blocks.{i}.mixer.o_proj.weight"),
    ("backbone.layers.{i}.mixer.out_proj.bias", "blocks.{i}.mixer.o_proj.bias"),
]
MAMBA_KEYS = _COMMON + [
    ("backbone.layers.{i}.mixer.x_proj.weight", "blocks.{i}.mixer.x_proj.weight"),
    ("backbone.layers.{i}.mixer.dt_proj.weight", "blocks.{i}.mixer.dt_proj.weight"),
    ("backbone.layers.{i}.mixer.dt_proj.bias", "blocks.{i}.mixer.dt_proj.bias"),
]
MAMBA2_KEYS = _COMMON + [
    ("backbone.layers.{i}.mixer.dt_bias", "blocks.{i}.mixer.dt_bias"),
    ("backbone.layers.{i}.mixer.norm.weight", "blocks.{i}.mixer.norm.weight"),
]


def _import_weights(
    weights: dict[str, Tensor], table, tie: bool, where: str, tie_field: str = "tie_word_embeddings"
) -> dict[str, Tensor]:
    """The weights under mnemo's names. With ``tie`` (the config's ``tie_field``) a ``lm_head.weight``
    in the file must equal the embedding: one that differs is refused (``transformers`` keeps such a
    head apart from the embedding, so a tied model would compute other logits)."""
    w = dict(weights)
    if "backbone.embedding.weight" in w:  # the name in mamba-ssm and older transformers files
        w["backbone.embeddings.weight"] = w.pop("backbone.embedding.weight")
    if tie and "lm_head.weight" in w:
        head, emb = w.pop("lm_head.weight"), w.get("backbone.embeddings.weight")
        if emb is not None and (head.shape != emb.shape or not torch.equal(head, emb)):
            raise ValueError(
                f"{where}: {tie_field} is true but lm_head.weight differs from the embedding "
                f"(backbone.embeddings.weight): the head is not tied; set {tie_field} to false in "
                "config.json to convert the model with its own head"
            )
    state = _rename(w, table, where)
    if "embed.weight" not in state:
        raise ValueError(f"{where}: no embedding weight (backbone.embeddings.weight)")
    if tie:
        state["lm_head.weight"] = state["embed.weight"]
    return state


def _export_weights(weights: dict[str, Tensor], table, tie: bool, where: str) -> dict[str, Tensor]:
    w = dict(weights)
    if tie:
        w.pop("lm_head.weight", None)
    return _rename(w, _invert(table), where)


# --- options ------------------------------------------------------------------------------------


def _refuse(where: str, what: str) -> None:
    raise ValueError(f"{where}: {what} is not supported (no exact mnemo equivalent)")


def _defaults(mixer: str) -> dict[str, Any]:
    sig = inspect.signature(MIXERS[mixer].__init__)
    return {k: p.default for k, p in sig.parameters.items() if p.default is not inspect.Parameter.empty}


def _d_inner_expand(where: str, hidden: int, expand, field: str = "expand") -> int:
    """``expand`` (the config's ``field``) as an int: ``ValueError`` naming the field for a value
    that is not a positive number, or whose ``expand · hidden`` is not a multiple of ``hidden``."""
    if isinstance(expand, bool) or not isinstance(expand, (int, float)) or not 0 < expand < math.inf:
        raise ValueError(f"{where}: field {field!r}: expected a positive int, got {expand!r}")
    d_inner = expand * hidden
    if d_inner != int(d_inner) or int(d_inner) % hidden:
        _refuse(
            where, f"{field} = {expand} (d_inner = expand · hidden_size must be a multiple of hidden_size)"
        )
    return int(d_inner) // hidden


def _check_act(where: str, act) -> None:
    if act not in ("silu", "swish"):
        _refuse(where, f"hidden_act = {act!r} (Mamba layers use SiLU)")


def _vocab(where: str, weights: dict[str, Tensor], declared=None, pad_multiple: int = 1) -> int:
    """The vocabulary: the embedding's row count. A config ``vocab_size`` (``declared``) above it
    is refused (its ids would index past the embedding); one below it is accepted as padding when
    the rows are ``declared`` rounded up to ``pad_multiple`` (mamba-ssm's
    ``pad_vocab_size_multiple``), and otherwise said in a warning: the rows above it are kept."""
    for k in ("backbone.embeddings.weight", "backbone.embedding.weight"):
        if k in weights:
            rows = int(weights[k].shape[0])
            break
    else:
        raise ValueError(f"{where}: no embedding weight (backbone.embeddings.weight)")
    if declared is None:
        return rows
    if isinstance(declared, bool) or not isinstance(declared, int) or declared < 1:
        raise ValueError(f"{where}: vocab_size: expected a positive int, got {declared!r}")
    if declared > rows:
        raise ValueError(
            f"{where}: vocab_size = {declared} but the embedding has only {rows} rows "
            "(the config and the weights disagree)"
        )
    padded = -(-declared // max(1, pad_multiple)) * max(1, pad_multiple)
    if declared < rows and padded != rows:
        warnings.warn(
            f"{where}: vocab_size = {declared} but the embedding has {rows} rows; the model keeps all "
            f"{rows} (ids {declared}..{rows - 1} have weights but lie past the declared vocabulary)",
            stacklevel=3,
        )
    return rows


def _mamba_options(
    where, hidden, state_size, expand, conv, rank, bias, conv_bias, *, expand_field: str = "expand"
) -> dict[str, Any]:
    if rank in (None, "auto"):
        rank = math.ceil(hidden / 16)
    return {
        "d_state": int(state_size),
        "expand": _d_inner_expand(where, hidden, expand, expand_field),
        "conv_size": int(conv),
        "dt_rank": int(rank),
        "bias": bool(bias),
        "conv_bias": bool(conv_bias),
    }


def _mamba2_options(
    where,
    hidden,
    state_size,
    expand,
    head_dim,
    n_groups,
    conv,
    bias,
    conv_bias,
    dt_limit,
    eps,
    n_heads=None,
    *,
    expand_field: str = "expand",
    limit_field: str = "time_step_limit",
) -> dict[str, Any]:
    e = _d_inner_expand(where, hidden, expand, expand_field)
    d_inner = e * hidden
    if d_inner % head_dim or (n_heads is not None and n_heads * head_dim != d_inner):
        _refuse(where, f"num_heads · head_dim = {n_heads} · {head_dim} ≠ expand · hidden_size = {d_inner}")
    if (d_inner // head_dim) % n_groups:
        _refuse(where, f"n_groups = {n_groups} not dividing the {d_inner // head_dim} heads")
    opts = {
        "d_state": int(state_size),
        "head_dim": int(head_dim),
        "expand": e,
        "n_groups": int(n_groups),
        "conv_size": int(conv),
        "bias": bool(bias),
        "conv_bias": bool(conv_bias),
        "norm_eps": float(eps),
    }
    lo, hi = _dt_limit(where, limit_field, dt_limit)
    if (lo, hi) != (0.0, math.inf):
        opts["dt_limit"] = [lo, hi]
    return opts


#: how ``transformers`` 5 writes a non-finite float in a ``config.json`` (JSON has no ``Infinity``)
_FLOAT_TAGS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def _number(v) -> float:
    """A float of a config (``transformers`` 5 writes ``inf`` as ``{"__float__": "Infinity"}``);
    ``ValueError`` (no field named: the caller names it) for anything but a number."""
    if isinstance(v, dict) and set(v) == {"__float__"} and v["__float__"] in _FLOAT_TAGS:
        return _FLOAT_TAGS[v["__float__"]]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"expected a number, got {v!r}")
    return float(v)


def _dt_limit(where: str, field: str, value) -> tuple[float, float]:
    """``time_step_limit`` / ``ssm_cfg.dt_limit``: ``[min, max]``, two numbers (``inf`` as
    ``transformers`` writes it) with ``min <= max``; ``None`` means ``(0, inf)``. Raises
    ``ValueError`` naming ``field`` and the received value for anything else."""
    if value is None:
        return 0.0, math.inf
    expected = f"{where}: field {field!r}: expected [min, max], two numbers with min <= max, got {value!r}"
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ValueError(expected)
    try:
        lo, hi = (_number(v) for v in value)
    except ValueError:
        raise ValueError(expected) from None
    if not lo <= hi:  # NaN included
        raise ValueError(expected)
    return lo, hi


def json_float(v: float):
    """``v`` as ``transformers`` 5 writes a float in a ``config.json``: ``inf``, ``-inf`` and
    ``nan`` as ``{"__float__": "Infinity" | "-Infinity" | "NaN"}`` (what :func:`_number` reads
    back), every other value as it is."""
    if isinstance(v, float) and not math.isfinite(v):
        return {"__float__": "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")}
    return v


def _model_config(vocab, hidden, n_layers, mixer, options, tie, eps) -> ModelConfig:
    return ModelConfig(
        vocab_size=int(vocab),
        d_model=int(hidden),
        n_layers=int(n_layers),
        mixer=mixer,
        mixer_options={mixer: options},
        mlp="none",
        pos_embedding="none",
        tie_embeddings=bool(tie),
        norm_eps=float(eps),
    ).validate()


# --- which config fields decide a weight's shape ---------------------------------------------------

#: per mixer: the config fields (``transformers``' names) that decide the shape of each weight, by
#: the weight's mnemo name without its ``blocks.N.`` prefix (the longest matching prefix counts)
SHAPE_FIELDS: dict[str, dict[str, tuple[str, ...]]] = {
    "mamba": {
        "embed.weight": ("vocab_size", "hidden_size"),
        "lm_head.weight": ("vocab_size", "hidden_size"),
        "norm.weight": ("hidden_size",),
        "mixer_norm.weight": ("hidden_size",),
        "mixer.in_proj": ("hidden_size", "expand", "intermediate_size"),
        "mixer.conv": ("hidden_size", "expand", "intermediate_size", "conv_kernel"),
        "mixer.x_proj": ("hidden_size", "expand", "intermediate_size", "time_step_rank", "state_size"),
        "mixer.dt_proj.weight": ("hidden_size", "expand", "intermediate_size", "time_step_rank"),
        "mixer.dt_proj.bias": ("hidden_size", "expand", "intermediate_size"),
        "mixer.A_log": ("hidden_size", "expand", "intermediate_size", "state_size"),
        "mixer.D": ("hidden_size", "expand", "intermediate_size"),
        "mixer.o_proj": ("hidden_size", "expand", "intermediate_size"),
    },
    "mamba2": {
        "embed.weight": ("vocab_size", "hidden_size"),
        "lm_head.weight": ("vocab_size", "hidden_size"),
        "norm.weight": ("hidden_size",),
        "mixer_norm.weight": ("hidden_size",),
        "mixer.in_proj": ("hidden_size", "expand", "n_groups", "state_size", "num_heads", "head_dim"),
        "mixer.conv": ("hidden_size", "expand", "n_groups", "state_size", "conv_kernel"),
        "mixer.A_log": ("num_heads", "head_dim", "hidden_size", "expand"),
        "mixer.D": ("num_heads", "head_dim", "hidden_size", "expand"),
        "mixer.dt_bias": ("num_heads", "head_dim", "hidden_size", "expand"),
        "mixer.norm.weight": ("hidden_size", "expand"),
        "mixer.o_proj": ("hidden_size", "expand"),
    },
}
#: the same fields under the original mamba-ssm layout's names
_SSM_FIELD_NAMES = {
    "hidden_size": "d_model",
    "expand": "ssm_cfg.expand",
    "conv_kernel": "ssm_cfg.d_conv",
    "time_step_rank": "ssm_cfg.dt_rank",
    "state_size": "ssm_cfg.d_state",
    "n_groups": "ssm_cfg.ngroups",
    "head_dim": "ssm_cfg.headdim",
    "num_heads": None,  # not a field there: expand · d_model / headdim
}


def _shown(fields: dict, defaults: dict, names=None) -> dict[str, str]:
    """``{name: "value"}`` of the config fields, ``"value (default)"`` for one the config leaves out
    (``names``: the fields' names in the config, when not ``transformers``')."""
    out = {}
    for k, default in defaults.items():
        name = (names or {}).get(k, k)
        if name is None:
            continue
        out[name] = f"{fields[k]!r}" if k in fields else f"{default!r} (default)"
    return out


def _foreign_name(key: str, table: list[tuple[str, str]]) -> str:
    """The file's name of the mnemo weight ``key`` (``table``: ``(theirs, ours)`` pairs)."""
    for theirs, ours in table:
        m = re.fullmatch(ours.replace(".", r"\.").replace("{i}", r"(?P<i>\d+)"), key)
        if m:
            return theirs.replace("{i}", m.group("i")) if "{i}" in theirs else theirs
    return key


def _check_shapes(
    where: str,
    config: ModelConfig,
    state: dict[str, Tensor],
    table: list[tuple[str, str]],
    shown: dict[str, str],
    names: dict[str, str | None] | None = None,
) -> None:
    """Refuse a weight whose shape is not the one ``config`` gives, naming the weight (its file
    name) and the config fields that decide its shape with their values (``shown``)."""
    from ..models.lm import LanguageModel

    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in LanguageModel(config).state_dict().items()}
    fields_of = SHAPE_FIELDS[config.mixer]
    for k, t in state.items():
        want = expected.get(k)
        if want is None or tuple(t.shape) == want:
            continue  # an unexpected key is left to the caller's check
        local = re.sub(r"^blocks\.\d+\.", "", k)
        best = max((p for p in fields_of if local.startswith(p)), key=len, default=None)
        fields = [(names or {}).get(f, f) for f in (fields_of[best] if best else ())]
        said = ", ".join(f"{f} = {shown[f]}" for f in fields if f is not None and f in shown)
        raise ValueError(
            f"{where}: weight {_foreign_name(k, table)} has shape {list(t.shape)}, but the config"
            + (f" ({said})" if said else "")
            + f" gives {list(want)}: the config and the weights disagree"
        )


# --- transformers MambaForCausalLM / Mamba2ForCausalLM ------------------------------------------


def import_mamba(hf_config: dict, weights: dict[str, Tensor]) -> tuple[ModelConfig, dict[str, Tensor]]:
    """``transformers`` ``MambaForCausalLM`` → mnemo layers ``mamba`` (no MLP, tied head by
    ``tie_word_embeddings``, default true; the inner width is ``intermediate_size`` where the config
    gives it, as ``MambaMixer`` is built, else ``expand · hidden_size``)."""
    return _import_mamba1("MambaForCausalLM", hf_config, weights, {})


#: ``FalconMambaConfig``'s ``mixer_rms_eps`` (``transformers`` 5.25) where a config leaves it out
FALCON_MAMBA_RMS_EPS = 1e-6


def import_falcon_mamba(hf_config: dict, weights: dict[str, Tensor]) -> tuple[ModelConfig, dict[str, Tensor]]:
    """``transformers`` ``FalconMambaForCausalLM`` → mnemo layers ``mamba`` with ``bcdt_rms_eps =
    mixer_rms_eps`` (default ``1e-6``).

    FalconMamba is Mamba-1 with one change of function: inside each mixer the Δ input (the
    ``time_step_rank`` channels of ``x_proj``, before ``dt_proj``), ``B`` and ``C`` are each divided
    by their root mean square (no weight; ``FalconMambaMixer``'s ``dt_layernorm``, ``b_layernorm``,
    ``c_layernorm``), which is :class:`~mnemo.layers.ssm.Mamba`'s ``bcdt_rms_eps``. Everything else
    (weights under the same names, the block and final RMSNorms with ``layer_norm_epsilon``, the
    conv, the scan, the ``D`` skip, the ``silu(z)`` gate, the tied head by default) is Mamba's and is
    read as :func:`import_mamba` reads it. The norms' ``weight`` buffers (ones, not saved, unused by
    the function) have no counterpart. ``residual_in_fp32`` is carried as for Mamba."""
    where = "FalconMambaForCausalLM"
    eps = hf_config.get("mixer_rms_eps", FALCON_MAMBA_RMS_EPS)
    if eps is None:
        eps = FALCON_MAMBA_RMS_EPS
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < math.inf:
        raise ValueError(f"{where}: field 'mixer_rms_eps': expected a finite number >= 0, got {eps!r}")
    return _import_mamba1(where, hf_config, weights, {"bcdt_rms_eps": float(eps)})


def _import_mamba1(
    where: str, hf_config: dict, weights: dict[str, Tensor], extra: dict[str, Any]
) -> tuple[ModelConfig, dict[str, Tensor]]:
    """The Mamba-1 classes of ``transformers`` (``where``: the class's name) → mnemo ``mamba``
    layers, with the mixer options ``extra`` on top of Mamba's."""
    c = hf_config
    _check_act(where, c.get("hidden_act", "silu"))
    hidden = int(c["hidden_size"])
    expand, expand_field = c.get("expand", 2), "expand"
    inner = c.get("intermediate_size")
    if inner is not None:  # transformers' MambaMixer is built from it (expand only sets its default)
        if isinstance(expand, bool) or not isinstance(expand, (int, float)) or not 0 < expand < math.inf:
            raise ValueError(f"{where}: field 'expand': expected a positive int, got {expand!r}")
        if isinstance(inner, bool) or not isinstance(inner, int) or inner < 1 or inner % hidden:
            raise ValueError(
                f"{where}: field 'intermediate_size': expected a positive multiple of hidden_size = {hidden} "
                f"(mnemo's d_inner is expand · d_model, expand an int), got {inner!r}"
            )
        expand, expand_field = inner // hidden, "intermediate_size"
    opts = _mamba_options(
        where,
        hidden,
        c.get("state_size", 16),
        expand,
        c.get("conv_kernel", 4),
        c.get("time_step_rank", "auto"),
        c.get("use_bias", False),
        c.get("use_conv_bias", True),
        expand_field=expand_field,
    )
    opts |= extra
    tie = c.get("tie_word_embeddings", True)
    vocab = _vocab(where, weights, c.get("vocab_size"))
    config = _model_config(
        vocab, hidden, c["num_hidden_layers"], "mamba", opts, tie, c.get("layer_norm_epsilon", 1e-5)
    )
    state = _import_weights(weights, MAMBA_KEYS, tie, where)
    defaults = dict(vocab_size=vocab, hidden_size=None, expand=2, conv_kernel=4, time_step_rank="auto")
    defaults["state_size"] = 16
    shown = _shown(c, defaults)
    if expand_field == "intermediate_size" and inner != c.get("expand", 2) * hidden:
        shown["intermediate_size"] = repr(inner)  # (named in a shape error where it, not expand, decides)
    _check_shapes(where, config, state, MAMBA_KEYS, shown)
    return config, state


def import_mamba2(hf_config: dict, weights: dict[str, Tensor]) -> tuple[ModelConfig, dict[str, Tensor]]:
    """``transformers`` ``Mamba2ForCausalLM`` → mnemo layers ``mamba2``. Its ``time_step_limit``
    becomes ``dt_limit`` (mnemo clamps Δ in token steps too; transformers' one-token path does
    not, so decoding with a limit that binds differs there)."""
    where, c = "Mamba2ForCausalLM", hf_config
    _check_act(where, c.get("hidden_act", "silu"))
    hidden = int(c["hidden_size"])
    eps = c.get("layer_norm_epsilon", 1e-5)
    opts = _mamba2_options(
        where,
        hidden,
        c.get("state_size", 128),
        c.get("expand", 2),
        int(c.get("head_dim", 64)),
        int(c.get("n_groups", 8)),
        c.get("conv_kernel", 4),
        c.get("use_bias", False),
        c.get("use_conv_bias", True),
        c.get("time_step_limit"),
        eps,
        n_heads=int(c["num_heads"]) if "num_heads" in c else None,
    )
    tie = c.get("tie_word_embeddings", False)
    vocab = _vocab(where, weights, c.get("vocab_size"))
    config = _model_config(vocab, hidden, c["num_hidden_layers"], "mamba2", opts, tie, eps)
    state = _import_weights(weights, MAMBA2_KEYS, tie, where)
    defaults = dict(vocab_size=vocab, hidden_size=None, expand=2, n_groups=8, state_size=128)
    defaults |= dict(num_heads=opts["expand"] * hidden // opts["head_dim"], head_dim=64, conv_kernel=4)
    _check_shapes(where, config, state, MAMBA2_KEYS, _shown(c, defaults))
    return config, state


def _single_mixer(config: ModelConfig, name: str, where: str) -> dict[str, Any]:
    """The options of ``name`` (defaults filled in) after checking that ``config`` is a plain stack
    of ``name`` layers that ``where`` can express."""
    refuse_unexpressed(where.removeprefix("export to "), config)
    mixers = sorted(set(config.layer_mixers()))
    if mixers != [name]:
        _refuse(where, f"layers {mixers} (only {name!r} layers)")
    if config.mlp != "none":
        _refuse(where, f"mlp = {config.mlp!r} (Mamba blocks have no MLP; use mlp = 'none')")
    if config.pos_embedding != "none":
        _refuse(where, f"pos_embedding = {config.pos_embedding!r} (no learned positions)")
    opts = {**_defaults(name), **config.mixer_options.get(name, {})}
    if opts.get("bcdt_norm"):
        _refuse(
            where,
            "mixer_options['mamba']['bcdt_norm'] = True (RMSNorms with weights on dt, B and C are "
            "Jamba's: JambaForCausalLM expresses them)",
        )
    return opts


def export_mamba(config: ModelConfig, weights: dict[str, Tensor]) -> tuple[dict, dict[str, Tensor]]:
    """mnemo ``mamba`` layers → ``transformers`` ``MambaForCausalLM`` (without ``bcdt_rms_eps``:
    that model is FalconMamba's, :func:`export_falcon_mamba`)."""
    where = "export to MambaForCausalLM"
    o = _single_mixer(config, "mamba", where)
    if o["bcdt_rms_eps"] is not None:
        _refuse(
            where,
            f"bcdt_rms_eps = {o['bcdt_rms_eps']} (the RMS normalisation of dt, B and C is FalconMamba's: "
            "FalconMambaForCausalLM expresses it)",
        )
    return _export_mamba1(config, weights, o, where, "mamba")


def export_falcon_mamba(config: ModelConfig, weights: dict[str, Tensor]) -> tuple[dict, dict[str, Tensor]]:
    """mnemo ``mamba`` layers with ``bcdt_rms_eps`` set → ``transformers``
    ``FalconMambaForCausalLM`` (``mixer_rms_eps = bcdt_rms_eps``); a Mamba without it is refused
    (``MambaForCausalLM`` expresses it)."""
    where = "export to FalconMambaForCausalLM"
    o = _single_mixer(config, "mamba", where)
    if o["bcdt_rms_eps"] is None:
        _refuse(
            where,
            "bcdt_rms_eps = None (FalconMamba normalises dt, B and C in every layer; MambaForCausalLM "
            "expresses a Mamba without it)",
        )
    hf, sd = _export_mamba1(config, weights, o, where, "falcon_mamba")
    hf["mixer_rms_eps"] = float(o["bcdt_rms_eps"])
    return hf, sd


def _export_mamba1(
    config: ModelConfig, weights: dict[str, Tensor], o: dict[str, Any], where: str, model_type: str
) -> tuple[dict, dict[str, Tensor]]:
    """The ``config.json`` fields and weights that Mamba and FalconMamba share (``o``: the mixer's
    options; ``model_type``: ``"mamba"`` or ``"falcon_mamba"``)."""
    if not o["selective"]:
        _refuse(where, "selective = False (a non-selective, LTI Mamba)")
    d = config.d_model
    hf = {
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": d,
        "num_hidden_layers": config.n_layers,
        "state_size": o["d_state"],
        "expand": o["expand"],
        "intermediate_size": o["expand"] * d,
        "conv_kernel": o["conv_size"],
        "time_step_rank": o["dt_rank"] or math.ceil(d / 16),
        "use_bias": bool(o["bias"]),
        "use_conv_bias": bool(o["conv_bias"]),
        "hidden_act": "silu",
        "layer_norm_epsilon": config.norm_eps,
        "residual_in_fp32": True,
        "tie_word_embeddings": config.tie_embeddings,
    }
    return hf, _export_weights(weights, MAMBA_KEYS, config.tie_embeddings, where)


def export_mamba2(config: ModelConfig, weights: dict[str, Tensor]) -> tuple[dict, dict[str, Tensor]]:
    """mnemo ``mamba2`` layers → ``transformers`` ``Mamba2ForCausalLM`` (which has one epsilon for
    every norm, per-head ``D`` and the gate before the norm)."""
    where = "export to Mamba2ForCausalLM"
    o = _single_mixer(config, "mamba2", where)
    if o["D_has_hdim"]:
        _refuse(where, "D_has_hdim = True (per-channel D)")
    if o["norm_before_gate"]:
        _refuse(where, "norm_before_gate = True")
    if o["norm_groups"] not in (None, o["n_groups"]):
        _refuse(where, f"norm_groups = {o['norm_groups']} ≠ n_groups = {o['n_groups']}")
    if float(o["norm_eps"]) != float(config.norm_eps):
        _refuse(where, f"a gated-norm norm_eps = {o['norm_eps']} ≠ the model's norm_eps = {config.norm_eps}")
    d = config.d_model
    d_inner = o["expand"] * d
    head_dim = min(o["head_dim"], d_inner)
    lo, hi = (float(v) for v in o["dt_limit"])
    hf = {
        "model_type": "mamba2",
        "vocab_size": config.vocab_size,
        "hidden_size": d,
        "num_hidden_layers": config.n_layers,
        "state_size": o["d_state"],
        "expand": o["expand"],
        "head_dim": head_dim,
        "num_heads": d_inner // head_dim,
        "n_groups": o["n_groups"],
        "conv_kernel": o["conv_size"],
        "use_bias": bool(o["bias"]),
        "use_conv_bias": bool(o["conv_bias"]),
        "hidden_act": "silu",
        "layer_norm_epsilon": config.norm_eps,
        "time_step_limit": [lo, hi],
        "residual_in_fp32": True,
        "chunk_size": o["chunk_size"],
        "tie_word_embeddings": config.tie_embeddings,
    }
    return hf, _export_weights(weights, MAMBA2_KEYS, config.tie_embeddings, where)


# --- the original mamba-ssm layout ----------------------------------------------------------------

#: ``ssm_cfg`` keys that only set the initialisation or the kernels (no effect on a trained model)
_SSM_INIT_ONLY = {
    "dt_min",
    "dt_max",
    "dt_init",
    "dt_scale",
    "dt_init_floor",
    "conv_init",
    "A_init_range",
    "use_fast_path",
    "use_mem_eff_path",
    "chunk_size",
    "layer_idx",
    "layer",
    "process_group",
    "sequence_parallel",
    "device",
    "dtype",
}
_SSM1_KEYS = {"d_state", "d_conv", "expand", "dt_rank", "bias", "conv_bias"}
_SSM2_KEYS = {
    "d_state",
    "d_conv",
    "expand",
    "headdim",
    "d_ssm",
    "ngroups",
    "D_has_hdim",
    "rmsnorm",
    "norm_before_gate",
    "dt_limit",
    "bias",
    "conv_bias",
}
#: mamba-ssm's MixerModel norm epsilon (not stored in its config) and RMSNormGated's
MAMBA_SSM_EPS = 1e-5


#: the mamba-ssm layout's fields that are sizes (top level, then ``ssm_cfg``) and true/false
_SSM_TOP_INTS = ("d_model", "n_layer", "vocab_size", "pad_vocab_size_multiple")
_SSM_TOP_BOOLS = ("tie_embeddings", "residual_in_fp32", "fused_add_norm")
_SSM_INTS = ("d_state", "d_conv", "headdim", "ngroups", "d_ssm")
_SSM_BOOLS = ("bias", "conv_bias", "D_has_hdim", "rmsnorm", "norm_before_gate")


def _check_ssm_fields(where: str, cfg: dict, ssm: dict) -> None:
    """The mamba-ssm layout's fields of the right kind (``transformers``' names are checked by
    :func:`mnemo.hf.convert._check_fields`): ``ValueError`` naming the field and the received value
    for a size that is not a positive int, or a true/false field that is not a JSON boolean (a
    string ``"false"`` would read as true)."""
    for fields, names, prefix in ((cfg, _SSM_TOP_INTS, ""), (ssm, _SSM_INTS, "ssm_cfg.")):
        for k in names:
            v = fields.get(k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{where}: field '{prefix}{k}': expected a positive int, got {v!r}")
    for fields, names, prefix in ((cfg, _SSM_TOP_BOOLS, ""), (ssm, _SSM_BOOLS, "ssm_cfg.")):
        for k in names:
            v = fields.get(k)
            if v is not None and not isinstance(v, bool):
                raise ValueError(f"{where}: field '{prefix}{k}': expected true or false, got {v!r}")
    rank = ssm.get("dt_rank")
    if rank not in (None, "auto") and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
        raise ValueError(
            f"{where}: field 'ssm_cfg.dt_rank': expected a positive int or \"auto\", got {rank!r}"
        )


def _is_mamba_ssm(cfg: dict) -> bool:
    return "n_layer" in cfg and "d_model" in cfg


def import_mamba_ssm(cfg: dict, weights: dict[str, Tensor]) -> tuple[ModelConfig, dict[str, Tensor]]:
    """The original ``mamba-ssm`` ``MambaLMHeadModel`` layout (``ssm_cfg.layer`` ``"Mamba1"`` or
    ``"Mamba2"``) → mnemo ``mamba`` / ``mamba2`` layers."""
    where = "mamba-ssm checkpoint"
    if cfg.get("d_intermediate", 0):
        _refuse(where, f"d_intermediate = {cfg['d_intermediate']} (an MLP after each mixer)")
    if cfg.get("attn_layer_idx"):
        _refuse(where, f"attn_layer_idx = {cfg['attn_layer_idx']} (attention layers)")
    if not cfg.get("rms_norm", True):
        _refuse(where, "rms_norm = false (LayerNorm blocks)")
    ssm = cfg.get("ssm_cfg") or {}
    if not isinstance(ssm, dict):
        raise ValueError(f"{where}: field 'ssm_cfg': expected an object of Mamba options, got {ssm!r}")
    ssm = dict(ssm)
    _check_ssm_fields(where, cfg, ssm)
    layer = ssm.get("layer", "Mamba1")
    if layer not in ("Mamba1", "Mamba2"):
        _refuse(where, f"ssm_cfg.layer = {layer!r} (supported: 'Mamba1', 'Mamba2')")
    allowed = (_SSM1_KEYS if layer == "Mamba1" else _SSM2_KEYS) | _SSM_INIT_ONLY
    unknown = sorted(set(ssm) - allowed)
    if unknown:
        _refuse(where, f"ssm_cfg option(s) {unknown} of a {layer} layer")
    hidden = int(cfg["d_model"])
    tie = cfg.get("tie_embeddings", True)
    vocab = _vocab(where, weights, cfg.get("vocab_size"), int(cfg.get("pad_vocab_size_multiple", 1) or 1))
    if layer == "Mamba1":
        opts = _mamba_options(
            where,
            hidden,
            ssm.get("d_state", 16),
            ssm.get("expand", 2),
            ssm.get("d_conv", 4),
            ssm.get("dt_rank", "auto"),
            ssm.get("bias", False),
            ssm.get("conv_bias", True),
            expand_field="ssm_cfg.expand",
        )
        mixer, table = "mamba", MAMBA_KEYS
        defaults = dict(expand=2, conv_kernel=4, time_step_rank="auto", state_size=16)
    else:
        if not ssm.get("rmsnorm", True):
            _refuse(where, "ssm_cfg.rmsnorm = false (a Mamba2 layer without its gated norm)")
        e = _d_inner_expand(where, hidden, ssm.get("expand", 2), "ssm_cfg.expand")
        if ssm.get("d_ssm") not in (None, e * hidden):
            _refuse(where, f"ssm_cfg.d_ssm = {ssm['d_ssm']} (a gated MLP beside the SSM)")
        opts = _mamba2_options(
            where,
            hidden,
            ssm.get("d_state", 128),
            ssm.get("expand", 2),
            int(ssm.get("headdim", 64)),
            int(ssm.get("ngroups", 1)),
            ssm.get("d_conv", 4),
            ssm.get("bias", False),
            ssm.get("conv_bias", True),
            ssm.get("dt_limit"),
            MAMBA_SSM_EPS,
            expand_field="ssm_cfg.expand",
            limit_field="ssm_cfg.dt_limit",
        )
        if ssm.get("D_has_hdim"):
            opts["D_has_hdim"] = True
        if ssm.get("norm_before_gate"):
            opts["norm_before_gate"] = True
        mixer, table = "mamba2", MAMBA2_KEYS
        defaults = dict(expand=2, conv_kernel=4, state_size=128, n_groups=1, head_dim=64)
    config = _model_config(vocab, hidden, cfg["n_layer"], mixer, opts, tie, MAMBA_SSM_EPS)
    state = _import_weights(weights, table, tie, where, "tie_embeddings")
    # the fields under this layout's names (d_model, ssm_cfg.d_state, ...)
    given = {"hidden_size": hidden, "vocab_size": vocab}
    for k, name in _SSM_FIELD_NAMES.items():
        if name is not None and name.startswith("ssm_cfg.") and name.removeprefix("ssm_cfg.") in ssm:
            given[k] = ssm[name.removeprefix("ssm_cfg.")]
    shown = _shown(given, {"hidden_size": None, "vocab_size": None, **defaults}, _SSM_FIELD_NAMES)
    _check_shapes(where, config, state, table, shown, _SSM_FIELD_NAMES)
    return config, state


# --- decoding caches ----------------------------------------------------------------------------


def layer_states_from_hf(
    config: ModelConfig, layers: list[tuple[Tensor, Tensor]], offset: int = 0
) -> list[BlockState]:
    """A ``transformers`` Mamba / Mamba-2 cache's per-layer ``(conv_state [B, C, W],
    ssm_state)`` → mnemo's per-layer states (``offset``: tokens consumed so far). The conv tail
    drops its oldest input; Mamba-2's ``[B, H, P, N]`` becomes ``[B, H, N, P]``."""
    mixers = config.layer_mixers()
    if len(layers) != len(mixers):
        raise ValueError(
            f"layers: expected one (conv, ssm) pair per layer ({len(mixers)}), got {len(layers)}"
        )
    out = []
    for name, (conv, ssm) in zip(mixers, layers):
        if name == "mamba":
            out.append(BlockState(mixer=MambaState(ssm=ssm, conv=conv[..., 1:], offset=offset)))
        elif name == "mamba2":
            out.append(
                BlockState(mixer=Mamba2State(ssm=ssm.transpose(-1, -2), conv=conv[..., 1:], offset=offset))
            )
        else:
            raise ValueError(f"layer_states_from_hf: mixer {name!r} is not a Mamba layer")
    return out


def layer_states_to_hf(states: list[BlockState]) -> list[tuple[Tensor, Tensor]]:
    """mnemo's per-layer Mamba / Mamba-2 states → ``transformers``' per-layer ``(conv_state
    [B, C, W], ssm_state)`` (the conv tail gets one leading zero input, which no output reads)."""
    out = []
    for s in states:
        m = s.mixer
        if not isinstance(m, MambaState | Mamba2State):
            raise ValueError(f"layer_states_to_hf: expected Mamba / Mamba-2 states, got {type(m).__name__}")
        conv = torch.nn.functional.pad(m.conv, (1, 0))
        ssm = m.ssm.transpose(-1, -2) if isinstance(m, Mamba2State) else m.ssm
        out.append((conv, ssm.contiguous()))
    return out


def hf_cache_from_layer_states(hf_model_config, layers: list[tuple[Tensor, Tensor]]):
    """A ``transformers`` ``DynamicCache`` for ``hf_model_config`` holding ``layers`` (from
    :func:`layer_states_to_hf`), ready for one-token decoding steps. Needs ``transformers``."""
    from transformers import DynamicCache

    cache = DynamicCache(config=hf_model_config)
    for i, (conv, ssm) in enumerate(layers):
        cache.update_conv_state(conv, i, conv_kernel_size=conv.shape[-1])
        cache.update_recurrent_state(ssm, i)
    return cache


def layer_states_of_hf_cache(cache) -> list[tuple[Tensor, Tensor]]:
    """The per-layer ``(conv_state, ssm_state)`` of a ``transformers`` Mamba / Mamba-2 cache."""
    return [(layer.conv_states[0], layer.recurrent_states[0]) for layer in cache.layers]
