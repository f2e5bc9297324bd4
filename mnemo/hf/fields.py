"""What the importers and exporters of ``transformers``' RoPE families share.

* :class:`ConfigFormat`: one ``config.json`` format — its name (every refusal starts ``"{name}
  conversion: "``), the defaults of its ``transformers`` config class (a ``config.json`` written by
  ``save_pretrained`` leaves out the fields equal to them) and the config fields that set each
  weight's shape (named when a weight's shape contradicts the config).
* :func:`rope_fields`: ``rope_theta``, ``partial_rotary_factor`` and the scaling of a config, read
  as ``transformers`` 5 reads them: ``rope_parameters``, or a non-empty legacy ``rope_scaling`` in
  its place, with the legacy top-level ``rope_theta`` / ``partial_rotary_factor`` as fallbacks. The
  static scalings become :class:`~mnemo.layers.rotary.RotaryEmbedding` mappings with the same
  frequencies: ``"yarn"`` → ``"yarn_hf"``, ``"linear"`` → ``"linear"``, ``"llama3"`` →
  ``"llama3"``; :func:`rope_parameters` writes them back.
* :class:`Weights`: a state dict consumed key by key; a missing, mis-shaped or unexpected weight is
  refused by name.
* :func:`decoder_fields`, :func:`import_head`, :func:`export_head`: the ``config.json`` fields of a
  RoPE / SwiGLU decoder, and the embedding and output head both ways (tied or not);
  :func:`tied_as_loaded`: whether ``transformers`` ties the head of
  a file (not where the file's head differs from the embedding).
* :func:`mixer_options`: a mixer's effective constructor options in a :class:`ModelConfig`.

Used by :mod:`mnemo.hf.qwen3_next`, :mod:`mnemo.hf.llama`, :mod:`mnemo.hf.bamba` and
:mod:`mnemo.hf.fla_hub`; nothing here imports ``transformers``.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch
from torch import Tensor

from ..layers import MIXERS
from ..layers.rotary import LLAMA3_KEYS, YARN_HF_KEYS, check_rope_scaling
from ..models.config import ModelConfig


def is_int(v) -> bool:
    """An int that is not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class ConfigFormat:
    """A ``transformers`` config format: ``name`` (as refusals say it, ``"Qwen3-Next"``),
    ``defaults`` (its config class's value of each field the conversion reads) and ``shape_fields``
    (by the end of a weight's name in the file, the config fields that set its shape; the longest
    matching end counts)."""

    name: str
    defaults: dict[str, Any]
    shape_fields: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def refuse(self, what: str) -> NoReturn:
        """Raise ``ValueError("{name} conversion: {what}")``."""
        raise ValueError(f"{self.name} conversion: {what}")

    def get(self, cfg: dict, key: str):
        """``cfg[key]``, or the class's default where the config leaves it out or sets it null."""
        return cfg[key] if cfg.get(key) is not None else self.defaults[key]

    def require(self, where: str, opts: dict, key: str, expected) -> None:
        """Refuse unless ``opts[key] == expected`` (an export's fixed option), naming both values."""
        if opts.get(key) != expected:
            self.refuse(
                f"{where} option {key}={opts.get(key)!r} has no {self.name} equivalent (needs {expected!r})"
            )

    def why_shape(self, cfg: dict, key: str) -> str:
        """``" (its shape is set by f = v, ...: ...)"``: the config fields deciding the shape of the
        weight ``key``, ``"v (default)"`` for one the config leaves out; ``""`` when none is known."""
        best = max((e for e in self.shape_fields if key == e or key.endswith("." + e)), key=len, default=None)
        if best is None:
            return ""
        said = ", ".join(
            f"{f} = {cfg[f]!r}" if cfg.get(f) is not None else f"{f} = {self.defaults.get(f)!r} (default)"
            for f in self.shape_fields[best]
        )
        return f" (its shape is set by {said}: the config and the weights disagree)"

    def init_std(self, v) -> float:
        """``initializer_range`` (the weights' init scale, carried as ``init_std``), a number >= 0."""
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
            self.refuse(f"field 'initializer_range': expected a number >= 0, got {v!r}")
        return float(v)


