"""Model configuration: a dataclass that serialises to JSON next to the weights."""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: the ``model_type`` that ``config.json`` carries, so that ``transformers``' ``AutoConfig`` /
#: ``AutoModelForCausalLM`` recognise a mnemo checkpoint (after ``import mnemo.hf``)
MODEL_TYPE = "mnemo"


@dataclass
class ModelConfig:
    """A decoder language model: ``n_layers`` blocks ``x + mixer(norm(x))``, ``x + mlp(norm(x))``.

    Attributes:
        vocab_size: tokenizer size (default ``256``).
        d_model: residual width (default ``128``).
        n_layers: number of blocks (default ``4``).
        mixer: the mixer name of every layer (a key of :data:`mnemo.layers.MIXERS`), unless
            ``pattern`` or ``layers`` is given.
        pattern: mixer names repeated over the layers (layer ``i`` uses ``pattern[i % len]``), so a
            hybrid keeps its ratio when ``n_layers`` changes: ``["gla", "gla", "gla", "attention"]``.
        layers: explicit per-layer mixer names (takes precedence); its length must equal ``n_layers``.
        mixer_options: keyword options per mixer name, e.g. ``{"attention": {"n_heads": 4}}``.
        mlp: ``"swiglu"``, ``"none"`` (mixer-only blocks), ``"cms"`` (a Continuum Memory System,
            :class:`mnemo.layers.ContinuumMemory`) or ``"moe"`` (a top-k mixture of SwiGLU experts,
            :class:`mnemo.layers.MoE`; stateless). mlp_hidden: SwiGLU hidden width (for ``"moe"``:
            the default ``expert_hidden``).
        mlp_options: options of the MLP; for ``"cms"``: ``{"levels": [{"period": 16, ...}, ...],
            "transfer": "sequential"}`` (see :class:`mnemo.layers.ContinuumMemory`); for ``"moe"``
            the keys of :data:`mnemo.layers.moe.MOE_OPTIONS`: ``n_experts`` (8), ``top_k`` (2),
            ``expert_hidden``, ``shared_expert_hidden`` (``None``: no shared expert),
            ``shared_expert_gate`` (False), ``norm_topk_prob`` (True), ``capacity_factor``
            (``None``: no token is dropped), ``aux_loss_coef`` (0.01, Switch load balance),
            ``z_loss_coef`` (0, ST-MoE router z-loss), ``seq_aux_loss_coef`` (0: off,
            DeepSeek-V3's sequence-wise balance loss, eq. 17–20, per batch row), ``bias_balancing`` (False,
            auxiliary-loss-free bias), ``bias_update_rate`` (1e-3), ``dispatch`` (``"sorted"``),
            ``score`` (``"softmax"``; ``"sigmoid"``: DeepSeek-V3's affinities),
            ``routed_scaling_factor`` (1.0), ``n_group`` (1), ``topk_group`` (1: no group limit) and
            ``group_score`` (``"top2"``: DeepSeek-V3's sum of a group's two best scores; ``"max"``:
            DeepSeek-V2's best score).
        mlp_only_layers: with ``mlp="moe"``, the indices of the layers (``0 … n_layers − 1``, each
            once) whose MLP is a dense SwiGLU of width ``mlp_hidden`` instead of the mixture of
            experts (default ``None``: every layer is MoE; ``[]`` the same). ``transformers``'
            Qwen2-MoE / Qwen3-MoE field of the same name; DeepSeek-V3's ``first_k_dense_replace = k``
            is ``list(range(k))``. The MoE losses, metrics and balancing bias cover the MoE layers only
            (:meth:`~mnemo.models.LanguageModel.moe_layers`).
        pos_embedding: ``"none"`` (positions come from the mixers, e.g. RoPE) or ``"learned"``
            (absolute, up to ``max_position`` tokens; default ``max_position=4096``).
        tie_embeddings: share the input embedding with the output head (default ``True``).
        norm_eps, init_std: RMSNorm epsilon and the std of the normal weight init (defaults
            ``norm_eps=1e-5``, ``init_std=0.02``).
        embedding_multiplier, residual_multiplier, logits_scaling: IBM Granite's three scalars
            (``transformers``' ``GraniteConfig`` / ``GraniteMoeHybridConfig``, same names and
            meaning; ``modeling_granite.py``, ``modeling_granitemoehybrid.py``): the token embedding
            is multiplied by ``embedding_multiplier`` (``hook_embed`` sees ``embed(ids) · m``; a
            learned position embedding is added after, unscaled), every residual branch by
            ``residual_multiplier`` (``x + m · mixer(norm(x))``, ``x + m · mlp(norm(x))``), and the
            output logits are divided by ``logits_scaling`` (``lm_head(norm(x)) / s``; the training
            loss and every other reader of the head too). Finite numbers > 0; defaults
            ``embedding_multiplier=1.0``, ``residual_multiplier=1.0``, ``logits_scaling=1.0``, which
            compute exactly what a model without them did (no multiplication is made). Granite's
            fourth, ``attention_multiplier``, is the attention mixer's ``softmax_scale`` option.
    """

    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    mixer: str = "attention"
    pattern: list[str] | None = None
    layers: list[str] | None = None
    mixer_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    mlp: str = "swiglu"
    mlp_hidden: int | None = None
    mlp_options: dict[str, Any] = field(default_factory=dict)
    mlp_only_layers: list[int] | None = None
    pos_embedding: str = "none"
    max_position: int = 4096
    tie_embeddings: bool = True
    norm_eps: float = 1e-5
    init_std: float = 0.02
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0

    def __post_init__(self):
        # JSON has no tuples: keep ``pattern``/``layers``/``mlp_only_layers`` as lists, so that a
        # config saved and loaded again equals itself
        for name in ("pattern", "layers", "mlp_only_layers"):
            if isinstance(getattr(self, name), tuple):
                setattr(self, name, list(getattr(self, name)))
        if self.mlp_only_layers == []:  # the same model as None: one spelling, so configs compare equal
            self.mlp_only_layers = None

    def layer_mixers(self) -> list[str]:
        if self.layers is not None:
            return list(self.layers)
        if self.pattern:
            return [self.pattern[i % len(self.pattern)] for i in range(self.n_layers)]
        return [self.mixer] * self.n_layers

    def validate(self) -> ModelConfig:
        """Raise ``ValueError`` naming the offending field; return self."""
        from ..layers import MIXERS

        def bad(name, expected, got):
            raise ValueError(f"ModelConfig.{name}: expected {expected}, got {got!r}")

        for name in ("vocab_size", "d_model", "n_layers", "max_position"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                bad(name, "a positive int", v)
        if not isinstance(self.mixer, str):
            bad("mixer", "a mixer name", self.mixer)
        for name in ("layers", "pattern"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, (list, tuple)) or not all(isinstance(m, str) for m in v)):
                bad(name, "a list of mixer names or None", v)
        if not isinstance(self.tie_embeddings, bool):
            bad("tie_embeddings", "true or false", self.tie_embeddings)
        for name in ("norm_eps", "init_std", "embedding_multiplier", "residual_multiplier", "logits_scaling"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
                bad(name, "a finite number > 0", v)
        if not isinstance(self.mixer_options, dict):
            bad("mixer_options", "a mapping {mixer name: {option: value}}", self.mixer_options)
        if self.layers is not None and len(self.layers) != self.n_layers:
            bad("layers", f"a list of n_layers = {self.n_layers} mixer names", self.layers)
        if self.pattern is not None and not self.pattern:
            bad("pattern", "a non-empty list of mixer names or None", self.pattern)
        source = "layers" if self.layers is not None else "pattern" if self.pattern else "mixer"
        for m in self.layer_mixers():
            if m not in MIXERS:
                bad(source, f"mixer names among {sorted(MIXERS)}", m)
        for m, opts in self.mixer_options.items():
            if m not in MIXERS:
                bad("mixer_options", f"keys among {sorted(MIXERS)}", m)
            if not isinstance(opts, dict):
                bad(f"mixer_options[{m!r}]", f"a dict of the {m!r} mixer's options", opts)
            unknown = _unknown_options(MIXERS[m], opts)
            if unknown:
                bad(
                    f"mixer_options[{m!r}]",
                    f"options of the {m!r} mixer ({', '.join(_option_names(MIXERS[m]))})",
                    ", ".join(unknown),
                )
            for key, expected in _mistyped_options(MIXERS[m], opts):
                bad(f"mixer_options[{m!r}][{key!r}]", expected, opts[key])
        if self.mlp not in ("swiglu", "none", "cms", "moe"):
            bad("mlp", "'swiglu', 'none', 'cms' or 'moe'", self.mlp)
        if self.mlp_hidden is not None and (
            not isinstance(self.mlp_hidden, int) or isinstance(self.mlp_hidden, bool) or self.mlp_hidden < 1
        ):
            bad("mlp_hidden", "a positive int or None", self.mlp_hidden)
        if self.mlp == "cms":
            from ..layers.cms import ContinuumMemory, _as_levels

            if not isinstance(self.mlp_options, dict):
                bad("mlp_options", "a dict of ContinuumMemory options", self.mlp_options)
            unknown = _unknown_options(ContinuumMemory, self.mlp_options)
            if unknown:
                known = ", ".join(_known_options(ContinuumMemory))
                bad("mlp_options", f"options of ContinuumMemory ({known})", ", ".join(unknown))
            for key, expected in _mistyped_options(ContinuumMemory, self.mlp_options):
                bad(f"mlp_options[{key!r}]", expected, self.mlp_options[key])
            if "levels" in self.mlp_options:
                try:
                    for level in _as_levels(self.mlp_options["levels"]):
                        level.validate()
                except (TypeError, ValueError) as e:
                    raise ValueError(f"ModelConfig.mlp_options: {e}") from None
        if self.mlp == "moe":
            from ..layers.moe import check_moe_options

            if not isinstance(self.mlp_options, dict):
                bad("mlp_options", "a dict of MoE options", self.mlp_options)
            try:
                check_moe_options(self.mlp_options)
            except ValueError as e:
                raise ValueError(f"ModelConfig.mlp_options: {e}") from None
        if self.mlp in ("swiglu", "none") and self.mlp_options:
            bad(
                "mlp_options",
                f"empty for mlp {self.mlp!r} (options are for 'cms' and 'moe')",
                self.mlp_options,
            )
        only = self.mlp_only_layers
        if only is not None:
            n = self.n_layers
            if not isinstance(only, (list, tuple)) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n for i in only
            ):
                bad("mlp_only_layers", f"None or a list of layer indices in 0 … {n - 1} (n_layers {n})", only)
            if len(set(only)) != len(only):
                bad("mlp_only_layers", "each layer index once", only)
            if only and self.mlp != "moe":
                bad("mlp_only_layers", f"None or [] for mlp {self.mlp!r} (dense among 'moe' layers)", only)
        if self.pos_embedding not in ("none", "learned"):
            bad("pos_embedding", "'none' or 'learned'", self.pos_embedding)
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """A validated config from a dict of its fields. ``model_type`` (written by :meth:`save` for
        ``transformers``; must be ``"mnemo"`` when present) and the special token ids
        ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` (``MnemoForCausalLM.save_pretrained``
        writes them for ``transformers``' ``AutoConfig``; not model fields) are accepted and dropped;
        configs written before them load unchanged. Any other unknown key raises ``ValueError``."""
        if not isinstance(d, Mapping):
            raise ValueError(
                f"ModelConfig: expected a mapping of its fields (a JSON object), got {type(d).__name__} {d!r}"
            )
        d = dict(d)
        model_type = d.pop("model_type", MODEL_TYPE)
        if model_type != MODEL_TYPE:
            raise ValueError(f"model_type: expected {MODEL_TYPE!r} (a mnemo config), got {model_type!r}")
        for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
            d.pop(k, None)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**d).validate()

    def save(self, path: str | Path) -> None:
        """Write the fields as JSON, preceded by ``"model_type": "mnemo"`` (what ``transformers``'
        Auto classes dispatch on)."""
        Path(path).write_text(json.dumps({"model_type": MODEL_TYPE, **self.to_dict()}, indent=2))

    @classmethod
    def load(cls, path: str | Path) -> ModelConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))


