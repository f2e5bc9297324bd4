"""Regression review 44B: defects found in today's changes (t_quantile's expansion, the CLI's
flush, Corpus.encode's joined tensors)."""

from __future__ import annotations

import sys

import pytest
import torch

from mnemo.data.corpus import Corpus
from mnemo.sweep.stats import t_quantile


@pytest.mark.parametrize(
    "p, df, exact",
    [
        # 40-digit references (mpmath: the regularised incomplete beta solved for t; scipy agrees)
        (0.975, 10_001, 1.9602012161646406916),
        (0.6, 10_001, 0.25335384277175252006),
        (1e-300, 10**6, -37.059820872774391305),
    ],
)
def test_t_quantile_above_10000_takes_the_exact_expansion(p, df, exact):
    # the expansion was taken only where its last term was below 1e-18 of t: at df 10,001 the
    # O(df) series answered instead, 4.3e-13 relative off at 0.975 (3.6e-14 at df 1e6, p 1e-300)
    assert t_quantile(p, df) == pytest.approx(exact, rel=7e-16, abs=0)


def test_cli_main_with_no_stdout_returns_the_commands_status(monkeypatch):
    # pythonw (and a detached service) has sys.stdout None: the new exit flush raised AttributeError
    from mnemo.cli import main

    monkeypatch.setattr(sys, "stdout", None)
    assert main(["models"]) == 0


class _Int32Tokenizer:
    kind, eot_id, vocab_size = "test", None, 256

    def encode(self, text):
        return torch.tensor(list(text.encode("utf-8")), dtype=torch.int32)

    def num_chars(self, text):
        return len(text)


def test_corpus_encode_gives_long_ids_for_a_non_long_tokenizer():
    # the joined tensors kept the tokenizer's int32 (the old path built a long tensor from a list):
    # int32 targets fail in cross_entropy
    ids, starts, chars = Corpus(["hé"]).encode(_Int32Tokenizer())
    assert ids.dtype == torch.long
    assert ids.tolist() == [0x68, 0xC3, 0xA9]  # UTF-8 of "hé"
    assert starts.tolist() == [0] and chars == 2
