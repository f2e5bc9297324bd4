"""Import and export of checkpoints written by other libraries.

``import_hf(src)`` reads a checkpoint folder of another library and returns mnemo's
``(ModelConfig, state_dict, tokenizer_files)``; :func:`convert` writes it as a mnemo checkpoint
folder; :func:`export_hf` writes a mnemo model as a folder that ``transformers`` loads with its own
classes. Nothing here imports ``transformers`` (only ``torch`` and ``safetensors``), except the
optional :func:`hf_cache_from_layer_states`.

Formats are kept in a registry, :data:`ARCHITECTURES`, keyed by name (the ``architectures`` entry
of a ``transformers`` ``config.json``) and found by ``architectures``, then ``model_type``, then a
``detect(config) -> bool`` function for configs that carry neither. Built in:

* ``MambaForCausalLM`` (``model_type`` ``"mamba"``) ↔ mnemo ``mamba`` layers;
* ``Mamba2ForCausalLM`` (``"mamba2"``) ↔ mnemo ``mamba2`` layers;
* ``LlamaForCausalLM`` (``"llama"``), ``Qwen2ForCausalLM`` (``"qwen2"``), ``Qwen3ForCausalLM``
  (``"qwen3"``), ``MistralForCausalLM`` (``"mistral"``) ↔ mnemo ``attention`` layers with SwiGLU MLPs
  (:mod:`mnemo.hf.llama`);
* ``MixtralForCausalLM`` (``"mixtral"``), ``Qwen3MoeForCausalLM`` (``"qwen3_moe"``),
  ``Qwen2MoeForCausalLM`` (``"qwen2_moe"``) ↔ the same attention with a mixture-of-experts MLP in
  every layer (``mlp="moe"``, :class:`~mnemo.layers.MoE`; Qwen2-MoE's gated shared expert;
  :mod:`mnemo.hf.llama`);
* ``Qwen3NextForCausalLM`` (``"qwen3_next"``) ↔ mnemo ``gated_deltanet`` and gated ``attention``
  layers (:mod:`mnemo.hf.qwen3_next`);
* ``FalconMambaForCausalLM`` (``"falcon_mamba"``) ↔ mnemo ``mamba`` layers with ``bcdt_rms_eps``
  (the RMS normalisation of dt, B and C; :mod:`mnemo.hf.mamba`);
* ``BambaForCausalLM`` (``"bamba"``) ↔ mnemo ``mamba2`` and ``attention`` layers (partial rotary)
  with SwiGLU MLPs (:mod:`mnemo.hf.bamba`);
* ``GraniteMoeHybridForCausalLM`` (``"granitemoehybrid"``, Granite 4.0-H) ↔ mnemo ``mamba2`` and
  ``attention`` layers (RoPE or no positions) with a SwiGLU MLP or a MoE plus a shared expert, and
  ``GraniteForCausalLM`` (``"granite"``) ↔ mnemo ``attention`` layers with SwiGLU MLPs, both with
  Granite's ``embedding_multiplier`` / ``residual_multiplier`` / ``logits_scaling`` and
  ``attention_multiplier`` (the attention's ``softmax_scale``) (:mod:`mnemo.hf.granite`); no other
  format carries these, and every other export refuses a model that sets them, naming the field;
* ``JambaForCausalLM`` (``"jamba"``, AI21's Jamba) ↔ mnemo ``mamba`` layers with ``bcdt_norm`` (the
  RMSNorms with weights on dt, B and C) and ``attention`` layers without positions, at periodic
  layers, with SwiGLU MLPs or a top-k MoE that keeps the softmax weights unnormalised at periodic
  layers (dense ones among them as ``mlp_only_layers``) (:mod:`mnemo.hf.jamba`);
* ``DeepseekV3ForCausalLM`` (``"deepseek_v3"``: DeepSeek-V3 / R1, Moonlight; also Kimi K2's
  ``"kimi_k2"``) and ``DeepseekV2ForCausalLM`` (``"deepseek_v2"``: its softmax router, greedy or
  group-limited by each group's largest score) ↔ mnemo ``mla``
  layers (multi-head latent attention, YaRN's ``mscale_all_dim`` as its ``softmax_scale``), dense
  first layers (``mlp_only_layers``) and DeepSeek-V3's sigmoid-routed MoE with groups, a routed
  scaling factor, ungated shared experts and the ``e_score_correction_bias`` as the balancing bias
  (:mod:`mnemo.hf.deepseek`); Qwen2-MoE / Qwen3-MoE, Jamba and DeepSeek-V3 are the formats that carry
  ``mlp_only_layers``, every other export refuses a model with dense layers among MoE ones;
* ``KimiLinearForCausalLM`` (``"kimi_linear"``, Moonshot's Kimi Linear) ↔ mnemo ``kda`` layers
  (Kimi Delta Attention) and ``mla`` layers without positions (``rope=False``) in any order, with
  SwiGLU MLPs and DeepSeek-V3's MoE at any layers (``mlp_only_layers``: it carries them too)
  (:mod:`mnemo.hf.kimi_linear`);
* flash-linear-attention's ``GLAForCausalLM`` (``"gla"``), ``RetNetForCausalLM`` (``"retnet"``),
  ``DeltaNetForCausalLM`` (``"delta_net"``) and ``GatedDeltaNetForCausalLM`` (``"gated_deltanet"``),
  import only → mnemo ``gla``, ``retnet``, ``deltanet``, ``gated_deltanet`` layers with SwiGLU MLPs
  (:mod:`mnemo.hf.fla_hub`);
* ``mamba_ssm`` (import only): the original ``mamba-ssm`` layout — ``config.json`` with
  ``d_model``, ``n_layer``, ``vocab_size``, ``ssm_cfg`` (``{"layer": "Mamba1" | "Mamba2", ...}``;
  ``"Mamba1"`` when absent), ``d_intermediate``, ``attn_layer_idx``, ``rms_norm``,
  ``tie_embeddings``, ``pad_vocab_size_multiple`` (the field names of ``mamba_ssm``'s
  ``MambaConfig``) and weights ``backbone.embedding.weight``, ``backbone.layers.N.norm.weight``,
  ``backbone.layers.N.mixer.*``, ``backbone.norm_f.weight``, ``lm_head.weight``. Its norms use
  ``mamba_ssm``'s fixed epsilon ``1e-5``; the vocabulary is the embedding's (padded) row count.

Every architecture's import refuses, by name, any option it cannot reproduce exactly (an MLP
between mixers, attention layers, LayerNorm instead of RMSNorm, another activation…), and every
export refuses a mnemo config that the target class cannot express; nothing is approximated.

Weights: ``model.safetensors``, sharded safetensors (``model.safetensors.index.json``),
``pytorch_model.bin`` (read with ``torch.load(weights_only=True)``) or its sharded index. The
state dict that ``import_hf`` returns loads into ``LanguageModel(config)`` with ``strict=True`` in
the checkpoint's dtype; :func:`convert` stores a float32 model (what ``LanguageModel`` builds) and
carries the source's dtype, in which :func:`export_hf` writes the weights again. A quantized
checkpoint (a ``quantization_config``: GPTQ, AWQ, bitsandbytes, fp8…) is refused by name.

Folders: :func:`convert` and :func:`export_hf` write the whole output folder into a hidden temporary
sibling (``.OUT.partial-…``) and move it into place only when it is complete, so a failed write (a
full disk, a file size limit) leaves ``OUT`` as it was and raises ``OSError``; with ``force`` an
existing checkpoint folder is replaced whole (no file of its previous content stays), after the new
one is complete; never one that holds the source. Neither writes into a training run's folder or
checkpoint. Besides the model, they carry the tokenizer files (:data:`TOKENIZER_FILES`, the chat
template included), ``generation_config.json`` and the source ``config.json``'s special token ids,
``residual_in_fp32``, ``max_position_embeddings`` and dtype (:data:`CARRIED_FIELDS`, kept in a
converted checkpoint's :data:`CARRIED_CONFIG_NAME` and written back on export). ``mnemo
generate`` reads them as ``transformers`` does: the prompt starts with the BOS the tokenizer's
post-processor puts first, and the text ends at the declared end-of-text id
(``LanguageModel.generate`` stops there only when given ``eos_token_id``).

The Mamba formats live in :mod:`mnemo.hf.mamba`, Qwen3-Next in :mod:`mnemo.hf.qwen3_next`, the
Llama family in :mod:`mnemo.hf.llama`; this module holds the registry, the folders and the checks
every format shares. An export tries the formats whose ``mixers`` cover the model's, a converted
checkpoint's own format first, then those of fewer mixers first (registration order among equals),
and writes the first that expresses the model exactly (:func:`_export`).

Decoding caches: ``transformers`` keeps the last ``W`` convolution inputs per layer, mnemo the last
``W − 1`` (the oldest one never reaches an output); Mamba-2's ssm state is ``[B, H, P, N]`` there
and ``[B, H, N, P]`` here. :func:`layer_states_from_hf` and :func:`layer_states_to_hf` convert a
cache's per-layer ``(conv_state, ssm_state)`` pairs to mnemo's per-layer states and back.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
import stat
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..data.tokenizer import MNEMO_TOKENIZER_NAME
from ..models.config import ModelConfig
from ..models.formats import register_foreign_loader
from .bamba import export_bamba, import_bamba
from .deepseek import KEEP_FLOAT32 as DEEPSEEK_FLOAT32
from .deepseek import MODEL_TYPES as DEEPSEEK_V3_TYPES
from .deepseek import export_deepseek_v2, export_deepseek_v3, import_deepseek_v2, import_deepseek_v3
from .fields import MULTIPLIER_FIELDS, refuse_unexpressed  # noqa: F401  (MULTIPLIER_FIELDS: this module's API)
from .fla_hub import FORMATS as FLA_FORMATS
from .granite import FORMATS as GRANITE_FORMATS
from .jamba import export_jamba, import_jamba
from .kimi_linear import KEEP_FLOAT32 as KIMI_LINEAR_FLOAT32
from .kimi_linear import export_kimi_linear, import_kimi_linear
from .llama import CLASSES as LLAMA_CLASSES
from .llama import MOE_CLASSES
from .mamba import (  # noqa: F401  (the decoding-cache converters are part of this module's API)
    MAMBA2_KEYS,
    MAMBA_KEYS,
    _is_mamba_ssm,
    export_falcon_mamba,
    export_mamba,
    export_mamba2,
    hf_cache_from_layer_states,
    import_falcon_mamba,
    import_mamba,
    import_mamba2,
    import_mamba_ssm,
    json_float,
    layer_states_from_hf,
    layer_states_of_hf_cache,
    layer_states_to_hf,
)
from .qwen3_next import export_qwen3_next, import_qwen3_next

ImportFn = Callable[[dict, dict[str, Tensor]], tuple[ModelConfig, dict[str, Tensor]]]
ExportFn = Callable[[ModelConfig, dict[str, Tensor]], tuple[dict, dict[str, Tensor]]]

#: tokenizer files copied next to a converted or exported checkpoint, when present
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",  # a tokenizer's chat template (transformers 5; before: in tokenizer_config.json)
)
#: other files of a checkpoint folder that convert and export copy as they are, when present:
#: ``transformers``' generation defaults (bos / eos / pad ids, sampling settings)
CARRIED_FILES = ("generation_config.json",)
#: ``config.json`` fields that the mnemo model does not use but that :func:`convert` keeps (those the
#: source has) in :data:`CARRIED_CONFIG_NAME` and :func:`export_hf` writes back: the special token
#: ids, Mamba's ``residual_in_fp32`` (how ``transformers`` adds the residual in bf16/fp16; mnemo
#: computes a converted model in float32, where it changes nothing), ``max_position_embeddings`` (the
#: RoPE classes' context, which no frequency mnemo imports depends on) and ``dtype`` (the source's
#: weight dtype — its ``dtype`` / legacy ``torch_dtype`` field, else its weights' — kept only where
#: it is not float32: a converted checkpoint stores float32, and an export writes the source's dtype
#: back, :func:`export_hf`)
CARRIED_FIELDS = (
    "bos_token_id", "eos_token_id", "pad_token_id", "residual_in_fp32", "max_position_embeddings", "dtype",
)  # fmt: skip
#: the weight dtypes a carried ``dtype`` may name (``torch.<name>``)
DTYPE_NAMES = ("float32", "float64", "bfloat16", "float16")
#: the file of a converted mnemo checkpoint holding :data:`CARRIED_FIELDS`:
#: ``{"source_architecture": NAME, "fields": {FIELD: VALUE, ...}}``
CARRIED_CONFIG_NAME = "hf_config_carried.json"
#: the special token ids among :data:`CARRIED_FIELDS`
TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")
#: the ``model_type`` of mnemo's own config.json (a config without one is mnemo's too)
MNEMO_MODEL_TYPE = "mnemo"


@dataclass(frozen=True)
class Architecture:
    """One foreign checkpoint format: how to recognise it and how to convert it.

    ``import_fn(hf_config, weights) -> (ModelConfig, state_dict)``;
    ``export_fn(config, state_dict) -> (hf_config, weights)`` (``None``: import only);
    ``mixers``: the mnemo mixer names an export can express (used to pick the exporter);
    ``detect(config) -> bool`` recognises a config without ``architectures`` / ``model_type``;
    ``multipliers``: whether the format carries IBM Granite's ``embedding_multiplier``,
    ``residual_multiplier``, ``logits_scaling`` and the attention's ``softmax_scale`` (every other
    format's export refuses a model that sets them: :func:`_refuse_multipliers`);
    ``mlp_only_layers``: whether the format expresses dense layers among mixture-of-experts ones
    (:attr:`ModelConfig.mlp_only_layers <mnemo.models.ModelConfig>`; every other format's export
    refuses a model that has them); ``softmax_scale``: the mixers whose ``softmax_scale`` the format
    carries itself (its export checks the value: DeepSeek-V3's YaRN ``mscale²`` on MLA), besides the
    ``multipliers`` formats; ``other_model_types``: further ``model_type`` values a config naming the
    class may have (Kimi K2's ``"kimi_k2"`` for ``DeepseekV3ForCausalLM``); ``keep_float32``: the ends
    of the exported weights' names written in float32 whatever the export's dtype, besides
    :data:`KEEP_FLOAT32` (the class's ``_keep_in_fp32_modules_strict``)."""

    name: str
    model_type: str | None
    import_fn: ImportFn
    export_fn: ExportFn | None
    mixers: frozenset[str]
    detect: Callable[[dict], bool] | None
    multipliers: bool = False
    mlp_only_layers: bool = False
    softmax_scale: frozenset[str] = frozenset()
    other_model_types: frozenset[str] = frozenset()
    keep_float32: tuple[str, ...] = ()


#: registered formats, by name (see :func:`register_architecture`)
ARCHITECTURES: dict[str, Architecture] = {}


def register_architecture(
    name: str,
    *,
    import_fn: ImportFn,
    export_fn: ExportFn | None = None,
    model_type: str | None = None,
    mixers=(),
    detect: Callable[[dict], bool] | None = None,
    multipliers: bool = False,
    mlp_only_layers: bool = False,
    softmax_scale=(),
    other_model_types=(),
    keep_float32: tuple[str, ...] = (),
) -> Architecture:
    """Register (or replace) a checkpoint format under ``name`` (a ``transformers`` class name
    such as ``"MambaForCausalLM"``, or a layout's name). Returns the entry."""
    arch = Architecture(
        name,
        model_type,
        import_fn,
        export_fn,
        frozenset(mixers),
        detect,
        multipliers,
        mlp_only_layers,
        frozenset(softmax_scale),
        frozenset(other_model_types),
        tuple(keep_float32),
    )
    ARCHITECTURES[name] = arch
    return arch


def _supported() -> str:
    return ", ".join(
        f"{a.name}" + (f" (model_type {a.model_type!r})" if a.model_type else "")
        for a in ARCHITECTURES.values()
    )


def find_architecture(hf_config: dict) -> Architecture | None:
    """The registered format of ``hf_config``; ``None`` for mnemo's own config (``model_type``
    ``"mnemo"``, or none of ``architectures`` / ``model_type`` and no ``detect`` match).

    Raises ``ValueError`` naming the architecture and listing the supported ones when the config is
    a foreign one that is not registered — also when its ``model_type`` is a registered one but its
    ``architectures`` name another class of it (``MambaModel``: the backbone without its
    language-model head) — or when ``architectures`` is not a list of class names."""
    if not isinstance(hf_config, dict):
        raise ValueError(f"config: expected a JSON object, got {type(hf_config).__name__}")
    model_type = hf_config.get("model_type")
    if model_type == MNEMO_MODEL_TYPE:
        return None
    names = hf_config.get("architectures") or []
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(
            f"config: field 'architectures': expected a list of class names such as "
            f"['Mamba2ForCausalLM'], got {names!r}"
        )
    for n in names:
        if n in ARCHITECTURES:
            a = ARCHITECTURES[n]
            known = {a.model_type, *a.other_model_types}
            if model_type is not None and a.model_type is not None and model_type not in known:
                raise ValueError(
                    f"config: architectures names {n} (model_type "
                    f"{' or '.join(repr(t) for t in [a.model_type, *sorted(a.other_model_types)])}) but "
                    f"model_type is {model_type!r}: the config contradicts itself; fix one of the two"
                )
            return a
    if model_type is not None:
        for a in ARCHITECTURES.values():
            if model_type == a.model_type or model_type in a.other_model_types:
                if names:  # another class of the same family: its weights are not the ones read here
                    raise ValueError(
                        f"unsupported architecture {', '.join(names)} (model_type {model_type!r}): of "
                        f"model_type {model_type!r} mnemo reads {a.name}, the language model with its "
                        f"head (lm_head); {', '.join(names)} is another class (a backbone without the head, "
                        f"or another head). Save the {a.name} instead; supported: {_supported()}"
                    )
                return a
    if names or model_type is not None:
        raise ValueError(
            f"unsupported architecture {', '.join(names) or '?'} (model_type {model_type!r}); "
            f"supported: {_supported()}"
        )
    for a in ARCHITECTURES.values():
        if a.detect is not None and a.detect(hf_config):
            return a
    return None


def is_foreign_checkpoint(directory: str | Path) -> bool:
    """Whether ``directory/config.json`` is another library's config (a registered one or not);
    ``False`` for mnemo's own, a missing file or one that is not JSON (left to the caller)."""
    p = Path(directory) / "config.json"
    try:
        cfg = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return False
    if not isinstance(cfg, dict) or cfg.get("model_type") == MNEMO_MODEL_TYPE:
        return False
    if cfg.get("architectures") or cfg.get("model_type") is not None:
        return True
    return any(a.detect is not None and a.detect(cfg) for a in ARCHITECTURES.values())


# --- reading and writing folders ----------------------------------------------------------------


def load_weights(directory: str | Path) -> dict[str, Tensor]:
    """All tensors of the checkpoint in ``directory``: ``model.safetensors``, sharded safetensors
    (``model.safetensors.index.json``), ``pytorch_model.bin`` or its sharded index."""
    from safetensors.torch import load_file as _load_file

    def load_file(path: str) -> dict[str, Tensor]:
        try:
            return _load_file(path)
        except Exception as e:  # safetensors raises several error types for damaged files
            raise ValueError(f"corrupt or unreadable weights file {path}: {e}") from e

    def load_bin(path) -> dict:
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # a truncated zip, a pickle that is not a state dict, ...
            raise ValueError(f"corrupt or unreadable weights file {path}: {e}") from e

    d = Path(directory)
    if (d / "model.safetensors").is_file():
        return dict(load_file(str(d / "model.safetensors")))
    for index, loader in (
        ("model.safetensors.index.json", lambda p: load_file(str(p))),
        ("pytorch_model.bin.index.json", load_bin),
    ):
        if (d / index).is_file():
            weight_map = _weight_map(d / index)
            out: dict[str, Tensor] = {}
            for shard in sorted(set(weight_map.values())):
                if not (d / shard).is_file():
                    raise FileNotFoundError(f"checkpoint shard missing: {d / shard} (listed in {d / index})")
                out.update(loader(d / shard))
            return out
    if (d / "pytorch_model.bin").is_file():
        sd = load_bin(d / "pytorch_model.bin")
        if isinstance(sd, dict) and isinstance(sd.get("state_dict"), dict):
            sd = sd["state_dict"]
        return dict(sd)
    raise FileNotFoundError(
        f"no weights in {d}: expected model.safetensors, model.safetensors.index.json, "
        "pytorch_model.bin or pytorch_model.bin.index.json"
    )


def _weight_map(index: Path) -> dict[str, str]:
    """The ``weight_map`` of a sharded checkpoint's index file: ``ValueError`` naming the file when
    it is not JSON or holds no ``{"weight_map": {weight name: shard file}}``."""
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"corrupt index file {index}: not JSON ({e})") from None
    wm = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(wm, dict) or not wm or not all(isinstance(v, str) for v in wm.values()):
        raise ValueError(
            f"corrupt index file {index}: expected a JSON object with a non-empty 'weight_map' "
            f"(weight name → shard file), got {json.dumps(data)[:120]}"
        )
    return wm


def import_hf(src: str | Path) -> tuple[ModelConfig, dict[str, Tensor], list[Path]]:
    """Read the foreign checkpoint folder ``src``: returns ``(config, state_dict, tokenizer_files)``
    where ``state_dict`` loads into ``LanguageModel(config)`` with ``strict=True`` and
    ``tokenizer_files`` are the tokenizer files present in ``src``.

    Raises ``FileNotFoundError`` (no config / weights) or ``ValueError`` naming an unsupported
    architecture or option, a field of the wrong kind (expected vs received), a corrupt file, or a
    weight whose shape the config contradicts (with the config fields that set it)."""
    imported = _import(src)
    return imported.config, imported.state, imported.tokenizer_files


@dataclass(frozen=True)
class _Imported:
    arch: Architecture
    config: ModelConfig
    state: dict[str, Tensor]
    tokenizer_files: list[Path]
    carried: dict  # the source config's CARRIED_FIELDS (those it has)


def _import(src: str | Path) -> _Imported:
    d = Path(src)
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        if (d / "latest").is_file():
            raise ValueError(
                f"{d} is a mnemo training run, not a foreign checkpoint: mnemo loads it as it is "
                f"(--checkpoint {d}, LanguageModel.from_pretrained); `mnemo export` writes it "
                "for transformers"
            )
        raise FileNotFoundError(f"checkpoint file missing: {cfg_path}")
    try:
        hf_config = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"corrupt config {cfg_path}: not JSON ({e})") from e
    arch = find_architecture(hf_config)
    if arch is None:
        raise ValueError(
            f"{cfg_path} is not a foreign checkpoint config (it looks like mnemo's own); "
            f"supported: {_supported()}"
        )
    _check_fields(cfg_path, hf_config)
    quant = hf_config.get("quantization_config")
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else None
        raise ValueError(
            f"{cfg_path}: field 'quantization_config' (quant_method {method!r}): quantized checkpoints are "
            "not supported (their weights are packed integers and scales, not the model's weights): "
            "dequantize first (with transformers: load the model, model.dequantize() where its "
            "quantizer has it, save_pretrained) and convert that"
        )
    weights = load_weights(d)
    try:
        config, state = arch.import_fn(hf_config, weights)
    except KeyError as e:
        raise ValueError(f"{cfg_path}: the {arch.name} config has no field {e.args[0]!r}") from None
    except TypeError as e:  # a field of the wrong kind met by int()/float()
        raise ValueError(f"{cfg_path}: a field of the {arch.name} config has the wrong kind: {e}") from None
    _check_state(config, state, arch.name)
    names = (*TOKENIZER_FILES, MNEMO_TOKENIZER_NAME)  # the last: mnemo's own, as `export_hf` names it
    files = [d / n for n in names if (d / n).is_file()]
    return _Imported(arch, config, state, files, _source_carried(cfg_path, hf_config, weights))


def _source_carried(where, hf_config: dict, weights: dict[str, Tensor] | None = None) -> dict:
    """The :data:`CARRIED_FIELDS` of a source ``config.json`` (:func:`_carried_fields`): ``dtype`` read
    as ``transformers`` reads it (``dtype``, else the legacy ``torch_dtype``, else the dtype of most
    of ``weights``' floating elements, when given), kept only when it is one of :data:`DTYPE_NAMES`
    other than float32 (another name, which no export could write, is not carried); a null
    ``max_position_embeddings`` is left out (the class's default)."""
    fields = {k: hf_config[k] for k in CARRIED_FIELDS if k in hf_config}
    dtype = hf_config.get("dtype") or hf_config.get("torch_dtype")
    if dtype is None and weights:
        dtype = str(weights_dtype(weights)).removeprefix("torch.")
    fields.pop("dtype", None)
    if dtype in DTYPE_NAMES and dtype != "float32":
        fields["dtype"] = dtype
    if fields.get("max_position_embeddings", 0) is None:
        del fields["max_position_embeddings"]
    return _carried_fields(where, fields)


def weights_dtype(weights: dict[str, Tensor]) -> torch.dtype | None:
    """The dtype of most of ``weights``' floating elements (``None``: none is floating)."""
    count: dict[torch.dtype, int] = {}
    for v in weights.values():
        if v.is_floating_point():
            count[v.dtype] = count.get(v.dtype, 0) + v.numel()
    return max(count, key=count.get) if count else None


def _carried_fields(where, fields: dict) -> dict:
    """The :data:`CARRIED_FIELDS` that ``fields`` (a config) has, checked: a token id is an int or
    null (``eos_token_id`` also a list of ints, as ``transformers`` allows); ``residual_in_fp32`` is
    true or false; ``max_position_embeddings`` a positive int; ``dtype`` one of :data:`DTYPE_NAMES`.
    ``ValueError`` naming the field and the received value otherwise."""
    out = {}
    for k in CARRIED_FIELDS:
        if k not in fields:
            continue
        v = fields[k]
        if k in TOKEN_ID_FIELDS:
            many = k == "eos_token_id" and isinstance(v, list) and v and all(map(_is_int, v))
            if not (v is None or _is_int(v) or many):
                kinds = "an int, a list of ints or null" if k == "eos_token_id" else "an int or null"
                raise ValueError(f"{where}: field {k!r}: expected a token id ({kinds}), got {v!r}")
        elif k == "max_position_embeddings":
            if not _is_int(v) or v < 1:
                raise ValueError(f"{where}: field {k!r}: expected a positive int, got {v!r}")
        elif k == "dtype":
            if v not in DTYPE_NAMES:
                raise ValueError(f"{where}: field 'dtype': expected one of {list(DTYPE_NAMES)}, got {v!r}")
        elif not isinstance(v, bool):
            raise ValueError(f"{where}: field {k!r}: expected true or false, got {v!r}")
        out[k] = v
    return out


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


#: config fields that are sizes or counts wherever they appear (checked before any importer reads them)
_POSITIVE_INT_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "state_size",
    "conv_kernel",
    "num_heads",
    "n_groups",
    "vocab_size",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "full_attention_interval",
    "chunk_size",
)