class Weights:
    """A state dict consumed key by key (keys starting with one of ``ignore`` dropped first);
    :meth:`finish` refuses what was not consumed. ``cfg``: the source config, whose fields a shape
    error then names (:meth:`ConfigFormat.why_shape`)."""

    def __init__(
        self,
        fmt: ConfigFormat,
        weights: dict[str, Tensor],
        ignore: tuple[str, ...] = (),
        cfg: dict | None = None,
    ):
        self.fmt = fmt
        self.w = {k: v for k, v in weights.items() if not k.startswith(ignore)}
        self.used: set[str] = set()
        self.cfg = cfg

    def __contains__(self, key: str) -> bool:
        return key in self.w

    def pop(self, key: str, shape: tuple[int, ...] | None = None) -> Tensor:
        """The weight ``key`` (of ``shape`` when given), marked used; refused by name when missing
        or of another shape."""
        if key not in self.w:
            self.fmt.refuse(f"weight {key!r} is missing")
        t = self.w[key]
        if shape is not None and tuple(t.shape) != tuple(shape):
            why = self.fmt.why_shape(self.cfg, key) if self.cfg is not None else ""
            self.fmt.refuse(f"weight {key!r} has shape {list(t.shape)}, expected {list(shape)}{why}")
        self.used.add(key)
        return t

    def finish(self) -> None:
        """Refuse the weights that no :meth:`pop` took (the first eight named, and how many more)."""
        left = sorted(set(self.w) - self.used)
        if left:
            self.fmt.refuse(
                f"unexpected weights (not expressible in the mnemo model): {left[:8]}"
                + (f" and {len(left) - 8} more" if len(left) > 8 else "")
            )


def rope_fields(
    fmt: ConfigFormat,
    cfg: dict,
    *,
    kinds: dict[str, str],
    partial_default: float,
    reasons: dict[str, str] | None = None,
) -> tuple[float, float, dict | None]:
    """``(rope_theta, partial_rotary_factor, rope_scaling)`` of ``cfg`` as ``transformers`` reads them.

    The fields come from ``rope_parameters`` or, when a legacy ``rope_scaling`` is non-empty, from it
    alone (``transformers`` then ignores ``rope_parameters``); ``rope_theta`` / ``partial_rotary_factor``
    fall back on the top-level fields, then on ``10000`` / ``partial_default``. ``kinds`` maps each
    accepted ``rope_type`` to how the refusal of another one describes it; ``reasons`` maps a
    refused ``rope_type`` to why (said after the list). The scaling is ``None``
    for ``"default"``, and for the static kinds the :func:`~mnemo.layers.rotary.check_rope_scaling`
    mapping with ``transformers``' frequencies: ``"yarn"`` → ``"yarn_hf"``, ``"linear"`` →
    ``"linear"`` (every frequency divided by ``factor``), ``"llama3"`` → ``"llama3"``. The training
    context of ``"yarn"`` / ``"llama3"`` (``original_max_position_embeddings``) is, as in
    ``transformers``' ``standardize_rope_params``, a top-level field first (Phi-3's), then the scaling's,
    then ``max_position_embeddings`` (``fmt``'s default when left out).

    Raises ``ValueError`` (``fmt.refuse``) naming the field for a value of the wrong kind or a
    ``rope_type`` not among ``kinds``."""
    field_, rp = "rope_parameters", cfg.get("rope_parameters")
    if cfg.get("rope_scaling") not in (None, {}):
        field_, rp = "rope_scaling", cfg["rope_scaling"]
    rp = {"rope_type": "default"} if rp is None else rp
    if not isinstance(rp, dict):
        fmt.refuse(
            f"field {field_!r}: expected an object such as "
            f"{{'rope_type': 'default', 'rope_theta': 10000.0}}, got {rp!r}"
        )
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type not in kinds:
        said = [f"{k!r}, {v}" for k, v in kinds.items()]
        only = ", ".join(said[:-1]) + ", and " + said[-1] if len(said) > 1 else said[0]
        why = (reasons or {}).get(rope_type)
        fmt.refuse(
            f"{field_}: rope_type {rope_type!r} is not supported (only {only})" + (f": {why}" if why else "")
        )
    theta = rp.get("rope_theta", cfg.get("rope_theta", 10000.0))
    factor = rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", partial_default))
    for name, v, top, kind in (
        ("rope_theta", theta, float("inf"), "a positive number"),
        ("partial_rotary_factor", factor, 1.0, "a number in (0, 1], the share of head_dim rotated"),
    ):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= top or v == float("inf"):
            where = f"{field_}.{name}" if name in rp else name
            fmt.refuse(f"field {where!r}: expected {kind}, got {v!r}")
    scaling = None
    if rope_type != "default":
        n = fmt.get(cfg, "max_position_embeddings")
        L = cfg.get("original_max_position_embeddings") or rp.get("original_max_position_embeddings") or n
        if rope_type == "yarn":  # as transformers' _compute_yarn_parameters reads it
            keys = ("factor", "attention_factor", *YARN_HF_KEYS)
            scaling = {"rope_type": "yarn_hf", **{k: rp[k] for k in keys if rp.get(k) is not None}}
            scaling["beta_fast"] = rp.get("beta_fast") or 32  # (transformers: a 0 or null means the default)
            scaling["beta_slow"] = rp.get("beta_slow") or 1
            scaling["original_max_position_embeddings"] = L
            if scaling.get("factor") is None and is_int(L) and L > 0 and isinstance(n, (int, float)):
                scaling["factor"] = n / L  # transformers: the context extension
        elif rope_type == "llama3":  # _compute_llama3_parameters: every key required
            needed = [k for k in LLAMA3_KEYS if k != "original_max_position_embeddings"]
            missing = [k for k in needed if rp.get(k) is None]
            if missing:  # (original_max_position_embeddings falls back on max_position_embeddings)
                fmt.refuse(
                    f"field {field_!r}: rope_type 'llama3' needs {missing} (transformers reads every one of "
                    f"{needed}), got keys {sorted(rp)}"
                )
            scaling = {"rope_type": "llama3", **{k: rp[k] for k in LLAMA3_KEYS if k in rp}}
            scaling["original_max_position_embeddings"] = L
        else:  # "linear": _compute_linear_scaling_rope_parameters
            scaling = {"rope_type": rope_type, "factor": rp.get("factor")}
        try:
            scaling = check_rope_scaling(scaling)
        except ValueError as e:  # said with the field the config uses (rope_parameters or rope_scaling)
            said = str(e)
            said = field_ + said.removeprefix("rope_scaling") if said.startswith("rope_scaling") else said
            fmt.refuse(f"field {field_!r} (rope_type {rope_type!r}): {said}")
    return float(theta), float(factor), scaling


