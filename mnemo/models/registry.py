"""Named model configurations: one registry for the CLI, sweeps and tests.

``build_config(name, vocab_size=..., **overrides)`` returns a :class:`ModelConfig`;
``register_model`` adds a name. ``mnemo models`` lists them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .config import ModelConfig


@dataclass(frozen=True)
class ModelEntry:
    """A registered model: ``factory() -> ModelConfig``, and ``derive(cfg, overrides)`` (optional),
    which re-derives, in the overridden config's dict ``cfg``, the fields the preset sizes from
    others (unless ``overrides`` gives them)."""

    name: str
    description: str
    factory: Callable[[], ModelConfig]
    derive: Callable[[dict, dict], None] | None = None


MODELS: dict[str, ModelEntry] = {}


def register_model(name: str, description: str, derive: Callable[[dict, dict], None] | None = None):
    """Decorator: register ``factory() -> ModelConfig`` under ``name`` (``derive``: see
    :class:`ModelEntry`; default ``None``)."""

    def deco(factory):
        if name in MODELS:
            raise ValueError(f"model {name!r} is already registered")
        MODELS[name] = ModelEntry(name, description, factory, derive)
        return factory

    return deco


def model_names() -> list[str]:
    return sorted(MODELS)


def build_config(name: str, **overrides) -> ModelConfig:
    """The registered config ``name`` with fields replaced by ``overrides``.

    A registered *mixer* name that is not a model name (a mixer of your own, registered with
    ``@register_mixer``) gives the default model built from that mixer: ``ModelConfig(mixer=name)``
    — so a new mixer trains with ``TrainConfig(model=name)`` without a model registration.
    ``mixer_options`` overrides are merged per mixer (``{"attention": {"n_heads": 2}}`` keeps the
    preset's other attention options); ``mlp_options`` overrides are merged into the preset's while
    ``mlp`` stays the same (``{"order": "slowest_first"}`` keeps a HOPE preset's CMS levels), and an
    ``mlp`` of another kind starts from no options. Likewise a ``mixer`` override on a preset with a
    ``pattern`` (a hybrid) drops the pattern, so that every layer uses that mixer (give ``pattern``
    or ``layers`` too to keep one). Fields a preset sizes from others follow the overrides (e.g.
    ``gated_deltanet_attention_moe``'s ``expert_hidden``, half the dense width). Raises
    ``ValueError`` for an unknown name or field, or an ``mlp_hidden`` for a model without a dense
    MLP (``mlp`` ``"none"`` or ``"cms"``: it would be ignored).
    """
    from ..layers import MIXERS

    if name in MODELS:
        cfg = MODELS[name].factory().to_dict()
    elif name in MIXERS:
        cfg = ModelConfig(mixer=name).to_dict()
    else:
        raise ValueError(
            f"unknown model {name!r}; registered models: {', '.join(model_names())} (or any mixer name: "
            f"{', '.join(sorted(MIXERS))})"
        )
    preset_mlp, preset_mlp_options = cfg["mlp"], dict(cfg["mlp_options"] or {})
    for key, value in overrides.items():
        if key not in cfg:
            raise ValueError(f"unknown ModelConfig field {key!r} in overrides; known: {sorted(cfg)}")
        if key == "mixer_options":
            if value is not None and (
                not isinstance(value, dict) or not all(isinstance(o, dict) for o in value.values())
            ):
                raise ValueError(
                    "ModelConfig.mixer_options: expected a mapping {mixer name: {option: value}}, "
                    f"got {value!r}"
                )
            merged = {m: dict(o) for m, o in cfg["mixer_options"].items()}
            for m, o in (value or {}).items():
                merged.setdefault(m, {}).update(o)
            value = merged
        if (
            key == "mlp_options"
            and isinstance(value, dict)
            and overrides.get("mlp", preset_mlp) == preset_mlp
        ):
            value = {**preset_mlp_options, **value}  # the same MLP: the preset's other options stay
        cfg[key] = value
    if overrides.get("mlp", preset_mlp) != preset_mlp and "mlp_options" not in overrides:
        cfg["mlp_options"] = {}  # another MLP: the preset's options were the old one's
    if "mixer" in overrides and "pattern" not in overrides and "layers" not in overrides:
        cfg["pattern"] = cfg["layers"] = None  # the preset's hybrid would hide the mixer asked for
    if overrides.get("mlp_hidden") is not None and cfg["mlp"] in ("none", "cms"):
        # (asked for and ignored; a saved config that holds one still loads)
        raise ValueError(
            f"ModelConfig.mlp_hidden: expected None for mlp {cfg['mlp']!r} (it is the width of 'swiglu' and "
            f"'moe'), got {overrides['mlp_hidden']!r}"
        )
    derive = MODELS[name].derive if name in MODELS else None
    if derive is not None:
        derive(cfg, overrides)
    return ModelConfig.from_dict(cfg)


# --------------------------------------------------------------------------------------------
# The small defaults are sized for CPU experiments (d_model 128, 4 layers, ~0.8-1.1M parameters).
# --------------------------------------------------------------------------------------------

_HEADS = 4


@register_model("transformer", "softmax attention (RoPE) + SwiGLU, the baseline")
def _transformer() -> ModelConfig:
    return ModelConfig(mixer="attention", mixer_options={"attention": {"n_heads": _HEADS}})


@register_model(
    "mla",
    "multi-head latent attention + SwiGLU: the transformer with DeepSeek-V2's cache of one latent per token "
    "(DeepSeek-AI 2024, §2.1.2)",
)
def _mla() -> ModelConfig:
    return ModelConfig(mixer="mla", mixer_options={"mla": {"n_heads": _HEADS}})


@register_model(
    "transformer_sinks",
    "the transformer with a 512-token window + 4 attention sinks: a bounded KV cache (Xiao et al. 2023)",
)
def _transformer_sinks() -> ModelConfig:
    return ModelConfig(
        mixer="attention", mixer_options={"attention": {"n_heads": _HEADS, "window": 512, "n_sink": 4}}
    )


@register_model(
    "linear_attention", "linear attention, elu+1 features, normalised (Katharopoulos et al. 2020)"
)
def _linear_attention() -> ModelConfig:
    return ModelConfig(
        mixer="linear_attention",
        mixer_options={"linear_attention": {"n_heads": _HEADS, "feature_map": "elu", "normalize": True}},
    )


@register_model(
    "retnet", "retention: fixed per-head decays 1 - 2^(-5-h), RoPE, output gate (Sun et al. 2023)"
)
def _retnet() -> ModelConfig:
    return ModelConfig(mixer="retnet", mixer_options={"retnet": {"n_heads": _HEADS}})


@register_model("gla", "gated linear attention, data-dependent per-channel decay (Yang et al. 2023)")
def _gla() -> ModelConfig:
    return ModelConfig(mixer="gla", mixer_options={"gla": {"n_heads": _HEADS}})


@register_model("gla_hybrid", "GLA layers with softmax attention every 4th layer (a hybrid by config)")
def _gla_hybrid() -> ModelConfig:
    return ModelConfig(
        pattern=["gla", "gla", "gla", "attention"],
        mixer_options={"gla": {"n_heads": _HEADS}, "attention": {"n_heads": _HEADS}},
    )


@register_model("deltanet", "DeltaNet: delta-rule memory, short conv, L2-normed q/k (Yang et al. 2024)")
def _deltanet() -> ModelConfig:
    return ModelConfig(mixer="deltanet", mixer_options={"deltanet": {"n_heads": _HEADS}})


@register_model("gated_deltanet", "Gated DeltaNet: delta rule with Mamba-2-style decay (Yang et al. 2024)")
def _gated_deltanet() -> ModelConfig:
    return ModelConfig(mixer="gated_deltanet", mixer_options={"gated_deltanet": {"n_heads": _HEADS}})


@register_model(
    "kda",
    "Kimi Delta Attention: the delta rule with a per-channel decay from a low-rank gate, a sigmoid output "
    "gate (Kimi Team 2025)",
)
def _kda() -> ModelConfig:
    return ModelConfig(mixer="kda", mixer_options={"kda": {"n_heads": _HEADS}})


@register_model(
    "kimi_linear",
    "Kimi Linear's hybrid (Kimi Team 2025): 3 KDA layers : 1 multi-head latent attention layer without "
    "positions (NoPE, as Kimi Linear's); ours: the MLPs are dense SwiGLUs (Kimi Linear's are mixtures of "
    "experts after a dense first layer)",
)
def _kimi_linear() -> ModelConfig:
    return ModelConfig(
        pattern=["kda", "kda", "kda", "mla"],
        mixer_options={"kda": {"n_heads": _HEADS}, "mla": {"n_heads": _HEADS, "rope": False}},
    )


@register_model("mamba", "Mamba (S6): selective scan, d_state 16, expand 2, no MLP (Gu & Dao 2023)")
def _mamba() -> ModelConfig:
    # Mamba stacks mixer blocks without an MLP; 2x the layers keeps parameters near the others.
    return ModelConfig(mixer="mamba", mlp="none", n_layers=8)


@register_model("mamba2", "Mamba-2 (SSD): scalar decay per head, d_state 64, head_dim 32 (Dao & Gu 2024)")
def _mamba2() -> ModelConfig:
    # head_dim 32, not the layer's default 64: d_inner = 2 · 128 = 256 gives 8 SSD heads (4 at 64)
    return ModelConfig(mixer="mamba2", mlp="none", n_layers=8, mixer_options={"mamba2": {"head_dim": 32}})


@register_model("gated_deltanet_hybrid", "Gated DeltaNet with softmax attention every 4th layer (hybrid)")
def _gdn_hybrid() -> ModelConfig:
    return ModelConfig(
        pattern=["gated_deltanet", "gated_deltanet", "gated_deltanet", "attention"],
        mixer_options={"gated_deltanet": {"n_heads": _HEADS}, "attention": {"n_heads": _HEADS}},
    )


def _half_dense_experts(cfg: dict, overrides: dict) -> None:
    """``expert_hidden`` = half the dense SwiGLU width (``mlp_hidden``, else ``d_model``'s) of the
    overridden config, unless the overrides give it (or make the config invalid: validation says so)."""
    opts, d, h = cfg["mlp_options"], cfg["d_model"], cfg["mlp_hidden"]
    given = overrides.get("mlp_options")
    if (
        cfg["mlp"] != "moe"
        or not isinstance(opts, dict)
        or (isinstance(given, dict) and "expert_hidden" in given)
    ):
        return
    for v in (d, 1 if h is None else h):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            return
    from ..layers.mlp import swiglu_hidden

    opts["expert_hidden"] = max(1, (h if h is not None else swiglu_hidden(d)) // 2)


@register_model(
    "gated_deltanet_attention_moe",
    "Gated DeltaNet + attention every 4th layer with a mixture-of-experts MLP: 8 SwiGLU experts, "
    "top-2, each half the dense width (the active MLP equals gated_deltanet_hybrid's)",
    derive=_half_dense_experts,
)
def _gdn_attention_moe() -> ModelConfig:
    # active MLP parameters per token: 2 experts x 176 hidden = the dense SwiGLU's 352 at d_model 128
    return ModelConfig(
        pattern=["gated_deltanet", "gated_deltanet", "gated_deltanet", "attention"],
        mixer_options={"gated_deltanet": {"n_heads": _HEADS}, "attention": {"n_heads": _HEADS}},
        mlp="moe",
        mlp_options={"n_experts": 8, "top_k": 2, "expert_hidden": 176, "aux_loss_coef": 0.01},
    )


def _memory_model(spec: str, **options) -> ModelConfig:
    return ModelConfig(
        mixer="neural_memory", mixer_options={"neural_memory": {"n_heads": _HEADS, "spec": spec, **options}}
    )


@register_model("titans_lmm", "Titans LMM: deep MLP memory, l2, weight decay, momentum (Behrouz et al. 2024)")
def _titans_lmm() -> ModelConfig:
    return _memory_model("titans", persistent_tokens=4)


@register_model("titans_mac", "Titans MAC: segment attention over [persistent | memory read | segment]")
def _titans_mac() -> ModelConfig:
    return ModelConfig(mixer="titans_mac", mixer_options={"titans_mac": {"n_heads": _HEADS, "segment": 64}})


@register_model("titans_mag", "Titans MAG: sliding-window attention gated by the memory branch")
def _titans_mag() -> ModelConfig:
    return ModelConfig(mixer="titans_mag", mixer_options={"titans_mag": {"n_heads": _HEADS, "window": 64}})


@register_model("titans_mal", "Titans MAL: memory layer, then sliding-window attention")
def _titans_mal() -> ModelConfig:
    return ModelConfig(mixer="titans_mal", mixer_options={"titans_mal": {"n_heads": _HEADS, "window": 64}})


@register_model("moneta", "Moneta: deep MLP memory, lp attentional bias, lq retention (Behrouz et al. 2025)")
def _moneta() -> ModelConfig:
    return _memory_model("moneta")


@register_model("yaad", "Yaad: deep MLP memory, Huber attentional bias, weight decay (Behrouz et al. 2025)")
def _yaad() -> ModelConfig:
    return _memory_model("yaad")


@register_model("memora", "Memora: deep MLP memory, l2, KL (softmax) retention (Behrouz et al. 2025)")
def _memora() -> ModelConfig:
    return _memory_model("memora")


@register_model("ttt_linear", "TTT-Linear: x + LN(Wx), mini-batch GD of 16 (Sun et al. 2024)")
def _ttt_linear() -> ModelConfig:
    return _memory_model("ttt_linear")


@register_model("ttt_mlp", "TTT-MLP: x + LN(MLP(x)), mini-batch GD of 16 (Sun et al. 2024)")
def _ttt_mlp() -> ModelConfig:
    return _memory_model("ttt_mlp")


# periods 8/16/32: the default 128-token training window holds 4 periods of the slowest level, so
# every level steps (and its step is seen by the loss) in training, not only at evaluation
_PERIODS = (8, 16, 32)


def _cms_levels(objective: str) -> list[dict]:
    return [{"period": p, "objective": objective} for p in _PERIODS]


def _hope_config(objective: str) -> ModelConfig:
    # self-modifying Titans as published (Nested Learning §8.1–8.2): residual-MLP memories M_k, M_v,
    # M_η, M_α and M_memory, DGD updates; the main memory on 16-token chunks, the projection
    # memories on 64-token chunks (§8.2 uses two chunk sizes; the values are mnemo's choice)
    return ModelConfig(
        mixer="self_modifying_titans",
        mixer_options={"self_modifying_titans": {"n_heads": _HEADS, "chunk_size": 16, "proj_chunk_size": 64}},
        mlp="cms",
        mlp_options={"levels": _cms_levels(objective)},
    )


def _hope_attention_config(objective: str) -> ModelConfig:
    return ModelConfig(
        mixer="attention",
        mixer_options={"attention": {"n_heads": _HEADS}},
        mlp="cms",
        mlp_options={"levels": _cms_levels(objective)},
    )


_TASK = "inner objective: the next-token loss (the paper's, §7.1)"
_RECONSTRUCTION = "inner objective: reconstruction ½‖MLP(x) − W_v x‖² (mnemo's self-supervised variant)"


@register_model(
    "hope",
    f"HOPE: self-modifying Titans followed by a 3-level CMS (periods 8/16/32) (Behrouz et al. 2025); {_TASK}",
)
def _hope() -> ModelConfig:
    return _hope_config("task")


@register_model("hope_reconstruction", f"hope with the CMS levels' {_RECONSTRUCTION}")
def _hope_reconstruction() -> ModelConfig:
    return _hope_config("reconstruction")


#: DGD momentum of hope_paper (the paper gives no value; the conventional heavy-ball 0.9, as the
#: CMS levels' Level.beta default)
_PAPER_MOMENTUM = 0.9


@register_model(
    "hope_paper",
    "HOPE as Table 6's full model (Behrouz et al. 2025): self-modifying Titans with self-generated "
    f"targets, an adaptive inner-projection q and DGD with momentum {_PAPER_MOMENTUM}, then a 3-level "
    f"CMS (periods 8/16/32); {_TASK}",
)
def _hope_paper() -> ModelConfig:
    # what Table 6 ablates from the evaluated model ("w/o momentum", "w/o inner-projection q") is on;
    # the targets are Eq. 84/94's self-generated M_memory(v_t); the CMS levels learn from the task loss
    cfg = _hope_config("task")
    cfg.mixer_options["self_modifying_titans"].update(
        memory_target="self", adaptive_q=True, momentum=_PAPER_MOMENTUM
    )
    return cfg


#: paper-scale CMS periods (§9.1 groups its CMS variants by lowest frequency 512 and 2K): four
#: levels, the slowest stepping every 2048 tokens
_LONG_PERIODS = (16, 128, 512, 2048)


@register_model(
    "hope_long",
    "hope with paper-scale CMS periods 16/128/512/2048 (its slow levels step only when the state is "
    "carried across training windows: docs/guides/nested_learning.md, 'Paper-scale time scales'); "
    f"{_TASK}",
)
def _hope_long() -> ModelConfig:
    cfg = _hope_config("task")
    cfg.mlp_options = {"levels": [{"period": p, "objective": "task"} for p in _LONG_PERIODS]}
    return cfg


@register_model(
    "hope_attention",
    f"HOPE-attention: softmax attention followed by a 3-level CMS (periods 8/16/32); {_TASK}",
)
def _hope_attention() -> ModelConfig:
    return _hope_attention_config("task")


@register_model("hope_attention_reconstruction", f"hope_attention with the CMS levels' {_RECONSTRUCTION}")
def _hope_attention_reconstruction() -> ModelConfig:
    return _hope_attention_config("reconstruction")


# --------------------------------------------------------------------------------------------
# ablations used by the recall benchmarks (mnemo.data.tasks, configs/sweeps)
# --------------------------------------------------------------------------------------------


@register_model("mamba_lti", "Mamba with input-independent Δ, B, C: an LTI SSM (the Mamba §4.1 ablation)")
def _mamba_lti() -> ModelConfig:
    return ModelConfig(mixer="mamba", mlp="none", n_layers=8, mixer_options={"mamba": {"selective": False}})


@register_model(
    "transformer_abs", "softmax attention with learned absolute positions (no RoPE) + SwiGLU, GPT-2 style"
)
def _transformer_abs() -> ModelConfig:
    return ModelConfig(
        mixer="attention",
        mixer_options={"attention": {"n_heads": _HEADS, "rope": False}},
        pos_embedding="learned",
    )
