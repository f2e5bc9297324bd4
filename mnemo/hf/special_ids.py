"""The special token ids a checkpoint declares: the token read before a text (BOS) and the ids that
end one (EOS), shared by ``mnemo generate``, ``mnemo eval`` and the lm-evaluation-harness adapter
(:mod:`mnemo.hf.harness`), so the three read a checkpoint the same way. ``transformers``-free.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..train.batches import bos_id
from ..train.checkpoint import TRAIN_CONFIG_NAME, load_json
from .convert import CARRIED_CONFIG_NAME

__all__ = ["checkpoint_bos", "checkpoint_eos", "is_training_run"]


def is_training_run(ckpt: str | Path) -> bool:
    """Whether a mnemo training run wrote ``ckpt`` (it holds the run's training configuration)."""
    return (Path(ckpt) / TRAIN_CONFIG_NAME).is_file()


def checkpoint_bos(ckpt: str | Path, tokenizer, warn=None) -> int | None:
    """The id read before a text, or ``None``.

    For a checkpoint a mnemo training run made: the id of its ``TrainConfig.bos`` (its windows'
    fixed first token; ``None`` when it trained without one). For any other checkpoint (a
    converted one, a ``transformers`` folder): the BOS the tokenizer's own post-processor puts
    before a text (:meth:`~mnemo.data.tokenizer.HFTokenizer.special_prefix`), as ``transformers``'
    ``tokenizer(text)`` does. A post-processor that puts more than one token first is not followed
    (said through ``warn``, a function of one string; stderr by default). Raises ``ValueError``
    (naming ``TrainConfig.bos``) when the run's BOS text is not one token under ``tokenizer``.
    """
    ckpt = Path(ckpt)
    if is_training_run(ckpt):
        return bos_id(tokenizer, load_json(ckpt / TRAIN_CONFIG_NAME).get("bos"))
    prefix = tokenizer.special_prefix() if hasattr(tokenizer, "special_prefix") else []
    if len(prefix) > 1:
        (warn or _stderr)(
            f"warning: the tokenizer puts {len(prefix)} special tokens {prefix} before a text; the "
            "text is read without them"
        )
    return prefix[0] if len(prefix) == 1 else None


def checkpoint_eos(ckpt: str | Path) -> int | list[int] | None:
    """The end-of-text id(s) a checkpoint that no mnemo training run made declares, as
    ``transformers`` reads them: ``generation_config.json``'s ``eos_token_id`` where that file
    exists (none there: none at all), else the one :func:`mnemo.hf.convert.convert` kept from the
    source (``hf_config_carried.json``), else ``config.json``'s own (a ``transformers`` one, or those
    ``MnemoForCausalLM.save_pretrained`` wrote to mnemo's, as ``AutoConfig`` reads them). ``None`` for
    a mnemo training run or a checkpoint that declares none. Raises ``ValueError`` naming
    ``--checkpoint`` for a file that is not readable JSON."""
    ckpt = Path(ckpt)
    if is_training_run(ckpt):
        return None

    def read(name: str) -> dict:
        path = ckpt / name
        try:
            data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        except (OSError, ValueError) as e:
            raise ValueError(f"--checkpoint: {path} is not a readable JSON file ({e})") from None
        return data if isinstance(data, dict) else {}

    if (ckpt / "generation_config.json").is_file():  # transformers reads the ids from it alone then
        fields = read("generation_config.json")
    else:
        # (a mnemo config.json holds no other id field: those MnemoForCausalLM.save_pretrained
        # wrote, which AutoConfig and MnemoForCausalLM.from_pretrained read, or none)
        config = read("config.json")
        fields = read(CARRIED_CONFIG_NAME).get("fields") or config
    eos = fields.get("eos_token_id")
    return None if eos == [] else eos


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)