#: config fields that are positive numbers wherever they appear
_POSITIVE_FLOAT_FIELDS = (
    "layer_norm_epsilon",
    "rms_norm_eps",
    "norm_epsilon",
    "rope_theta",
    "partial_rotary_factor",
    "time_step_min",
    "time_step_max",
)


#: config fields that are non-negative numbers wherever they appear
_NONNEG_FLOAT_FIELDS = ("time_step_floor", "time_step_init_scale")

#: config fields that are true/false wherever they appear (a string "yes" is not read as true)
_BOOL_FIELDS = (
    "tie_word_embeddings",
    "rms_norm",
    "residual_in_fp32",
    "use_bias",
    "use_conv_bias",
    "attention_bias",
    "norm_topk_prob",
)


def _check_fields(path: Path, hf_config: dict) -> None:
    for k in _BOOL_FIELDS:
        v = hf_config.get(k)
        if v is not None and not isinstance(v, bool):
            raise ValueError(f"{path}: field {k!r}: expected true or false, got {v!r}")
    if hf_config.get("rms_norm") is False:
        raise ValueError(
            f"{path}: field 'rms_norm': false (LayerNorm) is not supported: mnemo's blocks use RMSNorm"
        )
    for k in _NONNEG_FLOAT_FIELDS:
        v = hf_config.get(k)
        real = isinstance(v, (int, float)) and not isinstance(v, bool)
        if v is not None and not (real and 0 <= v < math.inf):
            raise ValueError(f"{path}: field {k!r}: expected a number >= 0, got {v!r}")
    rank = hf_config.get("time_step_rank")
    if rank not in (None, "auto") and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 1):
        raise ValueError(f"{path}: field 'time_step_rank': expected a positive int or \"auto\", got {rank!r}")
    for k in ("hidden_size", "num_hidden_layers"):  # every importer needs these two
        if k in hf_config and hf_config[k] is None:
            raise ValueError(f"{path}: field {k!r}: expected a positive int, got None")
    for k in _POSITIVE_INT_FIELDS:
        v = hf_config.get(k)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"{path}: field {k!r}: expected a positive int, got {v!r}")
    for k in _POSITIVE_FLOAT_FIELDS:
        v = hf_config.get(k)
        if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v < math.inf):
            raise ValueError(f"{path}: field {k!r}: expected a positive number, got {v!r}")


