"""Measures after a break-it review: each defect found, pinned against an independent computation or a
known answer (spectrum arguments, the QR iteration's burn-in, half-life quantiles of annihilated
directions, the sink score's input, ``mnemo probe``'s ``--tokens`` in tokens)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mnemo.cli import main
from mnemo.interp.lyapunov import LN2, classify, delta_rule_spectrum, half_lives, matrix_spectrum
from mnemo.interp.scores import sink_score
from mnemo.interp.spectrum import memory_spectrum
from mnemo.models import LanguageModel, build_config

F64 = torch.float64


def _tiny(name: str, layers: int = 2) -> LanguageModel:
    torch.manual_seed(0)
    return LanguageModel(build_config(name, d_model=16, n_layers=layers, vocab_size=30)).eval()


# ------------------------------------------------------------------------------------------------
# memory_spectrum's arguments


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"layers": [5]}, "layers"),  # out of range: used to return {} (no layer read, no error)
        ({"layers": [True]}, "layers"),  # a bool: used to read layer 1
        ({"layers": ["0"]}, "layers"),  # a string: used to read nothing
        ({"context": 0}, "context"),  # used to raise ZeroDivisionError
        ({"context": -3.0}, "context"),  # used to classify against a negative band
        ({"method": "foo"}, "method"),  # used to pass silently where no memory is test-time trained
        ({"directions": 0}, "directions"),
    ],
)
def test_memory_spectrum_refuses_bad_arguments_naming_them(kwargs, named):
    m = _tiny("gla")
    ids = torch.randint(0, 30, (1, 9), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=named):
        memory_spectrum(m, ids, **kwargs)


def test_memory_spectrum_reads_the_layers_asked_for_an_int_included():
    m = _tiny("gla")
    ids = torch.randint(0, 30, (2, 9), generator=torch.Generator().manual_seed(0))
    assert list(memory_spectrum(m, ids, layers=1)) == ["1"]
    both = memory_spectrum(m, ids)
    assert memory_spectrum(m, ids, layers=[1])["1"]["exponents"] == both["1"]["exponents"]


def test_directions_below_one_are_refused_for_a_test_time_memory():
    """A test-time memory with ``directions=0`` used to crash in a reshape (no argument named)."""
    m = _tiny("ttt_linear", layers=1)
    ids = torch.randint(0, 30, (1, 9), generator=torch.Generator().manual_seed(0))
    for bad in (0, -1):
        with pytest.raises(ValueError, match="directions"):
            memory_spectrum(m, ids, directions=bad)


# ------------------------------------------------------------------------------------------------
# the QR iteration's burn-in


def test_burn_in_outside_the_steps_is_refused():
    """``burn_in ≥ T`` used to give exponents of 0 (nothing averaged, reported as 'marginal'), and a
    negative one divided the sum by ``T − burn_in > T``."""
    A = torch.diag(torch.tensor([0.5, 0.25], dtype=F64)).expand(5, 2, 2)
    for bad in (5, 6, -2):
        with pytest.raises(ValueError, match="burn_in"):
            matrix_spectrum(A, burn_in=bad)
    # within range, a constant diagonal gives its log entries whatever the burn-in
    got = matrix_spectrum(A, burn_in=4)
    assert got.tolist() == pytest.approx([math.log(0.5), math.log(0.25)])


# ------------------------------------------------------------------------------------------------
# half-life quantiles where a direction is annihilated exactly (λ = −inf)


def test_half_life_quantiles_of_annihilated_directions():
    """The delta rule with ``β = 1`` on a fixed unit key removes that key's direction at once
    (``λ = −inf``, half-life 0) and keeps the other (``λ = 0``, never halves). The quantiles used to
    come out of ``nan`` (``−inf + inf``) as ``p10 = inf`` > ``p90 = 0``."""
    k = torch.zeros(1, 4, 1, 2, dtype=F64)
    k[..., 0] = 1
    lam = delta_rule_spectrum(k, torch.ones(1, 4, 1, dtype=F64))
    assert lam.tolist() == [[0.0, -math.inf]]
    assert half_lives(lam).tolist() == [[math.inf, 0.0]]
    c = classify(lam, context=4.0)
    assert c["irrelevant"] == 0.5 and c["marginal"] == 0.5
    # sorted λ = [−inf, 0]: the 10% quantile lies at −inf's end (half-life 0), the 90% one between
    # them (linear interpolation from −inf: still −inf-like, 0 tokens); ordered either way
    assert c["p10_half_life"] == 0.0
    assert c["p10_half_life"] <= c["median_half_life"] <= c["p90_half_life"]
    # three annihilated directions and one of λ = −1: the lower quantiles are 0 tokens, the 90% one
    # (interpolated from −inf) a finite half-life of about 0
    c = classify(torch.tensor([[-math.inf, -math.inf, -math.inf, -1.0]], dtype=F64), context=4.0)
    assert c["p10_half_life"] == 0.0 and c["median_half_life"] == 0.0
    assert math.isfinite(c["p90_half_life"]) and c["p90_half_life"] >= 0.0
    # finite exponents keep their interpolated quantiles (as before)
    c = classify(-torch.tensor([0.1, 0.2], dtype=F64), context=1000)
    assert c["median_half_life"] == pytest.approx(LN2 / 0.15)


# ------------------------------------------------------------------------------------------------
# the sink score's input


def test_sink_score_refuses_maps_without_a_batch_axis():
    """Maps ``[H, T, T]`` used to be averaged over the heads into one number, silently."""
    maps = torch.zeros(3, 6, 6)
    maps[..., 0] = 1
    with pytest.raises(ValueError, match="maps"):
        sink_score(maps)
    score, uniform = sink_score(maps[None], start=0)
    assert score.tolist() == [1.0, 1.0, 1.0]
    assert uniform == pytest.approx(sum(1 / (t + 1) for t in range(6)) / 6)


# ------------------------------------------------------------------------------------------------
# mnemo probe timescales / spectrum: --tokens counts tokens


class _PairTokenizer:
    """A stand-in for a BPE tokenizer: one token per two characters."""

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([ord(text[i]) % 7 for i in range(0, len(text), 2)], dtype=torch.long)


def test_text_ids_takes_tokens_not_characters():
    from mnemo.commands.probe import _text_ids
    from mnemo.data.tokenizer import ByteTokenizer

    text = "héllo wörld, 日本語 " * 50
    byte = ByteTokenizer()
    ids = _text_ids(byte, text, 40)  # text[:40] holds more than 40 bytes
    assert ids.shape == (1, 40) and torch.equal(ids[0], byte.encode(text)[:40])
    pair = _PairTokenizer()
    ids = _text_ids(pair, text, 40)  # text[:40] holds only 20 tokens
    assert ids.shape == (1, 40) and torch.equal(ids[0], pair.encode(text)[:40])
    # a text shorter than asked gives all of its tokens
    assert _text_ids(pair, "abcdef", 40).shape == (1, 3)


@pytest.fixture(scope="module")
def byte_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("byte_run")
    text = root / "u.txt"
    text.write_text("héllo wörld ünïcödé — 日本語のテキスト\n" * 200, encoding="utf-8")
    out = root / "run"
    args = ["--model", "gla", "--data", str(text), "--tokenizer", "byte", "--out", str(out), "--steps", "2"]
    args += ["--seq-len", "16", "--batch-size", "2", "--eval-interval", "2", "--eval-batches", "1"]
    args += ["--d-model", "16", "--n-layers", "1", "--sample-tokens", "0", "--no-progress"]
    assert main(["train", *args]) == 0
    return out


@pytest.mark.parametrize("command", ["timescales", "spectrum"])
def test_probe_runs_on_the_tokens_asked_for(byte_run, command, tmp_path, capsys):
    """With a byte tokenizer, ``--tokens 40`` used to run on the bytes of 40 characters (69 here)."""
    out = tmp_path / command
    assert main(["probe", command, "--checkpoint", str(byte_run), "--tokens", "40", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["tokens"] == 40
    assert "gives only" not in captured.err


def test_icl_score_refuses_a_skip_that_leaves_nothing_to_score():
    """``skip`` ≥ the number of predictions gave NaN (means of empty spans); named now. Within range
    the score is the late span's mean loss minus the early span's (a hand computation)."""
    from mnemo.interp.scores import icl_score

    m = _tiny("gla", layers=1)
    ids = torch.randint(0, 30, (2, 21), generator=torch.Generator().manual_seed(0))
    for bad in (20, 25, -1, True):
        with pytest.raises(ValueError, match="skip: expected an int in \\[0, 20\\)"):
            icl_score(m, ids, skip=bad)
    with torch.no_grad():
        logits, _ = m(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").mean(0)
        got = icl_score(m, ids, skip=0)
    want = loss[16:20].mean() - loss[1:3].mean()  # late (0.8, 1.0) and early (0.05, 0.15) of 20
    assert got == pytest.approx(float(want), abs=1e-6)