def rope_parameters(theta: float, scaling: dict | None, **base) -> dict[str, Any]:
    """``transformers``' ``rope_parameters`` for mnemo's RoPE: ``{"rope_type": "default", "rope_theta":
    theta, **base}`` for plain RoPE (``scaling`` ``None``); a checked ``"yarn_hf"`` scaling as
    ``rope_type`` ``"yarn"`` and ``"linear"`` / ``"llama3"`` as they are, with their keys (``None``
    values left out). ``base``: further fields (``partial_rotary_factor``)."""
    out: dict[str, Any] = {"rope_type": "default", "rope_theta": float(theta), **base}
    if scaling is None:
        return out
    out["rope_type"] = "yarn" if scaling["rope_type"] == "yarn_hf" else scaling["rope_type"]
    for k, v in scaling.items():
        if k != "rope_type" and v is not None:
            out[k] = v
    return out


def decoder_fields(
    config: ModelConfig,
    arch: str,
    model_type: str,
    *,
    heads: tuple[int, int, int],
    hidden: int,
    rope: dict[str, Any],
) -> dict[str, Any]:
    """The ``config.json`` fields a ``transformers`` decoder of RoPE attention and SwiGLU MLPs shares
    (``architectures``, ``model_type``, the sizes, ``hidden_act`` ``"silu"``, ``rms_norm_eps``,
    ``tie_word_embeddings``, ``initializer_range``) for the mnemo ``config``; ``heads``:
    ``(num_attention_heads, num_key_value_heads, head_dim)``; ``hidden``: ``intermediate_size``;
    ``rope``: the ``rope_parameters`` (:func:`rope_parameters`). With YaRN (``rope_type`` ``"yarn"``)
    ``max_position_embeddings`` is ``factor × original_max_position_embeddings``: ``transformers``
    derives YaRN's factor from their ratio where ``factor`` is left out, so the class's default could
    imply another factor, or lie below the training context, which it warns about. For the other
    kinds it is left out here (no frequency depends on it); :func:`mnemo.hf.convert.export_hf`
    writes back a converted checkpoint's own value."""
    H, H_kv, D = heads
    out = {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": hidden,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": H,
        "num_key_value_heads": H_kv,
        "head_dim": D,
        "hidden_act": "silu",
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "rope_parameters": rope,
        "attention_dropout": 0.0,
        "initializer_range": config.init_std,
    }
    yarn = rope.get("rope_type") == "yarn"
    if yarn and rope.get("factor") is not None and rope.get("original_max_position_embeddings") is not None:
        out["max_position_embeddings"] = int(round(rope["factor"] * rope["original_max_position_embeddings"]))
    return out


