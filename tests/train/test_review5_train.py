"""Fifth break-it review of the training loop: hostile-but-plausible settings.
``checkpoint_interval: true`` (a YAML slip) is refused naming the field, as every other integer
setting refuses a boolean, instead of checkpointing every step; ``init_from`` a text run whose
tokenizer gives its ids to other tokens is refused instead of fine-tuning every embedding row as
another token; ``Trainer.evaluate(lengths=...)`` names ``lengths`` when it refuses one."""

from __future__ import annotations

import pytest
import torch

from mnemo.train import TrainConfig, Trainer
from tests.train.test_review2_training import TINY


@pytest.mark.parametrize("value", [True, False])
def test_checkpoint_interval_refuses_a_boolean_naming_the_field(value):
    """``checkpoint_interval=True`` passed validation (``bool`` is an ``int``) and the run saved a
    checkpoint every step (``step % True == 0``); ``False`` silently meant the default."""
    with pytest.raises(ValueError, match=rf"TrainConfig.checkpoint_interval: expected .*got {value}"):
        TrainConfig.from_dict({**TINY, "checkpoint_interval": value}).validate()


def _text(path, alphabet: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(len(alphabet), (6000,), generator=g)
    path.write_text("".join(alphabet[i] for i in idx.tolist()))
    return str(path)


def test_init_from_a_run_whose_characters_mean_other_ids_is_refused(tmp_path):
    """``init_from`` (fine-tuning on another text) rebuilt the char vocabulary from the new text:
    with as many distinct characters as the first run's but other ones, the weights loaded (same
    shapes) and every embedding row was trained on as another character than it learned, silently.
    The run is refused, naming both settings and the fix (the first run's tokenizer)."""
    first = tmp_path / "first"
    kw = {**TINY, "steps": 2, "eval_interval": 2}
    Trainer(
        TrainConfig.from_dict({**kw, "data": _text(tmp_path / "a.txt", "abcdefgh \n")}),
        first,
        progress=False,
        log=lambda *a: None,
    ).fit()
    other = _text(tmp_path / "b.txt", "zbcdefgh \n")  # 'a' -> 'z': as many characters, other ids
    with pytest.raises(
        ValueError,
        match=r"TrainConfig.init_from: .*another tokenizer.*ids mean other tokens.*tokenizer=.*"
        r"\(mnemo train: --tokenizer ",  # (trial 50h: the flag too, not only the field)
    ):
        Trainer(
            TrainConfig.from_dict({**kw, "data": other, "init_from": str(first)}),
            tmp_path / "second",
            progress=False,
            log=lambda *a: None,
        )
    # with the first run's tokenizer the ids mean what they meant ('z' is <unk> there): it trains
    tok = str(first / "ckpt-000002")
    t = Trainer(
        TrainConfig.from_dict({**kw, "data": other, "init_from": str(first), "tokenizer": tok}),
        tmp_path / "third",
        progress=False,
        log=lambda *a: None,
    )
    assert t.tokenizer.to_dict()["chars"] == sorted(set("abcdefgh \n"))
    # and the same text (the same vocabulary) stays allowed
    Trainer(
        TrainConfig.from_dict({**kw, "data": str(tmp_path / "a.txt"), "init_from": str(first)}),
        tmp_path / "fourth",
        progress=False,
        log=lambda *a: None,
    )


@pytest.mark.parametrize(("lengths", "got"), [([0], "got 0"), ([64, 7], "got 7"), (["x"], "got 'x'")])
def test_evaluate_names_lengths_when_a_length_is_refused(tmp_path, lengths, got):
    """``Trainer.evaluate(lengths=[7])`` on an MQAR run was refused as ``seq_len: ... got 7``: the
    caller gave no ``seq_len`` (the run's is 32 and fine); the message names ``lengths``."""
    kw = {**TINY, "task": "mqar", "seq_len": 32}
    t = Trainer(TrainConfig.from_dict(kw), tmp_path, progress=False, log=lambda *a: None)
    with pytest.raises(ValueError, match=rf"^lengths \(evaluate's .*\): .*{got}"):
        t.evaluate(1, lengths=lengths)