def check_not_source(out: str | Path, *sources: str | Path) -> None:
    """Refuse an output folder that is a source or lies inside one (a run folder, the checkpoint
    it resolves to): writing there would replace or mix with what is being read."""
    o = Path(out).resolve()
    for src in sources:
        if src is None:
            continue
        s = Path(src).resolve()
        if o == s or s in o.parents:
            raise ValueError(
                f"OUT: {out} is {'the source' if o == s else 'inside the source'} {src}; writing there "
                "would overwrite what is read (--force does not change that): pick another folder"
            )


def _refuse_out_holding_source(out: str | Path, *sources: str | Path) -> None:
    """Refuse an output folder that holds a source: ``force`` replaces ``OUT`` whole, which would
    delete the source read (the conversion, done in memory, would succeed and the source be gone)."""
    o = Path(out).resolve()
    for src in sources:
        if src is not None and o in Path(src).resolve().parents:
            raise ValueError(
                f"OUT: {out} holds the source {src}; replacing OUT (--force) would delete it: "
                "pick another folder, or move the source out first"
            )


def _refuse_run_out(o: Path) -> None:
    """Refuse ``o`` when it belongs to a training run: a run's folder, or one of its checkpoints or
    inside one. The marks are the ones mnemo already checks: the run files that
    :meth:`~mnemo.models.LanguageModel.save_pretrained` refuses to write among
    (``mnemo.models.lm._RUN_FILES``: ``latest``, ``metrics.jsonl``, ``.lock``, ``trainer_state.pt``,
    ``manifest.json``) and the commands' ``OUT`` check (:func:`mnemo.argtypes.checkpoint_around`)."""
    from ..argtypes import checkpoint_around
    from ..models.lm import _RUN_FILES

    if (o / "latest").is_file():  # files at a run's root would hide its checkpoints
        raise ValueError(
            f"OUT: {o} is a training run folder; --force does not write into one: pick another folder"
        )
    owned = [n for n in _RUN_FILES if (o / n).exists()]
    ckpt = checkpoint_around(o.resolve())
    if owned or ckpt is not None:
        why = f"it holds {', '.join(owned)}" if owned else f"it lies inside the checkpoint {ckpt}"
        raise ValueError(
            f"OUT: {o} belongs to a training run ({why}); writing there would replace the run's own "
            "files (--force does not change that): pick another folder"
        )