def _known_options(cls) -> list[str]:
    """The keyword options of a mixer class's constructor (after ``d_model``)."""
    params = list(inspect.signature(cls).parameters.values())[1:]  # after d_model (classes, partials)
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


#: the kinds of value an option's annotation may join (``bias: bool | str``): name -> (test, as said)
_KINDS = {
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an int"),
    "float": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
    "str": (lambda v: isinstance(v, str), "text"),
}


def _union_kinds(annotation) -> list[str] | None:
    """The kinds a union annotation of several :data:`_KINDS` names (``"bool | str"`` -> ``["bool",
    "str"]``; ``None`` in it left out), else ``None`` (the default's kind is checked)."""
    if not isinstance(annotation, str):  # (the mixers' modules use postponed annotations)
        return None
    names = [n.strip() for n in annotation.split("|") if n.strip() != "None"]
    return names if len(names) > 1 and all(n in _KINDS for n in names) else None


def _mistyped_options(cls, opts: dict) -> list[tuple[str, str]]:
    """``(key, expected)`` for each option whose value is not of its default's kind (a bool for a
    bool, an int for an int, a number for a float, text for text), or for an option annotated with
    several of those kinds (attention's ``bias: bool | str``) of none of them, or text that is not
    among the mixer's ``text_options`` for it (``{"bias": ("qkv",)}``; other values of each kind are
    the mixer's to check); ``None`` and options defaulting to ``None`` are left to
    the mixer, which may read ``None`` as "derive it")."""
    out = []
    for p in inspect.signature(cls).parameters.values():
        if p.name not in opts or p.default is inspect.Parameter.empty or p.default is None:
            continue
        v, d = opts[p.name], p.default
        if v is None:
            continue
        kinds = _union_kinds(p.annotation)
        if kinds is not None:
            texts = getattr(cls, "text_options", {}).get(p.name)  # (the text values it takes, if named)
            said = [_KINDS[k][1] if k != "str" or not texts else " or ".join(map(repr, texts)) for k in kinds]
            fits = any(_KINDS[k][0](v) for k in kinds) and not (
                isinstance(v, str) and texts and v not in texts
            )
            if not fits:
                out.append((p.name, f"{' or '.join(said)} (the default is {d!r})"))
            continue
        if isinstance(d, bool):
            ok, kind = isinstance(v, bool), "true or false"
        elif isinstance(d, int):
            ok, kind = isinstance(v, int) and not isinstance(v, bool), "an int"
        elif isinstance(d, float):
            ok, kind = isinstance(v, (int, float)) and not isinstance(v, bool), "a number"
        elif isinstance(d, str):
            ok, kind = isinstance(v, str), "text"
        else:
            continue
        if not ok:
            out.append((p.name, f"{kind} (the default is {d!r})"))
    return out


