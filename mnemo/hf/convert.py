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

Decoding caches: ``transformers`` keeps the last ``W`` convolution inputs per layer, mnemo the last
``W − 1`` (the oldest one never reaches an output); Mamba-2's ssm state is ``[B, H, P, N]`` there
and ``[B, H, N, P]`` here. :func:`layer_states_from_hf` and :func:`layer_states_to_hf` convert a
cache's per-layer ``(conv_state, ssm_state)`` pairs to mnemo's per-layer states and back.
"""

from __future__ import annotations

import inspect
import json
import math
import re
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..data.tokenizer import MNEMO_TOKENIZER_NAME
from ..layers import MIXERS
from ..layers.ssm import Mamba2State, MambaState
from ..layers.state import BlockState
from ..models.config import ModelConfig
from ..models.formats import register_foreign_loader

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
            return ARCHITECTURES[n]
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


def _check_fields(path: Path, hf_config: dict) -> None:
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
    return o


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


def _import_weights(weights: dict[str, Tensor], table, tie: bool, where: str) -> dict[str, Tensor]:
    w = dict(weights)
    if "backbone.embedding.weight" in w:  # the name in mamba-ssm and older transformers files
        w["backbone.embeddings.weight"] = w.pop("backbone.embedding.weight")
    if tie:
        w.pop("lm_head.weight", None)
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


def _d_inner_expand(where: str, hidden: int, expand) -> int:
    d_inner = expand * hidden
    if d_inner != int(d_inner) or int(d_inner) % hidden:
        _refuse(
            where, f"expand = {expand} (d_inner = expand · hidden_size must be a multiple of hidden_size)"
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
            f"{rows} (ids {declared}..{rows - 1} are never produced by the tokenizer)",
            stacklevel=3,
        )
    return rows


def _mamba_options(where, hidden, state_size, expand, conv, rank, bias, conv_bias) -> dict[str, Any]:
    if rank in (None, "auto"):
        rank = math.ceil(hidden / 16)
    return {
        "d_state": int(state_size),
        "expand": _d_inner_expand(where, hidden, expand),
        "conv_size": int(conv),
        "dt_rank": int(rank),
        "bias": bool(bias),
        "conv_bias": bool(conv_bias),
    }


def _mamba2_options(
    where, hidden, state_size, expand, head_dim, n_groups, conv, bias, conv_bias, dt_limit, eps, n_heads=None
) -> dict[str, Any]:
    e = _d_inner_expand(where, hidden, expand)
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
    lo, hi = (_number(v) for v in (dt_limit if dt_limit is not None else (0.0, math.inf)))
    if (lo, hi) != (0.0, math.inf):
        opts["dt_limit"] = [lo, hi]
    return opts


def _number(v) -> float:
    """A float of a config (``transformers`` 5 writes ``inf`` as ``{"__float__": "Infinity"}``)."""
    if isinstance(v, dict) and "__float__" in v:
        v = v["__float__"]
    return float(v)


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


# --- transformers MambaForCausalLM / Mamba2ForCausalLM ------------------------------------------


def import_mamba(hf_config: dict, weights: dict[str, Tensor]) -> tuple[ModelConfig, dict[str, Tensor]]:
    """``transformers`` ``MambaForCausalLM`` → mnemo layers ``mamba`` (no MLP, tied head by
    ``tie_word_embeddings``, default true)."""
    where, c = "MambaForCausalLM", hf_config
    _check_act(where, c.get("hidden_act", "silu"))
    hidden = int(c["hidden_size"])
    opts = _mamba_options(
        where,
        hidden,
        c.get("state_size", 16),
        c.get("expand", 2),
        c.get("conv_kernel", 4),
        c.get("time_step_rank", "auto"),
        c.get("use_bias", False),
        c.get("use_conv_bias", True),
    )
    tie = c.get("tie_word_embeddings", True)
    config = _model_config(
        _vocab(where, weights, c.get("vocab_size")),
        hidden,
        c["num_hidden_layers"],
        "mamba",
        opts,
        tie,
        c.get("layer_norm_epsilon", 1e-5),
    )
    return config, _import_weights(weights, MAMBA_KEYS, tie, where)


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
    return config, _import_weights(weights, MAMBA2_KEYS, tie, where)


def _single_mixer(config: ModelConfig, name: str, where: str) -> dict[str, Any]:
    """The options of ``name`` (defaults filled in) after checking that ``config`` is a plain stack
    of ``name`` layers that ``where`` can express."""
    mixers = sorted(set(config.layer_mixers()))
    if mixers != [name]:
        _refuse(where, f"layers {mixers} (only {name!r} layers)")
    if config.mlp != "none":
        _refuse(where, f"mlp = {config.mlp!r} (Mamba blocks have no MLP; use mlp = 'none')")
    if config.pos_embedding != "none":
        _refuse(where, f"pos_embedding = {config.pos_embedding!r} (no learned positions)")
    opts = {**_defaults(name), **config.mixer_options.get(name, {})}
    return opts


def export_mamba(config: ModelConfig, weights: dict[str, Tensor]) -> tuple[dict, dict[str, Tensor]]:
    """mnemo ``mamba`` layers → ``transformers`` ``MambaForCausalLM``."""
    where = "export to MambaForCausalLM"
    o = _single_mixer(config, "mamba", where)
    if not o["selective"]:
        _refuse(where, "selective = False (a non-selective, LTI Mamba)")
    d = config.d_model
    hf = {
        "model_type": "mamba",
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
    ssm = dict(cfg.get("ssm_cfg") or {})
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
        )
        mixer, table = "mamba", MAMBA_KEYS
    else:
        if not ssm.get("rmsnorm", True):
            _refuse(where, "ssm_cfg.rmsnorm = false (a Mamba2 layer without its gated norm)")
        e = _d_inner_expand(where, hidden, ssm.get("expand", 2))
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
        )
        if ssm.get("D_has_hdim"):
            opts["D_has_hdim"] = True
        if ssm.get("norm_before_gate"):
            opts["norm_before_gate"] = True
        mixer, table = "mamba2", MAMBA2_KEYS
    config = _model_config(vocab, hidden, cfg["n_layer"], mixer, opts, tie, MAMBA_SSM_EPS)
    return config, _import_weights(weights, table, tie, where)


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
from .qwen3_next import export_qwen3_next, import_qwen3_next  # noqa: E402

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