def _prepare_out(out: str | Path, force: bool) -> Path:
    """The folder to write (a link: the folder it points to), after the checks: not a file, not a
    training run's (:func:`_refuse_run_out`), and either empty or, with ``force``, a checkpoint
    folder (one holding ``config.json``) that is not the current folder nor holds it, which is
    replaced whole. Creates nothing; ``ValueError`` naming ``OUT`` otherwise."""
    o = Path(out)
    if o.is_symlink():
        o = o.resolve()
    if o.exists() and not o.is_dir():
        raise ValueError(f"OUT: {o} exists and is not a folder")
    _refuse_run_out(o)
    held = sorted(p.name for p in o.iterdir()) if o.is_dir() else []
    if held and not force:
        raise ValueError(f"output folder {o} is not empty (use --force / force=True to replace it)")
    if held and not (o / "config.json").is_file():
        shown = ", ".join(held[:6]) + (f" and {len(held) - 6} more" if len(held) > 6 else "")
        raise ValueError(
            f"OUT: {o} holds {shown} but no config.json, so it is not a checkpoint folder; --force "
            "replaces a checkpoint folder whole and would delete these: pick another folder"
        )
    here = Path.cwd().resolve()
    if held and (here == o.resolve() or o.resolve() in here.parents):
        raise ValueError(
            f"OUT: {o} is the current folder or holds it; --force replaces OUT whole, which would leave "
            "this shell in a deleted folder: run the command from outside it"
        )
    return o