def _keyword_fields(name: str) -> set[str] | None:
    """What a constructor's ``**name`` takes, where mnemo knows it: the neural-memory mixers'
    ``**spec_overrides`` are :class:`~mnemo.memory.MemorySpec` fields; ``None`` for anything else."""
    if name != "spec_overrides":
        return None
    import dataclasses

    from ..memory import MemorySpec

    return {f.name for f in dataclasses.fields(MemorySpec)}


def _option_names(cls) -> list[str]:
    """The keyword options of ``cls``'s constructor, with those its ``**kwargs`` takes where known."""
    names = _known_options(cls)
    for p in inspect.signature(cls).parameters.values():
        if p.kind is p.VAR_KEYWORD:
            names = names + sorted((_keyword_fields(p.name) or set()) - set(names))
    return names


def _unknown_options(cls, opts: dict) -> list[str]:
    """Keys of ``opts`` the constructor does not take (none when it takes a ``**kwargs`` whose keys
    mnemo does not know: :func:`_keyword_fields`)."""
    params = inspect.signature(cls).parameters.values()
    known = set(_known_options(cls))
    for p in params:
        if p.kind is p.VAR_KEYWORD:
            fields = _keyword_fields(p.name)
            if fields is None:
                return []
            known |= fields
    return sorted(str(k) for k in opts if k not in known)
