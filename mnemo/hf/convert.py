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
the checkpoint's dtype; :func:`convert` stores a float32 model (what ``LanguageModel`` builds).

The Mamba formats live in :mod:`mnemo.hf.mamba`, Qwen3-Next in :mod:`mnemo.hf.qwen3_next`; this
module holds the registry, the folders and the checks every format shares.

Decoding caches: ``transformers`` keeps the last ``W`` convolution inputs per layer, mnemo the last
``W − 1`` (the oldest one never reaches an output); Mamba-2's ssm state is ``[B, H, P, N]`` there
and ``[B, H, N, P]`` here. :func:`layer_states_from_hf` and :func:`layer_states_to_hf` convert a
cache's per-layer ``(conv_state, ssm_state)`` pairs to mnemo's per-layer states and back.
"""

from __future__ import annotations

import json
import math
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..data.tokenizer import MNEMO_TOKENIZER_NAME
from ..models.config import ModelConfig
from ..models.formats import register_foreign_loader
from .mamba import (  # noqa: F401  (the decoding-cache converters are part of this module's API)
    MAMBA2_KEYS,
    MAMBA_KEYS,
    _is_mamba_ssm,
    export_mamba,
    export_mamba2,
    hf_cache_from_layer_states,
    import_mamba,
    import_mamba2,
    import_mamba_ssm,
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
)
#: the ``model_type`` of mnemo's own config.json (a config without one is mnemo's too)
MNEMO_MODEL_TYPE = "mnemo"


@dataclass(frozen=True)
class Architecture:
    """One foreign checkpoint format: how to recognise it and how to convert it.

    ``import_fn(hf_config, weights) -> (ModelConfig, state_dict)``;
    ``export_fn(config, state_dict) -> (hf_config, weights)`` (``None``: import only);
    ``mixers``: the mnemo mixer names an export can express (used to pick the exporter);
    ``detect(config) -> bool`` recognises a config without ``architectures`` / ``model_type``."""

    name: str
    model_type: str | None
    import_fn: ImportFn
    export_fn: ExportFn | None
    mixers: frozenset[str]
    detect: Callable[[dict], bool] | None


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
) -> Architecture:
    """Register (or replace) a checkpoint format under ``name`` (a ``transformers`` class name
    such as ``"MambaForCausalLM"``, or a layout's name). Returns the entry."""
    arch = Architecture(name, model_type, import_fn, export_fn, frozenset(mixers), detect)
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
    a foreign one that is not registered."""
    if not isinstance(hf_config, dict):
        raise ValueError(f"config: expected a JSON object, got {type(hf_config).__name__}")
    model_type = hf_config.get("model_type")
    if model_type == MNEMO_MODEL_TYPE:
        return None
    names = hf_config.get("architectures") or []
    for n in names:
        if n in ARCHITECTURES:
            a = ARCHITECTURES[n]
            if model_type is not None and a.model_type is not None and model_type != a.model_type:
                raise ValueError(
                    f"config: architectures names {n} (model_type {a.model_type!r}) but model_type is "
                    f"{model_type!r}: the config contradicts itself; fix one of the two"
                )
            return a
    if model_type is not None:
        for a in ARCHITECTURES.values():
            if a.model_type == model_type:
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
        cfg = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
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
            weight_map = json.loads((d / index).read_text()).get("weight_map", {})
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


def import_hf(src: str | Path) -> tuple[ModelConfig, dict[str, Tensor], list[Path]]:
    """Read the foreign checkpoint folder ``src``: returns ``(config, state_dict, tokenizer_files)``
    where ``state_dict`` loads into ``LanguageModel(config)`` with ``strict=True`` and
    ``tokenizer_files`` are the tokenizer files present in ``src``.

    Raises ``FileNotFoundError`` (no config / weights) or ``ValueError`` naming an unsupported
    architecture or option."""
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
        hf_config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"corrupt config {cfg_path}: {e}") from e
    arch = find_architecture(hf_config)
    if arch is None:
        raise ValueError(
            f"{cfg_path} is not a foreign checkpoint config (it looks like mnemo's own); "
            f"supported: {_supported()}"
        )
    _check_fields(cfg_path, hf_config)
    weights = load_weights(d)
    try:
        config, state = arch.import_fn(hf_config, weights)
    except KeyError as e:
        raise ValueError(f"{cfg_path}: the {arch.name} config has no field {e.args[0]!r}") from None
    except TypeError as e:  # a field of the wrong kind met by int()/float()
        raise ValueError(f"{cfg_path}: a field of the {arch.name} config has the wrong kind: {e}") from None
    _check_state(config, state, arch.name)
    names = (*TOKENIZER_FILES, MNEMO_TOKENIZER_NAME)  # the last: mnemo's own, as `export_hf` names it
    return config, state, [d / n for n in names if (d / n).is_file()]


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
_BOOL_FIELDS = ("tie_word_embeddings", "rms_norm", "residual_in_fp32", "use_bias", "use_conv_bias")


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


def _prepare_out(out: str | Path, force: bool) -> Path:
    o = Path(out)
    if o.exists() and not o.is_dir():
        raise ValueError(f"output {o} exists and is not a folder")
    if (o / "latest").is_file():  # files at a run's root would hide its checkpoints
        raise ValueError(
            f"OUT: {o} is a training run folder; --force does not write into one: pick another folder"
        )
    if o.is_dir() and any(o.iterdir()) and not force:
        raise ValueError(f"output folder {o} is not empty (use --force / force=True to write into it)")
    o.mkdir(parents=True, exist_ok=True)
    return o


def convert(src: str | Path, out: str | Path, *, force: bool = False) -> Path:
    """Convert the foreign checkpoint ``src`` into a mnemo checkpoint folder ``out``
    (``config.json``, ``model.safetensors`` and the tokenizer files found in ``src``). Refuses a
    non-empty ``out`` unless ``force``. Returns ``out``."""
    from ..models.lm import LanguageModel

    check_not_source(out, src)
    config, state, tok = import_hf(src)
    o = _prepare_out(out, force)
    model = LanguageModel(config)
    model.load_state_dict(state, strict=True)
    model.save_pretrained(o)
    names = {f.name for f in tok}
    for f in tok:
        # mnemo's own char/byte tokenizer, renamed on export, gets its checkpoint name back
        # unless a Hugging Face tokenizer.json came with it
        back = f.name == MNEMO_TOKENIZER_NAME and "tokenizer.json" not in names
        shutil.copy2(f, o / ("tokenizer.json" if back else f.name))
    if not tok:
        _warn_no_tokenizer(src, o)
    return o


def _warn_no_tokenizer(src, out: Path) -> None:
    """``src`` held no tokenizer file, so ``out`` has none: said, since text commands need one."""
    warnings.warn(
        f"{src} holds no tokenizer ({', '.join((*TOKENIZER_FILES, MNEMO_TOKENIZER_NAME))}), so {out} has "
        "none: `mnemo generate` and `mnemo eval` on text need one (copy it in as tokenizer.json)",
        stacklevel=3,
    )


def export_hf(ckpt, out: str | Path, *, force: bool = False) -> Path:
    """Write the mnemo model ``ckpt`` (a checkpoint folder or a ``LanguageModel``) as a folder that
    ``transformers`` loads with its own class (``config.json`` with ``architectures``,
    ``model.safetensors`` in the model's dtype, the tokenizer files of a ``ckpt`` folder).

    Raises ``ValueError`` naming what the target class cannot express. Returns ``out``."""
    from safetensors.torch import save_file

    from ..models.lm import LanguageModel

    if isinstance(ckpt, LanguageModel):
        model, src = ckpt, None
    else:
        from ..train import resolve_checkpoint

        src = resolve_checkpoint(ckpt)  # a run folder means its latest intact checkpoint
        check_not_source(out, ckpt, src)
        model = LanguageModel.from_pretrained(src)
    config = model.config
    arch = _exporter(config)
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    try:
        hf_config, hf_weights = arch.export_fn(config, weights)
    except ValueError as e:
        mixers = sorted(set(config.layer_mixers()))
        raise ValueError(
            f"a model of mixers {mixers} exports only as {arch.name} here, which cannot express it: {e}"
        ) from None
    hf_config = {"architectures": [arch.name], **hf_config}
    if "model_type" not in hf_config and arch.model_type:
        hf_config["model_type"] = arch.model_type
    dtype = next(iter(hf_weights.values())).dtype
    hf_config.setdefault("dtype", str(dtype).removeprefix("torch."))
    o = _prepare_out(out, force)
    (o / "config.json").write_text(json.dumps(hf_config, indent=2))
    save_file(
        {k: v.contiguous().clone() for k, v in hf_weights.items()},
        str(o / "model.safetensors"),
        {"format": "pt"},
    )
    if src is not None:
        for n in TOKENIZER_FILES:
            if (src / n).is_file():
                if n == "tokenizer.json" and _is_mnemo_tokenizer(src / n):
                    # mnemo's char/byte format is not a Hugging Face tokenizer: keep it under
                    # another name so transformers' AutoTokenizer does not misread it
                    shutil.copy2(src / n, o / MNEMO_TOKENIZER_NAME)
                    warnings.warn(
                        f"{src / n} is mnemo's own char/byte tokenizer, which transformers cannot load; "
                        f"written as {o / MNEMO_TOKENIZER_NAME} (mnemo.data.load_tokenizer and "
                        "`mnemo convert` read it)",
                        stacklevel=2,
                    )
                    continue
                shutil.copy2(src / n, o / n)
        if (src / MNEMO_TOKENIZER_NAME).is_file() and not (src / "tokenizer.json").is_file():
            shutil.copy2(src / MNEMO_TOKENIZER_NAME, o / MNEMO_TOKENIZER_NAME)  # an export exported again
        if not any((o / n).is_file() for n in (*TOKENIZER_FILES, MNEMO_TOKENIZER_NAME)):
            _warn_no_tokenizer(src, o)
        eos = _eos_token_id(src)
        if eos is not None and "eos_token_id" not in hf_config:
            hf_config["eos_token_id"] = eos
            (o / "config.json").write_text(json.dumps(hf_config, indent=2))
    return o


def _is_mnemo_tokenizer(path: Path) -> bool:
    try:
        return "kind" in json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError):
        return False


def _eos_token_id(ckpt: Path) -> int | None:
    """The end-of-text id of a checkpoint's Hugging Face tokenizer (``None`` without one)."""
    p = ckpt / "tokenizer.json"
    if not p.is_file() or _is_mnemo_tokenizer(p):
        return None
    from ..data import load_tokenizer

    return getattr(load_tokenizer(ckpt), "eot_id", None)


def _exporter(config: ModelConfig) -> Architecture:
    mixers = set(config.layer_mixers())
    for a in ARCHITECTURES.values():
        if a.export_fn is not None and mixers <= a.mixers:
            return a
    known = "; ".join(f"{a.name}: {sorted(a.mixers)}" for a in ARCHITECTURES.values() if a.export_fn)
    raise ValueError(f"no export format expresses a model of mixers {sorted(mixers)}; exportable: {known}")


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


def _load_foreign(directory: Path) -> tuple[ModelConfig, dict[str, Tensor]] | None:
    """The loader :meth:`LanguageModel.from_pretrained` calls (:mod:`mnemo.models.formats`)."""
    if not is_foreign_checkpoint(directory):
        return None
    config, weights, _ = import_hf(directory)
    return config, weights


register_foreign_loader(_load_foreign)