def _write_folder(o: Path, write: Callable[[Path], None]) -> None:
    """Write the folder ``o`` all at once: ``write(tmp)`` fills a fresh hidden temporary folder,
    whose content then takes ``o``'s place. The temporary folder is a sibling of ``o``, which it
    replaces by a rename (an existing ``o`` is set aside and removed once the new folder is in
    place) — except where ``o`` must stay the folder it is: an empty ``o`` (the current folder,
    say) or a mount point (a volume: no rename crosses its boundary) gets the temporary folder
    inside it, and its entries are swapped in place (a previous content set aside inside it first).
    When ``write`` or the move fails, ``o`` is left as it was and the temporary folder is removed; a
    failure of the file system (a full disk, a file size limit, a permission; ``safetensors``' I/O
    errors included) raises ``OSError`` saying so, anything else propagates."""
    from safetensors import SafetensorError

    o = Path(os.path.abspath(o))
    existed = o.exists()
    kept = f"{o} was left as it was" if existed else f"{o} was not created"
    o.parent.mkdir(parents=True, exist_ok=True)
    inside = existed and (not any(o.iterdir()) or os.path.ismount(o))
    tmp = _fresh_sibling(o / "mnemo" if inside else o, "partial")  # inside: o/.mnemo.partial-…
    old = None
    try:
        write(tmp)
        if inside:
            held = [p for p in o.iterdir() if p != tmp]
            if held:  # a mount point's previous content: set aside inside it
                old = _fresh_sibling(o / "mnemo", "old")
                for p in held:
                    os.rename(p, old / p.name)
            _move_entries(tmp, o)
            tmp.rmdir()
        else:
            if existed:  # keep the folder's permissions
                os.chmod(tmp, stat.S_IMODE(o.stat().st_mode))
                old = o.parent / f".{o.name}.old-{secrets.token_hex(4)}"
                os.rename(o, old)
            os.rename(tmp, o)
    except BaseException as e:
        if old is not None and inside:
            kept = _restore_inside(o, old, tmp, kept)
        elif old is not None and not o.exists():
            os.rename(old, o)
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, (OSError, SafetensorError)):
            raise OSError(f"writing {o} failed ({e}); {kept} (the partial copy was removed)") from e
        raise
    if old is not None:
        try:
            shutil.rmtree(old)
        except OSError as e:
            warnings.warn(
                f"{o} was written, but its previous content, set aside as {old}, could not be removed "
                f"({e}): delete it by hand",
                stacklevel=3,
            )


def _restore_inside(o: Path, old: Path, tmp: Path, kept: str) -> str:
    """Put back the previous content of ``o`` set aside in ``old`` (inside ``o``) after a failed
    in-place swap: an entry of the new content still in ``o`` under the same name goes back to
    ``tmp`` first. ``old`` is removed only once every entry is back; otherwise it stays, and the
    returned sentence (``kept`` when all went back) says where the previous content is."""
    for p in list(old.iterdir()):
        dst = o / p.name
        try:
            if dst.exists() or dst.is_symlink():
                os.rename(dst, tmp / p.name)
            os.rename(p, dst)
        except OSError:
            continue
    if any(old.iterdir()):
        return f"its previous content is kept, partly, in {old} (move it back by hand)"
    old.rmdir()
    return kept


def _move_entries(src: Path, dst: Path) -> None:
    """Move every entry of ``src`` into ``dst``, which holds none of their names (``config.json``
    last, so that ``dst`` is a checkpoint only once its weights are there); on a failure the entries
    moved so far go back, leaving ``dst`` as it was, and the error propagates."""
    names = sorted((p.name for p in src.iterdir()), key=lambda n: n == "config.json")
    moved: list[str] = []
    try:
        for n in names:
            os.rename(src / n, dst / n)
            moved.append(n)
    except BaseException:
        for n in moved:
            os.rename(dst / n, src / n)
        raise


def _fresh_sibling(o: Path, tag: str) -> Path:
    """A new empty folder next to ``o``, hidden (``.NAME.TAG-XXXXXXXX``), made with the usual
    permissions (the umask's)."""
    while True:
        p = o.parent / f".{o.name}.{tag}-{secrets.token_hex(4)}"
        try:
            p.mkdir()
            return p
        except FileExistsError:
            continue


