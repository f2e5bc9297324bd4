"""Break-it review as a new user following the README and the guides: each test is a defect found by
the review, failing before its fix."""

from __future__ import annotations

import io
import json
import random
import sys

import pytest

from mnemo.cli import main
from mnemo.train import TrainConfig
from tests.helpers import fast_train_flags

TEXT_FAST = fast_train_flags(seq_len=16, batch_size=2, sample_tokens=None)


def _help(argv: list[str], capsys) -> str:
    assert main(argv) == 0
    return " ".join(capsys.readouterr().out.split())


def test_sample_tokens_are_tokens_not_characters(tmp_path, capsys):
    """``mnemo train --help`` said ``--sample-tokens`` counts characters, but the end-of-training
    sample decodes that many tokens (``generate_text(..., cfg.sample_tokens)``): with a byte or
    subword tokenizer a token is not a character. A byte-tokenizer run on text of two-byte characters
    shows it: 6 sampled tokens are 6 bytes, never 6 characters of that text."""
    text = _help(["train", "--help"], capsys)
    assert "--sample-tokens N tokens to sample at the end" in text
    assert "characters to sample" not in text
    with pytest.raises(ValueError, match=r"sample_tokens.*tokens sampled at the end"):
        TrainConfig(sample_tokens=100_001).validate()
    data = tmp_path / "greek.txt"
    rng = random.Random(0)
    data.write_text("".join(rng.choice("αβγδ ") for _ in range(3000)), encoding="utf-8")
    out = tmp_path / "run"
    argv = ["train", "--data", str(data), "--tokenizer", "byte", "--out", str(out), *TEXT_FAST]
    assert main([*argv, "--sample-tokens", "6"]) == 0
    printed = capsys.readouterr().out
    sample = printed.split("--- sample ---\n", 1)[1].split("\n-----", 1)[0]
    assert sample.startswith("ROMEO:")
    # the 6 new tokens are 6 bytes: decoded, at most 6 characters (invalid bytes become U+FFFD)
    assert len(sample) - len("ROMEO:") <= 6


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_eval_of_a_whole_split_shows_progress_on_a_terminal(tmp_path, capsys, monkeypatch):
    """``mnemo eval --max-batches all`` (the README's whole-split evaluation) read for half a minute
    on the README's default model and the bundled split, minutes with ``--full``, without a sign
    of life; it now draws a bar of batches on a terminal (stderr), and stdout stays one JSON line."""
    data = tmp_path / "corpus.txt"
    rng = random.Random(1)
    data.write_text("".join(rng.choice("abcdefgh \n") for _ in range(4000)))
    out = tmp_path / "run"
    assert main(["train", "--data", str(data), "--out", str(out), "--sample-tokens", "0", *TEXT_FAST]) == 0
    capsys.readouterr()
    err = _Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    assert main(["eval", "--checkpoint", str(out), "--max-batches", "3", "--batch-size", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["sequences"] == 6
    # (the bar's first drawing always shows its total; later ones are throttled by time)
    assert "eval:" in err.getvalue() and "0/3 " in err.getvalue()
    # the whole split: ceil(windows / batch) batches in the bar
    err.seek(0)
    err.truncate()
    assert main(["eval", "--checkpoint", str(out), "--max-batches", "all", "--batch-size", "4"]) == 0
    record = json.loads(capsys.readouterr().out)
    batches = -(-record["sequences"] // 4)
    assert f"0/{batches} " in err.getvalue()


def test_generate_help_states_the_defaults_it_samples_with(capsys):
    """``mnemo generate --help`` gave ``--temperature`` as "0 = greedy" with no default, and
    ``--seed`` / ``--device`` with no text at all: a new user could not tell that a plain
    ``mnemo generate`` samples at temperature 0.8 from seed 0. Each stated default is the parser's."""
    text = _help(["generate", "--help"], capsys)
    assert "--temperature TEMPERATURE sampling temperature, 0 = greedy (default 0.8)" in text
    assert "--seed SEED seeds the sampling (default 0)" in text
    assert "--device DEVICE cpu or cuda[:N] (default cpu)" in text
    assert "--device DEVICE cpu or cuda[:N] (default cpu)" in _help(["eval", "--help"], capsys)
    from mnemo.argtypes import Parser
    from mnemo.commands import evaluate

    parser = Parser(prog="mnemo")
    evaluate.add_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["generate", "--checkpoint", "."])
    assert (args.temperature, args.seed, args.device) == (0.8, 0, "cpu")