def tied_as_loaded(
    fmt: ConfigFormat, cfg: dict, weights: dict[str, Tensor], embed: str = "model.embed_tokens.weight"
) -> bool:
    """Whether ``transformers`` 5 ties the output head to the embedding when it loads ``weights``
    with the config ``cfg``: ``tie_word_embeddings`` (``fmt``'s default where left out), unless the
    file holds both the embedding ``embed`` (default ``model.embed_tokens.weight``; fla's models:
    ``model.embeddings.weight``) and a ``lm_head.weight`` of other values — then
    ``transformers`` keeps them apart ("both are present in the checkpoints with different values, so
    we will NOT tie them", ``PreTrainedModel.tie_weights``), and so does the import, with a
    ``UserWarning`` naming the field. Heads of different shapes are left to the shape check."""
    tie = bool(fmt.get(cfg, "tie_word_embeddings"))
    emb, head = weights.get(embed), weights.get("lm_head.weight")
    if not tie or emb is None or head is None or emb.shape != head.shape or torch.equal(emb, head):
        return tie
    warnings.warn(
        f"{fmt.name} conversion: field 'tie_word_embeddings' is true but the file's lm_head.weight differs "
        f"from {embed} (max |Δ| = "
        f"{(head.double() - emb.double()).abs().max().item():.3g}): imported untied, with the file's own "
        "head, as transformers loads it (it does not tie them then); set tie_word_embeddings to false in "
        "config.json to say so",
        UserWarning,
        stacklevel=3,
    )
    return False


def import_head(
    w: Weights, vocab: int, d: int, tie: bool, embed: str = "model.embed_tokens.weight"
) -> dict[str, Tensor]:
    """``embed.weight`` and ``lm_head.weight`` from the embedding ``embed`` (default
    ``model.embed_tokens.weight``) and ``lm_head.weight`` (``[vocab, d]``); tied (``tie``): the
    embedding under both names, and a ``lm_head.weight`` in the file, if any, must equal it (refused
    by name otherwise)."""
    emb = w.pop(embed, (vocab, d))
    if not tie:
        return {"embed.weight": emb, "lm_head.weight": w.pop("lm_head.weight", (vocab, d))}
    if "lm_head.weight" in w and not torch.equal(w.pop("lm_head.weight", (vocab, d)), emb):
        w.fmt.refuse("tie_word_embeddings is set but lm_head.weight differs from the embedding")
    return {"embed.weight": emb, "lm_head.weight": emb}


def export_head(w: Weights, config: ModelConfig) -> dict[str, Tensor]:
    """``model.embed_tokens.weight`` and ``lm_head.weight`` (a tied model's state dict lists the
    shared tensor under both names, as ``transformers``' ``state_dict()`` does; one that differs is
    refused by name. The file :func:`mnemo.hf.convert.export_hf` writes holds it once)."""
    shape = (config.vocab_size, config.d_model)
    emb, head = w.pop("embed.weight", shape), w.pop("lm_head.weight", shape)
    if config.tie_embeddings and not torch.equal(head, emb):
        w.fmt.refuse("tie_embeddings is set but lm_head.weight differs from embed.weight")
    return {"model.embed_tokens.weight": emb, "lm_head.weight": head}