def convert(src: str | Path, out: str | Path, *, force: bool = False) -> Path:
    """Convert the foreign checkpoint ``src`` into a mnemo checkpoint folder ``out``:
    ``config.json``, ``model.safetensors``, the tokenizer files of ``src`` (:data:`TOKENIZER_FILES`,
    the chat template included), its :data:`CARRIED_FILES` (``generation_config.json``) and
    :data:`CARRIED_CONFIG_NAME` with those of :data:`CARRIED_FIELDS` (the bos / eos / pad token
    ids, ``residual_in_fp32``) that its ``config.json`` has, which :func:`export_hf` writes back.
    ``mnemo generate`` stops at the end-of-text id they declare (``--ignore-eos``: it does not);
    ``LanguageModel.generate`` stops only when given ``eos_token_id``; ``MnemoForCausalLM.generate``
    (which equals it) stops there too, as ``MnemoForCausalLM.from_pretrained`` sets its
    ``generation_config`` from them (as ``transformers`` does for the source class).

    The weights are stored in float32 whatever the source's dtype (a bfloat16 source doubles in
    size): the model that ``LanguageModel`` builds and that the exactness bounds were measured on,
    which every loader reads as it reads the source folder itself (``LanguageModel.from_pretrained``
    of either gives float32) and which fine-tuning needs; the source dtype is carried
    (:data:`CARRIED_FIELDS`), so :func:`export_hf` writes it back.

    The folder is written whole into a temporary sibling and moved into place when complete:
    ``out`` must be empty or new, or with ``force`` a checkpoint folder (holding ``config.json``)
    that is replaced once the new one is complete. Returns ``out``.

    Raises ``FileNotFoundError`` / ``ValueError`` as :func:`import_hf` does; ``ValueError`` for an
    ``out`` that is ``src``, inside it or holds it, a training run's folder or one of its checkpoints
    (``force`` or not), not empty without ``force``, or with ``force`` not a checkpoint folder or
    the current folder; ``OSError`` when writing fails (``out`` is then left as it was)."""
    from ..models.lm import LanguageModel

    check_not_source(out, src)
    _refuse_out_holding_source(out, src)
    imported = _import(src)
    o = _prepare_out(out, force)
    model = LanguageModel(imported.config)
    model.load_state_dict(imported.state, strict=True)
    tok = imported.tokenizer_files
    names = {f.name for f in tok}
    carried_files = [Path(src) / n for n in CARRIED_FILES if (Path(src) / n).is_file()]

    def write(d: Path) -> None:
        model.save_pretrained(d)
        for f in tok:
            # mnemo's own char/byte tokenizer, renamed on export, gets its checkpoint name back
            # unless a Hugging Face tokenizer.json came with it
            back = f.name == MNEMO_TOKENIZER_NAME and "tokenizer.json" not in names
            shutil.copy2(f, d / ("tokenizer.json" if back else f.name))
        for f in carried_files:
            shutil.copy2(f, d / f.name)
        record = {"source_architecture": imported.arch.name, "fields": imported.carried}
        (d / CARRIED_CONFIG_NAME).write_text(json.dumps(record, indent=2) + "\n")

    _write_folder(o, write)
    if not tok:
        _warn_no_tokenizer(src, o)
    return Path(out)


def _warn_no_tokenizer(src, out: Path, export: bool = False) -> None:
    """``src`` held no tokenizer file, so ``out`` has none: said, with what reads one and how to give
    it (``export``: ``out`` is a folder for ``transformers``, else a mnemo checkpoint)."""
    mnemo_reads = (
        f"`mnemo generate` and `mnemo eval` with --checkpoint {out} read {Path(out) / 'tokenizer.json'}"
    )
    if export:
        needs = (
            f"transformers' AutoTokenizer.from_pretrained({str(out)!r}) reads its tokenizer files "
            f"(tokenizer.json, tokenizer_config.json, special_tokens_map.json, ...), and {mnemo_reads}: "
            "copy the model's tokenizer files into it"
        )
    else:
        needs = (
            f"{mnemo_reads} (a Hugging Face tokenizers file or mnemo's char/byte one): copy the source "
            "model's tokenizer.json into it"
        )
    warnings.warn(
        f"{src} holds no tokenizer ({', '.join((*TOKENIZER_FILES, MNEMO_TOKENIZER_NAME))}), so {out} has "
        f"none: {needs}",
        stacklevel=3,
    )


def export_hf(ckpt, out: str | Path, *, force: bool = False, dtype=None) -> Path:
    """Write the mnemo model ``ckpt`` (a checkpoint folder or a ``LanguageModel``) as a folder that
    ``transformers`` loads with its own class (``config.json`` with ``architectures`` and ``dtype``,
    ``model.safetensors``; from a ``ckpt`` folder also its tokenizer files, the chat template
    included, and its ``generation_config.json``). A tied model's file holds no ``lm_head.weight``
    (as ``save_pretrained`` writes one).

    ``dtype``: the weights' dtype on disk — ``None`` (default): a converted checkpoint's source
    dtype (carried ``dtype``: a bfloat16 source comes back in bfloat16, its own values if the model
    was not trained since, as float32 holds every bfloat16 exactly), else the model's own; a
    ``torch.dtype`` or one of :data:`DTYPE_NAMES` casts to it (``ValueError`` naming ``dtype``
    otherwise).

    ``config.json`` is written as ``transformers`` writes it (an infinite float, such as
    Mamba-2's default ``time_step_limit`` bound, as ``{"__float__": "Infinity"}``). The special
    token ids: a checkpoint made by :func:`convert` gets its source's back (with
    ``residual_in_fp32`` and ``max_position_embeddings`` where the class has them;
    :data:`CARRIED_CONFIG_NAME`; one its source left out stays out, so the
    class's default applies as it did there); otherwise ``eos_token_id`` is the end-of-text
    token of the checkpoint's Hugging Face tokenizer and every id it does not know is written as
    null (the target class's defaults, such as Mamba's ``eos_token_id = 0``, would make real tokens
    special). ``transformers``' ``generate`` on the export stops at ``eos_token_id``; mnemo's
    ``LanguageModel.generate`` when given ``eos_token_id``.

    The folder is written whole into a temporary sibling and moved into place when complete:
    ``out`` must be empty or new, or with ``force`` a checkpoint folder (holding ``config.json``)
    that is replaced once the new one is complete. Returns ``out``.

    Raises ``ValueError`` naming what the target class cannot express, or for an ``out`` that is
    the source, inside it or holds it, a training run's folder or one of its checkpoints (``force`` or not),
    not empty without ``force``, or with ``force`` not a checkpoint folder or the current folder;
    ``OSError`` when writing fails (``out`` is then left as it was)."""
    from safetensors.torch import save_file

    from ..models.lm import LanguageModel

    if dtype is not None:
        name = str(dtype).removeprefix("torch.")
        if name not in DTYPE_NAMES:
            raise ValueError(
                f"dtype: expected one of {list(DTYPE_NAMES)} (or the torch.dtype), got {dtype!r}"
            )
        dtype = getattr(torch, name)
    if isinstance(ckpt, LanguageModel):
        model, src = ckpt, None
    else:
        from ..train import resolve_checkpoint

        src = resolve_checkpoint(ckpt)  # a run folder means its latest intact checkpoint
        check_not_source(out, ckpt, src)
        _refuse_out_holding_source(out, ckpt, src)
        model = LanguageModel.from_pretrained(src)
    config = model.config
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    arch, hf_config, hf_weights = _export(config, weights, _source_architecture(src))
    hf_config = {"architectures": [arch.name], **hf_config}
    if "model_type" not in hf_config and arch.model_type:
        hf_config["model_type"] = arch.model_type
    carried = None
    if src is not None and is_foreign_checkpoint(src):  # a transformers folder, converted in memory
        carried = _source_carried(src / "config.json", json.loads((src / "config.json").read_text()))
    elif src is not None:
        carried = _read_carried(src)
    if dtype is None:
        dtype = getattr(torch, carried["dtype"]) if "dtype" in (carried or {}) else weights_dtype(hf_weights)
    hf_weights = {
        k: v.to(dtype) if v.is_floating_point() and not k.endswith(KEEP_FLOAT32 + arch.keep_float32) else v
        for k, v in hf_weights.items()
    }
    if hf_config.get("tie_word_embeddings") and "lm_head.weight" in hf_weights:
        # the shared tensor once, as save_pretrained writes a tied model (the exporter checked that
        # the head is the embedding; transformers ties it again on load)
        del hf_weights["lm_head.weight"]
    hf_config["dtype"] = str(dtype).removeprefix("torch.")
    rope = "rope_parameters" in hf_config  # a RoPE class: it has max_position_embeddings
    for k, v in (carried or {}).items():
        # residual_in_fp32 where the target class has it, max_position_embeddings where it is a RoPE one
        where = k in hf_config if k != "max_position_embeddings" else rope
        if k in TOKEN_ID_FIELDS or (k != "dtype" and where):
            hf_config[k] = v
    if carried is None:  # a model of mnemo's own: the ids its config.json holds (those
        # MnemoForCausalLM.save_pretrained wrote, which AutoConfig reads), else for eos the one its
        # tokenizer knows, null for the others
        own = _own_token_ids(src) if src is not None else {}
        eos = _eos_token_id(src) if src is not None and "eos_token_id" not in own else None
        for k in TOKEN_ID_FIELDS:
            hf_config.setdefault(k, own.get(k, eos if k == "eos_token_id" else None))
    text = json.dumps(_json_safe(hf_config), indent=2, allow_nan=False)
    o = _prepare_out(out, force)
    mnemo_tok = (
        src is not None and (src / "tokenizer.json").is_file() and _is_mnemo_tokenizer(src / "tokenizer.json")
    )

    def write(d: Path) -> None:
        (d / "config.json").write_text(text)
        save_file(
            {k: v.contiguous().clone() for k, v in hf_weights.items()},
            str(d / "model.safetensors"),
            {"format": "pt"},
        )
        if src is None:
            return
        for n in TOKENIZER_FILES:
            if (src / n).is_file():
                # mnemo's char/byte format is not a Hugging Face tokenizer: kept under another name
                # so that transformers' AutoTokenizer does not misread it
                shutil.copy2(
                    src / n, d / (MNEMO_TOKENIZER_NAME if n == "tokenizer.json" and mnemo_tok else n)
                )
        if (src / MNEMO_TOKENIZER_NAME).is_file() and not (src / "tokenizer.json").is_file():
            shutil.copy2(src / MNEMO_TOKENIZER_NAME, d / MNEMO_TOKENIZER_NAME)  # an export exported again
        for n in CARRIED_FILES:
            if (src / n).is_file():
                shutil.copy2(src / n, d / n)

    _write_folder(o, write)
    if mnemo_tok:
        warnings.warn(
            f"{src / 'tokenizer.json'} is mnemo's own char/byte tokenizer, which transformers cannot load; "
            f"written as {o / MNEMO_TOKENIZER_NAME} (mnemo.data.load_tokenizer and `mnemo convert` read it)",
            stacklevel=2,
        )
    if src is not None and not any((o / n).is_file() for n in (*TOKENIZER_FILES, MNEMO_TOKENIZER_NAME)):
        _warn_no_tokenizer(src, o, export=True)
    return Path(out)