def mixer_options(name: str, config: ModelConfig) -> dict[str, Any]:
    """The mixer's effective constructor options: its signature's defaults, the registry's preset
    options and ``config.mixer_options[name]``."""
    ctor = MIXERS[name]
    cls = getattr(ctor, "func", ctor)
    opts = {
        k: p.default
        for k, p in inspect.signature(cls).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    opts.update(getattr(ctor, "keywords", {}) or {})
    opts.update(config.mixer_options.get(name, {}))
    return opts


#: the :class:`ModelConfig` fields of IBM Granite's scalars (1.0: none)
MULTIPLIER_FIELDS = ("embedding_multiplier", "residual_multiplier", "logits_scaling")


def refuse_unexpressed(
    name: str,
    config: ModelConfig,
    *,
    multipliers: bool = False,
    mlp_only_layers: bool = False,
    softmax_scale=(),
    carried_by: dict[str, str] | None = None,
) -> None:
    """Refuse (``ValueError``, ``"{name} conversion: …"``) what a format's class cannot compute: a
    Granite scalar of :data:`MULTIPLIER_FIELDS` other than 1 or a mixer's ``softmax_scale`` (unless
    ``multipliers``; a mixer named in ``softmax_scale`` is checked by the format's own export), and
    dense layers among mixture-of-experts ones (``ModelConfig.mlp_only_layers``, unless
    ``mlp_only_layers``). Every exporter calls it first (its class would otherwise compute another
    function in silence), and so does :func:`mnemo.hf.convert.export_hf`, which names in
    ``carried_by`` (``{"multipliers": …, "mlp_only_layers": …}``) the formats that do carry them."""
    hint = carried_by or {}
    if config.mlp_only_layers and not mlp_only_layers:
        where = f"; carried by {hint['mlp_only_layers']}" if "mlp_only_layers" in hint else ""
        raise ValueError(
            f"{name} conversion: ModelConfig.mlp_only_layers = {config.mlp_only_layers!r} (dense layers "
            f"among mixture-of-experts ones) has no equivalent in this format (expected None or []{where})"
        )
    if multipliers:
        return
    where = f"; Granite's multipliers are carried by {hint['multipliers']}" if "multipliers" in hint else ""
    for k in MULTIPLIER_FIELDS:
        v = getattr(config, k)
        if v != 1.0:
            raise ValueError(
                f"{name} conversion: ModelConfig.{k} = {v!r} has no equivalent in this format (expected "
                f"1.0{where})"
            )
    for mixer, opts in config.mixer_options.items():
        if mixer in softmax_scale:  # (the format's export checks it)
            continue
        if isinstance(opts, dict) and opts.get("softmax_scale") is not None:
            raise ValueError(
                f"{name} conversion: mixer_options[{mixer!r}]['softmax_scale'] = "
                f"{opts['softmax_scale']!r} has no equivalent in this format (expected None: the "
                f"mixer's default scale{where})"
            )


def aux_loss_coef_from_hf(router_aux_loss_coef: float, top_k: int, n_moe_layers: int) -> float:
    """mnemo's ``aux_loss_coef`` for a ``transformers`` MoE model's ``router_aux_loss_coef`` ``c``:
    ``c · k / L`` with ``L`` the number of *sparse* layers. ``transformers``' balance loss
    (``load_balancing_loss_func``) is ``E Σ_e F_e P_e`` over the router logits of the sparse layers
    only, pooled (``F_e`` counts ``k`` choices per token, ``k`` times mnemo's share ``f_e``), where
    mnemo adds each sparse layer's ``L_aux = E Σ_e f_e P_e`` (:class:`~mnemo.layers.MoE`): equal for
    one sparse layer, and where the layers' routing statistics agree. Dense layers among sparse ones
    (``mlp_only_layers``) produce no router logits and do not count. :func:`aux_loss_coef_to_hf` is
    the inverse."""
    return float(router_aux_loss_coef) * top_k / n_moe_layers


def aux_loss_coef_to_hf(aux_loss_coef: float, top_k: int, n_moe_layers: int) -> float:
    """``router_aux_loss_coef`` for mnemo's ``aux_loss_coef``: the inverse of
    :func:`aux_loss_coef_from_hf` (``aux_loss_coef · L / k``, ``L`` the sparse layers)."""
    return float(aux_loss_coef) * n_moe_layers / top_k