def _read_carried(ckpt: Path) -> dict | None:
    """The fields :func:`convert` kept in ``ckpt`` / :data:`CARRIED_CONFIG_NAME` (``None``: no such
    file, a checkpoint of mnemo's own). ``ValueError`` naming the file when it is damaged."""
    p = ckpt / CARRIED_CONFIG_NAME
    if not p.is_file():
        return None
    try:
        record = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"corrupt file {p}: not JSON ({e})") from None
    fields = record.get("fields") if isinstance(record, dict) else None
    if not isinstance(fields, dict):
        raise ValueError(
            f"corrupt file {p}: expected a JSON object with a 'fields' object, got {json.dumps(record)[:120]}"
        )
    unknown = sorted(set(fields) - set(CARRIED_FIELDS))
    if unknown:
        raise ValueError(f"{p}: unknown field(s) {unknown}; expected among {list(CARRIED_FIELDS)}")
    return _carried_fields(p, fields)


def _json_safe(v):
    """``v`` (a config) with every non-finite float as ``transformers`` writes it (:func:`json_float`)."""
    if isinstance(v, dict):
        return {k: _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    return json_float(v)


def _is_mnemo_tokenizer(path: Path) -> bool:
    try:
        return "kind" in json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError):
        return False


def _own_token_ids(ckpt: Path) -> dict:
    """The special ids set in a mnemo ``config.json`` of ``ckpt`` (written by
    ``MnemoForCausalLM.save_pretrained``; ``{}`` for none)."""
    try:
        config = json.loads((ckpt / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(config, dict):
        return {}
    return {k: config[k] for k in TOKEN_ID_FIELDS if config.get(k) is not None}


def _eos_token_id(ckpt: Path) -> int | None:
    """The end-of-text id of a checkpoint's Hugging Face tokenizer (``None`` without one)."""
    p = ckpt / "tokenizer.json"
    if not p.is_file() or _is_mnemo_tokenizer(p):
        return None
    from ..data import load_tokenizer

    return getattr(load_tokenizer(ckpt), "eot_id", None)


def _exporters(config: ModelConfig, prefer: str | None = None) -> list[Architecture]:
    """The formats that may express ``config``: those whose ``mixers`` cover the model's, ``prefer``
    (a converted checkpoint's source format) first, then fewer mixers first (a plain attention
    stack is a Llama-family model before it is a Qwen3-Next hybrid), registration order among
    equals. ``ValueError`` listing the exportable formats when none covers the model's mixers."""
    mixers = set(config.layer_mixers())
    found = [a for a in ARCHITECTURES.values() if a.export_fn is not None and mixers <= a.mixers]
    if not found:
        known = "; ".join(f"{a.name}: {sorted(a.mixers)}" for a in ARCHITECTURES.values() if a.export_fn)
        raise ValueError(
            f"no export format expresses a model of mixers {sorted(mixers)}; exportable: {known}"
        )
    return sorted(found, key=lambda a: (a.name != prefer, len(a.mixers)))


def _export(
    config: ModelConfig, weights: dict[str, Tensor], prefer: str | None = None
) -> tuple[Architecture, dict, dict[str, Tensor]]:
    """``(format, its config dict, its state dict)``: the first of :func:`_exporters` whose export
    expresses the model; where that is not ``prefer`` (a converted checkpoint's source class, which
    refused it: a Qwen2 converted before ``bias="qkv"`` whose zero o bias was trained goes out
    as Llama), a ``UserWarning`` says so and why. ``ValueError`` saying what each candidate cannot
    express otherwise."""
    candidates = _exporters(config, prefer)
    refusals = []
    for arch in candidates:
        try:
            _refuse_multipliers(arch, config)
            found = (arch, *arch.export_fn(config, weights))
        except ValueError as e:
            refusals.append((arch.name, e))
            continue
        if refusals and refusals[0][0] == prefer:
            warnings.warn(
                f"exported as {arch.name}, not as the source's class {prefer}, which cannot express the "
                f"model: {refusals[0][1]}",
                stacklevel=3,
            )
        return found
    mixers = sorted(set(config.layer_mixers()))
    if len(refusals) == 1:
        name, e = refusals[0]
        raise ValueError(
            f"a model of mixers {mixers} exports only as {name} here, which cannot express it: {e}"
        )
    raise ValueError(
        f"a model of mixers {mixers} exports as none of {', '.join(n for n, _ in refusals)}: "
        + "; ".join(f"{n}: {e}" for n, e in refusals)
    )


#: the exported weights kept in float32 whatever the export's dtype, as ``transformers`` keeps them
#: (``_keep_in_fp32_modules_strict``): DeepSeek-V3's router bias, which a bfloat16 copy would round,
#: changing the routing
KEEP_FLOAT32 = ("e_score_correction_bias",)


def _refuse_multipliers(arch: Architecture, config: ModelConfig) -> None:
    """:func:`~mnemo.hf.fields.refuse_unexpressed` for ``arch`` (what its registration says it
    carries), naming the registered formats that do carry Granite's scalars and ``mlp_only_layers``
    (the exporters call it too, without the names)."""
    carried_by = {
        "multipliers": ", ".join(a.name for a in ARCHITECTURES.values() if a.multipliers and a.export_fn)
        or "none",
        "mlp_only_layers": ", ".join(
            a.name for a in ARCHITECTURES.values() if a.mlp_only_layers and a.export_fn
        )
        or "none",
    }
    refuse_unexpressed(
        arch.name,
        config,
        multipliers=arch.multipliers,
        mlp_only_layers=arch.mlp_only_layers,
        softmax_scale=arch.softmax_scale,
        carried_by=carried_by,
    )


def _source_architecture(src: Path | None) -> str | None:
    """The format a converted checkpoint ``src`` came from (its :data:`CARRIED_CONFIG_NAME`'s
    ``source_architecture``, or the class a foreign folder names); ``None`` for anything else."""
    if src is None:
        return None
    try:
        if is_foreign_checkpoint(src):
            a = find_architecture(json.loads((src / "config.json").read_text(encoding="utf-8")))
            return a.name if a is not None else None
        record = json.loads((src / CARRIED_CONFIG_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # no such file, not JSON, an unregistered class: no preference
        return None
    name = record.get("source_architecture") if isinstance(record, dict) else None
    return name if isinstance(name, str) else None


def _check_state(config: ModelConfig, state: dict[str, Tensor], where: str) -> None:
    """Every key and shape of ``LanguageModel(config)``'s state dict, and nothing else."""
    from ..models.lm import LanguageModel

    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in LanguageModel(config).state_dict().items()}
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing or extra:
        raise ValueError(
            f"{where}: weights do not match the model: missing {missing[:8]}, unexpected {extra[:8]}"
        )
    for k, shape in expected.items():
        if tuple(state[k].shape) != shape:
            raise ValueError(f"{where}: weight {k} has shape {list(state[k].shape)}, expected {list(shape)}")


# --- the registry -------------------------------------------------------------------------------

register_architecture(
    "MambaForCausalLM", model_type="mamba", import_fn=import_mamba, export_fn=export_mamba, mixers={"mamba"}
)
register_architecture(
    "Mamba2ForCausalLM",
    model_type="mamba2",
    import_fn=import_mamba2,
    export_fn=export_mamba2,
    mixers={"mamba2"},
)
register_architecture("mamba_ssm", import_fn=import_mamba_ssm, detect=_is_mamba_ssm)

# Qwen3-Next: gated DeltaNet + gated attention hybrids with dense MLPs (mnemo/hf/qwen3_next.py)

register_architecture(
    "Qwen3NextForCausalLM",
    model_type="qwen3_next",
    import_fn=import_qwen3_next,
    export_fn=export_qwen3_next,
    mixers={"gated_deltanet", "attention"},
)

# the dense Llama family: Llama, Mistral, Qwen3, Qwen2 (mnemo/hf/llama.py), in the order an export of
# mnemo's own attention stack tries them

# and their mixture-of-experts relatives: Mixtral, Qwen3-MoE, Qwen2-MoE (mnemo/hf/llama.py), which an
# export of a mlp="moe" attention stack tries in that order (the dense classes refuse it)

for _c, _import_fn, _export_fn in (*LLAMA_CLASSES, *MOE_CLASSES):
    register_architecture(
        _c.arch,
        model_type=_c.model_type,
        import_fn=_import_fn,
        export_fn=_export_fn,
        mixers={"attention"},
        mlp_only_layers=_c.moe is not None and _c.moe.sparse_step,  # (Qwen's mlp_only_layers)
    )

# FalconMamba (Mamba-1 with dt, B, C RMS-normalised: mnemo/hf/mamba.py) and Bamba (Mamba-2 + attention
# with SwiGLU MLPs: mnemo/hf/bamba.py); registered after the classes a plain Mamba or attention stack
# exports as

register_architecture(
    "FalconMambaForCausalLM",
    model_type="falcon_mamba",
    import_fn=import_falcon_mamba,
    export_fn=export_falcon_mamba,
    mixers={"mamba"},
)
register_architecture(
    "BambaForCausalLM",
    model_type="bamba",
    import_fn=import_bamba,
    export_fn=export_bamba,
    mixers={"mamba2", "attention"},
)

# IBM Granite: Granite 4.0-H (Mamba-2 + attention, SwiGLU or MoE + shared MLP) and dense Granite, the
# only formats that carry Granite's multipliers and the attention's softmax_scale (mnemo/hf/granite.py)

for _name, _model_type, _import_fn, _export_fn, _mixers in GRANITE_FORMATS:
    register_architecture(
        _name,
        model_type=_model_type,
        import_fn=_import_fn,
        export_fn=_export_fn,
        mixers=_mixers,
        multipliers=True,
    )

# AI21's Jamba (Mamba-1 with weighted dt/B/C norms + attention without positions, SwiGLU MLPs and a
# periodic, not renormalised MoE with dense layers among its sparse ones: mnemo/hf/jamba.py)

register_architecture(
    "JambaForCausalLM",
    model_type="jamba",
    import_fn=import_jamba,
    export_fn=export_jamba,
    mixers={"mamba", "attention"},
    mlp_only_layers=True,
)

# DeepSeek-V3 (multi-head latent attention, dense first layers, sigmoid-routed MoE: mnemo/hf/deepseek.py;
# also under Kimi K2's model_type) and DeepSeek-V2 (the same with a softmax router), which carry MLA's
# softmax_scale (YaRN's mscale_all_dim²) themselves and keep the router in float32 on export

register_architecture(
    "DeepseekV3ForCausalLM",
    model_type="deepseek_v3",
    import_fn=import_deepseek_v3,
    export_fn=export_deepseek_v3,
    mixers={"mla"},
    mlp_only_layers=True,
    softmax_scale={"mla"},
    other_model_types=DEEPSEEK_V3_TYPES[1:],
    keep_float32=DEEPSEEK_FLOAT32,
)
register_architecture(
    "DeepseekV2ForCausalLM",
    model_type="deepseek_v2",
    import_fn=import_deepseek_v2,
    export_fn=export_deepseek_v2,
    mixers={"mla"},
    mlp_only_layers=True,
    softmax_scale={"mla"},
    keep_float32=DEEPSEEK_FLOAT32,
)

# Moonshot's Kimi Linear (KDA + MLA without positions, DeepSeek-V3's MoE with dense layers anywhere:
# mnemo/hf/kimi_linear.py), which keeps its routers and KDA's dt_bias in float32 on export

register_architecture(
    "KimiLinearForCausalLM",
    model_type="kimi_linear",
    import_fn=import_kimi_linear,
    export_fn=export_kimi_linear,
    mixers={"kda", "mla"},
    mlp_only_layers=True,
    keep_float32=KIMI_LINEAR_FLOAT32,
)

# flash-linear-attention's released models (fla-hub): GLA, RetNet, DeltaNet, Gated DeltaNet, import only
# (mnemo/hf/fla_hub.py)

for _name, _model_type, _import_fn in FLA_FORMATS:
    register_architecture(_name, model_type=_model_type, import_fn=_import_fn)


def _load_foreign(directory: Path) -> tuple[ModelConfig, dict[str, Tensor]] | None:
    """The loader :meth:`LanguageModel.from_pretrained` calls (:mod:`mnemo.models.formats`)."""
    if not is_foreign_checkpoint(directory):
        return None
    config, weights, _ = import_hf(directory)
    return config, weights


register_foreign_loader(_load_foreign)
